// libFuzzer harness for GGUF tokenizers and chat formats: the tokenizer.ggml.* and tokenizer.chat_template
// metadata keys, read by Tokenizer::from_gguf and ChatTemplate::from_gguf, then used.
//
// The input is the metadata as JSON text (how ModelFile::metadata() holds it), so that mutations reach the
// tokenizer instead of breaking the GGUF framing (fuzz_model_file fuzzes that). Only documents a GGUF file
// could produce are used: an object whose values are numbers, bools, strings and arrays of them, '~' in
// strings standing for the byte 0xFF (fuzz_common.h). A tokenizer that loads encodes the fixed samples with
// and without special tokens, decodes them, streams them and renders the first ids of the vocabulary; a chat
// format that is recognised formats a few conversations. A tessera::Error is the expected outcome for bad
// input; anything else is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/tokenizer.h"

using namespace tessera;
using nlohmann::json;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  json md = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (md.is_discarded() || !fuzz::gguf_metadata(md)) return 0;
  try {
    const auto tok = model::Tokenizer::from_gguf(md);
    for (std::string_view text : fuzz::kSampleTexts) {
      for (const bool special : {false, true}) {
        const std::vector<int32_t> ids =
            tok->encode(text, {.add_special = special, .parse_special = special});
        (void)tok->decode(ids);
        (void)tok->decode(ids, {.skip_special = true});
        model::StreamingDecoder stream(*tok);
        for (int32_t id : ids) (void)stream.push(id);
        (void)stream.flush();
      }
    }
    const int32_t n = std::min<int32_t>(tok->vocab_size(), 1024);
    for (int32_t id = 0; id < n; ++id) (void)tok->token_to_piece(id);
  } catch (const Error&) {
    // expected for malformed input
  }
  try {
    const model::ChatTemplate chat = model::ChatTemplate::from_gguf(md);
    const std::vector<model::ChatMessage> conversation = {
        {"system", " Be brief. "}, {"user", "Hi \xC2\xA0"}, {"assistant", "Hello"}, {"user", "\xE2\x80\x83"}};
    (void)chat.apply(conversation, true);
    (void)chat.apply(std::span(conversation).subspan(1), false);
  } catch (const Error&) {
  }
  return 0;
}
