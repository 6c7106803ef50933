#include "runtime/cuda/w4_gemv.h"

#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

namespace {

using attn::gpu::check_launch;
using nbf = __nv_bfloat16;

// ---- the group quantization, one function for the device and the host (the same operations: equal bits)

__host__ __device__ inline uint32_t as_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
__host__ __device__ inline float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
__host__ __device__ inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// f32 to bf16 bits, round to nearest even (core/dtype.h's f32_to_bf16; finite and infinite values).
__host__ __device__ inline uint32_t bf16_bits_rn(float f) {
  const uint32_t u = as_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// A group's parameter word from lo = min(its weights, 0) and hi = max(its weights, 0) (w4_gemv.h).
__host__ __device__ inline uint32_t group_param(float lo, float hi) {
  const uint32_t sb = bf16_bits_rn(div_rn(hi - lo, 15.0f));
  const float s = from_bits(sb << 16);
  uint32_t z = 0;
  if (s > 0.0f) z = static_cast<uint32_t>(fminf(fmaxf(rintf(div_rn(-lo, s)), 0.0f), 15.0f));
  return sb | (z << 16);
}
__host__ __device__ inline uint32_t group_code(float w, uint32_t param) {
  const float s = from_bits(param << 16);
  if (!(s > 0.0f)) return param >> 16;
  const float z = static_cast<float>(param >> 16);
  return static_cast<uint32_t>(fminf(fmaxf(rintf(div_rn(w, s)) + z, 0.0f), 15.0f));
}

constexpr int kQuantWarps = 8;  // groups a block of quantize_w4 takes (a warp each)

__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_w4_kernel(const nbf* w, int64_t ldw, int64_t rows, int64_t cols, uint8_t* codes, uint32_t* params) {
  const int64_t groups = cols / kW4Group;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  if (g >= rows * groups) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = g / groups, c0 = (g % groups) * kW4Group + lane * 4;
  const nbf* src = w + r * ldw + c0;
  float v[4];
  float lo = 0.0f, hi = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = __bfloat162float(src[i]);
    lo = fminf(lo, v[i]);
    hi = fmaxf(hi, v[i]);
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, s));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, s));
  }
  const uint32_t p = group_param(lo, hi);
  uint32_t q = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) q |= group_code(v[i], p) << (4 * i);
  *reinterpret_cast<uint16_t*>(codes + r * (cols / 2) + c0 / 2) = static_cast<uint16_t>(q);
  if (lane == 0) params[g] = p;
}

// ---- the product

constexpr int kRows = 4;    // output channels a block computes
constexpr int kWarps = 4;   // warps of a block: each takes every kWarps-th run of 32 chunks of the rows
constexpr int kUnroll = 2;  // 16-byte chunks of each weight row a lane has in flight

// The 8 weights of one code word (nibble j: element j), each s * (q - z) exactly: the nibble placed at mantissa bits
// 8-11, 12-15 or 16-19 under the exponent of 2^15, 2^11 or 2^7 reads 2^E + q, and fma(2^E + q, s, c_E) with c_E =
// -(2^E + z) s (exact: 16 + 8 significant bits at most) is the exact s (q - z). Two integer operations (a shift
// shared by several nibbles, a mask-and-or) and one FMA a weight.
__device__ __forceinline__ void dequant_word(uint32_t w, float s, float c15, float c11, float c7, float (&f)[8]) {
  const uint32_t lo = w << 8, hi = w >> 12;
  f[0] = fmaf(__uint_as_float((lo & 0xF00u) | 0x47000000u), s, c15);
  f[1] = fmaf(__uint_as_float((lo & 0xF000u) | 0x45000000u), s, c11);
  f[2] = fmaf(__uint_as_float((w & 0xF00u) | 0x47000000u), s, c15);
  f[3] = fmaf(__uint_as_float((w & 0xF000u) | 0x45000000u), s, c11);
  f[4] = fmaf(__uint_as_float((w & 0xF0000u) | 0x43000000u), s, c7);
  f[5] = fmaf(__uint_as_float((hi & 0xF00u) | 0x47000000u), s, c15);
  f[6] = fmaf(__uint_as_float((hi & 0xF000u) | 0x45000000u), s, c11);
  f[7] = fmaf(__uint_as_float((hi & 0xF0000u) | 0x43000000u), s, c7);
}

