// tessera/model/quant.h — ggml block layouts, dequantization to f32, and reference quantizers.
//
// A quantized row of n elements is n / block_size consecutive blocks; each block holds block_size elements in
// the layouts below (little-endian; "half" is an IEEE binary16 bit pattern). The layouts are ggml's, as
// documented by the GGUF specification and gguf-py (gguf/quants.py); the code here is tessera's own. Within a
// block, element i is reconstructed as:
//
//   Q4_0  {half d; u8 qs[16]}                  x[i] = d * (q[i] - 8),   q[j] = qs[j] & 15, q[j+16] = qs[j] >>
//   4 Q4_1  {half d, m; u8 qs[16]}               x[i] = d * q[i] + m      (q as Q4_0) Q5_0  {half d; u8
//   qh[4]; u8 qs[16]}        x[i] = d * (q[i] - 16),  q[i] = (Q4 nibble) | bit i of qh << 4 Q5_1  {half d, m;
//   u8 qh[4]; u8 qs[16]}     x[i] = d * q[i] + m      (q as Q5_0, unsigned) Q8_0  {half d; i8 qs[32]} x[i] =
//   d * qs[i] Q2_K  {u8 scales[16]; u8 qs[64]; half d, dmin}                    256 elements in 16 groups of
//   16:
//         x = (d * (sc & 15)) * q - dmin * (sc >> 4),  q 2 bits
//   Q3_K  {u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}           16 groups of 16, 6-bit signed scales:
//         x = (d * (s - 32)) * (q - (hbit ? 0 : 4)),  q 2 low bits + 1 high bit
//   Q4_K  {half d, dmin; u8 scales[12]; u8 qs[128]}                   8 groups of 32, 6-bit scale and min:
//         x = (d * sc) * q - dmin * m,  q 4 bits
//   Q5_K  {half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}        as Q4_K with a fifth bit from qh
//   Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}              16 groups of 16:
//         x = (d * sc) * (q - 32),  q 4 low bits + 2 high bits
//   Q8_K  {float d; i8 qs[256]; i16 bsums[16]}                        x[i] = d * qs[i]
//
// The exact bit positions are in quant.cpp, next to the code that reads them. Products are evaluated in f32
// in the order written above (no fused multiply-add), so results equal gguf-py's numpy reference bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "model/model_file.h"

namespace tessera::model {

// Dequantizes n consecutive elements starting at a block boundary. n must be a multiple of the type's block
// size and `src` must hold tensor_type_bytes(t, n) bytes (unaligned is fine). Throws Error for an unsupported
// type or a ragged n.
void dequantize_row(TensorType t, const uint8_t* src, int64_t n, float* dst);

// All numel() elements of `tensor`, row-major, into out[0, numel). Single-threaded; to spread a big tensor
// over threads, call dequantize_rows on disjoint row ranges.
void dequantize(const TensorInfo& tensor, float* out);

// Rows [row_begin, row_begin + row_count) of `tensor` (a row is the innermost dimension, row_length()
// elements) into out[0, row_count * row_length()). Throws Error naming the tensor when the range is outside
// [0, rows()).
void dequantize_rows(const TensorInfo& tensor, int64_t row_begin, int64_t row_count, float* out);

// Reference quantizers for the types with a simple round-to-nearest recipe: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1. They reproduce gguf-py's quantize() byte for byte (which follows ggml's reference C code), so a
// future converter writes the same files llama.cpp's tools would. n must be a multiple of the block size; dst
// receives tensor_type_bytes(t, n) bytes. Other types throw Error (the K-quants need a search over scales
// that tessera does not implement yet).
void quantize_row(TensorType t, const float* src, int64_t n, uint8_t* dst);
bool quantize_supported(TensorType t);

}  // namespace tessera::model
