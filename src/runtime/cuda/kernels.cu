// The small kernels of the GPU forward pass (kernels.h). Memory-bound: one block per row where a row needs a
// reduction (the row held in registers), rows x columns grids elsewhere. The per-token kernels of every layer
// (RMSNorm, QK-norm + RoPE, the gated activation) move 16 bytes per load and store, each thread several vectors
// in flight; their scalar twins remain for shapes and pointers the vector kernels do not take.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "cuda/cuda_check.h"
#include "core/error.h"
#include "runtime/cuda/fp8_codes.cuh"
#include "runtime/cuda/kernels.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;
using attn::gpu::check_launch;

static_assert(sizeof(bf16) == sizeof(nbf), "tessera::bf16 and __nv_bfloat16 must have the same layout");

nbf* dev(bf16* p) { return reinterpret_cast<nbf*>(p); }
const nbf* dev(const bf16* p) { return reinterpret_cast<const nbf*>(p); }

__device__ __forceinline__ float to_f(nbf v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ nbf to_bf(float v) { return __float2bfloat16_rn(v); }

// 16-byte vector access: 8 bf16 in a uint4 (element 2k in the low half of word k), 4 f32 in a float4. The
// unpacking is exact (a bf16 is the high half of its f32); the packing rounds each value to nearest even, as
// to_bf does.
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return static_cast<uint32_t>(__bfloat16_as_ushort(p.x)) | (static_cast<uint32_t>(__bfloat16_as_ushort(p.y)) << 16);
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = bf_lo(w[k]);
    f[2 * k + 1] = bf_hi(w[k]);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]), pack_bf2(f[6], f[7]));
}

