// tessera/runtime/stream/span_math.h — the arithmetic of span discovery and InfLLM's block scores, one definition
// for the CPU class (span_discovery.cpp, span_index.cpp) and the device kernels (runtime/cuda/stream_decide.cu),
// so that the device's theta, triangle scores, candidates, span masses and InfLLM block scores EQUAL the CPU's
// bit for bit on the same map and vectors. Every sum, difference and product is one correctly rounded operation
// (or an explicit fused multiply-add), written so that neither compiler may contract or reorder it: on the device
// through the __*_rn intrinsics, on the host through plain operators (runtime code is built with -O3, without
// -ffast-math) and std::fma where a fused operation is meant.
//
// The prefix sums P of a causal map A ([n, n] row-major, entries above the diagonal ignored) are (n + 1) x (n + 1)
// doubles: P[0][*] = P[*][0] = 0 and P[r + 1][c + 1] = P[r][c + 1] + R[r][c], R[r][c] the running sum of
// A[r][0..min(c, r)] taken left to right. The device builds R row by row (one thread per row, left to right) and
// then P column by column (one thread per column, top to bottom): the same operations in the same order as the
// CPU's row-major loop. tests/runtime_stream_test.cpp runs these functions as the kernels do (the host emulation)
// and checks them against TriangleScores / causal_quantile / span_candidates.
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

// The correctly rounded operations: on the device the __*_rn intrinsics, on the host plain operators and std::fma.
#if defined(__CUDA_ARCH__)
TESSERA_SPAN_HD double add(double a, double b) { return __dadd_rn(a, b); }
TESSERA_SPAN_HD double sub(double a, double b) { return __dsub_rn(a, b); }
TESSERA_SPAN_HD double mul(double a, double b) { return __dmul_rn(a, b); }
TESSERA_SPAN_HD double fma(double a, double b, double c) { return __fma_rn(a, b, c); }
TESSERA_SPAN_HD float fmaf(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
TESSERA_SPAN_HD double add(double a, double b) { return a + b; }
TESSERA_SPAN_HD double sub(double a, double b) { return a - b; }
TESSERA_SPAN_HD double mul(double a, double b) { return a * b; }
TESSERA_SPAN_HD double fma(double a, double b, double c) { return std::fma(a, b, c); }
TESSERA_SPAN_HD float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
#endif

// P[r][c] of the (n + 1) x (n + 1) table.
TESSERA_SPAN_HD double at(const double* P, int32_t n, int32_t r, int32_t c) {
  return P[static_cast<int64_t>(r) * (n + 1) + c];
}

// Mass of the causal cells in rows [r0, r1) x columns [c0, c1): ((P[r1][c1] - P[r0][c1]) - P[r1][c0]) + P[r0][c0].
TESSERA_SPAN_HD double mass(const double* P, int32_t n, int32_t r0, int32_t r1, int32_t c0, int32_t c1) {
  if (r1 <= r0 || c1 <= c0) return 0;
  return add(sub(sub(at(P, n, r1, c1), at(P, n, r0, c1)), at(P, n, r1, c0)), at(P, n, r0, c0));
}

// TA(j, i) = mass of the triangle j..i - theta * len (len + 1) / 2 (the cell count is an exact integer in double):
// one fused multiply-add.
TESSERA_SPAN_HD double triangle_score(const double* P, int32_t n, double theta, int32_t j, int32_t i) {
  const double len = static_cast<double>(i - j + 1);
  const double cells = len * (len + 1) / 2;  // exact: an integer below 2^53
  return fma(-theta, cells, mass(P, n, j, i + 1, j, i + 1));
}

// Loads are taken kChunk at a time into registers before the chunk's dependent adds (the device's memory latency
// is then paid once per chunk); the adds themselves run one after another in column (row) order.
constexpr int32_t kPrefixChunk = 32;

// Row r of R into P's row r + 1 (P[r + 1][c + 1] = R[r][c]; the column pass adds the rows above).
TESSERA_SPAN_HD void prefix_row(const float* __restrict__ map, int32_t n, int32_t r, double* __restrict__ P) {
  double row = 0;
  const float* in = map + static_cast<int64_t>(r) * n;
  double* out = P + static_cast<int64_t>(r + 1) * (n + 1);
  out[0] = 0;
  for (int32_t c0 = 0; c0 < n; c0 += kPrefixChunk) {
    float v[kPrefixChunk];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int32_t i = 0; i < kPrefixChunk; ++i) v[i] = c0 + i < n && c0 + i <= r ? in[c0 + i] : 0.0f;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int32_t i = 0; i < kPrefixChunk; ++i) {
      if (c0 + i >= n) break;
      if (c0 + i <= r) row = add(row, static_cast<double>(v[i]));
      out[c0 + i + 1] = row;
    }
  }
}

// Column c + 1 of P, top to bottom, after every prefix_row: P[r + 1][c + 1] = P[r][c + 1] + R[r][c].
TESSERA_SPAN_HD void prefix_column(int32_t n, int32_t c, double* __restrict__ P) {
  double acc = 0;  // P[0][c + 1]
  const int64_t ld = n + 1;
  double* col = P + ld + c + 1;  // P[1][c + 1]
  for (int32_t r0 = 0; r0 < n; r0 += kPrefixChunk) {
    double v[kPrefixChunk];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int32_t i = 0; i < kPrefixChunk; ++i) v[i] = r0 + i < n ? col[(r0 + i) * ld] : 0.0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int32_t i = 0; i < kPrefixChunk; ++i) {
      if (r0 + i >= n) break;
      acc = add(acc, v[i]);
      col[(r0 + i) * ld] = acc;
    }
  }
}

// Whether candidate (v1 at begin j1) beats (v2 at j2) on one anti-diagonal: the higher score, ties the smaller j.
TESSERA_SPAN_HD bool diagonal_better(double v1, int32_t j1, double v2, int32_t j2) {
  return v1 > v2 || (v1 == v2 && j1 < j2);
}

// One lane's share of anti-diagonal d (j + i = d, j <= i): j = j0 + lane, j0 + lane + lanes, ...; its best TA > 0
// (ties: the smaller j, as it scans j upwards). Combining the lanes' bests with diagonal_better() in any order gives
// diagonal_best()'s point (the maximum; among equal maxima the smallest j).
TESSERA_SPAN_HD bool diagonal_best_lane(const double* P, int32_t n, double theta, int32_t d, int32_t lane,
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
TESSERA_SPAN_HD bool diagonal_best(const double* P, int32_t n, double theta, int32_t d, int32_t* begin, int32_t* end,
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
