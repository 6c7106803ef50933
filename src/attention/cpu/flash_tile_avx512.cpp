// The query-tile kernel for AVX-512 (this file is compiled with -mavx512f/bw/vl/dq; callers check the CPU).
// GCC 12's AVX-512 intrinsic headers initialise their "undefined" operands from themselves and then warn
// about it (-Wuninitialized) once inlined; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "attention/cpu/flash_tile.h"

#if defined(__AVX512F__) && defined(__FMA__)

#include <immintrin.h>

#include "attention/cpu/flash_tile_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

// 64 query rows = 4 zmm. QK^T: 6 keys x 64 rows = 24 accumulators; PV: 6 dims x 64 rows = 24 accumulators.
struct Avx512 {
  using reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRowVecs = 4;
  static constexpr int kQkKeys = 6;
  static constexpr int kPvDims = 6;

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
  // 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2; 2^f by exp2_fraction (flash_tile_impl.h), 2^n by scalef.
  // Inputs <= -125 (including -inf, whose lanes go NaN on the way) give exactly 0, so no denormal is ever
  // produced.
  static reg exp2(reg x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GT_OQ);
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg p = exp2_fraction<Avx512>(_mm512_sub_ps(x, n));
    return _mm512_maskz_scalef_ps(live, p, n);
  }
  static reg widen_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg widen_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

}  // namespace
}  // namespace tessera::attn::cpu_detail

namespace tessera::attn::cpu_detail {

void run_tile_avx512(const TileJob& job, float* scratch) {
  run_tile_flushing_denormals<Avx512>(job, scratch);
}

}  // namespace tessera::attn::cpu_detail

#else

namespace tessera::attn::cpu_detail {
// Built without AVX-512 support: never selected (see kernel_isa.cpp), kept so the symbol exists.
void run_tile_avx512(const TileJob& job, float* scratch) {
  run_tile_baseline(job, scratch);
}
}  // namespace tessera::attn::cpu_detail

#endif
