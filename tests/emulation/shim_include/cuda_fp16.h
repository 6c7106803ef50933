// Stand-in for cuda_fp16.h (host emulation, ../shim.h): the storage type and the conversions the kernels use.
#pragma once

#include <cmath>
#include <cstdint>

struct __half {
  unsigned short b;
};
struct __half2 {
  __half x, y;
};
inline __half __ushort_as_half(unsigned short b) {
  return {b};
}
inline float __half2float(__half h) {
  const uint32_t s = (h.b >> 15) & 1, e = (h.b >> 10) & 31, m = h.b & 1023;
  float v;
  if (e == 0) {
    v = std::ldexp(float(m), -24);
  } else if (e == 31) {
    v = m ? NAN : INFINITY;
  } else {
    v = std::ldexp(float(m | 1024), int(e) - 25);
  }
  return s ? -v : v;
}
__half2 __floats2half2_rn(float, float);  // declared only: no emulated kernel packs
