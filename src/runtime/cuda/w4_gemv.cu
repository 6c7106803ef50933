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

// Where element e (0-7) of a code word sits: even elements in the low half-word, odd ones in the high (w4_gemv.h).
__host__ __device__ inline int code_bit(int e) { return 16 * (e & 1) + 4 * (e >> 1); }

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
  // Lanes 2i and 2i + 1 hold elements 0-3 and 4-7 of the group's word i (element e at bit code_bit(e)).
  uint32_t part = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) part |= group_code(v[i], p) << code_bit((lane & 1) * 4 + i);
  const uint32_t word = part | __shfl_xor_sync(0xffffffffu, part, 1);
  if ((lane & 1) == 0) *reinterpret_cast<uint32_t*>(codes + r * (cols / 2) + c0 / 2) = word;
  if (lane == 0) params[g] = p;
}

// ---- the product

constexpr int kRows = 16;   // output channels a block computes (the MMA's M)
constexpr int kWarps = 8;   // warps of a block: warp w takes groups w, w + kWarps, ... of the block's rows (split K)
constexpr int kUnroll = 4;  // groups a warp has in flight

// The nibbles at bits 0-3 and 16-19 of w in the mantissas of two bf16 of exponent 2^7: the pair (128 + q0, 128 + q1).
__device__ __forceinline__ uint32_t nibbles_to_bf16x2(uint32_t w) { return (w & 0x000F000Fu) | 0x43004300u; }
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_of(float v) {
  const __nv_bfloat162 h = __float2bfloat162_rn(v);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// d += a b: mma.sync m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The MMA's A is a [16 channels, 16] tile of the weights as exact bf16 integers q - z, its B the [16, 8] tile of the
// activation rows (the columns of rows >= m are zeros: they change no other column), D [16, 8] in f32. Lane (g, t) =
// (lane / 4, lane % 4) holds A's rows g and g + 8 at the MMA's k = 2t, 2t + 1, 2t + 8, 2t + 9 and B's column g there;
// k is mapped so that step s of a group reads its elements 32 t + 4 s + (0, 1, 2, 3): a lane's 16-byte run of a row's
// codes (elements 32 t .. 32 t + 31 of the group; word w holds steps 2w and 2w + 1, even elements in the low
// half-word) and its 64 bytes of x are the same 32 elements. A group's 8 steps accumulate from zero (the tensor
// cores' f32 sums), then acc += s * part per channel.
__global__ void __launch_bounds__(kWarps * 32)
    gemv_w4a16_kernel(const nbf* x, int64_t ldx, int m, const uint8_t* codes, const uint32_t* params, int64_t out,
                      int64_t in, void* y, bool y_f32, int64_t ldy, float beta) {
  __shared__ float red[kWarps][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t groups = in / kW4Group;
  const int64_t ra = o0 + g < out ? o0 + g : out - 1, rb = o0 + g + 8 < out ? o0 + g + 8 : out - 1;
  const uint4* wa = reinterpret_cast<const uint4*>(codes + ra * (in / 2)) + t;  // group j's run: wa + 4 j
  const uint4* wb = reinterpret_cast<const uint4*>(codes + rb * (in / 2)) + t;
  const uint32_t* pa = params + ra * groups;
  const uint32_t* pb = params + rb * groups;
  const bool has_x = g < m;
  const uint4* xr = reinterpret_cast<const uint4*>(x + (has_x ? g : 0) * ldx) + 4 * t;  // group j's 32: xr + 16 j
  constexpr uint32_t kOne = 0x3F803F80u;  // bf16x2 (1, 1)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t j0 = warp; j0 < groups; j0 += kWarps * kUnroll) {
    uint4 va[kUnroll], vb[kUnroll];
    uint32_t sa[kUnroll], sb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * kWarps;
      const bool ok = j < groups;
      va[u] = ok ? __ldcs(wa + 4 * j) : make_uint4(0, 0, 0, 0);  // read once: do not keep in L1
      vb[u] = ok ? __ldcs(wb + 4 * j) : make_uint4(0, 0, 0, 0);
      sa[u] = ok ? __ldcs(pa + j) : 0u;
      sb[u] = ok ? __ldcs(pb + j) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * kWarps;
      if (j >= groups) break;
      uint4 xv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) xv[q] = has_x ? __ldg(xr + 16 * j + q) : make_uint4(0, 0, 0, 0);
      const float za = static_cast<float>(sa[u] >> 16), zb = static_cast<float>(sb[u] >> 16);
      const uint32_t ca = bf16x2_of(-(128.0f + za)), cb = bf16x2_of(-(128.0f + zb));  // exact: 8 significant bits
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t ua = w == 0 ? va[u].x : w == 1 ? va[u].y : w == 2 ? va[u].z : va[u].w;
        const uint32_t ub = w == 0 ? vb[u].x : w == 1 ? vb[u].y : w == 2 ? vb[u].z : vb[u].w;
        // Step 2w: elements 0-3 of the word (bits 0-3, 16-19 | 4-7, 20-23), x elements 8w .. 8w + 3; step 2w + 1:
        // elements 4-7 (8 and 12 bits up), x 8w + 4 .. 8w + 7. Each pair: fma(128 + q, 1, -(128 + z)) = q - z.
        mma_bf16(part, fma_bf16x2(nibbles_to_bf16x2(ua), kOne, ca), fma_bf16x2(nibbles_to_bf16x2(ub), kOne, cb),
                 fma_bf16x2(nibbles_to_bf16x2(ua >> 4), kOne, ca), fma_bf16x2(nibbles_to_bf16x2(ub >> 4), kOne, cb),
                 xv[w].x, xv[w].y);
        mma_bf16(part, fma_bf16x2(nibbles_to_bf16x2(ua >> 8), kOne, ca),
                 fma_bf16x2(nibbles_to_bf16x2(ub >> 8), kOne, cb), fma_bf16x2(nibbles_to_bf16x2(ua >> 12), kOne, ca),
                 fma_bf16x2(nibbles_to_bf16x2(ub >> 12), kOne, cb), xv[w].z, xv[w].w);
      }
      const float s_a = __uint_as_float(sa[u] << 16), s_b = __uint_as_float(sb[u] << 16);
      acc[0] = fmaf(s_a, part[0], acc[0]);
      acc[1] = fmaf(s_a, part[1], acc[1]);
      acc[2] = fmaf(s_b, part[2], acc[2]);
      acc[3] = fmaf(s_b, part[3], acc[3]);
    }
  }
  // The warps' sums in a fixed order (the same for every row count); lane (g, t) of warp 0 holds channels o0 + g and
  // o0 + g + 8 of activation rows 2t and 2t + 1.
