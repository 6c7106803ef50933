// tessera/runtime/paged_kv.h — the paged KV cache's bookkeeping, shared by the CPU and GPU batched engines.
//
// Storage is a pool of fixed-size blocks; a block holds `block_tokens` consecutive rows (positions) of one
// (layer, kv head): K and V, each [block_tokens, head_dim]. Every sequence has one block table per (layer, kv
// head) mapping logical block b (positions [b * B, (b + 1) * B)) to a physical block id, or -1 where the rows are
// not kept. This file holds only ids and counts; the engines own the memory the ids index (f32 on the host,
// bf16 on the GPU) — see batch_forward.h and runtime/cuda/batch_gpu.h.
//
// Per-head retention (MoA's per-head KV caches, the model's sliding windows): a decode query at position
// len - 1 of query head h sees the keys
//     j in [0, len)  with  j >= len - horizon  and  (j < sink or j >= len - window)
// (DecodeView; dense: sink 0, window = horizon = unbounded). A KV head keeps the union over its GQA group: the
// rows below the largest sink and the last max(min(window, horizon)) rows; a block every row of which has fallen
// out of that union returns to the pool as soon as it does (a ring of blocks for a window; the sink blocks stay).
// Allocation and freeing are O(1) from a free list of equal-size blocks, so there is no fragmentation.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "attention/pattern/policy.h"
#include "model/model_config.h"

namespace tessera::runtime {

inline constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

// The keys one query head sees at decode (see above).
struct DecodeView {
  int32_t sink = 0;
  int64_t window = kUnbounded;   // the most recent keys seen besides the sink (>= 1)
  int64_t horizon = kUnbounded;  // the model's own sliding window (a Gemma-3 local layer): nothing older
  bool operator==(const DecodeView&) const = default;

  // The two key ranges [a0, a1) and [b0, b1) (a1 <= b0; either may be empty) a query at position len - 1 sees.
  struct Ranges {
    int64_t a0, a1, b0, b1;
    int64_t count() const { return (a1 - a0) + (b1 - b0); }
  };
  Ranges ranges(int64_t len) const;
};

// The decode views of every (layer, query head), layer-major: MoA's elastic windows keep sink + the last
// alpha + beta * prompt_len keys (the span is fixed when the prompt ends, as MoA's decode caches are; within the
// prompt it is the pattern's own mask, span clipped to N), every other pattern decodes densely (the
// prefill-only patterns of MInference and TriangleMix), and a sliding-window layer's window applies on top.
// `policy` may be null or empty (dense).
std::vector<DecodeView> decode_views(const ModelConfig& config, const attn::AttentionPolicy* policy,
                                     int64_t prompt_len);

// What a KV head keeps: the rows below `sink` and the last `window` rows.
struct KVRetention {
  int32_t sink = 0;
  int64_t window = kUnbounded;
  bool operator==(const KVRetention&) const = default;
};
// The union over each KV head's query heads (decode_views layout in, [layer * kv_heads + kv_head] out).
std::vector<KVRetention> kv_retention(const ModelConfig& config, std::span<const DecodeView> views);

struct PagedKVShape {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_tokens = 64;
  int64_t elements_per_block() const { return static_cast<int64_t>(block_tokens) * head_dim; }  // of K (or V)
};

// Equal-size blocks, ids [0, total()), handed out from a free list, each with a count of its holders (a sequence's
// table, the prefix cache: a block shared by several is freed when the last one gives it back).
class BlockPool {
 public:
  BlockPool() = default;
  explicit BlockPool(int32_t num_blocks);
  int32_t total() const { return total_; }
  int32_t available() const { return static_cast<int32_t>(free_.size()); }
  int32_t used() const { return total_ - available(); }
  // A free block, held once. Throws tessera::Error when none is free (callers reserve first; this is a bug check).
  int32_t take();
  // One more holder of a block in use.
  void share(int32_t id);
  // One holder fewer; the block is free when none is left.
  void give(int32_t id);
  int32_t holders(int32_t id) const { return refs_[static_cast<size_t>(id)]; }
  // The prefix cache's holds: keep() is a share() marked as the cache's, unkeep() gives it back. kept_alone() counts
  // the blocks only the cache holds (what evicting it frees), kept up to date by every share / give rather than
  // counted over the cache's entries: the server asks for it every step.
  void keep(int32_t id);
  void unkeep(int32_t id);
  int32_t kept_alone() const { return kept_alone_; }

