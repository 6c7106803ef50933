#include "runtime/cuda/paged_decode.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

namespace {

using nbf = __nv_bfloat16;
using attn::gpu::check_launch;

constexpr int kThreads = 128;

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

// fn(k, g, c) for each piece of a group's [G, D] output that thread `tid` owns: acc[k] holds columns c .. c + 3 of
// group member g (kOut pieces per thread at most, unrolled).
template <int kOut, int D, class F>
__device__ __forceinline__ void for_owned_outputs(int tid, int G, F&& fn) {
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    const int o = (tid + k * kThreads) * 4;
    if (o < G * D) fn(k, o / D, o % D);
  }
}

// grid (splits, kv_heads, rows); T keys per tile; GM >= the query heads per group (G, at run time); D head dim.
template <int D, int GM, int T>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedDecodeArgs a) {
  const int G = a.q_heads / a.kv_heads;
  constexpr int kPad = 8;  // bf16 per row of padding: 16-byte reads of consecutive rows hit distinct banks
  constexpr int kLd = D + kPad;
  __shared__ __align__(16) nbf ks[T * kLd];
  __shared__ __align__(16) nbf vs[T * kLd];
  __shared__ float qs[GM * D];
  __shared__ float ps[GM * T];
  __shared__ float m_s[GM], l_s[GM], corr_s[GM];
  __shared__ int64_t rng[GM][4];

  const int split = blockIdx.x, kvh = blockIdx.y, row = blockIdx.z;
  const int slot = a.row_slot[row];
  const int64_t len = a.row_len[row];
  const int tid = threadIdx.x;

  // This group's heads: ranges, and the union [lo, A1) u [B0, len) as a compacted key index.
  int64_t lo = len, A1 = 0, B0 = len;
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    const Ranges r = view_ranges(a.views + (static_cast<int64_t>(slot) * a.num_layers * a.q_heads +
                                            static_cast<int64_t>(a.layer) * a.q_heads + h) * 3,
                                 len);
    if (tid == 0) {
      rng[g][0] = r.a0, rng[g][1] = r.a1, rng[g][2] = r.b0, rng[g][3] = r.b1;
    }
    lo = min64(lo, r.a0);  // the same for every head of a layer (the layer's horizon) in a model
    A1 = max64(A1, r.a1);
    B0 = min64(B0, r.b0);
  }
  A1 = max64(A1, lo);
  const int64_t second = max64(B0, A1);
  const int64_t n_first = A1 - lo, n_keys = n_first + (len - second);
  const int64_t per = ((n_keys + a.splits - 1) / a.splits + T - 1) / T * T;
  const int64_t i_begin = min64(n_keys, static_cast<int64_t>(split) * per), i_end = min64(n_keys, i_begin + per);

  const nbf* qrow = reinterpret_cast<const nbf*>(a.q) + static_cast<int64_t>(row) * a.q_stride +
                    static_cast<int64_t>(kvh) * G * D;
  for (int i = tid; i < G * D; i += kThreads) qs[i] = __bfloat162float(qrow[i]);
  if (tid < G) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  // No tables: one sequence's contiguous cache, key `pos` of this head at row pos * kv_heads + kvh.
  const int32_t* table = a.tables == nullptr ? nullptr
                                             : a.tables + (static_cast<int64_t>(slot) * a.num_layers * a.kv_heads +
                                                           static_cast<int64_t>(a.layer) * a.kv_heads + kvh) *
                                                              a.max_blocks;
  const int shift = __ffs(a.block_tokens) - 1, mask = a.block_tokens - 1;
  const nbf* kpool = reinterpret_cast<const nbf*>(a.k_pool);
  const nbf* vpool = reinterpret_cast<const nbf*>(a.v_pool);

  // P.V: each thread owns groups of 4 consecutive output dims of one head (8-byte reads of V rows).
  constexpr int kOut = (GM * D / 4 + kThreads - 1) / kThreads;
  float acc[kOut][4];
