// tessera/plan/plan_report.h — what `tessera plan` shows of a plan: a picture, a per-layer summary, the expected
// density and attention FLOPs at given lengths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/pattern/policy.h"

namespace tessera::plan {

// An SVG grid, one row per layer and one cell per query head, coloured by pattern kind (dense, A-shape, MoA window,
// triangle, vertical-slash, block-sparse) and shaded by the head's density at `length`; each cell's tooltip is
// describe(pattern). An empty table draws every head dense.
std::string plan_svg(const attn::AttentionPolicy& policy, int32_t num_layers, int32_t num_q_heads, int32_t length,
                     const std::string& title);

struct LengthCost {
  int32_t length = 0;
  double density = 0;        // mean over heads (plan_trianglemix.h: policy_density; windows: see plan_costs)
  double flops = 0;          // attention FLOPs of one prefill (QK^T and PV over the kept cells, all heads/layers)
  double dense_flops = 0;    // the same for dense attention
};

// head_dim: the model's. An empty table is dense. layer_windows: the model's sliding window per layer (0: none; empty:
// no window layers); a window layer's head counts the smaller of its pattern's density and the window's (exact for
// dense and for windows within the model's; `plan --method measure` gives the executed density on a real prompt).
std::vector<LengthCost> plan_costs(const attn::AttentionPolicy& policy, int32_t num_layers, int32_t num_q_heads,
                                   int32_t head_dim, const std::vector<int32_t>& lengths,
                                   const std::vector<int32_t>& layer_windows = {});
// The density of a sliding window of `window` keys at prompt length n: sum over rows of min(row + 1, window) over
// the causal cells.
double window_density(int32_t window, int32_t n);

// One line per layer: "layer  3: vertical_slash 7, ashape 2  density 0.31" (density at `length`).
std::vector<std::string> layer_summary(const attn::AttentionPolicy& policy, int32_t num_layers, int32_t num_q_heads,
                                       int32_t length);

}  // namespace tessera::plan
