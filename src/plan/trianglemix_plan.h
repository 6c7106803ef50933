// tessera/plan/trianglemix_plan.h — TriangleMix's layer split from the gradient probe (trianglemix.txt §3).
//
// The probe (profile.h) gives per layer the mean |dL/dtheta| over the Middle, Last-Q and Streaming cells. The
// Middle gradient falls sharply in the deeper layers; the start layer is where it has fallen for good:
//   start = the smallest l such that middle(m) <= threshold * max_layers middle for every m >= l
// (0-based: layers [0, start) keep the inner policy, layers >= start run Triangle). With a density budget the
// start is instead the largest one whose plan's mean density at `length` is within the budget (the densest plan
// that fits), and the probe's own start is reported beside it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "attention/pattern/pattern.h"
#include "attention/pattern/policy.h"
#include "plan/profile.h"

namespace tessera::plan {

struct TriangleMixOptions {
  attn::TrianglePattern triangle;   // the deep layers' pattern (paper defaults 8 / 512 / 128)
  double threshold = 0.1;           // Middle gradient relative to the layers' largest
  std::optional<double> budget;     // mean density at `length`
  int32_t length = 4096;            // for the budget
};

struct TriangleMixResult {
  std::vector<double> middle, last, streaming;  // per layer: mean |dL/dtheta| per cell
  std::vector<double> middle_signed;            // per layer: the paper's signed mean
  int32_t probe_start = 0;                      // by the threshold rule
  int32_t start_layer = 0;                      // chosen (= probe_start without a budget)
  double density = 0;                           // of the chosen plan at options.length
  attn::AttentionPolicy policy;
};

// The start layer by the threshold rule from per-layer Middle gradients.
int32_t trianglemix_start(const std::vector<double>& middle, double threshold);

// Mean density over heads of a policy at a prefill of `length` tokens: dense heads 1, static patterns exactly
// (index accounting), dynamic ones by their budget bound (vertical_slash: min(1, (vertical/2 + slash) * 2 / N),
// block_sparse: min(1, top_k / mean causal blocks)).
double policy_density(const attn::AttentionPolicy& policy, int32_t length);

// inner: the policy of the shallow layers (an empty table: dense). Throws tessera::Error for a budget outside
// (0, 1] or one no start layer meets.
TriangleMixResult plan_trianglemix(const GradientProfile& profile, int32_t num_kv_heads,
                                   const attn::AttentionPolicy& inner, const TriangleMixOptions& options);

// The plan with the Triangle from layer `start` (num_layers: none), `inner` (an empty table: dense) below it.
attn::AttentionPolicy trianglemix_policy(int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
                                         const attn::AttentionPolicy& inner, const attn::TrianglePattern& triangle,
                                         int32_t start);

// The split chosen by held-out validation (tessera plan --trianglemix-select TOL), not by the probe alone:
// score(s) gives the plan with the Triangle from layer s its held-out answers kept and the summed log perplexity of
// the validation texts; s = num_layers (no Triangle) is the reference. A split is acceptable when it keeps at
// least the reference's answers and its log perplexity is at most the reference's + tolerance. From `from` (the
// probe's split): when it is acceptable the split moves one layer earlier (sparser) while the next is acceptable
// too; when it is not, one layer later until one is (num_layers always is). The trials in the order run.
struct SplitTrial {
  int32_t start = 0;
  int32_t kept = 0;
  double log_perplexity = 0;
  bool acceptable = false;
};
struct SplitSelection {
  int32_t start = 0;
  int32_t reference_kept = 0;
  double reference_log_perplexity = 0;
  std::vector<SplitTrial> trials;
};
using SplitScore = std::function<std::pair<int32_t, double>(int32_t start)>;
// Throws tessera::Error for `from` outside [0, num_layers] or a negative tolerance.
SplitSelection select_split(int32_t num_layers, int32_t from, double tolerance, const SplitScore& score);

}  // namespace tessera::plan
