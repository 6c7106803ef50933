// tessera/attention/cuda/vs_select_kernels.cuh — the VS estimator's selection (device code): VsTopK (exact
// top-k of a row of sums), VsCoverage (adaptive budgets' counts) and vs_topk_kernel, which picks each VS head's
// columns and offsets from vs_estimate_kernels.cuh's sums.
// Part of estimate_kernels.cuh (which says who includes these headers and why everything in them has internal
// linkage); host-compiled by tests/emulation with TESSERA_EMULATION defined.
#pragma once

#include <cstdint>

#include "attention/cuda/block_topk.cuh"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/vs_estimate_kernels.cuh"

namespace tessera::attn::gpu {

namespace {

constexpr int kTopKThreads = 512;  // vs_topk: a block per (head, columns or offsets)

// Exact top-k of one row by one block (v3; docs/PERF.md history, "Top-k v3", v2 in "VS estimator/index v2"): the selection
// rule of block_topk.cuh (the k largest order keys, ties to the smaller index, written ascending) by four
// 8-bit radix passes (v1's BlockTopK's threshold and digit search). Each warp owns one contiguous segment of the row for every
// pass: (1) it counts into its own 256-bin histogram (runs of equal digits per thread in registers, an atomic
// when the digit changes: v1's per-element shared atomics serialised on the few bins most scores share),
// the block's histogram is the sum of the 16; (2) after each digit search a warp adds its bins above the chosen
// digit to its count of keys above T, and its bin of the last digit is its count of keys equal to T, so the
// warps' output bases need no counting pass (v2 ran one); (3) one ordered ballot pass per warp writes the
// output. Every pass issues kLoads loads per thread before using them: the passes wait on L2 latency, ~n /
// (threads x kLoads) round trips each (v2: 4 loads, 6 passes, 290 us at 128K on the H200).
struct VsTopK {
  static constexpr int kWarps = kTopKThreads / 32;
  static constexpr int kLoads = 16;
  struct Storage {
    unsigned hist[kWarps][256];
    unsigned total[256];
    uint32_t prefix;
    int remaining, digit;
    int gt[kWarps], eq[kWarps];
  };

  // The order keys of row[first + j * stride], j < kLoads (0 at or past end): every load is issued before any
  // is used, so a pass over the row waits on one latency per kLoads elements, not one per element.
  __device__ static void load_keys(const float* row, int first, int stride, int end, uint32_t (&u)[kLoads]) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = first + j * stride;
      u[j] = i < end ? detail::order_key(row[i]) : 0u;
    }
  }

  // out[0, k) = the indices i in [begin, end) of the k largest score[i] (ties: smaller i), ascending; k
  // clamped to [0, end - begin]. Every thread of the block calls it with the same arguments.
  __device__ static void select(const float* score, int begin, int end, int k, int32_t* out, Storage& st) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n = end - begin;
    if (k > n) k = n;
    if (k <= 0) return;
    if (k == n) {
      for (int i = tid; i < n; i += kTopKThreads) out[i] = begin + i;
      return;
    }
    const float* row = score + begin;
    const int seg = (n + kTopKThreads - 1) / kTopKThreads * 32;  // a multiple of 32 per warp
    const int s0 = min(n, warp * seg), s1 = min(n, s0 + seg);
    unsigned* hist = st.hist[warp];
    if (tid == 0) {
      st.prefix = 0;
      st.remaining = k;
    }
    uint32_t mask = 0;
    int gt = 0;  // this warp's keys above T (lane 0's copy is complete)
    for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
      for (int j = 0; j < 8; ++j) hist[lane + 32 * j] = 0;
      __syncthreads();  // also: st.prefix of the previous digit search is visible
      const uint32_t prefix = st.prefix;
      unsigned run_digit = 0, run = 0;
      for (int b0 = s0; b0 < s1; b0 += 32 * kLoads) {  // the lane's elements of the segment in index order
        uint32_t u[kLoads];
        load_keys(row, b0 + lane, 32, s1, u);
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          if (b0 + 32 * j + lane >= s1 || (u[j] & mask) != prefix) continue;
          const unsigned d = (u[j] >> shift) & 255u;
          if (d != run_digit && run != 0) {
            atomicAdd(&hist[run_digit], run);
            run = 0;
          }
          run_digit = d;
          ++run;
        }
      }
      if (run != 0) atomicAdd(&hist[run_digit], run);
      __syncthreads();
      if (tid < 256) {
        unsigned sum = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += st.hist[w][tid];
        st.total[tid] = sum;
      }
      __syncthreads();
      if (tid < 32) {  // the digit search: the 8-bit digit where the count from the top reaches `remaining`
        const unsigned rem = static_cast<unsigned>(st.remaining);
        unsigned cnt[8];
        unsigned sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          cnt[j] = st.total[255 - 8 * lane - j];
          sum += cnt[j];
        }
        // Every lane has read st.remaining (and its digits) before the one lane that finds the digit overwrites
        // st.remaining / st.prefix below: without this barrier the read and that write are unordered between
        // lanes (compute-sanitizer racecheck reported exactly that pair in v1's block top-k), and a lane
        // reading the new value would compare against the wrong count.
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
              st.digit = 255 - 8 * lane - j;
              break;
            }
            acc += cnt[j];
          }
        }
      }
      mask |= 255u << shift;
      __syncthreads();
      // This warp's keys with T's digits so far and a larger digit here are above T.
      const int digit = st.digit;
      unsigned above = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = lane + 32 * j;
        above += d > digit ? hist[d] : 0u;
      }
      gt += static_cast<int>(__reduce_add_sync(0xffffffffu, above));
      if (shift == 0 && lane == 0) {
        st.gt[warp] = gt;
        st.eq[warp] = static_cast<int>(hist[digit]);
      }
      __syncwarp();  // the warp's reads of its histogram before the next pass zeroes it
    }
    __syncthreads();

    // T = st.prefix; keep every key above T and the first need_eq keys equal to T (index order).
    const uint32_t thr = st.prefix;
    const int need_eq = st.remaining;
    const unsigned below = (1u << lane) - 1u;
    int taken = 0, eq_seen = 0;  // over the warps before this one
    for (int w = 0; w < warp; ++w) {
      const int eq_w = st.eq[w];
      const int left = need_eq - eq_seen;
      taken += st.gt[w] + (left <= 0 ? 0 : (left < eq_w ? left : eq_w));
      eq_seen += eq_w;
    }
    for (int b0 = s0; b0 < s1; b0 += 32 * kLoads) {
      uint32_t u[kLoads];
      load_keys(row, b0 + lane, 32, s1, u);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {  // in index order
        const int i = b0 + 32 * j + lane;
        const bool is_eq = i < s1 && u[j] == thr;
        const unsigned em = __ballot_sync(0xffffffffu, is_eq);
        const bool sel = (i < s1 && u[j] > thr) || (is_eq && eq_seen + __popc(em & below) < need_eq);
        const unsigned sm = __ballot_sync(0xffffffffu, sel);
        if (sel) out[taken + __popc(sm & below)] = begin + i;
        taken += __popc(sm);
        eq_seen += __popc(em);
      }
    }
  }
};

