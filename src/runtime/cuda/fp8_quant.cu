#include "runtime/cuda/fp8_quant.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_check.h"
#include "core/error.h"
#include "runtime/cuda/fp8_codes.cuh"

namespace tessera::runtime::gpu {

namespace {

constexpr int kThreads = 256;
using fp8::encode8;
using fp8::row_inverse_scale;

// 8 bf16 of row r, columns [8c, 8c + 8).
__device__ inline uint4 load8(const __nv_bfloat16* x, int64_t ldx, int64_t groups_per_row, int64_t g) {
  const int64_t r = g / groups_per_row, c = g - r * groups_per_row;
  return *reinterpret_cast<const uint4*>(x + r * ldx + c * 8);
}

__device__ inline void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__global__ void amax_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t groups_per_row, int64_t groups,
                            float* __restrict__ amax) {
  float a = 0.0f;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float f[8];
    unpack8(load8(x, ldx, groups_per_row, g), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(f[i]));  // fmaxf drops NaN
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) a = fmaxf(a, warp_max[w]);
    // Non-negative floats order as their bit patterns: an unsigned atomic max is the float max.
    atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(a));
  }
}

__global__ void quantize_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t groups_per_row,
                                int64_t groups, const float* __restrict__ amax_p, uint8_t* __restrict__ q,
                                float* __restrict__ scale_out) {
  const float inv = row_inverse_scale(*amax_p, blockIdx.x == 0 && threadIdx.x == 0 ? scale_out : nullptr);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float f[8];
    unpack8(load8(x, ldx, groups_per_row, g), f);
    *reinterpret_cast<uint2*>(q + g * 8) = encode8(f, inv);  // q is contiguous: group g is bytes [8g, 8g + 8)
  }
}

// A row's pieces, shared by the warp-per-row and CTA-per-row kernels: the amax of the groups first, first + stride,
// ... (a part of it: the caller reduces the parts), and the codes of the same groups with the row's inverse scale.
__device__ __forceinline__ float row_amax_part(const __nv_bfloat16* __restrict__ xr, int64_t groups_per_row,
                                               int64_t first, int64_t stride) {
  float a = 0.0f;
#pragma unroll 4
  for (int64_t g = first; g < groups_per_row; g += stride) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(xr + g * 8), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(f[i]));  // fmaxf drops NaN
  }
  return a;
}

__device__ __forceinline__ void encode_row_part(const __nv_bfloat16* __restrict__ xr, int64_t groups_per_row,
                                                uint8_t* __restrict__ qr, float inv, int64_t first, int64_t stride) {
#pragma unroll 4
  for (int64_t g = first; g < groups_per_row; g += stride) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(xr + g * 8), f);
    *reinterpret_cast<uint2*>(qr + g * 8) = encode8(f, inv);
  }
}

// A warp per row: the row's amax (shuffle reduction, every lane gets it), its scale, then its codes. The second pass
// reads the row again (8-28 KB for the model's widths: L1 or L2 hits).
constexpr int kRowsPerBlock = kThreads / 32;
__device__ __forceinline__ void quantize_row(const __nv_bfloat16* __restrict__ xr, int64_t groups_per_row,
                                             uint8_t* __restrict__ qr, float* __restrict__ scale, int lane) {
  float a = row_amax_part(xr, groups_per_row, lane, 32);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const float inv = row_inverse_scale(a, lane == 0 ? scale : nullptr);
  encode_row_part(xr, groups_per_row, qr, inv, lane, 32);
}

__global__ void quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx, int64_t m, int64_t groups_per_row,
                                     uint8_t* __restrict__ q, float* __restrict__ scales) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= m) return;
  quantize_row(x + r * ldx, groups_per_row, q + r * groups_per_row * 8, scales + r, static_cast<int>(threadIdx.x & 31));
}

// A CTA per row, for wide rows (activations of 2,048 values and more): a warp per row left 1,024 rows of 4,096 in
// 128 CTAs of 16 loads a lane (10.1 us on the H200 for what its bandwidth moves in ~3). The amax (a maximum: the same
// value in any order) through the warps' shuffles and shared memory, then the codes as quantize_row writes them.
constexpr int kWideGroups = 256;  // groups of 8 a row from which a row takes a CTA
__global__ void __launch_bounds__(kThreads) quantize_wide_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                                                      int64_t groups_per_row, uint8_t* __restrict__ q,
                                                                      float* __restrict__ scales) {
  const int64_t r = blockIdx.x;
  const __nv_bfloat16* xr = x + r * ldx;
  float a = row_amax_part(xr, groups_per_row, threadIdx.x, kThreads);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = a;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) a = fmaxf(a, warp_max[w]);
  const float inv = row_inverse_scale(a, threadIdx.x == 0 ? scales + r : nullptr);
  encode_row_part(xr, groups_per_row, q + r * groups_per_row * 8, inv, threadIdx.x, kThreads);
}

// Job blockIdx.y of `jobs`, rows as quantize_rows_kernel.
__global__ void quantize_rows_batch_kernel(Fp8RowJobs jobs, int64_t ldx, int64_t m, int64_t groups_per_row) {
  const int j = static_cast<int>(blockIdx.y);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= m) return;
  quantize_row(reinterpret_cast<const __nv_bfloat16*>(jobs.x[j]) + r * ldx, groups_per_row,
               jobs.q[j] + r * groups_per_row * 8, jobs.scales[j] + r, static_cast<int>(threadIdx.x & 31));
}

