// tessera/attention/cuda/estimate_kernels.cuh — the device estimators' kernels, their parameters and the BS
// scoring plan (device code of estimate_cuda.cu, which launches them; contract: estimate_cuda.h; overview:
// estimate_cuda.cu).
//
// Only estimate_cuda.cu includes this (everything keeps internal linkage, as when it lived there) and the
// host emulation of tests/emulation, which compiles the same code with the host compiler (TESSERA_EMULATION
// defined), runs every CUDA lane as a fiber and supplies, under that macro, what is PTX or dynamic shared
// memory here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/cuda/block_topk.cuh"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/hopper/wgmma.cuh"
#include "attention/cuda/mma_sm80.cuh"

namespace tessera::attn::gpu {

namespace {

using detail::cp_async_16;
using detail::cp_async_commit;
using detail::cp_async_tile;
using detail::cp_async_wait;
using detail::fast_exp2;
using detail::LaneSwizzle;
using detail::smem_addr;
using detail::ldmatrix_x4;
using detail::MmaTraits;

constexpr int kVsRows = 64;
constexpr float kLog2e = 1.4426950408889634f;  // VS row maxima are kept in log2 units (vs_stats)  // rows of the VS estimate handled by one CTA (4 warps x 16)
constexpr int kVsPStride = 72;  // vs_sums' sP rows: a half warp's float2 stores of a C fragment hit 32 banks
constexpr int kTopKThreads = 512;  // vs_topk: a block per (head, columns or offsets)

struct VsParams {
  const void* q = nullptr;
  const void* k = nullptr;
  int64_t q_tok = 0, q_head = 0, k_tok = 0, k_head = 0;
  int32_t q_len = 0, q_begin = 0, keys = 0, chunks = 0;
  int32_t chunk_keys = 0;  // keys per CTA of vs_stats / vs_sums (a multiple of 64)
  float scale = 0.0f;
  const VsHeadDesc* heads = nullptr;
  const VsGroupDesc* groups = nullptr;
  float2* partial = nullptr;
  float2* stats = nullptr;
  float* colsum = nullptr;
  float* diag_partial = nullptr;
  float* diag = nullptr;
  int32_t* columns = nullptr;
  int32_t* offsets = nullptr;
};

__device__ __forceinline__ int floor_div(int a, int b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Shared part of the two VS passes (v3). A CTA takes one chunk of keys for a group of up to vs_group<D>() VS
// heads that read the same kv head (DeviceEstimates builds the groups): warps 4 s .. 4 s + 3 take the 64 rows
// of the group's head s, so each K tile is loaded once for all of them and, on the wgmma path, read once per
// head (v2 ran a CTA of 4 warps per head and chunk, each warp reading the whole tile through ldmatrix for its 16
// rows: ~5 us per 64-key tile, bound inside the SM rather than on memory; docs/PERF.md history, "VS estimate v3", has the
// measured steps). Dynamic shared memory starts with kVsStages [64][D] tiles: the
// group's Q rows are staged there first (head s in stage s; each warp then keeps its 16 rows as mma A
// fragments in registers), then they form a ring of K tiles with kVsStages - 1 loads in flight.
template <int D>
__host__ __device__ constexpr int vs_group() {
  return D <= 128 ? 4 : 1;  // 4 G warps per CTA within 128 registers a thread (Q fragments: D / 4 registers)
}
constexpr int kVsStages = 4;

template <typename T, int D>
struct VsTile {
  T* buf;
  uint32_t qa[D / 16][4];
  int slot;     // the warp's head (index into p.heads); -1: the group has fewer heads, the warp only loads
  int kv_head;  // the group's
  int row[2];
  bool valid[2];
  int pos[2];
};

// Scores on the tensor cores' warpgroup path (wgmma m64n64k16, Q from the registers, K from shared memory)
// where it exists (sm_90a device code) at D = 128: a head's four warps are one warpgroup. K tiles are then
// stored in the 128-byte-swizzled layout the wgmma descriptors name (hopper/wgmma.cuh); elsewhere mma.sync over
// ldmatrix fragments (swizzle<D>'s layout). (v3 H200 profile with mma.sync: each warp re-read the whole K tile
// through ldmatrix and the scoring passes ran at ~150 TFLOP/s.)
template <int D>
__host__ __device__ constexpr bool vs_wgmma() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  return D == 128;
#else
  return false;
#endif
}

// The kernels' shared memory, from a 1024-byte-aligned base (the swizzle's period; the launch adds 1024 bytes).
__device__ __forceinline__ unsigned char* vs_smem_base(unsigned char* raw) {
  const uint32_t a = smem_addr(raw);
  return raw + (((a + 1023u) & ~1023u) - a);
}

template <typename T, int D>
__device__ __forceinline__ void vs_load_k(const VsParams& p, int kv_head, T* dst, int kb) {
  constexpr int kThreads = 128 * vs_group<D>();
  const T* kh = static_cast<const T*>(p.k) + kv_head * p.k_head;
  if constexpr (vs_wgmma<D>()) {
    constexpr int kChunks = D / 8;  // 16-byte chunks of a row
    static_assert((64 * kChunks) % kThreads == 0);
    const uint32_t base = smem_addr(dst);
#pragma unroll
    for (int it = 0; it < 64 * kChunks / kThreads; ++it) {
      const int i = static_cast<int>(threadIdx.x) + it * kThreads, row = i / kChunks, ch = i % kChunks;
      const bool ok = kb + row < p.keys;  // rows past the keys are zero-filled (and masked)
      cp_async_16(base + detail::sw128_offset<64>(row, ch),
                  ok ? static_cast<const void*>(kh + static_cast<int64_t>(kb + row) * p.k_tok + 8 * ch) : p.k, ok);
    }
  } else {
    cp_async_tile<D, 64, kThreads>(dst, threadIdx.x, p.k, [&](int r) -> const void* {
      return kb + r < p.keys ? kh + static_cast<int64_t>(kb + r) * p.k_tok : nullptr;
    });
  }
}

// Q into the registers, then the loads of the chunk's first kVsStages - 1 K tiles (one commit group each,
// empty past the chunk's end, so that vs_scores can count them).
template <typename T, int D>
__device__ __forceinline__ VsTile<T, D> vs_setup(const VsParams& p, int kb0, int kb1, unsigned char* smem) {
  constexpr int G = vs_group<D>();
  static_assert(kVsStages >= G, "the group's Q rows are staged in the K ring");
  static_assert(G <= static_cast<int>(sizeof(VsGroupDesc::slot) / sizeof(int32_t)), "VsGroupDesc holds the group");
  VsTile<T, D> v;
  v.buf = reinterpret_cast<T*>(smem);
  const int32_t* gslot = p.groups[blockIdx.x].slot;  // read in place: a local copy would go to the stack
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wq = warp % 4, gs = warp / 4;
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int slot = gslot[s];
    if (slot < 0) continue;
    const VsHeadDesc hd = p.heads[slot];
    const int rq0 = p.q_len - hd.rows;
    const T* qh = static_cast<const T*>(p.q) + hd.q_head * p.q_head;
    cp_async_tile<D, kVsRows, 128 * G>(v.buf + s * 64 * D, tid, p.q, [&](int r) -> const void* {
      return r < hd.rows ? qh + static_cast<int64_t>(rq0 + r) * p.q_tok : nullptr;
    });
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  v.slot = gslot[gs];
  v.kv_head = p.heads[gslot[0]].kv_head;
  for (int e = 0; e < 2; ++e) {
    v.row[e] = wq * 16 + lane / 4 + 8 * e;
    v.valid[e] = false;
    v.pos[e] = 0;
  }
  if (v.slot >= 0) {
    const VsHeadDesc hd = p.heads[v.slot];
    const LaneSwizzle sw(lane);
    const uint32_t q_base = smem_addr(v.buf + gs * 64 * D) + wq * 16 * D * 2 + LaneSwizzle::a_row<D>(lane);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(v.qa[kk], q_base + (kk / 4) * 128 + sw.a_off[kk % 4]);
    const int pos0 = p.q_begin + p.q_len - hd.rows;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      v.valid[e] = v.row[e] < hd.rows;
      v.pos[e] = pos0 + v.row[e];
    }
  }
  __syncthreads();  // every warp holds its Q: the stages become the K ring
  for (int s = 0; s + 1 < kVsStages; ++s) {
    if (kb0 + 64 * s < kb1) vs_load_k<T, D>(p, v.kv_head, v.buf + s * 64 * D, kb0 + 64 * s);
    cp_async_commit();
  }
  return v;
}

// The load of tile t + kVsStages - 1 of the chunk into the stage of tile t - 1 (one commit group, empty past
// the chunk's end), issued by every thread at the end of step t: vs_scores(t)'s barrier ended every warp's
// reads of that stage. (Issued after the step's work rather than before it: the loads' addresses would
// otherwise be live across the scores and make vs_sums spill at 128 registers.)
template <typename T, int D>
__device__ __forceinline__ void vs_prefetch(const VsParams& p, const VsTile<T, D>& v, int t, int kb0, int kb1) {
  const int tn = t + kVsStages - 1;
  if (kb0 + 64 * tn < kb1) vs_load_k<T, D>(p, v.kv_head, v.buf + (tn % kVsStages) * 64 * D, kb0 + 64 * tn);
  cp_async_commit();
}

// Scores of the lane's fragment for tile t of the chunk (keys from kb0 + 64 t), warp_qk's products in
// warp_qk's order with Q from the registers (an idle warp computes none). First waits for tile t: the barrier
// also ends every warp's reads of tile t - 1's stage (vs_prefetch(t) reuses it) and, in vs_sums, of the
// previous tile's sP, sCol and band entries.
template <typename T, int D>
__device__ __forceinline__ void vs_scores(const VsTile<T, D>& v, int t, float (&s)[8][4]) {
  cp_async_wait<kVsStages - 2>();  // committed: tiles 0 .. t + kVsStages - 2, one group each
  if constexpr (vs_wgmma<D>()) detail::fence_proxy_async_shared();  // cp.async writes before wgmma reads
  __syncthreads();
  if (v.slot < 0) return;
  if constexpr (vs_wgmma<D>()) {
    // The accumulator layout per 8-column block is mma.sync's C layout: d[4 i + j] is s[i][j].
    float(&d)[32] = *reinterpret_cast<float(*)[32]>(&s[0][0]);
    const uint64_t desc = detail::sw128_desc(smem_addr(v.buf + (t % kVsStages) * 64 * D), 16, 1024);
    detail::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      detail::Wgmma<T>::rs_m64n64(d, v.qa[kk], detail::desc_advance(desc, (kk / 4) * (64 * 128) + (kk % 4) * 32),
                                  kk > 0 ? 1 : 0);
    detail::wgmma_commit();
    detail::wgmma_wait<0>();
    detail::fence_operands(d);
    return;
  }
  const int lane = threadIdx.x % 32;
  const LaneSwizzle sw(lane);
  const uint32_t k_base = smem_addr(v.buf + (t % kVsStages) * 64 * D) + LaneSwizzle::b_row<D>(lane);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_base + np * 16 * (D * 2) + (kk / 4) * 128 + sw.b_off[kk % 4]);
      MmaTraits<T>::mma(s[2 * np], v.qa[kk], b[0], b[1]);
      MmaTraits<T>::mma(s[2 * np + 1], v.qa[kk], b[2], b[3]);
    }
  }
}

