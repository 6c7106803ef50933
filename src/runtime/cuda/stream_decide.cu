#include "runtime/cuda/stream_decide.h"

#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "attention/cuda/mma_sm80.cuh"
#include "runtime/stream/span_math.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;

using attn::gpu::check_launch;

int blocks_for(int64_t total, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 65535LL * 16)));
}

// The dots' row stride for a tile of vt index vectors: vt rounded up to 8 floats (rows 32-byte aligned).
int64_t dots_ld(int64_t vt) { return (vt + 7) / 8 * 8; }

// Rows of q (nq heads) and k (nkv heads), bf16 -> rotated at position pos0 + r (runtime/rope.cpp's tables and products
// in f32, without contraction into FMAs) -> bf16, rounded to nearest even: the chunk map's q and k as the attention
// kernels see them (StreamingKV's map rounds its rotated copies alike). One launch for both: a thread per (row, pair
// i) computes the angle's cos and sin once.
__global__ void rotate_bf16_kernel(const nbf* q, nbf* qb, int nq, const nbf* k, nbf* kb, int nkv, int64_t rows, int d,
                                   const float* inv_freq, int64_t pos0) {
  const int half = d / 2;
  const int64_t total = rows * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / half;
    const int i = static_cast<int>(idx % half);
    const float angle = __fmul_rn(static_cast<float>(pos0 + r), inv_freq[i]);
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float s = static_cast<float>(sin(static_cast<double>(angle)));
    const auto rotate = [&](const nbf* x, nbf* y, int heads) {
      const int64_t ld = static_cast<int64_t>(heads) * d;
      for (int h = 0; h < heads; ++h) {
        const int64_t at = r * ld + static_cast<int64_t>(h) * d + i;
        const float a = __bfloat162float(x[at]), b = __bfloat162float(x[at + half]);
        y[at] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
        y[at + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
      }
    };
    rotate(q, qb, nq);
    rotate(k, kb, nkv);
  }
}

constexpr int kThreads = 256;

// The chunk map on the tensor cores, without the [heads, n, n] scores: a CTA of kMapWarps warps covers kMapTile query
// rows (16 per warp) against kMapTile keys at a time, the mma.sync kernels' building blocks (attention/cuda/
// mma_sm80.cuh: cp.async into swizzled tiles, ldmatrix, m16n8k16 bf16 x bf16 -> f32, the products exact). A warp's
// S = q_h k_g^T block [16, 64] stays in its registers (thread (g, c) = (lane / 4, lane % 4) holds rows g and g + 8,
// columns 8j + 2c and 8j + 2c + 1); the softmax works on it there, a row's max across the four threads of its quad.
// kStages = 2: the next key tile's (map_stats) or the next head's (map_tiles) copies are in flight while the current
// one is multiplied; 1 where shared memory is short (the copies then overlap only the softmax). The q and k rows are
// padded with zeros to a multiple of kMapTile. D = head_dim: 64, 128 or 256, as the GPU's streaming runs.
constexpr int kMapWarps = 4, kMapTile = 16 * kMapWarps;
namespace mma = attn::gpu::detail;

template <int D>
constexpr size_t map_tile_bytes() {
  return static_cast<size_t>(kMapTile) * D * sizeof(nbf);
}
// Shared memory of map_stats_kernel (a q tile and kStages key tiles) and map_tiles_kernel (kStages q and k tiles).
template <int D, int kStages>
constexpr size_t map_stats_smem() {
  return (1 + kStages) * map_tile_bytes<D>();
}
template <int D, int kStages>
constexpr size_t map_tiles_smem() {
  return 2 * kStages * map_tile_bytes<D>();
}

// kMapTile rows of D bf16 from src (row stride ld; rows past the chunk are the zero padding) into a swizzled tile.
template <int D>
__device__ __forceinline__ void stage_rows(unsigned char* dst, const nbf* src, int64_t ld) {
  mma::cp_async_tile<D, kMapTile, 32 * kMapWarps>(dst, static_cast<int>(threadIdx.x), src,
                                                   [&](int r) { return src + r * ld; });
}

// The warp's S block: s[j][e] for row r0 + g + 8 (e / 2), column c0 + 8j + 2c + e % 2 (the layout above).
template <int D>
__device__ __forceinline__ void map_block(float (&s)[kMapTile / 8][4], const unsigned char* qs, const unsigned char* ks,
                                          int warp, int lane, const mma::LaneSwizzle& sw) {
#pragma unroll
  for (auto& f : s) f[0] = f[1] = f[2] = f[3] = 0.0f;
  mma::warp_qk<nbf, D, kMapTile>(
      s, mma::smem_addr(qs) + static_cast<uint32_t>(warp * 16 * D * 2) + mma::LaneSwizzle::a_row<D>(lane),
      mma::smem_addr(ks) + mma::LaneSwizzle::b_row<D>(lane), sw);
}

// Per head h0 + blockIdx.y and row r < n: the causal row's max m of sc2 * S (sc2 = the softmax scale * log2 e: base 2,
// exp2f, one multi-function instruction and a few) and inv = 1 / sum 2^(sc2 * S - m) (online over the key tiles; each
// thread sums its columns, the quad's four partial sums added at the end).
template <int D, int kStages>
__global__ void __launch_bounds__(32 * kMapWarps) map_stats_kernel(const nbf* q, const nbf* k, int n, int64_t qrow,
                                                                   int64_t krow, int group, int h0, float sc2,
                                                                   float* mx, float* inv) {
  extern __shared__ __align__(128) unsigned char map_smem[];
  constexpr size_t kTile = map_tile_bytes<D>();
  unsigned char* const qs = map_smem;
  unsigned char* const ks = map_smem + kTile;  // key tile ct in ks + (ct % kStages) * kTile
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int rt = static_cast<int>(blockIdx.x);
  const int64_t r0 = static_cast<int64_t>(rt) * kMapTile + warp * 16;
  const int h = h0 + static_cast<int>(blockIdx.y), g = h / group;
  const nbf* const kh = k + static_cast<int64_t>(g) * D;
  stage_rows<D>(qs, q + static_cast<int64_t>(rt) * kMapTile * qrow + static_cast<int64_t>(h) * D, qrow);
  stage_rows<D>(ks, kh, krow);
  mma::cp_async_commit();
  const mma::LaneSwizzle sw(lane);
  const int64_t rows[2] = {r0 + lane / 4, r0 + lane / 4 + 8};
  const int col = 2 * (lane % 4);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int ct = 0; ct <= rt; ++ct) {
    if (kStages == 2 && ct < rt) {
      stage_rows<D>(ks + ((ct + 1) % kStages) * kTile, kh + static_cast<int64_t>(ct + 1) * kMapTile * krow, krow);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();  // key tile ct staged
    float s[kMapTile / 8][4];
    if (r0 < n) map_block<D>(s, qs, ks + (ct % kStages) * kTile, warp, lane, sw);
    __syncthreads();  // every warp's products read the tile: it may be overwritten
    if (kStages == 1 && ct < rt) {
      stage_rows<D>(ks, kh + static_cast<int64_t>(ct + 1) * kMapTile * krow, krow);
      mma::cp_async_commit();
    }
    if (r0 >= n) continue;
    const int64_t c0 = static_cast<int64_t>(ct) * kMapTile;
    const bool full = c0 + kMapTile <= r0;  // the warp's rows see every key of the tile: no mask
    float tm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kMapTile / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool seen = full || c0 + 8 * j + col + e % 2 <= rows[e / 2];
        s[j][e] = seen ? s[j][e] * sc2 : -INFINITY;
        tm[e / 2] = fmaxf(tm[e / 2], s[j][e]);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tm[i] = fmaxf(tm[i], __shfl_xor_sync(0xffffffffu, tm[i], 1));
      tm[i] = fmaxf(tm[i], __shfl_xor_sync(0xffffffffu, tm[i], 2));
      if (tm[i] != -INFINITY) {  // (the quad's rows agree: m is the row's)
        const float mn = fmaxf(m[i], tm[i]);
        l[i] = m[i] == -INFINITY ? 0.0f : l[i] * exp2f(m[i] - mn);
        m[i] = mn;
      }
    }
#pragma unroll
    for (int j = 0; j < kMapTile / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (m[e / 2] != -INFINITY) l[e / 2] += exp2f(s[j][e] - m[e / 2]);  // (exp2f(-inf) = 0)
  }
  if (r0 >= n) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    if (lane % 4 == 0 && rows[i] < n) {
      const int64_t at = static_cast<int64_t>(blockIdx.y) * n + rows[i];
      mx[at] = m[i];
      inv[at] = __fdiv_rn(1.0f, l[i]);
    }
  }
}

// One causal tile (row tile >= key tile, blockIdx.x in row-major order of the lower triangle) and one range of heads
// (blockIdx.y of `splits`): out[split][r][c] = sum over the range's heads in order of 2^(sc2 * S_h - m) * inv for
// c <= r, 0 above the diagonal.
template <int D, int kStages>
__global__ void __launch_bounds__(32 * kMapWarps) map_tiles_kernel(const nbf* q, const nbf* k, int n, int64_t qrow,
                                                                   int64_t krow, int group, int h0, int heads,
                                                                   int splits, float sc2, const float* mx,
                                                                   const float* inv, float* out) {
  extern __shared__ __align__(128) unsigned char map_smem[];
  constexpr size_t kTile = map_tile_bytes<D>();  // head hh's q tile in stage (hh - hb) % kStages, its k tile after
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  int rt = static_cast<int>((sqrt(8.0 * blockIdx.x + 1.0) - 1.0) / 2.0);
  while (static_cast<int64_t>(rt + 1) * (rt + 2) / 2 <= blockIdx.x) ++rt;
  while (static_cast<int64_t>(rt) * (rt + 1) / 2 > blockIdx.x) --rt;
  const int ct = static_cast<int>(blockIdx.x - static_cast<int64_t>(rt) * (rt + 1) / 2);
  const int64_t r0 = static_cast<int64_t>(rt) * kMapTile + warp * 16, c0 = static_cast<int64_t>(ct) * kMapTile;
  const int split = static_cast<int>(blockIdx.y);
  const int hb = static_cast<int>(static_cast<int64_t>(heads) * split / splits);
  const int he = static_cast<int>(static_cast<int64_t>(heads) * (split + 1) / splits);
  const nbf* const qt = q + static_cast<int64_t>(rt) * kMapTile * qrow;
  const nbf* const kt = k + c0 * krow;
  auto stage = [&](int hh) {
    unsigned char* at = map_smem + 2 * ((hh - hb) % kStages) * kTile;
    stage_rows<D>(at, qt + static_cast<int64_t>(h0 + hh) * D, qrow);
    stage_rows<D>(at + kTile, kt + static_cast<int64_t>((h0 + hh) / group) * D, krow);
    mma::cp_async_commit();
  };
  if (hb < he) stage(hb);
  const mma::LaneSwizzle sw(lane);
  const int64_t rows[2] = {r0 + lane / 4, r0 + lane / 4 + 8};
  const int col = 2 * (lane % 4);
  const bool full = c0 + kMapTile <= r0;  // no mask (as in map_stats_kernel)
  float acc[kMapTile / 8][4];
#pragma unroll
  for (auto& a : acc) a[0] = a[1] = a[2] = a[3] = 0.0f;
  for (int hh = hb; hh < he; ++hh) {
    if (kStages == 2 && hh + 1 < he) {
      stage(hh + 1);
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();  // head hh's tiles staged
    const unsigned char* at = map_smem + 2 * ((hh - hb) % kStages) * kTile;
    float s[kMapTile / 8][4];
    if (r0 < n) map_block<D>(s, at, at + kTile, warp, lane, sw);
    __syncthreads();  // every warp's products read them: they may be overwritten
    if (kStages == 1 && hh + 1 < he) stage(hh + 1);
    if (r0 >= n) continue;
    float m[2], iv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[i] = rows[i] < n ? mx[static_cast<int64_t>(hh) * n + rows[i]] : 0.0f;
      iv[i] = rows[i] < n ? inv[static_cast<int64_t>(hh) * n + rows[i]] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kMapTile / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (full || c0 + 8 * j + col + e % 2 <= rows[e / 2]) acc[j][e] += exp2f(s[j][e] * sc2 - m[e / 2]) * iv[e / 2];
  }
  float* const o = out + static_cast<int64_t>(split) * n * n;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rows[i] >= n) continue;
    float* const orow = o + rows[i] * n;
#pragma unroll
    for (int j = 0; j < kMapTile / 8; ++j) {
      const int64_t c = c0 + 8 * j + col;
      if (c + 1 < n && n % 2 == 0) {
        *reinterpret_cast<float2*>(orow + c) = make_float2(acc[j][2 * i], acc[j][2 * i + 1]);
      } else {
        if (c < n) orow[c] = acc[j][2 * i];
        if (c + 1 < n) orow[c + 1] = acc[j][2 * i + 1];
      }
    }
  }
}

