// Stand-in for cuda_bf16.h (host emulation, ../shim.h): the storage type and the conversions the kernels use.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  unsigned short b;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) {
  return {b};
}
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
__nv_bfloat162 __floats2bfloat162_rn(float, float);  // declared only: no emulated kernel packs
