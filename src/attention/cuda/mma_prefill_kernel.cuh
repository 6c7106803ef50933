// tessera/attention/cuda/mma_prefill_kernel.cuh — the portable prefill kernel (mma.sync m16n8k16, sm_80 and
// later; device code, see sparse_prefill.h): every head_dim and tile of the instantiation table
// (prefill_instances.h), split-K units, and the twin the Hopper kernel is checked against.
//
// CTA layout: BM / 16 warps, warp w owns query rows [16w, 16w + 16) of the tile. Shared memory: Q [BM][D],
// K and V [2 stages][64][D] (16-byte chunks XOR-swizzled, mma_sm80.cuh), and the key position of every K/V
// row of each stage (kAbsentKey for a row past the end of a partial tile), which is all the masking step
// needs: a score is kept iff 0 <= position - key < span (span: the sliding window args.window, or 2^31 - 1),
// one unsigned compare (key_visible).
//
// Key tiles of one item come from a cursor: first the ranges, each cut into tiles of 64 consecutive keys
// starting at the range's begin (token-granular, so tiles need not align), then the columns, 64 per tile,
// gathered row by row (KeyCursor; with a window the item starts at its first row's window). A tile is masked
// only when it is partial, reaches past the tile's first query position, or (window) holds a key below the
// last row's window; full tiles inside every row's visible band skip the mask.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/prefill_epilogue.cuh"
#include "attention/cuda/prefill_scheduler.cuh"
#include "attention/cuda/work_plan.h"
#include "cuda/cuda_check.h"

namespace tessera::attn::gpu::detail {

template <int D, int BM>
struct PrefillConfig {
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kWarps = BM / kRowsPerWarp;
  static constexpr int kThreads = kWarps * 32;
  // Key tile: 64 (the plan's unit); 32 at head_dim 256, where the 16 x 256 f32 output tile per warp leaves no
  // registers for a wider score tile.
  static constexpr int BN = D == 256 ? kPrefillKeyTile / 2 : kPrefillKeyTile;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // Q fragments are re-read from shared memory at every key tile (registers go to the output accumulators).
  // No register cap beyond the architectural one: a cap of 128 (16 warps per SM) spills at every head_dim in
  // this mma.sync version. Occupancy follows from the registers and shared memory actually used.
  static constexpr int kMinBlocks = 1;
  static constexpr size_t kSmemBytes =
      (static_cast<size_t>(BM) * D + 4u * BN * D) * 2u + 2u * BN * sizeof(int);
  static_assert(BN % 16 == 0);
  static_assert(BM % 16 == 0 && (BN * kChunks) % kThreads == 0 && (BM * kChunks) % kThreads == 0);
};

template <typename T, int D, int BM>
__global__ void __launch_bounds__(PrefillConfig<D, BM>::kThreads, PrefillConfig<D, BM>::kMinBlocks)
    mma_prefill_kernel(const PrefillParams p) {
  using Cfg = PrefillConfig<D, BM>;
  constexpr int BN = Cfg::BN, kThreads = Cfg::kThreads, kChunks = Cfg::kChunks;
  const float neg_inf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + BM * D;
  T* sV = sK + 2 * BN * D;
  int* sKeys = reinterpret_cast<int*>(sV + 2 * BN * D);
  __shared__ int s_slot;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c4 = lane % 4;
  const T* q_all = static_cast<const T*>(p.q);
  const T* k_all = static_cast<const T*>(p.k);
  const T* v_all = static_cast<const T*>(p.v);

  constexpr int kRowBytes = D * 2;
  const LaneSwizzle sw(lane);
  const uint32_t q_lane = smem_addr(sQ) + warp * 16 * kRowBytes + LaneSwizzle::a_row<D>(lane);
  const uint32_t k_lane = smem_addr(sK) + LaneSwizzle::b_row<D>(lane);
  const uint32_t v_lane = smem_addr(sV) + LaneSwizzle::v_row<D>(lane);

  for (;;) {
    const PrefillWork work = take_block_work(p, s_slot);
    if (work.item < 0) break;
    const int item = work.item;
    [[maybe_unused]] const auto [h, t, row0, rows, pos0, kvh] = prefill_item(p, item, BM);
    const T* qh = q_all + h * p.q_head + static_cast<int64_t>(row0) * p.q_tok;
    const T* kh = k_all + kvh * p.k_head;
    const T* vh = v_all + kvh * p.v_head;

    // Cursor over the item's key tiles: ranges first, then columns (window-clipped).
    // Split units count in the plan's tiles of kPrefillKeyTile keys (BN is half that at head dim 256).
    KeyCursor<BN, true, kPrefillKeyTile> cursor(p, item, pos0, rows, work.tile_begin, work.tile_end);
    auto next_tile = [&]() { return cursor.next(); };
    auto load_kv = [&](int stage, const KeyTile& kt) {
      T* dk = sK + stage * BN * D;
      T* dv = sV + stage * BN * D;
#pragma unroll
      for (int it = 0; it < BN * kChunks / kThreads; ++it) {
        const int i = tid + it * kThreads;
        const int row = i / kChunks, ch = i % kChunks;
        int key = -1;
        if (row < kt.count) key = kt.gathered ? p.columns[kt.first + row] : kt.first + row;
        const bool ok = key >= 0;
        const int64_t kr = ok ? key : 0;
        cp_async_16(smem_addr(dk + swizzle<D>(row, ch)), kh + kr * p.k_tok + ch * 8, ok);
        cp_async_16(smem_addr(dv + swizzle<D>(row, ch)), vh + kr * p.v_tok + ch * 8, ok);
        if (ch == 0) sKeys[stage * BN + row] = ok ? key : kAbsentKey;
      }
    };

    KeyTile cur = next_tile();
    cp_async_tile<D, BM, kThreads>(sQ, tid, q_all, [&](int row) -> const void* {
      return row < rows ? qh + static_cast<int64_t>(row) * p.q_tok : nullptr;
    });
    if (cur.count > 0) load_kv(0, cur);
    cp_async_commit();

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {neg_inf, neg_inf};
    float l[2] = {0.0f, 0.0f};
    const int pos_row[2] = {pos0 + warp * 16 + g, pos0 + warp * 16 + g + 8};
    int stage = 0;

    while (cur.count > 0) {
      const KeyTile nxt = next_tile();
      if (nxt.count > 0) load_kv(stage ^ 1, nxt);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();

      // S = Q K^T for this warp's 16 rows and the 64 keys of the stage.
      const uint32_t k_stage = k_lane + stage * (BN * kRowBytes);
      const uint32_t v_stage = v_lane + stage * (BN * kRowBytes);
      float s[BN / 8][4];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
      warp_qk<T, D, BN>(s, q_lane, k_stage, sw);

#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        s[i][0] *= p.scale_log2;
        s[i][1] *= p.scale_log2;
        s[i][2] *= p.scale_log2;
        s[i][3] *= p.scale_log2;
      }
      if (cur.masked) {
        const int* keys = sKeys + stage * BN;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int key = keys[i * 8 + 2 * c4 + j];
            if (!key_visible(pos_row[0], key, p.span)) s[i][j] = neg_inf;
            if (!key_visible(pos_row[1], key, p.span)) s[i][2 + j] = neg_inf;
          }
        }
      }

