// tessera/attention/cuda/hopper/consumer.cuh — the consumers of the Hopper prefill kernel: two warpgroups that
// compute S = Q K^T and P V on the tensor cores (wgmma) with an online softmax between them (device code, sm_90a).
//
// Warpgroup cw (0 or 1) owns query rows [64 cw, 64 cw + 64) of every item; per step of 128 keys (two pipeline
// stages, "pair" step: the per-step costs — barriers, waits, max shuffles, descriptor set-up, branches — are paid
// once per 128 keys):
//   issue_qk   S[64 x 128] = Q K^T, 8 x wgmma m64n128k16, Q from registers (read once per item, load_q), K from
//              the stage pair's [2 halves][128 rows] operand;
//   softmax    mask (when a tile is masked), running max (a tree over the row's 32 scores; moved only when it grows
//              by more than 2^kRescaleLog2), P = 2^(S * scale_log2 - m) as one FFMA + EX2 per score, row sums;
//              alpha = the factor O must be multiplied by;
//   rescale    O *= alpha, skipped when no row of the thread changed its max (alpha = 1 exactly);
//   pack_p     P to 16-bit pairs: the A fragments of P V (the accumulator layout is mma.sync's C layout, which is
//              the A layout of the next k-step: no shuffle);
//   issue_pv   O[64 x 128] += P V, 8 x m64n128k16, V N-major (transposed), k-steps 0-3 from tile a, 4-7 from b.
// S of step j overlaps P V of step j - 1, and the two warpgroups ping-pong (FA3's schedule: they take turns issuing
// their wgmmas through named barriers 2 and 3, so that one warpgroup's softmax runs while the tensor cores work on
// the other's tiles). An item with an odd number of tiles ends with a one-tile step: the missing half's scores
// are masked out and its wgmmas read tile a again.
// Accumulator layout (hopper/wgmma.cuh): thread (warp w, g = lane / 4, c4 = lane % 4) holds rows 16w + g and
// 16w + g + 8 of its warpgroup's 64, columns 8i + 2 c4 + {0, 1}.
#pragma once

#include <cstdint>

#include "attention/cuda/hopper/config.cuh"
#include "attention/cuda/hopper/wgmma.cuh"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/prefill_epilogue.cuh"

namespace tessera::attn::gpu::detail {

// One consumer warpgroup's accumulators and softmax state, and the wgmma issue of one step.
template <typename T>
struct HopperConsumer {
  static constexpr int D = HopperConfig::D;
  static constexpr int BN = 2 * HopperConfig::BN;  // keys per step
  static constexpr float kRescaleLog2 = static_cast<float>(HopperConfig::kRescaleLog2);
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

  // Q's A fragments for this warp's 16 rows, all 8 k-steps of 16 (32 registers), read once per item with
  // ldmatrix from the [BM][128] swizzled tile at q_tile; row16 = the warp's first row in the tile.
  __device__ __forceinline__ static void load_q(uint32_t (&qf)[D / 16][4], uint32_t q_tile, int row16) {
    const int lane = threadIdx.x % 32;
    const int row = row16 + (lane % 16);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qf[kk], q_tile + sw128_offset<HopperConfig::BM>(row, 2 * kk + lane / 16));
  }