#pragma unroll
  for (int k = 0; k < kOut; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.0f;
  __syncthreads();

  for (int64_t t0 = i_begin; t0 < i_end; t0 += T) {
    // K and V tiles: 16-byte chunks, each key looked up in the block table; every load of the tile is issued
    // before the first store to shared memory (memory-level parallelism).
    constexpr int kChunks = D / 8;
    constexpr int kPer = T * kChunks / kThreads;
    static_assert(T * kChunks % kThreads == 0, "tile chunks must divide among the threads");
    uint4 kv[kPer], vv[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = tid + j * kThreads;
      const int t = c / kChunks, part = c % kChunks;
      const int64_t i = t0 + t;
      kv[j] = make_uint4(0, 0, 0, 0);
      vv[j] = make_uint4(0, 0, 0, 0);
      if (i < i_end) {
        // 32-bit position arithmetic and a power-of-two block (a 64-bit division per chunk cost more than the load).
        const int pos = static_cast<int>(i < n_first ? lo + i : second + (i - n_first));
        const int blk = table != nullptr ? __ldg(table + (pos >> shift)) : pos * a.kv_heads + kvh;
        const int64_t off = (static_cast<int64_t>(blk) * a.block_tokens + (pos & mask)) * D + part * 8;
        kv[j] = __ldg(reinterpret_cast<const uint4*>(kpool + off));
        vv[j] = __ldg(reinterpret_cast<const uint4*>(vpool + off));
      }
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = tid + j * kThreads;
      const int t = c / kChunks, part = c % kChunks;
      *reinterpret_cast<uint4*>(ks + t * kLd + part * 8) = kv[j];
      *reinterpret_cast<uint4*>(vs + t * kLd + part * 8) = vv[j];
    }
    __syncthreads();
    // Scores, masked per head.
    for (int idx = tid; idx < G * T; idx += kThreads) {
      const int g = idx / T, t = idx % T;
      const int64_t i = t0 + t;
      float s = -INFINITY;
      if (i < i_end) {
        const int64_t pos = i < n_first ? lo + i : second + (i - n_first);
        if ((pos >= rng[g][0] && pos < rng[g][1]) || (pos >= rng[g][2] && pos < rng[g][3])) {
          float dot = 0.0f;
          const nbf* kr = ks + t * kLd;
          const float* qg = qs + g * D;
#pragma unroll 4
          for (int c = 0; c < D; c += 8) {
            const uint4 raw = *reinterpret_cast<const uint4*>(kr + c);
            const nbf* e = reinterpret_cast<const nbf*>(&raw);
#pragma unroll
            for (int j = 0; j < 8; ++j) dot += qg[c + j] * __bfloat162float(e[j]);
          }
          s = dot * a.scale;
        }
      }
      ps[idx] = s;
    }
    __syncthreads();
    // Online softmax, one warp per head.
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += kThreads / 32) {
      float mx = -INFINITY;
      for (int t = lane; t < T; t += 32) mx = fmaxf(mx, ps[g * T + t]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int t = lane; t < T; t += 32) {
        const float s = ps[g * T + t];
        const float p = m_new == -INFINITY ? 0.0f : __expf(s - m_new);
        ps[g * T + t] = p;
        sum += p;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        corr_s[g] = corr;
        l_s[g] = l_s[g] * corr + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // P.V
    for_owned_outputs<kOut, D>(tid, G, [&](int k, int g, int c) {
      const float corr = corr_s[g];
      float v0 = acc[k][0] * corr, v1 = acc[k][1] * corr, v2 = acc[k][2] * corr, v3 = acc[k][3] * corr;
      const float* pg = ps + g * T;
#pragma unroll 8
      for (int t = 0; t < T; ++t) {
        const uint2 raw = *reinterpret_cast<const uint2*>(vs + t * kLd + c);
        const __nv_bfloat162 lo2 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
        const __nv_bfloat162 hi2 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
        const float p = pg[t];
        const float2 fa = __bfloat1622float2(lo2), fb = __bfloat1622float2(hi2);
        v0 += p * fa.x;
        v1 += p * fa.y;
        v2 += p * fb.x;
        v3 += p * fb.y;
      }
      acc[k][0] = v0, acc[k][1] = v1, acc[k][2] = v2, acc[k][3] = v3;
    });
    __syncthreads();
  }
  // Partial output and log-sum-exp of this split.
  for_owned_outputs<kOut, D>(tid, G, [&](int k, int g, int c) {
    const int h = kvh * G + g;
    const float l = l_s[g];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t base = (static_cast<int64_t>(row) * a.q_heads + h) * a.splits + split;
    *reinterpret_cast<float4*>(a.o_part + base * D + c) =
        make_float4(acc[k][0] * inv, acc[k][1] * inv, acc[k][2] * inv, acc[k][3] * inv);
    if (c == 0) a.lse_part[base] = l > 0.0f ? m_s[g] + __logf(l) : -INFINITY;
  });
}

// grid rows * q_heads, D threads.
__global__ void paged_decode_merge_kernel(PagedDecodeArgs a) {
  const int64_t rh = blockIdx.x;
  const int c = threadIdx.x;
  const int D = a.head_dim;
  const float* lse = a.lse_part + rh * a.splits;
  float mx = -INFINITY;
  for (int s = 0; s < a.splits; ++s) mx = fmaxf(mx, lse[s]);
  float num = 0.0f, den = 0.0f;
  if (mx != -INFINITY) {
    for (int s = 0; s < a.splits; ++s) {
      const float w = __expf(lse[s] - mx);
      num += w * a.o_part[(rh * a.splits + s) * D + c];
      den += w;
    }
  }
  const int64_t row = rh / a.q_heads, h = rh % a.q_heads;
  reinterpret_cast<nbf*>(a.out)[row * static_cast<int64_t>(a.q_heads) * D + h * D + c] =
      __float2bfloat16_rn(den > 0.0f ? num / den : 0.0f);
}

template <int D, int GM>
void launch(const PagedDecodeArgs& a, cudaStream_t stream) {
  constexpr int T = D == 256 ? 32 : 64;
  const dim3 grid(static_cast<unsigned>(a.splits), static_cast<unsigned>(a.kv_heads), static_cast<unsigned>(a.rows));
  paged_decode_kernel<D, GM, T><<<grid, kThreads, 0, stream>>>(a);
}

template <int D>
void launch_g(const PagedDecodeArgs& a, int group, cudaStream_t stream) {
  if (group <= 1) return launch<D, 1>(a, stream);
  if (group <= 2) return launch<D, 2>(a, stream);
  if (group <= 4) return launch<D, 4>(a, stream);
  if (group <= 8) return launch<D, 8>(a, stream);
  throw Error("paged decode attention: GQA groups of at most 8 query heads, got " + std::to_string(group));
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
  const int64_t ctas = static_cast<int64_t>(rows) * kv_heads;
  // About six CTAs per multiprocessor (five fit at once for head dim 128: latency hiding comes from occupancy),
  // at least 256 keys per split.
  const int64_t want = (6LL * sms + ctas - 1) / std::max<int64_t>(ctas, 1);
  const int64_t most = std::max<int64_t>(1, max_keys / 256);
  return static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 256)));
}