      // Online softmax (base 2; scores already carry scale * log2 e).
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = neg_inf;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[i][2 * e], s[i][2 * e + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[e], mx);
        const float m_use = m_new == neg_inf ? 0.0f : m_new;  // a row with nothing visible yet stays at zero
        const float alpha = fast_exp2(m[e] - m_use);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          s[i][2 * e] = fast_exp2(s[i][2 * e] - m_use);
          s[i][2 * e + 1] = fast_exp2(s[i][2 * e + 1] - m_use);
          sum += s[i][2 * e] + s[i][2 * e + 1];
        }
        l[e] = l[e] * alpha + sum;
        m[e] = m_new;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[i][2 * e] *= alpha;
          o[i][2 * e + 1] *= alpha;
        }
      }

      // O += P V.
      warp_pv<T, D, BN>(o, s, v_stage, sw);
      __syncthreads();
      cur = nxt;
      stage ^= 1;
    }
    cp_async_wait<0>();  // an item without key tiles still has its Q load in flight

    // Epilogue: normalise and store; rows past q_len (short last tile) are not written.
    store_rows<T, D>(p, h, row0 + warp * 16, g, c4, l, m, work.part, row0,
                     [&](int i, int e) { return make_float2(o[i][2 * e], o[i][2 * e + 1]); });
    __syncthreads();  // everyone has read s_slot and finished with shared memory before the next item
  }
}

// Launches the persistent kernel for one (dtype, head_dim, tile) (instantiated from prefill_instances.h in
// prefill_mma_{bf16,f16}.cu).
template <typename T, int D, int BM>
void launch_mma_prefill(const PrefillParams& p, cudaStream_t stream) {
  using Cfg = PrefillConfig<D, BM>;
  launch_persistent(mma_prefill_kernel<T, D, BM>, Cfg::kThreads, Cfg::kSmemBytes, "sparse prefill (mma.sync)",
                    "head_dim " + std::to_string(D) + " with tile " + std::to_string(BM), "mma_prefill_kernel", p,
                    stream, p);
}

}  // namespace tessera::attn::gpu::detail
