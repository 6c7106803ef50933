// tessera/attention/cuda/mma_sm80.cuh — the warp-level building blocks of the mma.sync kernels (device code).
//
// cp.async (16-byte global -> shared copies, zero-filled when the source is absent), ldmatrix (8x8 b16 tiles from
// shared memory into the mma fragment layout, optionally transposed), mma.sync m16n8k16 with f32 accumulation,
// and the swizzled shared-memory layout all tiles use. These run on sm_80 and later; the Hopper-only path
// (wgmma/TMA) will live beside them.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, c = lane % 4), each register holding two consecutive columns:
//   A (16x16, row-major): a0 (g, 2c), a1 (g+8, 2c), a2 (g, 2c+8), a3 (g+8, 2c+8)
//   B (16x8, k-major):    b0 (k=2c, n=g), b1 (k=2c+8, n=g)
//   C (16x8, f32):        c0,c1 (g, 2c..2c+1), c2,c3 (g+8, 2c..2c+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tessera::attn::gpu::detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared; when `valid` is false nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <class T>
struct MmaTraits;

template <>
struct MmaTraits<__nv_bfloat16> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two floats to a packed pair; `lo` goes to the lower half (the smaller column).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

template <>
struct MmaTraits<__half> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
};

// 2^x, approximate (ex2.approx: 2 ulp); 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Element offset of (row, 16-byte chunk) in a [rows][D] tile of 2-byte elements whose chunks are XOR-swizzled
// with the row (chunk ^ (row % 8)), so that ldmatrix's eight row addresses hit eight different bank groups.
template <int D>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  return row * D + ((chunk ^ (row & 7)) << 3);
}

}  // namespace tessera::attn::gpu::detail
