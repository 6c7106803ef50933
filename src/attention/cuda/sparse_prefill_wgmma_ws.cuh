// tessera/attention/cuda/sparse_prefill_wgmma_ws.cuh — the warp-specialized Hopper (sm_90a) sparse prefill
// kernel: a producer warpgroup loads, two consumer warpgroups compute (device code; see sparse_prefill.h).
//
// Same contract, item cursor, scores and epilogue as sparse_prefill_wgmma.cuh (bf16/f16, head_dim 128, query
// tile 128, key tiles of 64); the difference is who does what and how they synchronise:
//  - warpgroup 0 (the producer, 128 threads, registers lowered to 56) takes items from the plan's counter,
//    walks each item's key tiles with the shared KeyCursor and copies Q and every K/V tile into shared memory
//    with cp.async (ranges and gathered columns alike: 16-byte chunks into the 128-byte-swizzled layout),
//    writing the tile's key positions and a small descriptor (item, key count, masked / last flags) beside it;
//  - warpgroups 1 and 2 (the consumers, registers raised to 224) own query rows [0, 64) and [64, 128) of the
//    item and run S = Q K^T, the online softmax and P V (WgmmaConsumer), S of tile j overlapped with P V of
//    tile j - 1 as in the overlapped variant of the other kernel; with kQRegs, Q is read into registers once
//    per item (32 per thread) and S is computed with Q as the register operand: the m64n64 shared-memory form
//    reads 4 KB of operands per 32 cycles of tensor work, which with the K/V copies landing in shared memory
//    saturates its bandwidth (first H200 run: 364-392 TFLOP/s with Q in shared memory);
//  - between them, mbarriers instead of __syncthreads: full[s] completes when the producer's copies into stage
//    s have landed (cp.async.mbarrier.arrive, one per producer thread) and its descriptor is written (one
//    ordinary arrive per producer thread, release semantics); empty[s] when both consumer warpgroups are done
//    with stage s (one arrive per consumer warp, after the P V that read V was waited for). Q is
//    double-buffered with its own full/empty pair, so the next item's Q and first tiles load while the
//    consumers finish the previous item.
// Nothing synchronises the whole CTA after the start, so the consumers never wait for a load they do not
// need yet, and no consumer thread issues a copy or walks the index. Items without key tiles still send one
// descriptor (count 0, last) so that their rows are written (zeros, lse -inf). After the last item the
// producer sends an "end" descriptor and both roles leave.
#pragma once

#include <cuda.h>  // CUtensorMap (the driver entry point is looked up at run time: no libcuda link)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/sparse_prefill_kernel.cuh"
#include "attention/cuda/wgmma_consumer.cuh"
#include "attention/cuda/wgmma_sm90.cuh"
#include "attention/cuda/work_plan.h"

