// core/fp8.h: the host E4M3 encoder and decoder (the twin of the device conversion the FP8 GEMMs use) against
// all 256 codes, round-to-nearest-even at every midpoint, saturation, and the per-tensor scale convention.
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

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

}  // namespace
}  // namespace tessera
