// tessera/attention/cuda/block_topk.cuh — exact top-k of a score array by one thread block (device code).
//
// Radix select on the order-preserving 32-bit image of the floats: four passes of an 8-bit histogram find the
// k-th largest key T exactly; a final ordered pass keeps every element above T and the first (smallest-index)
// elements equal to T until k are kept, and writes the kept indices in ascending order through a block-wide
// prefix sum. So ties go to the smaller index, as in the CPU estimators (attention/index/estimate.cpp), and
// the result does not depend on thread timing. -0.0 counts as +0.0.
#pragma once

#include <cstdint>
#include <cub/block/block_scan.cuh>

namespace tessera::attn::gpu::detail {

// Larger float -> larger unsigned key.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x == 0.0f) x = 0.0f;  // fold -0.0 into +0.0
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <int kThreads>
struct BlockTopK {
  using Scan = cub::BlockScan<int, kThreads>;
  struct Storage {
    typename Scan::TempStorage scan;
    unsigned hist[256];
    uint32_t prefix;
    int remaining;
  };

  // Writes to out[0, k) the indices i in [begin, end) of the k largest load(i) (ties: smaller i), ascending.
  // k is clamped to [0, end - begin]. Every thread of the block must call it (with the same arguments).
  template <class Load>
  __device__ static void select(Load load, int begin, int end, int k, int32_t* out, Storage& st) {
    const int tid = threadIdx.x;
    const int n = end - begin;
    if (k > n) k = n;
    if (k <= 0) return;
    if (k == n) {
      for (int i = tid; i < n; i += kThreads) out[i] = begin + i;
      __syncthreads();
      return;
    }
    if (tid == 0) {
      st.prefix = 0;
      st.remaining = k;
    }
    uint32_t mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kThreads) st.hist[i] = 0;
      __syncthreads();
      const uint32_t prefix = st.prefix;
      for (int i = tid; i < n; i += kThreads) {
        const uint32_t u = order_key(load(begin + i));
        if ((u & mask) == prefix) atomicAdd(&st.hist[(u >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid < 32) {
        // Lane l owns digits 255 - 8l down to 248 - 8l; find the digit where the running count from the top
        // reaches `remaining`.
        const int lane = tid;
        const unsigned rem = static_cast<unsigned>(st.remaining);
        unsigned cnt[8];
        unsigned sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          cnt[j] = st.hist[255 - 8 * lane - j];
          sum += cnt[j];
        }
        // Every lane has read st.remaining (and its digits) before the one lane that finds the digit
        // overwrites st.remaining / st.prefix below. Without this barrier the read and that write are
        // unordered (a warp's lanes are not in lockstep since Volta, and the shuffles below order execution,
        // not shared-memory accesses: the compiler may even sink the load of `rem` past them): the race
        // compute-sanitizer racecheck reported in this kernel (read line "rem = st.remaining" / write line
        // "st.remaining = ..."). A lane reading the new value would compare against the wrong count.
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
              break;
            }
            acc += cnt[j];
          }
        }
      }
      mask |= 255u << shift;
      __syncthreads();
    }

    // Ordered collection: everything above T, and the first `need_eq` elements equal to T.
    const uint32_t thr = st.prefix;
    const int need_eq = st.remaining;
    int out_base = 0, eq_base = 0;
    for (int base = 0; base < n && out_base < k; base += kThreads) {
      const int i = base + tid;
      const bool valid = i < n;
      const uint32_t u = valid ? order_key(load(begin + i)) : 0u;
      const int gt = valid && u > thr;
      const int eq = valid && u == thr;
      int eq_rank = 0, eq_total = 0;
      Scan(st.scan).ExclusiveSum(eq, eq_rank, eq_total);
      __syncthreads();
      const int sel = gt || (eq && eq_base + eq_rank < need_eq);
      int pos = 0, sel_total = 0;
      Scan(st.scan).ExclusiveSum(sel, pos, sel_total);
      __syncthreads();
      if (sel) out[out_base + pos] = begin + i;
      out_base += sel_total;
      eq_base += eq_total;
    }
  }
};

}  // namespace tessera::attn::gpu::detail