// Grids of vs_stats and vs_sums are (groups, chunks) with the groups varying fastest.
template <typename T, int D>
__global__ void __launch_bounds__(128 * vs_group<D>(), 1) vs_stats_kernel(const VsParams p) {
#ifndef TESSERA_EMULATION
  extern __shared__ __align__(1024) unsigned char smem_raw[];
#else
  unsigned char* smem_raw = emu::dynamic_smem();  // host emulation (tests/emulation)
#endif
  unsigned char* smem = vs_smem_base(smem_raw);
  const int chunk = blockIdx.y;
  const int kb0 = chunk * p.chunk_keys, kb1 = min(kb0 + p.chunk_keys, p.keys);
  const VsTile<T, D> v = vs_setup<T, D>(p, kb0, kb1, smem);
  const int c4 = threadIdx.x % 4;
  const float neg_inf = -__int_as_float(0x7f800000);
  // Log2 domain: scores times scale * log2(e), fast_exp2 (one MUFU op, ex2.approx.ftz: results below 2^-126
  // flush to 0; exp2f adds a denormal range fix-up, expf a ~10-instruction accurate routine), so m is the row
  // max in log2 units; l is unchanged (2^(x log2 e) = e^x).
  const float scale2 = p.scale * kLog2e;
  float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
  for (int kb = kb0, t = 0; kb < kb1; kb += 64, ++t) {
    float s[8][4];
    vs_scores<T, D>(v, t, s);
    if (v.slot < 0) {
      vs_prefetch<T, D>(p, v, t, kb0, kb1);
      continue;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = neg_inf;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = kb + i * 8 + 2 * c4 + j;
          const bool vis = v.valid[e] && key <= v.pos[e];
          s[i][2 * e + j] = vis ? s[i][2 * e + j] * scale2 : neg_inf;
          mx = fmaxf(mx, s[i][2 * e + j]);
        }
      }
      if (mx == neg_inf) continue;
      const float m_new = fmaxf(m[e], mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += fast_exp2(s[i][2 * e] - m_new) + fast_exp2(s[i][2 * e + 1] - m_new);
      l[e] = l[e] * fast_exp2(m[e] - m_new) + sum;
      m[e] = m_new;
    }
    vs_prefetch<T, D>(p, v, t, kb0, kb1);
  }
  if (v.slot < 0) return;
  // Merge the four lanes of each row.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mq = m[e];
    mq = fmaxf(mq, __shfl_xor_sync(0xffffffffu, mq, 1));
    mq = fmaxf(mq, __shfl_xor_sync(0xffffffffu, mq, 2));
    float lq = mq == neg_inf ? 0.0f : l[e] * fast_exp2(m[e] - mq);
    lq += __shfl_xor_sync(0xffffffffu, lq, 1);
    lq += __shfl_xor_sync(0xffffffffu, lq, 2);
    if (c4 == 0) {
      p.partial[(static_cast<int64_t>(v.slot) * p.chunks + chunk) * kVsRows + v.row[e]] = make_float2(mq, lq);
    }
  }
}

