#include "runtime/cuda/device_kv_cache.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "core/error.h"

namespace tessera::runtime::gpu {

DeviceKVCache::DeviceKVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens)
    : ContiguousKVLayers(num_layers, num_kv_heads, head_dim, max_tokens) {}

size_t DeviceKVCache::bytes_for(int32_t tokens) const {
  return static_cast<size_t>(tokens) * static_cast<size_t>(row_) * sizeof(bf16) * 2 *
         static_cast<size_t>(num_layers_);
}

void DeviceKVCache::reserve(int32_t tokens, int32_t valid) {
  check(tokens <= max_tokens_,
        "KV cache: " + std::to_string(tokens) + " tokens exceed its limit of " + std::to_string(max_tokens_));
  if (tokens <= capacity_) return;
  const int64_t grown = std::max<int64_t>({tokens, 2 * static_cast<int64_t>(capacity_), 256});
  int32_t cap = static_cast<int32_t>(std::min<int64_t>(grown, max_tokens_));
  valid = std::clamp(valid, 0, capacity_);
  const size_t keep = static_cast<size_t>(valid) * static_cast<size_t>(row_);
  // Geometric growth first; when that does not fit, exactly what is asked for. A layer that grew keeps its rows,
  // so a failure leaves the cache as it was for every valid row (capacity_ changes only on success).
  for (;;) {
    try {
      for (int32_t l = 0; l < num_layers_; ++l) {
        for (auto* buffers : {&k_, &v_}) {
          attn::gpu::DeviceBuffer<bf16>& old = (*buffers)[static_cast<size_t>(l)];
          if (old.size() >= static_cast<size_t>(cap) * static_cast<size_t>(row_)) continue;
          attn::gpu::DeviceBuffer<bf16> grown_buffer(static_cast<size_t>(cap) * static_cast<size_t>(row_));
          if (keep > 0)
            TESSERA_CUDA_CHECK(
                cudaMemcpy(grown_buffer.data(), old.data(), keep * sizeof(bf16), cudaMemcpyDeviceToDevice));
          old = std::move(grown_buffer);
        }
      }
      break;
    } catch (const Error& e) {
      if (cap > tokens) {
        cap = tokens;
        continue;
      }
      char gb[32];
      std::snprintf(gb, sizeof gb, "%.2f", static_cast<double>(bytes_for(cap)) / 1e9);
      throw Error("KV cache: cannot grow to " + std::to_string(cap) + " tokens (" + gb +
                  " GB of device memory for K and V in bf16): " + e.what() +
                  "; shorten the prompt or lower the context limit (--max-context)");
    }
  }
  capacity_ = cap;
}

void DeviceKVCache::release() {
  for (auto& b : k_) b = attn::gpu::DeviceBuffer<bf16>();
  for (auto& b : v_) b = attn::gpu::DeviceBuffer<bf16>();
  capacity_ = 0;
}

void DeviceKVCache::release_layer(int32_t layer) {
  k_[static_cast<size_t>(layer)] = attn::gpu::DeviceBuffer<bf16>();
  v_[static_cast<size_t>(layer)] = attn::gpu::DeviceBuffer<bf16>();
}

size_t DeviceKVCache::bytes() const {
  size_t b = 0;
  for (const auto& x : k_) b += x.bytes();
  for (const auto& x : v_) b += x.bytes();
  return b;
}

}  // namespace tessera::runtime::gpu
