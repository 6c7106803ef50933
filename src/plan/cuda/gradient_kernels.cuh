// tessera/plan/cuda/gradient_kernels.cuh — the kernels of the GPU gradient pass (gradients_cuda.cu includes this,
// and nothing else does): what the backward needs and the engine's kernels (runtime/cuda/kernels.h, bf16 out, no
// saved statistics) do not give — RMSNorm keeping its 1/rms (sums in double, as the CPU pass) and its backward,
// RoPE both ways in f32, the gated activation and its derivative (plan/activation.h: the CPU pass's formulas), the
// bias and residual adds in f32, and the blockwise attention: the chunk softmax with its log-sum-exp, D = dO . O,
// the 64 x 64 backward tiles with the planners' block and region sums, and the group sums of dK and dV.
// Grid-stride kernels use kThreads threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "model/model_config.h"
#include "plan/activation.h"

namespace tessera::plan::cuda {
namespace {

using runtime::Activation;

constexpr int kThreads = 256;

template <int K>
__device__ void block_sum(double (&v)[K], double* shared /* [K * 32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k)
    for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], o);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) shared[k * 32 + warp] = v[k];
  __syncthreads();
  if (threadIdx.x == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      double s = 0;
      for (int w = 0; w < warps; ++w) s += shared[k * 32 + w];
      v[k] = s;
    }
}
// One block per row: y = w * x * r, r = 1 / sqrt(mean(x^2) + eps) (as the CPU computes it: sum in double).
__global__ void rms_forward_kernel(const float* x, float* y, float* r, int64_t n, const float* w, float eps) {
  __shared__ double sh[32];
  const float* in = x + blockIdx.x * n;
  double v[1] = {0};
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v[0] += double(in[j]) * double(in[j]);
  block_sum<1>(v, sh);
  __shared__ float inv_s;
  if (threadIdx.x == 0) {
    inv_s = 1.0f / sqrtf(float(v[0] / double(n)) + eps);
    if (r) r[blockIdx.x] = inv_s;
  }
  __syncthreads();
  const float inv = inv_s;
  if (y)
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) y[blockIdx.x * n + j] = w[j] * (in[j] * inv);
}

// dx (= or +=) the gradient of y = w * x * r(x), given dy; one block per row.
__global__ void rms_backward_kernel(const float* x, const float* r, int64_t n, const float* w, const float* dy,
                                    float* dx, bool accumulate) {
  __shared__ double sh[32];
  const float* in = x + blockIdx.x * n;
  const float* g = dy + blockIdx.x * n;
  float* out = dx + blockIdx.x * n;
  double v[1] = {0};
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v[0] += double(w[j] * g[j]) * double(in[j]);
  block_sum<1>(v, sh);
  __shared__ float c_s;
  const float ri = r[blockIdx.x];
  if (threadIdx.x == 0) c_s = float(v[0]) * ri * ri * ri / float(n);
  __syncthreads();
  const float c = c_s;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float val = w[j] * g[j] * ri - in[j] * c;
    out[j] = accumulate ? out[j] + val : val;
  }
}

__global__ void add_bias_kernel(float* y, const float* b, int64_t rows, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < rows * n; e += int64_t(gridDim.x) * blockDim.x)
    y[e] += b[e % n];
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    y[e] += x[e];
}

// RoPE in rotate_half order, in place; inverse: the transpose (rotation by -angle).
__global__ void rope_kernel(float* x, int64_t S, int64_t heads, int64_t stride, int64_t D, const float* cs,
                            const float* sn, bool inverse) {
  const int64_t half = D / 2;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < S * heads * half;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, h = (e / half) % heads, t = e / (half * heads);
    float* v = x + t * stride + h * D;
    const float c = cs[t * half + i], s = inverse ? -sn[t * half + i] : sn[t * half + i];
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

__global__ void act_forward_kernel(const float* g, const float* u, float* act, int64_t n, Activation kind) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    act[e] = activation(kind, g[e]) * u[e];
}

// In place: g becomes dg, u becomes du (dact is read first).
__global__ void act_backward_kernel(float* g, float* u, const float* dact, int64_t n, Activation kind) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const float gv = g[e], uv = u[e], d = dact[e];
    u[e] = d * activation(kind, gv);
    g[e] = d * uv * activation_grad(kind, gv);
  }
}

__device__ int64_t first_key(int64_t i, int64_t window) { return window > 0 ? max(int64_t(0), i - window + 1) : 0; }

struct Gate {
  int32_t head = -1, query = -1, key = -1;
  float value = 1.0f;
};

// Forward softmax of one chunk row per block: P [heads][rows][nk] holds the scaled scores of keys [k0, k0 + nk);
// becomes the probabilities (0 outside row i's keys); lse[h * S + i].
__global__ void softmax_kernel(float* P, float* lse, int64_t rows, int64_t nk, int64_t r0, int64_t k0, int64_t window,
                               int64_t S, Gate gate) {
  __shared__ double sh[32];
  __shared__ float red[32];
  const int64_t r = blockIdx.x, h = blockIdx.y, i = r0 + r;
  float* row = P + (h * rows + r) * nk;
  const int64_t lo = first_key(i, window) - k0, hi = i - k0;  // valid [lo, hi]
  float mx = -INFINITY;
  for (int64_t j = lo + threadIdx.x; j <= hi; j += blockDim.x) mx = fmaxf(mx, row[j]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  __shared__ float mx_s;
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
    mx_s = m;
  }
  __syncthreads();
  mx = mx_s;
  double v[1] = {0};
  for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) {
    const float e = (j >= lo && j <= hi) ? expf(row[j] - mx) : 0.0f;
    row[j] = e;
    v[0] += e;
  }
  block_sum<1>(v, sh);
  __shared__ float sum_s;
  if (threadIdx.x == 0) {
    sum_s = float(v[0]);
    lse[h * S + i] = mx + logf(sum_s);
  }
  __syncthreads();
  const float sum = sum_s;
  for (int64_t j = threadIdx.x; j < nk; j += blockDim.x) row[j] /= sum;
  __syncthreads();
  if (threadIdx.x == 0 && h == gate.head && i == gate.query && gate.key >= k0 && gate.key < k0 + nk)
    row[gate.key - k0] *= gate.value;
}

// D[h * S + i] = dO_i . O_i (per head), one warp per (row, head).
__global__ void dvec_kernel(const float* dout, const float* o, float* Dv, int64_t S, int64_t NQ, int64_t D,
                            int64_t QD) {
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= S * NQ) return;
  const int64_t i = w / NQ, h = w % NQ;
  double s = 0;
  for (int64_t d = lane; d < D; d += 32) s += double(dout[i * QD + h * D + d]) * double(o[i * QD + h * D + d]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if (lane == 0) Dv[h * S + i] = float(s);
}

struct TileArgs {
  float* P;         // in: scaled scores; out: probabilities
  float* dP;        // in: dO V^T; out: dS = P (dP - D)
  const float* lse;
  const float* Dv;
  int64_t rows, nk, r0, k0, k0_aligned, window, S, block, nb;
  int32_t sink, local, last;
  float tiny;
  double* influence;  // [heads][nb][nb]
  double* gate;
  double* attention;
  double* regions;              // streaming, middle, last: (sum, abs_sum)
  unsigned long long* cells;    // streaming, middle, last
};

// One block per 64 x 64 cells (absolute key tiles) of one head of the chunk.
__global__ void backward_tile_kernel(TileArgs a) {
  __shared__ double sh[9 * 32];
  const int64_t h = blockIdx.z;
  const int64_t rt0 = a.r0 + int64_t(blockIdx.y) * 64, kt0 = a.k0_aligned + int64_t(blockIdx.x) * 64;
  const int c = threadIdx.x & 63;
  const int64_t j = kt0 + c;
  const bool per_cell_sums = (a.block % 64) != 0;
  double sums[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};  // influence, gate, attention, then the regions' (sum, abs)
  unsigned long long counts[3] = {0, 0, 0};
  for (int rr = threadIdx.x >> 6; rr < 64; rr += 4) {
    const int64_t i = rt0 + rr;
    if (i >= a.r0 + a.rows || j < a.k0 || j >= a.k0 + a.nk) continue;
    const int64_t at = (h * a.rows + (i - a.r0)) * a.nk + (j - a.k0);
    const bool valid = j <= i && j >= first_key(i, a.window);
    if (!valid) {
      a.P[at] = 0.0f;
      a.dP[at] = 0.0f;
      continue;
    }
    const float p = expf(a.P[at] - a.lse[h * a.S + i]);
    const float dp = a.dP[at];
    const float ds = p * (dp - a.Dv[h * a.S + i]);
    const float one_minus = 1.0f - p;
    const double e = (p > 0.0f && one_minus > a.tiny) ? -double(ds) / double(one_minus) : 0.0;
    const double g = double(p) * double(dp);
    a.P[at] = p;
    a.dP[at] = ds;
    if (per_cell_sums) {
      const int64_t b = (h * a.nb + i / a.block) * a.nb + j / a.block;
      atomicAdd(a.influence + b, e);
      atomicAdd(a.gate + b, g);
      atomicAdd(a.attention + b, double(p));
    } else {
      sums[0] += e;
      sums[1] += g;
      sums[2] += double(p);
    }
    const bool streaming = j < a.sink || i - j < a.local;
    const int region = streaming ? 0 : (i >= a.S - a.last ? 2 : 1);
    sums[3 + 2 * region] += g;
    sums[4 + 2 * region] += fabs(g);
    ++counts[region];
  }
  double cnt[3] = {double(counts[0]), double(counts[1]), double(counts[2])};
  block_sum<9>(sums, sh);
  __syncthreads();
  block_sum<3>(cnt, sh);
  if (threadIdx.x != 0) return;
  if (!per_cell_sums && (cnt[0] + cnt[1] + cnt[2]) > 0) {
    const int64_t b = (h * a.nb + rt0 / a.block) * a.nb + kt0 / a.block;
    atomicAdd(a.influence + b, sums[0]);
    atomicAdd(a.gate + b, sums[1]);
    atomicAdd(a.attention + b, sums[2]);
  }
  for (int r = 0; r < 3; ++r) {
    if (cnt[r] == 0) continue;
    atomicAdd(a.regions + 2 * r, sums[3 + 2 * r]);
    atomicAdd(a.regions + 2 * r + 1, sums[4 + 2 * r]);
    atomicAdd(a.cells + r, static_cast<unsigned long long>(cnt[r]));
  }
}

// dk[t, kvh * D + d] = sum over the group's query heads of dke[t, h * D + d].
__global__ void group_sum_kernel(const float* dke, float* dk, int64_t S, int64_t NKV, int64_t group, int64_t D) {
  const int64_t KD = NKV * D, QD = KD * group;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < S * KD; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / KD, c = e % KD, kvh = c / D, d = c % D;
    float s = 0;
    for (int64_t g = 0; g < group; ++g) s += dke[t * QD + (kvh * group + g) * D + d];
    dk[e] = s;
  }
}

// Rows at positions pos[t] gathered: y[t, :] = x[pos[t], :] (n floats a row), and scattered back added:
// x[pos[t], :] += y[t, :] (atomic, so repeated positions add up).
__global__ void gather_rows_kernel(const float* x, const int32_t* pos, float* y, int64_t rows, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < rows * n; e += int64_t(gridDim.x) * blockDim.x)
    y[e] = x[int64_t(pos[e / n]) * n + e % n];
}
__global__ void scatter_add_rows_kernel(float* x, const int32_t* pos, const float* y, int64_t rows, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < rows * n; e += int64_t(gridDim.x) * blockDim.x)
    atomicAdd(x + int64_t(pos[e / n]) * n + e % n, y[e]);
}

// The next-token cross-entropy of one row of logits z [V] a block (plan/cross_entropy.h's formulas, its CPU twin):
// soft-capped in place when cap > 0, loss[row] = lse - z[token] (the exponentials summed in double); with grad the row
// becomes dL/dz (uncapped): (softmax - onehot) / count, times the cap's derivative 1 - (z / cap)^2.
constexpr int kLossThreads = 512;
__global__ void __launch_bounds__(kLossThreads) cross_entropy_kernel(float* z, int64_t V, const int32_t* tokens,
                                                                   float cap, double count, bool grad,
                                                                   double* loss) {
  __shared__ double sh[32];
  __shared__ float mx_s, target_s;
  float* row = z + int64_t(blockIdx.x) * V;
  const int32_t tok = tokens[blockIdx.x];
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    if (cap > 0) row[j] = cap * tanhf(row[j] / cap);
    mx = fmaxf(mx, row[j]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) m = fmaxf(m, float(sh[w]));
    mx_s = m;
    target_s = row[tok];
  }
  __syncthreads();
  mx = mx_s;
  double v[1] = {0};
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) v[0] += exp(double(row[j] - mx));
  block_sum<1>(v, sh);  // thread 0 holds the sum
  __shared__ double lse_s;
  if (threadIdx.x == 0) {
    lse_s = double(mx) + log(v[0]);
    loss[blockIdx.x] = lse_s - double(target_s);
  }
  __syncthreads();
  if (!grad) return;
  const double lse = lse_s;
  const float one = static_cast<float>(1.0 / count);
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float zc = row[j];
    float g = static_cast<float>(exp(double(zc) - lse) / count);
    if (j == tok) g -= one;
    if (cap > 0) g *= 1.0f - (zc / cap) * (zc / cap);
    row[j] = g;
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

}  // namespace
}  // namespace tessera::plan::cuda
