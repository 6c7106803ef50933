#include "runtime/cuda/stream_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/cuda/fp8_quant.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;

using attn::gpu::check_launch;

int blocks_for(int64_t total, int threads) {
  return static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65535LL * 16));
}

// One thread per (row, pair): its cos / sin once, then every head.
__global__ void rope_rows_kernel(nbf* x, int64_t rows, int64_t ld, int heads, int d, const float* inv_freq,
                                 int64_t pos0, int64_t step) {
  const int half = d / 2;
  const int64_t total = rows * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / half;
    const int i = static_cast<int>(idx % half);
    const float angle = static_cast<float>(pos0 + step * r) * inv_freq[i];
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float s = static_cast<float>(sin(static_cast<double>(angle)));
    nbf* row = x + r * ld;
    for (int h = 0; h < heads; ++h) {
      const float a = __bfloat162float(row[h * d + i]), b = __bfloat162float(row[h * d + i + half]);
      row[h * d + i] = __float2bfloat16_rn(a * c - b * s);
      row[h * d + i + half] = __float2bfloat16_rn(b * c + a * s);
    }
  }
}

__global__ void merge_lse_kernel(nbf* out_l, const nbf* out_g, const float* lse_l, const float* lse_g, int64_t n,
                                 int heads, int d) {
  const int64_t total = n * heads * d;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rh = idx / d;
    const int64_t r = rh / heads;
    const int h = static_cast<int>(rh % heads);
    const float ll = lse_l[h * n + r], lg = lse_g[h * n + r];
    const float m = fmaxf(ll, lg);
    float wl = 0, wg = 0;
    if (m != -INFINITY) {
      wl = __expf(ll - m);
      wg = __expf(lg - m);
      const float z = wl + wg;
      wl /= z;
      wg /= z;
    }
    out_l[idx] = __float2bfloat16_rn(wl * __bfloat162float(out_l[idx]) + wg * __bfloat162float(out_g[idx]));
  }
}

// Range blockIdx.y of c, K (blockIdx.z 0) or V (1), in units T (uint4: 8 bf16 values, or one value).
template <typename T>
__global__ void copy_rows_kernel(T* dst_k, T* dst_v, int64_t row_units, StreamRowCopies c) {
  const int i = static_cast<int>(blockIdx.y);
  const T* src = static_cast<const T*>(blockIdx.z == 0 ? c.src_k[i] : c.src_v[i]);
  T* dst = (blockIdx.z == 0 ? dst_k : dst_v) + static_cast<int64_t>(c.dst_row[i]) * row_units;
  const int64_t total = static_cast<int64_t>(c.rows[i]) * row_units;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[idx] = src[idx];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Block blockIdx.y of c, K (blockIdx.z 0) or V (1): codes and scales of the block layout above into bf16 rows.
__global__ void dequantize_blocks_kernel(nbf* dst_k, nbf* dst_v, int64_t block_rows, int heads, int d,
                                         StreamFp8Blocks c) {
  const int i = static_cast<int>(blockIdx.y);
  const int kv = static_cast<int>(blockIdx.z);
  const int64_t row = static_cast<int64_t>(heads) * d;
  const uint8_t* codes = c.src[i] + kv * block_rows * row;
  const float* scales = reinterpret_cast<const float*>(c.src[i] + 2 * block_rows * row) + kv * block_rows * heads;
  nbf* dst = (kv == 0 ? dst_k : dst_v) + static_cast<int64_t>(c.dst_row[i]) * row;
  const int64_t total = block_rows * row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    __nv_fp8_e4m3 q;
    q.__x = codes[idx];
    dst[idx] = __float2bfloat16_rn(static_cast<float>(q) * scales[idx / d]);
  }
}

}  // namespace

