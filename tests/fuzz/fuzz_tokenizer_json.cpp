// libFuzzer harness for Hugging Face tokenizers: tokenizer.json (+ tokenizer_config.json) loaded with
// Tokenizer::from_hf_file, then used.
//
// Input: "#file:" sections (tests/fuzz/fuzz_common.h); bytes before the first marker are tokenizer.json, a
// "#file:tokenizer_config.json" section is written beside it, and a "#file:text" section is extra text to
// encode. A tokenizer that loads encodes that text and the fixed samples (with and without special tokens),
// decodes the ids, streams them through StreamingDecoder, and renders the first ids of the vocabulary one by
// one. A tessera::Error is the expected outcome for bad input; anything else is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "model/tokenizer/tokenizer.h"

using namespace tessera;

namespace {

void exercise(const model::Tokenizer& tok, std::string_view text) {
  for (const bool special : {false, true}) {
    const std::vector<int32_t> ids = tok.encode(text, {.add_special = special, .parse_special = special});
    (void)tok.decode(ids);
    (void)tok.decode(ids, {.skip_special = true});
    model::StreamingDecoder stream(tok);
    for (int32_t id : ids) (void)stream.push(id);
    (void)stream.flush();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::ScratchDir dir;
  dir.clear();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const auto files =
      fuzz::split_files(input, "tokenizer.json", {"tokenizer.json", "tokenizer_config.json", "text"});
  for (const auto& [name, bytes] : files)
    if (name != "text") dir.write(name, bytes);
  try {
    const auto tok = model::Tokenizer::from_hf_file(dir.file("tokenizer.json"));
    for (std::string_view text : fuzz::kSampleTexts) exercise(*tok, text);
    if (const auto it = files.find("text"); it != files.end()) exercise(*tok, it->second);
    const int32_t n = std::min<int32_t>(tok->vocab_size(), 1024);
    std::vector<int32_t> all;
    for (int32_t id = 0; id < n; ++id) {
      (void)tok->token_to_piece(id);
      (void)tok->is_special(id);
      all.push_back(id);
    }
    (void)tok->decode(all);
  } catch (const Error&) {
    // expected for malformed input
  }
  return 0;
}
