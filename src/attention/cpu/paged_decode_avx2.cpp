// The paged decode kernel for AVX2 + FMA + F16C (the build's baseline ISA on x86-64, x86-64-v3;
// paged_decode.cpp calls it only on a CPU that has them).
#include "attention/cpu/paged_decode.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include "attention/cpu/paged_decode_impl.h"
#include "attention/cpu/vector_ops.h"

namespace tessera::attn::cpu_detail {
namespace {

struct PagedAvx2 : Avx2Ops {
  static constexpr int kRegisters = 16;

  static reg loadf(const float* p) { return Avx2Ops::load(p); }
  static float reduce_max(reg x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  template <class E>
  static reg load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, ElemF32>) {
      return Avx2Ops::load(p);
    } else if constexpr (std::is_same_v<E, ElemF16>) {
      return widen_f16(p);
    } else {
      return widen_bf16(p);
    }
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
