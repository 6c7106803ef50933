// libFuzzer harness for the model-file parsers (GGUF and safetensors) and the dequantizers behind them.
//
// Inputs starting with "GGUF" go to the GGUF reader, everything else to the safetensors parser. Every tensor
// of a file that parses is dequantized in full, so a wrong size or offset check shows up as an out-of-bounds
// read under AddressSanitizer. A tessera::Error is the expected outcome for bad input; anything else (a
// crash, a sanitizer report, another exception type, a leak, a huge allocation) is a finding.
//
// Built with the other harnesses by the `fuzz` CMake preset (TESSERA_FUZZ=ON, clang); scripts/fuzz.sh runs
// them.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "model/gguf.h"
#include "model/mapped_file.h"
#include "model/model_file.h"
#include "model/quant.h"
#include "model/safetensors.h"

using namespace tessera::model;

namespace {

void dequantize_all(const std::vector<TensorInfo>& tensors) {
  std::vector<float> out;
  for (const TensorInfo& t : tensors) {
    out.resize(static_cast<size_t>(t.numel()));
    dequantize(t, out.data());
    if (t.rows() > 0) dequantize_rows(t, t.rows() - 1, 1, out.data());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = MappedFile::from_bytes("fuzz.bin", data, size);
    if (size >= 4 && std::memcmp(data, "GGUF", 4) == 0) {
      ModelFile m(read_gguf(file));
      dequantize_all(m.tensors());
      (void)m.metadata().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
      dequantize_all(parse_safetensors(*file));
    }
  } catch (const tessera::Error&) {
    // expected for malformed input
  }
  return 0;
}
