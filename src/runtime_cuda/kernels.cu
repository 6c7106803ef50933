// The small kernels of the GPU forward pass (kernels.h). Memory-bound and simple: one block per row where a
// row needs a reduction, grid-stride loops elsewhere.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "attention/cuda/cuda_check.h"
#include "core/error.h"
#include "runtime_cuda/kernels.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;
using attn::gpu::check_launch;

static_assert(sizeof(bf16) == sizeof(nbf), "tessera::bf16 and __nv_bfloat16 must have the same layout");

nbf* dev(bf16* p) { return reinterpret_cast<nbf*>(p); }
const nbf* dev(const bf16* p) { return reinterpret_cast<const nbf*>(p); }

__device__ __forceinline__ float to_f(nbf v) { return __bfloat162float(v); }
__device__ __forceinline__ nbf to_bf(float v) { return __float2bfloat16_rn(v); }

// Sum / max over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats; the leading barrier lets consecutive calls reuse it.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

// Grid size for a grid-stride loop over n elements with 256 threads per block.
unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65536));
}

__global__ void embed_kernel(const int32_t* tokens, const nbf* table, int64_t hidden, float scale, float* x) {
  const int64_t t = blockIdx.x;
  const nbf* e = table + static_cast<int64_t>(tokens[t]) * hidden;
  float* out = x + t * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = to_f(e[i]) * scale;
}

__global__ void rms_norm_kernel(const float* x, int64_t n, const float* w, float eps, nbf* y, int64_t ldy) {
  __shared__ float scratch[32];
  const float* in = x + static_cast<int64_t>(blockIdx.x) * n;
  nbf* out = y + static_cast<int64_t>(blockIdx.x) * ldy;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += in[i] * in[i];
  ss = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = to_bf(w[i] * (in[i] * inv));
}

__global__ void add_rms_normed_kernel(float* x, const float* o, int64_t n, const float* w, float eps) {
  __shared__ float scratch[32];
  const float* in = o + static_cast<int64_t>(blockIdx.x) * n;
  float* out = x + static_cast<int64_t>(blockIdx.x) * n;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += in[i] * in[i];
  ss = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] += w[i] * (in[i] * inv);
}

__global__ void rope_tables_kernel(const float* inv_freq, int half, int64_t pos0, int64_t total, float* c,
                                   float* s) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / half;
    const int i = static_cast<int>(idx % half);
    const float angle = static_cast<float>(pos0 + t) * inv_freq[i];
    c[idx] = static_cast<float>(cos(static_cast<double>(angle)));
    s[idx] = static_cast<float>(sin(static_cast<double>(angle)));
  }
}

// One block per row: the row's heads go through shared memory (f32), are normalised per head when asked,
// then rotated.
__global__ void qk_norm_rope_kernel(nbf* x, int64_t row_stride, int heads, int d, const float* norm_w, float eps,
                                    const float* cos_t, const float* sin_t) {
  extern __shared__ float sh[];  // heads * d values, then heads inverse norms
  const int64_t r = blockIdx.x;
  nbf* row = x + r * row_stride;
  const int total = heads * d;
  float* inv = sh + total;
  for (int i = threadIdx.x; i < total; i += blockDim.x) sh[i] = to_f(row[i]);
  __syncthreads();
  if (norm_w != nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int h = warp; h < heads; h += warps) {
      float ss = 0;
      for (int i = lane; i < d; i += 32) ss += sh[h * d + i] * sh[h * d + i];
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) inv[h] = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < total; i += blockDim.x) sh[i] = norm_w[i % d] * (sh[i] * inv[i / d]);
    __syncthreads();
  }
  const int half = d / 2;
  const float* c = cos_t + r * half;
  const float* s = sin_t + r * half;
  for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    const float a = sh[h * d + i], b = sh[h * d + i + half];
    row[h * d + i] = to_bf(a * c[i] - b * s[i]);
    row[h * d + i + half] = to_bf(b * c[i] + a * s[i]);
  }
}

__global__ void add_bias_kernel(nbf* y, int64_t rows, int64_t cols, int64_t ld, const float* bias) {
  const int64_t total = rows * cols;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / cols, c = idx % cols;
    nbf* p = y + r * ld + c;
    *p = to_bf(to_f(*p) + bias[c]);
  }
}

// Rows over blockIdx.y, columns over x: no division per element.
template <GateActivation kAct>
__global__ void gated_activation_kernel(nbf* gu, int64_t rows, int64_t f) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    nbf* row = gu + r * 2 * f;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < f;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float g = to_f(row[c]), u = to_f(row[f + c]);
      float a;
      if constexpr (kAct == GateActivation::kSiLU) {
        a = g / (1.0f + expf(-g));
      } else if constexpr (kAct == GateActivation::kGeluTanh) {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        a = 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
      } else {
        a = 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
      }
      row[c] = to_bf(a * u);
    }
  }
}

