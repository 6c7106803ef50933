// libFuzzer harness for Hugging Face model directories: config.json, model.safetensors.index.json, the
// safetensors shards and tokenizer.json / tokenizer_config.json, read the way `tessera run <dir>` reads them.
//
// One input holds the directory's files as "#file:<name>" sections (tests/fuzz/fuzz_common.h); bytes before
// the first marker are config.json. The files are written to a scratch directory, then ModelFile::open()
// reads the directory, load_model_config() turns config.json into a ModelConfig, and when a tokenizer.json is
// there the tokenizer is loaded and encodes/decodes a few texts. A tessera::Error is the expected outcome for
// bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "model/model_file.h"
#include "model/tokenizer/tokenizer.h"
#include "model/model_config.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::ScratchDir dir;
  dir.clear();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const auto files = fuzz::split_files(
      input, "config.json",
      {"config.json", "model.safetensors.index.json", "model.safetensors", "model-00001-of-00002.safetensors",
       "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json"});
  for (const auto& [name, bytes] : files) dir.write(name, bytes);
  try {
    const auto file = model::ModelFile::open(dir.path().string());
    (void)runtime::load_model_config(*file);
  } catch (const Error&) {
    // expected for malformed input
  }
  try {
    if (files.count("tokenizer.json") != 0) {
      const auto tok = model::Tokenizer::from_hf_file(dir.file("tokenizer.json"));
      for (std::string_view text : fuzz::kSampleTexts) {
        const std::vector<int32_t> ids = tok->encode(text, {.add_special = true, .parse_special = true});
        (void)tok->decode(ids);
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
