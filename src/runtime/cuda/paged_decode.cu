#include "runtime/cuda/paged_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>

#include "attention/cuda/mma_sm80.cuh"
#include "core/enum_names.h"
#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;
using attn::gpu::check_launch;

using attn::gpu::detail::cp_async_16;
using attn::gpu::detail::cp_async_commit;
using attn::gpu::detail::cp_async_wait;
using attn::gpu::detail::fast_exp2;
using attn::gpu::detail::LaneSwizzle;
using attn::gpu::detail::smem_addr;
using attn::gpu::detail::swizzle;

constexpr int kWarps = 4;       // warps of a CTA: pieces of one (row, kv head), sharing its Q tile
constexpr int kTileKeys = 16;   // keys a warp moves and multiplies at a time (one mma k-step of P.V)
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// One query head's visible ranges at `len` keys (runtime/paged_kv.h: DecodeView::ranges).
struct Ranges {
  int64_t a0, a1, b0, b1;
};
__device__ __forceinline__ Ranges view_ranges(const int32_t* v, int64_t len) {
  const int64_t sink = v[0], window = v[1], horizon = v[2];
  Ranges r;
  r.a0 = max64(0, len - horizon);
  r.a1 = max64(r.a0, min64(sink, len));
  r.b0 = max64(max64(r.a1, r.a0), len - window);
  r.b1 = max64(r.b0, len);
  return r;
}

// Stages of the K/V pipeline per warp: ~24 KB of shared memory a warp for head dims up to 128 (two CTAs a
// multiprocessor), 32 KB at 256 (one). FP8 tiles are half the bytes: more stages in about the same memory (with the
// widened f16 tiles: 25 KB a warp at 128, two CTAs; 41 KB at 256, one).
template <int D, bool F8 = false>
constexpr int stages() {
  return F8 ? (D <= 64 ? 6 : D <= 128 ? 4 : 3) : (D <= 64 ? 4 : D <= 128 ? 3 : 2);
}
template <int D>
constexpr int tile_bytes() {
  return kTileKeys * D * 2;  // one K or V tile, bf16
}
// A pipeline stage: the K and V tiles as stored (bf16, or E4M3 codes [16][D] row-major followed by the 16 keys' K
// scales and V scales, f32). FP8 adds per warp one f16 K and V tile (swizzled) that the codes are widened into.
template <int D, bool F8>
constexpr int stage_bytes() {
  return F8 ? 2 * kTileKeys * D + 2 * kTileKeys * 4 : 2 * tile_bytes<D>();
}
template <int D, bool F8>
constexpr int warp_bytes() {
  return stages<D, F8>() * stage_bytes<D, F8>() + (F8 ? 2 * tile_bytes<D>() : 0);
}
template <int D, bool F8>
constexpr size_t smem_bytes() {
  return 16 * D * 2 + static_cast<size_t>(kWarps) * warp_bytes<D, F8>();
}

// cp.async of 4 bytes (an FP8 row's scale), zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// The FP8 kernel multiplies in f16: an E4M3 code's bits moved into an f16 (sign to bit 15, the 4 exponent and 3
// mantissa bits under f16's 5 and 10) are its value times 2^-8, exactly, subnormals included (f16's bias is 15, E4M3's
// 7; an E4M3 subnormal m * 2^-9 lands on the f16 subnormal m * 2^-17). Integer operations only, ~1.5 a code: the
// conversion instructions (cvt e4m3x2 -> f16x2 -> f32 -> bf16x2) ran at a quarter rate and bound the kernel (the FP8
// step was slower than bf16's at 128K). kFp8Unit undoes the 2^-8 in the scales.
constexpr float kFp8Unit = 256.0f;
__device__ __forceinline__ uint32_t codes2_to_f16x2(uint32_t w, uint32_t selector) {
  const uint32_t p = __byte_perm(w, 0, selector);  // [0, code a, 0, code b]: each code the high byte of a half
  return (p & 0x80008000u) | ((p >> 1) & 0x3F803F80u);
}

// Eight E4M3 codes (8 bytes, in order) as eight f16, each the code's value times 2^-8 (above).
__device__ __forceinline__ uint4 widen8(uint2 codes) {
  return make_uint4(codes2_to_f16x2(codes.x, 0x1404), codes2_to_f16x2(codes.x, 0x3424),
                    codes2_to_f16x2(codes.y, 0x1404), codes2_to_f16x2(codes.y, 0x3424));
}

