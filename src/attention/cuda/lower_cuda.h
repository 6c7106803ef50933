// tessera/attention/cuda/lower_cuda.h — building the range+column index and its work plan on the GPU.
//
// The device twin of attention/index/lower.h (lower_layer), whose semantics are the contract: the index it
// builds is byte-identical to the CPU lowering of the same patterns and estimates. Per (head, query tile) the
// pattern's key intervals are generated in ascending order, clipped to [0, tile_key_end) and merged (touching
// intervals merge), then the VS columns that fall in no range are appended. Three launches per layer plus
// CUB: count (one thread per item), exclusive scans of the counts, fill; then the heaviest-first work order
// (work_plan.h) by a stable descending radix sort of the item costs, which the count pass computes.
//
// The index is allocated to an upper bound computed on the host from the patterns and the shape, so nothing
// in build() synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "attention/cuda/device_index.h"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/lower_tile.h"
#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn::gpu {

// The static part of a head's descriptor: kind and window parameters (an elastic window resolved to its span
// for ctx.n()); the estimate pointers are left null for the caller to set.
DeviceHeadPattern describe_head(const Pattern& pattern, const LoweringContext& ctx);

// How the count and fill passes map (head, tile) items to threads.
//   kPerKind (default): a warp per tile for vertical-slash and block-sparse heads, a thread per tile for every
//     other kind (a layer with both runs two launches per pass, each on its heads' items). Measured on the
//     H200 (run 3): VS warp 0.24 / 0.49 / 1.4 ms vs thread 2.4 / 3.4 / 3.8 ms at 8K / 32K / 128K; BS was
//     thread-per-tile until the warp kernel got its own BS path (docs/PERF.md history, "Index build v3"; before it, BS warp
//     0.33 / 0.99 / 3.4 ms vs thread 0.40 / 0.49 / 0.70 ms, lane 0 alone).
//   kWarp: a warp per tile for every head (dense / streaming / triangle on lane 0). kThread: a thread per tile
//     for every head.
// All three build the same index (DeviceIndexTest checks each against the CPU lowering).
enum class IndexBuildMode { kPerKind, kWarp, kThread };
const char* index_build_mode_name(IndexBuildMode m);

class DeviceIndexBuilder {
 public:
  DeviceIndexBuilder() = default;
  // `estimates` must hold the layout for the same patterns and context and outlive the builder.
  DeviceIndexBuilder(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                     const DeviceEstimates& estimates);

  // Builds the index into `index` (allocated here on first use) and the work order into `plan`.
  // Asynchronous on `stream`.
  void build(DeviceSparseIndex& index, DeviceWorkPlan& plan, cudaStream_t stream);

  // IndexBuildMode above (default kPerKind).
  void set_mode(IndexBuildMode m) { mode_ = m; }
  IndexBuildMode mode() const { return mode_; }
  // Shorthands kept for the older callers: true = kWarp, false = kThread.
  void set_warp_per_tile(bool on) { mode_ = on ? IndexBuildMode::kWarp : IndexBuildMode::kThread; }

  // Sum of the item costs (work_plan.h: 1 + key tiles per item) of the last build(): synchronises `stream`
  // (a 8-byte copy). The dense fallback of CudaLayerAttention compares it with the dense index's cost.
  int64_t download_total_cost(cudaStream_t stream = nullptr) const;

  // Split-K (attention/index/split_plan.h, default on): items of static heads (dense, streaming, triangle) that
  // cost more than a CTA's share of the layer (the device's SM count) run as units of key tiles, merged after
  // the kernel. The units are planned once, here, from the shape; estimated heads are never cut.
  void set_split(bool on) { split_ = on; }
  const std::vector<SplitUnit>& split_units() const { return split_units_; }

  int64_t range_capacity() const { return range_capacity_; }
  int64_t column_capacity() const { return column_capacity_; }

 private:
  LoweringContext ctx_;
  int32_t num_heads_ = 0;
  int32_t num_tiles_ = 0;
  int64_t range_capacity_ = 0;
  int64_t column_capacity_ = 0;
  IndexBuildMode mode_ = IndexBuildMode::kPerKind;
  bool split_ = true;
  std::vector<SplitUnit> split_units_;
  // Head kinds of the layer (kPerKind's launches): VS, BS, any other.
  bool has_vs_ = false, has_bs_ = false, has_other_ = false;
  DeviceBuffer<DeviceHeadPattern> heads_;
  DeviceBuffer<int32_t> range_counts_, column_counts_, costs_, sorted_costs_, items_;
  DeviceBuffer<unsigned long long> total_cost_;  // 1 entry: sum of costs_ (build())
  DeviceBuffer<unsigned char> scan_temp_, sort_temp_;
  // VS runs (lower_cuda.cu vs_runs_kernel): breaks and key-tile prefix sums per VS head, count per head.
  DeviceBuffer<int32_t> run_breaks_, run_tiles_, run_count_;
  // VS column coverage (vs_cover_kernel): cover_words_ words per head (allocated when the layer has VS heads).
  DeviceBuffer<uint32_t> cover_;
  int32_t cover_words_ = 0;
};

}  // namespace tessera::attn::gpu
