// tessera/attention/cuda/hopper/producer.cuh — the producer (mainloop load side) of the Hopper prefill kernel:
// one warp takes items from the tile scheduler and fills the pipeline stages (device code, sm_90a).
//
// Per item: Q by TMA (two 64-column boxes, into the one Q buffer once the consumers have read the previous item's Q
// into registers), then the item's key tiles in the order of the shared KeyCursor (prefill_cursor.h): range tiles
// by TMA (lane 0 issues four 8 KB boxes — the two 64-column halves of K and of V — into the 128-byte-swizzled
// layout; rows past kv_len are zero-filled, rows of a partial tile past its count carry other keys, masked through
// the tile's key list), gathered columns by cp.async from the 32 lanes (two rows per lane, all 16 chunks of K and
// V). Each stage gets its key positions and a descriptor {item, key count, flags, -1} (HopperConfig flags).
//
// Protocol with the consumers (hopper/consumer.cuh), per stage s: full[s] completes after 64 arrivals — per lane
// one for the data (lane 0's with the TMA byte count, or a cp.async arrive for gathered tiles) and one after its
// key-list and descriptor writes; empty[s] after one arrive per consumer warp (8). An item starts on an even stage
// (a skip descriptor fills an odd one), so that the consumers' pair steps take stages 2p and 2p + 1. Items without
// key tiles still send one descriptor (count 0, last) so that their rows are written (zeros, lse -inf). After the
// plan's last item the producer sends an "end" descriptor.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/hopper/config.cuh"
#include "attention/cuda/hopper/wgmma.cuh"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/prefill_scheduler.cuh"

namespace tessera::attn::gpu::detail {

template <typename T>
__device__ __forceinline__ void hopper_producer_warp(const PrefillParams& p, const HopperSmem& L, int lane,
                                                     const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                     const CUtensorMap* tm_v) {
  using Cfg = HopperConfig;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, kChunks = Cfg::kChunks, kStages = Cfg::kStages;
  const T* k_all = static_cast<const T*>(p.k);
  const T* v_all = static_cast<const T*>(p.v);
  int it = 0;  // stages sent: stage it % kStages, phase it / kStages
  for (int n = 0;; ++n) {
    const int slot = take_warp_slot(p, lane);
    if (slot >= p.num_items) {  // the end of the plan: an "end" descriptor
      const int st = it % kStages;
      mbarrier_wait(L.empty(st), ((it / kStages) & 1) ^ 1);
      if (lane == 0) L.meta[st] = make_int4(-1, 0, Cfg::kFlagEnd, 0);
      mbarrier_arrive(L.full(st));
      mbarrier_arrive(L.full(st));
      break;
    }
    const int item = p.order[slot];
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    mbarrier_wait(L.qempty(), (n & 1) ^ 1);
    if (lane == 0) {
      mbarrier_arrive_expect_tx(L.qfull(), Cfg::kQBytes);
      tma_load_3d(L.sQ, tm_q, 0, h, row0, L.qfull());
      tma_load_3d(L.sQ + BM * 128, tm_q, 64, h, row0, L.qfull());
    }
    if (it & 1) {  // the item starts on an even stage: a skip descriptor fills the odd one
      const int st = it % kStages;
      mbarrier_wait(L.empty(st), ((it / kStages) & 1) ^ 1);
      if (lane == 0) L.meta[st] = make_int4(-1, 0, Cfg::kFlagSkip, 0);
      mbarrier_arrive(L.full(st));
      mbarrier_arrive(L.full(st));
      ++it;
    }
    // Whole items only (no split units): the cursor walks without counting tiles.
    KeyCursor<BN, false> cursor(p, item, pos0, rows);
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
          tma_load_3d(L.k_half(st, 0), tm_k, 0, kvh, cur.first, L.full(st));
          tma_load_3d(L.k_half(st, 1), tm_k, 64, kvh, cur.first, L.full(st));
          tma_load_3d(dv, tm_v, 0, kvh, cur.first, L.full(st));
          tma_load_3d(dv + BN * 128, tm_v, 64, kvh, cur.first, L.full(st));
        } else {
          mbarrier_arrive(L.full(st));
        }
        keys[lane] = lane < cur.count ? cur.first + lane : kAbsentKey;
        keys[lane + 32] = lane + 32 < cur.count ? cur.first + lane + 32 : kAbsentKey;
      } else if (cur.count > 0) {
        // Gathered columns: lane copies rows lane and lane + 32, all 16 chunks of K and V (one row at a time:
        // unrolling both rows costs the producer registers the consumers need).
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
                               -1);
      }
      mbarrier_arrive(L.full(st));  // after this lane's key-list (and descriptor) writes
      ++it;
      if (nxt.count == 0) break;
      cur = nxt;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace tessera::attn::gpu::detail
