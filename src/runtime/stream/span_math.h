// tessera/runtime/stream/span_math.h — the arithmetic of span discovery and InfLLM's block scores, one definition
// for the CPU class (span_discovery.cpp, span_index.cpp) and the device kernels (runtime/cuda/stream_decide.cu),
// so that the device's theta, triangle scores, candidates, span masses and InfLLM block scores EQUAL the CPU's
// bit for bit on the same map and vectors. The prefix sums are integers (below); every floating-point operation is one
// correctly rounded operation or an explicit fused multiply-add, written so that neither compiler may contract or
// reorder it (runtime code is built with -O3, without -ffast-math).
//
// The prefix sums P of a causal map A ([n, n] row-major, entries above the diagonal ignored) are (n + 1) x (n + 1)
// integers: every causal entry rounded to a multiple of 2^-kMassBits (fixed_mass()), P[0][*] = P[*][0] = 0 and
// P[r + 1][c + 1] = the fixed-point sum of A over rows <= r, columns <= min(c, row). Integer sums (uint64, wrapping)
// are associative, so every order of the adds gives the same P: the device's parallel scans (a warp per row, then
// strips of rows) equal the CPU's row-major loop bit for bit without keeping its order. A mass (a rectangle's four
// corners) is an exact integer, turned into one double (mass_value()). The rounding moves an entry by at most
// 2^-(kMassBits + 1) (~7e-12), far below the map's entries (softmax rows summed over heads: a 1,024-token chunk's
// average entry is ~heads / 512). The sums are exact while the map's total mass times 2^kMassBits stays below 2^63:
// a map of softmax rows has n x heads of mass, which must stay below 2^27 (n = 2^19 with 128 heads is 2^26).
// tests/runtime_stream_test.cpp emulates the kernels' structure on the host and checks them against TriangleScores /
// causal_quantile / span_candidates.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TESSERA_SPAN_HD __host__ __device__ __forceinline__
#else
#define TESSERA_SPAN_HD inline
#endif