// One warp's [16][D] tile of E4M3 codes (row-major, `codes`) into the swizzled f16 tile at `dst`.
template <int D>
__device__ __forceinline__ void widen_tile(const unsigned char* codes, unsigned char* dst, int lane) {
  constexpr int kGroups = D / 8;  // 8-code groups (one 16-byte bf16 chunk) of a row
#pragma unroll
  for (int j = 0; j < kTileKeys * kGroups / 32; ++j) {
    const int gi = lane + j * 32, r = gi / kGroups, ch = gi % kGroups;
    const uint2 c = *reinterpret_cast<const uint2*>(codes + r * D + ch * 8);
    *reinterpret_cast<uint4*>(dst + 2 * swizzle<D>(r, ch)) = widen8(c);
  }
}

// o[D/8][4] += P[16 rows][16 keys] V[16 keys][D] for one warp, P given as the f32 accumulators of the scores (the
// layout detail::warp_pv reads) and split into two bf16 terms, P = hi + lo with lo = P - hi rounded again: P V then
// carries ~16 bits of P (the f32 P.V of the kernel this one replaced, within 2^-17 relative), not bf16's 8, for two
// mma.sync per V fragment instead of one — the decode step reads bytes, it has tensor-core time to spare.
// v_base: shared address of the V tile plus LaneSwizzle::v_row.
// T: the mma's input type (bf16; f16 for the FP8 kernel, whose P and V are then f16: hi + lo keeps ~22 bits of P).
template <int D, class T = nbf>
__device__ __forceinline__ void warp_pv_split(float (&o)[D / 8][4], const float (&p)[2][4], uint32_t v_base,
                                              const LaneSwizzle& sw) {
  using Mma = attn::gpu::detail::MmaTraits<T>;
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // a0 a1 a2 a3 = p[0][0..1], p[0][2..3], p[1][0..1], p[1][2..3]
    const float x0 = p[r >> 1][(r & 1) * 2], x1 = p[r >> 1][(r & 1) * 2 + 1];
    hi[r] = Mma::pack(x0, x1);
    const T* h = reinterpret_cast<const T*>(&hi[r]);
    lo[r] = Mma::pack(x0 - Mma::to_float(h[0]), x1 - Mma::to_float(h[1]));
  }
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t b[4];
    attn::gpu::detail::ldmatrix_x4_trans(b, v_base + (dp / 4) * 128 + sw.a_off[dp % 4]);
    Mma::mma(o[2 * dp], hi, b[0], b[1]);
    Mma::mma(o[2 * dp], lo, b[0], b[1]);
    Mma::mma(o[2 * dp + 1], hi, b[2], b[3]);
    Mma::mma(o[2 * dp + 1], lo, b[2], b[3]);
  }
}

