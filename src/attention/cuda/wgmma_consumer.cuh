// tessera/attention/cuda/wgmma_consumer.cuh — one consumer warpgroup's share of a key tile in the Hopper
// prefill kernels (device code, sm_90a): S = Q K^T on the tensor cores, the online-softmax step, O += P V.
//
// Shared by the two wgmma kernels: sparse_prefill_wgmma.cuh (all threads load and compute, one barrier per
// key tile) and sparse_prefill_wgmma_ws.cuh (a producer warpgroup loads, two consumer warpgroups compute,
// mbarriers between them). A warpgroup owns 64 query rows; per key tile of BN = 64 keys:
//   issue_qk   S[64 x 64] = Q[64 x 128] K^T, 8 x wgmma m64n64k16 (Q and K from shared memory, K-major);
//   softmax    mask (when the tile is masked), running max (moved only when it grows by more than 2^8),
//              P = 2^(S * scale_log2 - m) as one FFMA + EX2 per score, row sums; alpha = the factor O must be
//              multiplied by;
//   rescale    O *= alpha, skipped when no row of the thread changed its max (alpha = 1 exactly);
//   pack_p     P to 16-bit pairs: the A fragments of P V (the accumulator layout is mma.sync's C layout,
//              which is the A layout of the next k-step: no shuffle);
//   issue_pv   O[64 x 128] += P V, 4 x m64n128k16 (or 8 x m64n64k16, kSplitPv), V N-major (transposed).
// Accumulator layout (wgmma_sm90.cuh): thread (warp w, g = lane / 4, c4 = lane % 4) holds rows 16w + g and
// 16w + g + 8 of its warpgroup's 64, columns 8i + 2 c4 + {0, 1}.
#pragma once

#include <cstdint>

#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/wgmma_sm90.cuh"

namespace tessera::attn::gpu::detail {

// kRescale: the lazy-rescaling threshold in log2 units (softmax); 0 moves the max whenever it grows (eager).
// kBN: keys per step, 64 (one key tile) or 128 (two key tiles of 64 from two pipeline stages, the "pair" step:
// the per-step costs — barriers, waits, max shuffles, descriptor set-up, branches — are paid once per 128 keys).
// kPolyExp: of every BN / 8 column blocks of 8 scores, this many take 2^x from an FMA polynomial (poly_exp2) instead
// of the MUFU unit (whose 16 results per SM and clock are half the tensor cores' time at D = 128); 0: MUFU only.
// kMaxTree: each row's maximum as a tree of depth log2(BN / 4) instead of a chain.
template <typename T, bool kSplitPv, int kRescale = 8, int kBN = 64, int kPolyExp = 0, bool kMaxTree = false>
struct WgmmaConsumer {
  static constexpr int D = 128;
  static constexpr int BN = kBN;
  static_assert(kBN == 64 || kBN == 128, "a step covers one or two key tiles of 64");
  static_assert(kPolyExp >= 0 && kPolyExp <= kBN / 8 && (kPolyExp == 0 || (kBN / 8) % (kPolyExp > 0 ? kPolyExp : 1) == 0),
                "kPolyExp: a divisor of the step's column blocks");
  static constexpr float kRescaleLog2 = static_cast<float>(kRescale);  // see softmax
  using Mma = MmaTraits<T>;
  using Wg = Wgmma<T>;

  float o[D / 2];  // 64 x 128 per warpgroup: 16 column blocks of 8, 4 values each
  float m[2];      // running max of rows g and g + 8, in scaled (log2) units
  float l[2];      // running sums (this thread's columns only; the 4 lanes of a row are summed at the end)
  int pos_row[2];  // absolute positions of rows g and g + 8

  __device__ __forceinline__ void start(int pos_first_row_of_thread) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    const float neg_inf = -__int_as_float(0x7f800000);
    m[0] = m[1] = neg_inf;
    l[0] = l[1] = 0.0f;
    pos_row[0] = pos_first_row_of_thread;
    pos_row[1] = pos_first_row_of_thread + 8;
  }