namespace tessera::runtime::stream::span_math {

// The fused multiply-adds: on the device the __fma*_rn intrinsics, on the host std::fma.
#if defined(__CUDA_ARCH__)
TESSERA_SPAN_HD double fma(double a, double b, double c) { return __fma_rn(a, b, c); }
TESSERA_SPAN_HD float fmaf(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
TESSERA_SPAN_HD double fma(double a, double b, double c) { return std::fma(a, b, c); }
TESSERA_SPAN_HD float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
#endif

// The fixed point of the prefix sums: an entry counts as round(x * 2^kMassBits) (to nearest, ties to even), x
// clamped to [-2^kMassClamp, 2^kMassClamp] (NaN as 0) so that every entry is a defined integer.
constexpr int32_t kMassBits = 36;
constexpr int32_t kMassClamp = 24;
constexpr double kMassUnit = static_cast<double>(int64_t{1} << kMassBits);  // 2^kMassBits (exact)
TESSERA_SPAN_HD uint64_t fixed_mass(float x) {
  double v = static_cast<double>(x);
  constexpr double lim = static_cast<double>(1 << kMassClamp);
  v = v == v ? (v > lim ? lim : (v < -lim ? -lim : v)) : 0.0;
  const double scaled = v * kMassUnit;  // (exact: a power of two)
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double2ll_rn(scaled));
#else
  return static_cast<uint64_t>(std::llrint(scaled));  // the default rounding mode: to nearest, ties to even
#endif
}
// An exact integer mass (two's complement in the uint64) as a double: rounded once, then scaled exactly.
TESSERA_SPAN_HD double mass_value(uint64_t m) {
#if defined(__CUDA_ARCH__)
  const double v = __ll2double_rn(static_cast<long long>(m));
#else
  const double v = static_cast<double>(static_cast<int64_t>(m));
#endif
  return v * (1.0 / kMassUnit);  // (exact: a power of two)
}

// P[r][c] of the (n + 1) x (n + 1) table.
TESSERA_SPAN_HD uint64_t at(const uint64_t* P, int32_t n, int32_t r, int32_t c) {
  return P[static_cast<int64_t>(r) * (n + 1) + c];
}

// Mass of the causal cells in rows [r0, r1) x columns [c0, c1): P[r1][c1] - P[r0][c1] - P[r1][c0] + P[r0][c0], exact.
TESSERA_SPAN_HD double mass(const uint64_t* P, int32_t n, int32_t r0, int32_t r1, int32_t c0, int32_t c1) {
  if (r1 <= r0 || c1 <= c0) return 0;
  return mass_value(at(P, n, r1, c1) - at(P, n, r0, c1) - at(P, n, r1, c0) + at(P, n, r0, c0));
}

// TA(j, i) = mass of the triangle j..i - theta * len (len + 1) / 2 (the cell count is an exact integer in double):
// one fused multiply-add.
TESSERA_SPAN_HD double triangle_score(const uint64_t* P, int32_t n, double theta, int32_t j, int32_t i) {
  const double len = static_cast<double>(i - j + 1);
  const double cells = len * (len + 1) / 2;  // exact: an integer below 2^53
  return fma(-theta, cells, mass(P, n, j, i + 1, j, i + 1));
}

// Whether candidate (v1 at begin j1) beats (v2 at j2) on one anti-diagonal: the higher score, ties the smaller j.
TESSERA_SPAN_HD bool diagonal_better(double v1, int32_t j1, double v2, int32_t j2) {
  return v1 > v2 || (v1 == v2 && j1 < j2);
}

// One lane's share of anti-diagonal d (j + i = d, j <= i): j = j0 + lane, j0 + lane + lanes, ...; its best TA > 0
// (ties: the smaller j, as it scans j upwards). Combining the lanes' bests with diagonal_better() in any order gives
// diagonal_best()'s point (the maximum; among equal maxima the smallest j).
TESSERA_SPAN_HD bool diagonal_best_lane(const uint64_t* P, int32_t n, double theta, int32_t d, int32_t lane,
                                        int32_t lanes, int32_t* begin, double* score) {
  bool any = false;
  const int32_t j0 = d - (n - 1) > 0 ? d - (n - 1) : 0;
  for (int32_t j = j0 + lane; 2 * j <= d; j += lanes) {
    const double v = triangle_score(P, n, theta, j, d - j);
    if (v > 0 && (!any || v > *score)) {
      *begin = j;
      *score = v;
      any = true;
    }
  }
  return any;
}

// The linear variant's candidate on anti-diagonal d (j + i = d, j <= i): the best TA > 0, ties to the smaller j.
// Returns false when none scores above 0.
TESSERA_SPAN_HD bool diagonal_best(const uint64_t* P, int32_t n, double theta, int32_t d, int32_t* begin, int32_t* end,
                                   double* score) {
  if (!diagonal_best_lane(P, n, theta, d, 0, 1, begin, score)) return false;
  *end = d - *begin + 1;
  return true;
}

// The order key of a float: unsigned order equals the float order (negative values below positive ones).
TESSERA_SPAN_HD uint32_t order_key(float x) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(x);
#else
  std::memcpy(&u, &x, 4);
#endif
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
TESSERA_SPAN_HD float from_order_key(uint32_t key) {
  const uint32_t u = (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// One radix pass of the k-th smallest (0-based) key: given the 256 counts of the digit at this pass among the keys
// that match the digits chosen so far, the digit holding the k-th one; k becomes its rank among those keys.
TESSERA_SPAN_HD uint32_t pick_digit(const uint32_t* hist, uint64_t* k) {
  uint64_t below = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    if (*k < below + hist[b]) {
      *k -= below;
      return b;
    }
    below += hist[b];
  }
  return 255;  // k out of range: not reached for k < the keys counted
}

// The nearest-rank index causal_quantile() takes among m causal entries.
inline uint64_t quantile_rank(double quantile, uint64_t m) {
  const double q = quantile < 0 ? 0.0 : (quantile > 1 ? 1.0 : quantile);
  return m == 0 ? 0 : static_cast<uint64_t>(std::floor(q * static_cast<double>(m - 1)));
}

// InfLLM: sum over voting heads (w != 0) of w_h * dot(qmean_h, mean_{kv(h)}), each dot an f32 chain of fused
// multiply-adds in element order, the sum over heads f64 fused multiply-adds in head order.
TESSERA_SPAN_HD float repr_dot(const float* a, const float* b, int32_t d) {
  float dot = 0;
  for (int32_t i = 0; i < d; ++i) dot = fmaf(a[i], b[i], dot);
  return dot;
}
TESSERA_SPAN_HD double repr_accumulate(double s, double w, float dot) { return fma(w, static_cast<double>(dot), s); }
TESSERA_SPAN_HD double repr_score(const float* qmean, const float* mean, const double* w, int32_t q_heads,
                                  int32_t group, int32_t d) {
  double s = 0;
  for (int32_t h = 0; h < q_heads; ++h) {
    if (w[h] == 0) continue;
    s = repr_accumulate(s, w[h], repr_dot(qmean + static_cast<int64_t>(h) * d, mean + static_cast<int64_t>(h / group) * d, d));
  }
  return s;
}

}  // namespace tessera::runtime::stream::span_math