// The kernels of a head_dim: f.template operator()<D>() for d = 64, 128 or 256 (checked by the constructor).
template <class F>
void with_head_dim(int d, F&& f) {
  if (d == 64)
    f.template operator()<64>();
  else if (d == 128)
    f.template operator()<128>();
  else
    f.template operator()<256>();
}
// The chunk map's kernels of a head_dim and stage count: f<D, kStages>().
template <class F>
void with_map_kernels(int d, int stages, F&& f) {
  with_head_dim(d, [&]<int D>() {
    if (stages == 2)
      f.template operator()<D, 2>();
    else
      f.template operator()<D, 1>();
  });
}

// dots[slot][a][b] (rows of stride ld) = q_h(a) . k_g(v0 + b) for the query vectors a < m (rows of qs) and the index
// vectors b < vt of one tile, per voting head slot = blockIdx.z (voters[2 slot]: its query head's offset in a q row,
// voters[2 slot + 1]: its kv head's in a mirror row). A CTA: 64 query vectors (16 a warp) x 64 index vectors, one q and
// one k tile staged (rows past m or vt zero-filled), the products on the tensor cores as the chunk map's (exact bf16
// products, f32 sums), written from the registers. (cuBLAS before: its sm_75 align1 kernels for the odd tile sizes,
// and new heuristics for every shape, which every call is.)
template <int D>
__global__ void __launch_bounds__(32 * kMapWarps) dots_kernel(const nbf* qs, int64_t qrow, int64_t m, const nbf* keys,
                                                              int64_t row, int64_t v0, int64_t vt, int64_t ld,
                                                              const int32_t* voters, float* dots) {
  extern __shared__ __align__(128) unsigned char map_smem[];
  constexpr size_t kTile = map_tile_bytes<D>();
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int slot = static_cast<int>(blockIdx.z);
  const int64_t a0 = static_cast<int64_t>(blockIdx.y) * kMapTile, b0 = static_cast<int64_t>(blockIdx.x) * kMapTile;
  const nbf* const qh = qs + voters[2 * slot];
  const nbf* const kh = keys + (v0 + b0) * row + voters[2 * slot + 1];
  mma::cp_async_tile<D, kMapTile, 32 * kMapWarps>(map_smem, tid, qh, [&](int r) -> const void* {
    return a0 + r < m ? qh + (a0 + r) * qrow : nullptr;
  });
  mma::cp_async_tile<D, kMapTile, 32 * kMapWarps>(map_smem + kTile, tid, kh, [&](int r) -> const void* {
    return b0 + r < vt ? kh + r * row : nullptr;
  });
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  if (a0 + warp * 16 >= m) return;
  const mma::LaneSwizzle sw(lane);
  float s[kMapTile / 8][4];
  map_block<D>(s, map_smem, map_smem + kTile, warp, lane, sw);
  float* const out = dots + static_cast<int64_t>(slot) * m * ld;
  const int col = 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t a = a0 + warp * 16 + lane / 4 + 8 * i;
    if (a >= m) continue;
    float* const orow = out + a * ld;
#pragma unroll
    for (int j = 0; j < kMapTile / 8; ++j) {
      const int64_t b = b0 + 8 * j + col;  // (even, and ld is: 8-byte aligned)
      if (b + 1 < vt)
        *reinterpret_cast<float2*>(orow + b) = make_float2(s[j][2 * i], s[j][2 * i + 1]);
      else if (b < vt)
        orow[b] = s[j][2 * i];
    }
  }
}

// The span maxima (gemm scoring): out[slot][a][s - s0] = max over stored span s's vectors b of q_h(a) . k_g(b), for the
// query vectors a < m and the spans of the fused scoring's tiles x0 + blockIdx.x (whole spans, <= kFusedVectors
// vectors and spans, or one longer span), per voting head slot = blockIdx.z (voters as dots_kernel's); rows of stride
// ld. A CTA: 64 query vectors (16 a warp) against its tile's vectors 128 at a time (one pass, but for a longer
// span), the products on the tensor cores as dots_kernel's (the same values: the same fragments in the same order),
// then through shared memory each (row, span)'s maximum — exact in any order, so sim over these maxima is bit for bit
// sim over the dots. The dots never reach memory: the kernel writes one float per (row, span), not per vector.
constexpr int kSpanPass = 128, kSpanLd = kSpanPass + 4;  // (= kFusedVectors, the tiles' most vectors)
template <int D>
constexpr size_t spanmax_smem() {
  return map_tile_bytes<D>() + std::max(2 * map_tile_bytes<D>(), static_cast<size_t>(kMapTile) * kSpanLd * sizeof(float)) +
         2 * kSpanPass * sizeof(int32_t);
}
template <int D>
__global__ void __launch_bounds__(32 * kMapWarps) spanmax_kernel(const nbf* qs, int64_t qrow, int64_t m, const nbf* keys,
                                                                 int64_t row, const int32_t* voters,
                                                                 const int32_t* span_first, const int32_t* span_count,
                                                                 const int32_t* tile_begin, int32_t x0, int32_t tiles,
                                                                 int64_t S, int64_t s0, int64_t ld, float* out) {
  extern __shared__ __align__(128) unsigned char map_smem[];
  constexpr size_t kTile = map_tile_bytes<D>();
  unsigned char* const qtile = map_smem;
  unsigned char* const ktile = map_smem + kTile;  // [kSpanPass, D] bf16, then the products [kMapTile, kSpanLd] f32
  float* const prod = reinterpret_cast<float*>(ktile);
  auto* const first = reinterpret_cast<int32_t*>(map_smem + spanmax_smem<D>() - 2 * kSpanPass * sizeof(int32_t));
  int32_t* const count = first + kSpanPass;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int x = x0 + static_cast<int>(blockIdx.x), slot = static_cast<int>(blockIdx.z);
  const int64_t sb = tile_begin[x], se = x + 1 < tiles ? tile_begin[x + 1] : S;
  const int ns = static_cast<int>(se - sb);
  const int64_t vb = span_first[sb], ve = static_cast<int64_t>(span_first[se - 1]) + span_count[se - 1];
  const int64_t a0 = static_cast<int64_t>(blockIdx.y) * kMapTile;
  for (int i = tid; i < ns; i += 32 * kMapWarps) {
    first[i] = static_cast<int32_t>(span_first[sb + i] - vb);
    count[i] = span_count[sb + i];
  }
  const nbf* const qh = qs + voters[2 * slot];
  const nbf* const kh = keys + voters[2 * slot + 1];
  mma::cp_async_tile<D, kMapTile, 32 * kMapWarps>(qtile, tid, qh, [&](int r) -> const void* {
    return a0 + r < m ? qh + (a0 + r) * qrow : nullptr;
  });
  const mma::LaneSwizzle sw(lane);
  const int64_t wr = a0 + warp * 16;  // the warp's first row
  const float* const mine = prod + warp * 16 * kSpanLd;
  float run = -INFINITY;  // one span over several passes: lane r < 16's running max for row wr + r
  for (int64_t p = vb; p < ve; p += kSpanPass) {
    mma::cp_async_tile<D, kSpanPass, 32 * kMapWarps>(ktile, tid, kh, [&](int r) -> const void* {
      return p + r < ve ? kh + (p + r) * row : nullptr;
    });
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();  // the q tile (first pass), the key tile and the spans staged
    float sv[kSpanPass / 8][4];
#pragma unroll
    for (auto& f : sv) f[0] = f[1] = f[2] = f[3] = 0.0f;
    if (wr < m)
      mma::warp_qk<nbf, D, kSpanPass>(sv,
                                      mma::smem_addr(qtile) + static_cast<uint32_t>(warp * 16 * D * 2) +
                                          mma::LaneSwizzle::a_row<D>(lane),
                                      mma::smem_addr(ktile) + mma::LaneSwizzle::b_row<D>(lane), sw);
    __syncthreads();  // every warp's products read the key tile: its bytes take the products
    if (wr < m) {
      float* const w = prod + (warp * 16 + lane / 4) * kSpanLd + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kSpanPass / 8; ++j) {  // (8-byte aligned: kSpanLd and the column are even)
        *reinterpret_cast<float2*>(w + 8 * j) = make_float2(sv[j][0], sv[j][1]);
        *reinterpret_cast<float2*>(w + 8 * kSpanLd + 8 * j) = make_float2(sv[j][2], sv[j][3]);
      }
      __syncwarp();
      if (ns == 1) {  // one span (maybe longer than a pass): its maximum over this pass's vectors
        const int cols = static_cast<int>(std::min<int64_t>(kSpanPass, ve - p));
        if (lane < 16)
          for (int c = 0; c < cols; ++c) run = fmaxf(run, mine[lane * kSpanLd + c]);
      } else {  // whole spans within this one pass: (row, span) pairs i = r * ns + k over the lanes, 32 apart
        int r = lane / ns, k = lane % ns;  // (one division; each step of 32 pairs by subtraction)
        while (r < 16) {
          const float* const pr = mine + r * kSpanLd + first[k];
          float mx = pr[0];
          for (int c = 1; c < count[k]; ++c) mx = fmaxf(mx, pr[c]);
          if (wr + r < m) out[static_cast<int64_t>(slot) * m * ld + (wr + r) * ld + (sb - s0) + k] = mx;
          k += 32;
          while (k >= ns) {
            k -= ns;
            ++r;
          }
        }
      }
    }
    __syncthreads();  // the products read before the next pass's keys overwrite them
  }
  if (ns == 1 && lane < 16 && wr + lane < m) out[static_cast<int64_t>(slot) * m * ld + (wr + lane) * ld + (sb - s0)] = run;
}

// map[r][c] = the splits' partial sums added in split order (the heads' order), 0 above the diagonal.
__global__ void map_sum_kernel(const float* parts, float* map, int n, int splits) {
  const int64_t nn = static_cast<int64_t>(n) * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nn;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = 0.0f;
    if (i % n <= i / n)
      for (int s = 0; s < splits; ++s) v = __fadd_rn(v, parts[s * nn + i]);
    map[i] = v;
  }
}

// votes[c] = sum over rows r >= c of map[r][c] (the map is 0 above the diagonal): each column's rows summed in order
// within blocks of kVoteRows rows by a thread each (the loads independent: the old thread per column walked all n rows
// in turn, ~100 us of latency a chunk), then the blocks' sums in order (the CPU adds the rows in order one by one:
// the same terms, another association).
constexpr int kVoteRows = 32;
__global__ void votes_part_kernel(const float* map, float* parts, int n) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  const int r0 = static_cast<int>(blockIdx.y) * kVoteRows, r1 = min(n, r0 + kVoteRows);
  float x[kVoteRows];
#pragma unroll
  for (int i = 0; i < kVoteRows; ++i) x[i] = r0 + i < r1 && r0 + i >= c ? map[static_cast<int64_t>(r0 + i) * n + c] : 0.0f;
  float v = 0;
#pragma unroll
  for (int i = 0; i < kVoteRows; ++i) v = __fadd_rn(v, x[i]);
  parts[static_cast<int64_t>(blockIdx.y) * n + c] = v;
}
__global__ void votes_kernel(const float* parts, float* votes, int n, int blocks) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  float v = 0;
  for (int b = c / kVoteRows; b < blocks; ++b) v = __fadd_rn(v, parts[static_cast<int64_t>(b) * n + c]);
  votes[c] = v;
}

