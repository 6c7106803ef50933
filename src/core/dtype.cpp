#include "core/dtype.h"

namespace tessera {

float f16_to_f32(f16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      out = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | mant << 13;
  } else {
    out = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return std::bit_cast<float>(out);
}

f16 f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16::from_bits(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return f16::from_bits(sign | 0x7c00u);  // overflow (incl. inf) after rounding
  if (abs < 0x38800000u) {                                        // subnormal or zero in f16
    if (abs < 0x33000000u) return f16::from_bits(sign);            // rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150) = m * 2^-24, so m = mant >> (126-exp)
    const uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    uint32_t r = half + ((rem > mid || (rem == mid && (half & 1))) ? 1 : 0);
    return f16::from_bits(static_cast<uint16_t>(sign | r));
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);  // round to nearest even at bit 13
  return f16::from_bits(static_cast<uint16_t>(sign | (r >> 13)));
}

}  // namespace tessera
