// tessera/runtime/kv_cache.h — the per-layer key/value cache of one sequence, f32, grown on demand.
//
// Layer l holds K and V as [capacity, num_kv_heads, head_dim] row-major (token-major, the layout the
// attention executors read). Rows [0, length) are valid; the engine appends a chunk's rows in place (the K/V
// projections write straight into the cache). Capacity grows geometrically up to max_tokens, so a 1K prompt
// on a model with a 128K context allocates for about 1K tokens, not 128K.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "runtime/contiguous_kv.h"

namespace tessera::runtime {

class KVCache : public ContiguousKVLayers<std::vector<float>> {
 public:
  KVCache() = default;
  KVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens);

  // Makes room for `tokens` rows (<= max_tokens), keeping the rows already written. Throws tessera::Error
  // when the memory cannot be had.
  void reserve(int32_t tokens);
  // Throws tessera::Error when `tokens` rows would exceed the host memory budget (core/memory_budget.h):
  //   "KV cache for 131,072 tokens (24 layers x 3 kv heads x 64 dims, K and V in f32) needs 12.9 GB, over ..."
  void check_budget(int64_t tokens) const;
  double bytes_for(int64_t tokens) const;  // K and V of every layer for `tokens` rows
  // Frees everything (capacity 0).
  void release();

  // Views of rows [0, len) of one layer: [len, num_kv_heads, head_dim], f32.
  TensorView k_view(int32_t layer, int32_t len);
  TensorView v_view(int32_t layer, int32_t len);

  size_t bytes() const;  // allocated bytes, K and V of every layer

 private:
  std::string describe(int64_t tokens) const;
};

}  // namespace tessera::runtime
