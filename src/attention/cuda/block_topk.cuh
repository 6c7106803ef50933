// tessera/attention/cuda/block_topk.cuh — exact top-k of a score array by one thread block (BlockTopK) or by
// one warp (WarpTopK, further down) (device code).
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

// Exact top-k of one row by one warp, with the selection rule of BlockTopK (the k largest order keys, ties to
// the smaller index, written in ascending index order), for 0 < k < n. The row is read from global memory
// once into registers when it has at most 32 * kRegSlots entries (kInRegisters), else once per pass.
//
// The k-th largest key T is found bit by bit from the top: prefix/upper bracket T (count(key >= prefix) >= k
// > count(key >= upper)); each pass counts the keys at or above the midpoint (a per-lane count and one warp
// reduction). Once at most 32 keys lie in [prefix, upper) they are gathered into one register per lane
// (through `buf`, 32 words of shared memory per warp) and the remaining bits are decided on those alone. Then
// one ordered pass keeps every key above T and the first k - count(key > T) keys equal to T (ballots give
// each lane its output slot). Every lane of the warp must call it with the same arguments.
template <int kRegSlots>
struct WarpTopK {
  template <bool kInRegisters>
  __device__ static void select(const float* row, int n, int k, int32_t* out, uint32_t* buf) {
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const unsigned below = (1u << lane) - 1u;
    const int slots = (n + 31) >> 5;
    uint32_t key[kInRegisters ? kRegSlots : 1];
    if constexpr (kInRegisters) {
#pragma unroll
      for (int r = 0; r < kRegSlots; ++r) {
        const int i = r * 32 + lane;
        key[r] = i < n ? order_key(row[i]) : 0u;
      }
    }
    // f(key, valid, index) for the row's slots in index order (slot r holds index 32 r + lane) while it
    // returns true; the return value must be the same on every lane.
    auto visit = [&](auto&& f) {
      if constexpr (kInRegisters) {
        bool go = true;
#pragma unroll
        for (int g = 0; g < kRegSlots / 8; ++g) {
          if (!go || g * 8 >= slots) break;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int r = g * 8 + j, i = r * 32 + lane;
            if (go) go = f(key[r], i < n, i);
          }
        }
      } else {
        for (int r = 0; r < slots; ++r) {
          const int i = r * 32 + lane;
          const bool ok = i < n;
          if (!f(ok ? order_key(row[i]) : 0u, ok, i)) break;
        }
      }
    };
    const unsigned kk = static_cast<unsigned>(k);
    uint32_t prefix = 0;
    unsigned c_prefix = static_cast<unsigned>(n), c_upper = 0;  // count(key >= prefix), count(key >= upper)
    int bit = 31;                                               // upper = prefix + 2^(bit + 1)
    for (; bit >= 0; --bit) {
      if (c_prefix - c_upper <= 32u) break;
      const uint32_t cand = prefix | (1u << bit);
      unsigned local = 0;
      visit([&](uint32_t x, bool ok, int) {
        local += ok && x >= cand ? 1u : 0u;
        return true;
      });
      const unsigned cnt = __reduce_add_sync(kAll, local);
      if (cnt >= kk) {
        prefix = cand;
        c_prefix = cnt;
      } else {
        c_upper = cnt;
      }
    }
    if (bit >= 0) {
      // The m <= 32 keys in [prefix, upper), one per lane; count(key >= cand) = c_upper + those in
      // [cand, upper), i.e. those that agree with cand from `bit` up.
      const unsigned m = c_prefix - c_upper;
      const uint32_t high = bit == 31 ? 0u : ~0u << (bit + 1);
      unsigned found = 0;
      visit([&](uint32_t x, bool ok, int) {
        const bool in = ok && (x & high) == prefix;
        const unsigned b = __ballot_sync(kAll, in);
        if (in) buf[found + __popc(b & below)] = x;
        found += __popc(b);
        return found < m;
      });
      __syncwarp();
      const bool mine_ok = static_cast<unsigned>(lane) < m;
      const uint32_t mine = mine_ok ? buf[lane] : 0u;
      __syncwarp();  // buf is free again when this returns
      for (; bit >= 0; --bit) {
        const uint32_t cand = prefix | (1u << bit);
        const unsigned cnt =
            c_upper + __reduce_add_sync(kAll, mine_ok && mine >> bit == cand >> bit ? 1u : 0u);
        if (cnt >= kk) {
          prefix = cand;
          c_prefix = cnt;
        } else {
          c_upper = cnt;
        }
      }
    }
    // T = prefix; count(key > T) = c_upper < k <= count(key >= T).
    const uint32_t thr = prefix;
    const unsigned need_eq = kk - c_upper;
    unsigned taken = 0, eq_seen = 0;
    visit([&](uint32_t x, bool ok, int i) {
      const bool eq = ok && x == thr;
      const unsigned em = __ballot_sync(kAll, eq);
      const bool sel = (ok && x > thr) || (eq && eq_seen + __popc(em & below) < need_eq);
      const unsigned sm = __ballot_sync(kAll, sel);
      if (sel) out[taken + __popc(sm & below)] = i;
      taken += __popc(sm);
      eq_seen += __popc(em);
      return taken < kk;
    });
  }
};

}  // namespace tessera::attn::gpu::detail
