// tessera/attention/cpu/metrics.h — how much a sparse mask loses against dense attention.
//
// attention_recall measures the mask itself (share of the dense softmax mass it keeps); output_error measures
// the result (sparse output against the dense one). Both are exact: f64 arithmetic, no sampling.
#pragma once

#include <vector>

#include "attention/attention_args.h"
#include "attention/index/sparse_index.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace tessera::attn {

struct RecallResult {
  double mean = 0;               // mean over heads of per_head (= mean over all (head, row) pairs)
  std::vector<double> per_head;  // per query head: mean over rows
};

// For every (query head, row): the share of the dense causal softmax mass of scale * q.k that lies on the
// cells index.visible keeps, computed in f64; averaged over rows, then heads. With args.window > 0 both sides
// are windowed: the dense mass is the row's window's, and the kept cells are the index's within the window.
// Uses args.q, args.k, args.scale, args.q_begin, args.window (v, out and lse are not read). The index must
// describe the call (heads, q_begin, q_len, kv_len). Cost: one dense score matrix per head (O(q_len * kv_len
// * head_dim)), parallel over the pool.
RecallResult attention_recall(const AttentionArgs& args, const SparseIndex& index,
                              ThreadPool& pool = ThreadPool::global());

struct OutputError {
  double rel_frobenius =
      0;               // ||a - b|| / ||b|| over the whole tensor (0 when both are 0, inf when only b is)
  double max_abs = 0;  // max |a - b|
  std::vector<double> per_head_rel;  // the same per head (dim 1)
  std::vector<double> per_head_max_abs;
};

// a, b: [q_len, num_heads, head_dim] f32 of equal shape (a = sparse output, b = dense reference).
OutputError output_error(const TensorView& a, const TensorView& b);

}  // namespace tessera::attn
