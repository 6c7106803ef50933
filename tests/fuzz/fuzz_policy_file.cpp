// libFuzzer harness for attention policy files (src/attention/pattern/config_io.*): tessera's JSON format,
// MInference per-head configs and MoA alpha/beta plans, read with load_policy_file.
//
// The input is the file's bytes. It is loaded twice: without a model shape (as `tessera policy inspect` and
// the converters do) and against a small model shape (2 layers, 4 query heads, 2 KV heads, as `--attn <file>`
// does for a model). A policy that loads is summarised, written back in tessera's format (which must load
// again to an equal policy: a mismatch aborts, so it is a finding) and exported to the MInference and MoA
// formats. A tessera::Error is the expected outcome for bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "fuzz_common.h"

using namespace tessera;

namespace {

void use(const attn::AttentionPolicy& policy) {
  (void)attn::summarize_policy(policy);
  const nlohmann::json saved = attn::save_policy_json(policy);
  (void)attn::format_policy_json(saved);
  if (!(attn::load_policy_json(saved, "round trip") == policy)) std::abort();  // save/load must round-trip
  try {
    (void)attn::export_minference(policy);
  } catch (const Error&) {
    // a pattern MInference's format cannot express
  }
  try {
    (void)attn::export_moa(policy);
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::ScratchDir dir;
  const std::string path =
      dir.write("policy.json", std::string_view(reinterpret_cast<const char*>(data), size));
  for (const std::optional<attn::PolicyShape>& shape :
       {std::optional<attn::PolicyShape>(), std::optional<attn::PolicyShape>(attn::PolicyShape{2, 4, 2})}) {
    try {
      use(attn::load_policy_file(path, shape));
    } catch (const Error&) {
      // expected for malformed input
    }
  }
  return 0;
}