namespace tessera::attn::gpu::detail {

// kQBufsT: Q buffers in shared memory (2: the next item's Q loads while the current one's is still read; 1: Q
// is read into registers at the item's start, so one buffer suffices and its 32 KB go to two more K/V stages).
template <int kStagesT, int kQBufsT = 2>
struct WgmmaWsConfig {
  static constexpr int D = 128;
  static constexpr int BM = 128;
  static constexpr int BN = kPrefillKeyTile;  // 64
  static constexpr int kStages = kStagesT;
  static constexpr int kProducerThreads = 128;
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;  // 128 x 56 + 256 x 224 = 64512 <= 65536
  static constexpr int kChunks = D / 8;
  static constexpr int kQBufs = kQBufsT;
  // The pair-step layout (one Q buffer): the K tiles of stages 2p and 2p + 1 form one [2 halves][128 rows]
  // operand (S over 128 keys is one m64n128 per k-step), and every item starts on an even stage (the producer
  // sends a skip descriptor after an item with an odd number of tiles).
  static constexpr bool kPairs = kQBufs == 1;
  static constexpr uint32_t kQBytes = BM * D * 2;   // 32 KB per buffer
  static constexpr uint32_t kKvBytes = BN * D * 2;  // 16 KB per K (or V) stage
  static constexpr uint32_t kKOffset = kQBufs * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKvBytes;
  static constexpr uint32_t kKeysOffset = kVOffset + kStages * kKvBytes;
  static constexpr uint32_t kMetaOffset = kKeysOffset + kStages * BN * 4;  // int4 per stage
  static constexpr uint32_t kBarOffset = kMetaOffset + kStages * 16;       // full[S], empty[S], qfull[2], qempty[2]
  static constexpr uint32_t kSlotOffset = kBarOffset + (2 * kStages + 4) * 8;  // int[2]
  static constexpr uint32_t kPinOffset = kSlotOffset + 16;  // the consumers' softmax pins:
  static constexpr int kPinFloats = kQBufs == 2 ? 256 : 8;   // one per consumer thread, or per warp (smem-tight)
  static constexpr size_t kSmemBytes = 1024 + kPinOffset + kPinFloats * 4;  // + alignment slack
  // Descriptor flags. kFlagCopied: the tile's K/V were written by cp.async (the generic proxy), so the consumers
  // need a proxy fence before their wgmma reads it; TMA-written tiles (the async proxy, like wgmma) do not.
  static constexpr int kFlagMasked = 1, kFlagLast = 2, kFlagEnd = 4, kFlagCopied = 8, kFlagSkip = 16;
  static_assert(kProducerThreads == 8 * kChunks, "producer thread (r0, ch): rows r0 + 8 i, 16-byte chunk ch");
};

// Shared-memory addresses of the warp-specialized kernels (WgmmaWsConfig offsets from a 1024-aligned base).
template <int kStages, int kQBufs = 2>
struct WgmmaWsLayout {
  using Cfg = WgmmaWsConfig<kStages, kQBufs>;
  uint32_t sQ, sK, sV, bar;
  int* keys;   // [kStages][BN]
  int4* meta;  // per stage: item, key count, flags
  int* slot;   // int[2]
  float* pin;  // float[256], one per consumer thread
  __device__ __forceinline__ explicit WgmmaWsLayout(unsigned char* smem_raw) {
    const uint32_t raw_addr = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    sQ = smem_addr(smem);  // buffer b at sQ + b * kQBytes
    sK = sQ + Cfg::kKOffset;
    sV = sQ + Cfg::kVOffset;
    bar = sQ + Cfg::kBarOffset;
    keys = reinterpret_cast<int*>(smem + Cfg::kKeysOffset);
    meta = reinterpret_cast<int4*>(smem + Cfg::kMetaOffset);
    slot = reinterpret_cast<int*>(smem + Cfg::kSlotOffset);
    pin = reinterpret_cast<float*>(smem + Cfg::kPinOffset);
  }
  // Half h (64 of the 128 columns) of stage s's K tile: [2][64 rows][128 B] per stage, or in the pair layout
  // [2][128 rows][128 B] per stage pair with stage 2p + 1's rows after stage 2p's.
  __device__ __forceinline__ uint32_t k_half(int s, int h) const {
    if constexpr (Cfg::kPairs) {
      return sK + (s / 2) * 2 * Cfg::kKvBytes + h * (2 * Cfg::BN * 128) + (s % 2) * (Cfg::BN * 128);
    } else {
      return sK + s * Cfg::kKvBytes + h * (Cfg::BN * 128);
    }
  }
  __device__ __forceinline__ uint32_t full(int s) const { return bar + 8u * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar + 8u * (kStages + s); }
  __device__ __forceinline__ uint32_t qfull(int b) const { return bar + 8u * (2 * kStages + b); }
  __device__ __forceinline__ uint32_t qempty(int b) const { return bar + 8u * (2 * kStages + 2 + b); }
};

// One consumer step's wgmma issue and the wait for its S (both consumer loops): with kPingpong, this warpgroup's
// turn (named barrier 2 + cw) before issuing and the other's (3 - cw) after; S, then the previous step's P V when
// one is pending (pv_pending), committed in that order, so waiting for all but the last group waits for S only.
template <bool kPingpong, class IssueS, class IssuePv>
__device__ __forceinline__ void ws_issue_step(int cw, bool pv_pending, IssueS&& issue_s, IssuePv&& issue_pv) {
  if constexpr (kPingpong) named_barrier_sync(2 + cw, 256);
  issue_s();
  if (pv_pending) {
    issue_pv();
    if constexpr (kPingpong) named_barrier_arrive(3 - cw, 256);
    wgmma_wait<1>();  // S done, P V may still run
  } else {
    if constexpr (kPingpong) named_barrier_arrive(3 - cw, 256);
    wgmma_wait<0>();
  }
}

// The consumer warpgroups' loop (both warp-specialized kernels): warpgroup cw owns rows [64 cw, 64 cw + 64) of
// every item; wq is the warp's index in its warpgroup. Stage descriptors, keys and barriers as laid out by
// WgmmaWsLayout; the producer's side of the protocol is in the kernels.
// kPingpong (FA3's warpgroup ping-pong): the two warpgroups take turns issuing their S and P V wgmmas, through
// named barriers 2 and 3 (warpgroup w waits on 2 + w, then lets the other one go by arriving on 3 - w), so
// that one warpgroup's softmax runs while the tensor cores work on the other's tiles. Both warpgroups see the
// same tiles, so their turns pair up; warpgroup 1 opens with one arrive, which is left pending at the end.
template <typename T, int kStages, bool kQRegs, bool kPingpong = false, int kRescale = 8>
__device__ __forceinline__ void ws_consumer_loop(const PrefillParams& p, const WgmmaWsLayout<kStages>& L, int cw,
                                                 int wq, int lane) {
  using Cfg = WgmmaWsConfig<kStages>;
  using Consumer = WgmmaConsumer<T, false, kRescale>;
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN;
  const uint32_t sQ = L.sQ, sK = L.sK, sV = L.sV;
  int* sKeys = L.keys;
  const int4* sMeta = L.meta;
  auto full = [&](int s) { return L.full(s); };
  auto empty = [&](int s) { return L.empty(s); };
  auto qfull = [&](int b) { return L.qfull(b); };
  auto qempty = [&](int b) { return L.qempty(b); };
  const int g = lane / 4, c4 = lane % 4;
  auto release = [&](uint32_t b) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(b);
  };
  if constexpr (kPingpong) {
    if (cw == 1) named_barrier_arrive(2, 256);
  }
  // Stage 0's K and V descriptors; stage s's are these advanced by s * kKvBytes (desc_advance).
  const uint64_t k_desc0 = sw128_desc(sK, 16, 1024), v_desc0 = sw128_desc(sV, p.pv_lbo, p.pv_sbo);
  int it = 0;
  for (int n = 0;; ++n) {
    int st = it % kStages;
    mbarrier_wait(full(st), (it / kStages) & 1);
    int4 mt = sMeta[st];
    if (mt.z & Cfg::kFlagEnd) break;
    const int item = mt.x;
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    const int qb = n & 1;
    mbarrier_wait(qfull(qb), (n >> 1) & 1);
    const uint32_t q_wg = sQ + qb * Cfg::kQBytes + cw * 64 * 128;
    uint32_t qf[kQRegs ? D / 16 : 1][4];
    if constexpr (kQRegs) {
      Consumer::template load_q<BM>(qf, sQ + qb * Cfg::kQBytes, cw * 64 + wq * 16);
      release(qempty(qb));  // Q is in registers: the producer may load the item after next's
    }

    Consumer cs;
    cs.start(pos0 + cw * 64 + wq * 16 + g);
    uint32_t pa[BN / 16][4];
    int prev_st = -1;  // stage of the previous tile, whose P V is pending
    for (;;) {
      if (mt.z & Cfg::kFlagCopied) fence_proxy_async_shared();  // cp.async (generic proxy) before wgmma reads
      if (mt.y > 0) {
        float s[BN / 2];
        ws_issue_step<kPingpong>(
            cw, prev_st >= 0,
            [&] {
              if constexpr (kQRegs) {
                Consumer::issue_qk_rs_desc(s, qf, desc_advance(k_desc0, st * Cfg::kKvBytes));
              } else {
                Consumer::template issue_qk<BM>(s, q_wg, sK + st * Cfg::kKvBytes);
              }
            },
            [&] { cs.issue_pv_desc(pa, desc_advance(v_desc0, prev_st * Cfg::kKvBytes)); });
        fence_operands(s);
        float alpha[2];
        cs.softmax(s, (mt.z & Cfg::kFlagMasked) != 0, sKeys + st * BN, p.span, p.scale_log2, alpha);
        // Keeps the wait below the softmax: no instruction links the two, and ptxas otherwise schedules the
        // wait for P V first, serialising the softmax with P V (H200 profile: 10% of the samples on that wait).
        // ptxas does not move the wait above a shared-memory store, and the row sums need every score of the
        // step, so storing them pins the whole softmax before the wait. (A never-taken trap branch made ptxas
        // serialise every wgmma, C7518; a __syncwarp was compiled away.)
        L.pin[cw * 128 + wq * 32 + lane] = cs.l[0] + cs.l[1];
        wgmma_wait<0>();  // P V of the previous tile (nothing pending for the first)
        fence_operands(cs.o);
        Consumer::keep_live(pa);
        if (prev_st >= 0) release(empty(prev_st));
        cs.rescale(alpha);
        Consumer::pack_p(s, pa);
        prev_st = st;
      } else {
        release(empty(st));
      }
      ++it;
      if (mt.z & Cfg::kFlagLast) break;
      st = it % kStages;
      mbarrier_wait(full(st), (it / kStages) & 1);
      mt = sMeta[st];
    }
    if (prev_st >= 0) {
      cs.issue_pv_desc(pa, desc_advance(v_desc0, prev_st * Cfg::kKvBytes));
      wgmma_wait<0>();
      fence_operands(cs.o);
      Consumer::keep_live(pa);
      release(empty(prev_st));
    }
    if constexpr (!kQRegs) release(qempty(qb));  // every Q K^T of the item has completed
    store_rows<T, D>(p, h, row0 + cw * 64 + wq * 16, g, c4, cs.l, cs.m, mt.w, row0,  // mt: the item's last descriptor (w: split unit or -1)
                     [&](int i, int e) { return make_float2(cs.o[4 * i + 2 * e], cs.o[4 * i + 2 * e + 1]); });
  }
}