void stream_copy_rows(bf16* dst_k, bf16* dst_v, int64_t row, const StreamRowCopies& c, cudaStream_t stream) {
  if (c.count <= 0) return;
  check(c.count <= StreamRowCopies::kMax, "stream_copy_rows: more than " + std::to_string(StreamRowCopies::kMax) +
                                              " ranges in one launch");
  int32_t most = 0;
  bool vec = row % 8 == 0 && aligned16(dst_k) && aligned16(dst_v);
  for (int i = 0; i < c.count; ++i) {
    most = std::max(most, c.rows[i]);
    vec = vec && aligned16(c.src_k[i]) && aligned16(c.src_v[i]);
  }
  if (most == 0) return;
  const int threads = 256;
  const int64_t units = vec ? row / 8 : row;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((most * units + threads - 1) / threads, 64)),
                  static_cast<unsigned>(c.count), 2);
  if (vec)
    copy_rows_kernel<uint4><<<grid, threads, 0, stream>>>(reinterpret_cast<uint4*>(dst_k), reinterpret_cast<uint4*>(dst_v),
                                                          units, c);
  else
    copy_rows_kernel<nbf><<<grid, threads, 0, stream>>>(reinterpret_cast<nbf*>(dst_k), reinterpret_cast<nbf*>(dst_v),
                                                        units, c);
  check_launch("stream_copy_rows");
}

int64_t stream_fp8_block_bytes(int64_t rows, int heads, int d) {
  return 2 * rows * (static_cast<int64_t>(heads) * d + static_cast<int64_t>(heads) * static_cast<int64_t>(sizeof(float)));
}

void stream_quantize_block(const bf16* k, const bf16* v, int64_t rows, int heads, int d, uint8_t* dst,
                           cudaStream_t stream) {
  if (rows <= 0) return;
  check(aligned16(dst), "stream_quantize_block: the block must be 16-byte aligned");
  const int64_t row = static_cast<int64_t>(heads) * d;
  float* scales = reinterpret_cast<float*>(dst + 2 * rows * row);
  quantize_e4m3_rows(k, d, rows * heads, d, dst, scales, stream);
  quantize_e4m3_rows(v, d, rows * heads, d, dst + rows * row, scales + rows * heads, stream);
}

void stream_dequantize_blocks(bf16* dst_k, bf16* dst_v, int64_t block_rows, int heads, int d, const StreamFp8Blocks& c,
                              cudaStream_t stream) {
  if (c.count <= 0 || block_rows <= 0) return;
  check(c.count <= StreamFp8Blocks::kMax, "stream_dequantize_blocks: more than " +
                                              std::to_string(StreamFp8Blocks::kMax) + " blocks in one launch");
  const int threads = 256;
  const int64_t total = block_rows * heads * d;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((total + threads - 1) / threads, 64)),
                  static_cast<unsigned>(c.count), 2);
  dequantize_blocks_kernel<<<grid, threads, 0, stream>>>(reinterpret_cast<nbf*>(dst_k), reinterpret_cast<nbf*>(dst_v),
                                                         block_rows, heads, d, c);
  check_launch("stream_dequantize_blocks");
}

void stream_rope_rows(bf16* x, int64_t rows, int64_t ld, int heads, int d, const float* inv_freq, int64_t pos0,
                      int64_t step, cudaStream_t stream) {
  if (rows <= 0) return;
  check(d % 2 == 0 && heads > 0, "stream_rope_rows: needs an even head_dim and heads");
  rope_rows_kernel<<<blocks_for(rows * (d / 2), 256), 256, 0, stream>>>(reinterpret_cast<nbf*>(x), rows, ld, heads, d,
                                                                        inv_freq, pos0, step);
  check_launch("stream_rope_rows");
}

void stream_merge_lse(bf16* out_l, const bf16* out_g, const float* lse_l, const float* lse_g, int64_t n, int heads,
                      int d, cudaStream_t stream) {
  if (n <= 0) return;
  merge_lse_kernel<<<blocks_for(n * heads * d, 256), 256, 0, stream>>>(
      reinterpret_cast<nbf*>(out_l), reinterpret_cast<const nbf*>(out_g), lse_l, lse_g, n, heads, d);
  check_launch("stream_merge_lse");
}

}  // namespace tessera::runtime::gpu