// Adaptive budgets (pattern.h; the rule of coverage_count in attention/index/estimate.h) by one block: the
// number of entries of a row of masses (column or diagonal sums, >= 0) to keep: the forced [0, forced) first,
// then the rest by mass (VsTopK's order: order keys descending, ties to the smaller index), the shortest prefix
// whose mass reaches gamma * total, clamped to [max(min_count, forced), max_count]. With S(t) the mass of the
// unforced entries whose order key is >= t: the threshold T is the largest t with F + S(t) >= target (F: the
// forced mass), found by an 8-way search of the key interval (each pass over the row evaluates S at 7 points and
// narrows the interval 8-fold: 11 passes for the 2^31 keys of non-negative floats, where bisection took 31);
// the prefix then holds every unforced entry above T and the first ceil((target - F - S(T + 1)) / mass(T)) of
// those equal to T. Every sum is f64, each thread's in index order, then a fixed tree over lanes and warps: the
// count does not depend on timing (nor on the search: S(t) is the same sum whichever pass evaluates it). The CPU
// sums in the prefix's own order, so the two agree wherever the target is not within rounding of a prefix sum.
struct VsCoverage {
  static constexpr int kWarps = kTopKThreads / 32;
  static constexpr int kPoints = 7;  // thresholds per pass (more spill registers at 512 threads)
  struct Storage {
    double sum[kWarps][kPoints];
    unsigned count[kWarps][kPoints];
    double mass[kPoints];  // the results of the last mass_from
    unsigned n[kPoints];
  };

