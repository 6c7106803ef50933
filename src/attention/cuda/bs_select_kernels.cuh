// tessera/attention/cuda/bs_select_kernels.cuh — the BS estimator's selection (device code): BsCoverage
// (adaptive budgets' counts), bs_diag_score and bs_select_kernel, a warp per query block choosing its key blocks
// from bs_score_kernels.cuh's scores.
// Part of estimate_kernels.cuh (which says who includes these headers and why everything in them has internal
// linkage); host-compiled by tests/emulation with TESSERA_EMULATION defined.
#pragma once

#include <cstdint>

#include "attention/cuda/block_topk.cuh"
#include "attention/cuda/bs_score_kernels.cuh"
#include "attention/cuda/estimate_cuda.h"

namespace tessera::attn::gpu {

namespace {

// Adaptive BS budgets (pattern.h; the rule of coverage_count in attention/index/estimate.h, as the CPU's
// estimate_block_sparse applies it) for one query block qb by one warp. The masses are m = expf(s - top) in f32
// (s the f32 scores, top the largest of them; the CPU takes exp(s - top) in f64 of the same f32 scores: the two
// differ by about 1e-7 relative) of the diagonal block (forced: first in the order) and of the blocks [0, qb)
// (row). The count is the shortest prefix of the order (the diagonal, then the rest by mass descending) whose
// summed mass (f64) reaches gamma * total, clamped to [max(min_count, 1), max_count]; blocks of equal mass are
// interchangeable for the count, so ordering by mass rather than by score (the selection afterwards) gives the
// same count. With S(t) the mass of the blocks whose mass's order key is >= t and F the diagonal's mass, the
// threshold T is the largest t with F + S(t) >= target, found by an 8-way radix search over the order keys of the
// masses (>= 0: 31 bits, 11 passes): each pass sorts the blocks whose key lies in the current interval into 8
// buckets of equal key width (per lane, in shared memory, f64 masses and counts), the warp sums each bucket over the
// lanes in lane order, and the interval becomes the highest bucket whose suffix (with the mass above the interval)
// still reaches the target. The prefix then holds the blocks above T and the first ceil((target - F - S(T + 1)) /
// m(T)) of those equal to T. Every pass reads the row's scores again (L2-resident: the scoring kernel just wrote
// them; masses cached in registers took the kernel to 253 registers, one block per SM). Every sum has a fixed order:
// the count does not depend on timing. The CPU sums in the prefix's own order, so the two agree wherever the target is not within rounding of
// a prefix sum (nor the scores within rounding of each other: the CPU's dot products add in another order).
// (v1 evaluated S at 7 thresholds per pass, each element adding into 7 f64 accumulators, and computed f64 masses
// from the scores every pass; docs/PERF.md has each version's 128K estimate time on an H200.)
constexpr int kBsBuckets = 8;
struct BsCoverageStorage {
  double mass[kBsBuckets][32];  // one warp's buckets, a column per lane
  unsigned count[kBsBuckets][32];
};

struct BsCoverage {
  __device__ static float mass(float s, float top) { return expf(s - top); }

