// Device lowering of patterns to the range+column index (contract: lower_cuda.h; semantics: index/lower.cpp).
#include "attention/cuda/lower_cuda.h"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>
#include <string>

#include "attention/cuda/cuda_check.h"
#include "attention/cuda/work_plan.h"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace {

struct LowerParams {
  const DeviceHeadPattern* heads = nullptr;
  int32_t num_tiles = 0, tile = 0, q_begin = 0, q_len = 0, kv_len = 0, num_items = 0;
  int64_t n_total = 0;  // N of the prompt (Triangle's last rows)
  int32_t* range_counts = nullptr;
  int32_t* column_counts = nullptr;
  int32_t* costs = nullptr;
  int32_t* items = nullptr;
  const int32_t* range_offsets = nullptr;
  int2* ranges = nullptr;
  const int32_t* column_offsets = nullptr;
  int32_t* columns = nullptr;
};

// Receives intervals in ascending order of begin; clips them to [0, key_end) and merges overlapping or touching
// ones, as TileBuilder::emit does on the CPU.
template <bool kWrite>
struct RangeEmitter {
  int64_t key_end = 0;
  int2* out = nullptr;
  int32_t count = 0;
  int32_t key_tiles = 0;
  int64_t cb = 0, ce = 0;
  bool open = false;

  __device__ void add(int64_t b, int64_t e) {
    b = b < 0 ? 0 : b;
    e = e < key_end ? e : key_end;
    if (b >= e) return;
    if (open && b <= ce) {
      ce = e > ce ? e : ce;
      return;
    }
    flush();
    cb = b;
    ce = e;
    open = true;
  }
  __device__ void flush() {
    if (!open) return;
    if constexpr (kWrite) out[count] = make_int2(static_cast<int>(cb), static_cast<int>(ce));
    key_tiles += static_cast<int32_t>((ce - cb + kPrefillKeyTile - 1) / kPrefillKeyTile);
    ++count;
    open = false;
  }
};

// First index in [lo, hi) of the ascending array a whose value is > x (hi when none).
__device__ int upper_bound(const int32_t* a, int lo, int hi, int64_t x) {
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a[mid] <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <bool kWrite>
__device__ void lower_item(const LowerParams& p, int item, int32_t& num_ranges, int32_t& num_columns,
                           int32_t& cost) {
  const int h = item / p.num_tiles, t = item - h * p.num_tiles;
  const DeviceHeadPattern hp = p.heads[h];
  const int64_t p0 = int64_t{p.q_begin} + int64_t{t} * p.tile;
  const int64_t rows = min(p.tile, p.q_len - t * p.tile);
  const int64_t p1 = p0 + rows;
  const int64_t key_end = min(int64_t{p.kv_len}, p1);
  RangeEmitter<kWrite> em;
  em.key_end = key_end;
  if constexpr (kWrite) em.out = p.ranges + p.range_offsets[item];

  auto streaming = [&]() {
    em.add(0, hp.sink);
    em.add(p0 - hp.local + 1, p1);
  };
  switch (hp.kind) {
    case DeviceHeadPattern::kDense: em.add(0, p1); break;
    case DeviceHeadPattern::kStreaming: streaming(); break;
    case DeviceHeadPattern::kTriangle:
      if (p1 - 1 >= p.n_total - hp.last) {
        em.add(0, p1);
      } else {
        streaming();
      }
      break;
    case DeviceHeadPattern::kVerticalSlash:
      // Offsets ascending -> intervals [p0 - o, p1 - o) with descending begins: walk them backwards.
      for (int i = hp.num_offsets - 1; i >= 0; --i) em.add(p0 - hp.offsets[i], p1 - hp.offsets[i]);
      break;
    case DeviceHeadPattern::kBlockSparse: {
      // Union of the key blocks chosen by every query block the tile touches: a merge of sorted lists, taking
      // the smallest block above the last one emitted.
      const int64_t blk = hp.bs_block;
      const int64_t qb_first = p0 / blk, qb_last = (p1 - 1) / blk;
      int64_t last = -1;
      for (;;) {
        int64_t next = INT64_MAX;
        for (int64_t qb = qb_first; qb <= qb_last; ++qb) {
          const int64_t e = qb - hp.bs_first_q_block;
          if (e < 0 || e >= hp.bs_num_q_blocks) continue;
          const int lo = hp.bs_offsets[e], hi = hp.bs_offsets[e + 1];
          const int i = upper_bound(hp.bs_key_blocks, lo, hi, last);
          if (i < hi && hp.bs_key_blocks[i] < next) next = hp.bs_key_blocks[i];
        }
        if (next == INT64_MAX) break;
        em.add(next * blk, (next + 1) * blk);
        last = next;
      }
      break;
    }
    default: break;
  }
  em.flush();

  // Columns (VS): ascending, below key_end, in no range, no duplicates. Column c lies in the interval of
  // offset o iff p0 - c <= o < p1 - c; `i` tracks the first offset >= p0 - c, which moves left as c grows.
  int32_t nc = 0;
  if (hp.kind == DeviceHeadPattern::kVerticalSlash) {
    int32_t* out = nullptr;
    if constexpr (kWrite) out = p.columns + p.column_offsets[item];
    int i = hp.num_offsets;
    int64_t prev = -1;
    for (int j = 0; j < hp.num_columns; ++j) {
      const int64_t c = hp.columns[j];
      if (c < 0) continue;
      if (c >= key_end) break;
      while (i > 0 && hp.offsets[i - 1] >= p0 - c) --i;
      if (i < hp.num_offsets && hp.offsets[i] < p1 - c) continue;
      if (c == prev) continue;
      if constexpr (kWrite) out[nc] = static_cast<int32_t>(c);
      ++nc;
      prev = c;
    }
  }
  num_ranges = em.count;
  num_columns = nc;
  cost = 1 + em.key_tiles + (nc + kPrefillKeyTile - 1) / kPrefillKeyTile;
}

__global__ void lower_count_kernel(const LowerParams p) {
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item > p.num_items) return;
  if (item == p.num_items) {  // the scans run over num_items + 1 counts so that the last offset is the total
    p.range_counts[item] = 0;
    p.column_counts[item] = 0;
    return;
  }
  int32_t nr = 0, nc = 0, cost = 0;
  lower_item<false>(p, item, nr, nc, cost);
  p.range_counts[item] = nr;
  p.column_counts[item] = nc;
  p.costs[item] = cost;
  p.items[item] = item;
}