__global__ void vs_merge_stats_kernel(const VsParams p) {
  const int slot = blockIdx.x, r = threadIdx.x;
  const float neg_inf = -__int_as_float(0x7f800000);
  const float2* part = p.partial + static_cast<int64_t>(slot) * p.chunks * kVsRows + r;
  float m = neg_inf;
  for (int c = 0; c < p.chunks; ++c) m = fmaxf(m, part[static_cast<int64_t>(c) * kVsRows].x);
  float l = 0.0f;
  if (m != neg_inf) {
    for (int c = 0; c < p.chunks; ++c) {
      const float2 x = part[static_cast<int64_t>(c) * kVsRows];
      if (x.x != neg_inf) l += x.y * exp2f(x.x - m);  // maxima in log2 units (vs_stats)
    }
  }
  p.stats[slot * kVsRows + r] = make_float2(m, l);
}

// One reduce-scatter step over lane bit `mask` (32 > mask): of its 2N values the lane keeps the upper N when
// its bit is set, the lower N otherwise, each plus the partner lane's copy.
template <int N>
__device__ __forceinline__ void vs_fold(const float (&x)[2 * N], float (&y)[N], int mask) {
  const bool up = (threadIdx.x & mask) != 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float keep = up ? x[k + N] : x[k];
    const float give = up ? x[k] : x[k + N];
    y[k] = keep + __shfl_xor_sync(0xffffffffu, give, mask);
  }
}

// vs_sums' shared memory per head of the group, after the K ring: sP [64][kVsPStride], sCol [4 warps][64],
// band [2 row halves][chunk + 63].
__host__ __device__ constexpr int vs_sums_head_floats(int chunk_keys) {
  return 64 * kVsPStride + 4 * 64 + 2 * (chunk_keys + kVsRows - 1);
}

