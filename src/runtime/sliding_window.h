// tessera/runtime/sliding_window.h — a model's own sliding window (Gemma-3 local layers, Mistral) as an index.
//
// A sliding-window layer is part of the model, not a sparsity choice, and is row-exact: key j is visible to the
// query at position p iff p - window < j <= p. The attention patterns' windows are per query tile (a superset), so
// this builds a SparseIndex with one-row tiles and one range per row, which the sparse executor runs exactly.
//
// TODO(window): once AttentionArgs carries `int32_t window` (row-exact, 0 = none) and the executors honour it,
// set args.window and call the dense executor (or combine the window with a sparse policy) instead.
#pragma once

#include <cstdint>

#include "attention/index/sparse_index.h"

namespace tessera::runtime {

// Rows [0, q_len) at positions q_begin + r, keys [0, kv_len) with kv_len >= q_begin + q_len, every query head alike.
attn::SparseIndex sliding_window_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                       int32_t window);

}  // namespace tessera::runtime