  // S = Q K^T for this warpgroup's rows: q_wg is the shared address of its first Q row (in a [BM][128] tile
  // of `q_rows` rows), k_stage the K tile's. Issued and committed, not waited for.
  template <int kQRows>
  __device__ __forceinline__ static void issue_qk(float (&sc)[BN / 2], uint32_t q_wg, uint32_t k_stage) {
    fence_operands(sc);
    wgmma_fence();
    const uint64_t qd = sw128_desc(q_wg, 16, 1024), kd = sw128_desc(k_stage, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      Wg::ss_m64n64(sc, desc_advance(qd, (kk / 4) * (kQRows * 128) + (kk % 4) * 32),
                    desc_advance(kd, (kk / 4) * (BN * 128) + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }

  // Q's A fragments for this warp's 16 rows, all 8 k-steps of 16 (32 registers), read once per item with
  // ldmatrix from the [kQRows][128] swizzled tile at q_tile; row16 = the warp's first row in the tile.
  template <int kQRows>
  __device__ __forceinline__ static void load_q(uint32_t (&qf)[D / 16][4], uint32_t q_tile, int row16) {
    const int lane = threadIdx.x % 32;
    const int row = row16 + (lane % 16);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], q_tile + sw128_offset<kQRows>(row, 2 * kk + lane / 16));
  }
  // S = Q K^T with Q from registers (load_q): K is the only shared-memory operand, so the tensor cores read
  // 2 KB per k-step instead of 4 (the shared-memory bandwidth bound of the m64n64 "ss" form). Issued and
  // committed, not waited for.
  __device__ __forceinline__ static void issue_qk_rs(float (&sc)[BN / 2], const uint32_t (&qf)[D / 16][4],
                                                     uint32_t k_stage) {
    issue_qk_rs_desc(sc, qf, sw128_desc(k_stage, 16, 1024));
  }
  // The same from the K tile's descriptor (k_desc = sw128_desc(k_stage, 16, 1024), e.g. stage 0's advanced by
  // desc_advance): the kernel builds it once, each k-step adds a constant.
  __device__ __forceinline__ static void issue_qk_rs_desc(float (&sc)[BN / 2], const uint32_t (&qf)[D / 16][4],
                                                          uint64_t k_desc) {
    fence_operands(sc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      Wg::rs_m64n64(sc, qf[kk], desc_advance(k_desc, (kk / 4) * (BN * 128) + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }

  // O += P V, P of key block kk (16 keys) in pa[kk]; issued and committed, not waited for.
  __device__ __forceinline__ void issue_pv(const uint32_t (&pa)[BN / 16][4], uint32_t v_stage, uint32_t lbo,
                                           uint32_t sbo) {
    issue_pv_desc(pa, sw128_desc(v_stage, kSplitPv ? sbo : lbo, sbo));
  }
  // The same from the V tile's descriptor (v_desc = sw128_desc(v_stage, lbo, sbo); with kSplitPv lbo = sbo).
  __device__ __forceinline__ void issue_pv_desc(const uint32_t (&pa)[BN / 16][4], uint64_t v_desc) {
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t b = desc_advance(v_desc, kk * 16 * 128);
      if constexpr (kSplitPv) {
        Wg::template rs_m64n64_tb<0>(o, pa[kk], b);
        Wg::template rs_m64n64_tb<D / 4>(o, pa[kk], desc_advance(b, BN * 128));
      } else {
        Wg::rs_m64n128_tb(o, pa[kk], b);
      }
    }
    wgmma_commit();
  }

  // Pair step (kBN = 128): S[64 x 128] = Q K^T over the two key tiles of a stage pair, which the producer
  // stores as one [2 halves][128 rows] operand (k_desc: the pair's base), so 8 x m64n128k16 (two m64n64 per
  // k-step cost twice the wgmma issues and descriptor set-up). Q from registers. Issued and committed.
  __device__ __forceinline__ static void issue_qk_rs_pair(float (&sc)[BN / 2], const uint32_t (&qf)[D / 16][4],
                                                          uint64_t k_desc) {
    static_assert(kBN == 128, "pair step only");
    fence_operands(sc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      Wg::rs_m64n128(sc, qf[kk], desc_advance(k_desc, (kk / 4) * (128 * 128) + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // Pair step: O += P V over 128 keys, k-steps 0-3 from V tile a, 4-7 from V tile b.
  __device__ __forceinline__ void issue_pv_pair(const uint32_t (&pa)[BN / 16][4], uint64_t v_desc_a,
                                                uint64_t v_desc_b) {
    static_assert(kBN == 128 && !kSplitPv, "pair step: one m64n128 per k-step");
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      Wg::rs_m64n128_tb(o, pa[kk], desc_advance(kk < 4 ? v_desc_a : v_desc_b, (kk % 4) * 16 * 128));
    }
    wgmma_commit();
  }

  // Mask (keys: the tile's key positions, kAbsentKey for absent rows), running max and sums; sc becomes P
  // relative to the new max; alpha[e] is the factor for O's row e.
  __device__ __forceinline__ void softmax(float (&sc)[BN / 2], bool masked, const int* keys, uint32_t span,
                                          float scale_log2, float (&alpha)[2]) {
    softmax(sc, masked, keys, masked, keys, span, span, scale_log2, alpha);
  }
  // The same with the key positions of columns 64-127 (pair step) from their own tile's list and span; a pair
  // without a second tile (the item's odd last tile) passes masked_b with span_b = 0: nothing visible.
  __device__ __forceinline__ void softmax(float (&sc)[BN / 2], bool masked_a, const int* keys_a, bool masked_b,
                                          const int* keys_b, uint32_t span_a, uint32_t span_b, float scale_log2,
                                          float (&alpha)[2]) {
    const float neg_inf = -__int_as_float(0x7f800000);
#pragma unroll
    for (int half = 0; half < BN / 64; ++half) {
      if (half == 0 ? masked_a : masked_b) {
        const int* keys = half == 0 ? keys_a : keys_b;
        const uint32_t span = half == 0 ? span_a : span_b;
#pragma unroll
        for (int i = 8 * half; i < 8 * half + 8; ++i) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int key = keys[(i - 8 * half) * 8 + 2 * (threadIdx.x % 4) + j];
            if (!key_visible(pos_row[0], key, span)) sc[4 * i + j] = neg_inf;
            if (!key_visible(pos_row[1], key, span)) sc[4 * i + 2 + j] = neg_inf;
          }
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = neg_inf;
      if constexpr (kMaxTree) {
        float t[BN / 8];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) t[i] = fmaxf(sc[4 * i + 2 * e], sc[4 * i + 2 * e + 1]);
#pragma unroll
        for (int i = 0; i < BN / 16; ++i) t[i] = fmaxf(t[i], t[i + BN / 16]);
#pragma unroll
        for (int i = 0; i < BN / 32; ++i) t[i] = fmaxf(t[i], t[i + BN / 32]);
#pragma unroll
        for (int i = 0; i < BN / 64; ++i) t[i] = fmaxf(t[i], t[i + BN / 64]);
#pragma unroll
        for (int i = 0; i < BN / 128; ++i) t[i] = fmaxf(t[i], t[i + BN / 128]);
        mx = t[0];
      } else {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(sc[4 * i + 2 * e], sc[4 * i + 2 * e + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The raw max times the (positive) scale is the scaled max. Lazy rescaling: the running max moves only
      // when the tile's exceeds it by more than kRescaleLog2, so most steps keep alpha = 1 and skip the 64
      // multiplies of O (H200 profile: ~36 FMUL per step). Exact, not approximate: P, l and O all use the same
      // max; P is then at most 2^kRescaleLog2 (256 by default), well inside bf16/f16 range and the f32 accumulators.
      const float m_cand = fmaxf(m[e], mx * scale_log2);
      const float m_new = m_cand > m[e] + kRescaleLog2 ? m_cand : m[e];
      const float m_use = m_new == neg_inf ? 0.0f : m_new;  // a row with nothing visible yet stays at zero
      alpha[e] = m_new == m[e] ? 1.0f : fast_exp2(m[e] - m_use);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        // Every (BN / 8 / kPolyExp)-th column block on the FMA pipe, the others on MUFU.
        constexpr int kEvery = kPolyExp > 0 ? BN / 8 / kPolyExp : 1;
        if (kPolyExp > 0 && i % kEvery == kEvery - 1) {
          sc[4 * i + 2 * e] = poly_exp2(fmaf(sc[4 * i + 2 * e], scale_log2, -m_use));
          sc[4 * i + 2 * e + 1] = poly_exp2(fmaf(sc[4 * i + 2 * e + 1], scale_log2, -m_use));
        } else {
          sc[4 * i + 2 * e] = fast_exp2(fmaf(sc[4 * i + 2 * e], scale_log2, -m_use));
          sc[4 * i + 2 * e + 1] = fast_exp2(fmaf(sc[4 * i + 2 * e + 1], scale_log2, -m_use));
        }
        sum += sc[4 * i + 2 * e] + sc[4 * i + 2 * e + 1];
      }
      l[e] = l[e] * alpha[e] + sum;
      m[e] = m_new;
    }
    // Pin the results here: the scores, max and sums are plain register arithmetic, so without these the
    // compiler may sink the whole step below the next volatile asm (the wait for the pending P V), which
    // serialises the softmax with P V (H200 profile: the wait at the top of the step took 6.7% of the samples).
    fence_operands(sc);
    fence_operands(alpha);
    fence_operands(m);
    fence_operands(l);
  }

  __device__ __forceinline__ void rescale(const float (&alpha)[2]) {
    if (alpha[0] == 1.0f && alpha[1] == 1.0f) return;  // the common case once the maxima settle
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[4 * i] *= alpha[0];
      o[4 * i + 1] *= alpha[0];
      o[4 * i + 2] *= alpha[1];
      o[4 * i + 3] *= alpha[1];
    }
  }

  __device__ __forceinline__ static void pack_p(const float (&sc)[BN / 2], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = Mma::pack(sc[8 * kk + 0], sc[8 * kk + 1]);
      pa[kk][1] = Mma::pack(sc[8 * kk + 2], sc[8 * kk + 3]);
      pa[kk][2] = Mma::pack(sc[8 * kk + 4], sc[8 * kk + 5]);
      pa[kk][3] = Mma::pack(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
  }

  // Keeps the P fragments alive (and in place) until the P V that reads them was waited for.
  __device__ __forceinline__ static void keep_live(uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(pa[kk][j])::"memory");
    }
  }
};

}  // namespace tessera::attn::gpu::detail
