// core/fp8.h: the host E4M3 encoder and decoder (the twin of the device conversion the FP8 GEMMs use) against
// all 256 codes, round-to-nearest-even at every midpoint, saturation, the scale convention, and e4m3_quantize (the
// host reference of the device quantization) per tensor and per row.
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tessera {
namespace {

// The value of a code from its definition, written independently of e4m3_to_float: (-1)^s 2^(e-7) (1 + m/8), or
// 2^-6 m/8 for e = 0.
double reference_value(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::pow(2.0, -6) * m / 8.0 : std::pow(2.0, e - 7) * (1.0 + m / 8.0);
  return s ? -mag : mag;
}

TEST(Fp8E4M3, AllCodesDecodeAndRoundTrip) {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << code;
      EXPECT_EQ(float_to_e4m3(v) & 0x7F, 0x7F) << code;  // NaN stays NaN
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), reference_value(code)) << code;
    EXPECT_EQ(float_to_e4m3(v), code) << "code " << code << " value " << v;  // -0 (0x80) included
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8E4M3, MidpointsRoundToEvenAndNeighboursToNearest) {
  // Between consecutive non-negative finite codes c and c + 1: the midpoint goes to the even code, a value just
  // below it to c, just above to c + 1 (every midpoint and its f32 neighbours are exact in f32).
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_to_float(static_cast<uint8_t>(c)), hi = e4m3_to_float(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2) << c;
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(float_to_e4m3(mid), even) << "midpoint after code " << c;
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | even) << "negative midpoint after code " << c;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 1000.0f)), c + 1) << c;
  }
}

TEST(Fp8E4M3, SaturatesNeverOverflows) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);  // would round to 480 (a NaN code) without saturation
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the smallest subnormal: ties to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -10)), 0x01);   // above the midpoint
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // 1.5 subnormal steps: ties to even (2)
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
}