__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {  // p 16-byte aligned
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

bool g_force_scalar = false;  // force_scalar_kernels()

// Whether a vector kernel may access p: 16-byte aligned, and the scalar kernels not forced.
bool vector_ok(const void* p) { return !g_force_scalar && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

template <class T>
__global__ void embed_kernel(const int32_t* tokens, const T* table, int64_t hidden, float scale, float* x) {
  const int64_t t = blockIdx.x;
  const T* e = table + static_cast<int64_t>(tokens[t]) * hidden;
  float* out = x + t * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = to_f(e[i]) * scale;
}

// hidden % 8 == 0 and the table 16-byte aligned: 8 values per thread and step (16-byte loads, 2 x 16-byte stores).
__global__ void embed_vec_kernel(const int32_t* tokens, const nbf* table, int64_t hidden8, float scale, float* x) {
  const int64_t t = blockIdx.x;
  const uint4* e = reinterpret_cast<const uint4*>(table) + static_cast<int64_t>(tokens[t]) * hidden8;
  float4* out = reinterpret_cast<float4*>(x) + t * hidden8 * 2;
  for (int64_t i = threadIdx.x; i < hidden8; i += blockDim.x) {
    float f[8];
    unpack8(__ldg(e + i), f);
    out[2 * i] = make_float4(f[0] * scale, f[1] * scale, f[2] * scale, f[3] * scale);
    out[2 * i + 1] = make_float4(f[4] * scale, f[5] * scale, f[6] * scale, f[7] * scale);
  }
}

// The scalar norms below are the fallback for rows the vector kernels do not take (n % 4 != 0, misaligned
// pointers, n > 4 * kNormVecs * 1024).
// 1 / sqrt(mean(in^2) + eps) of the row in[0, n), in every thread of the block (scratch: 32 floats).
__device__ float row_inv_rms(const float* in, int64_t n, float eps, float* scratch) {
  float ss = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += in[i] * in[i];
  ss = block_sum(ss, scratch);
  return 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
}

__global__ void rms_norm_kernel(const float* x, int64_t n, const float* w, float eps, nbf* y, int64_t ldy) {
  __shared__ float scratch[32];
  const float* in = x + static_cast<int64_t>(blockIdx.x) * n;
  nbf* out = y + static_cast<int64_t>(blockIdx.x) * ldy;
  const float inv = row_inv_rms(in, n, eps, scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = to_bf(w[i] * (in[i] * inv));
}

__global__ void add_rms_normed_kernel(float* x, const float* o, int64_t n, const float* w, float eps) {
  __shared__ float scratch[32];
  const float* in = o + static_cast<int64_t>(blockIdx.x) * n;
  float* out = x + static_cast<int64_t>(blockIdx.x) * n;
  const float inv = row_inv_rms(in, n, eps, scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] += w[i] * (in[i] * inv);
}

// The vector norms: one block per row, thread t holding the row's float4s t, t + T, ..., t + (kNormVecs - 1) T
// (T = blockDim.x, a multiple of 32) in registers, so the f32 row is read from memory once; 16-byte loads of
// x and w, 8-byte stores of 4 bf16. Requires n % 4 == 0, n <= 4 * kNormVecs * blockDim.x, x (and o) and w
// 16-byte aligned, and for y: ldy % 4 == 0, y 8-byte aligned. Per element the arithmetic is the scalar
// kernels' (w * (x * inv), rounded once); the sum of squares is accumulated in another order (per thread over
// its 4 kNormVecs values, then the block), so inv may differ from the scalar kernel's in the last bit.
constexpr int kNormVecs = 4;

__device__ __forceinline__ float sum_squares(const float4 (&v)[kNormVecs]) {
  float ss = 0;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    ss += v[k].x * v[k].x;
    ss += v[k].y * v[k].y;
    ss += v[k].z * v[k].z;
    ss += v[k].w * v[k].w;
  }
  return ss;
}

__global__ void __launch_bounds__(1024)
    rms_norm_vec_kernel(const float* x, int n4, const float* w, float eps, nbf* y, int64_t ldy) {
  __shared__ float scratch[32];
  const float4* in = reinterpret_cast<const float4*>(x) + static_cast<int64_t>(blockIdx.x) * n4;
  float4 v[kNormVecs];
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < n4 ? __ldg(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const float ss = block_sum(sum_squares(v), scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(4 * n4) + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  uint2* out = reinterpret_cast<uint2*>(y + static_cast<int64_t>(blockIdx.x) * ldy);
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 g = __ldg(w4 + i);
      out[i] = make_uint2(pack_bf2(g.x * (v[k].x * inv), g.y * (v[k].y * inv)),
                          pack_bf2(g.z * (v[k].z * inv), g.w * (v[k].w * inv)));
    }
  }
}

// rms_norm_vec_kernel (the same sum, inv and bf16 values; y written unless null) and those bf16 values' FP8 E4M3
// codes with a scale per row (q [rows, 4 n4] contiguous, scales [rows]): the amax over the row's bf16 values, then
// fp8_codes.cuh's arithmetic, as quantize_e4m3_rows computes them from y in memory — one pass instead of two.
__global__ void __launch_bounds__(1024) rms_norm_fp8_kernel(const float* x, int n4, const float* w, float eps, nbf* y,
                                                            int64_t ldy, uint8_t* q, float* scales) {
  __shared__ float scratch[32];
  const float4* in = reinterpret_cast<const float4*>(x) + static_cast<int64_t>(blockIdx.x) * n4;
  float4 v[kNormVecs];
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < n4 ? __ldg(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const float ss = block_sum(sum_squares(v), scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(4 * n4) + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  uint2 b[kNormVecs];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    b[k] = make_uint2(0, 0);
    if (i < n4) {
      const float4 g = __ldg(w4 + i);
      b[k] = make_uint2(pack_bf2(g.x * (v[k].x * inv), g.y * (v[k].y * inv)),
                        pack_bf2(g.z * (v[k].z * inv), g.w * (v[k].w * inv)));
      if (y != nullptr) reinterpret_cast<uint2*>(y + static_cast<int64_t>(blockIdx.x) * ldy)[i] = b[k];
      amax = fmaxf(fmaxf(amax, fabsf(bf_lo(b[k].x))), fmaxf(fabsf(bf_hi(b[k].x)), fabsf(bf_lo(b[k].y))));
      amax = fmaxf(amax, fabsf(bf_hi(b[k].y)));
    }
  }
  amax = block_max(amax, scratch);
  const float qinv = fp8::row_inverse_scale(amax, threadIdx.x == 0 ? scales + blockIdx.x : nullptr);
  uint32_t* qr = reinterpret_cast<uint32_t*>(q) + static_cast<int64_t>(blockIdx.x) * n4;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) qr[i] = fp8::encode4(bf_lo(b[k].x), bf_hi(b[k].x), bf_lo(b[k].y), bf_hi(b[k].y), qinv);
  }
}

// x += w * (o * inv), as the scalar kernel's fma(w, o * inv, x) (written out, so that contraction cannot differ).
__global__ void __launch_bounds__(1024)
    add_rms_normed_vec_kernel(float* x, const float* o, int n4, const float* w, float eps) {
  __shared__ float scratch[32];
  const float4* in = reinterpret_cast<const float4*>(o) + static_cast<int64_t>(blockIdx.x) * n4;
  float4* out = reinterpret_cast<float4*>(x) + static_cast<int64_t>(blockIdx.x) * n4;
  float4 v[kNormVecs], r[kNormVecs];
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    const bool ok = i < n4;
    v[k] = ok ? __ldg(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    r[k] = ok ? out[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // the residual, loaded before the reduction
  }
  const float ss = block_sum(sum_squares(v), scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(4 * n4) + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 g = __ldg(w4 + i);
      out[i] = make_float4(
          __fmaf_rn(g.x, __fmul_rn(v[k].x, inv), r[k].x), __fmaf_rn(g.y, __fmul_rn(v[k].y, inv), r[k].y),
          __fmaf_rn(g.z, __fmul_rn(v[k].z, inv), r[k].z), __fmaf_rn(g.w, __fmul_rn(v[k].w, inv), r[k].w));
    }
  }
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

// The vector QK-norm + RoPE: no shared memory. A thread owns the 8-column chunk j of both halves of a head
// (columns [8j, 8j + 8) and [half + 8j, half + 8j + 8)), i.e. complete rotate_half pairs, for kRopeHeads heads
// (slot, slot + slots, ...): it reads its cos/sin (and norm weight) columns once and keeps them in registers for
// all its heads, and loads every head's 2 x 16 bytes before computing. The head's sum of squares (QK-norm) is
// reduced over the `chunks` = half / 8 lanes that own the head (consecutive lanes, a power of two <= 32) by
// shuffles. Block: blockDim.x = chunks * slots (a power of two <= 256) threads per row, blockDim.y rows.
// Requires half % 8 == 0, x and row_stride * 2 bytes 16-byte aligned, the tables (and norm_w) 16-byte
// aligned. Per element the arithmetic is the scalar kernel's (written out as it compiles there: lo =
// fma(a, c, -(b * s)), hi = fma(b, c, a * s)); the QK-norm's sum of squares is accumulated in another order.
constexpr int kRopeHeads = 4;

template <bool kNorm>
__global__ void __launch_bounds__(256)
    qk_norm_rope_vec_kernel(nbf* x, int64_t rows, int64_t row_stride, int heads, int half, int chunk_shift, int slots,
                            const float* norm_w, float eps, const float* cos_t, const float* sin_t) {
  const int chunks = 1 << chunk_shift;
  const int j = static_cast<int>(threadIdx.x) & (chunks - 1), slot = static_cast<int>(threadIdx.x) >> chunk_shift;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_ok = r < rows;
  const int d = 2 * half, col = 8 * j;
  float c[8] = {}, s[8] = {};
  if (row_ok) {
    load8(cos_t + r * half + col, c);
    load8(sin_t + r * half + col, s);
  }
  float wa[8] = {}, wb[8] = {};
  if constexpr (kNorm) {
    load8(norm_w + col, wa);
    load8(norm_w + half + col, wb);
  }
  nbf* row = x + (row_ok ? r : 0) * row_stride;
  uint4 va[kRopeHeads], vb[kRopeHeads];
#pragma unroll
  for (int k = 0; k < kRopeHeads; ++k) {
    const int h = slot + k * slots;
    const bool ok = row_ok && h < heads;
    va[k] = ok ? *reinterpret_cast<const uint4*>(row + h * d + col) : make_uint4(0, 0, 0, 0);
    vb[k] = ok ? *reinterpret_cast<const uint4*>(row + h * d + half + col) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kRopeHeads; ++k) {
    float a[8], b[8];
    unpack8(va[k], a);
    unpack8(vb[k], b);
    if constexpr (kNorm) {
      float ss = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += a[i] * a[i];
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += b[i] * b[i];
      for (int o = chunks >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // every lane runs it
      const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        a[i] = wa[i] * (a[i] * inv);
        b[i] = wb[i] * (b[i] * inv);
      }
    }
    float lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = __fmaf_rn(a[i], c[i], -__fmul_rn(b[i], s[i]));
      hi[i] = __fmaf_rn(b[i], c[i], __fmul_rn(a[i], s[i]));
    }
    const int h = slot + k * slots;
    if (row_ok && h < heads) {
      *reinterpret_cast<uint4*>(row + h * d + col) = pack8(lo);
      *reinterpret_cast<uint4*>(row + h * d + half + col) = pack8(hi);
    }
  }
}

// Rows over blockIdx.y, columns over x: no division per element.
__global__ void add_bias_kernel(nbf* y, int64_t rows, int64_t cols, int64_t ld, const float* bias) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    nbf* row = y + r * ld;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      row[c] = to_bf(to_f(row[c]) + bias[c]);
  }
}

