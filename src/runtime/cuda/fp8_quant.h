// tessera/runtime/cuda/fp8_quant.h — bf16 matrices to FP8 E4M3 with dynamic scales, on the device: one per tensor
// or one per row (core/fp8.h Fp8Scaling).
//
// quantize_e4m3 (per tensor) computes amax = max |x| over x [m, in] (rows ldx apart; an amax kernel with one atomic per block),
// then writes q [m, in] (contiguous, row-major) = e4m3(x * (448 / amax)) with the hardware's round-to-nearest-even,
// saturating conversion (cvt.rn.satfinite), and scale = amax / 448 to the device, for cuBLASLt's scale pointers. No
// host synchronisation: everything is stream-ordered. The convention and its host twin are core/fp8.h; the codes
// equal the host's bit for bit (tests/gpu/engine_tests/fp8_gemm_test.cpp).
//
// quantize_e4m3_rows (per row) gives each row its own amax, scale and codes in ONE kernel (a warp per row, or a CTA
// per row of 2,048 values or more: the amax by shuffles, then the row again, from L1/L2, for the codes); scales [m] =
// amax_r / 448. No atomics, no memset, no host synchronisation.
//
// scale_outer_e4m3 is the fallback epilogue of the per-row GEMM where cuBLASLt has no outer-vector scaling (gemm.cpp):
// y[r, o] = sx[r] * sw[o] * d[r, o] + beta * y[r, o] from the unscaled f32 product d.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// The work area of one quantization: kFp8WorkFloats floats of device memory, 16-byte aligned: amax at work[0], the
// scale at work[kFp8ScaleOffset] (its own 16-byte slot: cuBLASLt reads it through A/B_SCALE_POINTER, and every scale
// the libraries' examples pass is a separate, aligned allocation).
inline constexpr int kFp8WorkFloats = 8;
inline constexpr int kFp8ScaleOffset = 4;

// x: 16-byte aligned, ldx and in multiples of 8 (throws tessera::Error otherwise); work: see above.
void quantize_e4m3(const bf16* x, int64_t ldx, int64_t m, int64_t in, uint8_t* q, float* work, cudaStream_t stream);

// Per row: q [m, in] and scales [m] (16-byte aligned; the same conditions on x, ldx, in and q as above).
void quantize_e4m3_rows(const bf16* x, int64_t ldx, int64_t m, int64_t in, uint8_t* q, float* scales,
                        cudaStream_t stream);

// Several per-row quantizations of one shape in one launch: job i quantizes x[i] ([m, in], rows ldx apart) into
// q[i] and scales[i], each as quantize_e4m3_rows would (the same kernel's arithmetic: bit for bit).
struct Fp8RowJobs {
  static constexpr int kMax = 64;
  const bf16* x[kMax];
  uint8_t* q[kMax];
  float* scales[kMax];
  int32_t count = 0;
};
void quantize_e4m3_rows_batch(const Fp8RowJobs& jobs, int64_t ldx, int64_t m, int64_t in, cudaStream_t stream);

// y[r, o] (y_f32 ? f32 : bf16, rows ldy apart) = sx[r] * sw[o] * d[r * out + o] + beta * y[r, o], for r < m, o < out.
void scale_outer_e4m3(const float* d, int64_t m, int64_t out, const float* sx, const float* sw, void* y, bool y_f32,
                      int64_t ldy, float beta, cudaStream_t stream);

// Whether the current device has FP8 tensor cores (compute capability 8.9 or newer); `why` gets the device's name
// and compute capability.
bool fp8_tensor_cores(std::string* why = nullptr);

}  // namespace tessera::runtime::gpu
