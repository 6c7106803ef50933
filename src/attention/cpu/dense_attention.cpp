#include "attention/cpu/dense_attention.h"

#include <algorithm>
#include <vector>

#include "attention/cpu/flash_executor.h"
#include "attention/cpu/flash_tile.h"

namespace tessera::attn {

void dense_attention_cpu(const AttentionArgs& args, ThreadPool& pool) {
  validate(args);
  const int64_t q_len = args.q_len(), hq = args.num_q_heads();
  const int64_t tiles = (q_len + cpu_detail::kTileRows - 1) / cpu_detail::kTileRows;
  std::vector<KeyRange> ranges(static_cast<size_t>(tiles));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::min<int64_t>(cpu_detail::kTileRows, q_len - t * cpu_detail::kTileRows);
    const int64_t first_pos = args.q_begin + t * cpu_detail::kTileRows;
    const int64_t key_end = std::min<int64_t>(args.kv_len(), first_pos + rows);
    // With a window, keys below the first row's window are hidden from every row of the tile.
    const int64_t key_begin = args.window > 0 ? std::max<int64_t>(0, first_pos - args.window + 1) : 0;
    ranges[static_cast<size_t>(t)] = KeyRange{static_cast<int32_t>(key_begin), static_cast<int32_t>(key_end)};
  }
  std::vector<cpu_detail::WorkItem> items;
  items.reserve(static_cast<size_t>(tiles * hq));
  // Head-minor so that equal-cost items of different heads interleave after the (stable) sort.
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t h = 0; h < hq; ++h) {
      cpu_detail::WorkItem it;
      it.head = static_cast<int32_t>(h);
      it.row_begin = static_cast<int32_t>(t * cpu_detail::kTileRows);
      it.rows = static_cast<int32_t>(std::min<int64_t>(cpu_detail::kTileRows, q_len - it.row_begin));
      it.ranges = &ranges[static_cast<size_t>(t)];
      it.num_ranges = 1;
      it.cost = static_cast<int64_t>(it.rows) * (it.ranges->end - it.ranges->begin);
      items.push_back(it);
    }
  }
  cpu_detail::execute_items(args, items, pool);
}

}  // namespace tessera::attn