// The consumers' loop with pair steps (WgmmaConsumer kBN = 128), for the TMA kernel with one Q buffer (Q in
// registers): each step takes the item's next two key tiles (stages a and b), so the per-step costs are paid
// once per 128 keys (H200 profile of the 64-key step: ~330 instructions per warp and step, about half of them
// per step rather than per score). An item with an odd number of tiles ends with a one-tile step: the missing
// half's scores are masked out and its wgmmas read tile a again (64 keys of tensor work wasted per odd item).
// S of step j overlaps P V of step j - 1, the warpgroups ping-pong as in ws_consumer_loop, and the stages of a
// step are released once the P V that read their V completed.
// The consumer state (O, the P fragments, the pending stages) lives for the whole CTA rather than one item: with the
// same instructions per step (602-603 in the SASS), this form takes 2.6-3.0% fewer cycles (H200, ncu: A-shape at
// 128K 24.07 M against 24.75 M, dense 32K 22.32 against 22.91, model-like VS 128K 36.70 against 37.77; tensor pipe
// active 70.7% against 68.7%). Tried and dropped (NOTES.md "Items streamed"): an item's last P V issued with the
// next item's first S (spills and serialised wgmmas, or with the first step peeled off, descriptors off the
// uniform datapath: +12% cycles), and the last P V in a ping-pong turn of its own (no change).
template <typename T, int kStages, bool kPingpong, int kRescale = 8, int kPolyExp = 0, bool kMaxTree = false>
__device__ __forceinline__ void ws_consumer_loop_pairs(const PrefillParams& p, const WgmmaWsLayout<kStages, 1>& L,
                                                       int cw, int wq, int lane) {
  using Cfg = WgmmaWsConfig<kStages, 1>;
  using Consumer = WgmmaConsumer<T, false, kRescale, 128, kPolyExp, kMaxTree>;
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN;  // BN: one key tile (stage)
  const int g = lane / 4, c4 = lane % 4;
  auto release = [&](uint32_t b) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(b);
  };
  if constexpr (kPingpong) {
    if (cw == 1) named_barrier_arrive(2, 256);
  }
  const uint64_t k_desc0 = sw128_desc(L.sK, 16, 1024), v_desc0 = sw128_desc(L.sV, p.pv_lbo, p.pv_sbo);
  auto k_desc = [&](int st) { return desc_advance(k_desc0, st * Cfg::kKvBytes); };
  auto v_desc = [&](int st) { return desc_advance(v_desc0, st * Cfg::kKvBytes); };
  Consumer cs;
  cs.start(0);  // every item starts it again; this defines it before the lambdas below capture it
  uint32_t pa[Consumer::BN / 16][4];
  int prev_a = -1, prev_b = -1;  // stages of the previous step, whose P V is pending (prev_b -1: one tile)
  auto store_item = [&](int item, const RowTotals& r) {
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    store_rows<T, D>(p, h, row0 + cw * 64 + wq * 16, g, c4, r, -1, row0,  // no split units in the pair kernel (see its producer)
                     [&](int i, int e) { return make_float2(cs.o[4 * i + 2 * e], cs.o[4 * i + 2 * e + 1]); });
  };
  auto flush_pv = [&] {
    cs.issue_pv_pair(pa, v_desc(prev_a), v_desc(prev_b >= 0 ? prev_b : prev_a));
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
    mbarrier_wait(L.qfull(0), n & 1);
    uint32_t qf[D / 16][4];
    Consumer::template load_q<BM>(qf, L.sQ, cw * 64 + wq * 16);
    release(L.qempty(0));  // Q is in registers: the producer may load the next item's
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
      ws_issue_step<kPingpong>(
          cw, prev_a >= 0,
          [&] { Consumer::issue_qk_rs_pair(s, qf, k_desc(st)); },  // st even: the pair's base (b's rows follow)
          [&] { cs.issue_pv_pair(pa, v_desc(prev_a), v_desc(prev_b >= 0 ? prev_b : prev_a)); });
      fence_operands(s);
      float alpha[2];
      // Without a second tile, the pair's upper half holds stale rows: masked out whole (span 0).
      cs.softmax(s, (mt.z & Cfg::kFlagMasked) != 0, L.keys + st * BN, !has_b || (mb.z & Cfg::kFlagMasked) != 0,
                 L.keys + (has_b ? st_b : st) * BN, p.span, has_b ? p.span : 0u, p.scale_log2, alpha);
      // Pins the softmax above the wait for P V (see ws_consumer_loop); one word per warp here.
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

template <typename T, int kStages, bool kQRegs>
__global__ void __launch_bounds__(384, 1) sparse_prefill_wgmma_ws_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = WgmmaWsConfig<kStages>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, kChunks = Cfg::kChunks;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const WgmmaWsLayout<kStages> L(smem_raw);
  const uint32_t sQ = L.sQ, sK = L.sK, sV = L.sV;
  int* sKeys = L.keys;
  int4* sMeta = L.meta;
  int* sSlot = L.slot;
  auto full = [&](int s) { return L.full(s); };
  auto empty = [&](int s) { return L.empty(s); };
  auto qfull = [&](int b) { return L.qfull(b); };
  auto qempty = [&](int b) { return L.qempty(b); };

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 2 * Cfg::kProducerThreads);  // a copy arrive and a descriptor arrive per thread
      mbarrier_init(empty(s), 8);                          // one per consumer warp
    }
    for (int b = 0; b < 2; ++b) {
      mbarrier_init(qfull(b), Cfg::kProducerThreads);
      mbarrier_init(qempty(b), 8);
    }
  }
  __syncthreads();

  if (warp < 4) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    const int ptid = tid;
    // This thread's part of every copy: 16-byte chunk p_ch of rows p_r0 + 8 i (the swizzle of wgmma_sm90.cuh
    // depends on the row only through row % 8, so rows p_r0 + 8 i sit at p_off + 1024 i).
    const int p_ch = ptid % kChunks, p_r0 = ptid / kChunks;
    const uint32_t p_off = sw128_offset<BN>(p_r0, p_ch);
    const T* q_all = static_cast<const T*>(p.q);
    const T* k_all = static_cast<const T*>(p.k);
    const T* v_all = static_cast<const T*>(p.v);
    int it = 0;  // tiles sent: stage it % kStages, phase it / kStages
    for (int n = 0;; ++n) {
      int slot = 0;
      for (;;) {  // the next slot that runs something (an item split into units is skipped)
        if (ptid == 0) sSlot[n & 1] = atomicAdd(p.counter, 1);
        named_barrier_sync(1, Cfg::kProducerThreads);
        slot = sSlot[n & 1];
        if (slot >= p.num_items + p.num_units || p.order[slot] >= 0) break;
        named_barrier_sync(1, Cfg::kProducerThreads);  // everyone has read sSlot before thread 0 writes it
      }
      if (slot >= p.num_items + p.num_units) {
        const int st = it % kStages;
        mbarrier_wait(empty(st), ((it / kStages) & 1) ^ 1);
        if (ptid == 0) sMeta[st] = make_int4(-1, 0, Cfg::kFlagEnd, 0);
        cp_async_mbarrier_arrive(full(st));
        mbarrier_arrive(full(st));
        break;
      }
      const PrefillWork work = prefill_work(p, slot);
      const int item = work.item;
      [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
      const T* qh = q_all + h * p.q_head + static_cast<int64_t>(row0) * p.q_tok;
      const T* kh = k_all + kvh * p.k_head;
      const T* vh = v_all + kvh * p.v_head;

      // Q into buffer n % 2, once the consumers are done with item n - 2's.
      const int qb = n & 1;
      mbarrier_wait(qempty(qb), ((n >> 1) & 1) ^ 1);
      const uint32_t q_dst = sQ + qb * Cfg::kQBytes + sw128_offset<BM>(p_r0, p_ch);
      {
        const T* qs = qh + static_cast<int64_t>(p_r0) * p.q_tok + p_ch * 8;
        const int64_t step_q = 8 * p.q_tok;
#pragma unroll
        for (int i = 0; i < BM / 8; ++i) {
          const bool ok = p_r0 + 8 * i < rows;
          cp_async_16(q_dst + 1024u * i, ok ? qs : q_all, ok);
          qs += step_q;
        }
      }
      cp_async_mbarrier_arrive(qfull(qb));

      KeyCursor<BN> cursor(p, item, pos0, rows, work.tile_begin, work.tile_end);
      KeyTile cur = cursor.next();
      for (;;) {
        const KeyTile nxt = cur.count > 0 ? cursor.next() : KeyTile{};
        const int st = it % kStages;
        mbarrier_wait(empty(st), ((it / kStages) & 1) ^ 1);
        if (ptid == 0) {
          sMeta[st] = make_int4(item, cur.count,
                                (cur.masked ? Cfg::kFlagMasked : 0) | (nxt.count == 0 ? Cfg::kFlagLast : 0) |
                                    Cfg::kFlagCopied,
                                work.part);
        }
        if (cur.count > 0) {
          // Thread (r0, ch) copies 16-byte chunk ch of rows r0, r0 + 8, ...: its swizzled offset only moves by
          // 1024 bytes per 8 rows and a range's source pointer by 8 rows' stride, so a copy costs a compare,
          // two cp.async and a pointer add (the first version recomputed both per chunk: the producer could
          // not keep up with the consumers, which spun on `full` ~34 times per tile).
          const uint32_t dk = sK + st * Cfg::kKvBytes + p_off, dv = sV + st * Cfg::kKvBytes + p_off;
          if (!cur.gathered) {
            const int64_t step_k = 8 * p.k_tok, step_v = 8 * p.v_tok;
            const T* ks = kh + static_cast<int64_t>(cur.first + p_r0) * p.k_tok + p_ch * 8;
            const T* vs = vh + static_cast<int64_t>(cur.first + p_r0) * p.v_tok + p_ch * 8;
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
              const bool ok = p_r0 + 8 * i < cur.count;
              cp_async_16(dk + 1024u * i, ok ? ks : kh, ok);
              cp_async_16(dv + 1024u * i, ok ? vs : vh, ok);
              ks += step_k;
              vs += step_v;
            }
            if (p_ch == 0) {
#pragma unroll
              for (int i = 0; i < BN / 8; ++i) {
                const int row = p_r0 + 8 * i;
                sKeys[st * BN + row] = row < cur.count ? cur.first + row : kAbsentKey;
              }
            }
          } else {
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
              const int row = p_r0 + 8 * i;
              const int key = row < cur.count ? p.columns[cur.first + row] : -1;
              const bool ok = key >= 0;
              cp_async_16(dk + 1024u * i, kh + static_cast<int64_t>(ok ? key : 0) * p.k_tok + p_ch * 8, ok);
              cp_async_16(dv + 1024u * i, vh + static_cast<int64_t>(ok ? key : 0) * p.v_tok + p_ch * 8, ok);
              if (p_ch == 0) sKeys[st * BN + row] = ok ? key : kAbsentKey;
            }
          }
        }
        cp_async_mbarrier_arrive(full(st));
        mbarrier_arrive(full(st));
        ++it;
        if (nxt.count == 0) break;
        cur = nxt;
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    ws_consumer_loop<T, kStages, kQRegs>(p, L, warp / 4 - 1, warp % 4, lane);
  }