  // For the thresholds t_j = first + j * step, j < points (<= kPoints): the mass and the number of the entries of
  // row[begin, end) whose order key is >= t_j, into st.mass[j] / st.n[j] (read them before the next call).
  __device__ static void mass_from(const float* row, int begin, int end, uint64_t first, uint64_t step, int points,
                                   Storage& st) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    double m[kPoints];
    unsigned c[kPoints];
#pragma unroll
    for (int j = 0; j < kPoints; ++j) {
      m[j] = 0.0;
      c[j] = 0;
    }
#pragma unroll 2
    for (int i = begin + tid; i < end; i += kTopKThreads) {
      const float x = row[i];
      const uint64_t key = detail::order_key(x);
      if (key < first) continue;
      const uint64_t d = key - first;
      const double v = x > 0.0f ? static_cast<double>(x) : 0.0;
#pragma unroll
      for (int j = 0; j < kPoints; ++j) {
        if (j < points && d >= static_cast<uint64_t>(j) * step) {
          m[j] += v;
          ++c[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kPoints; ++j) {
      if (j >= points) break;  // uniform over the block
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        m[j] += __shfl_xor_sync(0xffffffffu, m[j], o);
        c[j] += __shfl_xor_sync(0xffffffffu, c[j], o);
      }
      if (lane == 0) {
        st.sum[warp][j] = m[j];
        st.count[warp][j] = c[j];
      }
    }
    __syncthreads();  // also: every thread has read st.mass / st.n of the previous call
    if (tid < points) {
      double total = 0.0;
      unsigned count = 0;
      for (int w = 0; w < kWarps; ++w) {
        total += st.sum[w][tid];
        count += st.count[w][tid];
      }
      st.mass[tid] = total;
      st.n[tid] = count;
    }
    __syncthreads();
  }

  __device__ static int count(const float* row, int n, int forced, double gamma, int min_count, int max_count,
                              Storage& st) {
    max_count = min(max_count, n);
    forced = min(forced, max_count);
    const int lo_count = min(max(min_count, forced), max_count);
    int keep = n;
    double total = 0.0;
    if (gamma < 1.0) {
      mass_from(row, 0, n, 0, 1, 1, st);
      total = st.mass[0];
    }
    if (gamma < 1.0 && total > 0.0) {
      const double target = gamma * total;
      mass_from(row, 0, forced, 0, 1, 1, st);
      const double forced_mass = st.mass[0];
      if (forced_mass >= target) {
        keep = forced;
      } else {
        // Keys of masses >= 0 are >= order_key(0) = 0x80000000: the search runs over [lo, hi) with lo valid
        // (F + S(lo) >= target, when all unforced mass reaches it) and hi invalid (S(2^32) = 0).
        uint64_t lo = 0x80000000u, hi = uint64_t{1} << 32;
        mass_from(row, forced, n, lo, 1, 1, st);
        double s_hi = 0.0;
        unsigned c_lo = st.n[0], c_hi = 0;
        if (forced_mass + st.mass[0] >= target) {
          while (hi - lo > 1) {
            // Points lo + step, lo + 2 step, ... below hi: (kPoints + 1)-fold narrower each pass.
            const uint64_t step = (hi - lo + kPoints) / (kPoints + 1);  // >= 1
            const uint64_t fit = (hi - lo - 1) / step;  // points strictly inside (lo, hi)
            const int points = fit < static_cast<uint64_t>(kPoints) ? static_cast<int>(fit) : kPoints;
            mass_from(row, forced, n, lo + step, step, points, st);
            // Valid points form a prefix (S falls as t grows): lo = the last valid, hi = the first invalid.
            uint64_t new_lo = lo, new_hi = hi;
            for (int j = 0; j < points; ++j) {
              const uint64_t t = lo + static_cast<uint64_t>(j + 1) * step;
              if (forced_mass + st.mass[j] >= target) {
                new_lo = t;
                c_lo = st.n[j];
              } else {
                new_hi = t;
                s_hi = st.mass[j];
                c_hi = st.n[j];
                break;
              }
            }
            lo = new_lo;
            hi = new_hi;
          }
          // T = lo: c_hi entries above it (mass s_hi), c_lo - c_hi equal to it, each of mass v.
          const double v = static_cast<double>(__uint_as_float(static_cast<uint32_t>(lo) & 0x7fffffffu));
          const double need = target - forced_mass - s_hi;
          const unsigned eq = c_lo - c_hi;
          unsigned take = 1;
          if (v > 0.0) {
            const double tk = ceil(need / v);
            take = tk < 1.0 ? 1u : (tk >= static_cast<double>(eq) ? eq : static_cast<unsigned>(tk));
          }
          keep = forced + static_cast<int>(c_hi + take);
        }
      }
    }
    return min(max(keep, lo_count), max_count);
  }
};

__global__ void __launch_bounds__(kTopKThreads) vs_topk_kernel(const VsParams p) {
  __shared__ VsTopK::Storage st;
  __shared__ VsCoverage::Storage cover;
  const int slot = blockIdx.x;
  const bool cols = blockIdx.y == 0;
  const VsHeadDesc hd = p.heads[slot];
  const float* score = (cols ? p.colsum : p.diag) + static_cast<int64_t>(slot) * p.keys;
  int32_t* out = cols ? p.columns + hd.column_base : p.offsets + hd.offset_base;
  const int forced = cols ? hd.forced_columns : hd.forced_offsets;
  const int room = cols ? hd.num_columns : hd.num_offsets;
  int count = room;
  if (hd.gamma > 0.0) {
    count = VsCoverage::count(score, p.keys, forced, hd.gamma, cols ? hd.min_columns : hd.min_offsets, room, cover);
  }
  for (int i = threadIdx.x; i < forced; i += kTopKThreads) out[i] = i;
  VsTopK::select(score, forced, p.keys, count - forced, out + forced, st);
  for (int i = count + static_cast<int>(threadIdx.x); i < room; i += kTopKThreads) out[i] = kVsUnused;
}

}  // namespace

}  // namespace tessera::attn::gpu
