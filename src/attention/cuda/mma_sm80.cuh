// tessera/attention/cuda/mma_sm80.cuh — the warp-level building blocks of the mma.sync kernels (device code).
//
// cp.async (16-byte global -> shared copies, zero-filled when the source is absent), ldmatrix (8x8 b16 tiles
// from shared memory into the mma fragment layout, optionally transposed), mma.sync m16n8k16 with f32
// accumulation, and the swizzled shared-memory layout all tiles use. These run on sm_80 and later; the
// Hopper-only path (wgmma/TMA) will live beside them.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, c = lane % 4), each register holding two consecutive
// columns:
//   A (16x16, row-major): a0 (g, 2c), a1 (g+8, 2c), a2 (g, 2c+8), a3 (g+8, 2c+8)
//   B (16x8, k-major):    b0 (k=2c, n=g), b1 (k=2c+8, n=g)
//   C (16x8, f32):        c0,c1 (g, 2c..2c+1), c2,c3 (g+8, 2c..2c+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace tessera::attn::gpu::detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared; when `valid` is false nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
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

// d += a * b, one mma.sync m16n8k16 with f32 accumulators on inputs of PTX type TYPE ("bf16" or "f16"); the
// operands of MmaTraits<T>::mma (an asm template must be one string literal, hence a macro).
#define TESSERA_MMA_M16N8K16(TYPE)                                                      \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                   \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// The mma.sync m16n8k16 of a 16-bit input type T (__nv_bfloat16 or __half) and its conversions.
template <class T>
struct MmaTraits {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "mma inputs: bf16 or f16");
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;

  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    if constexpr (kBf16)
      TESSERA_MMA_M16N8K16("bf16");
    else
      TESSERA_MMA_M16N8K16("f16");
  }
  // Two floats to a packed pair; `lo` goes to the lower half (the smaller column).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    if constexpr (kBf16) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    }
  }
  __device__ __forceinline__ static float to_float(T x) {
    if constexpr (kBf16)
      return __bfloat162float(x);
    else
      return __half2float(x);
  }
};

#undef TESSERA_MMA_M16N8K16

// 2^x, approximate (ex2.approx: 2 ulp); 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe (no MUFU): x = j + f with j = round(x), f in [-0.5, 0.5]; 2^f by a degree-3 polynomial
// (relative error 1.0e-4, below bf16's and f16's rounding of P), 2^j added to its exponent with one integer
// multiply-add (the low bits of x + 1.5 * 2^23 hold j). x is clamped at -125, so -inf gives 2^-125 (about 2.4e-38),
// not 0: the softmax's masked scores contribute below any visible key's weight, and a row that sees no key is
// recognised by its running max (-inf), not by its sum (store_rows).
__device__ __forceinline__ float poly_exp2(float x) {
  x = fmaxf(x, -125.0f);
  const float t = x + 12582912.0f;  // 1.5 * 2^23: rounds x to an integer j in t's low mantissa bits
  const float f = x - (t - 12582912.0f);
  const float p = fmaf(fmaf(fmaf(0.05500893f, f, 0.242211f), f, 0.69328296f), f, 1.0f);
  return __uint_as_float(__float_as_uint(t) * (1u << 23) + __float_as_uint(p));
}

// Element offset of (row, 16-byte chunk) in a [rows][D] tile of 2-byte elements whose chunks are XOR-swizzled
// with the row (chunk ^ (row % 8)), so that ldmatrix's eight row addresses hit eight different bank groups.
template <int D>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// Lane constants for ldmatrix on swizzled [rows][D] tiles. The lane's physical chunk for logical chunk 2k + b
// is 8 * (k / 4) + ((2 * (k % 4)) ^ x) with x < 8 fixed per lane, so every address is a lane base plus one of
// four lane offsets plus a compile-time constant (which keeps the addresses out of the register file).
//   a_off: A operand (Q rows, row-major, lane row = lane % 16) and the transposed B operand (V rows)
//   b_off: B operand (K rows, lane row = lane % 8 + 8 * (lane / 16))
struct LaneSwizzle {
  uint32_t a_off[4];
  uint32_t b_off[4];
  __device__ __forceinline__ explicit LaneSwizzle(int lane) {
    const int xa = (lane >> 4) ^ (lane & 7);
    const int xb = ((lane >> 3) & 1) ^ (lane & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a_off[j] = static_cast<uint32_t>(((2 * j) ^ xa) * 16);
      b_off[j] = static_cast<uint32_t>(((2 * j) ^ xb) * 16);
    }
  }
  // Byte offsets of the lane's row within a tile (add the tile's shared address).
  template <int D>
  __device__ __forceinline__ static uint32_t a_row(int lane) {
    return (lane & 15) * (D * 2);
  }
  template <int D>
  __device__ __forceinline__ static uint32_t b_row(int lane) {
    return ((lane & 7) + ((lane >> 4) << 3)) * (D * 2);
  }
  template <int D>
  __device__ __forceinline__ static uint32_t v_row(int lane) {
    return ((lane & 7) + (((lane >> 3) & 1) << 3)) * (D * 2);
  }
};

