// tessera/runtime/contiguous_kv.h — the layout one sequence's contiguous KV cache has on every device: per layer, K
// and V as [capacity, num_kv_heads, head_dim] row-major (token-major, what the attention executors read), in a
// buffer per layer of the device's kind (runtime/kv_cache.h: f32 on the host; runtime/cuda/device_kv_cache.h: bf16 on
// the GPU). The caches derive from it and add how they grow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::runtime {

template <class Buffer>
class ContiguousKVLayers {
 public:
  auto* k(int32_t layer, int32_t pos) { return k_[static_cast<size_t>(layer)].data() + offset(pos); }
  auto* v(int32_t layer, int32_t pos) { return v_[static_cast<size_t>(layer)].data() + offset(pos); }
  int64_t row_elements() const { return row_; }  // num_kv_heads * head_dim: one token of one layer
  int32_t capacity() const { return capacity_; }
  int32_t max_tokens() const { return max_tokens_; }

 protected:
  ContiguousKVLayers() = default;
  ContiguousKVLayers(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens)
      : num_layers_(num_layers),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        max_tokens_(max_tokens),
        row_(static_cast<int64_t>(num_kv_heads) * head_dim),
        k_(static_cast<size_t>(num_layers)),
        v_(static_cast<size_t>(num_layers)) {}
  size_t offset(int32_t pos) const { return static_cast<size_t>(pos) * static_cast<size_t>(row_); }

  int32_t num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0, max_tokens_ = 0;
  int64_t row_ = 0;
  int32_t capacity_ = 0;
  std::vector<Buffer> k_, v_;
};

}  // namespace tessera::runtime
