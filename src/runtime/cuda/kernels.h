// tessera/runtime/cuda/kernels.h — the small kernels of the GPU forward pass (everything but GEMMs and the
// sparse attention executor).
//
// The per-token kernels (norms, RoPE, activation, embedding) take 16-byte vector loads and stores when the row
// sizes and pointers allow it (f32 rows: n % 4 == 0; bf16: multiples of 8 elements; 16-byte aligned bases),
// and fall back to scalar kernels otherwise; the two paths agree bit for bit except in the sums of squares of the
// norms (another summation order: a last-bit difference in the inverse norm, so an output may differ by one
// bf16 unit in the last place).
//
// Device pointers throughout. bf16 data is tessera::bf16 on the host side of the API (bit-identical to CUDA's
// __nv_bfloat16), so that this header needs no CUDA type headers. Matrices are row-major; `ld`/`stride`
// arguments are in elements between rows. Every function launches asynchronously on `stream` and throws
// tessera::Error when the launch fails or an argument is out of the kernel's range.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// The gate activation of the gated MLP (runtime::Activation, without its header: this one is compiled by nvcc).
enum class GateActivation { kSiLU, kGeluTanh, kGelu };

// x[t, :] = table[tokens[t], :] * scale (f32 out; the residual stream stays in f32). tokens are device ints,
// already checked against the vocabulary.
void embed_tokens(const int32_t* tokens, int64_t n, const bf16* table, int64_t hidden, float scale, float* x,
                  cudaStream_t stream);
// The same from an f32 table (the planners' gradient pass, plan/cuda, keeps its weights in f32).
void embed_tokens(const int32_t* tokens, int64_t n, const float* table, int64_t hidden, float scale, float* x,
                  cudaStream_t stream);

// y[r, :] = bf16(w * (x[r, :] / sqrt(mean(x[r, :]^2) + eps))), x f32 [rows, n] (row stride n), y bf16 with
// row stride ldy. The order of operations is the CPU's (runtime/ops.h rms_norm); sums in f32.
void rms_norm_to_bf16(const float* x, int64_t rows, int64_t n, const float* w, float eps, bf16* y, int64_t ldy,
                      cudaStream_t stream);

// rms_norm_to_bf16 (y may be null: not written) and the bf16 rows it makes quantized to FP8 E4M3 per row in the same
// pass: q [rows, n] (contiguous) and scales [rows], bit for bit what quantize_e4m3_rows (fp8_quant.h) gives from y.
// Returns false, launching nothing, where the fused kernel does not apply (n not a multiple of 8 or over 16,384, an
// unaligned pointer, the scalar kernels forced): the caller runs the two.
bool rms_norm_to_fp8_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, bf16* y, int64_t ldy,
                          uint8_t* q, float* scales, cudaStream_t stream);

// x[r, :] += w * RMSNorm(o[r, :]) (Gemma-3's post-attention and post-MLP norms before the residual add).
void add_rms_normed(float* x, const float* o, int64_t rows, int64_t n, const float* w, float eps,
                    cudaStream_t stream);

// RoPE tables for positions [pos0, pos0 + n): cos[t * half + i] = cos(float(pos0 + t) * inv_freq[i]) (the
// angle in f32 as the CPU and transformers form it, its cosine and sine in double, rounded to f32).
void rope_tables(const float* inv_freq, int half, int64_t pos0, int64_t n, float* cos, float* sin,
                 cudaStream_t stream);

// In place on `rows` rows of `heads` head vectors (row r at x + r * row_stride, heads contiguous): optionally
// RMSNorm of every head with norm_w [head_dim] (Gemma-3's QK-norm; norm_w == nullptr: none), then RoPE in the
// rotate_half convention with table row r. Computed in f32 from bf16, rounded once to bf16.
void qk_norm_rope(bf16* x, int64_t rows, int64_t row_stride, int heads, int head_dim, const float* norm_w,
                  float eps, const float* cos, const float* sin, cudaStream_t stream);