// y = sx[r] sw[o] d + beta y, grid-stride over the m * out elements (the fallback path only).
template <typename Y>
__global__ void scale_outer_kernel(const float* __restrict__ d, int64_t m, int64_t out, const float* __restrict__ sx,
                                   const float* __restrict__ sw, Y* __restrict__ y, int64_t ldy, float beta) {
  const int64_t n = m * out;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out, o = i - r * out;
    float v = sx[r] * sw[o] * d[i];
    Y& dst = y[r * ldy + o];
    if (beta != 0.0f) v += beta * static_cast<float>(dst);
    dst = static_cast<Y>(v);
  }
}

int grid_for(int64_t groups) {
  static int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 132;
    }
    return n;
  }();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((groups + kThreads - 1) / kThreads, int64_t{sms} * 4)));
}

}  // namespace

void quantize_e4m3(const bf16* x, int64_t ldx, int64_t m, int64_t in, uint8_t* q, float* work, cudaStream_t stream) {
  if (m <= 0 || in <= 0) return;
  check(in % 8 == 0 && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(work) % 16 == 0,
        "FP8 quantization of [" + std::to_string(m) + " x " + std::to_string(in) + "] (rows " + std::to_string(ldx) +
            " apart): needs 16-byte aligned rows of a multiple of 8 elements");
  const int64_t groups_per_row = in / 8, groups = m * groups_per_row;
  const int grid = grid_for(groups);
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(work, 0, sizeof(float), stream));
  amax_kernel<<<grid, kThreads, 0, stream>>>(xb, ldx, groups_per_row, groups, work);
  TESSERA_CUDA_CHECK(cudaGetLastError());
  quantize_kernel<<<grid, kThreads, 0, stream>>>(xb, ldx, groups_per_row, groups, work, q, work + kFp8ScaleOffset);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void quantize_e4m3_rows(const bf16* x, int64_t ldx, int64_t m, int64_t in, uint8_t* q, float* scales,
                        cudaStream_t stream) {
  if (m <= 0 || in <= 0) return;
  check(in % 8 == 0 && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(scales) % 16 == 0,
        "FP8 per-row quantization of [" + std::to_string(m) + " x " + std::to_string(in) + "] (rows " +
            std::to_string(ldx) + " apart): needs 16-byte aligned rows of a multiple of 8 elements");
  if (in / 8 >= kWideGroups) {
    check(m <= 0x7fffffff, "FP8 per-row quantization: " + std::to_string(m) + " rows are too many");
    quantize_wide_rows_kernel<<<static_cast<unsigned>(m), kThreads, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x), ldx, in / 8, q, scales);
    TESSERA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int64_t blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  check(blocks <= 0x7fffffff, "FP8 per-row quantization: " + std::to_string(m) + " rows are too many");
  quantize_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), ldx, m, in / 8, q, scales);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void quantize_e4m3_rows_batch(const Fp8RowJobs& jobs, int64_t ldx, int64_t m, int64_t in, cudaStream_t stream) {
  if (jobs.count <= 0 || m <= 0 || in <= 0) return;
  check(jobs.count <= Fp8RowJobs::kMax, "FP8 per-row quantization: more than " + std::to_string(Fp8RowJobs::kMax) +
                                            " jobs in one launch");
  bool aligned = in % 8 == 0 && ldx % 8 == 0;
  for (int i = 0; i < jobs.count; ++i)
    aligned = aligned && reinterpret_cast<uintptr_t>(jobs.x[i]) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(jobs.q[i]) % 16 == 0 && reinterpret_cast<uintptr_t>(jobs.scales[i]) % 16 == 0;
  check(aligned, "FP8 per-row quantization of [" + std::to_string(m) + " x " + std::to_string(in) + "] (rows " +
                     std::to_string(ldx) + " apart): needs 16-byte aligned rows of a multiple of 8 elements");
  const int64_t blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  check(blocks <= 0x7fffffff, "FP8 per-row quantization: " + std::to_string(m) + " rows are too many");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(jobs.count));
  quantize_rows_batch_kernel<<<grid, kThreads, 0, stream>>>(jobs, ldx, m, in / 8);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void scale_outer_e4m3(const float* d, int64_t m, int64_t out, const float* sx, const float* sw, void* y, bool y_f32,
                      int64_t ldy, float beta, cudaStream_t stream) {
  if (m <= 0 || out <= 0) return;
  const int grid = grid_for(m * out);
  if (y_f32)
    scale_outer_kernel<float><<<grid, kThreads, 0, stream>>>(d, m, out, sx, sw, static_cast<float*>(y), ldy, beta);
  else
    scale_outer_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(d, m, out, sx, sw,
                                                                     static_cast<__nv_bfloat16*>(y), ldy, beta);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

bool fp8_tensor_cores(std::string* why) {
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) *why = "no CUDA device";
    return false;
  }
  if (why != nullptr)
    *why = std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." +
           std::to_string(prop.minor);
  return prop.major > 8 || (prop.major == 8 && prop.minor >= 9);
}

}  // namespace tessera::runtime::gpu