template <GateActivation kAct>
__device__ __forceinline__ float gate_activation(float g) {
  if constexpr (kAct == GateActivation::kSiLU) {
    return g / (1.0f + expf(-g));
  } else if constexpr (kAct == GateActivation::kGeluTanh) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
  } else {
    return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
  }
}

// The scalar fallback (f % 8 != 0 or gu not 16-byte aligned). Rows over blockIdx.y, columns over x: no
// division per element.
template <GateActivation kAct>
__global__ void gated_activation_kernel(nbf* gu, int64_t rows, int64_t f) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    nbf* row = gu + r * 2 * f;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < f;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float g = to_f(row[c]), u = to_f(row[f + c]);
      row[c] = to_bf(gate_activation<kAct>(g) * u);
    }
  }
}

// The vector activation: f % 8 == 0, gu 16-byte aligned. Thread (x) owns the 8 columns [8c, 8c + 8) of the
// gate and the up half of two rows (r0, r0 + 1, rows over y in steps of 2 * gridDim.y): four 16-byte loads in
// flight, two 16-byte stores. Per element the scalar kernel's arithmetic.
template <GateActivation kAct>
__device__ __forceinline__ uint4 gated8(const uint4& gv, const uint4& uv) {
  float g[8], u[8];
  unpack8(gv, g);
  unpack8(uv, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) g[i] = gate_activation<kAct>(g[i]) * u[i];
  return pack8(g);
}