// mean[j] = sum over i in order of q[i][j] / n (ReprIndex::block_scores's arithmetic).
__global__ void mean_query_kernel(const nbf* q, float* mean, int n, int64_t qrow) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= qrow) return;
  const float fn = static_cast<float>(n);
  float acc = 0;
  for (int i = 0; i < n; ++i) acc = __fadd_rn(acc, __fdiv_rn(__bfloat162float(q[i * qrow + j]), fn));
  mean[j] = acc;
}

// Ltri's query rows for either scoring: q rows of `tokens` (bf16, as they are), zero rows from m to m_pad (the fused
// kernel's passes of 64 rows; the GEMMs read the first m).
__global__ void gather_bf16_kernel(const nbf* q, const int32_t* tokens, nbf* out, int64_t m, int64_t m_pad, int64_t qrow) {
  const int64_t total = m_pad * qrow;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t a = idx / qrow, j = idx % qrow;
    out[idx] = a < m ? q[static_cast<int64_t>(tokens[a]) * qrow + j] : __float2bfloat16(0.0f);
  }
}

// Ltri's fused scoring (stream_decide.h): one CTA per tile of stored spans [tile_begin[x], next tile's first or S),
// whose vectors are consecutive. Per voting head in order: per 64 query rows (one 16-row slice per warp), per 128 of
// the tile's vectors (a tile of several spans has at most 128: one pass; one longer span takes several), the dot
// products on the tensor cores (bf16 x bf16, f32 accumulation) into shared memory, then each (row, span)'s maximum
// over the span's vectors in the pass (combined with the earlier passes' for a span that began in one); then thread
// s of the CTA adds span s's maxima over the rows in order into the running sum of the query span holding them and,
// when a query span ends, sim[t][s] += w_h * sum / count (f64: sim_kernel's and the CPU's operations and order).
constexpr int kFusedRows = 64;      // query rows per pass: 4 warps x 16
constexpr int kFusedVectors = 128;  // stored vectors per pass; also the most spans of a tile (one thread each)
static_assert(kSpanPass == kFusedVectors, "spanmax_kernel's passes: a tile's most vectors");
constexpr int kFusedThreads = 128;
constexpr int kDotsLd = kFusedVectors + 4;
size_t fused_smem_bytes(int d) {
  return static_cast<size_t>(kFusedVectors) * static_cast<size_t>(d + 8) * sizeof(nbf) +
         static_cast<size_t>(kFusedRows) * kDotsLd * sizeof(float) + static_cast<size_t>(kFusedRows) * kFusedVectors * sizeof(float) +
         2 * kFusedVectors * sizeof(int32_t);
}

__global__ void __launch_bounds__(kFusedThreads) fused_ltri_kernel(
    const nbf* q, int64_t qrow, int32_t m, const nbf* keys, int64_t row, int d, const int32_t* voter_offsets,
    const double* weights, int32_t voters, const int32_t* offsets, int32_t T, const int32_t* span_first,
    const int32_t* span_count, const int32_t* tile_begin, int32_t tiles, int32_t S, double* sim) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem[];
  const int ldk = d + 8;
  nbf* ks = reinterpret_cast<nbf*>(smem);  // [kFusedVectors][ldk]: one head's keys of the pass
  float* dots = reinterpret_cast<float*>(smem + static_cast<size_t>(kFusedVectors) * ldk * sizeof(nbf));  // [rows][kDotsLd]
  float* smax = dots + kFusedRows * kDotsLd;                                  // [rows][kFusedVectors]: per span
  int32_t* sfirst = reinterpret_cast<int32_t*>(smax + kFusedRows * kFusedVectors);
  int32_t* scount = sfirst + kFusedVectors;
  const int tile = static_cast<int>(blockIdx.x);
  const int32_t s0 = tile_begin[tile], s1 = tile + 1 < tiles ? tile_begin[tile + 1] : S;
  const int ns = s1 - s0;  // <= kFusedThreads
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32;
  for (int i = tid; i < ns; i += kFusedThreads) {
    sfirst[i] = span_first[s0 + i];
    scount[i] = span_count[s0 + i];
  }
  __syncthreads();
  const int64_t v0 = sfirst[0], v1 = static_cast<int64_t>(sfirst[ns - 1]) + scount[ns - 1];
  const int passes = static_cast<int>((v1 - v0 + kFusedVectors - 1) / kFusedVectors);
  double* mine = sim + s0 + tid;  // sim[t][s0 + tid] at mine[t * S]
  if (tid < ns)
    for (int32_t t = 0; t < T; ++t) mine[static_cast<int64_t>(t) * S] = 0.0;
  const int per_row = d / 8;  // 16-byte pieces of a key
  int loaded = -1;              // the pass whose keys ks holds, and their kv head (the heads of a group share it)
  int32_t loaded_koff = -1;
  for (int32_t h = 0; h < voters; ++h) {
    const double w = weights[h];
    const int32_t qoff = voter_offsets[2 * h], koff = voter_offsets[2 * h + 1];
    int32_t t = 0;  // thread tid's query span and its running sum
    double sum = 0;
    for (int32_t a0 = 0; a0 < m; a0 += kFusedRows) {
      const int rows = min(kFusedRows, m - a0);
      for (int p = 0; p < passes; ++p) {
        const int64_t b0 = v0 + static_cast<int64_t>(p) * kFusedVectors;
        const int nb = static_cast<int>(min(static_cast<int64_t>(kFusedVectors), v1 - b0));
        if (loaded != p || loaded_koff != koff) {
          __syncthreads();  // (the last pass's products are done with ks)
          for (int i = tid; i < kFusedVectors * per_row; i += kFusedThreads) {
            const int r = i / per_row, c = (i % per_row) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r < nb) v = *reinterpret_cast<const uint4*>(keys + (b0 + r) * row + koff + c);
            *reinterpret_cast<uint4*>(ks + r * ldk + c) = v;
          }
          loaded = p;
          loaded_koff = koff;
          __syncthreads();
        }
        if (a0 + warp * 16 < m) {  // (a warp whose 16 rows are all padding has nothing to compute)
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFusedVectors / 16];
          for (auto& f : acc) wmma::fill_fragment(f, 0.0f);
          const nbf* qa = q + static_cast<int64_t>(a0 + warp * 16) * qrow + qoff;
          for (int k = 0; k < d; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, nbf, wmma::row_major> fa;
            wmma::load_matrix_sync(fa, qa + k, static_cast<unsigned>(qrow));
            for (int f = 0; f < kFusedVectors / 16; ++f) {
              wmma::fragment<wmma::matrix_b, 16, 16, 16, nbf, wmma::col_major> fb;
              wmma::load_matrix_sync(fb, ks + f * 16 * ldk + k, static_cast<unsigned>(ldk));
              wmma::mma_sync(acc[f], fa, fb, acc[f]);
            }
          }
          for (int f = 0; f < kFusedVectors / 16; ++f)
            wmma::store_matrix_sync(dots + warp * 16 * kDotsLd + f * 16, acc[f], kDotsLd, wmma::mem_row_major);
        }
        __syncthreads();
        for (int i = tid; i < rows * ns; i += kFusedThreads) {
          const int a = i / ns, sl = i % ns;
          const int64_t f0 = sfirst[sl], f1 = f0 + scount[sl];
          const int64_t lo = max(f0, b0), hi = min(f1, b0 + nb);
          if (lo >= hi) continue;  // the span is in another pass
          const float* dr = dots + a * kDotsLd;
          float mx = dr[lo - b0];
          for (int64_t b = lo + 1; b < hi; ++b) mx = fmaxf(mx, dr[b - b0]);
          float* slot = smax + a * kFusedVectors + sl;
          *slot = f0 < b0 ? fmaxf(*slot, mx) : mx;
        }
        __syncthreads();
      }
      if (tid < ns)
        for (int a = 0; a < rows; ++a) {
          while (offsets[t + 1] <= a0 + a) {  // query span t ended before this row
            const int32_t c = offsets[t + 1] - offsets[t];
            if (c > 0) mine[static_cast<int64_t>(t) * S] = __dadd_rn(mine[static_cast<int64_t>(t) * S],
                                                                     __ddiv_rn(__dmul_rn(w, sum), static_cast<double>(c)));
            sum = 0;
            ++t;
          }
          sum = __dadd_rn(sum, static_cast<double>(smax[a * kFusedVectors + tid]));
        }
      __syncthreads();  // (smax and dots are rewritten by the next rows)
    }
    if (tid < ns)
      for (; t < T; ++t) {
        const int32_t c = offsets[t + 1] - offsets[t];
        if (c > 0) mine[static_cast<int64_t>(t) * S] = __dadd_rn(mine[static_cast<int64_t>(t) * S],
                                                                 __ddiv_rn(__dmul_rn(w, sum), static_cast<double>(c)));
        sum = 0;
      }
  }
}

// One voting head's term of sim[t][s]: w * (sum over t's vectors a in [a0, a1) of the max over s's vectors [b0, b1)
// of dots[h][a][b]) / (a1 - a0), in f64 in the CPU's order (a1 > a0). ld: the dots' row stride (dots_ld()).
__device__ __forceinline__ double head_term(const float* dots, int32_t h, int64_t m, int64_t ld, int32_t a0, int32_t a1,
                                            int64_t b0, int64_t b1, double w) {
  const float* dh = dots + static_cast<int64_t>(h) * m * ld;
  double sum = 0;
  for (int32_t a = a0; a < a1; ++a) {
    const float* row = dh + static_cast<int64_t>(a) * ld;
    float mx = row[b0];
    for (int64_t b = b0 + 1; b < b1; ++b) mx = fmaxf(mx, row[b]);
    sum = __dadd_rn(sum, static_cast<double>(mx));
  }
  return __ddiv_rn(__dmul_rn(w, sum), static_cast<double>(a1 - a0));
}

// The columns of stored span s in the rows sim reads: its vectors' dot products [span_first[s] - v0, + span_count[s])
// of a dots tile, or (kMaxima) its one column s - s0 of a tile of span maxima (spanmax_kernel: the same maxima).
template <bool kMaxima>
__device__ __forceinline__ void span_columns(int64_t s, int64_t s0, int64_t v0, const int32_t* span_first,
                                             const int32_t* span_count, int64_t& b0, int64_t& b1) {
  b0 = kMaxima ? s - s0 : span_first[s] - v0;
  b1 = kMaxima ? b0 + 1 : b0 + span_count[s];
}

// sim[t][s] for the query spans t and the stored spans s of one tile (vectors from v0, dots rows of stride ld): per
// voting head in order, the mean over t's vectors of the max over s's vectors of their dot products
// (dots[slot][a][v - v0]; kMaxima: those maxima, dots[slot][a][s - s0]).
template <bool kMaxima>
__global__ void sim_kernel(const float* dots, const int32_t* offsets, int32_t query_spans, const int32_t* span_first,
                           const int32_t* span_count, int32_t s0, int32_t s1, int64_t v0, int64_t ld, int64_t m,
                           const double* weights, int32_t voters, double* sim, int64_t total_spans) {
  const int64_t width = s1 - s0;
  const int64_t total = static_cast<int64_t>(query_spans) * width;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / width;
    const int64_t s = s0 + idx % width;
    const int32_t a0 = offsets[t], a1 = offsets[t + 1];
    int64_t b0, b1;
    span_columns<kMaxima>(s, s0, v0, span_first, span_count, b0, b1);
    double acc = 0;
    if (a1 > a0)
      for (int32_t h = 0; h < voters; ++h) acc = __dadd_rn(acc, head_term(dots, h, m, ld, a0, a1, b0, b1, weights[h]));
    sim[t * total_spans + s] = acc;
  }
}

