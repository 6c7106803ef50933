// tessera/attention/cpu/sparse_attention.h — attention over a SparseIndex on the CPU.
//
// Computes exactly dense attention under the mask index.visible (causal clipping included), with the same
// kernel as dense_attention_cpu: per (query head, query tile) the tile's key ranges are processed in 64-key
// blocks from each range's start (partial blocks need no mask; blocks crossing the diagonal get the causal
// mask per row), then the tile's single columns are gathered 64 at a time into scratch; one online softmax
// spans both. Work is proportional to the index's work cells (IndexStats::work_cells).
//
// The index may use any query-tile height: tiles higher than 64 rows are run as 64-row pieces, each with the
// tile's keys clipped to the piece's last row (which is the same mask).
//
// args.window > 0 intersects the index with the row-exact window: each piece's ranges and columns are clipped
// to its first row's window, and blocks straddling a row's lower bound are masked per row.
#pragma once

#include "attention/attention_args.h"
#include "attention/index/sparse_index.h"
#include "core/thread_pool.h"

namespace tessera::attn {

// Writes args.out (and args.lse when present); rows that see no key get 0 (lse -inf). Throws tessera::Error
// when args are invalid (validate(args)), when the index is invalid (index.validate()), or when it describes
// another call: "sparse attention: index has 4 heads, q_begin 0, q_len 128, kv_len 128; the call has 8 query
// heads, q_begin 0, q_len 128, kv_len 128".
void sparse_attention_cpu(const AttentionArgs& args, const SparseIndex& index,
                          ThreadPool& pool = ThreadPool::global());

}  // namespace tessera::attn
