// tessera/runtime/cuda/fp8_gemv.h — weight-only FP8 products for the decode step: y[m, out] = x[m, in] · W[out, in]^T
// (+ beta · y) with W in E4M3 (an Fp8Matrix: row-major codes and one scale per output channel, or one per tensor) and
// x in bf16, for a few rows (m <= kW8Rows).
//
// Why: at a decode step's few rows a product reads each weight once and does little arithmetic with it, so its time
// is the weights' bytes; W8A8 through cuBLASLt (gemm.h) halves the bytes but pays the activations' quantization and a
// kernel made for large tiles, and measured slower than bf16 (docs/PERF.md "Decode"). This kernel reads the E4M3
// codes with 16-byte loads, converts them in registers (integer operations, exact) and multiplies the bf16
// activations in f32: the activations keep their precision (only the weights are 8-bit), and a row's result does
// not depend on m (the same summation order for every row count, so a sequence decodes the same alone or batched).
//
// A block of four warps computes two output channels: the warps take interleaved runs of the rows' 16-byte chunks
// (four chunks of each row in flight a lane), multiply every one of the m activation rows (read through L1: all
// blocks share them), and the lanes' sums meet by shuffles, the warps' in shared memory in a fixed order.
// TESSERA_GPU_W8_GEMV=0 in the environment sends the decode rows through W8A8 instead (GpuOps::gemm; the side-by-side).
// Conditions: in and ldx multiples of 16, x 16-byte aligned (the FP8 products' own); thrown as tessera::Error otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "runtime/cuda/gemm.h"

namespace tessera::runtime::gpu {

inline constexpr int64_t kW8Rows = 8;  // the most rows gemv_w8a16 takes

// y (f32 when y_f32, else bf16; rows ldy apart) = x · w^T (+ beta · y: f32 y only, as Gemm::linear).
void gemv_w8a16(const bf16* x, int64_t ldx, int64_t m, const Fp8Matrix& w, void* y, bool y_f32, int64_t ldy,
                float beta, cudaStream_t stream);

}  // namespace tessera::runtime::gpu
