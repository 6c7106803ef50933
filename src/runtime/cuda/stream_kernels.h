// tessera/runtime/cuda/stream_kernels.h — the small kernels of the GPU streaming path (stream_gpu_kv.h).
//
// Device pointers; everything asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// Rotates `rows` rows of `heads` head vectors (x: [rows, ld] bf16, head h at columns [h*d, (h+1)*d)) by RoPE at
// position pos0 + step * r for row r (step 0: every row at pos0), rotate_half pairs (i, i + d/2) as runtime/rope.h:
// angle = float(position) * inv_freq[i], cos / sin in double rounded to float, as the CPU's tables.
void stream_rope_rows(bf16* x, int64_t rows, int64_t ld, int heads, int d, const float* inv_freq, int64_t pos0,
                      int64_t step, cudaStream_t stream);

// Up to kMax rotations in one launch, each from src into dst (src == dst: in place; otherwise the two must not
// overlap), rows `ld` values apart in both, the values stream_rope_rows gives. The workspace's local keys (the sinks,
// the ring's one or two pieces, the chunk: consecutive positions) are one launch, and so are the two rotations of a
// chunk's queries (at their positions for the local pass, all at one position for the global pass).
struct StreamRopeJobs {
  static constexpr int kMax = 4;
  struct Job {
    bf16* dst = nullptr;
    const bf16* src = nullptr;
    int64_t rows = 0, pos0 = 0, step = 1;
  };
  Job job[kMax];
  int32_t count = 0;
  void add(bf16* dst, const bf16* src, int64_t rows, int64_t pos0, int64_t step);  // (throws past kMax)
};
void stream_rope_copy(const StreamRopeJobs& jobs, int64_t ld, int heads, int d, const float* inv_freq,
                      cudaStream_t stream);

// out_l = (e^{lse_l} out_l + e^{lse_g} out_g) / (e^{lse_l} + e^{lse_g}) per (row, head): the softmax over the union
// of the two key sets of stream_layout.h. out_l, out_g: [n, heads, d] bf16 (contiguous); lse_*: [heads, n] f32.
void stream_merge_lse(bf16* out_l, const bf16* out_g, const float* lse_l, const float* lse_g, int64_t n, int heads,
                      int d, cudaStream_t stream);

// Row ranges copied in one launch (instead of two cudaMemcpyAsync calls per range): range i copies rows[i] rows of
// `row` values from src_k[i] / src_v[i] to dst_k / dst_v starting at row dst_row[i]. The workspace's global part (the
// sinks, then each retrieved block from the layer's block cache) is one such launch per layer and chunk. The bytes
// are the copies' (stream_gpu_test: equal to the cudaMemcpyAsync path's, bit for bit).
struct StreamRowCopies {
  static constexpr int kMax = 48;
  const void* src_k[kMax];
  const void* src_v[kMax];
  int32_t dst_row[kMax];
  int32_t rows[kMax];
  int32_t count = 0;
};
// Copies c's ranges (count <= kMax); `row`: bf16 values per row of every range and of the destination.
void stream_copy_rows(bf16* dst_k, bf16* dst_v, int64_t row, const StreamRowCopies& c, cudaStream_t stream);

// FP8 evicted blocks (StreamOptions::host_fp8). One block of `rows` tokens is, contiguous and 16-byte aligned:
// K codes [rows, heads * d], V codes [rows, heads * d] (E4M3), K scales [rows, heads], V scales [rows, heads] (f32):
// each (token, head) vector of d values has its own scale amax / 448 (core/fp8.h's per-row convention with a "row"
// of d values), so a token's outlier head does not flatten the others.
int64_t stream_fp8_block_bytes(int64_t rows, int heads, int d);
// Quantizes blocks of k and v (each [rows, heads * d] bf16, contiguous, 16-byte aligned; d a multiple of 8) into the
// blocks at dst[i] (16-byte aligned), all in one launch: the codes and scales of quantize_e4m3_rows
// (runtime/cuda/fp8_quant.h), equal to core/fp8.h's e4m3_quantize with Fp8Scaling::kRow over [rows * heads, d] bit
// for bit. A layer's evictions of one chunk are one call.
struct StreamFp8Evictions {
  static constexpr int kMax = 32;
  const bf16* k[kMax];
  const bf16* v[kMax];
  uint8_t* dst[kMax];
  int32_t count = 0;
};
void stream_quantize_blocks(const StreamFp8Evictions& e, int64_t rows, int heads, int d, cudaStream_t stream);
// Dequantizes FP8 blocks of `block_rows` tokens into the workspace in one launch: block i (src[i]) to rows
// [dst_row[i], dst_row[i] + block_rows) of dst_k / dst_v ([*, heads * d] bf16). A value is bf16(e4m3_to_float(code) *
// scale), rounded to nearest even: the host's e4m3_to_float and f32_to_bf16, bit for bit (stream_gpu_test).
struct StreamFp8Blocks {
  static constexpr int kMax = 48;
  const uint8_t* src[kMax];
  int32_t dst_row[kMax];
  int32_t count = 0;
};
void stream_dequantize_blocks(bf16* dst_k, bf16* dst_v, int64_t block_rows, int heads, int d, const StreamFp8Blocks& c,
                              cudaStream_t stream);

}  // namespace tessera::runtime::gpu