// sim_kernel's sim[t][s], in parallel over the voting heads: a CTA per query span t (blockIdx.y, strided) and 32
// consecutive stored spans (blockIdx.x), thread (x, y) on span s0 + 32 * blockIdx.x + x and, per round of blockDim.y
// heads, head h0 + y: its term w_h * (sum over t's vectors of the max over s's vectors) / |t| into shared memory
// (adjacent lanes: adjacent spans, whose vectors are adjacent in a dots row); then thread (x, 0) adds the round's terms
// in head order. The same f64 operations in the same order as sim_kernel (each term, then acc += term, head after
// head; fmaxf's order does not matter): bit-identical to it, with blockDim.y times the threads.
constexpr int kSimSpans = 32;
template <bool kMaxima>
__global__ void __launch_bounds__(1024) sim_heads_kernel(
    const float* dots, const int32_t* offsets, int32_t query_spans, const int32_t* span_first, const int32_t* span_count,
    int32_t s0, int32_t s1, int64_t v0, int64_t ld, int64_t m, const double* weights, int32_t voters, double* sim,
    int64_t total_spans) {
  extern __shared__ double terms[];  // [blockDim.y][kSimSpans]
  const int x = static_cast<int>(threadIdx.x), y = static_cast<int>(threadIdx.y), ys = static_cast<int>(blockDim.y);
  const int64_t s = s0 + static_cast<int64_t>(blockIdx.x) * kSimSpans + x;
  const bool live = s < s1;
  int64_t b0 = 0, b1 = 0;
  if (live) span_columns<kMaxima>(s, s0, v0, span_first, span_count, b0, b1);
  for (int64_t t = blockIdx.y; t < query_spans; t += gridDim.y) {
    const int32_t a0 = offsets[t], a1 = offsets[t + 1];
    double acc = 0;  // thread (x, 0)'s
    for (int32_t h0 = 0; h0 < voters; h0 += ys) {
      const int32_t h = h0 + y;
      if (live && a1 > a0 && h < voters) terms[y * kSimSpans + x] = head_term(dots, h, m, ld, a0, a1, b0, b1, weights[h]);
      __syncthreads();
      if (y == 0 && live && a1 > a0)
        for (int32_t j = 0; j < min(ys, voters - h0); ++j) acc = __dadd_rn(acc, terms[j * kSimSpans + x]);
      __syncthreads();  // (the next round rewrites terms)
    }
    if (y == 0 && live) sim[t * total_spans + s] = acc;
  }
}

// score[b] = sum over query spans t of max over b's spans of sim[t][s]; -inf for a block without spans. One warp per
// block: the lanes take the block's spans (32 at a time, coalesced), their maximum by shuffles (a maximum does not
// depend on the order), and every lane adds the query spans' bests in t order (SpanIndex::block_scores's sum).
// (One thread per block walking T x spans serially before, then a warp per block one query span at a time: the same
// values, latency-bound loops.)
constexpr int kBlockWarps = 4, kBlockRows = 8;
__global__ void __launch_bounds__(32 * kBlockWarps) block_kernel(const double* sim, const int32_t* block_begin,
                                                                 int32_t blocks, int32_t query_spans,
                                                                 int64_t total_spans, double* scores) {
  const int64_t b = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (b >= blocks) return;  // whole warps leave together
  const int32_t s0 = block_begin[b], s1 = block_begin[b + 1];
  if (s1 <= s0) {
    if (lane == 0) scores[b] = -INFINITY;
    return;
  }
  // kBlockRows query spans at a time: their first loads issued together (a block has few spans: usually one load a
  // lane), then the maxima, then the adds in t order.
  double score = 0;
  for (int32_t t0 = 0; t0 < query_spans; t0 += kBlockRows) {
    double best[kBlockRows];
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i)
      best[i] = t0 + i < query_spans && s0 + lane < s1 ? sim[static_cast<int64_t>(t0 + i) * total_spans + s0 + lane]
                                                       : -INFINITY;
    if (s1 - s0 > 32)
      for (int i = 0; i < kBlockRows && t0 + i < query_spans; ++i) {
        const double* row = sim + static_cast<int64_t>(t0 + i) * total_spans;
        for (int32_t s = s0 + lane + 32; s < s1; s += 32) best[i] = fmax(best[i], row[s]);
      }
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i)
      for (int off = 16; off > 0; off >>= 1) best[i] = fmax(best[i], __shfl_xor_sync(0xffffffffu, best[i], off));
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i)
      if (t0 + i < query_spans) score = __dadd_rn(score, best[i]);
  }
  if (lane == 0) scores[b] = score;
}

// block_kernel in two passes over sim, in parallel over the query spans too: best[t][b] = the max over b's spans of
// sim[t][s] (a thread per (t, b): adjacent blocks on adjacent lanes read adjacent spans of a sim row), then
// score[b] = sum over t in order of best[t][b] (a warp per block; -inf for a block without spans). The same f64 adds
// in the same order as block_kernel (fmax's order does not matter): bit for bit its scores, which gemm-serial keeps
// as the twin. (ncu at 256K, a retrieval layer: block_kernel 53 us, its warp per block mostly idle lanes (a block has
// a few spans), best_kernel 9.7 us; a thread per (t, b) computing the maxima from the dots themselves instead of sim,
// tried first: 143 us, its loads 32 lines apart.)
constexpr int kBestBlocks = 32, kBestRows = 8;
__global__ void __launch_bounds__(kBestBlocks * kBestRows) best_kernel(const double* sim, const int32_t* block_begin,
                                                                      int32_t blocks, int32_t query_spans,
                                                                      int64_t total_spans, double* best) {
  const int32_t b = static_cast<int32_t>(blockIdx.x) * kBestBlocks + static_cast<int32_t>(threadIdx.x);
  const int32_t t = static_cast<int32_t>(blockIdx.y) * kBestRows + static_cast<int32_t>(threadIdx.y);
  if (b >= blocks || t >= query_spans) return;
  const double* row = sim + static_cast<int64_t>(t) * total_spans;
  double mx = -INFINITY;
  for (int32_t sp = block_begin[b]; sp < block_begin[b + 1]; ++sp) mx = fmax(mx, row[sp]);
  best[static_cast<int64_t>(t) * blocks + b] = mx;
}
// A warp per block: lane i loads best[t0 + i][b] (32 loads in flight), then lane 0 adds them in t order as they
// come across the warp (a thread per block walking its column was latency-bound: 20 us at 256K).
constexpr int kSumWarps = 4;
__global__ void __launch_bounds__(32 * kSumWarps) block_sum_kernel(const double* best, const int32_t* block_begin,
                                                                   int32_t blocks, int32_t query_spans, double* scores) {
  const int64_t b = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (b >= blocks) return;  // whole warps leave together
  if (block_begin[b + 1] <= block_begin[b]) {
    if (lane == 0) scores[b] = -INFINITY;
    return;
  }
  double score = 0;
  for (int32_t t0 = 0; t0 < query_spans; t0 += 32) {
    const double x = t0 + lane < query_spans ? best[static_cast<int64_t>(t0 + lane) * blocks + b] : 0.0;
    const int32_t count = min(32, query_spans - t0);
    for (int i = 0; i < count; ++i) score = __dadd_rn(score, __shfl_sync(0xffffffffu, x, i));
  }
  if (lane == 0) scores[b] = score;
}

namespace sm = stream::span_math;

// Span discovery (span_math.h): the prefix sums in fixed point, whose integer adds give the CPU's P in any order.
// Rows: a warp per row, 128 columns a step: each lane's 4 adjacent entries summed in turn, the lanes' sums scanned
// across the warp (Hillis-Steele over shuffles), the row's running total carried from step to step; R[r][c] goes into
// P's row r + 1. (Before 2026-12-02 the sums were f64 in the CPU's order, a thread per row and then per column: 67 +
// 38 us under ncu at n = 1,024; a warp per row 32 columns a step: 23 us.)
constexpr int kRowWarps = 8, kRowCols = 4;
__global__ void __launch_bounds__(32 * kRowWarps) prefix_rows_kernel(const float* map, int n, uint64_t* P) {
  const int r = static_cast<int>(blockIdx.x) * kRowWarps + static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (r >= n) return;  // whole warps
  const float* in = map + static_cast<int64_t>(r) * n;
  uint64_t* out = P + static_cast<int64_t>(r + 1) * (n + 1);
  if (lane == 0) out[0] = 0;
  uint64_t carry = 0;
  for (int c0 = 0; c0 < n; c0 += 32 * kRowCols) {
    const int c = c0 + lane * kRowCols;
    uint64_t v[kRowCols];
#pragma unroll
    for (int i = 0; i < kRowCols; ++i) v[i] = c + i <= r && c + i < n ? sm::fixed_mass(in[c + i]) : 0;
#pragma unroll
    for (int i = 1; i < kRowCols; ++i) v[i] += v[i - 1];
    uint64_t incl = v[kRowCols - 1];
    if (c0 <= r) {  // (past the diagonal every entry is 0: the row total carries on)
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint64_t o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
    }
    const uint64_t before = carry + incl - v[kRowCols - 1];  // the row's sum before this lane's entries
#pragma unroll
    for (int i = 0; i < kRowCols; ++i)
      if (c + i < n) out[c + i + 1] = before + v[i];
    carry = __shfl_sync(0xffffffffu, carry + incl, 31);
  }
}
// Columns, in strips of kStripRows rows: each strip's column sums (T[strip][c]), then each strip's rows in turn from
// the sum of the strips above it: P[r + 1][c + 1] = P[r][c + 1] + R[r][c]. A thread per (column, strip), coalesced.
constexpr int kStripRows = 32, kStripThreads = 128;
__global__ void __launch_bounds__(kStripThreads) prefix_strips_kernel(int n, const uint64_t* P, uint64_t* T) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  const int64_t ld = static_cast<int64_t>(n) + 1;
  const int r0 = static_cast<int>(blockIdx.y) * kStripRows, r1 = min(n, r0 + kStripRows);
  uint64_t sum = 0;
#pragma unroll 8
  for (int r = r0; r < r1; ++r) sum += P[(r + 1) * ld + c + 1];
  T[static_cast<int64_t>(blockIdx.y) * n + c] = sum;
}
__global__ void __launch_bounds__(kStripThreads) prefix_apply_kernel(int n, uint64_t* P, const uint64_t* T) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  const int64_t ld = static_cast<int64_t>(n) + 1;
  const int strip = static_cast<int>(blockIdx.y);
  uint64_t acc = 0;
  for (int s = 0; s < strip; ++s) acc += T[static_cast<int64_t>(s) * n + c];
  const int r0 = strip * kStripRows, r1 = min(n, r0 + kStripRows);
  uint64_t* col = P + ld + c + 1;  // P[1][c + 1]
  uint64_t v[kStripRows];
#pragma unroll
  for (int i = 0; i < kStripRows; ++i) v[i] = r0 + i < r1 ? col[(r0 + i) * ld] : 0;
#pragma unroll
  for (int i = 0; i < kStripRows; ++i)
    if (r0 + i < r1) col[(r0 + i) * ld] = acc += v[i];
}

// theta: the k-th smallest causal entry of the map, by a radix select over span_math's order keys: four passes of
// 8 bits, each a histogram over the whole grid (the counts are integers: the order of the atomic adds does not
// matter) and a pick of the digit holding the k-th key (one thread).
struct SelectState {
  uint32_t prefix, mask;
  uint64_t rank;
  uint32_t hist[256];
  uint32_t done;  // the current pass's blocks that have added their counts (the last one picks the digit)
};

__global__ void select_init_kernel(SelectState* st, uint64_t k) {
  for (int b = static_cast<int>(threadIdx.x); b < 256; b += blockDim.x) st->hist[b] = 0;
  if (threadIdx.x == 0) {
    st->prefix = st->mask = st->done = 0;
    st->rank = k;
  }
}

__device__ void select_pick(SelectState* st, int shift, double* theta);