// grid (ceil(splits / kWarps), kv_heads, rows), kWarps warps. Warp w of CTA x takes piece x * kWarps + w of the
// row's keys for this kv head: a contiguous run of the group's compacted key index, walked in 16-key tiles that
// cp.async brings into the warp's own stages of swizzled shared memory (each key looked up in the block table)
// while the tile before is multiplied: S = Q K^T and O += P V by mma.sync m16n8k16 with Q's 16 rows the group's
// query heads (G <= 8; the rest zero), an online softmax in f32 per head with its own mask. Each warp writes its
// piece's partial output and log-sum-exp; paged_decode_merge_kernel combines the pieces.
// F8: the pools hold E4M3 codes and per-row scales (paged_decode.h); the codes come in by cp.async, are widened to f16
// (times 2^-8, exactly) in the warp's own tile, Q is f16 too, and the scales (times 2^8) multiply the scores (K) and
// the probabilities (V) in f32.
template <int D, bool F8>
__global__ void __launch_bounds__(kWarps * 32) paged_decode_kernel(PagedDecodeArgs a) {
  constexpr int S = stages<D, F8>();
  constexpr int kChunks = F8 ? D / 16 : D / 8;      // 16-byte chunks of a stored row
  constexpr int kPer = kTileKeys * kChunks / 32;    // chunks of a tile per lane
  constexpr int kCodeBytes = kTileKeys * kChunks * 16;  // one stored K or V tile
  using T = std::conditional_t<F8, __half, nbf>;  // the mma's inputs
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  const int G = a.q_heads / a.kv_heads;
  const int kvh = blockIdx.y, row = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = a.row_slot[row];
  const int64_t len = a.row_len[row];

  // Q: the group's G heads as rows of a swizzled [16][D] tile, the other rows zero.
  const nbf* qrow = reinterpret_cast<const nbf*>(a.q) + static_cast<int64_t>(row) * a.q_stride +
                    static_cast<int64_t>(kvh) * G * D;
  for (int i = threadIdx.x; i < 16 * (D / 8); i += kWarps * 32) {
    const int r = i / (D / 8), ch = i % (D / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < G) v = *reinterpret_cast<const uint4*>(qrow + r * D + ch * 8);
    if constexpr (F8) {  // bf16 -> f16: exact within f16's range (|q| <= 65504 kept, beyond it saturated)
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
        const auto sat = [](float x) { return fminf(fmaxf(x, -65504.0f), 65504.0f); };
        const __half2 h = __floats2half2_rn(sat(f.x), sat(f.y));
        w[j] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    *reinterpret_cast<uint4*>(qs + swizzle<D>(r, ch)) = v;
  }
  __syncthreads();
  const int piece = blockIdx.x * kWarps + warp;
  if (piece >= a.splits) return;

  // The group's union of visible keys, [lo, A1) u [B0, len), as one compacted index; this lane's head
  // (row g = lane / 4 of the mma fragments) and its own ranges.
  const int g = lane >> 2, c = lane & 3;
  const int32_t* views = a.views + (static_cast<int64_t>(slot) * a.num_layers * a.q_heads +
                                    static_cast<int64_t>(a.layer) * a.q_heads + static_cast<int64_t>(kvh) * G) * 3;
  int64_t lo = len, A1 = 0, B0 = len;
  Ranges mine{0, 0, 0, 0};
  for (int h = 0; h < G; ++h) {
    const Ranges r = view_ranges(views + h * 3, len);
    if (h == g) mine = r;
    lo = min64(lo, r.a0);  // the same for every head of a layer (the layer's horizon) in a model
    A1 = max64(A1, r.a1);
    B0 = min64(B0, r.b0);
  }
  A1 = max64(A1, lo);
  const int64_t second = max64(B0, A1);
  const int64_t n_first = A1 - lo, n_keys = n_first + (len - second);
  // The row's own pieces: no more than its keys fill at kPagedDecodeMinPieceKeys each (what paged_decode_splits
  // allows the longest row), so a short row is cut alike alone and beside a long one (the same sums: a sequence
  // decodes the same alone or batched wherever the batch's splits allow its length's).
  const int64_t pieces = min64(a.splits, max64(1, n_keys / kPagedDecodeMinPieceKeys));
  const int64_t per = ((n_keys + pieces - 1) / pieces + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int64_t i_begin = min64(n_keys, static_cast<int64_t>(piece) * per), i_end = min64(n_keys, i_begin + per);
  const int tiles = static_cast<int>((i_end - i_begin + kTileKeys - 1) / kTileKeys);

  const int32_t* table = a.tables + (static_cast<int64_t>(slot) * a.num_layers * a.kv_heads +
                                     static_cast<int64_t>(a.layer) * a.kv_heads + kvh) *
                                        a.max_blocks;
  const int shift = __ffs(a.block_tokens) - 1, mask = a.block_tokens - 1;
  using Elem = std::conditional_t<F8, unsigned char, nbf>;
  const Elem* kpool = static_cast<const Elem*>(a.k_pool);
  const Elem* vpool = static_cast<const Elem*>(a.v_pool);
  unsigned char* stage0 = smem + 16 * D * 2 + static_cast<size_t>(warp) * warp_bytes<D, F8>();

  // Tile t into stage t % S: lane r < 16 looks up key r's row once, every lane copies its chunks of K and V (FP8:
  // and lane r its row's K scale, lane r + 16 its V scale).
  const auto load = [&](int t) {
    if (t >= tiles) return;  // the same for the whole warp
    const int64_t i = i_begin + static_cast<int64_t>(t) * kTileKeys + (lane & 15);
    int64_t row_id = -1;  // the key's stored row: block * block_tokens + its row in the block
    if (i < i_end) {
      // 32-bit position arithmetic and a power-of-two block (a 64-bit division per key cost more than the load).
      const int pos = static_cast<int>(i < n_first ? lo + i : second + (i - n_first));
      row_id = static_cast<int64_t>(__ldg(table + (pos >> shift))) * a.block_tokens + (pos & mask);
    }
    const int64_t off = row_id < 0 ? -1 : row_id * D;
    unsigned char* ks = stage0 + (t % S) * stage_bytes<D, F8>();
    unsigned char* vs = ks + kCodeBytes;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int ci = lane + j * 32;
      const int r = ci / kChunks, ch = ci % kChunks;
      const int64_t o = __shfl_sync(0xffffffffu, off, r);
      const bool ok = o >= 0;
      // bf16: the swizzled layout the mma fragments read; FP8: row-major codes, widened into it after they land.
      const uint32_t dst = F8 ? static_cast<uint32_t>(r * D + ch * 16) : static_cast<uint32_t>(2 * swizzle<D>(r, ch));
      constexpr int kElems = 16 / static_cast<int>(sizeof(Elem));
      cp_async_16(smem_addr(ks) + dst, ok ? kpool + o + ch * kElems : kpool, ok);
      cp_async_16(smem_addr(vs) + dst, ok ? vpool + o + ch * kElems : vpool, ok);
    }
    if constexpr (F8) {
      const float* scales = lane < 16 ? a.k_scale : a.v_scale;
      const bool ok = row_id >= 0;
      cp_async_4(smem_addr(vs + kCodeBytes) + 4 * lane, ok ? scales + row_id : scales, ok);
    }
  };

  const LaneSwizzle sw(lane);
  const uint32_t q_base = smem_addr(qs) + LaneSwizzle::a_row<D>(lane);
  const float scale2 = a.scale * kLog2e * (F8 ? kFp8Unit : 1.0f);  // (F8: the codes' 2^-8 undone, exactly)
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // row g's running max (log2 units) and this lane's part of its sum

#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    load(t);
    cp_async_commit();
  }
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<S - 2>();
    __syncwarp();
    load(t + S - 1);  // into the stage tile t - 1 used (every lane is past it)
    cp_async_commit();
    unsigned char* stage = stage0 + (t % S) * stage_bytes<D, F8>();
    uint32_t k_addr = smem_addr(stage);
    const float* kv_scale = reinterpret_cast<const float*>(stage + 2 * kCodeBytes);  // F8: K scales [16], V [16]
    if constexpr (F8) {
      unsigned char* wide = stage0 + S * stage_bytes<D, F8>();
      widen_tile<D>(stage, wide, lane);
      widen_tile<D>(stage + kCodeBytes, wide + tile_bytes<D>(), lane);
      __syncwarp();
      k_addr = smem_addr(wide);
    }
    float s[2][4] = {};
    attn::gpu::detail::warp_qk<T, D, kTileKeys>(s, q_base, k_addr + LaneSwizzle::b_row<D>(lane), sw);
    // Scores of row g at keys 8n + 2c + e, masked by the head's ranges; rows g + 8 and g >= G are padding.
    const int64_t i0 = i_begin + static_cast<int64_t>(t) * kTileKeys;
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t i = i0 + 8 * n + 2 * c + e;
        float v = -INFINITY;
        if (g < G && i < i_end) {
          const int64_t pos = i < n_first ? lo + i : second + (i - n_first);
          if ((pos >= mine.a0 && pos < mine.a1) || (pos >= mine.b0 && pos < mine.b1))
            v = (F8 ? s[n][e] * kv_scale[8 * n + 2 * c + e] : s[n][e]) * scale2;
        }
        s[n][e] = v;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float corr = m_new == -INFINITY ? 1.0f : fast_exp2(m - m_new);  // exp2(-inf) = 0
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = fast_exp2(s[n][0] - base);
      s[n][1] = fast_exp2(s[n][1] - base);
      s[n][2] = s[n][3] = 0.0f;
      sum += s[n][0] + s[n][1];
      if constexpr (F8) {  // P V over the codes: P times each key's V scale (the sum above takes P itself)
        s[n][0] *= kv_scale[kTileKeys + 8 * n + 2 * c] * kFp8Unit;
        s[n][1] *= kv_scale[kTileKeys + 8 * n + 2 * c + 1] * kFp8Unit;
      }
    }
    l = l * corr + sum;
    m = m_new;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr;
      o[n][1] *= corr;
    }
    const uint32_t v_addr = k_addr + tile_bytes<D>() + LaneSwizzle::v_row<D>(lane);
    warp_pv_split<D, T>(o, s, v_addr, sw);
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g >= G) return;
  const int h = kvh * G + g;
  const int64_t base = (static_cast<int64_t>(row) * a.q_heads + h) * a.splits + piece;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* out = a.o_part + base * D + 2 * c;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) *reinterpret_cast<float2*>(out + 8 * n) = make_float2(o[n][0] * inv, o[n][1] * inv);
  if (c == 0) a.lse_part[base] = l > 0.0f ? (m + __log2f(l)) / kLog2e : -INFINITY;
}

