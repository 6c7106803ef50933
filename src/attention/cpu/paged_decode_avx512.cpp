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
#include "attention/cpu/vector_ops.h"

namespace tessera::attn::cpu_detail {
namespace {

struct PagedAvx512 : Avx512Ops {
  static constexpr int kRegisters = 32;

  static reg loadf(const float* p) { return Avx512Ops::load(p); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }

  template <class E>
  static reg load(const typename E::T* p) {
    if constexpr (std::is_same_v<E, ElemF32>) {
      return Avx512Ops::load(p);
    } else if constexpr (std::is_same_v<E, ElemF16>) {
      return widen_f16(p);
    } else {
      return widen_bf16(p);
    }
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