template <GateActivation kAct>
__global__ void __launch_bounds__(256) gated_activation_vec_kernel(nbf* gu, int64_t rows, int f8) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= f8) return;
  for (int64_t r0 = 2 * static_cast<int64_t>(blockIdx.y); r0 < rows; r0 += 2 * static_cast<int64_t>(gridDim.y)) {
    uint4* p = reinterpret_cast<uint4*>(gu) + r0 * 2 * f8 + c;  // row r0's gate chunk; its up chunk at p + f8
    const bool two = r0 + 1 < rows;
    const uint4 g0 = p[0], u0 = p[f8];
    uint4 g1 = make_uint4(0, 0, 0, 0), u1 = g1;
    if (two) {
      g1 = p[2 * f8];
      u1 = p[3 * f8];
    }
    p[0] = gated8<kAct>(g0, u0);
    if (two) p[2 * f8] = gated8<kAct>(g1, u1);
  }
}

// gated_activation_vec_kernel's values (gated8) of one row per CTA, kept in registers, and their FP8 E4M3 codes with
// the row's scale (q [rows, 8 f8], scales [rows]): quantize_e4m3_rows' codes of the activation's bf16 rows, bit for
// bit, without writing them (unless write_bf16) and reading them back. Rows of up to kActThreads * kActGroups * 8.
constexpr int kActThreads = 512, kActGroups = 8;
template <GateActivation kAct>
__global__ void __launch_bounds__(kActThreads) gated_activation_fp8_kernel(nbf* gu, int f8, bool write_bf16, uint8_t* q,
                                                                          float* scales) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  uint4* row = reinterpret_cast<uint4*>(gu) + r * 2 * f8;  // the gate's chunks; the up half at row + f8
  uint4 g[kActGroups];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kActGroups; ++k) {
    const int c = threadIdx.x + k * kActThreads;
    g[k] = make_uint4(0, 0, 0, 0);
    if (c < f8) {
      g[k] = gated8<kAct>(row[c], row[f8 + c]);
      if (write_bf16) row[c] = g[k];
      float f[8];
      unpack8(g[k], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
    }
  }
  amax = block_max(amax, scratch);
  const float qinv = fp8::row_inverse_scale(amax, threadIdx.x == 0 ? scales + r : nullptr);
  uint2* qr = reinterpret_cast<uint2*>(q + r * 8 * static_cast<int64_t>(f8));
#pragma unroll
  for (int k = 0; k < kActGroups; ++k) {
    const int c = threadIdx.x + k * kActThreads;
    if (c < f8) {
      float f[8];
      unpack8(g[k], f);
      qr[c] = fp8::encode8(f, qinv);
    }
  }
}