// c0 += a * B0 and c1 += a * B1 for one warp, the two 16x8 B fragments loaded by one ldmatrix x4 from shared
// address `b_addr` (transposed: B stored [k][n], as V; else [n][k], as K).
template <typename T, bool kTrans>
__device__ __forceinline__ void mma_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                       uint32_t b_addr) {
  uint32_t b[4];
  if constexpr (kTrans)
    ldmatrix_x4_trans(b, b_addr);
  else
    ldmatrix_x4(b, b_addr);
  MmaTraits<T>::mma(c0, a, b[0], b[1]);
  MmaTraits<T>::mma(c1, a, b[2], b[3]);
}

// s[BN/8][4] += Q[16 rows] K[BN keys]^T for one warp. q_base: shared address of the warp's first Q row plus
// LaneSwizzle::a_row; k_base: shared address of the K tile plus LaneSwizzle::b_row. Rows are D elements.
template <typename T, int D, int BN>
__device__ __forceinline__ void warp_qk(float (&s)[BN / 8][4], uint32_t q_base, uint32_t k_base,
                                        const LaneSwizzle& sw) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, q_base + (kk / 4) * 128 + sw.a_off[kk % 4]);
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      mma_x2<T, false>(s[2 * np], s[2 * np + 1], a,
                       k_base + np * 16 * (D * 2) + (kk / 4) * 128 + sw.b_off[kk % 4]);
    }
  }
}

// o[D/8][4] += P[16 rows][BN keys] V[BN keys][D] for one warp, P given as the f32 accumulators of warp_qk
// (the accumulators of n-tiles 2k and 2k+1 are exactly the A fragment of k-chunk k). v_base: shared address
// of the V tile plus LaneSwizzle::v_row.
template <typename T, int D, int BN>
__device__ __forceinline__ void warp_pv(float (&o)[D / 8][4], const float (&p)[BN / 8][4], uint32_t v_base,
                                        const LaneSwizzle& sw) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[4];
    a[0] = MmaTraits<T>::pack(p[2 * kk][0], p[2 * kk][1]);
    a[1] = MmaTraits<T>::pack(p[2 * kk][2], p[2 * kk][3]);
    a[2] = MmaTraits<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = MmaTraits<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      mma_x2<T, true>(o[2 * dp], o[2 * dp + 1], a,
                      v_base + kk * 16 * (D * 2) + (dp / 4) * 128 + sw.a_off[dp % 4]);
    }
  }
}

// Copies rows [0, ROWS) of a [ROWS][D] tile into swizzled shared memory with cp.async, 16 bytes per thread
// per step; src(row) returns the row's global address or nullptr for a row to zero-fill. `fallback` is any
// valid global address (the source operand of a zero-filling copy, which reads nothing).
template <int D, int ROWS, int THREADS, class RowSrc>
__device__ __forceinline__ void cp_async_tile(void* dst, int tid, const void* fallback, RowSrc src) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % THREADS == 0);
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int row = i / kChunks, ch = i % kChunks;
    const void* g = src(row);
    const bool ok = g != nullptr;
    cp_async_16(smem_addr(static_cast<char*>(dst) + 2 * swizzle<D>(row, ch)),
                ok ? static_cast<const char*>(g) + 16 * ch : static_cast<const char*>(fallback), ok);
  }
}

}  // namespace tessera::attn::gpu::detail
