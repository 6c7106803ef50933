// tessera/model/tokenizer/byte_level.h — GPT-2's byte-to-unicode alphabet.
//
// Byte-level BPE vocabularies spell every byte as one printable character: bytes 0x21..0x7E, 0xA1..0xAC and
// 0xAE..0xFF stand for themselves (as code points), the other 68 bytes map in order to U+0100.. (so a space
// is "Ġ" U+0120 and a newline "Ċ" U+010A). Tokens are written in that alphabet; decoding maps them back to
// bytes.
#pragma once

#include <string>
#include <string_view>

namespace tessera::model::byte_level {

char32_t byte_to_char(unsigned char b);
// The byte a character of the alphabet stands for, or -1 for a character outside it.
int char_to_byte(char32_t c);

// Raw bytes -> their spelling in the alphabet (UTF-8).
std::string spell(std::string_view bytes);
// Spelling -> raw bytes. Characters outside the alphabet are kept as they are (their UTF-8 bytes), so added
// tokens spelled in plain text survive.
std::string unspell(std::string_view spelled);
// True when every character of `s` belongs to the alphabet.
bool is_spelled(std::string_view s);

}  // namespace tessera::model::byte_level
