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

// RoPE over tiles of `tile_rows` rows of one job: the tile's cos / sin first (in double, rounded to float, as the
// CPU's tables: one per (row, pair), not one per head), then a thread per (row, head, 8 pairs) through 16-byte loads
// (`vec`) or per (row, head, pair). src == dst is allowed: a thread reads only the values it writes. The tile is
// ~kRopeItems work items (stream_rope_copy), so a chunk's queries (32 heads a row) spread over as many CTAs as its
// keys (8): a query row's 256 items in one tile of 16 rows left 128 CTAs of 16 items a thread (15.2 us for 2 x 1,024
// rows on the H200, against 10.7 for 5,120 key rows in 320 CTAs).
constexpr int kRopeThreads = 256;
constexpr int kRopeItems = 512;
constexpr int kRopeMaxRows = 16;

// rotate_half without contraction into FMAs: each product and the difference rounded on their own, whatever the
// compiler does with the surrounding code (the 16-byte and one-value paths equal bit for bit).
__device__ __forceinline__ void rotate_pair(float a, float b, float2 cs, float& ra, float& rb) {
  ra = __fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y));
  rb = __fadd_rn(__fmul_rn(b, cs.x), __fmul_rn(a, cs.y));
}

__global__ void rope_copy_kernel(StreamRopeJobs jobs, int64_t ld, int heads, int d, const float* inv_freq, bool vec,
                                 int tile_rows) {
  extern __shared__ float2 cs[];  // [tile_rows][d / 2]: (cos, sin)
  int64_t tile = blockIdx.x;
  int j = 0;
  for (; j + 1 < jobs.count; ++j) {
    const int64_t tiles = (jobs.job[j].rows + tile_rows - 1) / tile_rows;
    if (tile < tiles) break;
    tile -= tiles;
  }
  const StreamRopeJobs::Job job = jobs.job[j];
  const int half = d / 2;
  const int64_t r0 = tile * tile_rows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(tile_rows), job.rows - r0));
  for (int t = threadIdx.x; t < rows * half; t += blockDim.x) {
    const int r = t / half, i = t - r * half;
    const float angle = static_cast<float>(job.pos0 + job.step * (r0 + r)) * inv_freq[i];
    cs[t] = make_float2(static_cast<float>(cos(static_cast<double>(angle))),
                        static_cast<float>(sin(static_cast<double>(angle))));
  }
  __syncthreads();
  const nbf* src = reinterpret_cast<const nbf*>(job.src) + r0 * ld;
  nbf* dst = reinterpret_cast<nbf*>(job.dst) + r0 * ld;
  if (vec) {
    const int groups = half / 8, per_row = heads * groups;
    for (int t = threadIdx.x; t < rows * per_row; t += blockDim.x) {
      const int r = t / per_row, rem = t - r * per_row, h = rem / groups, i0 = (rem - h * groups) * 8;
      const int64_t at = r * ld + static_cast<int64_t>(h) * d + i0;
      const uint4 va = *reinterpret_cast<const uint4*>(src + at), vb = *reinterpret_cast<const uint4*>(src + at + half);
      const nbf* pa = reinterpret_cast<const nbf*>(&va);
      const nbf* pb = reinterpret_cast<const nbf*>(&vb);
      uint4 oa, ob;
      nbf* qa = reinterpret_cast<nbf*>(&oa);
      nbf* qb = reinterpret_cast<nbf*>(&ob);
      const float2* c = cs + r * half + i0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float ra, rb;
        rotate_pair(__bfloat162float(pa[k]), __bfloat162float(pb[k]), c[k], ra, rb);
        qa[k] = __float2bfloat16_rn(ra);
        qb[k] = __float2bfloat16_rn(rb);
      }
      *reinterpret_cast<uint4*>(dst + at) = oa;
      *reinterpret_cast<uint4*>(dst + at + half) = ob;
    }
  } else {
    const int per_row = heads * half;
    for (int t = threadIdx.x; t < rows * per_row; t += blockDim.x) {
      const int r = t / per_row, rem = t - r * per_row, h = rem / half, i = rem - h * half;
      const int64_t at = r * ld + static_cast<int64_t>(h) * d + i;
      float ra, rb;
      rotate_pair(__bfloat162float(src[at]), __bfloat162float(src[at + half]), cs[r * half + i], ra, rb);
      dst[at] = __float2bfloat16_rn(ra);
      dst[at + half] = __float2bfloat16_rn(rb);
    }
  }
}

