// Device lowering of patterns to the range+column index (contract: lower_cuda.h; semantics: index/lower.cpp).
#include <algorithm>
#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <string>
#include <string_view>

#include "cuda/cuda_check.h"
#include "attention/cuda/lower_cuda.h"
#include "attention/cuda/lower_kernels.cuh"
#include "attention/cuda/work_plan.h"
#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::attn::gpu {

const char* index_build_mode_name(IndexBuildMode m) {
  static constexpr std::string_view kNames[] = {"per kind (warp for VS and BS, thread for others)", "warp per tile",
                                                "thread per tile"};  // in IndexBuildMode's order
  return enum_name(kNames, m).data();
}

DeviceHeadPattern describe_head(const Pattern& pattern, const LoweringContext& ctx) {
  DeviceHeadPattern d;
  if (const auto* a = std::get_if<AShapePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kStreaming;
    d.sink = a->sink;
    d.local = a->local;
  } else if (const auto* e = std::get_if<ElasticWindowPattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kStreaming;
    d.sink = e->sink;
    d.local = static_cast<int32_t>(std::max<int64_t>(1, e->span(ctx.n())));
  } else if (const auto* tri = std::get_if<TrianglePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kTriangle;
    d.sink = tri->sink;
    d.local = tri->local;
    d.last = tri->last;
  } else if (std::holds_alternative<VerticalSlashPattern>(pattern)) {
    d.kind = DeviceHeadPattern::kVerticalSlash;
  } else if (const auto* bs = std::get_if<BlockSparsePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kBlockSparse;
    d.bs_block = bs->block;
  }
  return d;
}

// total[0] += sum of the item costs (zeroed before the launch): a grid-stride loop, a warp then a block sum,
// one atomic per block (integers: the order of the additions does not matter).
constexpr int kSumThreads = 256, kSumItemsPerThread = 4;
__global__ void __launch_bounds__(kSumThreads) sum_costs_kernel(const int32_t* costs, int n,
                                                                unsigned long long* total) {
  __shared__ unsigned long long warp_sums[kSumThreads / 32];
  unsigned long long local = 0;
  for (int i = static_cast<int>(blockIdx.x * kSumThreads + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * kSumThreads))
    local += static_cast<unsigned long long>(costs[i]);
  for (int o = 16; o > 0; o /= 2) local += __shfl_xor_sync(0xffffffffu, local, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long block = 0;
    for (int w = 0; w < kSumThreads / 32; ++w) block += warp_sums[w];
    if (block != 0) atomicAdd(total, block);
  }
}

// Split-K (split_plan.h): the items that units replace leave the sort with cost 0 and entry -1 (their full
// costs were summed already); the units' own entries sit after the items' in the sort's input.
__global__ void split_fixup_kernel(const int4* units, int num_units, int32_t* costs, int32_t* items) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= num_units) return;
  costs[units[u].x] = 0;
  items[units[u].x] = -1;
}