constexpr int kSelectThreads = 256;
__global__ void __launch_bounds__(kSelectThreads) select_hist_kernel(const float* map, int n, SelectState* st, int shift,
                                                                     double* theta) {
  __shared__ uint32_t hist[256];
  for (int b = static_cast<int>(threadIdx.x); b < 256; b += kSelectThreads) hist[b] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix, mask = st->mask;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // Rows in turn across the grid, each row's causal entries [0, r] (contiguous: coalesced); every thread of the block
  // runs the same trips (the warp's match needs all its lanes).
  for (int r = static_cast<int>(blockIdx.x); r < n; r += static_cast<int>(gridDim.x)) {
    const float* row = map + static_cast<int64_t>(r) * n;
    for (int c0 = 0; c0 <= r; c0 += kSelectThreads) {
      const int c = c0 + static_cast<int>(threadIdx.x);
      int bin = -1;
      if (c <= r) {
        const uint32_t key = sm::order_key(row[c]);
        if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & 255u);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
  }
  __syncthreads();
  for (int b = static_cast<int>(threadIdx.x); b < 256; b += kSelectThreads)
    if (hist[b] != 0) atomicAdd(&st->hist[b], hist[b]);
  // The last block to finish picks the digit (no launch of its own): its counts, then the others' (fenced before
  // their arrival), are all in st->hist.
  __threadfence();
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&st->done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  select_pick(st, shift, theta);
  if (threadIdx.x == 0) st->done = 0;
}

// sm::pick_digit over the 256 counts by one warp (the pass's last block's first): lane l holds digits [8l, 8l + 8), an
// inclusive scan of the lanes' sums finds the lane whose range holds the rank, which scans its eight (a thread
// scanning 256 counts in global memory one after another before: ~12 us a pass; a kernel of its own after each pass
// until 2026-12-02: 2.5 us and a launch). The state is read from L2 (__ldcg): other blocks' atomics wrote the counts.
__device__ void select_pick(SelectState* st, int shift, double* theta) {
  const int lane = static_cast<int>(threadIdx.x);
  uint32_t h[8];
  uint64_t mine = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    h[i] = __ldcg(&st->hist[8 * lane + i]);
    mine += h[i];
  }
  uint64_t incl = mine;
  for (int off = 1; off < 32; off <<= 1) {
    const uint64_t o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  const uint64_t k = __ldcg(reinterpret_cast<const unsigned long long*>(&st->rank)), below = incl - mine;
  const bool here = k >= below && k < incl;  // the lanes' ranges [below, incl) are disjoint: one lane at most
  const unsigned who = __ballot_sync(0xffffffffu, here);
#pragma unroll
  for (int i = 0; i < 8; ++i) st->hist[8 * lane + i] = 0;
  if (here || (who == 0 && lane == 0)) {
    uint32_t digit = 255;  // k out of range (not reached for k < the keys counted): pick_digit's 255, k kept
    uint64_t r = k;
    if (here) {
      uint64_t b = below;
      for (int i = 0; i < 8; ++i) {
        if (k < b + h[i]) {
          digit = static_cast<uint32_t>(8 * lane + i);
          r = k - b;
          break;
        }
        b += h[i];
      }
    }
    const uint32_t prefix = __ldcg(&st->prefix) | (digit << shift);
    st->rank = r;
    st->prefix = prefix;
    st->mask = __ldcg(&st->mask) | (255u << shift);
    if (shift == 0) *theta = static_cast<double>(sm::from_order_key(prefix));
  }
}

// The linear variant's candidate per anti-diagonal d, one warp per diagonal (begin -1: none): each lane scans its
// share, the lanes' bests combine by span_math::diagonal_better (order-free: the maximum, ties the smallest j).
__global__ void candidates_kernel(const uint64_t* P, int n, const double* theta, int32_t* begin_end, double* score) {
  const int d = static_cast<int>((blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (d >= 2 * n - 1) return;  // whole warps leave together
  int32_t j = -1;
  double v = 0;
  bool any = sm::diagonal_best_lane(P, n, *theta, d, lane, 32, &j, &v);
  for (int off = 16; off > 0; off >>= 1) {
    const int32_t oj = __shfl_xor_sync(0xffffffffu, j, off);
    const double ov = __shfl_xor_sync(0xffffffffu, v, off);
    const bool oany = __shfl_xor_sync(0xffffffffu, any ? 1 : 0, off) != 0;
    if (oany && (!any || sm::diagonal_better(ov, oj, v, j))) {
      j = oj;
      v = ov;
      any = true;
    }
  }
  if (lane == 0) {
    begin_end[2 * d] = any ? j : -1;
    begin_end[2 * d + 1] = any ? d - j + 1 : -1;
    score[d] = any ? v : 0.0;
  }
}

// Masses of spans (begin, end pairs): the triangle and the later rows' (span_masses()).
__global__ void masses_kernel(const uint64_t* P, int n, const int32_t* spans, int count, double* out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  const int32_t b = spans[2 * i], e = spans[2 * i + 1];
  out[2 * i] = sm::mass(P, n, b, e, b, e);
  out[2 * i + 1] = sm::mass(P, n, e, n, b, e);
}

// Values [first, first + row) of each ring row (ring rows of `ring_row` values) of the positions, [m, row].
// (Out: float, the bf16 values converted exactly: gather_keys(); or nbf, as they are: the index mirror.)
template <typename Out>
__global__ void gather_ring_kernel(const nbf* ring, int32_t ring_rows, int32_t sinks, const int32_t* positions,
                                   int64_t m, int64_t row, Out* out, int64_t ring_row, int64_t first) {
  const int64_t total = m * row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t a = idx / row, j = idx % row;
    const int64_t slot = (positions[a] - sinks) % ring_rows;
    if constexpr (std::is_same_v<Out, float>)
      out[idx] = __bfloat162float(ring[slot * ring_row + first + j]);
    else
      out[idx] = ring[slot * ring_row + first + j];
  }
}

// InfLLM: the dot of the mean query of head h with block b's mean key (voting heads only), then per block the
// weighted sum over heads in order (span_math::repr_score's arithmetic).
__global__ void repr_dots_kernel(const float* qmean, const float* means, const double* w, int64_t blocks, int nq,
                                 int group, int d, int64_t row, float* dots) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= blocks * nq) return;
  const int64_t b = idx / nq;
  const int h = static_cast<int>(idx % nq);
  dots[idx] = w[h] == 0 ? 0.0f
                        : sm::repr_dot(qmean + static_cast<int64_t>(h) * d, means + b * row + static_cast<int64_t>(h / group) * d, d);
}
__global__ void repr_sum_kernel(const float* dots, const double* w, int64_t blocks, int nq, double* scores) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= blocks) return;
  double s = 0;
  for (int h = 0; h < nq; ++h)
    if (w[h] != 0) s = sm::repr_accumulate(s, w[h], dots[b * nq + h]);
  scores[b] = s;
}

// Grows a scratch buffer geometrically and never shrinks it (a reallocation frees the old buffer, which waits for
// the whole device: per layer and chunk that would be a hidden synchronisation). Kernels take explicit counts.
template <typename T>
void fit(attn::gpu::DeviceBuffer<T>& b, size_t count) {
  if (count > b.size()) b.resize(std::max(count, 2 * b.size()));
}

template <typename T>
void h2d(T* dst, const T* src, size_t count, cudaStream_t s) {
  if (count > 0) TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyHostToDevice, s));
}

// Grows a device array to at least `want` elements keeping its first `keep` (a new allocation, copied).
template <typename T>
void grow(attn::gpu::DeviceBuffer<T>& buf, int64_t& capacity, int64_t want, int64_t keep, int64_t per, cudaStream_t s) {
  if (want <= capacity) return;
  const int64_t cap = std::max<int64_t>({want, 2 * capacity, 1024});
  attn::gpu::DeviceBuffer<T> bigger(static_cast<size_t>(cap * per));
  if (keep > 0)
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(bigger.data(), buf.data(), static_cast<size_t>(keep * per) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, s));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));  // the old buffer is freed on assignment
  buf = std::move(bigger);
  capacity = cap;
}

}  // namespace

StreamDecider::StreamDecider(const ModelConfig& cfg)
    : nq_(cfg.num_q_heads), nkv_(cfg.num_kv_heads), d_(cfg.head_dim) {
  qrow_ = static_cast<int64_t>(nq_) * d_;
  row_ = static_cast<int64_t>(nkv_) * d_;
  mirrors_.resize(static_cast<size_t>(cfg.num_layers));
  means_mirrors_.resize(static_cast<size_t>(cfg.num_layers));
  const char* scoring = std::getenv("TESSERA_LTRI_SCORING");
  const std::string how = scoring != nullptr ? scoring : kDefaultLtriScoring;
  check(how == "fused" || how == "gemm" || how == "gemm-serial",
        [&] { return "TESSERA_LTRI_SCORING must be fused, gemm or gemm-serial, got '" + how + "'"; });
  check(d_ == 64 || d_ == 128 || d_ == 256, [&] {
    return "GPU streaming: head_dim " + std::to_string(d_) + " is not 64, 128 or 256 (the chunk map's kernels)";
  });
  fused_ = how == "fused";
  serial_sim_ = how == "gemm-serial";
  if (fused_)
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(fused_ltri_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(fused_smem_bytes(d_))));
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
  // Two stages (copies of the next tiles in flight during the products) where the device's shared memory holds
  // map_tiles_kernel's four tiles (128 KB at head_dim 256: not on sm_86's 99 KB, one stage there).
  int smem_optin = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  map_stages_ = static_cast<size_t>(smem_optin) >= 4 * static_cast<size_t>(kMapTile) * static_cast<size_t>(d_) * sizeof(nbf) ? 2 : 1;
  with_map_kernels(d_, map_stages_, [&]<int D, int kStages>() {  // ([&]: a captureless lambda template trips nvcc's #445-D)
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(map_stats_kernel<D, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(map_stats_smem<D, kStages>())));
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(map_tiles_kernel<D, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(map_tiles_smem<D, kStages>())));
  });
  with_head_dim(d_, [&]<int D>() {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(dots_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(2 * map_tile_bytes<D>())));
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(spanmax_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(spanmax_smem<D>())));
  });
}

StreamDecider::~StreamDecider() {
  if (results_ != nullptr) cudaEventDestroy(results_);
}

void StreamDecider::sync(cudaStream_t s) {
  if (!before_wait_) {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  if (results_ == nullptr) TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&results_, cudaEventDisableTiming));
  TESSERA_CUDA_CHECK(cudaEventRecord(results_, s));
  const std::function<void()> work = std::move(before_wait_);
  before_wait_ = nullptr;
  work();
  TESSERA_CUDA_CHECK(cudaEventSynchronize(results_));
}

size_t StreamDecider::device_bytes() const {
  size_t b = qb_.bytes() + kb_.bytes() + stat_max_.bytes() + stat_inv_.bytes() + vote_parts_.bytes() + scores_.bytes() + map_.bytes() + votes_.bytes() +
             dots_.bytes() + mean_.bytes() + sim_.bytes() + block_scores_.bytes() + weights_.bytes() +
             score_args_.bytes();
  for (const Mirror& m : mirrors_)
    b += m.keys.bytes() + m.span_first.bytes() + m.span_count.bytes() + m.block_begin.bytes() +
         m.tile_begin.bytes();
  b += qsel16_.bytes();
  for (const MeansMirror& m : means_mirrors_) b += m.means.bytes();
  b += prefix_.bytes() + strip_sums_.bytes() + best_.bytes() + theta_dev_.bytes() + masses_.bytes() + cand_begin_.bytes() + cand_end_.bytes() +
       positions_.bytes() + cand_score_.bytes() + keys_.bytes() + repr_dots_.bytes() + select_.bytes();
  return b;
}

void StreamDecider::Mirror::clear() {
  vectors = spans = 0;
  blocks = 0;
  tile_vectors = tile_spans = tiles_uploaded = 0;
  first_host.clear();
  count_host.clear();
  block_begin_host.clear();
  tile_begin_host.clear();
}

void StreamDecider::reset() {
  for (Mirror& m : mirrors_) m.clear();
  for (MeansMirror& m : means_mirrors_) m.blocks = 0;
  pending_ = pending_candidates_ = false;
}

void StreamDecider::chunk_map(const bf16* q, const bf16* k, int32_t n, int32_t pos, const float* inv_freq,
                              float scale, bool want_map, cudaStream_t s) {
  launch_chunk(q, k, n, pos, inv_freq, scale, want_map, false, 0.0, s);
  wait(s);
}

void StreamDecider::wait(cudaStream_t s) {
  if (!pending_) return;
  sync(s);
  if (s == arena_stream_) arena_used_ = 0;
  synced();
}