__global__ void softcap_kernel(float* x, int64_t n, float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = cap * tanhf(x[i] / cap);
}

constexpr int kAttnThreads = 128;

// One block per (query row, query head). Keys in chunks of kAttnThreads: each thread scores one key, the
// block takes the chunk's max and sum (online softmax), then every thread accumulates its output dimensions
// (tid and tid + 128) over the chunk's probabilities.
__global__ void __launch_bounds__(kAttnThreads)
    simple_attention_kernel(const nbf* q, int64_t q_stride, const nbf* k, const nbf* v, int64_t kv_stride, nbf* out,
                            int64_t out_stride, int group, int d, int64_t q_begin, int window, float scale) {
  __shared__ float qv[256];
  __shared__ float probs[kAttnThreads];
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y, kvh = h / group, tid = threadIdx.x;
  const int64_t p = q_begin + r;
  const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
  const nbf* qr = q + r * q_stride + static_cast<int64_t>(h) * d;
  for (int i = tid; i < d; i += kAttnThreads) qv[i] = to_f(qr[i]);
  __syncthreads();
  const nbf* kb = k + static_cast<int64_t>(kvh) * d;
  const nbf* vb = v + static_cast<int64_t>(kvh) * d;
  float m = -INFINITY, l = 0, acc0 = 0, acc1 = 0;
  for (int64_t j0 = lo; j0 <= p; j0 += kAttnThreads) {
    const int64_t j = j0 + tid;
    float s = -INFINITY;
    if (j <= p) {
      const nbf* kr = kb + j * kv_stride;
      float dot = 0;
      for (int i = 0; i < d; ++i) dot += qv[i] * to_f(kr[i]);
      s = dot * scale;
    }
    const float new_m = fmaxf(m, block_max(s, scratch));  // finite: key j0 is always visible
    const float pj = j <= p ? expf(s - new_m) : 0.0f;
    probs[tid] = pj;
    const float chunk_sum = block_sum(pj, scratch);  // its barriers also publish probs
    const float corr = expf(m - new_m);
    l = l * corr + chunk_sum;
    acc0 *= corr;
    acc1 *= corr;
    const int count = p - j0 + 1 < kAttnThreads ? static_cast<int>(p - j0 + 1) : kAttnThreads;
    for (int t = 0; t < count; ++t) {
      const nbf* vr = vb + (j0 + t) * kv_stride;
      const float pt = probs[t];
      if (tid < d) acc0 += pt * to_f(vr[tid]);
      if (tid + kAttnThreads < d) acc1 += pt * to_f(vr[tid + kAttnThreads]);
    }
    m = new_m;
    __syncthreads();  // probs is rewritten by the next chunk
  }
  nbf* o = out + r * out_stride + static_cast<int64_t>(h) * d;
  if (tid < d) o[tid] = to_bf(acc0 / l);
  if (tid + kAttnThreads < d) o[tid + kAttnThreads] = to_bf(acc1 / l);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(nbf* p, int64_t n, uint64_t seed, float scale) {
  const uint64_t key = splitmix64(seed);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(key ^ static_cast<uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    p[i] = to_bf(scale * (2.0f * u - 1.0f));
  }
}

__global__ void fill_f32_kernel(float* p, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void write_column_kernel(nbf* m, int64_t rows, int64_t ld, const nbf* values) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m[r * ld] = values[r];
}

__global__ void f32_to_bf16_kernel(const float* x, int64_t n, nbf* y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = to_bf(x[i]);
}

void check_rows(int64_t rows, const char* what) {
  check(rows < (int64_t{1} << 31), std::string(what) + ": too many rows for one launch");
}

}  // namespace

void embed_tokens(const int32_t* tokens, int64_t n, const bf16* table, int64_t hidden, float scale, float* x,
                  cudaStream_t stream) {
  if (n <= 0) return;
  check_rows(n, "embed_tokens");
  embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(tokens, dev(table), hidden, scale, x);
  check_launch("embed_tokens");
}

void rms_norm_to_bf16(const float* x, int64_t rows, int64_t n, const float* w, float eps, bf16* y, int64_t ldy,
                      cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "rms_norm");
  rms_norm_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(x, n, w, eps, dev(y), ldy);
  check_launch("rms_norm");
}

void add_rms_normed(float* x, const float* o, int64_t rows, int64_t n, const float* w, float eps,
                    cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "add_rms_normed");
  add_rms_normed_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(x, o, n, w, eps);
  check_launch("add_rms_normed");
}

