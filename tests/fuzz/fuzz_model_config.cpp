// libFuzzer harness for the model configuration readers (src/runtime/model_config.*): a Hugging Face
// config.json, and GGUF metadata, to a ModelConfig.
//
// The input is JSON text. As config.json it goes to load_model_config() of a safetensors model; when it is an
// object whose values a GGUF file could hold (numbers, bools, strings and arrays of them: no null, no nested
// objects), it also goes in as the metadata of a GGUF model with no tensors, every '~' in its strings turned
// into the byte 0xFF (GGUF strings need not be UTF-8: fuzz_common.h). Parsing the JSON text itself is fuzzed
// by fuzz_hf_directory. A tessera::Error is the expected outcome for bad input; anything else (another
// exception type, a crash, a sanitizer report, a huge allocation) is a finding.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "fuzz_common.h"
#include "model/model_file.h"
#include "model/model_config.h"

using namespace tessera;
using nlohmann::json;

namespace {

void load(model::FileFormat format, const char* path, const json& metadata) {
  model::ModelFile::Contents c;
  c.format = format;
  c.path = path;
  c.metadata = metadata;
  const model::ModelFile file(std::move(c));
  try {
    (void)runtime::load_model_config(file);
  } catch (const Error&) {
    // expected for malformed input
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const json j = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  load(model::FileFormat::Safetensors, "fuzz/config.json", j);
  json md = j;
  if (fuzz::gguf_metadata(md)) load(model::FileFormat::GGUF, "fuzz.gguf", md);
  return 0;
}
