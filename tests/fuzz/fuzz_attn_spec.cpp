// libFuzzer harness for `--attn` specs (src/attention/pattern/presets.*): "vs:v=1000,s=6096",
// "trianglemix:start=16,inner=vs", ... turned into a policy by policy_from_spec.
//
// The input is the spec text, applied to two model shapes (2 layers x 4 query heads / 2 KV heads, and 32 x 32
// / 8). Specs that could name a file (a '/' in them, or the name of something in the working directory) are
// skipped: a spec that is not a preset is read as a policy file, which fuzz_policy_file covers, and the
// fuzzer must not read the machine's files. A tessera::Error is the expected outcome for bad input; anything
// else is a finding.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "attention/pattern/presets.h"
#include "core/error.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  if (spec.find('/') != std::string::npos || spec.find('\0') != std::string::npos) return 0;
  std::error_code ec;
  if (std::filesystem::exists(spec, ec)) return 0;
  // The last shape has sliding-window layers (Gemma-3-like): presets leave them dense.
  for (const attn::PolicyShape& shape :
       {attn::PolicyShape{2, 4, 2}, attn::PolicyShape{32, 32, 8}, attn::PolicyShape{4, 4, 1, {0, 512, 512, 0}}}) {
    try {
      (void)attn::policy_from_spec(spec, shape);
    } catch (const Error&) {
      // expected for malformed input
    }
  }
  return 0;
}