// Per tile: A into sP (for the band) while the column sums come from the registers (a fold over the 8 lanes of
// each column per warp, then the head's 4 warps through sCol); the band sums walk sP along "wrapped diagonals"
// (the head's 128 threads, 32 cells each, conflict-free), with one band copy per half of the rows. Sums are in
// a fixed order (deterministic). The head's four warps meet at named barrier 1 + gs between writing sP / sCol
// and reading them.
template <typename T, int D>
__global__ void __launch_bounds__(128 * vs_group<D>(), 1) vs_sums_kernel(const VsParams p) {
#ifndef TESSERA_EMULATION
  extern __shared__ __align__(1024) unsigned char smem_raw[];
#else
  unsigned char* smem_raw = emu::dynamic_smem();  // host emulation (tests/emulation)
#endif
  unsigned char* smem = vs_smem_base(smem_raw);
  const int chunk = blockIdx.y;
  const int kb0 = chunk * p.chunk_keys, kb1 = min(kb0 + p.chunk_keys, p.keys);
  const int band_len = p.chunk_keys + kVsRows - 1;
  const int tid = threadIdx.x, lane = tid % 32, c4 = lane % 4;
  const int ht = tid % 128, wq = ht / 32;  // thread and warp within the head's four warps
  float* sP = reinterpret_cast<float*>(smem + kVsStages * 64 * D * sizeof(T)) +
              (tid / 128) * vs_sums_head_floats(p.chunk_keys);  // [64][kVsPStride]
  float* sCol = sP + 64 * kVsPStride;                            // [4 warps][64]
  float* band = sCol + 4 * 64;                                   // [2 row halves][band_len]
  for (int i = ht; i < 2 * band_len; i += 128) band[i] = 0.0f;
  const VsTile<T, D> v = vs_setup<T, D>(p, kb0, kb1, smem);
  // Row maxima in log2 units (vs_stats), so A = 2^(s scale log2(e) - m) / l, with 1 / l once per row (the IEEE
  // division per score was, with expf, most of this kernel's instructions: ~55 per score on the H200).
  const float scale2 = p.scale * kLog2e;
  // A row without scores (past the head's rows, or none visible) gets m = +inf and 1 / l = 0: its A is 0.
  const float pos_inf = __int_as_float(0x7f800000);
  float m[2] = {pos_inf, pos_inf}, inv_l[2] = {0.0f, 0.0f};
  if (v.slot >= 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 st = p.stats[v.slot * kVsRows + v.row[e]];
      if (v.valid[e] && st.y > 0.0f) {
        m[e] = st.x;
        inv_l[e] = 1.0f / st.y;
      }
    }
  }
  // The thread's wrapped diagonal: cells (r, (r + 63 - dw) % 64) of rows [32 half, 32 half + 32).
  const int dw = ht % 64, half = ht / 64;
  const int tiles = (kb1 - kb0 + 63) / 64;
  for (int tl = 0; tl < tiles; ++tl) {
    const int kb = kb0 + 64 * tl;
    float s[8][4];
    vs_scores<T, D>(v, tl, s);
    if (v.slot < 0) {
      vs_prefetch<T, D>(p, v, tl, kb0, kb1);
      continue;
    }
    float cs[16];  // the lane's two rows added; cs[2 i + j] is column 8 i + 2 c4 + j
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float a[2][2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = i * 8 + 2 * c4 + j;
          a[e][j] = kb + col <= v.pos[e] ? fast_exp2(fmaf(s[i][2 * e + j], scale2, -m[e])) * inv_l[e] : 0.0f;
        }
        *reinterpret_cast<float2*>(&sP[v.row[e] * kVsPStride + i * 8 + 2 * c4]) = make_float2(a[e][0], a[e][1]);
      }
      cs[2 * i] = a[0][0] + a[1][0];
      cs[2 * i + 1] = a[0][1] + a[1][1];
    }
    // Over lane bits 4, 3, 2 (the rows g): lane (g, c4) ends with cs of columns 8 g + 2 c4 + {0, 1}, i.e.
    // 2 lane + {0, 1}.
    float c8[8], c4s[4], c2[2];
    vs_fold<8>(cs, c8, 16);
    vs_fold<4>(c8, c4s, 8);
    vs_fold<2>(c4s, c2, 4);
    *reinterpret_cast<float2*>(&sCol[wq * 64 + 2 * lane]) = make_float2(c2[0], c2[1]);
#ifndef TESSERA_EMULATION
    asm volatile("bar.sync %0, 128;" ::"r"(1 + tid / 128) : "memory");  // the head's four warps
#else
    emu::named_barrier(1 + tid / 128, 128);
#endif
    if (ht < 64 && kb + ht < p.keys) {
      p.colsum[static_cast<int64_t>(v.slot) * p.keys + kb + ht] =
          (sCol[ht] + sCol[64 + ht]) + (sCol[128 + ht] + sCol[192 + ht]);
    }
    // Band entry b holds the cells with row - col = b - 63 (offset = pos0 - kb + b - 63): on the wrapped
    // diagonal, rows r <= dw are b = dw and the others b = dw + 64. Four partial sums each break the chains.
    float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int r = 32 * half + k;
      const float x = sP[r * kVsPStride + ((r + 63 - dw) & 63)];
      if (r <= dw) {
        lo[k % 4] += x;
      } else {
        hi[k % 4] += x;
      }
    }
    float* bt = band + half * band_len + p.chunk_keys - 64 - 64 * tl;
    bt[dw] += (lo[0] + lo[1]) + (lo[2] + lo[3]);
    if (dw < 63) bt[dw + 64] += (hi[0] + hi[1]) + (hi[2] + hi[3]);
    vs_prefetch<T, D>(p, v, tl, kb0, kb1);
  }
  __syncthreads();
  if (v.slot < 0) return;
  float* out = p.diag_partial + (static_cast<int64_t>(v.slot) * p.chunks + chunk) * band_len;
  for (int i = ht; i < band_len; i += 128) out[i] = band[i] + band[band_len + i];
}

// Chunk c's band entry i is offset pos0 - c * chunk_keys - chunk_keys + 1 + i.
__global__ void vs_merge_diag_kernel(const VsParams p) {
  const int slot = blockIdx.y;
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= p.keys) return;
  const VsHeadDesc hd = p.heads[slot];
  const int pos0 = p.q_begin + p.q_len - hd.rows;
  const int ck = p.chunk_keys, band_len = ck + kVsRows - 1;
  const int c_lo = max(0, floor_div(pos0 - o, ck));
  const int c_hi = min(p.chunks - 1, floor_div(pos0 + kVsRows - 1 - o, ck));
  float sum = 0.0f;
  for (int c = c_lo; c <= c_hi; ++c) {
    const int i = o - (pos0 - c * ck - ck + 1);
    sum += p.diag_partial[(static_cast<int64_t>(slot) * p.chunks + c) * band_len + i];
  }
  p.diag[static_cast<int64_t>(slot) * p.keys + o] = sum;
}