// A thread per 8 values of one (row, head) (d % 8 == 0, 16-byte aligned; `vec`) or per value: the two weights once.
__device__ __forceinline__ void merge_weights(float ll, float lg, float& wl, float& wg) {
  const float m = fmaxf(ll, lg);
  wl = 0;
  wg = 0;
  if (m != -INFINITY) {
    wl = __expf(ll - m);
    wg = __expf(lg - m);
    const float z = wl + wg;
    wl /= z;
    wg /= z;
  }
}

__global__ void merge_lse_kernel(nbf* out_l, const nbf* out_g, const float* lse_l, const float* lse_g, int64_t n,
                                 int heads, int d, bool vec) {
  const int per = vec ? 8 : 1;
  const int64_t units_per_head = d / per;
  const int64_t total = n * heads * units_per_head;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rh = idx / units_per_head;
    const int64_t r = rh / heads;
    const int h = static_cast<int>(rh % heads);
    float wl, wg;
    merge_weights(lse_l[h * n + r], lse_g[h * n + r], wl, wg);
    if (vec) {
      uint4* pl = reinterpret_cast<uint4*>(out_l) + idx;
      const uint4 vg = reinterpret_cast<const uint4*>(out_g)[idx];
      uint4 vl = *pl;
      nbf* l = reinterpret_cast<nbf*>(&vl);
      const nbf* g = reinterpret_cast<const nbf*>(&vg);
#pragma unroll
      for (int k = 0; k < 8; ++k) l[k] = __float2bfloat16_rn(wl * __bfloat162float(l[k]) + wg * __bfloat162float(g[k]));
      *pl = vl;
    } else {
      out_l[idx] = __float2bfloat16_rn(wl * __bfloat162float(out_l[idx]) + wg * __bfloat162float(out_g[idx]));
    }
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

// Block blockIdx.y of c, K (blockIdx.z 0) or V (1): codes and scales of the block layout above into bf16 rows, a
// thread per 8 codes of one (token, head) vector (d % 8 == 0): one 8-byte load, one scale, one 16-byte store.
__global__ void dequantize_blocks_kernel(nbf* dst_k, nbf* dst_v, int64_t block_rows, int heads, int d,
                                         StreamFp8Blocks c) {
  const int i = static_cast<int>(blockIdx.y);
  const int kv = static_cast<int>(blockIdx.z);
  const int64_t row = static_cast<int64_t>(heads) * d;
  const uint2* codes = reinterpret_cast<const uint2*>(c.src[i] + kv * block_rows * row);
  const float* scales = reinterpret_cast<const float*>(c.src[i] + 2 * block_rows * row) + kv * block_rows * heads;
  uint4* dst = reinterpret_cast<uint4*>((kv == 0 ? dst_k : dst_v) + static_cast<int64_t>(c.dst_row[i]) * row);
  const int groups = d / 8;
  const int64_t total = block_rows * row / 8;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint2 q8 = codes[idx];
    const float scale = scales[idx / groups];
    const uint8_t* q = reinterpret_cast<const uint8_t*>(&q8);
    uint4 out;
    nbf* o = reinterpret_cast<nbf*>(&out);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      __nv_fp8_e4m3 e;
      e.__x = q[k];
      o[k] = __float2bfloat16_rn(static_cast<float>(e) * scale);
    }
    dst[idx] = out;
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

void stream_quantize_blocks(const StreamFp8Evictions& e, int64_t rows, int heads, int d, cudaStream_t stream) {
  if (e.count <= 0 || rows <= 0) return;
  check(e.count <= StreamFp8Evictions::kMax, "stream_quantize_blocks: more than " +
                                                 std::to_string(StreamFp8Evictions::kMax) + " blocks in one launch");
  static_assert(2 * StreamFp8Evictions::kMax <= Fp8RowJobs::kMax);
  const int64_t row = static_cast<int64_t>(heads) * d;
  Fp8RowJobs jobs;
  for (int i = 0; i < e.count; ++i) {
    check(aligned16(e.dst[i]), "stream_quantize_blocks: a block must be 16-byte aligned");
    float* scales = reinterpret_cast<float*>(e.dst[i] + 2 * rows * row);
    jobs.x[2 * i] = e.k[i];
    jobs.q[2 * i] = e.dst[i];
    jobs.scales[2 * i] = scales;
    jobs.x[2 * i + 1] = e.v[i];
    jobs.q[2 * i + 1] = e.dst[i] + rows * row;
    jobs.scales[2 * i + 1] = scales + rows * heads;
  }
  jobs.count = 2 * e.count;
  quantize_e4m3_rows_batch(jobs, d, rows * heads, d, stream);
}

void stream_dequantize_blocks(bf16* dst_k, bf16* dst_v, int64_t block_rows, int heads, int d, const StreamFp8Blocks& c,
                              cudaStream_t stream) {
  if (c.count <= 0 || block_rows <= 0) return;
  check(c.count <= StreamFp8Blocks::kMax, "stream_dequantize_blocks: more than " +
                                              std::to_string(StreamFp8Blocks::kMax) + " blocks in one launch");
  check(d % 8 == 0, "stream_dequantize_blocks: needs a head_dim that is a multiple of 8");
  const int threads = 256;
  const int64_t total = block_rows * heads * d / 8;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((total + threads - 1) / threads, 64)),
                  static_cast<unsigned>(c.count), 2);
  dequantize_blocks_kernel<<<grid, threads, 0, stream>>>(reinterpret_cast<nbf*>(dst_k), reinterpret_cast<nbf*>(dst_v),
                                                         block_rows, heads, d, c);
  check_launch("stream_dequantize_blocks");
}