  // Every lane must call it with the same arguments; max_count >= 2. `st`: this warp's storage.
  __device__ static int count(const float* scores, int n, float diag, double gamma, int min_count, int max_count,
                              BsCoverageStorage& st) {
    const int lo_count = min(max(min_count, 1), max_count);
    if (gamma >= 1.0) return max_count;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    float top = diag;
    for (int i = lane; i < n; i += 32) top = fmaxf(top, scores[i]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    // One pass: the blocks whose key is in [lo, lo + 2^width) into 8 buckets of width 2^shift (shift = width - 3,
    // or 0 with 2^width buckets); then lane b < 8 holds bucket b's mass and count (bm, bc; bucket_mass(b) reads
    // them on every lane: a shuffle, so that nothing in registers is indexed at run time).
    double bm = 0.0;
    unsigned bc = 0;
    auto bucket_mass = [&](int b) { return __shfl_sync(0xffffffffu, bm, b); };
    auto bucket_count = [&](int b) { return __shfl_sync(0xffffffffu, bc, b); };
    auto pass = [&](uint32_t lo, int width, int shift) {
#pragma unroll
      for (int b = 0; b < kBsBuckets; ++b) {
        st.mass[b][lane] = 0.0;
        st.count[b][lane] = 0;
      }
      for (int i = lane; i < n; i += 32) {
        const float x = mass(scores[i], top);
        const uint32_t key = detail::order_key(x);
        if (key < lo || static_cast<uint64_t>(key - lo) >= (uint64_t{1} << width)) continue;
        const int b = static_cast<int>((key - lo) >> shift);
        st.mass[b][lane] += static_cast<double>(x);
        st.count[b][lane] += 1;
      }
      __syncwarp();
      bm = 0.0;
      bc = 0;
      if (lane < kBsBuckets) {
        for (int l = 0; l < 32; ++l) {
          bm += st.mass[lane][l];
          bc += st.count[lane][l];
        }
      }
      __syncwarp();  // every lane's reads of the storage before the next pass clears it
    };
    const double forced_mass = static_cast<double>(mass(diag, top));
    constexpr uint32_t kZero = 0x80000000u;  // order_key(0.0f); masses are in [0, 1]: keys in [kZero, 2^32)
    // The first pass over the whole interval also gives the total.
    uint32_t lo = kZero;
    int width = 31;
    pass(lo, width, width - 3);
    double total_rest = 0.0;
    for (int b = 0; b < kBsBuckets; ++b) total_rest += bucket_mass(b);
    const double target = gamma * (forced_mass + total_rest);
    int keep = n + 1;  // no prefix reaches the target (rounding): all
    if (forced_mass >= target) {
      keep = 1;
    } else if (forced_mass + total_rest >= target) {
      double s_above = 0.0;  // mass and number of the blocks above the interval
      unsigned c_above = 0;
      for (;;) {
        const int shift = width > 3 ? width - 3 : 0;
        const int buckets = 1 << (width - shift);
        // The highest bucket whose suffix still reaches the target (bucket 0's always does: the invariant).
        double suffix = s_above;
        unsigned csuffix = c_above;
        int chosen = 0;
        for (int b = buckets - 1; b >= 0; --b) {
          const double mb = bucket_mass(b);
          if (forced_mass + suffix + mb >= target) {
            chosen = b;
            break;
          }
          suffix += mb;
          csuffix += bucket_count(b);
        }
        s_above = suffix;
        c_above = csuffix;
        lo += static_cast<uint32_t>(chosen) << shift;
        if (shift == 0) {
          // T = lo: c_above blocks above it (mass s_above), bc[chosen] equal to it, each of mass v.
          const unsigned eq = bucket_count(chosen);
          const double v = static_cast<double>(__uint_as_float(lo & 0x7fffffffu));
          const double need = target - forced_mass - s_above;
          unsigned take = 1;
          if (v > 0.0) {
            const double tk = ceil(need / v);
            take = tk < 1.0 ? 1u : (tk >= static_cast<double>(eq) ? eq : static_cast<unsigned>(tk));
          }
          keep = 1 + static_cast<int>(c_above + take);
          break;
        }
        width = shift;
        pass(lo, width, width > 3 ? width - 3 : 0);
      }
    }
    return min(max(keep, lo_count), max_count);
  }
};

// The score of query block e (entry of the head in slot `slot`) against its own key block qb, as bs_score_kernel
// computes the others (v1's tree: lane l's leaf is the fma over elements l, l + 32, ... from +0, the leaves added
// by the xor butterfly over lane masks 16 .. 1, times the scale), on every lane.
template <int D>
__device__ __forceinline__ float bs_diag_score(const BsParams& p, const BsHeadDesc& hd, int slot, int e, int qb) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const float* qp = p.qpool + (static_cast<int64_t>(slot) * p.max_q_blocks + e) * D;
  const float* kp = p.kpool + hd.kpool_base + static_cast<int64_t>(qb) * D;
  float a = 0.0f;
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    const int pos = bs_leaf_pos<D>(lane + 32 * t);
    a = fmaf(qp[pos], kp[pos], a);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) a = a + __shfl_xor_sync(0xffffffffu, a, o);
  return a * p.scale;
}

// grid (tiles of the wave, tile rows / 8): a warp per query block. The diagonal block qb is always kept (one
// of the top_k slots) and goes last; the other count - 1 are the top of [0, qb) by score, ascending, as in
// the CPU estimator (attention/index/estimate.h). count = min(top_k, qb + 1), the layout's room; for adaptive
// heads (gamma > 0) with room >= 2 the coverage count (BsCoverage), and kBsUnused fills the room after the kept.
// kAdaptive: the layer has adaptive heads (the fixed-only kernel keeps the coverage count's code and shared memory
// out).
template <int D, bool kAdaptive>
__global__ void __launch_bounds__(kBsSelectThreads) bs_select_kernel(const BsParams p, int tile_begin) {
  using TopK = detail::WarpTopK<kBsRegSlots>;
  __shared__ uint32_t buf[kBsSelectThreads / 32][TopK::kBufWords];
  __shared__ BsCoverageStorage cover[kAdaptive ? kBsSelectThreads / 32 : 1];
  const BsTileDesc tl = p.tiles[tile_begin + static_cast<int>(blockIdx.x)];
  const BsHeadDesc hd = p.heads[tl.slot];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = tl.e0 + static_cast<int>(blockIdx.y) * (kBsSelectThreads / 32) + warp;
  if (e >= tl.e1) return;  // uniform across the warp
  const int qb = hd.first_q_block + e;
  const int room = min(hd.top_k, qb + 1);
  if (room <= 0) return;
  int32_t* out = p.key_blocks + hd.key_base + p.offsets[hd.offsets_base + e];
  int count = room;
  if constexpr (kAdaptive) {
    if (hd.gamma > 0.0 && room >= 2) {  // a scored row (adaptive heads score every qb >= 1)
      const float* row = p.scores + bs_row_offset(tl, hd.first_q_block, e);
      const float diag = bs_diag_score<D>(p, hd, tl.slot, e, qb);
      count = BsCoverage::count(row, qb, diag, hd.gamma, hd.min_top_k, room, cover[warp]);
    }
  }
  const int k = count - 1;
  if (k >= qb) {
    for (int i = lane; i < qb; i += 32) out[i] = i;
  } else if (k > 0) {  // a scored row: 2 <= top_k <= qb, or adaptive
    const float* row = p.scores + bs_row_offset(tl, hd.first_q_block, e);
    if (qb <= 32 * kBsRegSlots) {
      TopK::select<true>(row, qb, k, out, buf[warp]);
    } else {
      TopK::select<false>(row, qb, k, out, buf[warp]);
    }
  }
  if (lane == 0) out[count - 1] = qb;
  for (int i = count + lane; i < room; i += 32) out[i] = kBsUnused;
}

}  // namespace

}  // namespace tessera::attn::gpu