// 8 bf16 activations (one uint4) to floats.
__device__ __forceinline__ void act_to_float(const uint4& a, float (&f)[8]) {
  const uint32_t words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

template <int M>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_w4a16_kernel(const nbf* x, int64_t ldx, const uint8_t* codes, const uint32_t* params, int64_t out,
                      int64_t in, void* y, bool y_f32, int64_t ldy, float beta) {
  __shared__ float red[kWarps][kRows][M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kRows;
  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  const int64_t chunks = in / 32, groups = in / kW4Group;  // a chunk: 16 bytes, 32 weights of one group
  const uint4* wrow[kRows];
  const uint32_t* prow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t o = o0 + r < out ? o0 + r : o0;
    wrow[r] = reinterpret_cast<const uint4*>(codes + o * (in / 2));
    prow[r] = params + o * groups;
  }
  constexpr int kStride = kWarps * 32;
  for (int64_t k0 = warp * 32 + lane; k0 < chunks; k0 += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
    uint32_t pv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t k = k0 + u * kStride;
        const bool in_row = k < chunks;
        wv[u][r] = in_row ? __ldcs(wrow[r] + k) : make_uint4(0, 0, 0, 0);  // read once: do not keep in L1
        pv[u][r] = in_row ? __ldcs(prow[r] + k / 4) : 0u;
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + u * kStride;
      if (k >= chunks) break;
      float s[kRows], c15[kRows], c11[kRows], c7[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s[r] = __uint_as_float(pv[u][r] << 16);
        const float z = static_cast<float>(pv[u][r] >> 16);
        c15[r] = __fmul_rn(-(32768.0f + z), s[r]);
        c11[r] = __fmul_rn(-(2048.0f + z), s[r]);
        c7[r] = __fmul_rn(-(128.0f + z), s[r]);
      }
#pragma unroll
      for (int word = 0; word < 4; ++word) {
        float wf[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const uint32_t bits = word == 0 ? wv[u][r].x : word == 1 ? wv[u][r].y : word == 2 ? wv[u][r].z : wv[u][r].w;
          dequant_word(bits, s[r], c15[r], c11[r], c7[r], wf[r]);
        }
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float xf[8];
          act_to_float(__ldg(reinterpret_cast<const uint4*>(x + i * ldx) + 4 * k + word), xf);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][i] = fmaf(wf[r][j], xf[j], acc[r][i]);
        }
      }
    }
  }
  // The lanes' sums by shuffles, then the warps' in a fixed order: the same for every row count.
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], s);
      if (lane == 0) red[warp][r][i] = acc[r][i];
    }
  __syncthreads();
  if (threadIdx.x >= kRows * M) return;
  const int r = threadIdx.x / M, i = threadIdx.x % M;
  const int64_t o = o0 + r;
  if (o >= out) return;
  float sum = 0.0f;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) sum += red[v][r][i];
  if (y_f32) {
    float* yo = static_cast<float*>(y) + i * ldy + o;
    // Rounded operations, not left to contraction: its choices may differ between instantiations (row counts).
    *yo = beta == 0.0f ? sum : __fadd_rn(sum, __fmul_rn(beta, *yo));
  } else {
    static_cast<nbf*>(y)[i * ldy + o] = __float2bfloat16_rn(sum);
  }
}

template <int M>
void launch(const bf16* x, int64_t ldx, const W4Matrix& w, void* y, bool y_f32, int64_t ldy, float beta,
            cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((w.rows + kRows - 1) / kRows);
  gemv_w4a16_kernel<M><<<blocks, kWarps * 32, 0, stream>>>(reinterpret_cast<const nbf*>(x), ldx, w.codes, w.params,
                                                           w.rows, w.cols, y, y_f32, ldy, beta);
}

}  // namespace

