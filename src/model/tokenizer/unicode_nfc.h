// tessera/model/tokenizer/unicode_nfc.h — Unicode NFC (the normalizer of Qwen2's tokenizer.json).
#pragma once

#include <string>
#include <string_view>

namespace tessera::model::unicode {

// Canonical composition of `text` (UTF-8). Invalid bytes are kept as they are and act as starters.
std::string nfc(std::string_view text);

}  // namespace tessera::model::unicode
