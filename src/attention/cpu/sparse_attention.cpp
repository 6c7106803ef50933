#include "attention/cpu/sparse_attention.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "attention/cpu/flash_executor.h"
#include "attention/cpu/flash_tile.h"
#include "core/error.h"

namespace tessera::attn {

void sparse_attention_cpu(const AttentionArgs& args, const SparseIndex& index, ThreadPool& pool) {
  validate(args);
  if (index.num_heads != args.num_q_heads() || index.q_begin != args.q_begin || index.q_len != args.q_len() ||
      index.kv_len != args.kv_len()) {
    throw Error("sparse attention: index has " + std::to_string(index.num_heads) + " heads, q_begin " +
                std::to_string(index.q_begin) + ", q_len " + std::to_string(index.q_len) + ", kv_len " +
                std::to_string(index.kv_len) + "; the call has " + std::to_string(args.num_q_heads()) +
                " query heads, q_begin " + std::to_string(args.q_begin) + ", q_len " +
                std::to_string(args.q_len()) + ", kv_len " + std::to_string(args.kv_len()));
  }
  index.validate();

  const int32_t tiles = index.num_tiles();
  const int32_t piece = cpu_detail::kTileRows;
  std::vector<cpu_detail::WorkItem> items;
  std::vector<KeyRange> clipped;  // ranges of pieces above the last one of their index tile
  std::vector<std::pair<size_t, size_t>>
      clipped_of;  // (item, first clipped range): pointers are set at the end
  const size_t pieces_per_tile = static_cast<size_t>((index.tile + piece - 1) / piece);
  items.reserve(static_cast<size_t>(index.num_heads) * static_cast<size_t>(tiles) * pieces_per_tile);

  for (int32_t t = 0; t < tiles; ++t) {
    const int32_t tile_begin = t * index.tile, tile_rows = index.tile_rows(t);
    for (int32_t h = 0; h < index.num_heads; ++h) {
      const std::span<const KeyRange> ranges = index.ranges_of(h, t);
      const std::span<const int32_t> columns = index.columns_of(h, t);
      for (int32_t r0 = 0; r0 < tile_rows; r0 += piece) {
        cpu_detail::WorkItem it;
        it.head = h;
        it.row_begin = tile_begin + r0;
        it.rows = std::min(piece, tile_rows - r0);
        const int32_t key_end =
            index.q_begin + it.row_begin + it.rows;  // keys >= key_end are hidden from the piece
        // With a window, keys below key_begin (the first row's window) are hidden from every row of the
        // piece.
        const int32_t key_begin =
            args.window > 0 ? std::max(0, index.q_begin + it.row_begin - args.window + 1) : 0;
        const bool last_piece = r0 + it.rows == tile_rows;
        int64_t keys = 0;
        if (last_piece && key_begin == 0) {  // the tile's own keys already end at or before key_end
          it.ranges = ranges.data();
          it.num_ranges = static_cast<int32_t>(ranges.size());
          it.columns = columns.data();
          it.num_columns = static_cast<int32_t>(columns.size());
          for (const KeyRange& kr : ranges) keys += kr.end - kr.begin;
        } else {
          const size_t first = clipped.size();
          for (const KeyRange& kr : ranges) {
            if (kr.begin >= key_end) break;
            if (kr.end <= key_begin) continue;
            clipped.push_back(KeyRange{std::max(kr.begin, key_begin), std::min(kr.end, key_end)});
            keys += clipped.back().end - clipped.back().begin;
          }
          clipped_of.emplace_back(items.size(), first);
          it.num_ranges = static_cast<int32_t>(clipped.size() - first);
          const auto col_begin = std::lower_bound(columns.begin(), columns.end(), key_begin);
          it.columns = columns.data() + (col_begin - columns.begin());
          it.num_columns =
              static_cast<int32_t>(std::lower_bound(col_begin, columns.end(), key_end) - col_begin);
        }
        keys += it.num_columns;
        if (keys == 0) {
          it.cost = it.rows;  // still writes zeros
        } else {
          it.cost = static_cast<int64_t>(it.rows) * keys;
        }
        items.push_back(it);
      }
    }
  }
  for (const auto& [item, first] : clipped_of) items[item].ranges = clipped.data() + first;
  cpu_detail::execute_items(args, items, pool);
}

}  // namespace tessera::attn