void paged_decode_attention(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return;
  check(a.kv_heads > 0 && a.q_heads % a.kv_heads == 0, "paged decode attention: query heads must be a multiple of kv heads");
  check(a.splits >= 1, "paged decode attention: splits must be >= 1");
  check(a.block_tokens > 0 && (a.block_tokens & (a.block_tokens - 1)) == 0,
        "paged decode attention: block_tokens must be a power of two, got " + std::to_string(a.block_tokens));
  check(a.q_stride % 8 == 0 && reinterpret_cast<uintptr_t>(a.q) % 16 == 0,
        "paged decode attention: q rows must be 16-byte aligned");
  const int group = a.q_heads / a.kv_heads;
  switch (a.head_dim) {
    case 64: launch_g<64>(a, group, stream); break;
    case 128: launch_g<128>(a, group, stream); break;
    case 256: launch_g<256>(a, group, stream); break;
    default: throw Error("paged decode attention: head dims 64, 128 and 256, got " + std::to_string(a.head_dim));
  }
  check_launch("paged_decode_attention");
  paged_decode_merge_kernel<<<static_cast<unsigned>(static_cast<int64_t>(a.rows) * a.q_heads),
                              static_cast<unsigned>(a.head_dim), 0, stream>>>(a);
  check_launch("paged_decode_merge");
}

