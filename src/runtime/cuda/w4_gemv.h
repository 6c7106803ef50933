// tessera/runtime/cuda/w4_gemv.h — weight-only 4-bit products for the decode step: y[m, out] = x[m, in] · W[out, in]^T
// (+ beta · y) with W group-quantized to 4 bits (a W4Matrix) and x in bf16, for a few rows (m <= kW4Rows).
//
// Why: a decode step's products read each weight once and do little arithmetic with it, so their time is the
// weights' bytes; 4.25 bits a weight are 0.27x bf16's 16 (FP8 weight-only, fp8_gemv.h: 0.5x).
//
// The format (GPTQ/AWQ's asymmetric round-to-nearest, no calibration): along each row, groups of kW4Group = 128
// consecutive weights share a scale s (bf16) and an integer zero point z (0..15); weight c of row r is the code
// q in 0..15 (a nibble: byte c / 2 of the row, the low nibble for even c) and its value is s * (q - z), exactly
// representable in f32 (8 significant bits times 4). Per group, with lo = min(w, 0) and hi = max(w, 0) over its
// bf16 weights (0 always in range: groups of a model's weights straddle it anyway):
//   s = bf16_rn((hi - lo) / 15),  z = clamp(rint(-lo / s), 0, 15),  q = clamp(rint(w / s) + z, 0, 15)
// (f32 operations, IEEE-rounded, rint to nearest even; s = 0, an all-zero group: z = q = 0). Bytes: in / 2 of codes
// and in / 32 of group parameters a row (one uint32 each: the scale's bf16 bits in bits 0-15, z in bits 16-19),
// 4.25 bits a weight. quantize_w4 (device, a warp per group) and quantize_w4_host compute the same codes and
// parameters bit for bit (one shared function of the group's values; tests/gpu/engine_tests/w4_gemm_test.cpp).
// Weights of magnitude 2^110 or more would overflow the kernel's constants (no model has them); NaNs are undefined.
//
// gemv_w4a16: a block of four warps computes four output channels; each lane takes 16-byte runs of the rows' codes
// (32 weights of one group), turns every nibble into its exact value s * (q - z) with two integer operations and an
// FMA shared by the m rows (the nibble ORed into a float's mantissa reads 2^E + q; fma(2^E + q, s, -(2^E + z) s) is
// exact for E <= 15), and multiplies the m bf16 activation rows in f32 (read through L1: all blocks share them). The
// lanes' sums meet by shuffles, the warps' in shared memory in a fixed order: a row's result does not depend on m (a
// sequence decodes the same alone or batched), and it is the f32 product of the dequantized weights but for the
// summation order. Conditions: in a multiple of kW4Group, ldx of 8, x and the codes 16-byte aligned (thrown as
// tessera::Error otherwise).
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