void rope_tables(const float* inv_freq, int half, int64_t pos0, int64_t n, float* cos, float* sin,
                 cudaStream_t stream) {
  const int64_t total = n * half;
  if (total <= 0) return;
  rope_tables_kernel<<<grid_for(total), 256, 0, stream>>>(inv_freq, half, pos0, total, cos, sin);
  check_launch("rope_tables");
}

void qk_norm_rope(bf16* x, int64_t rows, int64_t row_stride, int heads, int head_dim, const float* norm_w,
                  float eps, const float* cos, const float* sin, cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "qk_norm_rope");
  check(head_dim % 2 == 0, "qk_norm_rope: head_dim must be even, got " + std::to_string(head_dim));
  const size_t smem = (static_cast<size_t>(heads) * static_cast<size_t>(head_dim) + static_cast<size_t>(heads)) *
                      sizeof(float);
  check(smem <= 48 * 1024, "qk_norm_rope: " + std::to_string(heads) + " heads x " + std::to_string(head_dim) +
                               " do not fit the kernel's 48 KB of shared memory");
  qk_norm_rope_kernel<<<static_cast<unsigned>(rows), 256, smem, stream>>>(dev(x), row_stride, heads, head_dim,
                                                                          norm_w, eps, cos, sin);
  check_launch("qk_norm_rope");
}

void add_bias(bf16* y, int64_t rows, int64_t cols, int64_t ld, const float* bias, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  add_bias_kernel<<<grid_for(rows * cols), 256, 0, stream>>>(dev(y), rows, cols, ld, bias);
  check_launch("add_bias");
}

void gated_activation(bf16* gu, int64_t rows, int64_t f, GateActivation act, cudaStream_t stream) {
  if (rows <= 0 || f <= 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((f + 255) / 256, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  switch (act) {
    case GateActivation::kSiLU:
      gated_activation_kernel<GateActivation::kSiLU><<<grid, 256, 0, stream>>>(dev(gu), rows, f);
      break;
    case GateActivation::kGeluTanh:
      gated_activation_kernel<GateActivation::kGeluTanh><<<grid, 256, 0, stream>>>(dev(gu), rows, f);
      break;
    case GateActivation::kGelu:
      gated_activation_kernel<GateActivation::kGelu><<<grid, 256, 0, stream>>>(dev(gu), rows, f);
      break;
  }
  check_launch("gated_activation");
}

void softcap(float* x, int64_t n, float cap, cudaStream_t stream) {
  if (n <= 0) return;
  softcap_kernel<<<grid_for(n), 256, 0, stream>>>(x, n, cap);
  check_launch("softcap");
}

void simple_attention(const bf16* q, int64_t q_stride, const bf16* k, const bf16* v, int64_t kv_stride, bf16* out,
                      int64_t out_stride, int64_t q_len, int nq, int nkv, int head_dim, int64_t q_begin, int window,
                      float scale, cudaStream_t stream) {
  if (q_len <= 0) return;
  check_rows(q_len, "simple_attention");
  check(head_dim > 0 && head_dim <= 256, "simple attention: head_dim " + std::to_string(head_dim) +
                                             " is not supported (at most 256)");
  check(nq > 0 && nkv > 0 && nq % nkv == 0 && nq <= 65535, "simple attention: bad head counts " +
                                                                   std::to_string(nq) + "/" + std::to_string(nkv));
  check(window >= 0, "simple attention: window must be >= 0");
  const dim3 grid(static_cast<unsigned>(q_len), static_cast<unsigned>(nq));
  simple_attention_kernel<<<grid, kAttnThreads, 0, stream>>>(dev(q), q_stride, dev(k), dev(v), kv_stride, dev(out),
                                                             out_stride, nq / nkv, head_dim, q_begin, window, scale);
  check_launch("simple_attention");
}

void fill_uniform_bf16(bf16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n <= 0) return;
  fill_uniform_kernel<<<grid_for(n), 256, 0, stream>>>(dev(p), n, seed, scale);
  check_launch("fill_uniform_bf16");
}

void fill_f32(float* p, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return;
  fill_f32_kernel<<<grid_for(n), 256, 0, stream>>>(p, n, value);
  check_launch("fill_f32");
}

void write_column_bf16(bf16* m, int64_t rows, int64_t ld, int64_t col, const bf16* values, cudaStream_t stream) {
  if (rows <= 0) return;
  check(col >= 0 && col < ld, "write_column_bf16: column " + std::to_string(col) + " outside rows of " +
                                  std::to_string(ld));
  write_column_kernel<<<grid_for(rows), 256, 0, stream>>>(dev(m) + col, rows, ld, dev(values));
  check_launch("write_column_bf16");
}

void f32_to_bf16(const float* x, int64_t n, bf16* y, cudaStream_t stream) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(x, n, dev(y));
  check_launch("f32_to_bf16");
}

}  // namespace tessera::runtime::gpu