DeviceIndexBuilder::DeviceIndexBuilder(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                                       const DeviceEstimates& estimates)
    : ctx_(ctx), num_heads_(static_cast<int32_t>(patterns.size())) {
  check(ctx.tile > 0 && ctx.q_begin >= 0 && ctx.q_len >= 0 && ctx.kv_len >= ctx.q_begin + ctx.q_len,
        "CUDA lowering: inconsistent context (tile " + std::to_string(ctx.tile) + ", q_begin " +
            std::to_string(ctx.q_begin) + ", q_len " + std::to_string(ctx.q_len) + ", kv_len " +
            std::to_string(ctx.kv_len) + ")");
  num_tiles_ = (ctx.q_len + ctx.tile - 1) / ctx.tile;
  std::vector<DeviceHeadPattern> heads(patterns.size());
  for (size_t h = 0; h < patterns.size(); ++h) {
    DeviceHeadPattern& d = heads[h];
    d = describe_head(patterns[h], ctx);
    if (d.kind == DeviceHeadPattern::kVerticalSlash) {
      const int slot = estimates.vs_slot(static_cast<int>(h));
      check(slot >= 0,
            "CUDA lowering: head " + std::to_string(h) + " runs vertical_slash but has no VS estimate");
      const VsHeadDesc& v = estimates.vs_heads()[static_cast<size_t>(slot)];
      d.columns = estimates.vs_columns() + v.column_base;
      d.num_columns = v.num_columns;
      d.offsets = estimates.vs_offsets() + v.offset_base;
      d.num_offsets = v.num_offsets;
    } else if (d.kind == DeviceHeadPattern::kBlockSparse) {
      const int slot = estimates.bs_slot(static_cast<int>(h));
      check(slot >= 0,
            "CUDA lowering: head " + std::to_string(h) + " runs block_sparse but has no BS estimate");
      const BsHeadDesc& b = estimates.bs_heads()[static_cast<size_t>(slot)];
      d.bs_offsets = estimates.bs_offsets() + b.offsets_base;
      d.bs_key_blocks = estimates.bs_key_blocks() + b.key_base;
      d.bs_first_q_block = b.first_q_block;
      d.bs_num_q_blocks = b.num_q_blocks;
    }
  }

  // Upper bounds of what a tile can hold (see the invariants in sparse_index.h): merged VS ranges are
  // disjoint, non-touching and, but for one clipped at 0, at least `rows` long.
  for (const DeviceHeadPattern& d : heads) {
    for (int32_t t = 0; t < num_tiles_; ++t) {
      const int64_t p0 = int64_t{ctx.q_begin} + int64_t{t} * ctx.tile;
      const int64_t rows = std::min<int64_t>(ctx.tile, ctx.q_len - int64_t{t} * ctx.tile);
      const int64_t p1 = p0 + rows;
      const int64_t key_end = std::min<int64_t>(ctx.kv_len, p1);
      switch (d.kind) {
        case DeviceHeadPattern::kDense:
          range_capacity_ += 1;
          break;
        case DeviceHeadPattern::kStreaming:
        case DeviceHeadPattern::kTriangle:
          range_capacity_ += 2;
          break;
        case DeviceHeadPattern::kVerticalSlash:
          range_capacity_ += std::min<int64_t>(d.num_offsets, key_end / (rows + 1) + 1);
          column_capacity_ += std::min<int64_t>(d.num_columns, key_end);
          break;
        case DeviceHeadPattern::kBlockSparse: {
          const int64_t nq = (p1 - 1) / d.bs_block - p0 / d.bs_block + 1;
          const auto& bs = std::get<BlockSparsePattern>(patterns[static_cast<size_t>(&d - heads.data())]);
          range_capacity_ += std::min<int64_t>(nq * bs.top_k, (key_end + d.bs_block - 1) / d.bs_block);
          break;
        }
        default:
          break;
      }
    }
  }
  check(range_capacity_ < INT32_MAX && column_capacity_ < INT32_MAX,
        "CUDA lowering: the index of this layer could exceed 2^31 entries");
  int64_t run_entries = 0;  // VS runs (vs_runs_kernel): num_offsets + 1 entries per VS head
  for (DeviceHeadPattern& d : heads) {
    if (d.kind == DeviceHeadPattern::kVerticalSlash) {
      has_vs_ = true;
      d.run_base = static_cast<int32_t>(run_entries);
      run_entries += int64_t{d.num_offsets} + 1;
    } else if (d.kind == DeviceHeadPattern::kBlockSparse) {
      has_bs_ = true;
    } else {
      has_other_ = true;
    }
  }
  check(run_entries < INT32_MAX, "CUDA lowering: too many VS offsets in this layer");
  heads_.upload(heads);
  run_breaks_.resize(static_cast<size_t>(std::max<int64_t>(run_entries, 1)));
  run_tiles_.resize(static_cast<size_t>(std::max<int64_t>(run_entries, 1)));
  run_count_.resize(static_cast<size_t>(std::max(num_heads_, 1)));
  // VS column coverage (vs_cover_kernel): bits 0 .. q_begin + q_len (u = p1 - c <= p1) per head.
  cover_words_ = static_cast<int32_t>((int64_t{ctx.q_begin} + ctx.q_len) / 32 + 1);
  if (has_vs_) cover_.resize(static_cast<size_t>(num_heads_) * static_cast<size_t>(cover_words_));

  const int n_items = num_heads_ * num_tiles_;
  // Split-K (split_plan.h) over the static heads, whose item costs the host knows (lower_tile, as the device
  // computes them); estimated heads count as 0 and are never cut.
  {
    std::vector<int32_t> costs(static_cast<size_t>(n_items), 0);
    std::vector<uint8_t> splittable(static_cast<size_t>(n_items), 0);
    bool any = false;
    for (int32_t h = 0; h < num_heads_; ++h) {
      const DeviceHeadPattern& d = heads[static_cast<size_t>(h)];
      if (d.kind != DeviceHeadPattern::kDense && d.kind != DeviceHeadPattern::kStreaming &&
          d.kind != DeviceHeadPattern::kTriangle) {
        continue;
      }
      any = true;
      for (int32_t t = 0; t < num_tiles_; ++t) {
        const size_t item = static_cast<size_t>(h) * static_cast<size_t>(num_tiles_) + static_cast<size_t>(t);
        costs[item] =
            lower_tile(d, tile_geometry(t, ctx.tile, ctx.q_begin, ctx.q_len, ctx.kv_len, ctx.n()), nullptr, nullptr)
                .cost;
        splittable[item] = 1;
      }
    }
    if (any) split_units_ = plan_splits(costs, current_device_info().num_sms, splittable);
  }
  const int n_sort = n_items + static_cast<int>(split_units_.size());
  range_counts_.resize(static_cast<size_t>(n_items) + 1);
  column_counts_.resize(static_cast<size_t>(n_items) + 1);
  costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  sorted_costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  items_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  if (!split_units_.empty()) {  // the units' sort entries (the count pass writes the items' each build)
    std::vector<int32_t> unit_costs, unit_items;
    for (size_t u = 0; u < split_units_.size(); ++u) {
      unit_costs.push_back(split_unit_cost(split_units_[u]));
      unit_items.push_back(n_items + static_cast<int32_t>(u));
    }
    TESSERA_CUDA_CHECK(cudaMemcpy(costs_.data() + n_items, unit_costs.data(), unit_costs.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
    TESSERA_CUDA_CHECK(cudaMemcpy(items_.data() + n_items, unit_items.data(), unit_items.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
  }
  size_t scan_bytes = 0, sort_bytes = 0;
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, range_counts_.data(),
                                                   range_counts_.data(), n_items + 1));
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(),
                                                               items_.data(), std::max(n_sort, 1)));
  scan_temp_.resize(std::max<size_t>(scan_bytes, 1));
  sort_temp_.resize(std::max<size_t>(sort_bytes, 1));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // heads_ was uploaded from a local vector
}