void StreamDecider::issued(std::chrono::steady_clock::time_point t0) {
  if (timer_) prof_.issue += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void StreamDecider::profile(bool on) {
  if (on && !timer_) timer_ = std::make_unique<EventTimer>(true);
  if (!on) timer_.reset();
}

// The sections reuse EventTimer's kinds as slots (kMap..kScores: 0..4 of its 6).
void StreamDecider::begin(Section what, cudaStream_t s) {
  if (timer_) timer_->begin(static_cast<EventTimer::Kind>(what), s);
}
void StreamDecider::end(Section what, cudaStream_t s) {
  if (timer_) timer_->end(static_cast<EventTimer::Kind>(what), s);
}

// Host arrays to the device through the pinned arena: a cudaMemcpyAsync from pageable memory waits for the stream
// before it copies (a hidden synchronisation per call); from pinned memory it only enqueues. The arena's bytes are
// reused once the stream that read them has synchronised (synced()) or, before another stream's copy, after
// synchronising the last one.
void StreamDecider::put(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return;
  if (arena_used_ > 0 && s != arena_stream_) {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(arena_stream_));
    arena_used_ = 0;
  }
  const size_t need = (bytes + 15) / 16 * 16;
  if (arena_used_ + need > arena_.size()) {
    if (arena_used_ > 0) TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
    arena_used_ = 0;
    arena_.grow(std::max<size_t>(need, size_t{1} << 20));
  }
  unsigned char* at = arena_.data() + arena_used_;
  std::memcpy(at, src, bytes);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, at, bytes, cudaMemcpyHostToDevice, s));
  arena_used_ += need;
  arena_stream_ = s;
}

void StreamDecider::synced() {
  ++prof_.waits;
  if (timer_) {  // the stream has synchronised: every recorded event is complete
    const std::array<double, EventTimer::kKinds> t = timer_->collect();
    prof_.map += t[kMap];
    prof_.spans += t[kSpans];
    prof_.masses += t[kMasses];
    prof_.keys += t[kKeys];
    prof_.scores += t[kScores] + t[kScoresWide];
    prof_.scores_wide += t[kScoresWide];
  }
  if (!pending_) return;
  pending_ = false;
  candidates_.clear();
  if (!pending_candidates_) return;
  pending_candidates_ = false;
  const int32_t diagonals = 2 * map_n_ - 1;
  for (int32_t d = 0; d < diagonals; ++d)
    if (cand_host_[2 * d] >= 0)
      candidates_.push_back(stream::Span{cand_host_[2 * d], cand_host_[2 * d + 1], cand_score_host_[d]});
  theta_ = cand_score_host_[diagonals];
}

void StreamDecider::launch_chunk(const bf16* q, const bf16* k, int32_t n, int32_t pos, const float* inv_freq,
                                 float scale, bool want_map, bool candidates, double theta_quantile, cudaStream_t s,
                                 int32_t map_head) {
  const auto t_issue = std::chrono::steady_clock::now();
  check(map_head < nq_, "GPU streaming: the map's head is outside the model's query heads");
  check(!pending_, "GPU streaming: a chunk's decisions launched before the last one was waited for");
  const int64_t nn = static_cast<int64_t>(n) * n;
  const int64_t tiles = (n + kMapTile - 1) / kMapTile, n_pad = tiles * kMapTile;
  fit(qb_, static_cast<size_t>(n_pad * qrow_));
  fit(kb_, static_cast<size_t>(n_pad * row_));
  const int32_t h0 = map_head >= 0 ? map_head : 0, heads = map_head >= 0 ? 1 : nq_;
  fit(stat_max_, static_cast<size_t>(heads) * static_cast<size_t>(n));
  fit(stat_inv_, static_cast<size_t>(heads) * static_cast<size_t>(n));
  // The heads in `splits` ranges (each causal tile's CTAs x splits ~ 4 per multiprocessor), summed in order after.
  const int64_t causal_tiles = tiles * (tiles + 1) / 2;
  const int splits = static_cast<int>(std::clamp<int64_t>((4 * sm_count_ + causal_tiles - 1) / causal_tiles, 1,
                                                          std::min(heads, 8)));
  if (splits > 1) fit(scores_, static_cast<size_t>(splits * nn));
  fit(map_, static_cast<size_t>(nn));
  fit(votes_, static_cast<size_t>(n));
  const int half = d_ / 2;
  begin(kMap, s);
  auto* qb = reinterpret_cast<nbf*>(qb_.data());
  auto* kb = reinterpret_cast<nbf*>(kb_.data());
  rotate_bf16_kernel<<<blocks_for(static_cast<int64_t>(n) * half, kThreads), kThreads, 0, s>>>(
      reinterpret_cast<const nbf*>(q), qb, nq_, reinterpret_cast<const nbf*>(k), kb, nkv_, n, d_, inv_freq, pos);
  check_launch("stream chunk map: rotate");
  if (n_pad > n) {  // zero rows up to the tile (never counted: masked as keys and not written as rows)
    TESSERA_CUDA_CHECK(cudaMemsetAsync(qb + n * qrow_, 0, static_cast<size_t>((n_pad - n) * qrow_) * sizeof(bf16), s));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(kb + n * row_, 0, static_cast<size_t>((n_pad - n) * row_) * sizeof(bf16), s));
  }
  const float sc = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(d_));
  const float sc2 = sc * 1.4426950408889634f;  // the kernels' softmax in base 2
  const int group = nq_ / nkv_;
  if (splits == 1) TESSERA_CUDA_CHECK(cudaMemsetAsync(map_.data(), 0, static_cast<size_t>(nn) * sizeof(float), s));
  with_map_kernels(d_, map_stages_, [&]<int D, int kStages>() {
    map_stats_kernel<D, kStages><<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads)), 32 * kMapWarps,
                                   map_stats_smem<D, kStages>(), s>>>(qb, kb, n, qrow_, row_, group, h0, sc2,
                                                                      stat_max_.data(), stat_inv_.data());
    map_tiles_kernel<D, kStages><<<dim3(static_cast<unsigned>(causal_tiles), static_cast<unsigned>(splits)),
                                   32 * kMapWarps, map_tiles_smem<D, kStages>(), s>>>(
        qb, kb, n, qrow_, row_, group, h0, heads, splits, sc2, stat_max_.data(), stat_inv_.data(),
        splits == 1 ? map_.data() : scores_.data());
  });
  if (splits > 1) map_sum_kernel<<<blocks_for(nn, kThreads), kThreads, 0, s>>>(scores_.data(), map_.data(), n, splits);
  const int vote_blocks = (n + kVoteRows - 1) / kVoteRows;
  fit(vote_parts_, static_cast<size_t>(vote_blocks) * static_cast<size_t>(n));
  votes_part_kernel<<<dim3(static_cast<unsigned>((n + 127) / 128), static_cast<unsigned>(vote_blocks)), 128, 0, s>>>(
      map_.data(), vote_parts_.data(), n);
  votes_kernel<<<(n + 127) / 128, 128, 0, s>>>(vote_parts_.data(), votes_.data(), n, vote_blocks);
  check_launch("stream chunk map: softmax");
  end(kMap, s);
  votes_host_.grow(static_cast<size_t>(n));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(votes_host_.data(), votes_.data(), static_cast<size_t>(n) * sizeof(float),
                                     cudaMemcpyDeviceToHost, s));
  if (want_map) {
    map_host_.grow(static_cast<size_t>(nn));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(map_host_.data(), map_.data(), static_cast<size_t>(nn) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s));
  }
  map_n_ = n;
  pending_ = true;
  pending_candidates_ = candidates;
  if (!candidates) return issued(t_issue);
  // Span discovery: prefix sums, theta, the best point per anti-diagonal.
  const int64_t w = static_cast<int64_t>(n) + 1;
  fit(prefix_, static_cast<size_t>(w * w));
  fit(theta_dev_, 1);
  begin(kSpans, s);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(prefix_.data(), 0, static_cast<size_t>(w) * sizeof(uint64_t), s));
  prefix_rows_kernel<<<(n + kRowWarps - 1) / kRowWarps, 32 * kRowWarps, 0, s>>>(map_.data(), n, prefix_.data());
  const dim3 strips(static_cast<unsigned>((n + kStripThreads - 1) / kStripThreads),
                    static_cast<unsigned>((n + kStripRows - 1) / kStripRows));
  fit(strip_sums_, static_cast<size_t>(strips.y) * static_cast<size_t>(n));
  prefix_strips_kernel<<<strips, kStripThreads, 0, s>>>(n, prefix_.data(), strip_sums_.data());
  prefix_apply_kernel<<<strips, kStripThreads, 0, s>>>(n, prefix_.data(), strip_sums_.data());
  const uint64_t causal = static_cast<uint64_t>(n) * static_cast<uint64_t>(n + 1) / 2;
  fit(select_, (sizeof(SelectState) + 7) / 8);
  auto* st = reinterpret_cast<SelectState*>(select_.data());
  select_init_kernel<<<1, 256, 0, s>>>(st, sm::quantile_rank(theta_quantile, causal));
  const int select_blocks = static_cast<int>(std::clamp<int64_t>(nn / (kSelectThreads * 8), 1, 264));
  for (int shift = 24; shift >= 0; shift -= 8)
    select_hist_kernel<<<select_blocks, kSelectThreads, 0, s>>>(map_.data(), n, st, shift, theta_dev_.data());
  const int32_t diagonals = 2 * n - 1;
  fit(cand_begin_, static_cast<size_t>(2 * diagonals));
  fit(cand_score_, static_cast<size_t>(diagonals));
  candidates_kernel<<<(diagonals + 3) / 4, 128, 0, s>>>(prefix_.data(), n, theta_dev_.data(), cand_begin_.data(),
                                                        cand_score_.data());
  check_launch("stream span discovery");
  end(kSpans, s);
  cand_host_.grow(static_cast<size_t>(2 * diagonals));
  cand_score_host_.grow(static_cast<size_t>(diagonals) + 1);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(cand_host_.data(), cand_begin_.data(), static_cast<size_t>(2 * diagonals) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, s));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(cand_score_host_.data(), cand_score_.data(), static_cast<size_t>(diagonals) * sizeof(double),
                                     cudaMemcpyDeviceToHost, s));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(cand_score_host_.data() + diagonals, theta_dev_.data(), sizeof(double),
                                     cudaMemcpyDeviceToHost, s));
  issued(t_issue);
}

std::vector<stream::SpanMasses> StreamDecider::span_masses(std::span<const stream::Span> spans, cudaStream_t s) {
  const auto count = static_cast<int32_t>(spans.size());
  std::vector<stream::SpanMasses> out(spans.size());
  if (count == 0) return out;
  const auto t_issue = std::chrono::steady_clock::now();
  staging_.grow(static_cast<size_t>(2 * count));
  for (int32_t i = 0; i < count; ++i) {
    staging_[2 * i] = spans[static_cast<size_t>(i)].begin;
    staging_[2 * i + 1] = spans[static_cast<size_t>(i)].end;
  }
  fit(cand_end_, static_cast<size_t>(2 * count));
  fit(masses_, static_cast<size_t>(2 * count));
  begin(kMasses, s);
  h2d(cand_end_.data(), staging_.data(), static_cast<size_t>(2 * count), s);
  masses_kernel<<<(count + 127) / 128, 128, 0, s>>>(prefix_.data(), map_n_, cand_end_.data(), count, masses_.data());
  check_launch("stream span masses");
  end(kMasses, s);
  masses_host_.grow(static_cast<size_t>(2 * count));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(masses_host_.data(), masses_.data(), static_cast<size_t>(2 * count) * sizeof(double),
                                     cudaMemcpyDeviceToHost, s));
  issued(t_issue);
  sync(s);
  if (s == arena_stream_) arena_used_ = 0;
  synced();
  for (int32_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = {masses_host_[2 * i], masses_host_[2 * i + 1]};
  return out;
}

std::vector<float> StreamDecider::gather_keys(const bf16* ring, int32_t ring_rows, int32_t sinks,
                                              std::span<const int32_t> positions, cudaStream_t s) {
  const auto m = static_cast<int64_t>(positions.size());
  std::vector<float> out(static_cast<size_t>(m * row_));
  if (m == 0) return out;
  staging_.grow(static_cast<size_t>(m));
  std::copy(positions.begin(), positions.end(), staging_.data());
  fit(positions_, static_cast<size_t>(m));
  fit(keys_, static_cast<size_t>(m * row_));
  begin(kKeys, s);
  h2d(positions_.data(), staging_.data(), static_cast<size_t>(m), s);
  gather_ring_kernel<<<blocks_for(m * row_, kThreads), kThreads, 0, s>>>(reinterpret_cast<const nbf*>(ring), ring_rows,
                                                                         sinks, positions_.data(), m, row_, keys_.data(),
                                                                         row_, int64_t{0});
  check_launch("stream index keys");
  end(kKeys, s);
  keys_host_.grow(static_cast<size_t>(m * row_));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(keys_host_.data(), keys_.data(), static_cast<size_t>(m * row_) * sizeof(float),
                                     cudaMemcpyDeviceToHost, s));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
  if (s == arena_stream_) arena_used_ = 0;
  synced();
  std::copy(keys_host_.data(), keys_host_.data() + m * row_, out.begin());
  return out;
}