__global__ void softcap_kernel(float* x, int64_t n, float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = cap * tanhf(x[i] / cap);
}

// One block per row: each thread scans a strided slice keeping (value, index), then the block reduces; "better"
// is the larger value, on equal values the smaller index, so the result is the sequential scan's.
constexpr int kArgmaxThreads = 512;
__global__ void __launch_bounds__(kArgmaxThreads) row_argmax_kernel(const float* x, int64_t n, int64_t ld,
                                                                     int32_t* out) {
  __shared__ float bv[kArgmaxThreads / 32];
  __shared__ int64_t bi[kArgmaxThreads / 32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * ld;
  float v = -INFINITY;
  int64_t idx = -1;
  for (int64_t i = threadIdx.x; i < n; i += kArgmaxThreads) {
    const float y = row[i];
    if (y > v || (idx < 0 && y == v)) {  // strided: a thread's indices only grow, so ties keep its first
      v = y;
      idx = i;
    }
  }
  auto better = [](float av, int64_t ai, float bv_, int64_t bi_) {
    if (bi_ < 0) return true;
    if (ai < 0) return false;
    return av > bv_ || (av == bv_ && ai < bi_);
  };
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_down_sync(0xffffffffu, v, off);
    const int64_t oi = __shfl_down_sync(0xffffffffu, idx, off);
    if (!better(v, idx, ov, oi)) {
      v = ov;
      idx = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    bv[warp] = v;
    bi[warp] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w)
      if (!better(v, idx, bv[w], bi[w])) {
        v = bv[w];
        idx = bi[w];
      }
    out[blockIdx.x] = static_cast<int32_t>(idx < 0 ? 0 : idx);
  }
}

// row_logprobs: one CTA a row, two passes over it (the maximum, then the exponentials' sum in f64), each reduced by
// warp shuffles and then across the warps in shared memory.
constexpr int kLogprobThreads = 512;
__global__ void __launch_bounds__(kLogprobThreads) row_logprobs_kernel(const float* x, int64_t n, int64_t ld,
                                                                       const int32_t* next, double* out) {
  __shared__ float wmax[kLogprobThreads / 32];
  __shared__ double wsum[kLogprobThreads / 32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += kLogprobThreads) mx = fmaxf(mx, row[i]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) wmax[warp] = mx;
  __syncthreads();
  mx = wmax[0];
  for (int w = 1; w < kLogprobThreads / 32; ++w) mx = fmaxf(mx, wmax[w]);
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kLogprobThreads) sum += static_cast<double>(expf(row[i] - mx));
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) wsum[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kLogprobThreads / 32; ++w) total += wsum[w];
    out[blockIdx.x] = (static_cast<double>(row[next[blockIdx.x]]) - mx) - log(total);
  }
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

// Threads per block of the vector norms for rows of n f32 (a multiple of 32, kNormVecs float4s each), or 0 when
// the row needs the scalar kernel.
int norm_vec_threads(int64_t n) {
  if (n <= 0 || n % 4 != 0 || n > int64_t{4} * kNormVecs * 1024) return 0;
  const int64_t per_thread = 4 * kNormVecs;
  return static_cast<int>(std::max<int64_t>(32, ((n + per_thread - 1) / per_thread + 31) / 32 * 32));
}

}  // namespace