void StreamRopeJobs::add(bf16* dst, const bf16* src, int64_t rows, int64_t pos0, int64_t step) {
  if (rows <= 0) return;
  check(count < kMax, "stream_rope_copy: more than " + std::to_string(kMax) + " rotations in one launch");
  job[count++] = Job{dst, src, rows, pos0, step};
}

void stream_rope_copy(const StreamRopeJobs& jobs, int64_t ld, int heads, int d, const float* inv_freq,
                      cudaStream_t stream) {
  check(d % 2 == 0 && heads > 0, "stream_rope_rows: needs an even head_dim and heads");
  bool vec = (d / 2) % 8 == 0 && ld % 8 == 0;
  for (int j = 0; j < jobs.count; ++j) vec = vec && aligned16(jobs.job[j].dst) && aligned16(jobs.job[j].src);
  const int64_t per_row = static_cast<int64_t>(heads) * (vec ? d / 16 : d / 2);
  const int tile_rows = static_cast<int>(std::clamp<int64_t>(kRopeItems / std::max<int64_t>(per_row, 1), 1, kRopeMaxRows));
  int64_t tiles = 0;
  for (int j = 0; j < jobs.count; ++j) tiles += (jobs.job[j].rows + tile_rows - 1) / tile_rows;
  if (tiles == 0) return;
  check(tiles <= 0x7fffffff, "stream_rope_copy: too many rows");
  const size_t smem = static_cast<size_t>(tile_rows) * (d / 2) * sizeof(float2);
  rope_copy_kernel<<<static_cast<unsigned>(tiles), kRopeThreads, smem, stream>>>(jobs, ld, heads, d, inv_freq, vec,
                                                                                 tile_rows);
  check_launch("stream_rope_rows");
}

void stream_rope_rows(bf16* x, int64_t rows, int64_t ld, int heads, int d, const float* inv_freq, int64_t pos0,
                      int64_t step, cudaStream_t stream) {
  if (rows <= 0) return;
  StreamRopeJobs jobs;
  jobs.add(x, x, rows, pos0, step);
  stream_rope_copy(jobs, ld, heads, d, inv_freq, stream);
}

void stream_merge_lse(bf16* out_l, const bf16* out_g, const float* lse_l, const float* lse_g, int64_t n, int heads,
                      int d, cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = d % 8 == 0 && aligned16(out_l) && aligned16(out_g);
  const int64_t units = n * heads * (vec ? d / 8 : d);
  merge_lse_kernel<<<blocks_for(units, 256), 256, 0, stream>>>(
      reinterpret_cast<nbf*>(out_l), reinterpret_cast<const nbf*>(out_g), lse_l, lse_g, n, heads, d, vec);
  check_launch("stream_merge_lse");
}

}  // namespace tessera::runtime::gpu
