// tessera/runtime/sliding_window.h — a model's own sliding window (Gemma-3 local layers, Mistral).
//
// A sliding-window layer is part of the model, not a sparsity choice, and is row-exact: key j is visible to
// the query at position p iff p - window < j <= p. The attention patterns' windows are per query tile (a
// superset), so the window is run as two exact pieces through the sparse executor and merged by their
// log-sum-exps:
//   A: per 64-row tile [P0, P1), the keys [P1 - window, P1) — inside every row's window (causal clipping does
//      the right edge); rows of a tile see the same keys, so K/V are reused across the tile;
//   B: per row p, the keys [p - window + 1, min(p + 1, P1 - window)) — the rest of its window (at most 63
//   keys
//      when window >= 64; the whole window for the rows A misses when window < 64), one-row tiles.
// out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B): the softmax over the union of disjoint key
// sets.
//
// TODO(window): once AttentionArgs carries `int32_t window` (row-exact, 0 = none) and the executors honour
// it, set args.window and call the dense executor (or combine the window with a sparse policy) instead.
#pragma once

#include <cstdint>

#include "attention/cpu/attention_args.h"
#include "attention/index/sparse_index.h"
#include "core/thread_pool.h"

namespace tessera::runtime {

// Exact row-exact sliding-window causal attention; writes args.out (args.lse must be absent). Throws what the
// executors throw for invalid args.
void sliding_window_attention(const attn::AttentionArgs& args, int32_t window, ThreadPool& pool);

// The two indices above: piece A (tile `tile`) and piece B (one-row tiles; rows with nothing left get no
// range).
attn::SparseIndex sliding_window_tile_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                            int32_t window, int32_t tile);
attn::SparseIndex sliding_window_rest_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                            int32_t window, int32_t tile);

}  // namespace tessera::runtime