void embed_tokens(const int32_t* tokens, int64_t n, const bf16* table, int64_t hidden, float scale, float* x,
                  cudaStream_t stream) {
  if (n <= 0) return;
  check_rows(n, "embed_tokens");
  if (hidden % 8 == 0 && vector_ok(table) && vector_ok(x)) {
    const int64_t hidden8 = hidden / 8;
    const int threads = static_cast<int>(std::min<int64_t>(256, (hidden8 + 31) / 32 * 32));
    embed_vec_kernel<<<static_cast<unsigned>(n), threads, 0, stream>>>(tokens, dev(table), hidden8, scale, x);
  } else {
    embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(tokens, dev(table), hidden, scale, x);
  }
  check_launch("embed_tokens");
}

void embed_tokens(const int32_t* tokens, int64_t n, const float* table, int64_t hidden, float scale, float* x,
                  cudaStream_t stream) {
  if (n <= 0) return;
  check_rows(n, "embed_tokens");
  embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(tokens, table, hidden, scale, x);
  check_launch("embed_tokens");
}

void rms_norm_to_bf16(const float* x, int64_t rows, int64_t n, const float* w, float eps, bf16* y, int64_t ldy,
                      cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "rms_norm");
  const int threads = norm_vec_threads(n);
  if (threads > 0 && vector_ok(x) && vector_ok(w) && ldy % 4 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0)
    rms_norm_vec_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, static_cast<int>(n / 4), w, eps,
                                                                              dev(y), ldy);
  else
    rms_norm_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(x, n, w, eps, dev(y), ldy);
  check_launch("rms_norm");
}

bool rms_norm_to_fp8_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, bf16* y, int64_t ldy,
                          uint8_t* q, float* scales, cudaStream_t stream) {
  const int threads = norm_vec_threads(n);
  const bool y_ok = y == nullptr || (ldy % 4 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0);
  if (threads <= 0 || n % 8 != 0 || !vector_ok(x) || !vector_ok(w) || !y_ok || reinterpret_cast<uintptr_t>(q) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(scales) % 16 != 0)
    return false;
  if (rows <= 0) return true;
  check_rows(rows, "rms_norm_to_fp8_rows");
  rms_norm_fp8_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, static_cast<int>(n / 4), w, eps, dev(y),
                                                                          ldy, q, scales);
  check_launch("rms_norm_to_fp8_rows");
  return true;
}

void add_rms_normed(float* x, const float* o, int64_t rows, int64_t n, const float* w, float eps,
                    cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "add_rms_normed");
  const int threads = norm_vec_threads(n);
  if (threads > 0 && vector_ok(x) && vector_ok(o) && vector_ok(w))
    add_rms_normed_vec_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, o, static_cast<int>(n / 4), w,
                                                                                    eps);
  else
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
  check(heads > 0, "qk_norm_rope: no heads");
  const int half = head_dim / 2;
  if (half % 8 == 0 && half / 8 <= 32 && row_stride % 8 == 0 && vector_ok(x) && vector_ok(cos) && vector_ok(sin) &&
      (norm_w == nullptr || vector_ok(norm_w))) {
    const int chunks = half / 8;  // a power of two? (then the lanes of a head are a shuffle group)
    int slots = 1;
    while (slots * kRopeHeads < heads) slots *= 2;
    if ((chunks & (chunks - 1)) == 0 && chunks * slots <= 256) {
      int shift = 0;
      while ((1 << shift) < chunks) ++shift;
      const dim3 block(static_cast<unsigned>(chunks * slots), static_cast<unsigned>(256 / (chunks * slots)));
      const int64_t blocks = (rows + block.y - 1) / block.y;
      if (norm_w != nullptr)
        qk_norm_rope_vec_kernel<true><<<static_cast<unsigned>(blocks), block, 0, stream>>>(
            dev(x), rows, row_stride, heads, half, shift, slots, norm_w, eps, cos, sin);
      else
        qk_norm_rope_vec_kernel<false><<<static_cast<unsigned>(blocks), block, 0, stream>>>(
            dev(x), rows, row_stride, heads, half, shift, slots, norm_w, eps, cos, sin);
      check_launch("qk_norm_rope");
      return;
    }
  }
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
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + 255) / 256, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  add_bias_kernel<<<grid, 256, 0, stream>>>(dev(y), rows, cols, ld, bias);
  check_launch("add_bias");
}