 private:
  bool alone(size_t i) const { return kept_[i] > 0 && refs_[i] == kept_[i]; }
  template <class Change>
  void recount(int32_t id, Change change) {  // kept_alone_ follows a change of block id's counts
    const auto i = static_cast<size_t>(id);
    kept_alone_ -= alone(i);
    change(i);
    kept_alone_ += alone(i);
  }
  int32_t total_ = 0;
  std::vector<int32_t> free_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> kept_;  // of each block's holders, the cache's
  int32_t kept_alone_ = 0;
};

// The block tables of one sequence.
class SequenceBlocks {
 public:
  SequenceBlocks() = default;
  SequenceBlocks(const PagedKVShape& shape, std::vector<KVRetention> retention);

  int64_t length() const { return length_; }
  // Blocks the sequence holds at length `len` under its retention (what grow() to `len` leaves allocated).
  int64_t blocks_at(int64_t len) const;
  // Most blocks it holds at any length in [from, to] (admission reserves this).
  int64_t max_blocks(int64_t from, int64_t to) const;
  // Appends rows [length, length + n): takes blocks for the new rows the retention keeps, then returns to `pool`
  // the blocks whose rows have all fallen out. Throws tessera::Error when the pool runs out (after giving back
  // what it took, so the sequence is unchanged).
  void grow(int64_t n, BlockPool& pool);
  // Blocks grow(n) would take from the pool (0 when the new rows fall in blocks already held or not kept).
  int64_t need(int64_t n) const;
  // Starts an empty sequence with the first `blocks` logical blocks of cached KV (a prefix cache hit):
  // shared[b][layer * kv_heads + kv_head] is that block's physical id, or -1 where the cache did not keep it; each
  // id this sequence keeps at length blocks * block_tokens becomes shared (one more holder) — every such id must be
  // >= 0 (PrefixCache::match checks it) — and the length becomes blocks * block_tokens.
  void adopt(std::span<const std::vector<int32_t>* const> shared, BlockPool& pool);
  // Gives every block back; length becomes 0.
  void release(BlockPool& pool);
  // A copy of a sequence another process schedules (the tensor-parallel followers, parallel/tp_batch.h): only its
  // tables and length, set entry by entry, no pool behind them (its retention is unbounded: not for grow()).
  static SequenceBlocks mirror(const PagedKVShape& shape);
  // Logical block b of table i (layer * kv_heads + kv_head) becomes `id` (-1: not kept); the table grows with -1.
  void set_entry(size_t i, int64_t b, int32_t id);
  void set_length(int64_t length) { length_ = length; }

  // Physical block of row `pos` of (layer, kv head), or -1 when the row is not kept (or not written yet).
  int32_t block(int32_t layer, int32_t kv_head, int64_t pos) const;
  // Logical block -> physical id (-1: freed or never kept), for rows [0, length()).
  const std::vector<int32_t>& table(int32_t layer, int32_t kv_head) const {
    return tables_[static_cast<size_t>(layer) * static_cast<size_t>(shape_.num_kv_heads) +
                   static_cast<size_t>(kv_head)];
  }
  int64_t blocks_held() const { return held_; }
  const PagedKVShape& shape() const { return shape_; }
  // Whether (layer, kv head) table i keeps logical block b at length len.
  bool keeps(size_t i, int64_t b, int64_t len) const { return kept(retention_[i], b, len); }
  size_t tables() const { return tables_.size(); }
  const std::vector<int32_t>& table(size_t i) const { return tables_[i]; }
  const KVRetention& retention(int32_t layer, int32_t kv_head) const {
    return retention_[static_cast<size_t>(layer) * static_cast<size_t>(shape_.num_kv_heads) +
                      static_cast<size_t>(kv_head)];
  }

 private:
  // Whether logical block b holds a row kept at length len.
  bool kept(const KVRetention& r, int64_t b, int64_t len) const;

  PagedKVShape shape_;
  std::vector<KVRetention> retention_;     // [layer * kv_heads + kv_head]
  std::vector<std::vector<int32_t>> tables_;
  int64_t length_ = 0;
  int64_t held_ = 0;
};

}  // namespace tessera::runtime
