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
#include <optional>
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

}  // namespace tessera::plan