  // S[64 x 128] = Q K^T over the two key tiles of a stage pair (k_desc: the pair's base). Issued and committed.
  __device__ __forceinline__ static void issue_qk(float (&sc)[BN / 2], const uint32_t (&qf)[D / 16][4],
                                                  uint64_t k_desc) {
    fence_operands(sc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      Wg::rs_m64n128(sc, qf[kk], desc_advance(k_desc, (kk / 4) * (128 * 128) + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // O += P V over 128 keys, k-steps 0-3 from V tile a, 4-7 from V tile b. Issued and committed.
  __device__ __forceinline__ void issue_pv(const uint32_t (&pa)[BN / 16][4], uint64_t v_desc_a, uint64_t v_desc_b) {
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      Wg::rs_m64n128_tb(o, pa[kk], desc_advance(kk < 4 ? v_desc_a : v_desc_b, (kk % 4) * 16 * 128));
    }
    wgmma_commit();
  }

  // Mask, running max and sums; sc becomes P relative to the new max; alpha[e] is the factor for O's row e. The key
  // positions of columns 0-63 come from tile a's list and span, 64-127 from tile b's; a step without a second tile
  // (the item's odd last tile) passes masked_b with span_b = 0: nothing visible.
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
      // The row's maximum as a tree of depth log2(BN / 4) (a chain costs 0.4-0.5% more cycles, ninth H200 run).
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
      float mx = t[0];
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // The raw max times the (positive) scale is the scaled max. Lazy rescaling: the running max moves only
      // when the tile's exceeds it by more than kRescaleLog2, so most steps keep alpha = 1 and skip the 64
      // multiplies of O (H200 profile: ~36 FMUL per step). Exact, not approximate: P, l and O all use the same
      // max; P is then at most 2^kRescaleLog2 (256), well inside bf16/f16 range and the f32 accumulators.
      const float m_cand = fmaxf(m[e], mx * scale_log2);
      const float m_new = m_cand > m[e] + kRescaleLog2 ? m_cand : m[e];
      const float m_use = m_new == neg_inf ? 0.0f : m_new;  // a row with nothing visible yet stays at zero
      alpha[e] = m_new == m[e] ? 1.0f : fast_exp2(m[e] - m_use);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        sc[4 * i + 2 * e] = fast_exp2(fmaf(sc[4 * i + 2 * e], scale_log2, -m_use));
        sc[4 * i + 2 * e + 1] = fast_exp2(fmaf(sc[4 * i + 2 * e + 1], scale_log2, -m_use));
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

// One step's wgmma issue and the wait for its S, in this warpgroup's ping-pong turn: wait for the turn (named
// barrier 2 + cw), issue S, then the previous step's P V when one is pending (pv_pending), committed in that order,
// hand the turn to the other warpgroup (3 - cw); waiting for all but the last group then waits for S only.
template <class IssueS, class IssuePv>
__device__ __forceinline__ void hopper_issue_step(int cw, bool pv_pending, IssueS&& issue_s, IssuePv&& issue_pv) {
  named_barrier_sync(2 + cw, 256);
  issue_s();
  if (pv_pending) {
    issue_pv();
    named_barrier_arrive(3 - cw, 256);
    wgmma_wait<1>();  // S done, P V may still run
  } else {
    named_barrier_arrive(3 - cw, 256);
    wgmma_wait<0>();
  }
}

// The consumer warpgroup's loop over the stages the producer fills (hopper/producer.cuh has the protocol); wq is
// the warp's index in its warpgroup. Both warpgroups see the same stages, so their ping-pong turns pair up;
// warpgroup 1 opens with one arrive, which is left pending at the end. The consumer state (O, the P fragments, the
// pending stages) lives for the whole CTA rather than one item: with the same instructions per step (602-603 in the
// SASS), this form took 2.6-3.0% fewer cycles than per-item state (H200, ncu; docs/PERF.md ninth run).
template <typename T>
__device__ __forceinline__ void hopper_consumer_loop(const PrefillParams& p, const HopperSmem& L, int cw, int wq,
                                                     int lane) {
  using Cfg = HopperConfig;
  using Consumer = HopperConsumer<T>;
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN, kStages = Cfg::kStages;  // BN: one key tile (stage)
  const int g = lane / 4, c4 = lane % 4;
  auto release = [&](uint32_t b) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(b);
  };
  if (cw == 1) named_barrier_arrive(2, 256);
  const uint64_t k_desc0 = sw128_desc(L.sK, 16, 1024), v_desc0 = sw128_desc(L.sV, p.pv_lbo, p.pv_sbo);
  auto k_desc = [&](int st) { return desc_advance(k_desc0, st * Cfg::kKvBytes); };
  auto v_desc = [&](int st) { return desc_advance(v_desc0, st * Cfg::kKvBytes); };
  Consumer cs;
  cs.start(0);  // every item starts it again; this defines it before the lambdas below capture it
  uint32_t pa[Consumer::BN / 16][4];
  int prev_a = -1, prev_b = -1;  // stages of the previous step, whose P V is pending (prev_b -1: one tile)
  // Epilogue (prefill_epilogue.cuh): the item's rows, normalised, with their lse.
  auto store_item = [&](int item, const RowTotals& r) {
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    store_rows<T, D>(p, h, row0 + cw * 64 + wq * 16, g, c4, r, -1, row0,
                     [&](int i, int e) { return make_float2(cs.o[4 * i + 2 * e], cs.o[4 * i + 2 * e + 1]); });
  };
  auto flush_pv = [&] {
    cs.issue_pv(pa, v_desc(prev_a), v_desc(prev_b >= 0 ? prev_b : prev_a));
    wgmma_wait<0>();
    fence_operands(cs.o);
    Consumer::keep_live(pa);
    release(L.empty(prev_a));
    if (prev_b >= 0) release(L.empty(prev_b));
    prev_a = prev_b = -1;
  };
  int it = 0;
  for (int n = 0;; ++n) {
    int st = it % kStages;
    mbarrier_wait(L.full(st), (it / kStages) & 1);
    int4 mt = L.meta[st];
    if (mt.z & Cfg::kFlagSkip) {  // the stage that puts the item's first tile on an even stage
      release(L.empty(st));
      ++it;
      st = it % kStages;
      mbarrier_wait(L.full(st), (it / kStages) & 1);
      mt = L.meta[st];
    }
    if (mt.z & Cfg::kFlagEnd) break;
    const int item = mt.x;
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    mbarrier_wait(L.qfull(), n & 1);
    uint32_t qf[D / 16][4];
    Consumer::load_q(qf, L.sQ, cw * 64 + wq * 16);
    release(L.qempty());  // Q is in registers: the producer may load the next item's
    cs.start(pos0 + cw * 64 + wq * 16 + g);
    if (mt.y == 0) {  // an item without key tiles: its one (last) descriptor, rows written as empty
      release(L.empty(st));
      ++it;
      store_item(item, row_totals(cs.l, cs.m));
      continue;
    }
    for (;;) {
      int st_b = -1;
      int4 mb = make_int4(0, 0, 0, 0);
      if (!(mt.z & Cfg::kFlagLast)) {  // a tile follows in this item (its count is > 0)
        st_b = (it + 1) % kStages;
        mbarrier_wait(L.full(st_b), ((it + 1) / kStages) & 1);
        mb = L.meta[st_b];
      }
      const bool has_b = st_b >= 0;
      if ((mt.z | mb.z) & Cfg::kFlagCopied) fence_proxy_async_shared();  // cp.async tiles before wgmma reads
      float s[Consumer::BN / 2];
      hopper_issue_step(
          cw, prev_a >= 0,
          [&] { Consumer::issue_qk(s, qf, k_desc(st)); },  // st even: the pair's base (b's rows follow)
          [&] { cs.issue_pv(pa, v_desc(prev_a), v_desc(prev_b >= 0 ? prev_b : prev_a)); });
      fence_operands(s);
      float alpha[2];
      // Without a second tile, the pair's upper half holds stale rows: masked out whole (span 0).
      cs.softmax(s, (mt.z & Cfg::kFlagMasked) != 0, L.keys + st * BN, !has_b || (mb.z & Cfg::kFlagMasked) != 0,
                 L.keys + (has_b ? st_b : st) * BN, p.span, has_b ? p.span : 0u, p.scale_log2, alpha);
      // Keeps the wait below the softmax: no instruction links the two, and ptxas otherwise schedules the wait for
      // P V first, serialising the softmax with P V (H200 profile: 10% of the samples on that wait). ptxas does not
      // move the wait above a shared-memory store, and the row sums need every score of the step, so storing them
      // pins the whole softmax before the wait. (A never-taken trap branch made ptxas serialise every wgmma,
      // C7518; a __syncwarp was compiled away.)
      if (lane == 0) L.pin[cw * 4 + wq] = cs.l[0] + cs.l[1];
      wgmma_wait<0>();  // P V of the previous step
      fence_operands(cs.o);
      Consumer::keep_live(pa);
      if (prev_a >= 0) {
        release(L.empty(prev_a));
        if (prev_b >= 0) release(L.empty(prev_b));
      }
      cs.rescale(alpha);
      Consumer::pack_p(s, pa);
      prev_a = st;
      prev_b = st_b;
      it += has_b ? 2 : 1;
      if (!has_b || (mb.z & Cfg::kFlagLast)) break;
      st = it % kStages;
      mbarrier_wait(L.full(st), (it / kStages) & 1);
      mt = L.meta[st];
    }
    flush_pv();
    store_item(item, row_totals(cs.l, cs.m));
  }
}

}  // namespace tessera::attn::gpu::detail