// Exact top-k of one row by one block (v3; docs/PERF.md history, "Top-k v3", v2 in "VS estimator/index v2"): the selection
// rule of block_topk.cuh (the k largest order keys, ties to the smaller index, written ascending) by four
// 8-bit radix passes (v1's BlockTopK's threshold and digit search). Each warp owns one contiguous segment of the row for every
// pass: (1) it counts into its own 256-bin histogram (runs of equal digits per thread in registers, an atomic
// when the digit changes: v1's per-element shared atomics serialised on the few bins most scores share),
// the block's histogram is the sum of the 16; (2) after each digit search a warp adds its bins above the chosen
// digit to its count of keys above T, and its bin of the last digit is its count of keys equal to T, so the
// warps' output bases need no counting pass (v2 ran one); (3) one ordered ballot pass per warp writes the
// output. Every pass issues kLoads loads per thread before using them: the passes wait on L2 latency, ~n /
// (threads x kLoads) round trips each (v2: 4 loads, 6 passes, 290 us at 128K on the H200).
struct VsTopK {
  static constexpr int kWarps = kTopKThreads / 32;
  static constexpr int kLoads = 16;
  struct Storage {
    unsigned hist[kWarps][256];
    unsigned total[256];
    uint32_t prefix;
    int remaining, digit;
    int gt[kWarps], eq[kWarps];
  };

  // The order keys of row[first + j * stride], j < kLoads (0 at or past end): every load is issued before any
  // is used, so a pass over the row waits on one latency per kLoads elements, not one per element.
  __device__ static void load_keys(const float* row, int first, int stride, int end, uint32_t (&u)[kLoads]) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = first + j * stride;
      u[j] = i < end ? detail::order_key(row[i]) : 0u;
    }
  }

  // out[0, k) = the indices i in [begin, end) of the k largest score[i] (ties: smaller i), ascending; k
  // clamped to [0, end - begin]. Every thread of the block calls it with the same arguments.
  __device__ static void select(const float* score, int begin, int end, int k, int32_t* out, Storage& st) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n = end - begin;
    if (k > n) k = n;
    if (k <= 0) return;
    if (k == n) {
      for (int i = tid; i < n; i += kTopKThreads) out[i] = begin + i;
      return;
    }
    const float* row = score + begin;
    const int seg = (n + kTopKThreads - 1) / kTopKThreads * 32;  // a multiple of 32 per warp
    const int s0 = min(n, warp * seg), s1 = min(n, s0 + seg);
    unsigned* hist = st.hist[warp];
    if (tid == 0) {
      st.prefix = 0;
      st.remaining = k;
    }
    uint32_t mask = 0;
    int gt = 0;  // this warp's keys above T (lane 0's copy is complete)
    for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
      for (int j = 0; j < 8; ++j) hist[lane + 32 * j] = 0;
      __syncthreads();  // also: st.prefix of the previous digit search is visible
      const uint32_t prefix = st.prefix;
      unsigned run_digit = 0, run = 0;
      for (int b0 = s0; b0 < s1; b0 += 32 * kLoads) {  // the lane's elements of the segment in index order
        uint32_t u[kLoads];
        load_keys(row, b0 + lane, 32, s1, u);
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          if (b0 + 32 * j + lane >= s1 || (u[j] & mask) != prefix) continue;
          const unsigned d = (u[j] >> shift) & 255u;
          if (d != run_digit && run != 0) {
            atomicAdd(&hist[run_digit], run);
            run = 0;
          }
          run_digit = d;
          ++run;
        }
      }
      if (run != 0) atomicAdd(&hist[run_digit], run);
      __syncthreads();
      if (tid < 256) {
        unsigned sum = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += st.hist[w][tid];
        st.total[tid] = sum;
      }
      __syncthreads();
      if (tid < 32) {  // the digit search: the 8-bit digit where the count from the top reaches `remaining`
        const unsigned rem = static_cast<unsigned>(st.remaining);
        unsigned cnt[8];
        unsigned sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          cnt[j] = st.total[255 - 8 * lane - j];
          sum += cnt[j];
        }
        // Every lane has read st.remaining (and its digits) before the one lane that finds the digit overwrites
        // st.remaining / st.prefix below: without this barrier the read and that write are unordered between
        // lanes (compute-sanitizer racecheck reported exactly that pair in v1's block top-k), and a lane
        // reading the new value would compare against the wrong count.
        __syncwarp();
        unsigned incl = sum;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const unsigned v = __shfl_up_sync(0xffffffffu, incl, off);
          if (lane >= off) incl += v;
        }
        const unsigned excl = incl - sum;
        if (excl < rem && incl >= rem) {
          unsigned acc = excl;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (acc + cnt[j] >= rem) {
              st.prefix = prefix | (static_cast<uint32_t>(255 - 8 * lane - j) << shift);
              st.remaining = static_cast<int>(rem - acc);
              st.digit = 255 - 8 * lane - j;
              break;
            }
            acc += cnt[j];
          }
        }
      }
      mask |= 255u << shift;
      __syncthreads();
      // This warp's keys with T's digits so far and a larger digit here are above T.
      const int digit = st.digit;
      unsigned above = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = lane + 32 * j;
        above += d > digit ? hist[d] : 0u;
      }
      gt += static_cast<int>(__reduce_add_sync(0xffffffffu, above));
      if (shift == 0 && lane == 0) {
        st.gt[warp] = gt;
        st.eq[warp] = static_cast<int>(hist[digit]);
      }
      __syncwarp();  // the warp's reads of its histogram before the next pass zeroes it
    }
    __syncthreads();

    // T = st.prefix; keep every key above T and the first need_eq keys equal to T (index order).
    const uint32_t thr = st.prefix;
    const int need_eq = st.remaining;
    const unsigned below = (1u << lane) - 1u;
    int taken = 0, eq_seen = 0;  // over the warps before this one
    for (int w = 0; w < warp; ++w) {
      const int eq_w = st.eq[w];
      const int left = need_eq - eq_seen;
      taken += st.gt[w] + (left <= 0 ? 0 : (left < eq_w ? left : eq_w));
      eq_seen += eq_w;
    }
    for (int b0 = s0; b0 < s1; b0 += 32 * kLoads) {
      uint32_t u[kLoads];
      load_keys(row, b0 + lane, 32, s1, u);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {  // in index order
        const int i = b0 + 32 * j + lane;
        const bool is_eq = i < s1 && u[j] == thr;
        const unsigned em = __ballot_sync(0xffffffffu, is_eq);
        const bool sel = (i < s1 && u[j] > thr) || (is_eq && eq_seen + __popc(em & below) < need_eq);
        const unsigned sm = __ballot_sync(0xffffffffu, sel);
        if (sel) out[taken + __popc(sm & below)] = begin + i;
        taken += __popc(sm);
        eq_seen += __popc(em);
      }
    }
  }
};

