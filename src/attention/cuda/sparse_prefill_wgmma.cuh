// tessera/attention/cuda/sparse_prefill_wgmma.cuh — the Hopper (sm_90a) sparse prefill kernel: wgmma for
// Q K^T and P V, head_dim 128, query tile 128 (device code; see sparse_prefill.h).
//
// Same contract, item cursor and online softmax as the mma.sync kernel (sparse_prefill_kernel.cuh), which
// stays the fallback and the twin the self-check compares against. Differences:
//  - 2 warpgroups (256 threads), warpgroup w owns query rows [64w, 64w + 64) of the tile;
//  - S = Q K^T: 8 x wgmma m64n64k16 per key tile, Q and K both from shared memory (K-major descriptors);
//  - O += P V: P stays in registers (the S accumulators packed to 16 bits are the A fragment), V from shared
//    memory through an N-major (transposed) descriptor: 4 x m64n128k16, or 8 x m64n64k16 (kSplitPv, which
//    needs only the K-direction stride of the descriptor: the fallback variant of the self-check);
//  - K/V in a ring of stages, loaded with cp.async by all threads (ranges and gathered columns alike, 16-byte
//    chunks into the 128-byte-swizzled layout of wgmma_sm90.cuh), two tiles ahead; one barrier per key tile;
//  - kOverlap = false (3 stages): per tile S, wait, softmax, P V, wait; at step j the barrier says tile j has
//    landed and everyone is done with tile j - 1, whose stage receives tile j + 2;
//  - kOverlap = true (4 stages): S_j and P_{j-1} V_{j-1} are issued together and the softmax of S_j runs
//  while
//    the tensor cores do P V (FA3's intra-warpgroup overlap); tile j + 2 goes into the stage of tile j - 2.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/sparse_prefill_kernel.cuh"
#include "attention/cuda/wgmma_consumer.cuh"
#include "attention/cuda/wgmma_sm90.cuh"
#include "attention/cuda/work_plan.h"

namespace tessera::attn::gpu::detail {

template <int kStagesT>
struct WgmmaPrefillConfig {
  static constexpr int D = 128;
  static constexpr int BM = 128;
  static constexpr int BN = kPrefillKeyTile;  // 64
  static constexpr int kThreads = 256;
  static constexpr int kStages = kStagesT;
  static constexpr int kChunks = D / 8;             // 16-byte chunks per row
  static constexpr uint32_t kQBytes = BM * D * 2;   // 32 KB
  static constexpr uint32_t kKvBytes = BN * D * 2;  // 16 KB per K (or V) stage
  static constexpr uint32_t kKeysOffset = kQBytes + 2 * kStages * kKvBytes;
  static constexpr size_t kSmemBytes = 1024 + kKeysOffset + kStages * BN * sizeof(int);  // + alignment slack
  static_assert((BN * kChunks) % kThreads == 0 && (BM * kChunks) % kThreads == 0);
};

template <typename T, bool kSplitPv, bool kOverlap>
__global__ void __launch_bounds__(256, 1) sparse_prefill_wgmma_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = WgmmaPrefillConfig<kOverlap ? 4 : 3>;
  using Consumer = WgmmaConsumer<T, kSplitPv>;
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN, kThreads = Cfg::kThreads, kChunks = Cfg::kChunks;
  constexpr int kStages = Cfg::kStages;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int s_slot;
  // 1024-byte aligned base (the swizzle atoms must be aligned).
  const uint32_t raw_addr = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + Cfg::kQBytes;                         // stage s at sK + s * kKvBytes
  const uint32_t sV = sK + kStages * Cfg::kKvBytes;              // stage s at sV + s * kKvBytes
  int* sKeys = reinterpret_cast<int*>(smem + Cfg::kKeysOffset);  // [kStages][BN]

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4;  // warpgroup: rows [64 wg, 64 wg + 64)
  const int g = lane / 4, c4 = lane % 4;
  const T* q_all = static_cast<const T*>(p.q);
  const T* k_all = static_cast<const T*>(p.k);
  const T* v_all = static_cast<const T*>(p.v);

