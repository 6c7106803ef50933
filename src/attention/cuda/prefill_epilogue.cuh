// tessera/attention/cuda/prefill_epilogue.cuh — the epilogue of both prefill kernels (device code): a thread's
// two rows of the output tile normalised and stored, with their log-sum-exp; split-K units write f32 partial rows
// to the plan's scratch instead (split_merge.cu combines them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"

namespace tessera::attn::gpu::detail {

// The row statistics of a thread's two rows (g and g + 8 of its 16-row slice) that the epilogue needs: 1 / the
// row sum (each row's sum is spread over the 4 lanes of the row; 0 for a row that saw no key) and the lse in
// log2 units (m + log2 l; -inf for a row that saw no key).
struct RowTotals {
  float inv[2];
  float lse2[2];
};
__device__ __forceinline__ RowTotals row_totals(const float (&l)[2], const float (&m)[2]) {
  const float neg_inf = -__int_as_float(0x7f800000);
  RowTotals r;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float lt = l[e];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    // A row saw a key iff its running max moved off -inf (poly_exp2 gives masked scores a tiny, not zero, weight).
    const bool seen = m[e] != neg_inf && lt > 0.0f;
    r.inv[e] = seen ? 1.0f / lt : 0.0f;
    r.lse2[e] = seen ? m[e] + __log2f(lt) : neg_inf;
  }
  return r;
}
// Epilogue of every kernel for one thread's two rows, g and g + 8 of the 16-row slice starting at row16:
// normalise by the row sums (RowTotals), store the thread's column pairs (2 c4 + 8 i, i < D / 8) as 4-byte words,
// write the lse (natural log; -inf for a row that saw no key). Rows past q_len (a short last tile) are not
// written. o_at(i, e) returns the accumulator pair of column block i, row e. A split unit (part >= 0; row0: its
// item's first row) writes its rows to the unit's scratch instead: the normalised output in f32 and the lse in
// log2 units (m + log2 l), which split_merge combines.
template <typename T, int D, class OAt>
__device__ __forceinline__ void store_rows(const PrefillParams& p, int h, int row16, int g, int c4, const RowTotals& r,
                                           int part, int row0, OAt o_at) {
  T* oh = static_cast<T*>(p.out) + h * p.o_head;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float inv = r.inv[e];
    const int row = row16 + g + 8 * e;
    if (part >= 0) {
      // The unit's scratch rows: element offset (part * part_rows + row - row0) * D + 2 c4 + 8 i.
      const int slot = part * p.part_rows + (row - row0);
      if (row < p.q_len) {
        float* dst = p.part_o + static_cast<int64_t>(slot) * D + 2 * c4;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          const float2 v = o_at(i, e);
          dst[8 * i] = v.x * inv;
          dst[8 * i + 1] = v.y * inv;
        }
        if (c4 == 0) p.part_lse[slot] = r.lse2[e];
      }
      continue;
    }
    if (row < p.q_len) {
      T* dst = oh + static_cast<int64_t>(row) * p.o_tok + 2 * c4;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const float2 v = o_at(i, e);
        *reinterpret_cast<uint32_t*>(dst + i * 8) = MmaTraits<T>::pack(v.x * inv, v.y * inv);
      }
      if (p.lse != nullptr && c4 == 0) {
        p.lse[h * p.lse_head + static_cast<int64_t>(row) * p.lse_tok] = r.lse2[e] * 0.69314718055994531f;
      }
    }
  }
}
// The same from the running sums and maxima (l: this thread's share of each row's sum).
template <typename T, int D, class OAt>
__device__ __forceinline__ void store_rows(const PrefillParams& p, int h, int row16, int g, int c4,
                                           const float (&l)[2], const float (&m)[2], int part, int row0,
                                           OAt o_at) {
  store_rows<T, D>(p, h, row16, g, c4, row_totals(l, m), part, row0, o_at);
}

}  // namespace tessera::attn::gpu::detail
