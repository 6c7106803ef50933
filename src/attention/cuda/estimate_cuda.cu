// Device estimators for vertical-slash and block-sparse heads (contract: estimate_cuda.h).
//
// VS, per head, in five launches over all VS heads of the layer at once:
//   1. vs_stats: a CTA per chunk of keys (512-2048) and group of up to four VS heads of one kv head (each K tile
//   loaded once for the group), each of the 64 last rows' running max and sum of exp (tensor-core scores);
//   2. vs_merge_stats: the row maxima and normalisers over all chunks;
//   3. vs_sums (same grid): A = exp(s - m) / l tile by tile into shared memory; column sums go straight to
//      memory (each key belongs to one chunk); diagonal sums are accumulated per chunk over the band of offsets
//      the chunk touches (chunk + 63 offsets) in a fixed order and stored per chunk;
//   4. vs_merge_diag: each offset sums the (at most two) chunk bands that cover it, in chunk order;
//   5. vs_topk: forced prefix, then VsTopK (block_topk.cuh's selection rule) over the rest, for columns and
//      offsets; for adaptive heads (gamma > 0) first the count from the coverage target (VsCoverage).
// Everything is deterministic (no atomics on floats).
// BS: pool K per kv head (one pool per distinct block size), pool Q per head, then per wave a tiled f32
// scoring kernel (the scores of v1 bit for bit) into a scratch buffer and a warp per query block selecting
// from it with WarpTopK (bs_score_kernels.cuh, bs_select_kernels.cuh); for adaptive heads (gamma > 0) every
// query block past the first is scored and the warp first counts its blocks by the coverage target (BsCoverage).
// The kernels, their parameters and the BS plan are in estimate_kernels.cuh (by concern: vs_estimate_kernels.cuh,
// vs_select_kernels.cuh, bs_score_kernels.cuh, bs_select_kernels.cuh); this file has the launches and the host
// side of DeviceEstimates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/estimate_kernels.cuh"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace {

int64_t g_bs_wave_floats = int64_t{16} << 20;  // scores per wave (DeviceEstimates::set_bs_wave_floats)
int g_vs_chunk_keys = 0;                       // VS keys per CTA, 0: by size (DeviceEstimates::set_vs_chunk_keys)

// The inputs both estimators read: q and k (their data and token / head strides) and the call's query rows.
template <typename Params>
void set_inputs(Params& p, const TensorView& q, const TensorView& k, const LoweringContext& ctx) {
  p.q = q.data;
  p.k = k.data;
  p.q_tok = q.stride[0];
  p.q_head = q.stride[1];
  p.k_tok = k.stride[0];
  p.k_head = k.stride[1];
  p.q_len = ctx.q_len;
  p.q_begin = ctx.q_begin;
}

// launch.template operator()<T, D>() for the element type (bf16 when bf, else f16) and a head_dim d of 64, 128
// or 256 (none for another d; estimate() checks it first).
template <typename Launch>
void for_dtype_and_dim(bool bf, int d, Launch&& launch) {
  if (bf) {
    if (d == 64) launch.template operator()<__nv_bfloat16, 64>();
    if (d == 128) launch.template operator()<__nv_bfloat16, 128>();
    if (d == 256) launch.template operator()<__nv_bfloat16, 256>();
  } else {
    if (d == 64) launch.template operator()<__half, 64>();
    if (d == 128) launch.template operator()<__half, 128>();
    if (d == 256) launch.template operator()<__half, 256>();
  }
}

template <typename T, int D>
void launch_vs(const VsParams& p, int num_heads, int num_groups, cudaStream_t stream) {
  constexpr int kThreads = 128 * vs_group<D>();
  const size_t smem_scores = size_t{kVsStages} * 64u * D * sizeof(T) + 1024u;  // + alignment (vs_smem_base)
  const size_t smem_sums =
      smem_scores + size_t{vs_group<D>()} * static_cast<size_t>(vs_sums_head_floats(p.chunk_keys)) * sizeof(float);
  check(p.chunks <= 65535, "CUDA estimate: " + std::to_string(p.keys) + " keys are too many for the VS grid");
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(vs_stats_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_scores)));
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(vs_sums_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_sums)));
  const dim3 grid(static_cast<unsigned>(num_groups), static_cast<unsigned>(p.chunks));
  vs_stats_kernel<T, D><<<grid, kThreads, smem_scores, stream>>>(p);
  check_launch("vs_stats_kernel");
  vs_merge_stats_kernel<<<num_heads, kVsRows, 0, stream>>>(p);
  check_launch("vs_merge_stats_kernel");
  vs_sums_kernel<T, D><<<grid, kThreads, smem_sums, stream>>>(p);
  check_launch("vs_sums_kernel");
  vs_merge_diag_kernel<<<dim3(static_cast<unsigned>((p.keys + 255) / 256), static_cast<unsigned>(num_heads)),
                         256, 0, stream>>>(p);
  check_launch("vs_merge_diag_kernel");
  vs_topk_kernel<<<dim3(static_cast<unsigned>(num_heads), 2), kTopKThreads, 0, stream>>>(p);
  check_launch("vs_topk_kernel");
}