// grid rows * q_heads, kMergeWarps warps: warp w weighs pieces w, w + kMergeWarps, ... (each lane D / 32 columns,
// so the loads of a warp's pieces are independent and many are in flight), then the warps' sums are added in
// shared memory. One thread per column walking every piece in turn took ~25 us a layer at 128 pieces.
constexpr int kMergeWarps = 8;
template <int D>
__global__ void __launch_bounds__(kMergeWarps * 32) paged_decode_merge_kernel(PagedDecodeArgs a) {
  constexpr int kCols = D / 32;
  __shared__ float part[kMergeWarps][D];
  __shared__ float dens[kMergeWarps];
  const int64_t rh = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* lse = a.lse_part + rh * a.splits;
  float mx = -INFINITY;
  for (int s = lane; s < a.splits; s += 32) mx = fmaxf(mx, lse[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float acc[kCols] = {};
  float den = 0.0f;
  if (mx != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < a.splits; s += kMergeWarps) {
      const float w = __expf(lse[s] - mx);
      const float* src = a.o_part + (rh * a.splits + s) * D + lane * kCols;
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[j] += w * src[j];
      den += w;
    }
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j) part[warp][lane * kCols + j] = acc[j];
  if (lane == 0) dens[warp] = den;
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += kMergeWarps * 32) {
    float num = 0.0f, d = 0.0f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) {
      num += part[w][c];
      d += dens[w];
    }
    const int64_t row = rh / a.q_heads, h = rh % a.q_heads;
    reinterpret_cast<nbf*>(a.out)[row * static_cast<int64_t>(a.q_heads) * D + h * D + c] =
        __float2bfloat16_rn(d > 0.0f ? num / d : 0.0f);
  }
}

