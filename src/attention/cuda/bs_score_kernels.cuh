// tessera/attention/cuda/bs_score_kernels.cuh — the BS estimator's pooling and scoring (device code, and the
// host plan of the scoring waves): BsParams, bs_pool_k / bs_pool_q (mean-pooled key and query blocks),
// bs_score (the pooled dot products into the wave's scratch) and plan_bs_waves. The selection that follows:
// bs_select_kernels.cuh.
// Part of estimate_kernels.cuh (which says who includes these headers and why everything in them has internal
// linkage); host-compiled by tests/emulation with TESSERA_EMULATION defined.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/mma_sm80.cuh"

namespace tessera::attn::gpu {

namespace {

// ---------------------------------------------------------------------------------------------------------------
// BS estimator (v2; docs/PERF.md history, "BS estimator v2").
//
// The scores are bit for bit those of v1, whose CTA per query block summed each dot product with a warp: lane
// l accumulated elements l, l + 32, ... in that order by fma from +0 (its "leaf"), the 32 leaves were added
// by a shuffle butterfly over lane masks 16, 8, 4, 2, 1, and the sum was multiplied by the scale. f32
// addition is commutative, so that is one fixed binary tree: leaves l and l ^ 16 first, then pairs differing
// in bit 3, ..., bit 0 last. Here each dot product is split over 8 lanes (c = lane % 8): lane c computes the
// leaves c, c + 8, c + 16, c + 24 and adds them as that tree does ((c + c+16) + (c+8 + c+24)), and the lanes
// then add across c bits 2, 1, 0 in that order; the same tree, so the same value. Pooling is v1's too: f32
// sums in row order, divided by the row count.
//
// Pooled rows are stored "leaf-major": element e = l + 32 t (leaf l, step t < T = D / 32) at
// (t / V) * 32 V + l * V + t % V with V = min(T, 4), so that a lane's V consecutive elements of one leaf are
// one vector load and the 8 lanes of a group read 8 consecutive vectors (conflict-free).
//
// Kernels: bs_pool_k (per block size) and bs_pool_q; then per wave (a set of tiles whose scores fit the
// scratch) bs_score (a CTA per work item: a tile of 64 query blocks, or 32 at D = 256, against up to
// kBsKChunk key tiles; the pooled queries in registers, key tiles double-buffered in shared memory; every
// lane owns 4 query rows x 4 keys (2 x 4 at D = 256) per step of 4 keys) and bs_select (a warp per query
// block: WarpTopK over the row's scores, the diagonal block last).

struct BsParams {
  const void* q = nullptr;
  const void* k = nullptr;
  int64_t q_tok = 0, q_head = 0, k_tok = 0, k_head = 0;
  int32_t q_len = 0, q_begin = 0, kv_len = 0, max_q_blocks = 0;
  float scale = 0.0f;
  const BsHeadDesc* heads = nullptr;
  float* kpool = nullptr;
  float* qpool = nullptr;
  const int32_t* offsets = nullptr;
  int32_t* key_blocks = nullptr;
  const BsTileDesc* tiles = nullptr;
  const BsWorkDesc* work = nullptr;
  float* scores = nullptr;  // the wave's scratch
};

constexpr int kBsPoolThreads = 256;
constexpr int kBsScoreThreads = 128;           // 4 warps x 4 groups of 8 lanes
constexpr int kBsKTileBytes = 32 * 1024;       // one key tile in shared memory (two buffers)
constexpr int kBsKChunk = 2;                   // key tiles per scoring CTA
constexpr int kBsSelectThreads = 256;          // a warp per query block
constexpr int kBsRegSlots = 64;                // rows of up to 2048 scores are selected from registers

// Query rows per thread, query blocks per tile, key blocks per shared key tile.
constexpr int bs_tm(int d) {
  return d == 256 ? 2 : 4;
}
constexpr int bs_tile_rows(int d) {
  return (kBsScoreThreads / 8) * bs_tm(d);
}
constexpr int bs_ktile_rows(int d) {
  return kBsKTileBytes / (d * 4);
}

template <int D>
__device__ __forceinline__ int bs_leaf_pos(int e) {
  constexpr int T = D / 32, V = T < 4 ? T : 4;
  const int l = e % 32, t = e / 32;
  return (t / V) * 32 * V + l * V + t % V;
}

// V consecutive floats (8 or 16 bytes, aligned) into v.
template <int V>
__device__ __forceinline__ void bs_load_vec(float* v, const float* src) {
  if constexpr (V == 4) {
    const float4 x = *reinterpret_cast<const float4*>(src);
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  } else {
    const float2 x = *reinterpret_cast<const float2*>(src);
    v[0] = x.x;
    v[1] = x.y;
  }
}

// Mean of `rows` rows (row stride `stride` elements) of 8 consecutive elements at src, summed in row order in
// f32 (v1's order), into the leaf-major row dst.
template <typename T, int D>
__device__ __forceinline__ void bs_pool_rows(const T* src, int64_t stride, int rows, int e0, float* dst) {
  float acc[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
#pragma unroll 8
  for (int r = 0; r < rows; ++r) {
    const uint4 v = *reinterpret_cast<const uint4*>(src + r * stride);
    const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const auto bits = static_cast<unsigned short>(u % 2 ? word[u / 2] >> 16 : word[u / 2] & 0xffffu);
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        acc[u] += __bfloat162float(__ushort_as_bfloat16(bits));
      } else {
        acc[u] += __half2float(__ushort_as_half(bits));
      }
    }
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) dst[bs_leaf_pos<D>(e0 + u)] = acc[u] / static_cast<float>(rows);
}

// grid (ceil(key blocks / (256 / (D / 8))), kv heads): kpool[kvh][kb] = mean of k over the block's keys
// (a partial last block pools the keys it has). A thread pools 8 elements of one key block.
template <typename T, int D>
__global__ void __launch_bounds__(kBsPoolThreads, 4)
    bs_pool_k_kernel(const BsParams p, int block, int num_key_blocks, float* kpool) {
  constexpr int kChunks = D / 8;
  const int kvh = blockIdx.y, ch = threadIdx.x % kChunks;
  const int kb = blockIdx.x * (kBsPoolThreads / kChunks) + threadIdx.x / kChunks;
  if (kb >= num_key_blocks) return;
  const int j0 = kb * block, j1 = min(j0 + block, p.kv_len);
  const T* src = static_cast<const T*>(p.k) + kvh * p.k_head + static_cast<int64_t>(j0) * p.k_tok + ch * 8;
  bs_pool_rows<T, D>(src, p.k_tok, j1 - j0, ch * 8,
                     kpool + (static_cast<int64_t>(kvh) * num_key_blocks + kb) * D);
}

// grid (ceil(max query blocks / (256 / (D / 8))), BS heads): the mean of the call's rows in each query block.
template <typename T, int D>
__global__ void __launch_bounds__(kBsPoolThreads, 4) bs_pool_q_kernel(const BsParams p) {
  constexpr int kChunks = D / 8;
  const BsHeadDesc hd = p.heads[blockIdx.y];
  const int ch = threadIdx.x % kChunks;
  const int e = blockIdx.x * (kBsPoolThreads / kChunks) + threadIdx.x / kChunks;
  if (e >= hd.num_q_blocks) return;
  const int qb = hd.first_q_block + e;
  const int q_end = p.q_begin + p.q_len;
  const int r0 = max(qb * hd.block, p.q_begin) - p.q_begin, r1 = min((qb + 1) * hd.block, q_end) - p.q_begin;
  const T* src =
      static_cast<const T*>(p.q) + hd.q_head * p.q_head + static_cast<int64_t>(r0) * p.q_tok + ch * 8;
  bs_pool_rows<T, D>(src, p.q_tok, r1 - r0, ch * 8,
                     p.qpool + (static_cast<int64_t>(blockIdx.y) * p.max_q_blocks + e) * D);
}

// a if p else b, as a register select (a conditional of array elements would become a select of their
// addresses and put the array in local memory).
__device__ __forceinline__ float bs_select(bool p, float a, float b) {
#ifndef TESSERA_EMULATION
  float r;
  asm("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n selp.f32 %0, %1, %2, q;\n}\n"
      : "=f"(r)
      : "f"(a), "f"(b), "r"(static_cast<int>(p)));
  return r;
#else
  return p ? a : b;
#endif
}

// One round of the scoring kernel's reduce-scatter over the 8 lanes of a group: sum[0, kSize) are partial
// sums of kSize outputs; the lane keeps the upper half (where c & kMask) or the lower half, adds the partner
// lane's (c ^ kMask) partial sums of those outputs and leaves them in sum[0, kSize / 2).
template <int kMask, int kSize, int N>
__device__ __forceinline__ void bs_scatter_round(float (&sum)[N], int c) {
  const bool upper = (c & kMask) != 0;
#pragma unroll
  for (int x = 0; x < kSize / 2; ++x) {
    const float lo = sum[x], hi = sum[x + kSize / 2];
    const float send = bs_select(upper, lo, hi), keep = bs_select(upper, hi, lo);
    sum[x] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
  }
}

// Offset of scored row e's scores in the wave's scratch (rows [e_scored, e) before it, qb = first + e' floats
// each).
__device__ __forceinline__ int64_t bs_row_offset(const BsTileDesc& t, int first_q_block, int e) {
  const int64_t m = e - t.e_scored;
  return t.scratch + m * (first_q_block + t.e_scored) + m * (m - 1) / 2;
}

// One CTA per work item: scores[row e][kb] = scale * Qp[e] . Kp[kb] for the tile's scored rows and the key
// blocks kb < qb of key tiles [kt0, kt1). Lane (warp w, group g = lane / 8, c = lane % 8) holds leaves
// c + 8h (h < 4) of query rows (4w + g) TM + i (i < TM) in registers; a step takes 4 key rows, each lane
// computes its leaves' share of the TM x 4 dot products, and three shuffle rounds (c bits 2, 1, 0) leave the
// complete dot products 4 TM / 8 per lane (reduce-scatter). Dynamic shared memory: two key tiles.
template <int D>
__global__ void __launch_bounds__(kBsScoreThreads, 3) bs_score_kernel(const BsParams p, int work_begin) {
  constexpr int T = D / 32, V = T < 4 ? T : 4, NV = T / V, TM = bs_tm(D), KTR = bs_ktile_rows(D);
  constexpr int NOUT = TM * 4, KEEP = NOUT / 8;
#ifndef TESSERA_EMULATION
  extern __shared__ __align__(16) float bs_ktile[];
#else
  float* bs_ktile = reinterpret_cast<float*>(emu::dynamic_smem());  // host emulation (tests/emulation)
#endif
  const BsWorkDesc w = p.work[work_begin + static_cast<int>(blockIdx.x)];
  const BsTileDesc tl = p.tiles[w.tile];
  const BsHeadDesc hd = p.heads[tl.slot];
  const int tid = threadIdx.x, lane = tid & 31, c = lane & 7;
  const int row0 = ((tid >> 5) * 4 + (lane >> 3)) * TM;  // the lane's first query row in the tile
  const float* kp = p.kpool + hd.kpool_base;

  auto load_ktile = [&](int buf, int kt) {
    float* dst = bs_ktile + buf * KTR * D;
    constexpr int kChunks = KTR * D / 4;  // 16-byte chunks
#pragma unroll
    for (int it = 0; it < kChunks / kBsScoreThreads; ++it) {
      const int i = tid + it * kBsScoreThreads;
      const int r = i / (D / 4), ch = i % (D / 4);
      const int kb = kt * KTR + r;
      const bool ok = kb < hd.num_key_blocks;
      detail::cp_async_16(detail::smem_addr(dst + r * D + ch * 4),
                          ok ? kp + static_cast<int64_t>(kb) * D + ch * 4 : kp, ok);
    }
  };
  load_ktile(0, w.kt0);
  detail::cp_async_commit();

  // The lane's leaves of its query rows (zero for rows past the tile's end).
  float q[TM][4][T];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int e = tl.e0 + row0 + i;
    const float* src =
        p.qpool + (static_cast<int64_t>(tl.slot) * p.max_q_blocks + (e < tl.e1 ? e : tl.e0)) * D;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        bs_load_vec<V>(&q[i][h][v * V], src + v * 32 * V + (c + 8 * h) * V);
        if (e >= tl.e1) {
#pragma unroll
          for (int t = 0; t < V; ++t) q[i][h][v * V + t] = 0.0f;
        }
      }
    }
  }

  // The outputs this lane completes: o = KEEP * c + x (x < KEEP), o = 4 i + j: query row row0 + o / 4, key
  // row j = o % 4 of the step (the KEEP outputs share the row).
  const int i_out = (KEEP * c) / 4, j_out = (KEEP * c) % 4;
  const int e_out = tl.e0 + row0 + i_out;
  const bool row_scored = e_out >= tl.e_scored && e_out < tl.e1;
  const int qb_out = hd.first_q_block + e_out;
  float* out_row = p.scores + (row_scored ? bs_row_offset(tl, hd.first_q_block, e_out) : 0);

  for (int kt = w.kt0, it = 0; kt < w.kt1; ++kt, ++it) {
    if (kt + 1 < w.kt1) load_ktile((it + 1) & 1, kt + 1);
    detail::cp_async_commit();
    detail::cp_async_wait<1>();
    __syncthreads();
    const float* ks = bs_ktile + (it & 1) * KTR * D;
#pragma unroll 1
    for (int s = 0; s < KTR / 4; ++s) {
      const float* krow = ks + s * 4 * D;
      // Leaf h of the TM x 4 dot products: fma over its T elements in order, from +0.
      auto leaf = [&](int h, float(&acc)[TM][4]) {
        float kv[4][T];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int v = 0; v < NV; ++v)
            bs_load_vec<V>(&kv[j][v * V], krow + j * D + v * 32 * V + (c + 8 * h) * V);
        }
#pragma unroll
        for (int i = 0; i < TM; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float a = 0.0f;
#pragma unroll
            for (int t = 0; t < T; ++t) a = fmaf(q[i][h][t], kv[j][t], a);
            acc[i][j] = a;
          }
        }
      };
      // This lane's subtree: (leaf c + leaf c+16) + (leaf c+8 + leaf c+24).
      float sum[NOUT];
      {
        float a[TM][4], b[TM][4];
        leaf(0, a);
        leaf(2, b);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) sum[4 * i + j] = a[i][j] + b[i][j];
        }
        leaf(1, a);
        leaf(3, b);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) sum[4 * i + j] = sum[4 * i + j] + (a[i][j] + b[i][j]);
        }
      }
      // Across the 8 lanes of the group: c bit 2, then 1, then 0 (reduce-scatter: each round keeps half the
      // outputs, the lower half where the bit is 0).
      bs_scatter_round<4, NOUT>(sum, c);
      bs_scatter_round<2, NOUT / 2>(sum, c);
      bs_scatter_round<1, NOUT / 4>(sum, c);
      if (row_scored) {
#pragma unroll
        for (int x = 0; x < KEEP; ++x) {
          const int kb = kt * KTR + s * 4 + j_out + x;
          if (kb < qb_out) out_row[kb] = sum[x] * p.scale;
        }
      }
    }
    __syncthreads();  // before the next iteration's copy overwrites this buffer
  }
}