#pragma unroll
  for (int c = 0; c < 4; ++c) red[warp][lane][c] = acc[c];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float sum = red[0][lane][c];
#pragma unroll
    for (int v = 1; v < kWarps; ++v) sum += red[v][lane][c];
    const int64_t o = o0 + g + (c >= 2 ? 8 : 0);
    const int i = 2 * t + (c & 1);
    if (o >= out || i >= m) continue;
    if (y_f32) {
      float* yo = static_cast<float*>(y) + i * ldy + o;
      *yo = beta == 0.0f ? sum : __fadd_rn(sum, __fmul_rn(beta, *yo));
    } else {
      static_cast<nbf*>(y)[i * ldy + o] = __float2bfloat16_rn(sum);
    }
  }
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
      for (int64_t c = 0; c < kW4Group; c += 8) {
        uint32_t word = 0;
        for (int e = 0; e < 8; ++e) word |= group_code(bf16_to_f32(src[c + e]), p) << code_bit(e);
        std::memcpy(dst + c / 2, &word, sizeof word);  // little-endian, as the device stores it
      }
    }
}

float w4_value(const uint8_t* codes, const uint32_t* params, int64_t cols, int64_t r, int64_t c) {
  uint32_t word;
  std::memcpy(&word, codes + r * (cols / 2) + c / 8 * 4, sizeof word);
  const int q = static_cast<int>((word >> code_bit(static_cast<int>(c % 8))) & 0xF);
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
  const auto blocks = static_cast<unsigned>((w.rows + kRows - 1) / kRows);
  gemv_w4a16_kernel<<<blocks, kWarps * 32, 0, stream>>>(reinterpret_cast<const nbf*>(x), ldx, static_cast<int>(m),
                                                        w.codes, w.params, w.rows, w.cols, y, y_f32, ldy, beta);
  check_launch("gemv_w4a16");
}

}  // namespace tessera::runtime::gpu
