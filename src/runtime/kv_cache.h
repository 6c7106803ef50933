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

namespace tessera::runtime {

class KVCache {
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

  float* k(int32_t layer, int32_t pos) { return k_[static_cast<size_t>(layer)].data() + offset(pos); }
  float* v(int32_t layer, int32_t pos) { return v_[static_cast<size_t>(layer)].data() + offset(pos); }
  // Views of rows [0, len) of one layer: [len, num_kv_heads, head_dim], f32.
  TensorView k_view(int32_t layer, int32_t len);
  TensorView v_view(int32_t layer, int32_t len);

  int32_t capacity() const { return capacity_; }
  int32_t max_tokens() const { return max_tokens_; }
  size_t bytes() const;  // allocated bytes, K and V of every layer

 private:
  std::string describe(int64_t tokens) const;
  size_t offset(int32_t pos) const { return static_cast<size_t>(pos) * static_cast<size_t>(row_); }

  int32_t num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0, max_tokens_ = 0;
  int64_t row_ = 0;  // floats per token per layer: num_kv_heads * head_dim
  int32_t capacity_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

}  // namespace tessera::runtime
