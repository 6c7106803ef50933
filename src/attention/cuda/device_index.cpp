#include "attention/cuda/device_index.h"

#include <cuda_runtime.h>

#include "attention/cuda/cuda_check.h"

namespace tessera::attn::gpu {

DeviceSparseIndex DeviceSparseIndex::upload(const SparseIndex& index, cudaStream_t stream) {
  DeviceSparseIndex d;
  d.num_heads = index.num_heads;
  d.tile = index.tile;
  d.q_begin = index.q_begin;
  d.q_len = index.q_len;
  d.kv_len = index.kv_len;
  d.range_offsets.upload(index.range_offsets, stream);
  d.ranges.upload(index.ranges, stream);
  d.column_offsets.upload(index.column_offsets, stream);
  d.columns.upload(index.columns, stream);
  return d;
}

SparseIndex DeviceSparseIndex::download() const {
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  SparseIndex h;
  h.num_heads = num_heads;
  h.tile = tile;
  h.q_begin = q_begin;
  h.q_len = q_len;
  h.kv_len = kv_len;
  const size_t n = static_cast<size_t>(num_items()) + 1;
  h.range_offsets = range_offsets.download(n);
  h.column_offsets = column_offsets.download(n);
  h.ranges = ranges.download(static_cast<size_t>(h.range_offsets.back()));
  h.columns = columns.download(static_cast<size_t>(h.column_offsets.back()));
  return h;
}

DeviceWorkPlan DeviceWorkPlan::upload(const std::vector<int32_t>& order, cudaStream_t stream) {
  DeviceWorkPlan p;
  p.num_items = static_cast<int32_t>(order.size());
  p.order.upload(order, stream);
  p.counter.resize(1);
  return p;
}

const DeviceInfo& current_device_info() {
  static thread_local DeviceInfo cached[16];
  static thread_local bool filled[16] = {};
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 16) throw Error("CUDA device number " + std::to_string(dev) + " is out of range");
  if (!filled[dev]) {
    DeviceInfo& info = cached[dev];
    info.device = dev;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev));
    TESSERA_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    filled[dev] = true;
  }
  return cached[dev];
}

}  // namespace tessera::attn::gpu