// y[r, c] += bias[c] for c < cols (bf16 y, rows ld apart; bias f32).
void add_bias(bf16* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream);

// The gated MLP's activation, in place: for each row r of gu [rows, 2f] (gate in columns [0, f), up in
// [f, 2f)): gu[r, c] = act(gu[r, c]) * gu[r, f + c], c < f (the down projection then reads gu with ld 2f).
void gated_activation(bf16* gu, int64_t rows, int64_t f, GateActivation act, cudaStream_t stream);

// gated_activation's rows quantized to FP8 E4M3 per row in the same pass (q [rows, f] contiguous, scales [rows]),
// bit for bit quantize_e4m3_rows of what gated_activation writes; the activation's bf16 values are written into gu
// only when write_bf16. Returns false, launching nothing, where the fused kernel does not apply (f not a multiple
// of 8 or over 32,768, unaligned pointers, the scalar kernels forced).
bool gated_activation_fp8_rows(bf16* gu, int64_t rows, int64_t f, GateActivation act, bool write_bf16, uint8_t* q,
                               float* scales, cudaStream_t stream);

// x[i] = cap * tanh(x[i] / cap).
void softcap(float* x, int64_t n, float cap, cudaStream_t stream);

// out[r] = the index of the largest of x[r, 0:n) (rows ld apart), ties to the smaller index: runtime::argmax
// (sampling.h) for rows without NaN; a NaN is never chosen (a row of NaN only: 0).
void row_argmax(const float* x, int64_t rows, int64_t n, int64_t ld, int32_t* out, cudaStream_t stream);

// out[r] = x[r, next[r]] - log(sum_j exp(x[r, j])) over x[r, 0:n) (rows ld apart), next[r] in [0, n): the
// log-probability of the token after row r (runtime::next_token_logprobs, the host twin: there exp and the sum in
// f64; here exp(x - the row's maximum) in f32, summed in f64 — within a few f32 roundings of it).
void row_logprobs(const float* x, int64_t rows, int64_t n, int64_t ld, const int32_t* next, double* out,
                  cudaStream_t stream);

// Dense causal attention with an optional row-exact sliding window, in a plain kernel (one block per query
// row and head, f32 online softmax): the slow, obvious twin of the sparse executor, and the path for head
// dimensions the executor is not built for (any even head_dim up to 256). q [q_len, nq, d] (rows q_stride
// apart), k/v [kv_len, nkv, d] (rows kv_stride apart), out [q_len, nq, d] (rows out_stride apart), all bf16.
// Row r (position q_begin + r) sees keys j <= q_begin + r, and q_begin + r - j < window when window > 0.
void simple_attention(const bf16* q, int64_t q_stride, const bf16* k, const bf16* v, int64_t kv_stride, bf16* out,
                      int64_t out_stride, int64_t q_len, int nq, int nkv, int head_dim, int64_t q_begin, int window,
                      float scale, cudaStream_t stream);

// Deterministic pseudo-random fill: p[i] = bf16(scale * u), u uniform in [-1, 1) from a hash of (seed, i), so
// the same seed gives the same weights on any device and launch shape.
void fill_uniform_bf16(bf16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
void fill_f32(float* p, int64_t n, float value, cudaStream_t stream);

// Column `col` of a row-major bf16 matrix (rows `ld` elements apart): m[r * ld + col] = values[r] for r < rows,
// values on the device (DeviceModel::random's local-attention weights).
void write_column_bf16(bf16* m, int64_t rows, int64_t ld, int64_t col, const bf16* values, cudaStream_t stream);

// y[i] = bf16(x[i]), round to nearest even (as core/dtype.h f32_to_bf16).
void f32_to_bf16(const float* x, int64_t n, bf16* y, cudaStream_t stream);

// For tests: true makes every launch above that has a vector kernel run its scalar fallback instead (process-wide,
// not thread-safe; default false).
void force_scalar_kernels(bool on);

}  // namespace tessera::runtime::gpu