// Adaptive budgets (pattern.h; the rule of coverage_count in attention/index/estimate.h) by one block: the
// number of entries of a row of masses (column or diagonal sums, >= 0) to keep: the forced [0, forced) first,
// then the rest by mass (VsTopK's order: order keys descending, ties to the smaller index), the shortest prefix
// whose mass reaches gamma * total, clamped to [max(min_count, forced), max_count]. With S(t) the mass of the
// unforced entries whose order key is >= t: the threshold T is the largest t with F + S(t) >= target (F: the
// forced mass), found by an 8-way search of the key interval (each pass over the row evaluates S at 7 points and
// narrows the interval 8-fold: 11 passes for the 2^31 keys of non-negative floats, where bisection took 31);
// the prefix then holds every unforced entry above T and the first ceil((target - F - S(T + 1)) / mass(T)) of
// those equal to T. Every sum is f64, each thread's in index order, then a fixed tree over lanes and warps: the
// count does not depend on timing (nor on the search: S(t) is the same sum whichever pass evaluates it). The CPU
// sums in the prefix's own order, so the two agree wherever the target is not within rounding of a prefix sum.
struct VsCoverage {
  static constexpr int kWarps = kTopKThreads / 32;
  static constexpr int kPoints = 7;  // thresholds per pass (more spill registers at 512 threads)
  struct Storage {
    double sum[kWarps][kPoints];
    unsigned count[kWarps][kPoints];
    double mass[kPoints];  // the results of the last mass_from
    unsigned n[kPoints];
  };

  // For the thresholds t_j = first + j * step, j < points (<= kPoints): the mass and the number of the entries of
  // row[begin, end) whose order key is >= t_j, into st.mass[j] / st.n[j] (read them before the next call).
  __device__ static void mass_from(const float* row, int begin, int end, uint64_t first, uint64_t step, int points,
                                   Storage& st) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    double m[kPoints];
    unsigned c[kPoints];
#pragma unroll
    for (int j = 0; j < kPoints; ++j) {
      m[j] = 0.0;
      c[j] = 0;
    }
#pragma unroll 2
    for (int i = begin + tid; i < end; i += kTopKThreads) {
      const float x = row[i];
      const uint64_t key = detail::order_key(x);
      if (key < first) continue;
      const uint64_t d = key - first;
      const double v = x > 0.0f ? static_cast<double>(x) : 0.0;
#pragma unroll
      for (int j = 0; j < kPoints; ++j) {
        if (j < points && d >= static_cast<uint64_t>(j) * step) {
          m[j] += v;
          ++c[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kPoints; ++j) {
      if (j >= points) break;  // uniform over the block
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        m[j] += __shfl_xor_sync(0xffffffffu, m[j], o);
        c[j] += __shfl_xor_sync(0xffffffffu, c[j], o);
      }
      if (lane == 0) {
        st.sum[warp][j] = m[j];
        st.count[warp][j] = c[j];
      }
    }
    __syncthreads();  // also: every thread has read st.mass / st.n of the previous call
    if (tid < points) {
      double total = 0.0;
      unsigned count = 0;
      for (int w = 0; w < kWarps; ++w) {
        total += st.sum[w][tid];
        count += st.count[w][tid];
      }
      st.mass[tid] = total;
      st.n[tid] = count;
    }
    __syncthreads();
  }

  __device__ static int count(const float* row, int n, int forced, double gamma, int min_count, int max_count,
                              Storage& st) {
    max_count = min(max_count, n);
    forced = min(forced, max_count);
    const int lo_count = min(max(min_count, forced), max_count);
    int keep = n;
    double total = 0.0;
    if (gamma < 1.0) {
      mass_from(row, 0, n, 0, 1, 1, st);
      total = st.mass[0];
    }
    if (gamma < 1.0 && total > 0.0) {
      const double target = gamma * total;
      mass_from(row, 0, forced, 0, 1, 1, st);
      const double forced_mass = st.mass[0];
      if (forced_mass >= target) {
        keep = forced;
      } else {
        // Keys of masses >= 0 are >= order_key(0) = 0x80000000: the search runs over [lo, hi) with lo valid
        // (F + S(lo) >= target, when all unforced mass reaches it) and hi invalid (S(2^32) = 0).
        uint64_t lo = 0x80000000u, hi = uint64_t{1} << 32;
        mass_from(row, forced, n, lo, 1, 1, st);
        double s_hi = 0.0;
        unsigned c_lo = st.n[0], c_hi = 0;
        if (forced_mass + st.mass[0] >= target) {
          while (hi - lo > 1) {
            // Points lo + step, lo + 2 step, ... below hi: (kPoints + 1)-fold narrower each pass.
            const uint64_t step = (hi - lo + kPoints) / (kPoints + 1);  // >= 1
            const uint64_t fit = (hi - lo - 1) / step;  // points strictly inside (lo, hi)
            const int points = fit < static_cast<uint64_t>(kPoints) ? static_cast<int>(fit) : kPoints;
            mass_from(row, forced, n, lo + step, step, points, st);
            // Valid points form a prefix (S falls as t grows): lo = the last valid, hi = the first invalid.
            uint64_t new_lo = lo, new_hi = hi;
            for (int j = 0; j < points; ++j) {
              const uint64_t t = lo + static_cast<uint64_t>(j + 1) * step;
              if (forced_mass + st.mass[j] >= target) {
                new_lo = t;
                c_lo = st.n[j];
              } else {
                new_hi = t;
                s_hi = st.mass[j];
                c_hi = st.n[j];
                break;
              }
            }
            lo = new_lo;
            hi = new_hi;
          }
          // T = lo: c_hi entries above it (mass s_hi), c_lo - c_hi equal to it, each of mass v.
          const double v = static_cast<double>(__uint_as_float(static_cast<uint32_t>(lo) & 0x7fffffffu));
          const double need = target - forced_mass - s_hi;
          const unsigned eq = c_lo - c_hi;
          unsigned take = 1;
          if (v > 0.0) {
            const double tk = ceil(need / v);
            take = tk < 1.0 ? 1u : (tk >= static_cast<double>(eq) ? eq : static_cast<unsigned>(tk));
          }
          keep = forced + static_cast<int>(c_hi + take);
        }
      }
    }
    return min(max(keep, lo_count), max_count);
  }
};

__global__ void __launch_bounds__(kTopKThreads) vs_topk_kernel(const VsParams p) {
  __shared__ VsTopK::Storage st;
  __shared__ VsCoverage::Storage cover;
  const int slot = blockIdx.x;
  const bool cols = blockIdx.y == 0;
  const VsHeadDesc hd = p.heads[slot];
  const float* score = (cols ? p.colsum : p.diag) + static_cast<int64_t>(slot) * p.keys;
  int32_t* out = cols ? p.columns + hd.column_base : p.offsets + hd.offset_base;
  const int forced = cols ? hd.forced_columns : hd.forced_offsets;
  const int room = cols ? hd.num_columns : hd.num_offsets;
  int count = room;
  if (hd.gamma > 0.0) {
    count = VsCoverage::count(score, p.keys, forced, hd.gamma, cols ? hd.min_columns : hd.min_offsets, room, cover);
  }
  for (int i = threadIdx.x; i < forced; i += kTopKThreads) out[i] = i;
  VsTopK::select(score, forced, p.keys, count - forced, out + forced, st);
  for (int i = count + static_cast<int>(threadIdx.x); i < room; i += kTopKThreads) out[i] = kVsUnused;
}

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

// Adaptive BS budgets (pattern.h; the rule of coverage_count in attention/index/estimate.h, as the CPU's
// estimate_block_sparse applies it) for one query block qb by one warp. The masses are m = expf(s - top) in f32
// (s the f32 scores, top the largest of them; the CPU takes exp(s - top) in f64 of the same f32 scores: the two
// differ by about 1e-7 relative) of the diagonal block (forced: first in the order) and of the blocks [0, qb)
// (row). The count is the shortest prefix of the order (the diagonal, then the rest by mass descending) whose
// summed mass (f64) reaches gamma * total, clamped to [max(min_count, 1), max_count]; blocks of equal mass are
// interchangeable for the count, so ordering by mass rather than by score (the selection afterwards) gives the
// same count. With S(t) the mass of the blocks whose mass's order key is >= t and F the diagonal's mass, the
// threshold T is the largest t with F + S(t) >= target, found by an 8-way radix search over the order keys of the
// masses (>= 0: 31 bits, 11 passes): each pass sorts the blocks whose key lies in the current interval into 8
// buckets of equal key width (per lane, in shared memory, f64 masses and counts), the warp sums each bucket over the
// lanes in lane order, and the interval becomes the highest bucket whose suffix (with the mass above the interval)
// still reaches the target. The prefix then holds the blocks above T and the first ceil((target - F - S(T + 1)) /
// m(T)) of those equal to T. Every pass reads the row's scores again (L2-resident: the scoring kernel just wrote
// them; masses cached in registers took the kernel to 253 registers, one block per SM). Every sum has a fixed order:
// the count does not depend on timing. The CPU sums in the prefix's own order, so the two agree wherever the target is not within rounding of
// a prefix sum (nor the scores within rounding of each other: the CPU's dot products add in another order).
// (v1 evaluated S at 7 thresholds per pass, each element adding into 7 f64 accumulators, and computed f64 masses
// from the scores every pass; docs/PERF.md has each version's 128K estimate time on an H200.)
constexpr int kBsBuckets = 8;
struct BsCoverageStorage {
  double mass[kBsBuckets][32];  // one warp's buckets, a column per lane
  unsigned count[kBsBuckets][32];
};

struct BsCoverage {
  __device__ static float mass(float s, float top) { return expf(s - top); }

