#include "runtime/cuda/fp8_gemv.h"

#include <cuda_bf16.h>

#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

namespace {

using attn::gpu::check_launch;
using nbf = __nv_bfloat16;

constexpr int kRows = 2;    // output channels a block computes
constexpr int kWarps = 4;   // warps of a block: each takes every kWarps-th run of 32 chunks of the rows
constexpr int kUnroll = 4;  // 16-byte chunks of each weight row a lane has in flight

// 16 E4M3 codes (one uint4) to floats scaled by 2^-120, exactly, with integer operations only (the hardware's
// E4M3 -> f16 conversion and then f16 -> f32 bound the product at ~1.5x its bytes' time): a code's sign and seven
// magnitude bits placed at f32 bits 31 and 26..20 read as 2^(e - 127) * 1.m (e >= 1) or 2^-126 * 0.m / 8 (e = 0),
// i.e. the E4M3 value 2^(e - 7) * 1.m or 2^-6 * 0.m / 8 times 2^-120; the caller multiplies the sum by kUnbias.
// Sums of ~2^-110-sized terms keep f32's precision: the smallest codes' products fall to f32 denormals (exact FMA
// on the GPU: no flush, no fast math), whose absolute error (2^-149) is far below any sum's.
constexpr float kUnbias = 0x1p120f;
__device__ __forceinline__ float code_to_float(uint32_t word, int byte) {
  const int top = static_cast<int>(word << (24 - 8 * byte));  // the code in bits 31..24
  return __int_as_float((top >> 4) & static_cast<int>(0x87F00000u));
}
__device__ __forceinline__ void codes_to_float(const uint4& raw, float (&f)[16]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int b = 0; b < 4; ++b) f[4 * i + b] = code_to_float(words[i], b);
}

// 16 bf16 activations (two uint4) to floats.
__device__ __forceinline__ void act_to_float(const uint4& a, const uint4& b, float (&f)[16]) {
  const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

template <int M>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_w8a16_kernel(const nbf* x, int64_t ldx, const uint8_t* w, const float* scale, bool per_row, int64_t out,
                      int64_t in, void* y, bool y_f32, int64_t ldy, float beta) {
  __shared__ float red[kWarps][kRows][M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kRows;
  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  const int64_t chunks = in / 16;
  const uint4* wrow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) wrow[r] = reinterpret_cast<const uint4*>(w + (o0 + r < out ? o0 + r : o0) * in);
  constexpr int kStride = kWarps * 32;
  for (int64_t k0 = warp * 32 + lane; k0 < chunks; k0 += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t k = k0 + u * kStride;
        wv[u][r] = k < chunks ? __ldcs(wrow[r] + k) : make_uint4(0, 0, 0, 0);  // read once: do not keep in L1
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + u * kStride;
      if (k >= chunks) break;
      float wf[kRows][16];
#pragma unroll
      for (int r = 0; r < kRows; ++r) codes_to_float(wv[u][r], wf[r]);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + i * ldx) + 2 * k;
        float xf[16];
        act_to_float(__ldg(xr), __ldg(xr + 1), xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < 16; ++j) acc[r][i] = fmaf(wf[r][j], xf[j], acc[r][i]);
      }
    }
  }
  // The lanes' sums by shuffles, then the warps' in a fixed order: the same for every row count.
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], s);
      if (lane == 0) red[warp][r][i] = acc[r][i];
    }
  __syncthreads();
  if (threadIdx.x >= kRows * M) return;
  const int r = threadIdx.x / M, i = threadIdx.x % M;
  const int64_t o = o0 + r;
  if (o >= out) return;
  float sum = 0.0f;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) sum += red[v][r][i];
  // Rounded operations, not left to contraction: its choices may differ between instantiations (row counts).
  const float val = __fmul_rn(scale[per_row ? o : 0], __fmul_rn(sum, kUnbias));
  if (y_f32) {
    float* yo = static_cast<float*>(y) + i * ldy + o;
    *yo = beta == 0.0f ? val : __fadd_rn(val, __fmul_rn(beta, *yo));
  } else {
    static_cast<nbf*>(y)[i * ldy + o] = __float2bfloat16_rn(val);
  }
}

template <int M>
void launch(const bf16* x, int64_t ldx, const Fp8Matrix& w, void* y, bool y_f32, int64_t ldy, float beta,
            cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((w.rows + kRows - 1) / kRows);
  gemv_w8a16_kernel<M><<<blocks, kWarps * 32, 0, stream>>>(reinterpret_cast<const nbf*>(x), ldx, w.data, w.scale,
                                                           w.scaling == Fp8Scaling::kRow, w.rows, w.cols, y, y_f32,
                                                           ldy, beta);
}

}  // namespace

void gemv_w8a16(const bf16* x, int64_t ldx, int64_t m, const Fp8Matrix& w, void* y, bool y_f32, int64_t ldy,
                float beta, cudaStream_t stream) {
  if (m <= 0 || w.rows <= 0) return;
  check(m <= kW8Rows, "gemv_w8a16: at most " + std::to_string(kW8Rows) + " rows, got " + std::to_string(m));
  check(w.cols % 16 == 0 && ldx % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(w.data) % 16 == 0,
        "gemv_w8a16: in (" + std::to_string(w.cols) + ") and ldx (" + std::to_string(ldx) +
            ") must be multiples of 16 and x, w 16-byte aligned");
  check(y_f32 || beta == 0.0f, "gemv_w8a16: beta needs an f32 y");
  check(ldy >= w.rows, "gemv_w8a16: ldy below the output width");
  switch (m) {
    case 1: launch<1>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 2: launch<2>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 3: launch<3>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 4: launch<4>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 5: launch<5>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 6: launch<6>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 7: launch<7>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    default: launch<8>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
  }
  check_launch("gemv_w8a16");
}

}  // namespace tessera::runtime::gpu