template <typename T, int D>
void launch_bs(const BsParams& p, int num_heads, int num_kv_heads, const std::vector<int32_t>& block_sizes,
               const std::vector<int64_t>& pool_base, const std::vector<BsWave>& waves, bool adaptive,
               cudaStream_t stream) {
  const int q_end = p.q_begin + p.q_len;
  constexpr int kPerCta = kBsPoolThreads / (D / 8);  // blocks pooled per CTA
  for (size_t i = 0; i < block_sizes.size(); ++i) {
    const int b = block_sizes[i];
    const int nkb = (q_end + b - 1) / b;
    bs_pool_k_kernel<T, D>
        <<<dim3(static_cast<unsigned>((nkb + kPerCta - 1) / kPerCta), static_cast<unsigned>(num_kv_heads)),
           kBsPoolThreads, 0, stream>>>(p, b, nkb, p.kpool + pool_base[i]);
    check_launch("bs_pool_k_kernel");
  }
  bs_pool_q_kernel<T, D><<<dim3(static_cast<unsigned>((p.max_q_blocks + kPerCta - 1) / kPerCta),
                                static_cast<unsigned>(num_heads)),
                           kBsPoolThreads, 0, stream>>>(p);
  check_launch("bs_pool_q_kernel");
  constexpr int smem = 2 * kBsKTileBytes;
  TESSERA_CUDA_CHECK(
      cudaFuncSetAttribute(bs_score_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Three CTAs per SM need 3 x 64 KB of shared memory: ask for the largest carveout.
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(bs_score_kernel<D>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
  for (const BsWave& w : waves) {
    if (w.work_end > w.work_begin) {
      bs_score_kernel<D><<<static_cast<unsigned>(w.work_end - w.work_begin), kBsScoreThreads, smem, stream>>>(
          p, w.work_begin);
      check_launch("bs_score_kernel");
    }
    const dim3 grid(static_cast<unsigned>(w.tile_end - w.tile_begin),
                    static_cast<unsigned>(bs_tile_rows(D) / (kBsSelectThreads / 32)));
    if (adaptive) {
      bs_select_kernel<D, true><<<grid, kBsSelectThreads, 0, stream>>>(p, w.tile_begin);
    } else {
      bs_select_kernel<D, false><<<grid, kBsSelectThreads, 0, stream>>>(p, w.tile_begin);
    }
    check_launch("bs_select_kernel");
  }
}

// Sum over q blocks [0, x) of min(k, qb + 1): the CSR offset of query block x when blocks start at 0.
int64_t bs_prefix(int64_t x, int64_t k) {
  if (x <= k) return x * (x + 1) / 2;
  return k * (k + 1) / 2 + (x - k) * k;
}

void check_view(const TensorView& t, const char* what) {
  const std::string w = std::string("CUDA estimate ") + what;
  check(t.rank == 3, w + ": expected rank 3");
  check(t.dtype == DType::BF16 || t.dtype == DType::F16, w + ": dtype must be bf16 or f16");
  check(t.stride[2] == 1 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 &&
            reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
        w + ": head_dim must be contiguous, strides multiples of 8 elements, data 16-byte aligned");
}

}  // namespace

void DeviceEstimates::set_bs_wave_floats(int64_t floats) {
  check(floats > 0, "DeviceEstimates::set_bs_wave_floats: must be positive");
  g_bs_wave_floats = floats;
}
void DeviceEstimates::set_vs_chunk_keys(int keys) {
  check(keys == 0 || (keys >= 64 && keys <= 2048 && keys % 64 == 0),
        "DeviceEstimates::set_vs_chunk_keys: 0 or a multiple of 64 in [64, 2048], got " + std::to_string(keys));
  g_vs_chunk_keys = keys;
}

int64_t DeviceEstimates::bs_wave_floats() {
  return g_bs_wave_floats;
}

DeviceEstimates::DeviceEstimates(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                                 int num_kv_heads, int head_dim)
    : ctx_(ctx),
      num_q_heads_(static_cast<int>(patterns.size())),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      keys_(ctx.q_begin + ctx.q_len) {
  check(num_kv_heads > 0 && num_q_heads_ % num_kv_heads == 0,
        "CUDA estimates: " + std::to_string(num_q_heads_) + " query heads are not a multiple of " +
            std::to_string(num_kv_heads) + " kv heads");
  check(ctx.kv_len >= ctx.q_begin + ctx.q_len, "CUDA estimates: kv_len is smaller than q_begin + q_len");
  const int group = num_q_heads_ / num_kv_heads;
  const int64_t q_end = int64_t{ctx.q_begin} + ctx.q_len;
  slot_of_.assign(patterns.size(), {-1, -1});
  int64_t col_total = 0, off_total = 0, bs_off_total = 0, bs_key_total = 0;
  for (size_t h = 0; h < patterns.size(); ++h) {
    if (const auto* vs = std::get_if<VerticalSlashPattern>(&patterns[h])) {
      check(vs->last_q <= kVsRows, "CUDA estimates: head " + std::to_string(h) + ": vertical_slash last_q " +
                                       std::to_string(vs->last_q) + " > 64 is not supported on the GPU yet");
      VsHeadDesc d;
      d.q_head = static_cast<int32_t>(h);
      d.kv_head = static_cast<int32_t>(h) / group;
      if (ctx.q_len > 0) {
        d.rows = std::min(vs->last_q, ctx.q_len);
        d.num_columns = std::min(vs->vertical, keys_);
        d.num_offsets = std::min(vs->slash, keys_);
        d.forced_columns = std::min(vs->forced_columns, d.num_columns);
        d.forced_offsets = std::min(vs->forced_diagonals, d.num_offsets);
        if (vs->adaptive()) {
          d.gamma = vs->gamma;
          d.min_columns = vs->min_vertical;
          d.min_offsets = vs->min_slash;
        }
      }
      d.column_base = col_total;
      d.offset_base = off_total;
      col_total += d.num_columns;
      off_total += d.num_offsets;
      slot_of_[h].first = static_cast<int>(vs_.size());
      vs_.push_back(d);
    } else if (const auto* bs = std::get_if<BlockSparsePattern>(&patterns[h])) {
      BsHeadDesc d;
      d.q_head = static_cast<int32_t>(h);
      d.kv_head = static_cast<int32_t>(h) / group;
      d.block = bs->block;
      d.top_k = bs->top_k;
      if (bs->adaptive()) {
        d.gamma = bs->gamma;
        d.min_top_k = bs->min_top_k;
        bs_adaptive_ = true;
      }
      if (ctx.q_len > 0) {
        d.first_q_block = ctx.q_begin / bs->block;
        d.num_q_blocks = static_cast<int32_t>((q_end - 1) / bs->block) - d.first_q_block + 1;
        d.num_key_blocks = static_cast<int32_t>((q_end + bs->block - 1) / bs->block);
      }
      auto it = std::find(bs_block_sizes_.begin(), bs_block_sizes_.end(), bs->block);
      d.pool_index = static_cast<int32_t>(it - bs_block_sizes_.begin());
      if (it == bs_block_sizes_.end()) bs_block_sizes_.push_back(bs->block);
      d.offsets_base = bs_off_total;
      d.key_base = bs_key_total;
      const int64_t base = bs_prefix(d.first_q_block, d.top_k);
      for (int32_t e = 0; e <= d.num_q_blocks; ++e) {
        bs_offsets_host_.push_back(
            static_cast<int32_t>(bs_prefix(int64_t{d.first_q_block} + e, d.top_k) - base));
      }
      bs_off_total += d.num_q_blocks + 1;
      bs_key_total += bs_offsets_host_.back();
      bs_max_q_blocks_ = std::max(bs_max_q_blocks_, d.num_q_blocks);
      slot_of_[h].second = static_cast<int>(bs_.size());
      bs_.push_back(d);
    }
  }
  // Pooled keys: one [num_kv_heads][key blocks][head_dim] array per block size.
  int64_t pool_total = 0;
  for (int32_t b : bs_block_sizes_) {
    bs_pool_base_.push_back(pool_total);
    pool_total += int64_t{num_kv_heads} * ((q_end + b - 1) / b) * head_dim;
  }
  for (BsHeadDesc& d : bs_) {
    d.kpool_base =
        bs_pool_base_[static_cast<size_t>(d.pool_index)] + int64_t{d.kv_head} * d.num_key_blocks * head_dim;
  }

  // BS scoring: tiles of query blocks per head, grouped into waves whose scores fit the scratch; per tile
  // with scored rows, work items of up to kBsKChunk key tiles (heaviest first within a wave).
  std::vector<BsTileDesc> bs_tiles;
  std::vector<BsWorkDesc> bs_work;
  const int64_t bs_scratch = plan_bs_waves(bs_, head_dim, g_bs_wave_floats, bs_tiles, bs_work, bs_waves_);

  vs_columns_.resize(static_cast<size_t>(std::max<int64_t>(col_total, 1)));
  vs_offsets_.resize(static_cast<size_t>(std::max<int64_t>(off_total, 1)));
  bs_offsets_.upload(bs_offsets_host_.empty() ? std::vector<int32_t>{0} : bs_offsets_host_);
  bs_key_blocks_.resize(static_cast<size_t>(std::max<int64_t>(bs_key_total, 1)));
  if (!vs_.empty()) {
    vs_desc_.upload(vs_);
    // Groups: the VS heads of each kv head, up to vs_group<D>() per CTA (their K tiles are loaded once).
    const int per_group = head_dim <= 128 ? vs_group<128>() : vs_group<256>();
    std::vector<VsGroupDesc> groups;
    for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
      int filled = per_group;
      for (size_t i = 0; i < vs_.size(); ++i) {
        if (vs_[i].kv_head != kvh) continue;
        if (filled == per_group) {
          groups.push_back(VsGroupDesc{{-1, -1, -1, -1}});
          filled = 0;
        }
        groups.back().slot[filled++] = static_cast<int32_t>(i);
      }
    }
    vs_num_groups_ = static_cast<int>(groups.size());
    vs_groups_.upload(groups);
    // Keys per CTA: 512, doubled (up to 2048, which halves the per-CTA setup and the partial results) while
    // the grid keeps four or more CTAs per SM; or the test override.
    vs_chunk_keys_ = g_vs_chunk_keys;
    if (vs_chunk_keys_ == 0) {
      int dev = 0, sms = 0;
      TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
      TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      vs_chunk_keys_ = 512;
      while (vs_chunk_keys_ < 2048 &&
             int64_t{vs_num_groups_} * ((keys_ + 2 * vs_chunk_keys_ - 1) / (2 * vs_chunk_keys_)) >= 4 * sms)
        vs_chunk_keys_ *= 2;
    }
    vs_chunks_ = std::max(1, (keys_ + vs_chunk_keys_ - 1) / vs_chunk_keys_);
    const size_t n = vs_.size();
    vs_partial_stats_.resize(n * static_cast<size_t>(vs_chunks_) * kVsRows);
    vs_stats_.resize(n * kVsRows);
    vs_colsum_.resize(n * static_cast<size_t>(std::max(keys_, 1)));
    vs_diag_.resize(n * static_cast<size_t>(std::max(keys_, 1)));
    vs_diag_partial_.resize(n * static_cast<size_t>(vs_chunks_) * static_cast<size_t>(vs_chunk_keys_ + kVsRows - 1));
  }
  if (!bs_.empty()) {
    bs_desc_.upload(bs_);
    bs_kpool_.resize(static_cast<size_t>(std::max<int64_t>(pool_total, 1)));
    bs_qpool_.resize(bs_.size() * static_cast<size_t>(std::max(bs_max_q_blocks_, 1)) *
                     static_cast<size_t>(head_dim));
    bs_tiles_.upload(bs_tiles.empty() ? std::vector<BsTileDesc>(1) : bs_tiles);
    bs_work_.upload(bs_work.empty() ? std::vector<BsWorkDesc>(1) : bs_work);
    bs_scores_.resize(static_cast<size_t>(bs_scratch));
  }
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads above read host vectors that are members
}

void DeviceEstimates::estimate(const TensorView& q, const TensorView& k, float scale, cudaStream_t stream) {
  if (empty() || ctx_.q_len == 0) return;
  check_view(q, "q");
  check_view(k, "k");
  check(q.dtype == k.dtype, "CUDA estimate: q and k dtypes differ");
  check(q.dim(0) == ctx_.q_len && q.dim(1) == num_q_heads_ && q.dim(2) == head_dim_,
        "CUDA estimate q: expected [" + std::to_string(ctx_.q_len) + ", " + std::to_string(num_q_heads_) +
            ", " + std::to_string(head_dim_) + "], got " + q.shape_string());
  check(k.dim(0) >= ctx_.kv_len && k.dim(1) == num_kv_heads_ && k.dim(2) == head_dim_,
        "CUDA estimate k: expected [>= " + std::to_string(ctx_.kv_len) + ", " +
            std::to_string(num_kv_heads_) + ", " + std::to_string(head_dim_) + "], got " + k.shape_string());
  const bool bf = q.dtype == DType::BF16;
  const int d = head_dim_;
  check(d == 64 || d == 128 || d == 256,
        "CUDA estimate: head_dim " + std::to_string(d) + " is not supported");

  if (!vs_.empty()) {
    VsParams p;
    set_inputs(p, q, k, ctx_);
    p.keys = keys_;
    p.chunks = vs_chunks_;
    p.chunk_keys = vs_chunk_keys_;
    p.groups = vs_groups_.data();
    p.scale = scale;
    p.heads = vs_desc_.data();
    p.partial = vs_partial_stats_.data();
    p.stats = vs_stats_.data();
    p.colsum = vs_colsum_.data();
    p.diag_partial = vs_diag_partial_.data();
    p.diag = vs_diag_.data();
    p.columns = vs_columns_.data();
    p.offsets = vs_offsets_.data();
    const int n = static_cast<int>(vs_.size());
    for_dtype_and_dim(bf, d, [&]<typename T, int D>() { launch_vs<T, D>(p, n, vs_num_groups_, stream); });
  }
  if (!bs_.empty()) {
    BsParams p;
    set_inputs(p, q, k, ctx_);
    p.kv_len = ctx_.kv_len;
    p.max_q_blocks = bs_max_q_blocks_;
    p.scale = scale;
    p.heads = bs_desc_.data();
    p.kpool = bs_kpool_.data();
    p.qpool = bs_qpool_.data();
    p.offsets = bs_offsets_.data();
    p.key_blocks = bs_key_blocks_.data();
    p.tiles = bs_tiles_.data();
    p.work = bs_work_.data();
    p.scores = bs_scores_.data();
    const int n = static_cast<int>(bs_.size());
    for_dtype_and_dim(bf, d, [&]<typename T, int D>() {
      launch_bs<T, D>(p, n, num_kv_heads_, bs_block_sizes_, bs_pool_base_, bs_waves_, bs_adaptive_, stream);
    });
  }
}

std::vector<HeadEstimate> DeviceEstimates::download() const {
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<HeadEstimate> out(static_cast<size_t>(num_q_heads_));
  const std::vector<int32_t> cols = vs_columns_.download(), offs = vs_offsets_.download();
  for (const VsHeadDesc& d : vs_) {
    VerticalSlashEstimate e;
    e.columns.assign(cols.begin() + d.column_base, cols.begin() + d.column_base + d.num_columns);
    e.offsets.assign(offs.begin() + d.offset_base, offs.begin() + d.offset_base + d.num_offsets);
    if (d.gamma > 0.0) {  // adaptive: the kept entries, without the unused room after them
      std::erase(e.columns, kVsUnused);
      std::erase(e.offsets, kVsUnused);
    }
    out[static_cast<size_t>(d.q_head)] = std::move(e);
  }
  const std::vector<int32_t> keys = bs_key_blocks_.download();
  for (const BsHeadDesc& d : bs_) {
    BlockSparseEstimate e;
    e.block = d.block;
    e.first_q_block = d.first_q_block;
    e.offsets.assign(bs_offsets_host_.begin() + d.offsets_base,
                     bs_offsets_host_.begin() + d.offsets_base + d.num_q_blocks + 1);
    e.key_blocks.assign(keys.begin() + d.key_base, keys.begin() + d.key_base + e.offsets.back());
    if (d.gamma > 0.0) {  // adaptive: each query block's kept blocks, without the unused room after them
      std::vector<int32_t> kept;
      std::vector<int32_t> offsets(1, 0);
      for (int32_t q = 0; q < d.num_q_blocks; ++q) {
        for (int32_t i = e.offsets[static_cast<size_t>(q)]; i < e.offsets[static_cast<size_t>(q) + 1]; ++i) {
          if (e.key_blocks[static_cast<size_t>(i)] != kBsUnused) kept.push_back(e.key_blocks[static_cast<size_t>(i)]);
        }
        offsets.push_back(static_cast<int32_t>(kept.size()));
      }
      e.key_blocks = std::move(kept);
      e.offsets = std::move(offsets);
    }
    out[static_cast<size_t>(d.q_head)] = std::move(e);
  }
  return out;
}

void DeviceEstimates::upload(const std::vector<HeadEstimate>& estimates) {
  check(estimates.size() == static_cast<size_t>(num_q_heads_),
        "CUDA estimates upload: " + std::to_string(estimates.size()) + " estimates for " +
            std::to_string(num_q_heads_) + " heads");
  std::vector<int32_t> cols(vs_columns_.size(), 0), offs(vs_offsets_.size(), 0),
      keys(bs_key_blocks_.size(), 0);
  for (const VsHeadDesc& d : vs_) {
    const std::string where = "CUDA estimates upload: head " + std::to_string(d.q_head) + ": ";
    const auto* e = std::get_if<VerticalSlashEstimate>(&estimates[static_cast<size_t>(d.q_head)]);
    check(e != nullptr, where + "expected a vertical_slash estimate");
    // Adaptive heads may hold fewer (the rest of the room gets kVsUnused), fixed ones exactly the layout's.
    const bool fits = d.gamma > 0.0 ? e->columns.size() <= static_cast<size_t>(d.num_columns) &&
                                          e->offsets.size() <= static_cast<size_t>(d.num_offsets)
                                    : e->columns.size() == static_cast<size_t>(d.num_columns) &&
                                          e->offsets.size() == static_cast<size_t>(d.num_offsets);
    check(fits, where + "expected " + std::string(d.gamma > 0.0 ? "at most " : "") + std::to_string(d.num_columns) +
                    " columns and " + std::to_string(d.num_offsets) + " offsets, got " +
                    std::to_string(e->columns.size()) + " and " + std::to_string(e->offsets.size()));
    check(std::is_sorted(e->columns.begin(), e->columns.end()) &&
              std::is_sorted(e->offsets.begin(), e->offsets.end()),
          where + "columns and offsets must be ascending");
    std::fill(cols.begin() + d.column_base, cols.begin() + d.column_base + d.num_columns, kVsUnused);
    std::fill(offs.begin() + d.offset_base, offs.begin() + d.offset_base + d.num_offsets, kVsUnused);
    std::copy(e->columns.begin(), e->columns.end(), cols.begin() + d.column_base);
    std::copy(e->offsets.begin(), e->offsets.end(), offs.begin() + d.offset_base);
  }
  for (const BsHeadDesc& d : bs_) {
    const std::string where = "CUDA estimates upload: head " + std::to_string(d.q_head) + ": ";
    const auto* e = std::get_if<BlockSparseEstimate>(&estimates[static_cast<size_t>(d.q_head)]);
    check(e != nullptr, where + "expected a block_sparse estimate");
    const std::vector<int32_t> expect(bs_offsets_host_.begin() + d.offsets_base,
                                      bs_offsets_host_.begin() + d.offsets_base + d.num_q_blocks + 1);
    if (d.gamma > 0.0) {  // adaptive: per query block at most the layout's room, the rest kBsUnused
      bool fits = e->block == d.block && e->first_q_block == d.first_q_block &&
                  e->offsets.size() == expect.size() && !e->offsets.empty() && e->offsets.front() == 0 &&
                  static_cast<size_t>(e->offsets.back()) == e->key_blocks.size();
      for (size_t q = 0; fits && q + 1 < expect.size(); ++q) {
        const int32_t n = e->offsets[q + 1] - e->offsets[q], room = expect[q + 1] - expect[q];
        fits = n >= 0 && n <= room;
        if (!fits) break;
        std::copy(e->key_blocks.begin() + e->offsets[q], e->key_blocks.begin() + e->offsets[q + 1],
                  keys.begin() + d.key_base + expect[q]);
        std::fill(keys.begin() + d.key_base + expect[q] + n, keys.begin() + d.key_base + expect[q + 1], kBsUnused);
      }
      check(fits, where + "the adaptive block_sparse estimate does not fit the layout of this shape (at most "
                          "min(top_k, qb + 1) key blocks per query block)");
      continue;
    }
    check(e->block == d.block && e->first_q_block == d.first_q_block && e->offsets == expect,
          where + "the block_sparse estimate does not have the layout of this shape");
    std::copy(e->key_blocks.begin(), e->key_blocks.end(), keys.begin() + d.key_base);
  }
  vs_columns_.upload(cols);
  vs_offsets_.upload(offs);
  bs_key_blocks_.upload(keys);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace tessera::attn::gpu
