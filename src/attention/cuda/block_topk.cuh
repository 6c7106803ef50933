// tessera/attention/cuda/block_topk.cuh — the selection rule of the estimators' exact top-k and its one-warp
// implementation (WarpTopK) (device code; the one-block VS top-k, VsTopK, is in vs_select_kernels.cuh).
//
// The rule: on the order-preserving 32-bit image of the floats (order_key), find the k-th largest key T
// exactly; keep every element above T and the first (smallest-index) elements equal to T until k are kept,
// and write the kept indices in ascending order. So ties go to the smaller index, as in the CPU estimators
// (attention/index/estimate.cpp), and the result does not depend on thread timing. -0.0 counts as +0.0.
// (The block-wide BlockTopK of v1/v2 was replaced by VsTopK and removed.)
#pragma once

#include <cstdint>

namespace tessera::attn::gpu::detail {

// Larger float -> larger unsigned key.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x == 0.0f) x = 0.0f;  // fold -0.0 into +0.0
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exact top-k of one row by one warp, with the selection rule above (the k largest order keys, ties to
// the smaller index, written in ascending index order), for 0 < k < n. The row is read from global memory
// once into registers when it has at most 32 * kRegSlots entries (kInRegisters), else once per pass.
//
// v3 (docs/PERF.md history, "Top-k v3"). The k-th largest key T is bracketed by [lo, top] with c_lo = count(key >= lo) >= k
// > c_hi = count(key > top), and the bracket is narrowed by bisection of the key interval (v2 went bit by bit
// from bit 31, and on float keys most of those bits were sign and exponent bits that moved no count):
//   1. one pass: the row's largest key (top) and, for k <= 128, the smallest of the maxima of 128 groups of
//      the row (group j of lane l: slots r = j mod 4): 128 distinct keys are >= it, so it is a valid first
//      lo (the first pass's candidate), typically with a few hundred keys above it;
//   2. bisection passes over the row (count(key >= mid), per-lane counts in 4 independent accumulators and
//      one warp reduction) while more than kCap keys are >= lo and more than 32 lie in the bracket;
//   3. if at most kCap keys are >= lo, one ordered ballot pass copies all of them (key and index, in index
//      order) to `buf` and the rest works on those kSmall per lane: bisection down to <= 32 keys in the
//      bracket, those one per lane, bisection to T, and the ordered ballot output over the copies (no second
//      pass over the row). Otherwise (ties: over kCap keys equal T, or k > kCap) the bracket is gathered from
//      the row, T found one key per lane, and one ordered ballot pass over the row writes the output.
// Every step keeps the invariant, so T (the lo where lo == top) and need_eq = k - c_hi are v2's: same output.
// `buf` holds kBufWords words per warp. Every lane of the warp must call it with the same arguments.
template <int kRegSlots>
struct WarpTopK {
  static constexpr int kSmall = 8;            // copies per lane in step 3
  static constexpr int kCap = 32 * kSmall;    // keys >= lo that step 3 takes
  static constexpr int kBufWords = 2 * kCap;  // keys, then indices
  static constexpr int kHintGroups = 128;     // 4 per lane

  __device__ static uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
  __device__ static uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

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
    // f(key, valid, index, r % 4) for the row's slots in index order (slot r holds index 32 r + lane) while
    // it returns true; the return value must be the same on every lane. Keys past the row are 0.
    auto visit = [&](auto&& f) {
      if constexpr (kInRegisters) {
        bool go = true;
#pragma unroll
        for (int g = 0; g < kRegSlots / 8; ++g) {
          if (!go || g * 8 >= slots) break;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int r = g * 8 + j, i = r * 32 + lane;
            if (go) go = f(key[r], i < n, i, r & 3);
          }
        }
      } else {
#pragma unroll 4
        for (int r = 0; r < slots; ++r) {
          const int i = r * 32 + lane;
          const bool ok = i < n;
          if (!f(ok ? order_key(row[i]) : 0u, ok, i, 0)) break;
        }
      }
    };
    const unsigned kk = static_cast<unsigned>(k);
    // 1. top = the largest key; hint = the smallest of the group maxima (groups without a slot left out).
    uint32_t gmax[4] = {0u, 0u, 0u, 0u};
    if constexpr (kInRegisters) {
      visit([&](uint32_t x, bool, int, int j) {
        gmax[j] = umax(gmax[j], x);
        return true;
      });
    } else {
      for (int r0 = 0; r0 < slots; r0 += 4) {
        uint32_t x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = (r0 + j) * 32 + lane;
          x[j] = i < n ? order_key(row[i]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) gmax[j] = umax(gmax[j], x[j]);
      }
    }
    uint32_t top = 0u, hint = ~0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      top = umax(top, gmax[j]);
      if (j * 32 + lane < n) hint = umin(hint, gmax[j]);
    }
    top = __reduce_max_sync(kAll, top);
    hint = __reduce_min_sync(kAll, hint);
    // min(n, 128) nonempty groups, each with a key >= hint: count(key >= hint) >= k when k <= 128.
    bool use_hint = kk <= static_cast<unsigned>(kHintGroups) && hint > 0u;
    uint32_t lo = 0u;
    unsigned c_lo = static_cast<unsigned>(n), c_hi = 0u;
    auto narrow = [&](uint32_t cand, unsigned cnt) {
      if (cnt >= kk) {
        lo = cand;
        c_lo = cnt;
      } else {
        top = cand - 1u;
        c_hi = cnt;
      }
    };
    auto mid = [&]() { return lo + ((top - lo) >> 1) + 1u; };  // in (lo, top]
    // 2. Bisection over the row (cand >= 1: the 0 keys past the row never count).
    while (lo != top && c_lo > static_cast<unsigned>(kCap) && c_lo - c_hi > 32u) {
      const uint32_t cand = use_hint ? hint : mid();
      use_hint = false;
      unsigned c4[4] = {0u, 0u, 0u, 0u};
      visit([&](uint32_t x, bool, int, int j) {
        c4[j] += x >= cand ? 1u : 0u;
        return true;
      });
      narrow(cand, __reduce_add_sync(kAll, (c4[0] + c4[1]) + (c4[2] + c4[3])));
    }
    // The m <= 32 keys of [lo, top] one per lane (mine); then bisection to T = lo = top on those: count(key >=
    // cand) = count(key > top) at the gather (c_hi then, not the c_hi the bisection moves) + those >= cand.
    // `buf` is free again when this returns.
    auto finish = [&](uint32_t mine, bool mine_ok) {
      const unsigned above = c_hi;
      while (lo != top) {
        const uint32_t cand = mid();
        narrow(cand, above + __reduce_add_sync(kAll, mine_ok && mine >= cand ? 1u : 0u));
      }
    };
    auto gather_bracket = [&](auto&& visit_keys) {
      const unsigned m = c_lo - c_hi;
      unsigned found = 0;
      visit_keys([&](uint32_t x, bool ok, int, int) {
        const bool in = ok && x >= lo && x <= top;
        const unsigned b = __ballot_sync(kAll, in);
        if (in) buf[found + __popc(b & below)] = x;
        found += __popc(b);
        return found < m;
      });
      __syncwarp();
      const bool mine_ok = static_cast<unsigned>(lane) < m;
      const uint32_t mine = mine_ok ? buf[lane] : 0u;
      __syncwarp();
      finish(mine, mine_ok);
    };
    if (c_lo <= static_cast<unsigned>(kCap)) {
      // 3. Every key >= lo (and its index) to buf in index order; then the rest on those copies.
      const unsigned m = c_lo;
      uint32_t* skey = buf;
      uint32_t* sidx = buf + kCap;
      unsigned found = 0;
      visit([&](uint32_t x, bool ok, int i, int) {
        const bool in = ok && x >= lo;
        const unsigned b = __ballot_sync(kAll, in);
        if (in) {
          const unsigned at = found + __popc(b & below);
          skey[at] = x;
          sidx[at] = static_cast<uint32_t>(i);
        }
        found += __popc(b);
        return found < m;
      });
      __syncwarp();
      uint32_t ks[kSmall];
#pragma unroll
      for (int s = 0; s < kSmall; ++s) {
        const unsigned e = static_cast<unsigned>(s * 32 + lane);
        ks[s] = e < m ? skey[e] : 0u;
      }
      __syncwarp();  // skey is free for the bracket gather
      while (lo != top && c_lo - c_hi > 32u) {
        const uint32_t cand = mid();
        unsigned c = 0;
#pragma unroll
        for (int s = 0; s < kSmall; ++s) c += ks[s] >= cand ? 1u : 0u;
        narrow(cand, __reduce_add_sync(kAll, c));
      }
      if (lo != top) {
        gather_bracket([&](auto&& f) {
          bool go = true;
#pragma unroll
          for (int s = 0; s < kSmall; ++s) {
            const unsigned e = static_cast<unsigned>(s * 32 + lane);
            if (go) go = f(ks[s], e < m, 0, 0);
          }
        });
      }
      // T = lo; count(key > T) = c_hi < k <= count(key >= T).
      const uint32_t thr = lo;
      const unsigned need_eq = kk - c_hi;
      unsigned taken = 0, eq_seen = 0;
#pragma unroll
      for (int s = 0; s < kSmall; ++s) {
        if (taken >= kk) break;
        const unsigned e = static_cast<unsigned>(s * 32 + lane);
        const bool ok = e < m;
        const bool eq = ok && ks[s] == thr;
        const unsigned em = __ballot_sync(kAll, eq);
        const bool sel = (ok && ks[s] > thr) || (eq && eq_seen + __popc(em & below) < need_eq);
        const unsigned sm = __ballot_sync(kAll, sel);
        if (sel) out[taken + __popc(sm & below)] = static_cast<int32_t>(sidx[e]);
        taken += __popc(sm);
        eq_seen += __popc(em);
      }
      __syncwarp();  // buf is free again when this returns
      return;
    }
    if (lo != top) gather_bracket(visit);
    // T = lo; count(key > T) = c_hi < k <= count(key >= T): one ordered pass over the row.
    const uint32_t thr = lo;
    const unsigned need_eq = kk - c_hi;
    unsigned taken = 0, eq_seen = 0;
    visit([&](uint32_t x, bool ok, int i, int) {
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
