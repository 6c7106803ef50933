// tessera/attention/cpu/flash_executor.h — internal: runs a list of query-tile work items on a thread pool.
//
// The one driver behind dense_attention_cpu and sparse_attention_cpu: they only decide which keys each item
// sees. Items are run heaviest first (cost = rows x keys) so the tail of the parallel loop is short.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/attention_args.h"
#include "attention/index/sparse_index.h"
#include "core/thread_pool.h"

namespace tessera::attn::cpu_detail {

struct WorkItem {
  int32_t head = 0;       // query head
  int32_t row_begin = 0;  // first query row (0-based within the call)
  int32_t rows = 0;       // 1..64
  int32_t heads = 1;      // query heads head .. head + heads - 1, of one kv head (rows * heads <= kFewRows)
  int64_t cost = 0;       // rows x keys, for ordering
  // Keys of the item, clipped to [0, q_begin + row_begin + rows); storage owned by the caller.
  const KeyRange* ranges = nullptr;
  int32_t num_ranges = 0;
  const int32_t* columns = nullptr;
  int32_t num_columns = 0;
};

// args must be validated. Reorders items.
void execute_items(const AttentionArgs& args, std::vector<WorkItem>& items, ThreadPool& pool);

}  // namespace tessera::attn::cpu_detail