  for (;;) {
    const PrefillWork work = take_block_work(p, s_slot);
    if (work.item < 0) break;
    const int item = work.item;
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    const T* qh = q_all + h * p.q_head + static_cast<int64_t>(row0) * p.q_tok;
    const T* kh = k_all + kvh * p.k_head;
    const T* vh = v_all + kvh * p.v_head;

    // Cursor over the item's key tiles: ranges first, then columns (window-clipped; sparse_prefill_kernel.cuh).
    KeyCursor<BN> cursor(p, item, pos0, rows, work.tile_begin, work.tile_end);
    auto next_tile = [&]() { return cursor.next(); };
    auto load_kv = [&](int stage, const KeyTile& kt) {
      const uint32_t dk = sK + stage * Cfg::kKvBytes;
      const uint32_t dv = sV + stage * Cfg::kKvBytes;
#pragma unroll
      for (int it = 0; it < BN * kChunks / kThreads; ++it) {
        const int i = tid + it * kThreads;
        const int row = i / kChunks, ch = i % kChunks;
        int key = -1;
        if (row < kt.count) key = kt.gathered ? p.columns[kt.first + row] : kt.first + row;
        const bool ok = key >= 0;
        const int64_t kr = ok ? key : 0;
        const uint32_t off = sw128_offset<BN>(row, ch);
        cp_async_16(dk + off, kh + kr * p.k_tok + ch * 8, ok);
        cp_async_16(dv + off, vh + kr * p.v_tok + ch * 8, ok);
        if (ch == 0) sKeys[stage * BN + row] = ok ? key : kAbsentKey;
      }
    };

    // Prologue: Q and tile 0 (group 1), tile 1 (group 2).
    KeyTile cur = next_tile();
#pragma unroll
    for (int it = 0; it < BM * kChunks / kThreads; ++it) {
      const int i = tid + it * kThreads;
      const int row = i / kChunks, ch = i % kChunks;
      const bool ok = row < rows;
      const T* src = ok ? qh + static_cast<int64_t>(row) * p.q_tok + ch * 8 : q_all;
      cp_async_16(sQ + sw128_offset<BM>(row, ch), src, ok);
    }
    if (cur.count > 0) load_kv(0, cur);
    cp_async_commit();
    KeyTile nxt = cur.count > 0 ? next_tile() : KeyTile{};
    if (nxt.count > 0) load_kv(1, nxt);
    cp_async_commit();

    Consumer cs;
    cs.start(pos0 + wg * 64 + (warp % 4) * 16 + g);
    const uint32_t q_wg = sQ + wg * 64 * 128;  // this warpgroup's first Q row in each half
    auto issue_qk = [&](float(&sc)[BN / 2], int st) {
      Consumer::template issue_qk<BM>(sc, q_wg, sK + st * Cfg::kKvBytes);
    };
    auto issue_pv = [&](const uint32_t(&pa)[BN / 16][4], int st) {
      cs.issue_pv(pa, sV + st * Cfg::kKvBytes, p.pv_lbo, p.pv_sbo);
    };
    auto softmax = [&](float(&sc)[BN / 2], bool masked, int st, float(&alpha)[2]) {
      cs.softmax(sc, masked, sKeys + st * BN, p.span, p.scale_log2, alpha);
    };

    int stage = 0;
    if constexpr (!kOverlap) {
      // Tile j: wait for it, start loading tile j + 2 into the stage of tile j - 1, S, softmax, P V.
      while (cur.count > 0) {
        cp_async_wait<1>();  // tile `cur` (and Q) landed for this thread's copies
        fence_proxy_async_shared();
        __syncthreads();  // ... for everyone's; and everyone is done with the previous tile's stage
        const int stage_load = stage == 0 ? kStages - 1 : stage - 1;
        const KeyTile nn = nxt.count > 0 ? next_tile() : KeyTile{};
        if (nn.count > 0) load_kv(stage_load, nn);
        cp_async_commit();

        float s[BN / 2];
        issue_qk(s, stage);
        wgmma_wait<0>();
        fence_operands(s);
        float alpha[2];
        softmax(s, cur.masked, stage, alpha);
        cs.rescale(alpha);
        uint32_t pa[BN / 16][4];
        Consumer::pack_p(s, pa);
        issue_pv(pa, stage);
        wgmma_wait<0>();
        fence_operands(cs.o);
        Consumer::keep_live(pa);

        cur = nxt;
        nxt = nn;
        stage = stage == kStages - 1 ? 0 : stage + 1;
      }
    } else {
      // Step j: wait for tile j, start loading tile j + 2 into the stage of tile j - 2, issue S_j = Q K_j and
      // O += P_{j-1} V_{j-1}, softmax of S_j while P V runs, then rescale O and keep P_j for step j + 1.
      uint32_t pa[BN / 16][4];
      int prev_stage = -1;  // stage of tile j - 1 (whose P V is pending), -1 before the first tile
      while (cur.count > 0) {
        cp_async_wait<1>();
        fence_proxy_async_shared();
        // Tile j landed; everyone is done with tile j - 2 (its P V was waited for in step j - 1).
        __syncthreads();
        const int stage_load = stage < 2 ? stage + kStages - 2 : stage - 2;
        const KeyTile nn = nxt.count > 0 ? next_tile() : KeyTile{};
        if (nn.count > 0) load_kv(stage_load, nn);
        cp_async_commit();

        float s[BN / 2];
        issue_qk(s, stage);
        if (prev_stage >= 0) {
          issue_pv(pa, prev_stage);
          wgmma_wait<1>();  // S_j done (committed first), P V may still run
        } else {
          wgmma_wait<0>();
        }
        fence_operands(s);
        float alpha[2];
        softmax(s, cur.masked, stage, alpha);
        wgmma_wait<0>();
        fence_operands(cs.o);
        Consumer::keep_live(pa);
        cs.rescale(alpha);
        Consumer::pack_p(s, pa);

        prev_stage = stage;
        cur = nxt;
        nxt = nn;
        stage = stage == kStages - 1 ? 0 : stage + 1;
      }
      if (prev_stage >= 0) {
        issue_pv(pa, prev_stage);
        wgmma_wait<0>();
        fence_operands(cs.o);
        Consumer::keep_live(pa);
      }
    }
    cp_async_wait<0>();  // an item without key tiles still has its Q load in flight

    // Epilogue (shared with the mma.sync kernel): normalise and store; rows past q_len are not written.
    store_rows<T, D>(p, h, row0 + wg * 64 + (warp % 4) * 16, g, c4, cs.l, cs.m, work.part, row0,
                     [&](int i, int e) { return make_float2(cs.o[4 * i + 2 * e], cs.o[4 * i + 2 * e + 1]); });
    __syncthreads();  // everyone has read s_slot and finished with shared memory before the next item
  }
#endif
}

// Launches the wgmma kernel (instantiated in sparse_prefill_wgmma_{bf16,f16}.cu). Throws tessera::Error when
// the device cannot run it (not compute capability 9.0, or too little shared memory).
template <typename T, bool kSplitPv, bool kOverlap>
void launch_sparse_prefill_wgmma(const PrefillParams& p, cudaStream_t stream) {
  using Cfg = WgmmaPrefillConfig<kOverlap ? 4 : 3>;
  launch_persistent(sparse_prefill_wgmma_kernel<T, kSplitPv, kOverlap>, Cfg::kThreads, Cfg::kSmemBytes,
                    "sparse prefill (wgmma)", "", "sparse_prefill_wgmma_kernel", p, stream, p);
}

}  // namespace tessera::attn::gpu::detail