template <int D, bool F8>
void launch(const PagedDecodeArgs& a, cudaStream_t stream) {
  static const bool sized = [] {  // once per head dim and precision (not a stream operation: allowed while a graph captures)
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, F8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem_bytes<D, F8>())));
    return true;
  }();
  (void)sized;
  const dim3 grid(static_cast<unsigned>((a.splits + kWarps - 1) / kWarps), static_cast<unsigned>(a.kv_heads),
                  static_cast<unsigned>(a.rows));
  paged_decode_kernel<D, F8><<<grid, kWarps * 32, smem_bytes<D, F8>(), stream>>>(a);
  check_launch("paged_decode_attention");
  paged_decode_merge_kernel<D>
      <<<static_cast<unsigned>(static_cast<int64_t>(a.rows) * a.q_heads), kMergeWarps * 32, 0, stream>>>(a);
  check_launch("paged_decode_merge");
}

__global__ void append_kernel(const nbf* k_new, const nbf* v_new, int64_t ld, int kv_heads, int head_dim, const int32_t* blocks,
                              int layer, int num_layers, const int32_t* pos, int block_tokens, nbf* k_pool,
                              nbf* v_pool) {
  const int r = blockIdx.x / kv_heads, h = blockIdx.x % kv_heads;
  const int64_t blk = blocks[(static_cast<int64_t>(r) * num_layers + layer) * kv_heads + h];
  if (blk < 0) return;
  const int64_t dst = (blk * block_tokens + pos[r] % block_tokens) * head_dim;
  const int64_t src = static_cast<int64_t>(r) * ld + static_cast<int64_t>(h) * head_dim;
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    k_pool[dst + c] = k_new[src + c];
    v_pool[dst + c] = v_new[src + c];
  }
}