void DeviceIndexBuilder::build(DeviceSparseIndex& index, DeviceWorkPlan& plan, cudaStream_t stream) {
  const int n_items = num_heads_ * num_tiles_;
  index.num_heads = num_heads_;
  index.tile = ctx_.tile;
  index.q_begin = ctx_.q_begin;
  index.q_len = ctx_.q_len;
  index.kv_len = ctx_.kv_len;
  index.range_offsets.resize(static_cast<size_t>(n_items) + 1);
  index.column_offsets.resize(static_cast<size_t>(n_items) + 1);
  index.ranges.resize(static_cast<size_t>(std::max<int64_t>(range_capacity_, 1)));
  index.columns.resize(static_cast<size_t>(std::max<int64_t>(column_capacity_, 1)));
  const bool split = split_ && !split_units_.empty();
  const int n_sort = n_items + (split ? static_cast<int>(split_units_.size()) : 0);
  plan.num_items = n_items;
  plan.order.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  plan.counter.resize(1);
  if (!split) {
    plan.num_units = 0;
    plan.num_merges = 0;
  } else if (plan.num_units != static_cast<int32_t>(split_units_.size()) || plan.units.size() < split_units_.size()) {
    plan.set_units(split_units_, stream);  // once per plan object (synchronises stream)
  }

  LowerParams p;
  p.heads = heads_.data();
  p.num_tiles = num_tiles_;
  p.tile = ctx_.tile;
  p.q_begin = ctx_.q_begin;
  p.q_len = ctx_.q_len;
  p.kv_len = ctx_.kv_len;
  p.num_items = n_items;
  p.n_total = ctx_.n();
  p.range_counts = range_counts_.data();
  p.column_counts = column_counts_.data();
  p.costs = costs_.data();
  p.items = items_.data();
  p.range_offsets = index.range_offsets.data();
  p.ranges = index.ranges.data();
  p.column_offsets = index.column_offsets.data();
  p.columns = index.columns.data();
  p.range_capacity = static_cast<int64_t>(index.ranges.size());
  p.column_capacity = static_cast<int64_t>(index.columns.size());

  constexpr int kThreads = 128;
  constexpr int kWarpItemsPerBlock = kWarpKernelThreads / 32;
  // Which kernel lowers which heads: (warp kernel's selection or -1, thread kernel's selection or -1).
  int32_t warp_sel = -1, thread_sel = -1;
  switch (mode_) {
    case IndexBuildMode::kWarp:
      warp_sel = kSelectAll;
      break;
    case IndexBuildMode::kThread:
      thread_sel = kSelectAll;
      break;
    case IndexBuildMode::kPerKind:
      if ((has_vs_ || has_bs_) && has_other_) {
        warp_sel = kSelectWarpKinds;
        thread_sel = kSelectOthers;
      } else if (has_vs_ || has_bs_) {
        warp_sel = kSelectAll;
      } else {
        thread_sel = kSelectAll;
      }
      break;
  }
  // VS heads lowered by the warp kernel: their runs first (one block per head; others return at once), then
  // the column coverage (a thread per word; heads without runs return at once).
  if (warp_sel >= 0 && has_vs_ && num_tiles_ > 0) {
    p.use_runs = 1;
    p.run_breaks = run_breaks_.data();
    p.run_tiles = run_tiles_.data();
    p.run_count = run_count_.data();
    vs_runs_kernel<<<num_heads_, 512, 0, stream>>>(p);
    check_launch("vs_runs_kernel");
    p.cover = cover_.data();
    p.cover_words = cover_words_;
    const dim3 cover_grid(static_cast<unsigned>(num_heads_), static_cast<unsigned>((cover_words_ + 255) / 256));
    vs_cover_kernel<<<cover_grid, 256, 0, stream>>>(p);
    check_launch("vs_cover_kernel");
  }
  // Both kernels write the extra (num_items-th) zero count, with the same values.
  if (warp_sel >= 0) {
    p.select = warp_sel;
    lower_count_warp_kernel<<<(n_items + 1 + kWarpItemsPerBlock - 1) / kWarpItemsPerBlock, kWarpKernelThreads,
                              0, stream>>>(p);
    check_launch("lower_count_warp_kernel");
  }
  if (thread_sel >= 0) {
    p.select = thread_sel;
    lower_count_kernel<<<(n_items + 1 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
    check_launch("lower_count_kernel");
  }
  size_t bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, range_counts_.data(),
                                                   index.range_offsets.data(), n_items + 1, stream));
  bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, column_counts_.data(),
                                                   index.column_offsets.data(), n_items + 1, stream));
  if (n_items == 0) return;
  if (warp_sel >= 0) {
    p.select = warp_sel;
    lower_fill_warp_kernel<<<(n_items + kWarpItemsPerBlock - 1) / kWarpItemsPerBlock, kWarpKernelThreads, 0,
                             stream>>>(p);
    check_launch("lower_fill_warp_kernel");
  }
  if (thread_sel >= 0) {
    p.select = thread_sel;
    lower_fill_kernel<<<(n_items + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
    check_launch("lower_fill_kernel");
  }
  // The items' full costs are summed before the split fixup zeroes the cut items' entries.
  total_cost_.resize(1);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(total_cost_.data(), 0, sizeof(unsigned long long), stream));
  constexpr int kSumItemsPerBlock = kSumThreads * kSumItemsPerThread;
  const int sum_blocks = std::min((n_items + kSumItemsPerBlock - 1) / kSumItemsPerBlock, 1024);
  sum_costs_kernel<<<sum_blocks, kSumThreads, 0, stream>>>(costs_.data(), n_items, total_cost_.data());
  check_launch("sum_costs_kernel");
  if (split) {
    split_fixup_kernel<<<(plan.num_units + 127) / 128, 128, 0, stream>>>(plan.units.data(), plan.num_units,
                                                                         costs_.data(), items_.data());
    check_launch("split_fixup_kernel");
  }
  bytes = sort_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(sort_temp_.data(), bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(),
                                                               plan.order.data(), n_sort, 0, 32, stream));
}

int64_t DeviceIndexBuilder::download_total_cost(cudaStream_t stream) const {
  if (num_heads_ * num_tiles_ == 0 || total_cost_.size() == 0) return 0;
  unsigned long long total = 0;
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(&total, total_cost_.data(), sizeof total, cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<int64_t>(total);
}

}  // namespace tessera::attn::gpu
