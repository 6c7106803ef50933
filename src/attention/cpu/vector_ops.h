// tessera/attention/cpu/vector_ops.h — internal: the vector steps that both CPU attention kernels take from their
// SIMD policy (the query tile, flash_tile_impl.h; the paged decode, paged_decode_impl.h), written once per
// instruction set. A kernel's per-ISA file (flash_tile_avx512.cpp, flash_tile_baseline.cpp, paged_decode_avx512.cpp,
// paged_decode_avx2.cpp) derives its policy from the ops of its ISA and adds the kernel's own parts (register
// blocking, reductions); everything here has internal linkage, each file being compiled with its own ISA flags.
//
// The ops: reg, kWidth (lanes); zero, set1, load / store (kWidth floats), fmadd(a, b, c) = a * b + c, add, sub, mul,
// max; reduce_add (the sum of the lanes); zero_if_neg_inf(x) (x, with -inf lanes 0); exp2(x) (0 for x <= -125, -inf included, so no denormal is produced);
// widen_bf16 / widen_f16 (kWidth 16-bit values to f32); transpose(x, dst, ld) (kWidth registers x[i] of kWidth floats
// to dst[c * ld + i]).
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "core/simd_x86.h"
#endif

namespace tessera::attn::cpu_detail {
namespace {

// 2^f for |f| <= 1/2 by a degree-6 polynomial fitted for relative error (about 1e-7 in f32), Horner's scheme
// in policy S's fmadd: the part of the policies' exp2 that does not depend on the ISA (each scales the result by
// 2^n its own way).
template <class S>
typename S::reg exp2_fraction(typename S::reg f) {
  typename S::reg p = S::set1(1.5337576830683796e-4f);
  p = S::fmadd(p, f, S::set1(1.3399860363037684e-3f));
  p = S::fmadd(p, f, S::set1(9.618519534356884e-3f));
  p = S::fmadd(p, f, S::set1(5.5503289975178886e-2f));
  p = S::fmadd(p, f, S::set1(2.402264660871389e-1f));
  p = S::fmadd(p, f, S::set1(6.931472056005106e-1f));
  return S::fmadd(p, f, S::set1(1.0000000005920204f));
}

#if defined(__AVX512F__) && defined(__FMA__)
struct Avx512Ops {
  using reg = __m512;
  static constexpr int kWidth = 16;

  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
  static reg zero_if_neg_inf(reg x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ), x);
  }
  // 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2; 2^f by exp2_fraction, 2^n by scalef. Lanes <= -125 (-inf
  // included, whose lanes go NaN on the way) are masked to exactly 0.
  static reg exp2(reg x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GT_OQ);
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg p = exp2_fraction<Avx512Ops>(_mm512_sub_ps(x, n));
    return _mm512_maskz_scalef_ps(live, p, n);
  }
  static reg widen_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg widen_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // dst[c * ld + i] = x[i][c] for i, c < 16: 16 rows of 16 floats transposed in registers.
  static void transpose(const reg* x, float* dst, int64_t ld) {
    reg r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = x[i];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    auto lo = [](reg a, reg b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
    auto hi = [](reg a, reg b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
    for (int i = 0; i < 16; i += 4) {
      r[i] = lo(t[i], t[i + 2]);
      r[i + 1] = hi(t[i], t[i + 2]);
      r[i + 2] = lo(t[i + 1], t[i + 3]);
      r[i + 3] = hi(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
      for (int i = 0; i < 4; ++i) {
        t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
        t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
      }
    for (int i = 0; i < 8; ++i) {
      _mm512_storeu_ps(dst + i * ld, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
      _mm512_storeu_ps(dst + (i + 8) * ld, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2Ops {
  using reg = __m256;
  static constexpr int kWidth = 8;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float reduce_add(reg x) { return x86::hsum(x); }
  static reg zero_if_neg_inf(reg x) {
    return _mm256_and_ps(x, _mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ));
  }
  // As Avx512Ops::exp2, with 2^n built in the exponent field (n >= -124 on live lanes; others are masked to 0).
  static reg exp2(reg x) {
    const reg live = _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));  // keeps the integer conversion below in range
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg p = exp2_fraction<Avx2Ops>(_mm256_sub_ps(x, n));
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
  // dst[c * ld + i] = x[i][c] for i, c < 8: 8 rows of 8 floats transposed in registers.
  static void transpose(const reg* x, float* dst, int64_t ld) {
    reg r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = x[i];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }
};
#endif

}  // namespace
}  // namespace tessera::attn::cpu_detail
