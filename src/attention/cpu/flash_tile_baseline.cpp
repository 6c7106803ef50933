// The query-tile kernel for the build's baseline ISA: AVX2 + FMA on x86-64-v3, portable C++ elsewhere.
#include "attention/cpu/flash_tile.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "attention/cpu/flash_tile_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

// 16 ymm registers: a micro-kernel covers 16 rows (2 ymm) at a time; QK^T 4 keys x 2 = 8 accumulators,
// PV 4 dims x 2 = 8 accumulators.
struct Avx2 {
  using reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRowVecs = 2;
  static constexpr int kQkKeys = 4;
  static constexpr int kPvDims = 4;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float reduce_add(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static reg zero_if_neg_inf(reg x) {
    return _mm256_and_ps(x, _mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ));
  }
  // As Avx512::exp2, with 2^n built in the exponent field (n >= -124 on live lanes; others are masked to 0).
  static reg exp2(reg x) {
    const reg live = _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));  // keeps the integer conversion below in range
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg p = exp2_fraction<Avx2>(_mm256_sub_ps(x, n));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }
  static reg widen_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg widen_f16(const uint16_t* p) {  // F16C (part of x86-64-v3)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
using Baseline = Avx2;

}  // namespace
}  // namespace tessera::attn::cpu_detail

#else

#include <cmath>

#include "attention/cpu/flash_tile_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

// Plain C++ lanes for targets without AVX2; the compiler vectorises what it can.
struct Portable {
  struct reg {
    float x[8];
  };
  static constexpr int kWidth = 8;
  static constexpr int kRowVecs = 2;
  static constexpr int kQkKeys = 4;
  static constexpr int kPvDims = 4;
  template <class F>
  static reg map(F f) {
    reg r;
    for (int i = 0; i < 8; ++i) r.x[i] = f(i);
    return r;
  }
  static reg zero() { return set1(0); }
  static reg set1(float v) {
    return map([&](int) { return v; });
  }
  static reg load(const float* p) {
    return map([&](int i) { return p[i]; });
  }
  static void store(float* p, reg a) {
    for (int i = 0; i < 8; ++i) p[i] = a.x[i];
  }
  static reg fmadd(reg a, reg b, reg c) {
    return map([&](int i) { return a.x[i] * b.x[i] + c.x[i]; });
  }
  static reg add(reg a, reg b) {
    return map([&](int i) { return a.x[i] + b.x[i]; });
  }
  static reg sub(reg a, reg b) {
    return map([&](int i) { return a.x[i] - b.x[i]; });
  }
  static reg mul(reg a, reg b) {
    return map([&](int i) { return a.x[i] * b.x[i]; });
  }
  static reg max(reg a, reg b) {
    return map([&](int i) { return a.x[i] > b.x[i] ? a.x[i] : b.x[i]; });
  }
  static float reduce_add(reg a) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += a.x[i];
    return s;
  }
  static reg zero_if_neg_inf(reg a) {
    return map([&](int i) { return a.x[i] == -HUGE_VALF ? 0.0f : a.x[i]; });
  }
  static reg exp2(reg a) {
    return map([&](int i) { return a.x[i] <= -125.0f ? 0.0f : std::exp2(a.x[i]); });
  }
  static reg widen_bf16(const uint16_t* p) {
    return map([&](int i) { return bf16_bits_to_f32(p[i]); });
  }
  static reg widen_f16(const uint16_t* p) {
    return map([&](int i) { return f16_bits_to_f32(p[i]); });
  }
};
using Baseline = Portable;

}  // namespace
}  // namespace tessera::attn::cpu_detail

#endif

namespace tessera::attn::cpu_detail {

void run_tile_baseline(const TileJob& job, float* scratch) {
  run_tile_flushing_denormals<Baseline>(job, scratch);
}

}  // namespace tessera::attn::cpu_detail