// FP8 rows (paged_decode.h): a warp quantizes a row of d bf16 values alone (core/fp8.h's per-row convention: the
// amax by shuffles, scale = amax / 448, codes e4m3(x * (448 / amax)) by IEEE operations, so the host's e4m3_quantize
// gives the same codes), and widens one back (code * scale, rounded to bf16).
constexpr float kE4M3Max = 448.0f;
__device__ void quantize_row(const nbf* x, int d, uint8_t* codes, float* scale, int lane) {
  float amax = 0.0f;
  for (int c = lane; c < d; c += 32) amax = fmaxf(amax, fabsf(__bfloat162float(x[c])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const bool usable = amax > 0.0f && isfinite(amax);
  const float inv = usable ? __fdiv_rn(kE4M3Max, amax) : 1.0f;
  if (lane == 0) *scale = usable ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  for (int c = lane; c < d; c += 32)
    codes[c] = __nv_cvt_float_to_fp8(__fmul_rn(__bfloat162float(x[c]), inv), __NV_SATFINITE, __NV_E4M3);
}
__device__ void dequantize_row(const uint8_t* codes, float scale, int d, nbf* x, int lane) {
  for (int c = lane; c < d; c += 32)
    x[c] = __float2bfloat16_rn(__fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(codes[c], __NV_E4M3))), scale));
}

// Two warps per (row, kv head): warp 0 quantizes the new K row into its block, warp 1 the V row.
__global__ void append_fp8_kernel(const nbf* k_new, const nbf* v_new, int64_t ld, int kv_heads, int head_dim,
                                  const int32_t* blocks, int layer, int num_layers, const int32_t* pos,
                                  int block_tokens, PagedPools pools) {
  const int r = blockIdx.x / kv_heads, h = blockIdx.x % kv_heads;
  const int64_t blk = blocks[(static_cast<int64_t>(r) * num_layers + layer) * kv_heads + h];
  if (blk < 0) return;
  const int64_t row = blk * block_tokens + pos[r] % block_tokens;
  const int64_t src = static_cast<int64_t>(r) * ld + static_cast<int64_t>(h) * head_dim;
  const bool is_v = threadIdx.x >= 32;
  quantize_row((is_v ? v_new : k_new) + src, head_dim, static_cast<uint8_t*>(is_v ? pools.v : pools.k) + row * head_dim,
               (is_v ? pools.v_scale : pools.k_scale) + row, static_cast<int>(threadIdx.x & 31));
}

// paged_copy over FP8 pools: one CUDA block per entry, a warp per (row, K or V) of the block's rows.
constexpr int kPagesFp8Warps = 8;
__global__ void pages_fp8_kernel(const int32_t* entries, nbf* const* k_layers, nbf* const* v_layers,
                                 int64_t row_elements, int head_dim, int block_tokens, int len, PagedPools pools,
                                 bool to_pages) {
  const int32_t* e = entries + static_cast<int64_t>(blockIdx.x) * 4;
  const int layer = e[0], h = e[1];
  const int64_t b = e[2], blk = e[3];
  const int64_t r0 = b * block_tokens, r1 = min64(r0 + block_tokens, len);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t i = warp; i < 2 * (r1 - r0); i += kPagesFp8Warps) {
    const int64_t r = r0 + i / 2;
    const bool is_v = (i & 1) != 0;
    nbf* staged = (is_v ? v_layers : k_layers)[layer] + r * row_elements + static_cast<int64_t>(h) * head_dim;
    const int64_t row = blk * block_tokens + (r - r0);
    uint8_t* codes = static_cast<uint8_t*>(is_v ? pools.v : pools.k) + row * head_dim;
    float* scale = (is_v ? pools.v_scale : pools.k_scale) + row;
    if (to_pages)
      quantize_row(staged, head_dim, codes, scale, lane);
    else
      dequantize_row(codes, *scale, head_dim, staged, lane);
  }
}

__global__ void fill_fp8_kernel(uint8_t* codes, float* scales, int64_t rows, int head_dim, uint64_t seed,
                                float scale) {
  const int64_t n = rows * head_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f * 2.0f - 1.0f;  // [-1, 1)
    codes[i] = __nv_cvt_float_to_fp8(u * kE4M3Max, __NV_SATFINITE, __NV_E4M3);
    if (i % head_dim == 0) scales[i / head_dim] = scale / kE4M3Max;
  }
}

