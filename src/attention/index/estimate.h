// tessera/attention/index/estimate.h — online estimation for the dynamic patterns (CPU).
//
// Estimates are per query head (GQA: the head's queries against its KV head's keys). Inputs are token-major:
// q [q_len, num_q_heads, head_dim], k [kv_len, num_kv_heads, head_dim], f32 or bf16. Queries sit at absolute
// positions [ctx.q_begin, ctx.q_begin + q_len).
#pragma once

#include <cstdint>
#include <variant>
#include <vector>

#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace tessera::attn {

// Chosen vertical columns (ascending key positions) and slash offsets (ascending; offset o = query - key).
struct VerticalSlashEstimate {
  std::vector<int32_t> columns;
  std::vector<int32_t> offsets;
  bool operator==(const VerticalSlashEstimate&) const = default;
};

// Per query block (pattern.block rows, aligned to absolute position 0), the chosen key blocks, ascending, CSR.
struct BlockSparseEstimate {
  int32_t block = 64;
  int32_t first_q_block = 0;              // absolute block number of entry 0
  std::vector<int32_t> offsets;           // number of query blocks + 1
  std::vector<int32_t> key_blocks;
  bool operator==(const BlockSparseEstimate&) const = default;
};

using HeadEstimate = std::variant<std::monostate, VerticalSlashEstimate, BlockSparseEstimate>;

// VS (MInference Alg. 2): A = softmax(Q[last_q rows] K^T * scale + causal); column sums -> top-`vertical` columns,
// diagonal sums -> top-`slash` offsets; the first forced_columns columns and offsets [0, forced_diagonals) are
// always chosen (within the budgets). Budgets larger than what exists are clamped. Ties go to the smaller index.
// Adaptive (p.gamma > 0): the same selection with the counts coverage_count(column sums, forced, gamma,
// min_vertical, min(vertical, keys)) and likewise for the diagonal sums (pattern.h says what the mass is).
VerticalSlashEstimate estimate_vertical_slash(const VerticalSlashPattern& p, const TensorView& q,
                                              const TensorView& k, int q_head, int kv_head,
                                              const LoweringContext& ctx, float scale);

// BS (MInference Alg. 3): mean-pool Q and K over pattern.block tokens (partial blocks pool what they have),
// A = softmax(Qp Kp^T * scale + block-causal mask); per query block qb, min(top_k, qb + 1) key blocks among the
// causal ones (key block <= qb): the diagonal block qb itself (the block holding the query block's own
// positions) is always one of them when top_k >= 1, the other min(top_k, qb + 1) - 1 are the best-scoring of
// [0, qb). Ties go to the smaller block. top_k = 0 chooses nothing.
// Adaptive (p.gamma > 0): per query block, min(top_k, qb + 1) is replaced by coverage_count over the masses
// exp(score - max) of the causal blocks with the diagonal block forced (it is the first of the order): scores of
// [0, qb] as above (the diagonal's score too), min_top_k and top_k the clamps.
BlockSparseEstimate estimate_block_sparse(const BlockSparsePattern& p, const TensorView& q, const TensorView& k,
                                          int q_head, int kv_head, const LoweringContext& ctx, float scale);

// Adaptive budgets (pattern.h, gamma > 0): the number of elements of `mass` (non-negative, any scale) to keep.
// Order: the forced elements [0, forced) first, then the others by mass, descending, ties to the smaller index.
// The count is the length of the shortest prefix of that order whose summed mass (in that order, f64) is >=
// gamma * total (total: the sum of all masses in index order), or n when gamma >= 1, when the total is 0 or when
// no prefix reaches it (rounding); then clamped to [max(min_count, forced), max_count] and to [0, n]. forced <=
// max_count is the caller's (the estimators clamp forced to the maximum first).
int64_t coverage_count(const std::vector<double>& mass, int64_t forced, double gamma, int64_t min_count,
                       int64_t max_count);

// Estimates for every head of a layer (std::monostate for static patterns), in parallel over heads.
// group_size = num_q_heads / num_kv_heads.
std::vector<HeadEstimate> estimate_layer(const std::vector<Pattern>& patterns, const TensorView& q,
                                         const TensorView& k, const LoweringContext& ctx, float scale,
                                         ThreadPool& pool);

}  // namespace tessera::attn
