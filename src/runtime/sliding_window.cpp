#include "runtime/sliding_window.h"

#include <algorithm>

#include "core/error.h"

namespace tessera::runtime {

attn::SparseIndex sliding_window_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                       int32_t window) {
  check(window > 0, "sliding window: window must be positive");
  check(kv_len >= q_begin + q_len, "sliding window: kv_len is less than q_begin + q_len");
  attn::SparseIndex ix;
  ix.num_heads = num_heads;
  ix.tile = 1;
  ix.q_begin = q_begin;
  ix.q_len = q_len;
  ix.kv_len = kv_len;
  const size_t cells = static_cast<size_t>(num_heads) * static_cast<size_t>(q_len);
  ix.range_offsets.resize(cells + 1);
  ix.column_offsets.assign(cells + 1, 0);
  ix.ranges.resize(cells);
  for (int32_t h = 0; h < num_heads; ++h) {
    for (int32_t r = 0; r < q_len; ++r) {
      const int32_t p = q_begin + r;
      const size_t i = static_cast<size_t>(h) * static_cast<size_t>(q_len) + static_cast<size_t>(r);
      ix.ranges[i] = attn::KeyRange{std::max(0, p - window + 1), p + 1};
      ix.range_offsets[i] = static_cast<int32_t>(i);
    }
  }
  ix.range_offsets[cells] = static_cast<int32_t>(cells);
  return ix;
}

}  // namespace tessera::runtime
