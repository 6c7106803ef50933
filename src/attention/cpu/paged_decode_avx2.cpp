// The paged decode kernel for AVX2 + FMA + F16C (the build's baseline ISA on x86-64, x86-64-v3;
// paged_decode.cpp calls it only on a CPU that has them).
#include "attention/cpu/paged_decode.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include "attention/cpu/paged_decode_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

struct PagedAvx2 {
  using reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float reduce_max(reg x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_add(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  template <class E>
  static reg load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, ElemF32>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::is_same_v<E, ElemF16>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }

  // 2^x with 2^n built in the exponent field; lanes <= -125 (and -inf) give exactly 0.
  static reg exp2(reg x) {
    const reg live = _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg p = paged_exp2_fraction<PagedAvx2>(_mm256_sub_ps(x, n));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }

  // 128-bit halves: a's sum of its halves, then b's.
  static reg pair(reg a, reg b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // Half 0: keys 0, 2 (lanes 0/2 and 1/3 partial sums); half 1: keys 1, 3.
  static reg quad(reg r01, reg r23) {
    return _mm256_add_ps(_mm256_unpacklo_ps(r01, r23), _mm256_unpackhi_ps(r01, r23));
  }
  // t[0]: keys 0..3, t[1]: keys 4..7; lane 4b + i of the sum is key b + 2i; permuted to key order.
  static reg finish(const reg* t) {
    const __m256d a = _mm256_castps_pd(t[0]), b = _mm256_castps_pd(t[1]);
    const reg f =
        _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
};

}  // namespace

bool paged_decode_avx2_built() {
  return true;
}
void paged_decode_avx2(const PagedDecodeJob& job) {
  paged_decode_with<PagedAvx2>(job);
}

}  // namespace tessera::attn::cpu_detail

#else

namespace tessera::attn::cpu_detail {
// Built without AVX2/FMA/F16C: never selected (paged_decode_isa_available says so).
bool paged_decode_avx2_built() {
  return false;
}
void paged_decode_avx2(const PagedDecodeJob&) {}
}  // namespace tessera::attn::cpu_detail

#endif