void gated_activation(bf16* gu, int64_t rows, int64_t f, GateActivation act, cudaStream_t stream) {
  if (rows <= 0 || f <= 0) return;
  if (f % 8 == 0 && f / 8 <= (int64_t{1} << 30) && vector_ok(gu)) {
    const int f8 = static_cast<int>(f / 8);
    const int threads = static_cast<int>(std::min<int64_t>(256, (f8 + 31) / 32 * 32));
    const dim3 vgrid(static_cast<unsigned>((f8 + threads - 1) / threads),
                     static_cast<unsigned>(std::min<int64_t>((rows + 1) / 2, 65535)));
    switch (act) {
      case GateActivation::kSiLU:
        gated_activation_vec_kernel<GateActivation::kSiLU><<<vgrid, threads, 0, stream>>>(dev(gu), rows, f8);
        break;
      case GateActivation::kGeluTanh:
        gated_activation_vec_kernel<GateActivation::kGeluTanh><<<vgrid, threads, 0, stream>>>(dev(gu), rows, f8);
        break;
      case GateActivation::kGelu:
        gated_activation_vec_kernel<GateActivation::kGelu><<<vgrid, threads, 0, stream>>>(dev(gu), rows, f8);
        break;
    }
    check_launch("gated_activation");
    return;
  }
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

bool gated_activation_fp8_rows(bf16* gu, int64_t rows, int64_t f, GateActivation act, bool write_bf16, uint8_t* q,
                               float* scales, cudaStream_t stream) {
  if (f <= 0 || f % 8 != 0 || f / 8 > int64_t{kActThreads} * kActGroups || !vector_ok(gu) ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(scales) % 16 != 0)
    return false;
  if (rows <= 0) return true;
  check_rows(rows, "gated_activation_fp8_rows");
  const int f8 = static_cast<int>(f / 8);
  const auto grid = static_cast<unsigned>(rows);
  switch (act) {
    case GateActivation::kSiLU:
      gated_activation_fp8_kernel<GateActivation::kSiLU><<<grid, kActThreads, 0, stream>>>(dev(gu), f8, write_bf16, q, scales);
      break;
    case GateActivation::kGeluTanh:
      gated_activation_fp8_kernel<GateActivation::kGeluTanh><<<grid, kActThreads, 0, stream>>>(dev(gu), f8, write_bf16, q,
                                                                                                 scales);
      break;
    case GateActivation::kGelu:
      gated_activation_fp8_kernel<GateActivation::kGelu><<<grid, kActThreads, 0, stream>>>(dev(gu), f8, write_bf16, q, scales);
      break;
  }
  check_launch("gated_activation_fp8_rows");
  return true;
}

void softcap(float* x, int64_t n, float cap, cudaStream_t stream) {
  if (n <= 0) return;
  softcap_kernel<<<grid_for(n), 256, 0, stream>>>(x, n, cap);
  check_launch("softcap");
}

void row_logprobs(const float* x, int64_t rows, int64_t n, int64_t ld, const int32_t* next, double* out,
                  cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "row_logprobs");
  check(n > 0 && ld >= n, "row_logprobs: bad row size " + std::to_string(n));
  row_logprobs_kernel<<<static_cast<unsigned>(rows), kLogprobThreads, 0, stream>>>(x, n, ld, next, out);
  check_launch("row_logprobs");
}

void row_argmax(const float* x, int64_t rows, int64_t n, int64_t ld, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return;
  check_rows(rows, "row_argmax");
  check(n > 0 && n <= INT32_MAX && ld >= n, "row_argmax: bad row size " + std::to_string(n));
  row_argmax_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, stream>>>(x, n, ld, out);
  check_launch("row_argmax");
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

void force_scalar_kernels(bool on) { g_force_scalar = on; }

void f32_to_bf16(const float* x, int64_t n, bf16* y, cudaStream_t stream) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(x, n, dev(y));
  check_launch("f32_to_bf16");
}

}  // namespace tessera::runtime::gpu