void StreamDecider::set_mirror_heads(Mirror& M, int32_t head_begin, int32_t heads) {
  check(head_begin >= 0 && heads >= 0 && head_begin + heads <= nkv_, "GPU streaming: index heads outside the kv heads");
  const int64_t row = static_cast<int64_t>(heads) * d_;
  if (M.row != row || M.head_begin != head_begin) {
    check(M.vectors == 0, "GPU streaming: the index mirror's kv heads changed while it holds vectors");
    M.row = row;
    M.head_begin = head_begin;
    M.vector_capacity = 0;  // (grow() reallocates at the new row size)
  }
}

void StreamDecider::append_index_keys(int32_t layer, const bf16* ring, int32_t ring_rows, int32_t sinks,
                                      std::span<const int32_t> positions, int32_t head_begin, int32_t heads,
                                      cudaStream_t s) {
  const auto t_issue = std::chrono::steady_clock::now();
  Mirror& M = mirrors_[static_cast<size_t>(layer)];
  const auto m = static_cast<int64_t>(positions.size());
  if (m == 0) return;
  set_mirror_heads(M, head_begin, heads);
  if (M.row == 0) {  // a layer that keeps no heads: nothing to hold
    M.vectors += m;
    return;
  }
  fit(positions_, static_cast<size_t>(m));
  const auto* r = reinterpret_cast<const nbf*>(ring);
  const int64_t first = static_cast<int64_t>(head_begin) * d_;
  grow(M.keys, M.vector_capacity, M.vectors + m, M.vectors, M.row, s);
  begin(kKeys, s);
  put(positions_.data(), positions.data(), static_cast<size_t>(m) * sizeof(int32_t), s);
  gather_ring_kernel<<<blocks_for(m * M.row, kThreads), kThreads, 0, s>>>(
      r, ring_rows, sinks, positions_.data(), m, M.row, reinterpret_cast<nbf*>(M.keys.data()) + M.vectors * M.row, row_,
      first);
  check_launch("stream index keys to the mirror");
  end(kKeys, s);
  M.vectors += m;
  issued(t_issue);
}

std::vector<float> StreamDecider::mirror_keys(int32_t layer) const {
  const Mirror& M = mirrors_[static_cast<size_t>(layer)];
  const int64_t values = M.row > 0 ? M.vectors * M.row : 0;
  std::vector<float> out(static_cast<size_t>(values));
  if (out.empty()) return out;
  std::vector<bf16> raw(out.size());
  TESSERA_CUDA_CHECK(cudaMemcpy(raw.data(), M.keys.data(), raw.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::transform(raw.begin(), raw.end(), out.begin(), bf16_to_f32);
  return out;
}

// block_scores_ [blocks] to the host through the pinned buffer; waits for the stream (the decision needs them).
std::vector<double> StreamDecider::download_scores(int32_t blocks, cudaStream_t s) {
  scores_host_.grow(static_cast<size_t>(blocks));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(scores_host_.data(), block_scores_.data(), static_cast<size_t>(blocks) * sizeof(double),
                                     cudaMemcpyDeviceToHost, s));
  sync(s);
  if (s == arena_stream_) arena_used_ = 0;
  synced();
  return std::vector<double>(scores_host_.data(), scores_host_.data() + blocks);
}

std::vector<double> StreamDecider::infllm_scores(int32_t layer, const stream::ReprIndex& index, const bf16* q,
                                                 int32_t n, const stream::HeadWeights& w, cudaStream_t s) {
  MeansMirror& M = means_mirrors_[static_cast<size_t>(layer)];
  const int32_t blocks = index.num_blocks();
  if (blocks < M.blocks) M.blocks = 0;  // the index was cleared
  begin(kScores, s);
  if (blocks > M.blocks) {
    grow(M.means, M.capacity, blocks, M.blocks, row_, s);
    means_staging_.clear();
    for (int32_t b = static_cast<int32_t>(M.blocks); b < blocks; ++b) {
      const std::span<const float> mean = index.mean(b);
      means_staging_.insert(means_staging_.end(), mean.begin(), mean.end());
    }
    // Through the pinned arena (put()): enqueued, no synchronisation.
    put(M.means.data() + M.blocks * row_, means_staging_.data(), means_staging_.size() * sizeof(float), s);
    M.blocks = blocks;
  }
  if (blocks == 0) {
    end(kScores, s);
    return {};
  }
  fit(mean_, static_cast<size_t>(qrow_));
  mean_query_kernel<<<static_cast<unsigned>((qrow_ + 127) / 128), 128, 0, s>>>(reinterpret_cast<const nbf*>(q),
                                                                               mean_.data(), n, qrow_);
  fit(weights_, static_cast<size_t>(nq_));
  put(weights_.data(), w.data(), static_cast<size_t>(nq_) * sizeof(double), s);
  fit(repr_dots_, static_cast<size_t>(blocks) * static_cast<size_t>(nq_));
  const int64_t pairs = static_cast<int64_t>(blocks) * nq_;
  repr_dots_kernel<<<static_cast<unsigned>((pairs + 127) / 128), 128, 0, s>>>(
      mean_.data(), M.means.data(), weights_.data(), blocks, nq_, nq_ / nkv_, d_, row_, repr_dots_.data());
  fit(block_scores_, static_cast<size_t>(blocks));
  repr_sum_kernel<<<(blocks + 127) / 128, 128, 0, s>>>(repr_dots_.data(), weights_.data(), blocks, nq_,
                                                       block_scores_.data());
  check_launch("stream infllm scores");
  end(kScores, s);
  return download_scores(blocks, s);
}

std::vector<float> StreamDecider::mean_query(const bf16* q, int32_t n, cudaStream_t s) {
  fit(mean_, static_cast<size_t>(qrow_));
  mean_query_kernel<<<static_cast<unsigned>((qrow_ + 127) / 128), 128, 0, s>>>(reinterpret_cast<const nbf*>(q),
                                                                               mean_.data(), n, qrow_);
  check_launch("stream mean query");
  std::vector<float> out(static_cast<size_t>(qrow_));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), mean_.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
  if (s == arena_stream_) arena_used_ = 0;
  synced();
  return out;
}

void StreamDecider::mirror(int32_t layer, const stream::SpanIndex& index, cudaStream_t s) {
  Mirror& M = mirrors_[static_cast<size_t>(layer)];
  const std::span<const float> keys = index.keys();
  const int64_t vectors = index.num_vectors();
  const int64_t spans = index.num_spans();
  const int32_t blocks = index.num_blocks();
  if (vectors < M.vectors || spans < M.spans || blocks < M.blocks) M.clear();  // the index was cleared (a new sequence)
  if (index.row() == 0) {  // a layer whose index keeps no kv head (its blocks come from the votes): no keys to hold
    set_mirror_heads(M, index.kv_head_begin(), 0);
    M.vectors = vectors;
  } else if (index.holds_keys()) {  // f32 keys of a host index: uploaded as bf16 (exact for keys of bf16 values)
    set_mirror_heads(M, index.kv_head_begin(), index.kv_heads_kept());
    if (vectors > M.vectors && M.row > 0) {
      grow(M.keys, M.vector_capacity, vectors, M.vectors, M.row, s);
      const auto from = static_cast<size_t>(M.vectors * M.row);
      const auto values = static_cast<size_t>((vectors - M.vectors) * M.row);
      keys_staging_.resize(values);
      std::transform(keys.begin() + static_cast<std::ptrdiff_t>(from),
                     keys.begin() + static_cast<std::ptrdiff_t>(from + values), keys_staging_.begin(), f32_to_bf16);
      h2d(M.keys.data() + from, keys_staging_.data(), values, s);  // pageable: staged before the call returns
    }
    M.vectors = vectors;
  } else {  // the keys were appended here as they were gathered (append_index_keys)
    set_mirror_heads(M, index.kv_head_begin(), index.kv_heads_kept());
    check(M.vectors == vectors, [&] {
      return "GPU streaming: the device's index mirror holds " + std::to_string(M.vectors) +
             " vectors, the span index " + std::to_string(vectors);
    });
  }
  if (spans > M.spans) {
    int64_t cap = M.span_capacity;
    grow(M.span_first, cap, spans, M.spans, 1, s);
    cap = M.span_capacity;
    grow(M.span_count, cap, spans, M.spans, 1, s);
    M.span_capacity = cap;
    const std::span<const int64_t> first = index.span_first(), count = index.span_count();
    for (int64_t i = M.spans; i < spans; ++i) {
      const auto c = static_cast<int32_t>(count[static_cast<size_t>(i)]);
      M.first_host.push_back(static_cast<int32_t>(first[static_cast<size_t>(i)]));
      M.count_host.push_back(c);
      // The fused scoring's tiles: whole spans, at most kFusedVectors vectors and spans (or one longer span).
      if (M.tile_begin_host.empty() || M.tile_vectors + c > kFusedVectors || M.tile_spans == kFusedVectors) {
        M.tile_begin_host.push_back(static_cast<int32_t>(i));
        M.tile_vectors = c;
        M.tile_spans = 1;
      } else {
        M.tile_vectors += c;
        ++M.tile_spans;
      }
    }
    // Through the pinned arena (put()): the host vectors may change afterwards.
    put(M.span_first.data() + M.spans, M.first_host.data() + M.spans, static_cast<size_t>(spans - M.spans) * sizeof(int32_t), s);
    put(M.span_count.data() + M.spans, M.count_host.data() + M.spans, static_cast<size_t>(spans - M.spans) * sizeof(int32_t), s);
    M.spans = spans;
    const auto tiles = static_cast<int64_t>(M.tile_begin_host.size());
    if (tiles > M.tiles_uploaded) {  // a tile's first span never changes: only the new tiles go up
      grow(M.tile_begin, M.tile_capacity, tiles, M.tiles_uploaded, 1, s);
      put(M.tile_begin.data() + M.tiles_uploaded, M.tile_begin_host.data() + M.tiles_uploaded,
          static_cast<size_t>(tiles - M.tiles_uploaded) * sizeof(int32_t), s);
      M.tiles_uploaded = tiles;
    }
  }
  // block_begin: [blocks + 1] span ids, extended from the last block it covered (which may have gained spans); a
  // block's spans are consecutive and every span is in a block, so the last entry is the spans' count.
  if (blocks != M.blocks || (blocks > 0 && M.block_begin_host[static_cast<size_t>(blocks)] != spans)) {
    const int32_t from = std::max(0, M.blocks - 1);
    M.block_begin_host.resize(static_cast<size_t>(blocks) + 1);
    M.block_begin_host[0] = 0;
    for (int32_t b = from; b < blocks; ++b) {
      const std::span<const int64_t> bs = index.block_spans(b);
      check(bs.empty() || bs.front() == M.block_begin_host[static_cast<size_t>(b)],
            "GPU streaming: a block's spans are not consecutive in the span index");
      M.block_begin_host[static_cast<size_t>(b) + 1] =
          M.block_begin_host[static_cast<size_t>(b)] + static_cast<int32_t>(bs.size());
    }
    check(M.block_begin_host[static_cast<size_t>(blocks)] == spans, [&] {
      return "GPU streaming: the span index's blocks hold " +
             std::to_string(M.block_begin_host[static_cast<size_t>(blocks)]) + " spans, the index " +
             std::to_string(spans) + " (a block gained spans after a later one)";
    });
    int64_t cap = M.block_capacity;
    grow(M.block_begin, cap, static_cast<int64_t>(blocks) + 1, M.blocks > 0 ? from + 1 : 0, 1, s);
    M.block_capacity = cap;
    put(M.block_begin.data() + from, M.block_begin_host.data() + from, static_cast<size_t>(blocks + 1 - from) * sizeof(int32_t), s);
    M.blocks = blocks;
  }
}

