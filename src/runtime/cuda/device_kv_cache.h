// tessera/runtime/cuda/device_kv_cache.h — the key/value cache of one sequence in GPU memory, bf16.
//
// Layer l holds K and V as [capacity, num_kv_heads, head_dim] row-major (token-major: the layout the attention
// executors read, and what the K/V projections write in place). Capacity grows like the CPU cache
// (runtime/kv_cache.h: at least 256 rows, doubling, never past max_tokens, never less than asked); growing
// copies the valid rows layer by layer, so the transient extra memory is one layer's new buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "core/dtype.h"
#include "runtime/contiguous_kv.h"

namespace tessera::runtime::gpu {

class DeviceKVCache : public ContiguousKVLayers<attn::gpu::DeviceBuffer<bf16>> {
 public:
  DeviceKVCache() = default;
  DeviceKVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens);

  // Makes room for `tokens` rows, keeping rows [0, valid). Synchronous. Throws tessera::Error past max_tokens
  // or when the device memory does not suffice (naming the size and what to do).
  void reserve(int32_t tokens, int32_t valid);
  void release();
  // Frees layer l's K and V (a staged prefill moved into the KV blocks a layer at a time); the other layers stay.
  void release_layer(int32_t layer);

  size_t bytes() const;
  // Bytes the cache would hold at `tokens` rows.
  size_t bytes_for(int32_t tokens) const;
};

}  // namespace tessera::runtime::gpu