void quantize_w4(const bf16* w, int64_t ldw, int64_t rows, int64_t cols, uint8_t* codes, uint32_t* params,
                 cudaStream_t stream) {
  check(cols % kW4Group == 0 && ldw >= cols,
        "quantize_w4: cols (" + std::to_string(cols) + ") must be a multiple of " + std::to_string(kW4Group) +
            " and ldw (" + std::to_string(ldw) + ") at least cols");
  const int64_t warps = rows * (cols / kW4Group);
  if (warps <= 0) return;
  const auto blocks = static_cast<unsigned>((warps + kQuantWarps - 1) / kQuantWarps);
  quantize_w4_kernel<<<blocks, kQuantWarps * 32, 0, stream>>>(reinterpret_cast<const nbf*>(w), ldw, rows, cols, codes,
                                                             params);
  check_launch("quantize_w4");
}

void quantize_w4_host(const bf16* w, int64_t ldw, int64_t rows, int64_t cols, uint8_t* codes, uint32_t* params) {
  check(cols % kW4Group == 0 && ldw >= cols,
        "quantize_w4_host: cols (" + std::to_string(cols) + ") must be a multiple of " + std::to_string(kW4Group) +
            " and ldw (" + std::to_string(ldw) + ") at least cols");
  const int64_t groups = cols / kW4Group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const bf16* src = w + r * ldw + g * kW4Group;
      float lo = 0.0f, hi = 0.0f;
      for (int64_t c = 0; c < kW4Group; ++c) {
        lo = std::fmin(lo, bf16_to_f32(src[c]));
        hi = std::fmax(hi, bf16_to_f32(src[c]));
      }
      const uint32_t p = group_param(lo, hi);
      params[r * groups + g] = p;
      uint8_t* dst = codes + r * (cols / 2) + g * (kW4Group / 2);
      for (int64_t c = 0; c < kW4Group; c += 2)
        dst[c / 2] = static_cast<uint8_t>(group_code(bf16_to_f32(src[c]), p) |
                                          (group_code(bf16_to_f32(src[c + 1]), p) << 4));
    }
}

float w4_value(const uint8_t* codes, const uint32_t* params, int64_t cols, int64_t r, int64_t c) {
  const uint8_t byte = codes[r * (cols / 2) + c / 2];
  const int q = c % 2 == 0 ? byte & 0xF : byte >> 4;
  const uint32_t p = params[r * (cols / kW4Group) + c / kW4Group];
  return from_bits(p << 16) * static_cast<float>(q - static_cast<int>(p >> 16));
}

void gemv_w4a16(const bf16* x, int64_t ldx, int64_t m, const W4Matrix& w, void* y, bool y_f32, int64_t ldy,
                float beta, cudaStream_t stream) {
  if (m <= 0 || w.rows <= 0) return;
  check(m <= kW4Rows, "gemv_w4a16: at most " + std::to_string(kW4Rows) + " rows, got " + std::to_string(m));
  check(w.cols % kW4Group == 0 && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(w.codes) % 16 == 0,
        "gemv_w4a16: in (" + std::to_string(w.cols) + ") must be a multiple of " + std::to_string(kW4Group) +
            " and ldx (" + std::to_string(ldx) + ") of 8, x and the codes 16-byte aligned");
  check(y_f32 || beta == 0.0f, "gemv_w4a16: beta needs an f32 y");
  check(ldy >= w.rows, "gemv_w4a16: ldy below the output width");
  switch (m) {
    case 1: launch<1>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 2: launch<2>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 3: launch<3>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 4: launch<4>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 5: launch<5>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 6: launch<6>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    case 7: launch<7>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
    default: launch<8>(x, ldx, w, y, y_f32, ldy, beta, stream); break;
  }
  check_launch("gemv_w4a16");
}

}  // namespace tessera::runtime::gpu
