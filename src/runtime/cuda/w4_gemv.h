// tessera/runtime/cuda/w4_gemv.h — weight-only 4-bit products for the decode step: y[m, out] = x[m, in] · W[out, in]^T
// (+ beta · y) with W group-quantized to 4 bits (a W4Matrix) and x in bf16, for a few rows (m <= kW4Rows).
//
// Why: a decode step's products read each weight once and do little arithmetic with it, so their time is the
// weights' bytes; 4.25 bits a weight are 0.27x bf16's 16 (FP8 weight-only, fp8_gemv.h: 0.5x).
//
// The format (GPTQ/AWQ's asymmetric round-to-nearest, no calibration): along each row, groups of kW4Group = 128
// consecutive weights share a scale s (bf16) and an integer zero point z (0..15); weight c of a row is a code q in
// 0..15 and its value is s * (q - z), exactly representable in f32 and in bf16 arithmetic's q - z. Per group, with
// lo = min(w, 0) and hi = max(w, 0) over its bf16 weights (0 always in range: a model's groups straddle it anyway):
//   s = bf16_rn((hi - lo) / 15),  z = clamp(rint(-lo / s), 0, 15),  q = clamp(rint(w / s) + z, 0, 15)
// (f32 operations, IEEE-rounded, rint to nearest even; s = 0, an all-zero group: z = q = 0). A row's codes are
// cols / 2 bytes: 32-bit little-endian words of 8 consecutive weights, weight e (0-7) of a word at bit
// 16 (e & 1) + 4 (e >> 1) (even weights in the low half-word: two codes convert to a bf16 pair in one operation);
// its group parameters cols / 128 uint32 (the scale's bf16 bits in bits 0-15, z in bits 16-19). 4.25 bits a weight.
// quantize_w4 (device, a warp per group) and quantize_w4_host compute the same codes and parameters bit for bit (one
// shared function of the group's values; tests/gpu/engine_tests/w4_gemm_test.cpp).
// Weights within a factor 15 of f32's largest would overflow the scale (no model has them); NaNs are undefined.
//
// gemv_w4a16 runs on the tensor cores: a block of eight warps computes 16 output channels, each warp every eighth
// group of their rows (split K), as mma.sync m16n8k16 products of the weights' exact integers q - z (bf16: a code pair
// masked into two mantissas under the exponent of 128, then one bf16x2 FMA) with the activation rows as the 8 columns (rows past m zero: no
// column changes another), f32 accumulation, a group's sum times its scale into f32. The warps' sums meet in shared
// memory in a fixed order: a row's result does not depend on m (a sequence decodes the same alone or batched), and
// it is the f32 product of the dequantized weights but for the summation (the tensor cores' within a group).
// Conditions: in a multiple of kW4Group, ldx of 8, x and the codes 16-byte aligned (thrown as tessera::Error).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

inline constexpr int64_t kW4Rows = 8;     // the most rows gemv_w4a16 takes
inline constexpr int64_t kW4Group = 128;  // weights of a row sharing a scale and zero point

// A row-major [rows, cols] 4-bit matrix on the device (see above): codes [rows, cols / 2] bytes, params
// [rows, cols / kW4Group]. Rows r0.. of a matrix are the matrix at codes + r0 * cols / 2, params + r0 * cols / kW4Group.
struct W4Matrix {
  const uint8_t* codes = nullptr;
  const uint32_t* params = nullptr;
  int64_t rows = 0, cols = 0;
};

// Quantizes w [rows, cols] (bf16, rows ldw apart; cols a multiple of kW4Group) into codes [rows, cols / 2] and params
// [rows, cols / kW4Group] (contiguous), on `stream`.
void quantize_w4(const bf16* w, int64_t ldw, int64_t rows, int64_t cols, uint8_t* codes, uint32_t* params,
                 cudaStream_t stream);
// The same on the host (the reference).
void quantize_w4_host(const bf16* w, int64_t ldw, int64_t rows, int64_t cols, uint8_t* codes, uint32_t* params);
// The value of weight (r, c) of host codes and params of a [rows, cols] matrix: s * (q - z).
float w4_value(const uint8_t* codes, const uint32_t* params, int64_t cols, int64_t r, int64_t c);

// y (f32 when y_f32, else bf16; rows ldy apart) = x · w^T (+ beta · y: f32 y only, as Gemm::linear).
void gemv_w4a16(const bf16* x, int64_t ldx, int64_t m, const W4Matrix& w, void* y, bool y_f32, int64_t ldy,
                float beta, cudaStream_t stream);

}  // namespace tessera::runtime::gpu