// One CUDA block per entry (layer, kv head, logical block, physical block): the block's rows between the staging
// cache and the pool, to the pool (a prefill's end) or from it (a cached prefix staged again). Vec elements move at
// once: 8 bf16 (16 bytes) when the head dim, the row pitch and both bases allow it, else one (a 128K Llama-3-8B
// prefill moves 17 GB each way: element by element the copy cost ~70 ms of its time to first token).
template <class Vec>
__global__ void pages_kernel(const int32_t* entries, nbf* const* k_layers, nbf* const* v_layers, int64_t row_elements,
                             int head_dim, int block_tokens, int len, nbf* k_pool, nbf* v_pool, bool to_pages) {
  constexpr int kPer = static_cast<int>(sizeof(Vec) / sizeof(nbf));
  const int32_t* e = entries + static_cast<int64_t>(blockIdx.x) * 4;
  const int layer = e[0], h = e[1];
  const int64_t b = e[2], blk = e[3];
  const int64_t r0 = b * block_tokens, r1 = min64(r0 + block_tokens, len);
  const int vecs = head_dim / kPer;  // per row
  const int64_t total = (r1 - r0) * vecs;
  Vec* ks = reinterpret_cast<Vec*>(k_layers[layer]);
  Vec* vs = reinterpret_cast<Vec*>(v_layers[layer]);
  Vec* kp = reinterpret_cast<Vec*>(k_pool);
  Vec* vp = reinterpret_cast<Vec*>(v_pool);
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t r = r0 + i / vecs, c = i % vecs;
    const int64_t row = (r * row_elements + static_cast<int64_t>(h) * head_dim) / kPer + c;
    const int64_t slot = ((blk * block_tokens + (r - r0)) * head_dim) / kPer + c;
    if (to_pages) {
      kp[slot] = ks[row];
      vp[slot] = vs[row];
    } else {
      ks[row] = kp[slot];
      vs[row] = vp[slot];
    }
  }
}

__global__ void rope_at_kernel(const float* inv_freq, int half, const int32_t* pos, int64_t total, float* c,
                               float* s) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / half;
    const int i = static_cast<int>(idx % half);
    const float angle = static_cast<float>(pos[t]) * inv_freq[i];  // as runtime/cuda/kernels.cu's rope_tables
    c[idx] = static_cast<float>(cos(static_cast<double>(angle)));
    s[idx] = static_cast<float>(sin(static_cast<double>(angle)));
  }
}

}  // namespace

int32_t paged_decode_splits(int32_t rows, int32_t kv_heads, int64_t max_keys, int32_t sms) {
  const int64_t groups = static_cast<int64_t>(rows) * kv_heads;
  // A piece is one warp: about eight warps per multiprocessor (two CTAs of four at head dim 128) keep enough
  // loads in flight to reach the memory bandwidth; at least kPagedDecodeMinPieceKeys keys (four tiles) a piece.
  const int64_t want = (8LL * sms + groups - 1) / std::max<int64_t>(groups, 1);
  const int64_t most = std::max<int64_t>(1, max_keys / kPagedDecodeMinPieceKeys);
  return static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 256)));
}

// In KVPrecision's order (core/enum_names.h).
constexpr std::string_view kKVPrecisionNames[] = {"bf16", "fp8"};

const char* kv_precision_name(KVPrecision p) { return enum_name(kKVPrecisionNames, p).data(); }

KVPrecision parse_kv_precision(const std::string& name) {
  if (const auto p = enum_value<KVPrecision>(kKVPrecisionNames, name)) return *p;
  throw Error("GPU KV type: expected bf16 or fp8, got '" + name + "'");
}

void paged_decode_attention(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return;
  check(a.kv_heads > 0 && a.q_heads % a.kv_heads == 0, "paged decode attention: query heads must be a multiple of kv heads");
  check(a.splits >= 1, "paged decode attention: splits must be >= 1");
  check(a.tables != nullptr, "paged decode attention: block tables required");
  check(a.block_tokens > 0 && (a.block_tokens & (a.block_tokens - 1)) == 0,
        "paged decode attention: block_tokens must be a power of two, got " + std::to_string(a.block_tokens));
  check(a.q_stride % 8 == 0 && reinterpret_cast<uintptr_t>(a.q) % 16 == 0,
        "paged decode attention: q rows must be 16-byte aligned");
  const int group = a.q_heads / a.kv_heads;
  if (group > 8)
    throw Error("paged decode attention: GQA groups of at most 8 query heads, got " + std::to_string(group));
  const bool f8 = a.kv == KVPrecision::kFp8;
  check(!f8 || (a.k_scale != nullptr && a.v_scale != nullptr), "paged decode attention: FP8 KV needs its scales");
  switch (a.head_dim) {
    case 64: f8 ? launch<64, true>(a, stream) : launch<64, false>(a, stream); break;
    case 128: f8 ? launch<128, true>(a, stream) : launch<128, false>(a, stream); break;
    case 256: f8 ? launch<256, true>(a, stream) : launch<256, false>(a, stream); break;
    default: throw Error("paged decode attention: head dims 64, 128 and 256, got " + std::to_string(a.head_dim));
  }
}