  // Every lane must call it with the same arguments; max_count >= 2. `st`: this warp's storage.
  __device__ static int count(const float* scores, int n, float diag, double gamma, int min_count, int max_count,
                              BsCoverageStorage& st) {
    const int lo_count = min(max(min_count, 1), max_count);
    if (gamma >= 1.0) return max_count;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    float top = diag;
    for (int i = lane; i < n; i += 32) top = fmaxf(top, scores[i]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    // One pass: the blocks whose key is in [lo, lo + 2^width) into 8 buckets of width 2^shift (shift = width - 3,
    // or 0 with 2^width buckets); then lane b < 8 holds bucket b's mass and count (bm, bc; bucket_mass(b) reads
    // them on every lane: a shuffle, so that nothing in registers is indexed at run time).
    double bm = 0.0;
    unsigned bc = 0;
    auto bucket_mass = [&](int b) { return __shfl_sync(0xffffffffu, bm, b); };
    auto bucket_count = [&](int b) { return __shfl_sync(0xffffffffu, bc, b); };
    auto pass = [&](uint32_t lo, int width, int shift) {
#pragma unroll
      for (int b = 0; b < kBsBuckets; ++b) {
        st.mass[b][lane] = 0.0;
        st.count[b][lane] = 0;
      }
      for (int i = lane; i < n; i += 32) {
        const float x = mass(scores[i], top);
        const uint32_t key = detail::order_key(x);
        if (key < lo || static_cast<uint64_t>(key - lo) >= (uint64_t{1} << width)) continue;
        const int b = static_cast<int>((key - lo) >> shift);
        st.mass[b][lane] += static_cast<double>(x);
        st.count[b][lane] += 1;
      }
      __syncwarp();
      bm = 0.0;
      bc = 0;
      if (lane < kBsBuckets) {
        for (int l = 0; l < 32; ++l) {
          bm += st.mass[lane][l];
          bc += st.count[lane][l];
        }
      }
      __syncwarp();  // every lane's reads of the storage before the next pass clears it
    };
    const double forced_mass = static_cast<double>(mass(diag, top));
    constexpr uint32_t kZero = 0x80000000u;  // order_key(0.0f); masses are in [0, 1]: keys in [kZero, 2^32)
    // The first pass over the whole interval also gives the total.
    uint32_t lo = kZero;
    int width = 31;
    pass(lo, width, width - 3);
    double total_rest = 0.0;
    for (int b = 0; b < kBsBuckets; ++b) total_rest += bucket_mass(b);
    const double target = gamma * (forced_mass + total_rest);
    int keep = n + 1;  // no prefix reaches the target (rounding): all
    if (forced_mass >= target) {
      keep = 1;
    } else if (forced_mass + total_rest >= target) {
      double s_above = 0.0;  // mass and number of the blocks above the interval
      unsigned c_above = 0;
      for (;;) {
        const int shift = width > 3 ? width - 3 : 0;
        const int buckets = 1 << (width - shift);
        // The highest bucket whose suffix still reaches the target (bucket 0's always does: the invariant).
        double suffix = s_above;
        unsigned csuffix = c_above;
        int chosen = 0;
        for (int b = buckets - 1; b >= 0; --b) {
          const double mb = bucket_mass(b);
          if (forced_mass + suffix + mb >= target) {
            chosen = b;
            break;
          }
          suffix += mb;
          csuffix += bucket_count(b);
        }
        s_above = suffix;
        c_above = csuffix;
        lo += static_cast<uint32_t>(chosen) << shift;
        if (shift == 0) {
          // T = lo: c_above blocks above it (mass s_above), bc[chosen] equal to it, each of mass v.
          const unsigned eq = bucket_count(chosen);
          const double v = static_cast<double>(__uint_as_float(lo & 0x7fffffffu));
          const double need = target - forced_mass - s_above;
          unsigned take = 1;
          if (v > 0.0) {
            const double tk = ceil(need / v);
            take = tk < 1.0 ? 1u : (tk >= static_cast<double>(eq) ? eq : static_cast<unsigned>(tk));
          }
          keep = 1 + static_cast<int>(c_above + take);
          break;
        }
        width = shift;
        pass(lo, width, width > 3 ? width - 3 : 0);
      }
    }
    return min(max(keep, lo_count), max_count);
  }
};

// The score of query block e (entry of the head in slot `slot`) against its own key block qb, as bs_score_kernel
// computes the others (v1's tree: lane l's leaf is the fma over elements l, l + 32, ... from +0, the leaves added
// by the xor butterfly over lane masks 16 .. 1, times the scale), on every lane.
template <int D>
__device__ __forceinline__ float bs_diag_score(const BsParams& p, const BsHeadDesc& hd, int slot, int e, int qb) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const float* qp = p.qpool + (static_cast<int64_t>(slot) * p.max_q_blocks + e) * D;
  const float* kp = p.kpool + hd.kpool_base + static_cast<int64_t>(qb) * D;
  float a = 0.0f;
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    const int pos = bs_leaf_pos<D>(lane + 32 * t);
    a = fmaf(qp[pos], kp[pos], a);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) a = a + __shfl_xor_sync(0xffffffffu, a, o);
  return a * p.scale;
}

