// Emulation of what the VS score kernels use beyond ../bs_emulation/shim.h and vs_shim.h (sums_run.sh): dynamic
// shared memory as one arena with 32-bit offsets as shared addresses, cp.async as a copy, ldmatrix.x4 (each
// lane's address exchanged through a per-warp buffer) and mma.m16n8k16 bf16 -> f32 by the fragment layout of
// mma_sm80.cuh (products summed in double, added to the accumulator once: fixed, not the hardware's rounding).
#pragma once
#include "vs_shim.h"

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float2 make_float2(float x, float y) { return {x, y}; }

namespace vsemu::detail {
inline unsigned char* arena() {
  alignas(128) static unsigned char a[256 * 1024];
  return a;
}
inline uint32_t smem_addr(const void* p) { return uint32_t(static_cast<const unsigned char*>(p) - arena()); }
inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
  if (valid) std::memcpy(arena() + dst, src, 16);
  else std::memset(arena() + dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

struct WarpBuf { uint32_t v[32][6]; };
inline WarpBuf& wbuf() {
  static WarpBuf b[32];
  return b[emu::cur()->warp];
}
inline void warp_sync() { emu::barrier(emu::warps()[size_t(emu::cur()->warp)]); }

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  const int l = emu::cur()->lane;
  wbuf().v[l][0] = addr;
  warp_sync();
  uint32_t x[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&x[j], arena() + wbuf().v[8 * j + l / 4][0] + 4 * (l % 4), 4);
  warp_sync();
  for (int j = 0; j < 4; ++j) r[j] = x[j];
}

inline float bf16_half(uint32_t reg, int hi) { uint32_t u = (hi ? reg >> 16 : reg & 0xffffu) << 16; float f; std::memcpy(&f, &u, 4); return f; }

template <class T>
struct MmaTraits;
template <>
struct MmaTraits<__nv_bfloat16> {
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const int l = emu::cur()->lane;
    uint32_t* mine = wbuf().v[l];
    mine[0] = a[0], mine[1] = a[1], mine[2] = a[2], mine[3] = a[3], mine[4] = b0, mine[5] = b1;
    warp_sync();
    const int g = l / 4, c = l % 4;
    float out[4];
    for (int idx = 0; idx < 4; ++idx) {
      const int row = g + 8 * (idx / 2), col = 2 * c + idx % 2;
      double s = 0;
      for (int k = 0; k < 16; ++k) {
        const uint32_t ar = wbuf().v[4 * (row % 8) + (k % 8) / 2][(row < 8 ? 0 : 1) + (k < 8 ? 0 : 2)];
        const uint32_t br = wbuf().v[4 * col + (k % 8) / 2][k < 8 ? 4 : 5];
        s += double(bf16_half(ar, k % 2)) * double(bf16_half(br, k % 2));
      }
      out[idx] = float(double(d[idx]) + s);
    }
    warp_sync();
    for (int idx = 0; idx < 4; ++idx) d[idx] = out[idx];
  }
};
}  // namespace vsemu::detail