void paged_append_kv(const bf16* k_new, const bf16* v_new, int64_t ld, int32_t rows, int32_t kv_heads, int32_t head_dim,
                     const int32_t* blocks, int32_t layer, int32_t num_layers, const int32_t* pos,
                     int32_t block_tokens, const PagedPools& pools, cudaStream_t stream) {
  if (rows <= 0) return;
  check(ld >= static_cast<int64_t>(kv_heads) * head_dim, "paged_append_kv: row stride below kv_heads * head_dim");
  const auto kn = reinterpret_cast<const nbf*>(k_new);
  const auto vn = reinterpret_cast<const nbf*>(v_new);
  if (pools.precision == KVPrecision::kFp8)
    append_fp8_kernel<<<static_cast<unsigned>(rows * kv_heads), 64, 0, stream>>>(
        kn, vn, ld, kv_heads, head_dim, blocks, layer, num_layers, pos, block_tokens, pools);
  else
    append_kernel<<<static_cast<unsigned>(rows * kv_heads), 128, 0, stream>>>(
        kn, vn, ld, kv_heads, head_dim, blocks, layer, num_layers, pos, block_tokens, static_cast<nbf*>(pools.k),
        static_cast<nbf*>(pools.v));
  check_launch("paged_append_kv");
}

void paged_copy(const int32_t* entries, int32_t count, bf16* const* k_layers, bf16* const* v_layers,
                int64_t row_elements, int32_t head_dim, int32_t block_tokens, int32_t len, const PagedPools& pools,
                PageCopy direction, cudaStream_t stream) {
  if (count <= 0) return;
  const auto k_l = reinterpret_cast<nbf* const*>(k_layers);
  const auto v_l = reinterpret_cast<nbf* const*>(v_layers);
  const bool to = direction == PageCopy::kToPages;
  if (pools.precision == KVPrecision::kFp8) {
    pages_fp8_kernel<<<static_cast<unsigned>(count), kPagesFp8Warps * 32, 0, stream>>>(
        entries, k_l, v_l, row_elements, head_dim, block_tokens, len, pools, to);
    check_launch("paged_copy");
    return;
  }
  nbf* const k_pool = static_cast<nbf*>(pools.k);
  nbf* const v_pool = static_cast<nbf*>(pools.v);
  // 16-byte moves need every row start aligned: the head dim and the row pitch multiples of 8 elements, the pools
  // 16-byte aligned (cudaMalloc's are, and a staged layer of a DeviceKVCache starts at a multiple of its row pitch).
  const bool wide = head_dim % 8 == 0 && row_elements % 8 == 0 && reinterpret_cast<uintptr_t>(k_pool) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_pool) % 16 == 0;
  if (wide)
    pages_kernel<uint4><<<static_cast<unsigned>(count), 256, 0, stream>>>(entries, k_l, v_l, row_elements, head_dim,
                                                                         block_tokens, len, k_pool, v_pool, to);
  else
    pages_kernel<nbf><<<static_cast<unsigned>(count), 256, 0, stream>>>(entries, k_l, v_l, row_elements, head_dim,
                                                                       block_tokens, len, k_pool, v_pool, to);
  check_launch("paged_copy");
}

namespace {

// Blocks of 256 threads for a grid-stride loop over n elements (at most 65,536 blocks).
unsigned stride_blocks(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65536)); }

}  // namespace

void fill_random_fp8(uint8_t* codes, float* scales, int64_t rows, int32_t head_dim, uint64_t seed, float scale,
                     cudaStream_t stream) {
  if (rows * head_dim <= 0) return;
  fill_fp8_kernel<<<stride_blocks(rows * head_dim), 256, 0, stream>>>(codes, scales, rows, head_dim, seed, scale);
  check_launch("fill_random_fp8");
}

void rope_tables_at(const float* inv_freq, int half, const int32_t* pos, int64_t n, float* cos, float* sin,
                    cudaStream_t stream) {
  if (n * half <= 0) return;
  rope_at_kernel<<<stride_blocks(n * half), 256, 0, stream>>>(inv_freq, half, pos, n * half, cos, sin);
  check_launch("rope_tables_at");
}

}  // namespace tessera::runtime::gpu
