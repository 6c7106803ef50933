// The paged decode kernel for AVX-512 (compiled with -mavx512f/bw/vl/dq, src/CMakeLists.txt; paged_decode.cpp
// calls it only on a CPU that has them).
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers initialise their "undefined" operands from themselves (see flash_tile_avx512.cpp).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "attention/cpu/paged_decode.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__)

#include <immintrin.h>

#include "attention/cpu/paged_decode_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

struct PagedAvx512 {
  using reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;

  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }

  template <class E>
  static reg load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, ElemF32>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<E, ElemF16>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }

  // 2^x = 2^n * 2^f, n = round(x), |f| <= 1/2; lanes <= -125 (and -inf) give exactly 0.
  static reg exp2(reg x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GT_OQ);
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(live, paged_exp2_fraction<PagedAvx512>(_mm512_sub_ps(x, n)), n);
  }

  // 128-bit blocks: a's sums of blocks (0+2, 1+3), then b's.
  static reg pair(reg a, reg b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Block i: 4 partial sums of key i (r01's two keys, then r23's).
  static reg quad(reg r01, reg r23) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // t[q] holds keys 4q..4q+3 (one per block): lane 4b + i of the sum is key b + 4i; permuted to key order.
  static reg finish(const reg* t) {
    const reg u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
    const reg u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
    const __m512d a = _mm512_castps_pd(u0), b = _mm512_castps_pd(u1);
    const reg f =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
  }
};

}  // namespace

bool paged_decode_avx512_built() {
  return true;
}
void paged_decode_avx512(const PagedDecodeJob& job) {
  paged_decode_with<PagedAvx512>(job);
}

}  // namespace tessera::attn::cpu_detail

#else

namespace tessera::attn::cpu_detail {
// Built without AVX-512: never selected (paged_decode_isa_available says so).
bool paged_decode_avx512_built() {
  return false;
}
void paged_decode_avx512(const PagedDecodeJob&) {}
}  // namespace tessera::attn::cpu_detail

#endif
