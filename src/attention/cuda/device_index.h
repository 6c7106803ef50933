// tessera/attention/cuda/device_index.h — the sparse index and its work plan in device memory.
//
// The same CSR layout as attention/index/sparse_index.h, byte for byte: range_offsets and column_offsets
// (num_heads * num_tiles + 1 entries, item (h, t) at h * num_tiles + t), ranges as {begin, end} int32 pairs,
// columns as int32. A device-built index (lower_cuda.h) is allocated to an upper bound computed on the host,
// so its arrays may be longer than used: the used lengths are the last offsets, which stay on the device
// (nothing in the run path synchronises with the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "attention/index/sparse_index.h"
#include "attention/index/split_plan.h"

namespace tessera::attn::gpu {

struct DeviceSparseIndex : IndexExtent {
  DeviceBuffer<int32_t> range_offsets;
  DeviceBuffer<KeyRange> ranges;
  DeviceBuffer<int32_t> column_offsets;
  DeviceBuffer<int32_t> columns;

  // Copies a host index (asynchronous on `stream`; the host vectors must outlive the copy, i.e. until the
  // stream is synchronised; pageable memory makes the copy effectively synchronous anyway).
  static DeviceSparseIndex upload(const SparseIndex& index, cudaStream_t stream = nullptr);
  // Synchronous copy back, trimmed to the used lengths.
  SparseIndex download() const;
};

// The execution order of the items and the counter the persistent CTAs take items with; with split-K
// (attention/index/split_plan.h) also the units, the merge groups and the units' scratch.
struct DeviceWorkPlan {
  int32_t num_items = 0;
  int32_t num_units = 0;          // split units: order holds num_items + num_units entries
  DeviceBuffer<int32_t> order;    // item numbers (or num_items + unit, or -1 for a split item), heaviest first
  DeviceBuffer<int32_t> counter;  // 1 entry; reset by the executor before each launch
  DeviceBuffer<int4> units;       // {item, first key tile, end key tile, 0} per unit
  DeviceBuffer<int4> merges;      // {item, first unit, unit count, 0} per split item (its units are consecutive)
  int32_t num_merges = 0;
  DeviceBuffer<float> part_o, part_lse;  // the units' rows (sized by the executor: units x tile x head_dim)

  // A plan without splits (order: num_items item numbers).
  static DeviceWorkPlan upload(const std::vector<int32_t>& order, cudaStream_t stream = nullptr);
  // A plan with split units: order = order_with_splits(costs, units) of num_items items. Synchronous.
  static DeviceWorkPlan upload(const std::vector<int32_t>& order, const std::vector<SplitUnit>& units,
                               int32_t num_items, cudaStream_t stream = nullptr);
  // Sets the units and merge groups (units as plan_splits returns them). Synchronous.
  void set_units(const std::vector<SplitUnit>& units, cudaStream_t stream = nullptr);
  std::vector<int32_t> download() const {
    return order.download(static_cast<size_t>(num_items) + static_cast<size_t>(num_units));
  }
};

}  // namespace tessera::attn::gpu
