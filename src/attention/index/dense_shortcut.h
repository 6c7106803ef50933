// tessera/attention/index/dense_shortcut.h — the static "go dense before estimating" rule.
//
// A sparse layer pays estimation and index build before its dense fallback can decide (CUDA backend:
// CudaLayerAttention). When the patterns' budgets already cover most of the causal keys, that work is
// wasted: VS at 8K (1000 + 6096 of 8192 keys) estimated and indexed for 0.36 ms and then ran dense anyway
// (H200 run 3: 1.99 ms against 1.67 ms dense, 0.84x; BS top-100 x 64 at 8K likewise). This rule decides from
// the patterns and the shape alone, on the host, before any device work.
//
// Per head, a coverage in [0, 1] (fraction of the causal (row, key) cells the head may keep):
//   static heads (dense, A-shape, elastic window, Triangle): exact, rows p of [q_begin, q_begin + q_len) with
//     keys [0, min(p + 1, kv_len)): A-shape / elastic keep min(visible, sink + local) keys per row (sink and
//     window disjoint or merged), Triangle the same except its last `last` rows of the prompt (dense);
//   dynamic heads: a budget bound, per row min(visible, budget) with budget = vertical + slash (VS) or
//     top_k * block (BS): at most that many keys per row can be selected.
// The layer goes dense iff every head is covered: coverage >= kStaticDenseCoverage * r (static heads) or
// >= kDynamicDenseCoverage * r (dynamic heads), r = the dense backend's time per key tile relative to our
// sparse kernel's (1 when our kernel runs dense, ~0.95 for cuDNN on the H200 since the TMA warp-specialized
// kernel; 0.55 before it). Static heads get the higher
// threshold because their index costs nothing to build (their exact tile cost decides later anyway) and tile
// granularity makes their executed density higher than the cell coverage; dynamic heads' executed density is
// far above the budget bound (VS at 32K: bound 0.39, executed tile density 0.83), hence the lower threshold.
// Checked against run 3 (H200, r = 1): VS and BS at 8K (bounds 0.98 and 0.95) go dense; at 32K (0.39, 0.35)
// they estimate (sparse won 1.11x and 2.07x); A-shape at 8K (0.77) stays sparse (it won 1.27x).
// With cuDNN dense (r = 0.55): VS 32K (0.39 >= 0.36) goes dense (cuDNN 12.8 ms against 22.1 ms sparse), BS 32K
// (0.35) estimates (11.9 ms against 12.8), A-shape 8K (0.77 >= 0.50) goes dense (0.92 against 1.32 ms).
#pragma once

#include <vector>

#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn {

inline constexpr double kStaticDenseCoverage = 0.9;
inline constexpr double kDynamicDenseCoverage = 0.65;

// Coverage of one head (see above); 1 for an empty call.
double head_coverage(const Pattern& pattern, const LoweringContext& ctx);

// Whether the pattern's coverage is an exact count (static) or a budget bound (VS, BS).
bool coverage_is_bound(const Pattern& pattern);

// The rule: true iff the layer has at least one non-dense head and every head is covered at relative dense
// cost `rel_dense_cost` (r above; > 0). False for an empty layer or an empty call.
bool dense_before_estimation(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                             double rel_dense_cost);

}  // namespace tessera::attn
