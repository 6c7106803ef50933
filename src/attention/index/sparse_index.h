// tessera/attention/index/sparse_index.h — the one index every executor runs.
//
// Per (query head h, query tile t): a short list of key ranges [begin, end) plus a list of single key columns,
// stored flat like CSR. Token-granular: a range need not align to an executor's key tile (the executor masks
// partial tiles). The executor applies causal clipping per row (key j visible to query p only if j <= p).
//
// Invariants (checked by validate()):
//  - ranges of one (h, t) are non-empty, sorted, disjoint, within [0, tile_key_end(t));
//  - columns of one (h, t) are strictly ascending, within [0, tile_key_end(t)), and inside no range of that (h, t);
//  - offsets are monotone and sized num_heads * num_tiles + 1, entry (h, t) at h * num_tiles + t.
// tile_key_end(t) = min(kv_len, absolute position of the tile's last query + 1).
//
// The same bytes go to the GPU unchanged; the tile height is chosen by the executor that will run the index
// (64 on the CPU, 128 on Hopper).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tessera::attn {

struct KeyRange {
  int32_t begin = 0;
  int32_t end = 0;
  bool operator==(const KeyRange&) const = default;
};

// What an index covers: query heads, query rows and keys, the rows cut into tiles. The host index and its device
// copy (attention/cuda/device_index.h) both start with it.
struct IndexExtent {
  int32_t num_heads = 0;  // query heads
  int32_t tile = 64;      // query-tile height
  int32_t q_begin = 0;    // absolute position of query row 0
  int32_t q_len = 0;      // number of query rows
  int32_t kv_len = 0;     // keys [0, kv_len)

  int32_t num_tiles() const { return tile > 0 ? (q_len + tile - 1) / tile : 0; }
  int32_t num_items() const { return num_heads * num_tiles(); }  // (head, tile) items
};

struct SparseIndex : IndexExtent {
  std::vector<int32_t> range_offsets;   // num_heads * num_tiles() + 1
  std::vector<KeyRange> ranges;
  std::vector<int32_t> column_offsets;  // num_heads * num_tiles() + 1
  std::vector<int32_t> columns;

  int32_t tile_rows(int32_t t) const;      // rows in tile t (the last tile may be short)
  int32_t tile_key_end(int32_t t) const;   // min(kv_len, q_begin + last row of t + 1)

  std::span<const KeyRange> ranges_of(int32_t head, int32_t t) const {
    const size_t i = static_cast<size_t>(head) * static_cast<size_t>(num_tiles()) + static_cast<size_t>(t);
    return {ranges.data() + range_offsets[i], static_cast<size_t>(range_offsets[i + 1] - range_offsets[i])};
  }
  std::span<const int32_t> columns_of(int32_t head, int32_t t) const {
    const size_t i = static_cast<size_t>(head) * static_cast<size_t>(num_tiles()) + static_cast<size_t>(t);
    return {columns.data() + column_offsets[i], static_cast<size_t>(column_offsets[i + 1] - column_offsets[i])};
  }

  // Is key `key` visible to query row `row` (0-based within this call) of head `head`? Causal clipping included.
  bool visible(int32_t head, int32_t row, int32_t key) const;

  // Throws tessera::Error naming the first broken invariant.
  void validate() const;
};

// Work and density accounting for one index.
struct IndexStats {
  int64_t mask_cells = 0;    // visible (row, key) pairs after causal clipping, summed over heads
  int64_t causal_cells = 0;  // the same for dense causal attention
  int64_t work_cells = 0;    // cells an executor touches: per tile, rows x (range lengths + columns), no causal skip
  double density() const { return causal_cells ? static_cast<double>(mask_cells) / static_cast<double>(causal_cells) : 0.0; }
  // FLOPs for QK^T and PV over the mask (2 * 2 * d per cell).
  double mask_flops(int head_dim) const { return 4.0 * head_dim * static_cast<double>(mask_cells); }
  double work_flops(int head_dim) const { return 4.0 * head_dim * static_cast<double>(work_cells); }
};

// window > 0: a sliding-window layer's call (AttentionArgs::window), whose executors keep only the last `window` keys of
// each row: mask_cells counts the index's cells within them (causal_cells stays the whole causal triangle, so
// density() is the fraction of dense causal attention the call executes); work_cells is unchanged.
IndexStats index_stats(const SparseIndex& index, int64_t window = 0);
// Per-head stats (entry h covers query head h).
std::vector<IndexStats> index_stats_per_head(const SparseIndex& index, int64_t window = 0);

}  // namespace tessera::attn
