// tessera/attention/pattern/config_io.h — policy files: tessera's own JSON format, MInference per-head
// configs and MoA alpha/beta plans, read and written. The formats are documented in docs/policy-format.md.
//
// Errors: every malformed input throws tessera::Error whose message starts with the source name (the file
// path, or the name the caller gave) and names the layer, head and field at fault, e.g.
//   "llama.json: layer 3, head 17: field 'vertical_size' must be >= 0, got -5".
// Writers throw tessera::Error when the policy holds a pattern the target format cannot express exactly.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attention/pattern/policy.h"

namespace tessera::attn {

// The attention shape of a model: what a policy must match to run on it.
struct PolicyShape {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  // The model's sliding window per layer (0 or absent: a global layer). A preset (policy_from_spec) leaves a layer
  // with a window as the model defines it — dense within its window — instead of putting its pattern there too:
  // Gemma-3's 512-token local layers are already sparse, and a preset's pattern on them drops part of the window
  // the model was trained with. Policy files keep every layer's pattern as written. Not part of the comparison.
  std::vector<int32_t> sliding_windows = {};
  bool operator==(const PolicyShape& o) const {
    return num_layers == o.num_layers && num_q_heads == o.num_q_heads && num_kv_heads == o.num_kv_heads;
  }
};

PolicyShape shape_of(const AttentionPolicy& policy);

enum class PolicyFormat {
  tessera,     // {"tessera_policy": 1, ...}
  minference,  // [ {"0": ["vertical_and_slash", v, s, score], ...} per layer ]
  moa,         // {"alphas": [[...]], "betas": [[...]]}
};

// "tessera", "minference", "moa".
std::string_view format_name(PolicyFormat format);

// Recognises the format of a parsed file: an object with "tessera_policy" is tessera, an array is MInference,
// an object with "alphas" or "betas" is MoA. Throws Error("<source>: not a policy file: ...") otherwise.
PolicyFormat detect_policy_format(const nlohmann::json& j, const std::string& source);

// Limits on what a policy file may ask for, checked before anything is read or allocated: the file's size
// (published per-head configs are a few hundred kB) and, for the tessera format, layers x query heads.
inline constexpr uintmax_t kMaxPolicyFileBytes = uintmax_t{64} << 20;
inline constexpr size_t kMaxPolicyHeads = size_t{1} << 20;

// Reads, parses and loads a policy file of any of the three formats. The path must name a regular file of at most
// kMaxPolicyFileBytes.
//
// `expected`, when given, is the model's shape: the file must match it (layer count, query heads and, for the
// tessera format, KV heads), and MInference/MoA files (which are per query head and do not record the KV head
// count) take its num_kv_heads. Without it, MInference/MoA files load with num_kv_heads = num_q_heads; such a
// policy is for inspection (summaries, conversion), not for running a GQA model.
AttentionPolicy load_policy_file(const std::filesystem::path& path,
                                 const std::optional<PolicyShape>& expected = std::nullopt);

// The same for an already parsed document; `source` names it in error messages.
AttentionPolicy load_policy_json(const nlohmann::json& j, const std::string& source,
                                 const std::optional<PolicyShape>& expected = std::nullopt);

// Throws Error("<source>: ...") when the policy's shape differs from `expected`.
void check_policy_shape(const AttentionPolicy& policy, const PolicyShape& expected,
                        const std::string& source);

// tessera's own format.
AttentionPolicy parse_tessera_policy(const nlohmann::json& j, const std::string& source);
// Writes compactly: the most common pattern as "default", per layer a "default" where the layer's most common
// pattern differs from it plus the heads that differ, and a "trianglemix" section when the deepest layers all
// run one triangle. Patterns are written with all their fields except vertical_slash's last_q and forced_*
// where they equal the defaults. Loading the result gives an equal policy.
nlohmann::json save_policy_json(const AttentionPolicy& policy);

// MInference per-head configs (one entry per query head). If `scores` is given it receives the search scores,
// layer-major (num_layers * num_q_heads).
AttentionPolicy import_minference(const nlohmann::json& j, const std::string& source, int num_kv_heads,
                                  std::vector<double>* scores = nullptr);
// Writes vertical_slash (with default last_q/forced_* fields), ashape and block_sparse (block 64) heads; any
// other pattern throws. Scores are written as 0 unless `scores` (layer-major) is given.
nlohmann::json export_minference(const AttentionPolicy& policy, const std::vector<double>* scores = nullptr);

// MoA alpha/beta plans (one entry per query head): every head becomes ElasticWindowPattern{alpha, beta, 64}.
AttentionPolicy import_moa(const nlohmann::json& j, const std::string& source, int num_kv_heads);
// Every head must be a moa_window with sink 64 (the sink MoA runs with); anything else throws.
nlohmann::json export_moa(const AttentionPolicy& policy);

// Text for a policy document: one top-level key per line and one layer per line, patterns inline, keys in a
// fixed readable order (head indices numerically). Valid JSON.
std::string format_policy_json(const nlohmann::json& j);
// Converts and writes `policy` to `path` in `format`; throws Error naming the path when writing fails.
void save_policy_file(const AttentionPolicy& policy, const std::filesystem::path& path,
                      PolicyFormat format = PolicyFormat::tessera);

// A few lines for humans: the shape; for each run of consecutive layers whose per-layer counts of pattern
// kinds are the same, the total count of each kind over the run; then each distinct pattern with its count,
// most frequent first. For example:
//   policy: 32 layers x 32 query heads (8 KV heads), 1024 heads
//   layers 0-15: ashape 16, vertical_slash 496
//   layers 16-31: triangle 512
//   distinct patterns:
//     512  triangle(sink=8, local=512, last=128)
//     ...
std::string summarize_policy(const AttentionPolicy& policy);

}  // namespace tessera::attn
