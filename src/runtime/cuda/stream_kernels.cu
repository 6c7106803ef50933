#include "runtime/cuda/stream_kernels.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"

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

}  // namespace

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