// The BS scoring plan (host code, run by DeviceEstimates' constructor): tiles of query blocks per head, grouped
// into waves whose scores fit the scratch (max_wave_floats; a single tile may exceed it); per tile with scored
// rows, work items of up to kBsKChunk key tiles (heaviest first within a wave). Appends to bs_tiles, bs_work and
// waves; returns the scratch the waves need (floats, at least 1).
int64_t plan_bs_waves(const std::vector<BsHeadDesc>& heads, int head_dim, int64_t max_wave_floats,
                      std::vector<BsTileDesc>& bs_tiles, std::vector<BsWorkDesc>& bs_work,
                      std::vector<BsWave>& waves) {
  int64_t bs_scratch = 1;
  if (!heads.empty()) {
    // (head_dim is checked by estimate(); a bad one only has to keep this plan finite.)
    const int rows = bs_tile_rows(head_dim), ktr = std::max(1, bs_ktile_rows(std::max(head_dim, 1)));
    BsWave wave;
    int64_t wave_floats = 0;
    auto close_wave = [&] {
      std::stable_sort(
          bs_work.begin() + wave.work_begin, bs_work.end(),
          [](const BsWorkDesc& a, const BsWorkDesc& b) { return a.kt1 - a.kt0 > b.kt1 - b.kt0; });
      wave.tile_end = static_cast<int32_t>(bs_tiles.size());
      wave.work_end = static_cast<int32_t>(bs_work.size());
      waves.push_back(wave);
      bs_scratch = std::max(bs_scratch, wave_floats);
      wave = BsWave{wave.tile_end, wave.tile_end, wave.work_end, wave.work_end};
      wave_floats = 0;
    };
    for (size_t slot = 0; slot < heads.size(); ++slot) {
      const BsHeadDesc& d = heads[slot];
      // Scored rows choose among their causal blocks: 2 <= top_k <= qb = first_q_block + e; with adaptive
      // budgets every row with 2 <= top_k and 1 <= qb (its count may be below qb + 1).
      const int first_scored = d.gamma > 0.0 ? 1 : d.top_k;
      const int e_min =
          d.top_k >= 2 ? std::clamp(first_scored - d.first_q_block, 0, d.num_q_blocks) : d.num_q_blocks;
      for (int e0 = 0; e0 < d.num_q_blocks; e0 += rows) {
        BsTileDesc t;
        t.slot = static_cast<int32_t>(slot);
        t.e0 = e0;
        t.e1 = std::min(e0 + rows, d.num_q_blocks);
        t.e_scored = std::clamp(e_min, t.e0, t.e1);
        const int64_t m = t.e1 - t.e_scored;
        const int64_t floats = m * (d.first_q_block + t.e_scored) + m * (m - 1) / 2;
        if (wave_floats > 0 && wave_floats + floats > max_wave_floats) close_wave();
        t.scratch = wave_floats;
        wave_floats += floats;
        if (m > 0) {
          const int key_tiles =
              (d.first_q_block + t.e1 - 1 + ktr - 1) / ktr;  // scores of blocks < the last qb
          for (int kt = 0; kt < key_tiles; kt += kBsKChunk) {
            bs_work.push_back(
                BsWorkDesc{static_cast<int32_t>(bs_tiles.size()), kt, std::min(kt + kBsKChunk, key_tiles)});
          }
        }
        bs_tiles.push_back(t);
      }
    }
    if (static_cast<int32_t>(bs_tiles.size()) > wave.tile_begin) close_wave();
  }
  return bs_scratch;
}

}  // namespace

}  // namespace tessera::attn::gpu
