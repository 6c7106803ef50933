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
    // With a window, keys below the first row's window are hidden from every row of the tile: the walk starts at
    // the key block holding the first visible key, so that every row's key blocks lie at multiples of kKeyBlock
    // from key 0 whatever the tile (a row's bits do not depend on where its chunk or a cached prefix began; the
    // window mask hides the block's keys below it).
    const int64_t key_begin =
        args.window > 0
            ? std::max<int64_t>(0, first_pos - args.window + 1) / cpu_detail::kKeyBlock * cpu_detail::kKeyBlock
            : 0;
    ranges[static_cast<size_t>(t)] = KeyRange{static_cast<int32_t>(key_begin), static_cast<int32_t>(key_end)};
  }
  // A tile of few rows (decode) runs several query heads of one GQA group per item, so that they read K and V
  // once: as many as fit in kFewRows rows, fewer when that would leave workers idle.
  const int64_t group = args.group_size(), hkv = args.num_kv_heads();
  auto heads_per_item = [&](int64_t rows) {
    int64_t n = std::max<int64_t>(1, std::min<int64_t>(group, cpu_detail::kFewRows / rows));
    while (n > 1 && tiles * hkv * ((group + n - 1) / n) < pool.size()) --n;
    return n;
  };
  std::vector<cpu_detail::WorkItem> items;
  items.reserve(static_cast<size_t>(tiles * hq));
  // Head-minor so that equal-cost items of different heads interleave after the (stable) sort.
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::min<int64_t>(cpu_detail::kTileRows, q_len - t * cpu_detail::kTileRows);
    const int64_t per_item = heads_per_item(rows);
    for (int64_t h = 0; h < hq;) {
      cpu_detail::WorkItem it;
      it.head = static_cast<int32_t>(h);
      it.heads = static_cast<int32_t>(std::min(per_item, (h / group + 1) * group - h));  // within the group
      it.row_begin = static_cast<int32_t>(t * cpu_detail::kTileRows);
      it.rows = static_cast<int32_t>(rows);
      it.ranges = &ranges[static_cast<size_t>(t)];
      it.num_ranges = 1;
      it.cost = static_cast<int64_t>(it.rows) * it.heads * (it.ranges->end - it.ranges->begin);
      items.push_back(it);
      h += it.heads;
    }
  }
  cpu_detail::execute_items(args, items, pool);
}

}  // namespace tessera::attn