__global__ void lower_fill_kernel(const LowerParams p) {
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= p.num_items) return;
  int32_t nr = 0, nc = 0, cost = 0;
  lower_item<true>(p, item, nr, nc, cost);
}

}  // namespace

DeviceIndexBuilder::DeviceIndexBuilder(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                                       const DeviceEstimates& estimates)
    : ctx_(ctx), num_heads_(static_cast<int32_t>(patterns.size())) {
  check(ctx.tile > 0 && ctx.q_begin >= 0 && ctx.q_len >= 0 && ctx.kv_len >= ctx.q_begin + ctx.q_len,
        "CUDA lowering: inconsistent context (tile " + std::to_string(ctx.tile) + ", q_begin " +
            std::to_string(ctx.q_begin) + ", q_len " + std::to_string(ctx.q_len) + ", kv_len " +
            std::to_string(ctx.kv_len) + ")");
  num_tiles_ = (ctx.q_len + ctx.tile - 1) / ctx.tile;
  const int64_t n = ctx.n();
  std::vector<DeviceHeadPattern> heads(patterns.size());
  for (size_t h = 0; h < patterns.size(); ++h) {
    DeviceHeadPattern& d = heads[h];
    const Pattern& pat = patterns[h];
    if (const auto* a = std::get_if<AShapePattern>(&pat)) {
      d.kind = DeviceHeadPattern::kStreaming;
      d.sink = a->sink;
      d.local = a->local;
    } else if (const auto* e = std::get_if<ElasticWindowPattern>(&pat)) {
      d.kind = DeviceHeadPattern::kStreaming;
      d.sink = e->sink;
      d.local = static_cast<int32_t>(std::max<int64_t>(1, e->span(n)));
    } else if (const auto* tri = std::get_if<TrianglePattern>(&pat)) {
      d.kind = DeviceHeadPattern::kTriangle;
      d.sink = tri->sink;
      d.local = tri->local;
      d.last = tri->last;
    } else if (std::holds_alternative<VerticalSlashPattern>(pat)) {
      const int slot = estimates.vs_slot(static_cast<int>(h));
      check(slot >= 0, "CUDA lowering: head " + std::to_string(h) + " runs vertical_slash but has no VS estimate");
      const VsHeadDesc& v = estimates.vs_heads()[static_cast<size_t>(slot)];
      d.kind = DeviceHeadPattern::kVerticalSlash;
      d.columns = estimates.vs_columns() + v.column_base;
      d.num_columns = v.num_columns;
      d.offsets = estimates.vs_offsets() + v.offset_base;
      d.num_offsets = v.num_offsets;
    } else if (std::holds_alternative<BlockSparsePattern>(pat)) {
      const int slot = estimates.bs_slot(static_cast<int>(h));
      check(slot >= 0, "CUDA lowering: head " + std::to_string(h) + " runs block_sparse but has no BS estimate");
      const BsHeadDesc& b = estimates.bs_heads()[static_cast<size_t>(slot)];
      d.kind = DeviceHeadPattern::kBlockSparse;
      d.bs_offsets = estimates.bs_offsets() + b.offsets_base;
      d.bs_key_blocks = estimates.bs_key_blocks() + b.key_base;
      d.bs_first_q_block = b.first_q_block;
      d.bs_num_q_blocks = b.num_q_blocks;
      d.bs_block = b.block;
    }
  }

  // Upper bounds of what a tile can hold (see the invariants in sparse_index.h): merged VS ranges are disjoint,
  // non-touching and, but for one clipped at 0, at least `rows` long.
  for (const DeviceHeadPattern& d : heads) {
    for (int32_t t = 0; t < num_tiles_; ++t) {
      const int64_t p0 = int64_t{ctx.q_begin} + int64_t{t} * ctx.tile;
      const int64_t rows = std::min<int64_t>(ctx.tile, ctx.q_len - int64_t{t} * ctx.tile);
      const int64_t p1 = p0 + rows;
      const int64_t key_end = std::min<int64_t>(ctx.kv_len, p1);
      switch (d.kind) {
        case DeviceHeadPattern::kDense: range_capacity_ += 1; break;
        case DeviceHeadPattern::kStreaming:
        case DeviceHeadPattern::kTriangle: range_capacity_ += 2; break;
        case DeviceHeadPattern::kVerticalSlash:
          range_capacity_ += std::min<int64_t>(d.num_offsets, key_end / (rows + 1) + 1);
          column_capacity_ += std::min<int64_t>(d.num_columns, key_end);
          break;
        case DeviceHeadPattern::kBlockSparse: {
          const int64_t nq = (p1 - 1) / d.bs_block - p0 / d.bs_block + 1;
          const auto* bs = std::get_if<BlockSparsePattern>(&patterns[static_cast<size_t>(&d - heads.data())]);
          range_capacity_ += std::min<int64_t>(nq * bs->top_k, (key_end + d.bs_block - 1) / d.bs_block);
          break;
        }
        default: break;
      }
    }
  }
  check(range_capacity_ < INT32_MAX && column_capacity_ < INT32_MAX,
        "CUDA lowering: the index of this layer could exceed 2^31 entries");
  heads_.upload(heads);

  const int n_items = num_heads_ * num_tiles_;
  range_counts_.resize(static_cast<size_t>(n_items) + 1);
  column_counts_.resize(static_cast<size_t>(n_items) + 1);
  costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_items)));
  sorted_costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_items)));
  items_.resize(std::max<size_t>(1, static_cast<size_t>(n_items)));
  size_t scan_bytes = 0, sort_bytes = 0;
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, range_counts_.data(), range_counts_.data(),
                                                   n_items + 1));
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(), items_.data(),
                                                               std::max(n_items, 1)));
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
  plan.num_items = n_items;
  plan.order.resize(std::max<size_t>(1, static_cast<size_t>(n_items)));
  plan.counter.resize(1);

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
  p.ranges = reinterpret_cast<int2*>(index.ranges.data());
  p.column_offsets = index.column_offsets.data();
  p.columns = index.columns.data();

  constexpr int kThreads = 128;
  lower_count_kernel<<<(n_items + 1 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
  check_launch("lower_count_kernel");
  size_t bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, range_counts_.data(),
                                                   index.range_offsets.data(), n_items + 1, stream));
  bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, column_counts_.data(),
                                                   index.column_offsets.data(), n_items + 1, stream));
  if (n_items == 0) return;
  lower_fill_kernel<<<(n_items + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
  check_launch("lower_fill_kernel");
  bytes = sort_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(sort_temp_.data(), bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(), plan.order.data(),
                                                               n_items, 0, 32, stream));
}

}  // namespace tessera::attn::gpu