void paged_append_kv(const bf16* k_new, const bf16* v_new, int64_t ld, int32_t rows, int32_t kv_heads, int32_t head_dim,
                     const int32_t* blocks, int32_t layer, int32_t num_layers, const int32_t* pos,
                     int32_t block_tokens, bf16* k_pool, bf16* v_pool, cudaStream_t stream) {
  if (rows <= 0) return;
  check(ld >= static_cast<int64_t>(kv_heads) * head_dim, "paged_append_kv: row stride below kv_heads * head_dim");
  append_kernel<<<static_cast<unsigned>(rows * kv_heads), 128, 0, stream>>>(
      reinterpret_cast<const nbf*>(k_new), reinterpret_cast<const nbf*>(v_new), ld, kv_heads, head_dim, blocks, layer,
      num_layers, pos, block_tokens, reinterpret_cast<nbf*>(k_pool), reinterpret_cast<nbf*>(v_pool));
  check_launch("paged_append_kv");
}

void paged_copy(const int32_t* entries, int32_t count, bf16* const* k_layers, bf16* const* v_layers,
                int64_t row_elements, int32_t head_dim, int32_t block_tokens, int32_t len, bf16* k_pool, bf16* v_pool,
                PageCopy direction, cudaStream_t stream) {
  if (count <= 0) return;
  // 16-byte moves need every row start aligned: the head dim and the row pitch multiples of 8 elements, the pools
  // 16-byte aligned (cudaMalloc's are, and a staged layer of a DeviceKVCache starts at a multiple of its row pitch).
  const bool wide = head_dim % 8 == 0 && row_elements % 8 == 0 && reinterpret_cast<uintptr_t>(k_pool) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_pool) % 16 == 0;
  const auto k_l = reinterpret_cast<nbf* const*>(k_layers);
  const auto v_l = reinterpret_cast<nbf* const*>(v_layers);
  const bool to = direction == PageCopy::kToPages;
  if (wide)
    pages_kernel<uint4><<<static_cast<unsigned>(count), 256, 0, stream>>>(
        entries, k_l, v_l, row_elements, head_dim, block_tokens, len, reinterpret_cast<nbf*>(k_pool),
        reinterpret_cast<nbf*>(v_pool), to);
  else
    pages_kernel<nbf><<<static_cast<unsigned>(count), 256, 0, stream>>>(
        entries, k_l, v_l, row_elements, head_dim, block_tokens, len, reinterpret_cast<nbf*>(k_pool),
        reinterpret_cast<nbf*>(v_pool), to);
  check_launch("paged_copy");
}

void rope_tables_at(const float* inv_freq, int half, const int32_t* pos, int64_t n, float* cos, float* sin,
                    cudaStream_t stream) {
  const int64_t total = n * half;
  if (total <= 0) return;
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>((total + 255) / 256, 1, 65536));
  rope_at_kernel<<<blocks, 256, 0, stream>>>(inv_freq, half, pos, total, cos, sin);
  check_launch("rope_tables_at");
}

}  // namespace tessera::runtime::gpu