#endif
}

// Launches the warp-specialized kernel (instantiated in sparse_prefill_wgmma_{bf16,f16}.cu). Throws
// tessera::Error when the device cannot run it.
template <typename T, int kStages, bool kQRegs>
void launch_sparse_prefill_wgmma_ws(const PrefillParams& p, cudaStream_t stream) {
  using Cfg = WgmmaWsConfig<kStages>;
  launch_persistent(sparse_prefill_wgmma_ws_kernel<T, kStages, kQRegs>, Cfg::kThreads, Cfg::kSmemBytes,
                    "sparse prefill (wgmma, warp-specialized)", "", "sparse_prefill_wgmma_ws_kernel", p, stream, p);
}


// ------------------------------------------------------------------------------------------------------------
// TMA variant: the producer warpgroup's first warp does all the loading (warps 1-3 of it leave at once), the
// consumers are warps 4-11 as in the cp.async kernel. (A 288-thread layout with one producer warp did not
// launch: Hopper allocates registers per warpgroup, so 3 warpgroups x 128 x 184 registers exceed the file; ptxas
// caps such kernels at 168 registers, as at 384 threads.) Q and range tiles arrive by TMA (one thread, four 8 KB boxes per K/V tile: the two 64-column halves of K and of V, into
// the same 128-byte-swizzled layout; rows past kv_len are zero-filled, rows of a partial tile past its count
// carry other keys, masked through the tile's key list); gathered columns by cp.async from the 32 lanes.
// full[s] counts 64 arrivals per phase: per lane one for the data (lane 0's with the TMA byte count, or a
// cp.async arrive for gathered tiles) and one after its key-list writes.
template <typename T, int kStages, bool kQRegs, bool kPingpong, int kRescale = 8, bool kPair = false, int kPolyExp = 0,
          bool kMaxTree = false>