TEST(Fp8E4M3, ScaleConvention) {
  EXPECT_EQ(e4m3_scale(0.0f), 1.0f);
  EXPECT_EQ(e4m3_inverse_scale(0.0f), 1.0f);
  EXPECT_EQ(e4m3_scale(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(e4m3_scale(896.0f), 2.0f);
  EXPECT_EQ(e4m3_inverse_scale(896.0f), 0.5f);
  // The largest magnitude maps to 448 exactly or within one rounding of the inverse, never beyond it.
  for (float amax : {0.02f, 0.1234f, 3.0f, 17.5f, 240.0f, 1e4f}) {
    const float inv = e4m3_inverse_scale(amax);
    EXPECT_EQ(float_to_e4m3(amax * inv), 0x7E) << amax;
    EXPECT_EQ(float_to_e4m3(-amax * inv), 0xFE) << amax;
    // Round trip: the dequantized value is within half an E4M3 step (relative 2^-4) of the original.
    for (float x : {amax, amax * 0.37f, amax * 0.001f}) {
      const float back = e4m3_to_float(float_to_e4m3(x * inv)) * e4m3_scale(amax);
      EXPECT_LE(std::fabs(back - x), std::fabs(x) * 0.0625f + e4m3_scale(amax) * std::ldexp(1.0f, -10)) << x;
    }
  }
}

// e4m3_quantize per row: each row's scale from its own amax (NaN skipped; zero or inf: 1), its largest magnitude at
// code 0x7E, its codes those of float_to_e4m3(x * inverse); per tensor: one scale from the global amax, and the same
// codes as per row where the matrix is one row; strided input rows.
TEST(Fp8Quantize, PerRowAndPerTensorScales) {
  const int64_t rows = 5, cols = 24, ld = 32;
  std::vector<float> x(static_cast<size_t>(rows * ld), 12345.0f);  // the gap between rows is never read
  const float mags[rows] = {0.003f, 1.0f, 250.0f, 0.0f, 7.0f};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[static_cast<size_t>(r * ld + c)] = mags[r] * std::sin(0.7f * static_cast<float>(c + 3 * r) + 0.1f);
  x[static_cast<size_t>(4 * ld + 5)] = std::nanf("");
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  std::vector<float> scales(rows, -1.0f);
  e4m3_quantize(x.data(), ld, rows, cols, Fp8Scaling::kRow, q.data(), scales.data());
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x[static_cast<size_t>(r * ld + c)];
      if (!std::isnan(v)) amax = std::max(amax, std::fabs(v));
    }
    EXPECT_EQ(scales[static_cast<size_t>(r)], e4m3_scale(amax)) << r;
    const float inv = e4m3_inverse_scale(amax);
    int at_max = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code = q[static_cast<size_t>(r * cols + c)];
      EXPECT_EQ(code, float_to_e4m3(x[static_cast<size_t>(r * ld + c)] * inv)) << r << ", " << c;
      at_max += (code & 0x7F) == 0x7E;
    }
    if (amax > 0) {
      EXPECT_GE(at_max, 1) << "row " << r << ": its largest magnitude maps to 448";
    }
  }
  EXPECT_EQ(scales[3], 1.0f);  // the zero row
  EXPECT_EQ(q[static_cast<size_t>(4 * cols + 5)] & 0x7F, 0x7F);  // NaN stays NaN
  std::vector<uint8_t> qt(q.size());
  float tensor_scale = -1;
  e4m3_quantize(x.data(), ld, rows, cols, Fp8Scaling::kTensor, qt.data(), &tensor_scale);
  EXPECT_EQ(tensor_scale, scales[2]);  // the largest row holds the global amax
  EXPECT_EQ(std::vector<uint8_t>(qt.begin() + 2 * cols, qt.begin() + 3 * cols),
            std::vector<uint8_t>(q.begin() + 2 * cols, q.begin() + 3 * cols));
  // Infinity: the row's scale is 1 and its values saturate.
  std::vector<float> inf_row = {1.0f, -std::numeric_limits<float>::infinity(), 1000.0f, 0.5f};
  std::vector<uint8_t> qi(4);
  float si = 0;
  e4m3_quantize(inf_row.data(), 4, 1, 4, Fp8Scaling::kRow, qi.data(), &si);
  EXPECT_EQ(si, 1.0f);
  EXPECT_EQ(qi, (std::vector<uint8_t>{float_to_e4m3(1.0f), 0xFE, 0x7E, float_to_e4m3(0.5f)}));
}

// What per-row scales are for: a row 10^5 times smaller than the tensor's amax falls into E4M3's subnormals per
// tensor (0.001 * 448 / 100 = 0.0045, steps of 2^-9: relative error up to ~1/4), but keeps 3 mantissa bits per row
// (relative error <= 2^-4 per element).
TEST(Fp8Quantize, PerRowKeepsSmallRowsPrecise) {
  const int64_t rows = 2, cols = 64;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t c = 0; c < cols; ++c) {
    x[static_cast<size_t>(c)] = 0.001f * (1.0f + 0.01f * static_cast<float>(c));              // small row
    x[static_cast<size_t>(cols + c)] = 100.0f * std::cos(0.3f * static_cast<float>(c));  // large row
  }
  auto worst_small_row_error = [&](Fp8Scaling scaling) {
    std::vector<uint8_t> q(x.size());
    std::vector<float> s(rows);
    e4m3_quantize(x.data(), cols, rows, cols, scaling, q.data(), s.data());
    double worst = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double back = static_cast<double>(e4m3_to_float(q[static_cast<size_t>(c)])) * s[0];
      worst = std::max(worst, std::fabs(back - x[static_cast<size_t>(c)]) / x[static_cast<size_t>(c)]);
    }
    return worst;
  };
  const double per_row = worst_small_row_error(Fp8Scaling::kRow), per_tensor = worst_small_row_error(Fp8Scaling::kTensor);
  EXPECT_LE(per_row, 0.0625);
  EXPECT_GT(per_tensor, 0.1);
}

}  // namespace
}  // namespace tessera