// grid (tiles of the wave, tile rows / 8): a warp per query block. The diagonal block qb is always kept (one
// of the top_k slots) and goes last; the other count - 1 are the top of [0, qb) by score, ascending, as in
// the CPU estimator (attention/index/estimate.h). count = min(top_k, qb + 1), the layout's room; for adaptive
// heads (gamma > 0) with room >= 2 the coverage count (BsCoverage), and kBsUnused fills the room after the kept.
// kAdaptive: the layer has adaptive heads (the fixed-only kernel keeps the coverage count's code and shared memory
// out).
template <int D, bool kAdaptive>
__global__ void __launch_bounds__(kBsSelectThreads) bs_select_kernel(const BsParams p, int tile_begin) {
  using TopK = detail::WarpTopK<kBsRegSlots>;
  __shared__ uint32_t buf[kBsSelectThreads / 32][TopK::kBufWords];
  __shared__ BsCoverageStorage cover[kAdaptive ? kBsSelectThreads / 32 : 1];
  const BsTileDesc tl = p.tiles[tile_begin + static_cast<int>(blockIdx.x)];
  const BsHeadDesc hd = p.heads[tl.slot];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = tl.e0 + static_cast<int>(blockIdx.y) * (kBsSelectThreads / 32) + warp;
  if (e >= tl.e1) return;  // uniform across the warp
  const int qb = hd.first_q_block + e;
  const int room = min(hd.top_k, qb + 1);
  if (room <= 0) return;
  int32_t* out = p.key_blocks + hd.key_base + p.offsets[hd.offsets_base + e];
  int count = room;
  if constexpr (kAdaptive) {
    if (hd.gamma > 0.0 && room >= 2) {  // a scored row (adaptive heads score every qb >= 1)
      const float* row = p.scores + bs_row_offset(tl, hd.first_q_block, e);
      const float diag = bs_diag_score<D>(p, hd, tl.slot, e, qb);
      count = BsCoverage::count(row, qb, diag, hd.gamma, hd.min_top_k, room, cover[warp]);
    }
  }
  const int k = count - 1;
  if (k >= qb) {
    for (int i = lane; i < qb; i += 32) out[i] = i;
  } else if (k > 0) {  // a scored row: 2 <= top_k <= qb, or adaptive
    const float* row = p.scores + bs_row_offset(tl, hd.first_q_block, e);
    if (qb <= 32 * kBsRegSlots) {
      TopK::select<true>(row, qb, k, out, buf[warp]);
    } else {
      TopK::select<false>(row, qb, k, out, buf[warp]);
    }
  }
  if (lane == 0) out[count - 1] = qb;
  for (int i = count + lane; i < room; i += 32) out[i] = kBsUnused;
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
