// tessera/core/fp8.h — FP8 E4M3 (OCP "E4M3FN", as Hopper's tensor cores read it) on the host: the obvious twin of
// the device conversion (cvt.rn.satfinite.e4m3x2.f32) that runtime/cuda/fp8_quant.cu uses, and the scale
// convention both sides share.
//
// E4M3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7F / 0xFF are NaN; the largest
// finite magnitude is 448 (0x7E), the smallest subnormal 2^-9. Encoding rounds to nearest, ties to even, and
// saturates: every finite value (and +-inf) beyond +-448 becomes +-448, never NaN; NaN stays NaN.
//
// Quantization of a tensor with one scale (per tensor): amax = max |x| over the tensor;
//   scale = amax / 448,  inv = 448 / amax    (amax 0, NaN or inf: scale = inv = 1)
//   q = e4m3(x * inv)                         (one f32 multiply, then the rounding above)
// and the product of two quantized tensors is scale_a * scale_b * (q_a . q_b). The device computes the same f32
// operations (IEEE division and multiply), so its codes equal these bit for bit.
//
// Per row (Fp8Scaling::kRow, the FP8 GEMMs' default): the same with amax taken over each row alone, one scale per
// row. For a weight [out, in] that is a scale per output channel, for an activation [m, in] one per token, and the
// product is y[r, o] = scale_x[r] * scale_w[o] * (q_x[r] . q_w[o]): a row of small values (a token far from the
// tensor's outliers, an output channel of small weights) keeps E4M3's 3 mantissa bits instead of sliding into its
// subnormals. e4m3_quantize below is the host reference of both granularities.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tessera {

inline constexpr float kE4M3Max = 448.0f;

// The value of an E4M3 code (NaN for 0x7F and 0xFF).
inline float e4m3_to_float(uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  float v;
  if (exponent == 0xF && mantissa == 0x7)
    v = std::nanf("");
  else if (exponent == 0)
    v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m / 8 * 2^-6
  else
    v = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1 + m / 8) * 2^(e - 7)
  return negative ? -v : v;
}

// The nearest E4M3 code to f (ties to the even mantissa), saturating at +-448.
inline uint8_t float_to_e4m3(float f) {
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7F);
  const float a = std::fabs(f);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7E);
  if (a < 0x1p-6f) {
    // Subnormals step by 2^-9: a * 512 is exact; the code is the rounded count (8 rolls into the first normal, 0x08).
    const float m = std::nearbyint(a * 512.0f);  // the default rounding mode: nearest, ties to even
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(m));
  }
  int e = 0;
  (void)std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5, 1): a in [2^(e-1), 2^e)
  const int exponent = e - 1;                                        // -6 .. 8
  const float q = std::nearbyint(std::ldexp(a, 3 - exponent));      // [8, 16], exact scaling then one rounding
  const int code = ((exponent + 7) << 3) + (static_cast<int>(q) - 8);  // q = 16 carries into the next exponent
  return static_cast<uint8_t>(sign | code);
}

// The per-tensor scale of a tensor whose largest magnitude is amax, and its inverse (see above).
inline float e4m3_scale(float amax) { return amax > 0.0f && std::isfinite(amax) ? amax / kE4M3Max : 1.0f; }
inline float e4m3_inverse_scale(float amax) { return amax > 0.0f && std::isfinite(amax) ? kE4M3Max / amax : 1.0f; }

// The granularity of FP8 scales: one per matrix, or one per row.
enum class Fp8Scaling {
  kTensor,  // one scale: amax over the whole matrix
  kRow,     // one scale per row: per output channel of a weight [out, in], per token of an activation [m, in]
};

// Quantizes x [rows, cols] (rows ldx apart) into q [rows, cols] (contiguous, row-major): kTensor writes one scale
// (scales[0]), kRow one per row (scales[r]). amax skips NaN (the device's fmaxf does); inf gives scale 1.
inline void e4m3_quantize(const float* x, int64_t ldx, int64_t rows, int64_t cols, Fp8Scaling scaling, uint8_t* q,
                          float* scales) {
  auto amax_of = [&](int64_t r0, int64_t r1) {
    float a = 0.0f;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = std::fabs(x[r * ldx + c]);
        if (v > a) a = v;  // false for NaN
      }
    return a;
  };
  auto encode = [&](int64_t r0, int64_t r1, float amax) {
    const float inv = e4m3_inverse_scale(amax);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = float_to_e4m3(x[r * ldx + c] * inv);
  };
  if (scaling == Fp8Scaling::kTensor) {
    const float amax = amax_of(0, rows);
    scales[0] = e4m3_scale(amax);
    encode(0, rows, amax);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float amax = amax_of(r, r + 1);
    scales[r] = e4m3_scale(amax);
    encode(r, r + 1, amax);
  }
}

}  // namespace tessera
