// tessera/attention/cuda/vs_estimate_kernels.cuh — the VS estimator's scoring passes (device code): VsParams,
// the Q / K tile pipeline on the tensor cores, vs_stats and vs_merge_stats (row maxima and normalisers),
// vs_sums and vs_merge_diag (column and diagonal sums of A). The selection that follows: vs_select_kernels.cuh.
// Part of estimate_kernels.cuh (which says who includes these headers and why everything in them has internal
// linkage); host-compiled by tests/emulation with TESSERA_EMULATION defined.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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

constexpr int kVsRows = 64;  // rows of the VS estimate handled by one CTA (4 warps x 16)
constexpr float kLog2e = 1.4426950408889634f;  // VS row maxima are kept in log2 units (vs_stats)
constexpr int kVsPStride = 72;  // vs_sums' sP rows: a half warp's float2 stores of a C fragment hit 32 banks

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

// vs_stats' and vs_sums' dynamic shared memory, from vs_smem_base.
__device__ __forceinline__ unsigned char* vs_dynamic_smem() {
#ifndef TESSERA_EMULATION
  extern __shared__ __align__(1024) unsigned char smem_raw[];
#else
  unsigned char* smem_raw = emu::dynamic_smem();  // host emulation (tests/emulation)
#endif
  return vs_smem_base(smem_raw);
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
  unsigned char* smem = vs_dynamic_smem();
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
  unsigned char* smem = vs_dynamic_smem();
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

}  // namespace

}  // namespace tessera::attn::gpu
