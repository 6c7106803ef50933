#include "attention/cuda/device_index.h"

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "core/error.h"

namespace tessera::attn::gpu {

DeviceSparseIndex DeviceSparseIndex::upload(const SparseIndex& index, cudaStream_t stream) {
  DeviceSparseIndex d;
  static_cast<IndexExtent&>(d) = index;
  d.range_offsets.upload(index.range_offsets, stream);
  d.ranges.upload(index.ranges, stream);
  d.column_offsets.upload(index.column_offsets, stream);
  d.columns.upload(index.columns, stream);
  return d;
}

SparseIndex DeviceSparseIndex::download() const {
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  SparseIndex h;
  static_cast<IndexExtent&>(h) = *this;
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

DeviceWorkPlan DeviceWorkPlan::upload(const std::vector<int32_t>& order, const std::vector<SplitUnit>& units,
                                      int32_t num_items, cudaStream_t stream) {
  check(order.size() == static_cast<size_t>(num_items) + units.size(),
        "CUDA work plan: an order of " + std::to_string(order.size()) + " entries for " + std::to_string(num_items) +
            " items and " + std::to_string(units.size()) + " units");
  DeviceWorkPlan p;
  p.num_items = num_items;
  p.order.upload(order, stream);
  p.counter.resize(1);
  p.set_units(units, stream);
  return p;
}

void DeviceWorkPlan::set_units(const std::vector<SplitUnit>& list, cudaStream_t stream) {
  num_units = static_cast<int32_t>(list.size());
  std::vector<int4> u(list.size());
  std::vector<int4> m;
  for (size_t i = 0; i < list.size(); ++i) {
    u[i] = make_int4(list[i].item, list[i].tile_begin, list[i].tile_end, 0);
    if (m.empty() || m.back().x != list[i].item) {
      m.push_back(make_int4(list[i].item, static_cast<int>(i), 0, 0));
    }
    ++m.back().z;
  }
  num_merges = static_cast<int32_t>(m.size());
  units.upload(u, stream);
  merges.upload(m, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host vectors die here
}


}  // namespace tessera::attn::gpu
