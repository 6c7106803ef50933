// tessera/core/simd_x86.h — the x86 vector steps that the CPU kernels of several parts share (the stored-weight
// products, model/qmatmul_avx*.cpp; the attention tiles, attention/cpu/flash_tile_*.cpp), written once. Include it
// only from translation units compiled for AVX2 and F16C or more (the kernels' files; called only when CPUID
// reports those instructions).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tessera::x86 {
// Internal linkage: each kernel file is compiled with its own instruction-set flags, and an inline function with
// external linkage would leave one out-of-line copy for the linker to pick (say, the AVX-512 file's, called on an
// AVX2-only CPU).
namespace {

// The sum of the 8 lanes, in a fixed order (the high half onto the low, then pairs), so every kernel that reduces
// with it rounds alike.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The IEEE half at p (2 bytes, any alignment) as a float.
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

}  // namespace
}  // namespace tessera::x86
