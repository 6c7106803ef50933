// Stand-in for attention/cuda/mma_sm80.cuh (host emulation, ../../../shim.h): the real header, next on the
// include path, is compiled with its PTX functions renamed (ptx_*: never called, so never emitted), and
// emulations take their names: cp.async as a copy into the dynamic shared memory, ldmatrix.x4 (each lane's
// address exchanged through a per-warp buffer) and mma.m16n8k16 (16-bit inputs, f32 accumulation) by the
// fragment layout the real header documents (products summed in double, added to the accumulator once: fixed,
// not the hardware's rounding), ex2.approx.ftz as exp2f with subnormal results flushed. Everything else
// (smem_addr, swizzle, LaneSwizzle, cp_async_tile, ...) is the real header's code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "shim.h"

namespace tessera::attn::gpu::detail {
// cp_async_tile (real) calls cp_async_16, renamed below with the definition: this template, exact on its
// typed source pointer, wins over the real (const void*) overload and makes the copy.
template <class P>
inline void ptx_cp_async_16(uint32_t dst, const P* src, bool valid) {
  if (valid) {
    std::memcpy(emu::dynamic_smem() + dst, src, 16);
  } else {
    std::memset(emu::dynamic_smem() + dst, 0, 16);
  }
}
}  // namespace tessera::attn::gpu::detail

#define cp_async_16 ptx_cp_async_16
#define cp_async_commit ptx_cp_async_commit
#define cp_async_wait ptx_cp_async_wait
#define ldmatrix_x4 ptx_ldmatrix_x4
#define ldmatrix_x4_trans ptx_ldmatrix_x4_trans
#define MmaTraits PtxMmaTraits
#define fast_exp2 ptx_fast_exp2
#include_next <attention/cuda/mma_sm80.cuh>
#undef cp_async_16
#undef cp_async_commit
#undef cp_async_wait
#undef ldmatrix_x4
#undef ldmatrix_x4_trans
#undef MmaTraits
#undef fast_exp2

namespace tessera::attn::gpu::detail {

inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
  if (valid) {
    std::memcpy(emu::dynamic_smem() + dst, src, 16);
  } else {
    std::memset(emu::dynamic_smem() + dst, 0, 16);
  }
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

namespace emu_mma {
struct WarpBuf {
  uint32_t v[32][6];
};
inline WarpBuf& wbuf() {
  static WarpBuf b[32];
  return b[emu::cur()->warp];
}
inline void warp_sync() {
  emu::barrier(emu::warps()[size_t(emu::cur()->warp)]);
}
inline float half_of(uint32_t reg, int hi, bool bf16) {
  const auto bits = static_cast<unsigned short>(hi ? reg >> 16 : reg & 0xffffu);
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}
// d[4] += A (16x16) B (16x8) of the warp's fragments (mma_sm80.cuh's layout).
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
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
      s += double(half_of(ar, k % 2, bf16)) * double(half_of(br, k % 2, bf16));
    }
    out[idx] = float(double(d[idx]) + s);
  }
  warp_sync();
  for (int idx = 0; idx < 4; ++idx) d[idx] = out[idx];
}
}  // namespace emu_mma

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  const int l = emu::cur()->lane;
  emu_mma::wbuf().v[l][0] = addr;
  emu_mma::warp_sync();
  uint32_t x[4];
  for (int j = 0; j < 4; ++j)
    std::memcpy(&x[j], emu::dynamic_smem() + emu_mma::wbuf().v[8 * j + l / 4][0] + 4 * (l % 4), 4);
  emu_mma::warp_sync();
  for (int j = 0; j < 4; ++j) r[j] = x[j];
}

template <class T>
struct MmaTraits;
template <>
struct MmaTraits<__nv_bfloat16> {
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma::mma(d, a, b0, b1, true);
  }
};
template <>
struct MmaTraits<__half> {
  static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma::mma(d, a, b0, b1, false);
  }
};

inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

}  // namespace tessera::attn::gpu::detail