__global__ void __launch_bounds__(384, 1)
    sparse_prefill_wgmma_tma_kernel(const PrefillParams p, const __grid_constant__ CUtensorMap tm_q,
                                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kQBufs = kPair ? 1 : 2;
  using Cfg = WgmmaWsConfig<kStages, kQBufs>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, kChunks = Cfg::kChunks;
  static_assert(!kPair || kQRegs, "pair steps keep Q in registers");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const WgmmaWsLayout<kStages, kQBufs> L(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(L.full(s), 64);
      mbarrier_init(L.empty(s), 8);
    }
    for (int b = 0; b < kQBufs; ++b) {
      mbarrier_init(L.qfull(b), 1);
      mbarrier_init(L.qempty(b), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Registers: ptxas gives each side the budget of its setmaxnreg (without it the consumer step spills at the
  // kernel's 168); the producer warp's gathered-column copies need more than the cp.async kernel's 56.
  // Pair steps hold twice the scores and P fragments: 224 registers for the consumers, 56 for the producer
  // warpgroup (40 spilled in its gathered-column loop). setmaxnreg moves registers within the CTA's launch
  // allocation (384 x 168 = 64512), not the SM's 65536: 128 x 64 + 256 x 224 = 65536 compiled cleanly and hung
  // in setmaxnreg.inc on the H200 (the consumers waited for registers that never came).
  if (warp >= 4) {
    if constexpr (kPair) {
      static_assert(128 * 56 + 256 * 224 <= 384 * 168, "setmaxnreg within the launch allocation");
      setmaxnreg_inc<224>();
      ws_consumer_loop_pairs<T, kStages, kPingpong, kRescale, kPolyExp, kMaxTree>(p, L, warp / 4 - 1, warp % 4, lane);
    } else {
      setmaxnreg_inc<208>();
      ws_consumer_loop<T, kStages, kQRegs, kPingpong, kRescale>(p, L, warp / 4 - 1, warp % 4, lane);
    }
    return;
  }
  if constexpr (kPair) {
    setmaxnreg_dec<56>();
  } else {
    setmaxnreg_dec<88>();  // 128 x 88 + 256 x 208 = 64512 <= 65536
  }
  if (warp != 0) return;
  // ---------------------------------------------------------------- producer warp
  const T* k_all = static_cast<const T*>(p.k);
  const T* v_all = static_cast<const T*>(p.v);
  int it = 0;
  for (int n = 0;; ++n) {
    // The next slot that runs something (an item split into units is skipped); the pair kernel's plans have no
    // units (see the cursor below).
    const int slot_end = kPair ? p.num_items : p.num_items + p.num_units;
    int slot = 0;
    do {
      if (lane == 0) slot = atomicAdd(p.counter, 1);
      slot = __shfl_sync(0xffffffffu, slot, 0);
    } while (!kPair && slot < slot_end && p.order[slot] < 0);
    if (slot >= slot_end) {
      const int st = it % kStages;
      mbarrier_wait(L.empty(st), ((it / kStages) & 1) ^ 1);
      if (lane == 0) L.meta[st] = make_int4(-1, 0, Cfg::kFlagEnd, 0);
      mbarrier_arrive(L.full(st));
      mbarrier_arrive(L.full(st));
      break;
    }
    const PrefillWork work = kPair ? PrefillWork{p.order[slot], 0, 0x7fffffff, -1} : prefill_work(p, slot);
    const int item = work.item;
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    const int qb = n % kQBufs;
    mbarrier_wait(L.qempty(qb), ((n / kQBufs) & 1) ^ 1);
    if (lane == 0) {
      const uint32_t dst = L.sQ + qb * Cfg::kQBytes;
      mbarrier_arrive_expect_tx(L.qfull(qb), Cfg::kQBytes);
      tma_load_3d(dst, &tm_q, 0, h, row0, L.qfull(qb));
      tma_load_3d(dst + BM * 128, &tm_q, 64, h, row0, L.qfull(qb));
    }
    if constexpr (Cfg::kPairs) {
      if (it & 1) {  // the item starts on an even stage: a skip descriptor fills the odd one
        const int st = it % kStages;
        mbarrier_wait(L.empty(st), ((it / kStages) & 1) ^ 1);
        if (lane == 0) L.meta[st] = make_int4(-1, 0, Cfg::kFlagSkip, 0);
        mbarrier_arrive(L.full(st));
        mbarrier_arrive(L.full(st));
        ++it;
      }
    }
    // The pair kernel runs no split units (sparse_prefill routes split plans to the 4-stage kernel: the units'
    // tile count and scratch rows cost registers that the pair kernel's producer (56) and consumers (224) lack).
    KeyCursor<BN, !kPair> cursor(p, item, pos0, rows, work.tile_begin, work.tile_end);
    KeyTile cur = cursor.next();
    for (;;) {
      const KeyTile nxt = cur.count > 0 ? cursor.next() : KeyTile{};
      const int st = it % kStages;
      mbarrier_wait(L.empty(st), ((it / kStages) & 1) ^ 1);
      const uint32_t dv = L.sV + st * Cfg::kKvBytes;
      int* keys = L.keys + st * BN;
      if (cur.count > 0 && !cur.gathered) {
        if (lane == 0) {
          mbarrier_arrive_expect_tx(L.full(st), 2 * Cfg::kKvBytes);
          tma_load_3d(L.k_half(st, 0), &tm_k, 0, kvh, cur.first, L.full(st));
          tma_load_3d(L.k_half(st, 1), &tm_k, 64, kvh, cur.first, L.full(st));
          tma_load_3d(dv, &tm_v, 0, kvh, cur.first, L.full(st));
          tma_load_3d(dv + BN * 128, &tm_v, 64, kvh, cur.first, L.full(st));
        } else {
          mbarrier_arrive(L.full(st));
        }
        keys[lane] = lane < cur.count ? cur.first + lane : kAbsentKey;
        keys[lane + 32] = lane + 32 < cur.count ? cur.first + lane + 32 : kAbsentKey;
      } else if (cur.count > 0) {
        // Gathered columns: lane copies rows lane and lane + 32, all 16 chunks of K and V (one row at a time:
        // unrolling both rows costs the producer registers the pair-step consumers need).
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
          const int row = lane + 32 * half;
          const int key = row < cur.count ? p.columns[cur.first + row] : -1;
          const bool ok = key >= 0;
          const T* ks = k_all + kvh * p.k_head + static_cast<int64_t>(ok ? key : 0) * p.k_tok;
          const T* vs = v_all + kvh * p.v_head + static_cast<int64_t>(ok ? key : 0) * p.v_tok;
#pragma unroll
          for (int ch = 0; ch < kChunks; ++ch) {
            const uint32_t swz = row * 128 + (((ch & 7) ^ (row & 7)) << 4);  // sw128_offset within a half
            cp_async_16(L.k_half(st, ch >> 3) + swz, ks + ch * 8, ok);
            cp_async_16(dv + sw128_offset<BN>(row, ch), vs + ch * 8, ok);
          }
          keys[row] = ok ? key : kAbsentKey;
        }
        cp_async_mbarrier_arrive(L.full(st));
      } else {
        mbarrier_arrive(L.full(st));
      }
      if (lane == 0) {
        L.meta[st] = make_int4(item, cur.count,
                               (cur.masked ? Cfg::kFlagMasked : 0) | (nxt.count == 0 ? Cfg::kFlagLast : 0) |
                                   (cur.gathered ? Cfg::kFlagCopied : 0),
                               kPair ? -1 : work.part);
      }
      mbarrier_arrive(L.full(st));  // after this lane's key-list (and descriptor) writes
      ++it;
      if (nxt.count == 0) break;
      cur = nxt;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows][heads][128] token-major view (strides in elements) as a 3-D tensor map: dims (128, heads, rows),
// box (64, 1, box_rows), 128-byte swizzle, out-of-bounds rows zero-filled.
template <typename T>
CUtensorMap make_head_tensor_map(const void* base, int heads, int rows, int64_t head_stride, int64_t tok_stride,
                                 int box_rows) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) throw Error("sparse prefill (TMA): cuTensorMapEncodeTiled is not available from the driver");
  CUtensorMap m{};
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * sizeof(T),
                                 static_cast<cuuint64_t>(tok_stride) * sizeof(T)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estrides[3] = {1, 1, 1};
  const CUtensorMapDataType dt =
      sizeof(T) == 2 && std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(&m, dt, 3, const_cast<void*>(base), dims, strides, box, estrides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("sparse prefill (TMA): cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(r)) +
                " (heads " + std::to_string(heads) + ", rows " + std::to_string(rows) + ", strides " +
                std::to_string(head_stride) + "/" + std::to_string(tok_stride) + ")");
  }
  return m;
}

template <typename T, int kStages, bool kQRegs, bool kPingpong, int kRescale = 8, bool kPair = false, int kPolyExp = 0,
          bool kMaxTree = false>
void launch_sparse_prefill_wgmma_tma(const PrefillParams& p, cudaStream_t stream) {
  using Cfg = WgmmaWsConfig<kStages, kPair ? 1 : 2>;
  const CUtensorMap tq = make_head_tensor_map<T>(p.q, p.num_q_heads, p.q_len, p.q_head, p.q_tok, Cfg::BM);
  const CUtensorMap tk = make_head_tensor_map<T>(p.k, p.num_kv_heads, p.kv_len, p.k_head, p.k_tok, Cfg::BN);
  const CUtensorMap tv = make_head_tensor_map<T>(p.v, p.num_kv_heads, p.kv_len, p.v_head, p.v_tok, Cfg::BN);
  launch_persistent(sparse_prefill_wgmma_tma_kernel<T, kStages, kQRegs, kPingpong, kRescale, kPair, kPolyExp, kMaxTree>,
                    Cfg::kThreads, Cfg::kSmemBytes,
                    "sparse prefill (wgmma, TMA)", "", "sparse_prefill_wgmma_tma_kernel", p, stream, p, tq, tk, tv);
}

}  // namespace tessera::attn::gpu::detail
