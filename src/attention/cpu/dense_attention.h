// tessera/attention/cpu/dense_attention.h — dense causal attention on the CPU (flash-style, f32
// accumulation).
//
// Work items are (query head, 64-row query tile), run heaviest first over the pool; per item the keys
// [0, last row's position] are processed in 64-key blocks with an online softmax; only blocks crossing the
// diagonal are masked. It is sparse_attention_cpu with one range per tile (same kernel, same numerics).
// With args.window > 0 a tile's keys start at its first row's window, and only the blocks straddling a row's
// lower bound are masked per row: the work is rows x (window + 63) per tile, not rows x position.
// Tiles of at most 4 rows (decode) take the kernel's few-row path, and their items hold several query heads
// of one GQA group (up to 4 rows in all, fewer when workers would be idle), which then read K and V once.
#pragma once

#include "attention/attention_args.h"
#include "core/thread_pool.h"

namespace tessera::attn {

// Writes args.out (and args.lse when present). Throws what validate(args) throws.
void dense_attention_cpu(const AttentionArgs& args, ThreadPool& pool = ThreadPool::global());

}  // namespace tessera::attn
