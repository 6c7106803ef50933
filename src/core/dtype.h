// tessera/core/dtype.h — element types and scalar conversions.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace tessera {

enum class DType : uint8_t { F32, F16, BF16, I32 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
  }
  return "?";
}

// bfloat16: the upper 16 bits of an IEEE f32. Conversion from f32 rounds to nearest even; NaN stays NaN.
struct bf16 {
  uint16_t bits = 0;
  static bf16 from_bits(uint16_t b) { bf16 r; r.bits = b; return r; }
};

// IEEE binary16.
struct f16 {
  uint16_t bits = 0;
  static f16 from_bits(uint16_t b) { f16 r; r.bits = b; return r; }
};

inline float bf16_to_f32(bf16 h) { return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16); }

inline bf16 f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16::from_bits(static_cast<uint16_t>((u >> 16) | 0x40));  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16::from_bits(static_cast<uint16_t>(u >> 16));
}

float f16_to_f32(f16 h);
f16 f32_to_f16(float f);

}  // namespace tessera