// dots_[slot] (row-major [m, vt], rows of stride dots_ld(vt)) = Q_h K_g^T over the mirror's vectors [v0, v0 + vt),
// for each voting head in slot order (voters_dev_: ltri_scores()), by dots_kernel.
void StreamDecider::tile_dots(Mirror& M, int64_t m, int32_t H, int64_t v0, int64_t vt, cudaStream_t s) {
  const int64_t ld = dots_ld(vt);
  fit(dots_, static_cast<size_t>(static_cast<int64_t>(H) * m * ld));
  const dim3 grid(static_cast<unsigned>((vt + kMapTile - 1) / kMapTile), static_cast<unsigned>((m + kMapTile - 1) / kMapTile),
                  static_cast<unsigned>(H));
  const auto* qs = reinterpret_cast<const nbf*>(qsel16_.data());
  const auto* keys = reinterpret_cast<const nbf*>(M.keys.data());
  with_head_dim(d_, [&]<int D>() {
    dots_kernel<D><<<grid, 32 * kMapWarps, 2 * map_tile_bytes<D>(), s>>>(qs, qrow_, m, keys, M.row, v0, vt, ld,
                                                                         voters_dev_, dots_.data());
  });
  check_launch("stream ltri scores: dots");
}

void StreamDecider::gemm_scores(Mirror& M, int64_t m, int32_t T, int32_t H, cudaStream_t s) {
  const int64_t S = M.spans;
  const auto sim = [&](const float* rows, int64_t s0, int64_t s1, int64_t v0, int64_t ld, auto maxima) {
    constexpr bool kMaxima = decltype(maxima)::value;
    if (serial_sim_ || H == 1) {  // (one voter: sim_kernel's CTAs of 256 threads, 35.7 us against 44.7 at 256K)
      sim_kernel<kMaxima><<<blocks_for(static_cast<int64_t>(T) * (s1 - s0), kThreads), kThreads, 0, s>>>(
          rows, offsets_dev_, T, M.span_first.data(), M.span_count.data(), static_cast<int32_t>(s0),
          static_cast<int32_t>(s1), v0, ld, m, weights_dev_, H, sim_.data(), S);
    } else {
      const int ys = std::min<int32_t>(H, 1024 / kSimSpans);  // heads per round: one per thread row
      const dim3 grid(static_cast<unsigned>((s1 - s0 + kSimSpans - 1) / kSimSpans), static_cast<unsigned>(std::min(T, 65535)));
      sim_heads_kernel<kMaxima><<<grid, dim3(kSimSpans, static_cast<unsigned>(ys)),
                                  static_cast<size_t>(ys) * kSimSpans * sizeof(double), s>>>(
          rows, offsets_dev_, T, M.span_first.data(), M.span_count.data(), static_cast<int32_t>(s0),
          static_cast<int32_t>(s1), v0, ld, m, weights_dev_, H, sim_.data(), S);
    }
    check_launch("stream ltri scores: sim");
  };
  if (serial_sim_) {
    // The twin: every dot product into dots_, in tiles of whole spans of at most dots_budget_ products each (~256 MB;
    // one longer span may be a tile), sim_kernel's max over each span's columns.
    const int64_t tile_vectors = std::max<int64_t>(min_tile_vectors_, dots_budget_ / (static_cast<int64_t>(H) * m));
    const auto first = [&](int64_t span) { return static_cast<int64_t>(M.first_host[static_cast<size_t>(span)]); };
    const auto end = [&](int64_t span) { return first(span) + M.count_host[static_cast<size_t>(span)]; };
    for (int64_t s0 = 0; s0 < S;) {
      const int64_t v0 = first(s0);
      int64_t s1 = s0 + 1;
      while (s1 < S && end(s1) - v0 <= tile_vectors) ++s1;
      const int64_t vt = end(s1 - 1) - v0;
      tile_dots(M, m, H, v0, vt, s);
      sim(dots_.data(), s0, s1, v0, dots_ld(vt), std::false_type{});
      s0 = s1;
    }
    return;
  }
  // The span maxima (spanmax_kernel) over runs of the fused tiles, at most dots_budget_ maxima a run (at least one
  // tile), then sim over them.
  const auto tiles = static_cast<int64_t>(M.tile_begin_host.size());
  const auto tile_first = [&](int64_t x) { return x < tiles ? static_cast<int64_t>(M.tile_begin_host[static_cast<size_t>(x)]) : S; };
  const int64_t per_span = static_cast<int64_t>(H) * m;
  const auto* qs = reinterpret_cast<const nbf*>(qsel16_.data());
  const auto* keys = reinterpret_cast<const nbf*>(M.keys.data());
  for (int64_t x0 = 0; x0 < tiles;) {
    const int64_t s0 = tile_first(x0);
    int64_t x1 = x0 + 1;
    while (x1 < tiles && (tile_first(x1 + 1) - s0) * per_span <= dots_budget_) ++x1;
    const int64_t s1 = tile_first(x1), ld = s1 - s0;
    fit(dots_, static_cast<size_t>(per_span * ld));
    const dim3 grid(static_cast<unsigned>(x1 - x0), static_cast<unsigned>((m + kMapTile - 1) / kMapTile), static_cast<unsigned>(H));
    with_head_dim(d_, [&]<int D>() {
      spanmax_kernel<D><<<grid, 32 * kMapWarps, spanmax_smem<D>(), s>>>(
          qs, qrow_, m, keys, M.row, voters_dev_, M.span_first.data(), M.span_count.data(), M.tile_begin.data(),
          static_cast<int32_t>(x0), static_cast<int32_t>(tiles), S, s0, ld, dots_.data());
    });
    check_launch("stream ltri scores: span maxima");
    sim(dots_.data(), s0, s1, 0, ld, std::true_type{});
    x0 = x1;
  }
}

void StreamDecider::fused_scores(Mirror& M, int64_t m, int32_t T, int32_t H, cudaStream_t s) {
  const auto* qs = reinterpret_cast<const nbf*>(qsel16_.data());
  const auto tiles = static_cast<int32_t>(M.tile_begin_host.size());
  fused_ltri_kernel<<<tiles, kFusedThreads, fused_smem_bytes(d_), s>>>(
      qs, qrow_, static_cast<int32_t>(m), reinterpret_cast<const nbf*>(M.keys.data()), M.row, d_, voters_dev_,
      weights_dev_, H, offsets_dev_, T, M.span_first.data(), M.span_count.data(), M.tile_begin.data(), tiles,
      static_cast<int32_t>(M.spans), sim_.data());
  check_launch("stream ltri scores: fused");
}

std::vector<double> StreamDecider::ltri_scores(int32_t layer, const stream::SpanIndex& index, const bf16* q,
                                               std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                               const stream::HeadWeights& w, cudaStream_t s) {
  const auto t_issue = std::chrono::steady_clock::now();
  const Section section = index.kv_heads_kept() > 1 ? kScoresWide : kScores;
  begin(section, s);
  mirror(layer, index, s);
  Mirror& M = mirrors_[static_cast<size_t>(layer)];
  const int32_t blocks = index.num_blocks();
  const auto T = static_cast<int32_t>(counts.size());
  const auto m = static_cast<int64_t>(tokens.size());
  const int64_t S = M.spans, V = M.vectors;
  if (blocks == 0) {
    end(section, s);
    return {};
  }
  // Voting heads (weights in head order).
  std::vector<int32_t> heads;
  std::vector<double> weights;
  const int group = nq_ / nkv_;
  for (int32_t hh = 0; hh < nq_; ++hh)
    if (w[static_cast<size_t>(hh)] != 0) {
      const int32_t g = hh / group - M.head_begin;  // within the kept kv heads
      check(g >= 0 && static_cast<int64_t>(g) * d_ < M.row, [&] {
        return "GPU streaming: query head " + std::to_string(hh) +
               " votes, but its kv head is not in the index";
      });
      heads.push_back(hh);
      weights.push_back(w[static_cast<size_t>(hh)]);
    }
  const auto H = static_cast<int32_t>(heads.size());
  // The call's arguments in one copy: [tokens (m) | span offsets (T + 1) | per voter its query head's offset in a q
  // row and its kv head's in a mirror row (2H) | the voters' weights (H doubles, 8-byte aligned)], int32 units,
  // staged in pinned memory (read by the copy in flight until download_scores() synchronises).
  const int64_t at_offsets = m, at_voters = m + T + 1, at_weights = (at_voters + 2 * H + 1) / 2 * 2;
  const int64_t words = at_weights + 2 * static_cast<int64_t>(H);
  staging_.grow(static_cast<size_t>(words));
  int32_t* const args = staging_.data();
  std::copy(tokens.begin(), tokens.end(), args);
  int32_t* const offsets = args + at_offsets;
  offsets[0] = 0;
  for (int32_t t = 0; t < T; ++t) offsets[t + 1] = offsets[t] + counts[static_cast<size_t>(t)];
  check(offsets[T] == m, "GPU streaming: the query spans' counts do not add up to their vectors");
  for (int32_t slot = 0; slot < H; ++slot) {
    const int32_t hh = heads[static_cast<size_t>(slot)];
    args[at_voters + 2 * slot] = hh * d_;
    args[at_voters + 2 * slot + 1] = (hh / group - M.head_begin) * d_;
  }
  std::memcpy(args + at_weights, weights.data(), weights.size() * sizeof(double));
  fit(score_args_, static_cast<size_t>(words));
  h2d(score_args_.data(), args, static_cast<size_t>(words), s);
  tokens_dev_ = score_args_.data();
  offsets_dev_ = score_args_.data() + at_offsets;
  voters_dev_ = score_args_.data() + at_voters;
  weights_dev_ = reinterpret_cast<const double*>(score_args_.data() + at_weights);
  fit(sim_, static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(T) * S, 1)));
  if (m > 0 && V > 0 && H > 0 && S > 0) {
    // The query vectors as they are (bf16), padded with zero rows to the fused kernel's passes.
    const int64_t m_pad = fused_ ? (m + kFusedRows - 1) / kFusedRows * kFusedRows : m;
    fit(qsel16_, static_cast<size_t>(m_pad * qrow_));
    gather_bf16_kernel<<<blocks_for(m_pad * qrow_, kThreads), kThreads, 0, s>>>(
        reinterpret_cast<const nbf*>(q), tokens_dev_, reinterpret_cast<nbf*>(qsel16_.data()), m, m_pad, qrow_);
    check_launch("stream ltri scores: gather");
    if (fused_)
      fused_scores(M, m, T, H, s);
    else
      gemm_scores(M, m, T, H, s);
  } else if (static_cast<int64_t>(T) * S > 0) {
    TESSERA_CUDA_CHECK(cudaMemsetAsync(sim_.data(), 0, static_cast<size_t>(T) * static_cast<size_t>(S) * sizeof(double), s));
  }
  fit(block_scores_, static_cast<size_t>(blocks));
  if (serial_sim_) {  // the twin: a warp per block, the query spans in turn
    block_kernel<<<(blocks + kBlockWarps - 1) / kBlockWarps, 32 * kBlockWarps, 0, s>>>(sim_.data(), M.block_begin.data(),
                                                                                      blocks, T, S, block_scores_.data());
  } else {
    if (T > 0) {
      fit(best_, static_cast<size_t>(T) * static_cast<size_t>(blocks));
      const dim3 grid(static_cast<unsigned>((blocks + kBestBlocks - 1) / kBestBlocks),
                      static_cast<unsigned>((T + kBestRows - 1) / kBestRows));
      best_kernel<<<grid, dim3(kBestBlocks, kBestRows), 0, s>>>(sim_.data(), M.block_begin.data(), blocks, T, S,
                                                                best_.data());
    }
    block_sum_kernel<<<(blocks + kSumWarps - 1) / kSumWarps, 32 * kSumWarps, 0, s>>>(best_.data(), M.block_begin.data(),
                                                                                  blocks, T, block_scores_.data());
  }
  check_launch("stream ltri scores: blocks");
  end(section, s);
  issued(t_issue);
  return download_scores(blocks, s);
}

}  // namespace tessera::runtime::gpu
