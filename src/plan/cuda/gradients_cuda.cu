#include "plan/cuda/gradients_cuda.h"
#include "plan/cross_entropy.h"
#include "plan/pass_dims.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/memory_budget.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "runtime/rope.h"

namespace tessera::plan::cuda {

using attn::gpu::check_launch;
using attn::gpu::device_memory_state;
using runtime::Activation;
using runtime::ModelConfig;

namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("attention gradients (CUDA): cuBLAS error ") + std::to_string(static_cast<int>(s)) +
                " in " + what);
}

// A device allocation counted against the pass's peak (Tracker); uninitialised.
struct Tracker {
  size_t current = 0, peak = 0;
};

template <class T>
class Buf {
 public:
  Buf() = default;
  Buf(size_t n, Tracker* t) { alloc(n, t); }
  ~Buf() { release(); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), t_(o.t_) {}
  Buf& operator=(Buf&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
      t_ = o.t_;
    }
    return *this;
  }
  void alloc(size_t n, Tracker* t) {
    release();
    t_ = t;
    if (n == 0) return;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, n * sizeof(T));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("attention gradients (CUDA): out of device memory: could not allocate " +
                  std::to_string(n * sizeof(T)) + " bytes (" + device_memory_state() +
                  "); use shorter calibration samples or --device cpu");
    }
    p_ = static_cast<T*>(p);
    n_ = n;
    if (t_) {
      t_->current += n * sizeof(T);
      t_->peak = std::max(t_->peak, t_->current);
    }
  }
  void release() {
    if (p_) {
      cudaFree(p_);
      if (t_) t_->current -= n_ * sizeof(T);
    }
    p_ = nullptr;
    n_ = 0;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
  Tracker* t_ = nullptr;
};

// ---------------------------------------------------------------------------------------------------- kernels

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

__global__ void embed_kernel(const int32_t* tok, const float* emb, float* x, int64_t S, int64_t H, float scale) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < S * H; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / H, i = e % H;
    x[e] = emb[int64_t(tok[t]) * H + i] * scale;
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

__device__ float act_f(float g, int kind) {
  switch (kind) {
    case 0:
      return g / (1.0f + expf(-g));
    case 1: {
      const float c = 0.7978845608028654f;
      return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    }
    default:
      return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
  }
}
__device__ float act_grad(float g, int kind) {
  switch (kind) {
    case 0: {
      const float s = 1.0f / (1.0f + expf(-g));
      return s * (1.0f + g * (1.0f - s));
    }
    case 1: {
      const float c = 0.7978845608028654f;
      const float th = tanhf(c * (g + 0.044715f * g * g * g));
      return 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * c * (1.0f + float(3 * 0.044715) * g * g);
    }
    default: {
      const float cdf = 0.5f * (1.0f + erff(g * 0.7071067811865476f));
      const float pdf = expf(-0.5f * g * g) / 2.5066282746310002f;
      return cdf + g * pdf;
    }
  }
}

__global__ void act_forward_kernel(const float* g, const float* u, float* act, int64_t n, int kind) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    act[e] = act_f(g[e], kind) * u[e];
}

// In place: g becomes dg, u becomes du (dact is read first).
__global__ void act_backward_kernel(float* g, float* u, const float* dact, int64_t n, int kind) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const float gv = g[e], uv = u[e], d = dact[e];
    u[e] = d * act_f(gv, kind);
    g[e] = d * uv * act_grad(gv, kind);
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

__device__ uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// w[e] = uniform in [-amp, amp), from (seed, e).
__global__ void random_kernel(float* w, int64_t n, uint64_t seed, float amp) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix(seed ^ splitmix(uint64_t(e)));
    const float u = float(r >> 40) * (1.0f / 16777216.0f);
    w[e] = (2.0f * u - 1.0f) * amp;
  }
}

__global__ void fill_kernel(float* w, int64_t n, float v) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) w[e] = v;
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

}  // namespace

// ---------------------------------------------------------------------------------------------------- weights

struct DevWeight {
  Buf<float> buf;
  int64_t rows = 0, cols = 0;
  const float* ptr() const { return buf.get(); }
  bool empty() const { return buf.size() == 0; }
};

struct DevLayer {
  DevWeight attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm, w_gate,
      w_up, w_down;
};

struct GradientModel::Impl {
  ModelConfig cfg;
  std::vector<float> rope_freq_factors;
  DevWeight embedding, lm_head, final_norm;
  std::vector<DevLayer> layers;
  size_t bytes = 0;
  const DevWeight& output() const { return lm_head.empty() ? embedding : lm_head; }
};

GradientModel::GradientModel() : impl_(std::make_unique<Impl>()) {}
GradientModel::~GradientModel() = default;
const ModelConfig& GradientModel::config() const { return impl_->cfg; }
size_t GradientModel::bytes() const { return impl_->bytes; }

namespace {

void upload(DevWeight& d, const runtime::Weight& w, size_t& bytes) {
  d.rows = w.rows;
  d.cols = w.cols;
  if (w.empty()) return;
  const std::vector<float> host = w.to_f32();  // the weight in any kept type, as f32
  d.buf.alloc(host.size(), nullptr);
  TESSERA_CUDA_CHECK(cudaMemcpy(d.buf.get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  bytes += host.size() * sizeof(float);
}

void make_random(DevWeight& d, int64_t rows, int64_t cols, uint64_t seed, float amp, size_t& bytes) {
  d.rows = rows;
  d.cols = cols;
  const int64_t n = rows * cols;
  d.buf.alloc(sz(n), nullptr);
  if (amp == 0.0f)
    fill_kernel<<<grid_for(n), kThreads>>>(d.buf.get(), n, 1.0f);
  else
    random_kernel<<<grid_for(n), kThreads>>>(d.buf.get(), n, seed, amp);
  check_launch("random weights");
  bytes += sz(n) * sizeof(float);
}

}  // namespace

GradientModel::GradientModel(const ModelConfig& config, const runtime::ModelWeights& w) : GradientModel() {
  Impl& m = *impl_;
  m.cfg = config;
  m.rope_freq_factors = w.rope_freq_factors;
  upload(m.embedding, w.embedding, m.bytes);
  upload(m.lm_head, w.lm_head, m.bytes);
  upload(m.final_norm, w.final_norm, m.bytes);
  m.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const runtime::LayerWeights& s = w.layers[l];
    DevLayer& d = m.layers[l];
    for (auto [dst, src] : {std::pair{&d.attn_norm, &s.attn_norm}, std::pair{&d.wq, &s.wq}, std::pair{&d.wk, &s.wk}, std::pair{&d.wv, &s.wv}, std::pair{&d.wo, &s.wo}, std::pair{&d.bq, &s.bq}, std::pair{&d.bk, &s.bk}, std::pair{&d.bv, &s.bv}, std::pair{&d.q_norm, &s.q_norm}, std::pair{&d.k_norm, &s.k_norm}, std::pair{&d.post_attn_norm, &s.post_attn_norm}, std::pair{&d.ffn_norm, &s.ffn_norm}, std::pair{&d.post_ffn_norm, &s.post_ffn_norm}, std::pair{&d.w_gate, &s.w_gate}, std::pair{&d.w_up, &s.w_up}, std::pair{&d.w_down, &s.w_down}})
      upload(*dst, *src, m.bytes);
  }
}

std::unique_ptr<GradientModel> GradientModel::random(const ModelConfig& c, uint64_t seed) {
  std::unique_ptr<GradientModel> g(new GradientModel());
  Impl& m = *g->impl_;
  m.cfg = c;
  const int64_t H = c.hidden_size, D = c.head_dim, QD = int64_t(c.num_q_heads) * D, KD = int64_t(c.num_kv_heads) * D,
                F = c.intermediate_size, V = c.vocab_size;
  // Gemma-3's norms hold 1 + w: 1 either way.
  const float one = 0.0f;  // amp 0: filled with 1
  uint64_t s = seed * 1000003ull;
  auto lin = [&](DevWeight& w, int64_t out, int64_t in) {
    make_random(w, out, in, ++s, std::sqrt(3.0f / static_cast<float>(in)), m.bytes);
  };
  make_random(m.embedding, V, H, ++s, std::sqrt(3.0f), m.bytes);
  if (!c.tied_embeddings) lin(m.lm_head, V, H);
  make_random(m.final_norm, 1, H, 0, one, m.bytes);
  m.layers.resize(sz(c.num_layers));
  for (DevLayer& d : m.layers) {
    make_random(d.attn_norm, 1, H, 0, one, m.bytes);
    lin(d.wq, QD, H);
    lin(d.wk, KD, H);
    lin(d.wv, KD, H);
    lin(d.wo, H, QD);
    if (c.qkv_bias) {
      make_random(d.bq, 1, QD, ++s, 0.02f, m.bytes);
      make_random(d.bk, 1, KD, ++s, 0.02f, m.bytes);
      make_random(d.bv, 1, KD, ++s, 0.02f, m.bytes);
    }
    if (c.qk_norm) {
      make_random(d.q_norm, 1, D, 0, one, m.bytes);
      make_random(d.k_norm, 1, D, 0, one, m.bytes);
    }
    if (c.post_norms) {
      make_random(d.post_attn_norm, 1, H, 0, one, m.bytes);
      make_random(d.post_ffn_norm, 1, H, 0, one, m.bytes);
    }
    make_random(d.ffn_norm, 1, H, 0, one, m.bytes);
    lin(d.w_gate, F, H);
    lin(d.w_up, F, H);
    lin(d.w_down, H, F);
  }
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return g;
}

// ---------------------------------------------------------------------------------------------------- the pass

namespace {

class Pass : private PassDims {
 public:
  Pass(const GradientModel::Impl& m, std::span<const int32_t> tokens, const GradientOptions& opt,
       const DeviceRunOptions& run)
      : PassDims(m.cfg), m_(m), cfg_(m.cfg), opt_(opt), S_(static_cast<int64_t>(tokens.size())) {
    G_ = NQ_ / NKV_;
    nb_ = (S_ + opt.block - 1) / opt.block;
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cublas_check(cublasCreate(&blas_), "cublasCreate");
    cublas_check(cublasSetStream(blas_, stream_), "cublasSetStream");
    cublas_check(cublasSetMathMode(blas_, opt.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                 "cublasSetMathMode");
    // RoPE tables per distinct RopeConfig, exactly the CPU's.
    runtime::LayerRopes ropes = runtime::layer_ropes(cfg_, m.rope_freq_factors);
    for (const std::vector<float>& inv : ropes.inv_freqs) {
      std::vector<float> c(sz(S_ * (D_ / 2))), s(sz(S_ * (D_ / 2)));
      runtime::rope_tables(inv, 0, S_, c.data(), s.data());
      cos_.emplace_back(c.size(), &tr_);
      sin_.emplace_back(s.size(), &tr_);
      to_device(cos_.back().get(), c.data(), c.size());
      to_device(sin_.back().get(), s.data(), s.size());
    }
    layer_rope_ = std::move(ropes.layer);
    // The query chunk: the two [heads, R, S] buffers within 1 GiB.
    int64_t R = run.chunk_rows;
    const int64_t S64 = (S_ + 63) / 64 * 64;
    if (R <= 0) {
      R = (int64_t(1) << 30) / (NQ_ * std::max<int64_t>(S_, 1) * 8) / 64 * 64;
      R = std::clamp<int64_t>(R, 64, S64);
    }
    check(R % 64 == 0, "attention gradients (CUDA): chunk rows must be a multiple of 64, got " + std::to_string(R));
    R_ = std::min(R, S64);
  }
  ~Pass() {
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  int64_t chunk_rows() const { return R_; }
  const Tracker& tracker() const { return tr_; }
  size_t peak_used() const { return peak_used_; }

  // The forward alone, observe() after each layer's attention (GradientModel::forward).
  void forward(std::span<const int32_t> tokens, const std::function<void(const GradientModel::AttentionView&)>& observe) {
    Buf<int32_t> tok;
    Buf<float> x = embed(tokens, tok);
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      observed_layer_ = static_cast<int32_t>(l);
      observe_ = &observe;
      layer_forward(static_cast<int32_t>(l), x.get());
      observe_ = nullptr;
      copy(x.get(), x2_.get(), sz(S_ * H_));
      add(x.get(), post_ffn(l), S_ * H_);
    }
    sample_memory();
    sync();
  }

  GradientResult run(std::span<const int32_t> tokens, std::span<const Target> targets) {
    GradientResult result;
    result.seq_len = static_cast<int32_t>(S_);
    result.block = opt_.block;
    result.num_blocks = static_cast<int32_t>(nb_);
    result.num_q_heads = static_cast<int32_t>(NQ_);
    const int64_t L = cfg_.num_layers;
    Buf<int32_t> tok;
    Buf<float> x = embed(tokens, tok);
    if (!opt_.loss_only) inputs_.alloc(sz(L * S_ * H_), &tr_);
    for (int64_t l = 0; l < L; ++l) {
      if (!opt_.loss_only) copy(inputs_.get() + l * S_ * H_, x.get(), sz(S_ * H_));
      layer_forward(static_cast<int32_t>(l), x.get());
      copy(x.get(), x2_.get(), sz(S_ * H_));
      add(x.get(), post_ffn(l), S_ * H_);
    }
    sample_memory();

    // The loss over the target rows: the logits come to the host, the loss and dz are the CPU's code.
    const int64_t NT = static_cast<int64_t>(targets.size());
    const int64_t V = cfg_.vocab_size;
    const DevWeight& wout = m_.output();
    Buf<float> xt(sz(NT * H_), &tr_), rf(sz(NT), &tr_), hf(sz(NT * H_), &tr_), z(sz(NT * V), &tr_);
    for (int64_t t = 0; t < NT; ++t) copy(xt.get() + t * H_, x.get() + int64_t(targets[sz(t)].position) * H_, sz(H_));
    rms_forward_kernel<<<NT, kThreads, 0, stream_>>>(xt.get(), hf.get(), rf.get(), H_, m_.final_norm.ptr(),
                                                     static_cast<float>(cfg_.rms_norm_eps));
    check_launch("final norm");
    gemm(true, false, V, NT, H_, 1.0f, wout.ptr(), H_, hf.get(), H_, 0.0f, z.get(), V);
    std::vector<float> zh(sz(NT * V));
    to_host(zh.data(), z.get(), zh.size());
    std::vector<float> dz(opt_.loss_only ? 0 : sz(NT * V));
    result.loss = cross_entropy<float>(zh, V, targets, static_cast<float>(cfg_.final_logit_softcap), dz);
    if (opt_.loss_only) {
      sync();
      return result;
    }
    to_device(z.get(), dz.data(), dz.size());
    Buf<float> dhf(sz(NT * H_), &tr_), dxt(sz(NT * H_), &tr_);
    gemm(false, false, H_, NT, V, 1.0f, wout.ptr(), H_, z.get(), V, 0.0f, dhf.get(), H_);
    rms_backward_kernel<<<NT, kThreads, 0, stream_>>>(xt.get(), rf.get(), H_, m_.final_norm.ptr(), dhf.get(),
                                                      dxt.get(), false);
    check_launch("final norm backward");
    Buf<float>& dx = x;
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0, sz(S_ * H_) * sizeof(float), stream_));
    for (int64_t t = 0; t < NT; ++t) add(dx.get() + int64_t(targets[sz(t)].position) * H_, dxt.get() + t * H_, H_);

    alloc_backward();
    result.layers.resize(sz(L));
    for (int64_t l = L - 1; l >= 0; --l) {
      const float* xin = inputs_.get() + l * S_ * H_;
      layer_forward(static_cast<int32_t>(l), xin);
      layer_backward(static_cast<int32_t>(l), xin, dx.get(), result.layers[sz(l)]);
    }
    sync();
    return result;
  }

 private:
  // ------------------------------------------------------------------ helpers
  template <class T>
  void to_device(T* d, const T* h, size_t n) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(d, h, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  template <class T>
  void to_host(T* h, const T* d, size_t n) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(h, d, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy(float* d, const float* s, size_t n) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(d, s, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void add(float* y, const float* x, int64_t n) {
    add_kernel<<<grid_for(n), kThreads, 0, stream_>>>(y, x, n);
    check_launch("add");
  }
  void sync() { TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  void sample_memory() {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) peak_used_ = std::max(peak_used_, total_b - free_b);
  }

  // Column-major cuBLAS: C[m, n] = alpha op(A) op(B) + beta C.
  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    if (m == 0 || n == 0) return;
    cublas_check(cublasSgemm(blas_, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n),
                             int(k), &alpha, A, int(lda), B, int(ldb), &beta, C, int(ldc)),
                 "cublasSgemm");
  }
  void gemm_batched(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
                    int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc,
                    int64_t sc, int64_t batch) {
    if (m == 0 || n == 0) return;
    cublas_check(cublasSgemmStridedBatched(blas_, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           int(m), int(n), int(k), &alpha, A, int(lda), sa, B, int(ldb), sb, &beta, C,
                                           int(ldc), sc, int(batch)),
                 "cublasSgemmStridedBatched");
  }
  // y[S, out] = x[S, in] W^T (+ bias).
  void linear(const float* x, int64_t in, const DevWeight& w, const DevWeight* bias, float* y) {
    gemm(true, false, w.rows, S_, in, 1.0f, w.ptr(), in, x, in, 0.0f, y, w.rows);
    if (bias != nullptr && !bias->empty()) {
      add_bias_kernel<<<grid_for(S_ * w.rows), kThreads, 0, stream_>>>(y, bias->ptr(), S_, w.rows);
      check_launch("bias");
    }
  }
  // dx[S, in] (+)= dy[S, out] W.
  void linear_back(const float* dy, const DevWeight& w, float* dx, bool accumulate) {
    gemm(false, false, w.cols, S_, w.rows, 1.0f, w.ptr(), w.cols, dy, w.rows, accumulate ? 1.0f : 0.0f, dx, w.cols);
  }
  void rms(const float* x, float* y, float* r, int64_t rows, int64_t n, const DevWeight& w) {
    rms_forward_kernel<<<rows, kThreads, 0, stream_>>>(x, y, r, n, w.ptr(), static_cast<float>(cfg_.rms_norm_eps));
    check_launch("rms norm");
  }
  void rms_back(const float* x, const float* r, int64_t rows, int64_t n, const DevWeight& w, const float* dy, float* dx,
                bool accumulate) {
    rms_backward_kernel<<<rows, kThreads, 0, stream_>>>(x, r, n, w.ptr(), dy, dx, accumulate);
    check_launch("rms norm backward");
  }
  void rope(float* x, int64_t heads, int64_t stride, size_t table, bool inverse) {
    rope_kernel<<<grid_for(S_ * heads * (D_ / 2)), kThreads, 0, stream_>>>(x, S_, heads, stride, D_, cos_[table].get(),
                                                                          sin_[table].get(), inverse);
    check_launch("rope");
  }
  int act_kind() const {
    switch (cfg_.activation) {
      case Activation::SiLU:
        return 0;
      case Activation::GeluTanh:
        return 1;
      case Activation::Gelu:
        return 2;
    }
    return 0;
  }
  int64_t window(int32_t l) const { return cfg_.layers[sz(l)].sliding_window; }
  int64_t first_key_host(int32_t l, int64_t i) const {
    const int64_t w = window(l);
    return w > 0 ? std::max<int64_t>(0, i - w + 1) : 0;
  }

  // The activations allocated, then the tokens on the device (in `tok`) and their embedding rows (returned).
  Buf<float> embed(std::span<const int32_t> tokens, Buf<int32_t>& tok) {
    alloc_activations();
    tok.alloc(sz(S_), &tr_);
    to_device(tok.get(), tokens.data(), tokens.size());
    Buf<float> x(sz(S_ * H_), &tr_);
    embed_kernel<<<grid_for(S_ * H_), kThreads, 0, stream_>>>(tok.get(), m_.embedding.ptr(), x.get(), S_, H_,
                                                              static_cast<float>(cfg_.embedding_scale));
    check_launch("embedding");
    return x;
  }

  void alloc_activations() {
    auto a = [&](Buf<float>& b, int64_t n) { b.alloc(sz(n), &tr_); };
    a(r1_, S_);
    a(h1_, S_ * H_);
    a(q_pre_, S_ * QD_);
    a(k_pre_, S_ * KD_);
    if (cfg_.qk_norm) {
      a(rq_, S_ * NQ_);
      a(rk_, S_ * NKV_);
    }
    a(q_, S_ * QD_);
    a(k_, S_ * KD_);
    a(v_, S_ * KD_);
    a(lse_, NQ_ * S_);
    a(o_, S_ * QD_);
    a(att_, S_ * H_);
    a(ra_, S_);
    a(x2_, S_ * H_);
    a(r2_, S_);
    a(h2_, S_ * H_);
    a(g_, S_ * F_);
    a(u_, S_ * F_);
    a(act_, S_ * F_);
    a(m_out_, S_ * H_);
    a(rm_, S_);
    a(tmp_, S_ * H_);
    a(P_, NQ_ * R_ * S_);
  }
  void alloc_backward() {
    auto a = [&](Buf<float>& b, int64_t n) { b.alloc(sz(n), &tr_); };
    a(dP_, NQ_ * R_ * S_);
    a(dm_, S_ * H_);
    a(dact_, S_ * F_);
    a(dh2_, S_ * H_);
    a(dx2_, S_ * H_);
    a(da_, S_ * H_);
    a(dout_, S_ * QD_);
    a(dq_, S_ * QD_);
    a(dk_, S_ * KD_);
    a(dv_, S_ * KD_);
    a(dke_, S_ * QD_);
    a(dve_, S_ * QD_);
    a(dvec_, NQ_ * S_);
    a(dh1_, S_ * H_);
    a(tq_, S_ * QD_);
    const size_t blocks = sz(NQ_ * nb_ * nb_);
    sums_.alloc(3 * blocks + 6, &tr_);
    cells_.alloc(3, &tr_);
  }

  // The FFN branch's contribution to the residual: m, or RMSNorm(m) (Gemma-3), in tmp_.
  const float* post_ffn(int64_t l) {
    if (!cfg_.post_norms) return m_out_.get();
    rms(m_out_.get(), tmp_.get(), rm_.get(), S_, H_, m_.layers[sz(l)].post_ffn_norm);
    return tmp_.get();
  }

  void layer_forward(int32_t l, const float* x) {
    const DevLayer& W = m_.layers[sz(l)];
    rms(x, h1_.get(), r1_.get(), S_, H_, W.attn_norm);
    linear(h1_.get(), H_, W.wq, cfg_.qkv_bias ? &W.bq : nullptr, q_pre_.get());
    linear(h1_.get(), H_, W.wk, cfg_.qkv_bias ? &W.bk : nullptr, k_pre_.get());
    linear(h1_.get(), H_, W.wv, cfg_.qkv_bias ? &W.bv : nullptr, v_.get());
    if (cfg_.qk_norm) {
      rms(q_pre_.get(), q_.get(), rq_.get(), S_ * NQ_, D_, W.q_norm);
      rms(k_pre_.get(), k_.get(), rk_.get(), S_ * NKV_, D_, W.k_norm);
    } else {
      copy(q_.get(), q_pre_.get(), sz(S_ * QD_));
      copy(k_.get(), k_pre_.get(), sz(S_ * KD_));
    }
    const size_t r = layer_rope_[sz(l)];
    rope(q_.get(), NQ_, QD_, r, false);
    rope(k_.get(), NKV_, KD_, r, false);
    attention_forward(l);
    if (observe_ != nullptr) {
      GradientModel::AttentionView view;
      view.layer = observed_layer_;
      view.tokens = S_;
      view.q = q_.get();
      view.k = k_.get();
      view.v = v_.get();
      view.o = o_.get();
      view.stream = stream_;
      (*observe_)(view);
    }
    linear(o_.get(), QD_, W.wo, nullptr, att_.get());
    copy(x2_.get(), x, sz(S_ * H_));
    if (cfg_.post_norms) {
      rms(att_.get(), tmp_.get(), ra_.get(), S_, H_, W.post_attn_norm);
      add(x2_.get(), tmp_.get(), S_ * H_);
    } else {
      add(x2_.get(), att_.get(), S_ * H_);
    }
    rms(x2_.get(), h2_.get(), r2_.get(), S_, H_, W.ffn_norm);
    linear(h2_.get(), H_, W.w_gate, nullptr, g_.get());
    linear(h2_.get(), H_, W.w_up, nullptr, u_.get());
    act_forward_kernel<<<grid_for(S_ * F_), kThreads, 0, stream_>>>(g_.get(), u_.get(), act_.get(), S_ * F_,
                                                                    act_kind());
    check_launch("activation");
    linear(act_.get(), F_, W.w_down, nullptr, m_out_.get());
  }

  // out [heads][rows][nk] = alpha * A_h B_kv^T for chunk rows [r0, r0 + rows) of A ([S, QD]: q or dO) against
  // keys [k0, k0 + nk) of B ([S, KD]: k or v): the scaled scores, or dP = dO V^T.
  void chunk_products(const float* A, const float* B, int64_t r0, int64_t rows, int64_t k0, int64_t nk, float alpha,
                      float* out) {
    for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
      const int64_t h0 = kvh * G_;
      gemm_batched(true, false, nk, rows, D_, alpha, B + k0 * KD_ + kvh * D_, KD_, 0, A + r0 * QD_ + h0 * D_, QD_, D_,
                   0.0f, out + h0 * rows * nk, nk, rows * nk, G_);
    }
  }

  void attention_forward(int32_t l) {
    const float scale = static_cast<float>(cfg_.attention_scale);
    Gate gate;
    if (opt_.gate && opt_.gate->layer == l) {
      gate.head = opt_.gate->head;
      gate.query = opt_.gate->query;
      gate.key = opt_.gate->key;
      gate.value = static_cast<float>(opt_.gate->value);
    }
    for (int64_t r0 = 0; r0 < S_; r0 += R_) {
      const int64_t r1 = std::min(S_, r0 + R_), rows = r1 - r0, k0 = first_key_host(l, r0), nk = r1 - k0;
      chunk_products(q_.get(), k_.get(), r0, rows, k0, nk, scale, P_.get());
      softmax_kernel<<<dim3(unsigned(rows), unsigned(NQ_)), kThreads, 0, stream_>>>(P_.get(), lse_.get(), rows, nk, r0,
                                                                                 k0, window(l), S_, gate);
      check_launch("attention softmax");
      // O = P V
      for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
        const int64_t h0 = kvh * G_;
        gemm_batched(false, false, D_, rows, nk, 1.0f, v_.get() + k0 * KD_ + kvh * D_, KD_, 0,
                     P_.get() + h0 * rows * nk, nk, rows * nk, 0.0f, o_.get() + r0 * QD_ + h0 * D_, QD_, D_, G_);
      }
    }
  }

  void attention_backward(int32_t l, LayerGradients& g) {
    const float scale = static_cast<float>(cfg_.attention_scale);
    const size_t blocks = sz(NQ_ * nb_ * nb_);
    TESSERA_CUDA_CHECK(cudaMemsetAsync(sums_.get(), 0, sums_.size() * sizeof(double), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(cells_.get(), 0, 3 * sizeof(unsigned long long), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dke_.get(), 0, sz(S_ * QD_) * sizeof(float), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dve_.get(), 0, sz(S_ * QD_) * sizeof(float), stream_));
    {
      const int64_t warps = S_ * NQ_;
      dvec_kernel<<<unsigned((warps * 32 + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
          dout_.get(), o_.get(), dvec_.get(), S_, NQ_, D_, QD_);
      check_launch("attention D");
    }
    TileArgs ta{};
    ta.lse = lse_.get();
    ta.Dv = dvec_.get();
    ta.window = window(l);
    ta.S = S_;
    ta.block = opt_.block;
    ta.nb = nb_;
    ta.sink = opt_.regions.sink;
    ta.local = opt_.regions.local;
    ta.last = opt_.regions.last;
    ta.tiny = 1e-6f;
    ta.influence = sums_.get();
    ta.gate = sums_.get() + blocks;
    ta.attention = sums_.get() + 2 * blocks;
    ta.regions = sums_.get() + 3 * blocks;
    ta.cells = cells_.get();
    for (int64_t r0 = 0; r0 < S_; r0 += R_) {
      const int64_t r1 = std::min(S_, r0 + R_), rows = r1 - r0, k0 = first_key_host(l, r0), nk = r1 - k0;
      chunk_products(q_.get(), k_.get(), r0, rows, k0, nk, scale, P_.get());
      chunk_products(dout_.get(), v_.get(), r0, rows, k0, nk, 1.0f, dP_.get());
      ta.P = P_.get();
      ta.dP = dP_.get();
      ta.rows = rows;
      ta.nk = nk;
      ta.r0 = r0;
      ta.k0 = k0;
      ta.k0_aligned = k0 / 64 * 64;
      const dim3 grid(unsigned((r1 - ta.k0_aligned + 63) / 64), unsigned((rows + 63) / 64), unsigned(NQ_));
      backward_tile_kernel<<<grid, kThreads, 0, stream_>>>(ta);
      check_launch("attention backward tiles");
      for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
        const int64_t h0 = kvh * G_;
        // dQ = scale dS K
        gemm_batched(false, false, D_, rows, nk, scale, k_.get() + k0 * KD_ + kvh * D_, KD_, 0,
                     dP_.get() + h0 * rows * nk, nk, rows * nk, 0.0f, dq_.get() + r0 * QD_ + h0 * D_, QD_, D_, G_);
        // dK (per query head) += scale dS^T Q
        gemm_batched(false, true, D_, nk, rows, scale, q_.get() + r0 * QD_ + h0 * D_, QD_, D_,
                     dP_.get() + h0 * rows * nk, nk, rows * nk, 1.0f, dke_.get() + k0 * QD_ + h0 * D_, QD_, D_, G_);
        // dV (per query head) += P^T dO
        gemm_batched(false, true, D_, nk, rows, 1.0f, dout_.get() + r0 * QD_ + h0 * D_, QD_, D_,
                     P_.get() + h0 * rows * nk, nk, rows * nk, 1.0f, dve_.get() + k0 * QD_ + h0 * D_, QD_, D_, G_);
      }
    }
    group_sum_kernel<<<grid_for(S_ * KD_), kThreads, 0, stream_>>>(dke_.get(), dk_.get(), S_, NKV_, G_, D_);
    group_sum_kernel<<<grid_for(S_ * KD_), kThreads, 0, stream_>>>(dve_.get(), dv_.get(), S_, NKV_, G_, D_);
    check_launch("group sums");
    sample_memory();
    std::vector<double> h(sums_.size());
    std::vector<unsigned long long> c(3);
    to_host(h.data(), sums_.get(), h.size());
    to_host(c.data(), cells_.get(), 3);
    g.influence.assign(h.begin(), h.begin() + static_cast<ptrdiff_t>(blocks));
    g.gate_grad.assign(h.begin() + static_cast<ptrdiff_t>(blocks), h.begin() + static_cast<ptrdiff_t>(2 * blocks));
    g.attention.assign(h.begin() + static_cast<ptrdiff_t>(2 * blocks), h.begin() + static_cast<ptrdiff_t>(3 * blocks));
    RegionSums* rs[3] = {&g.probe.streaming, &g.probe.middle, &g.probe.last};
    for (int r = 0; r < 3; ++r) {
      rs[r]->sum = h[3 * blocks + 2 * sz(r)];
      rs[r]->abs_sum = h[3 * blocks + 2 * sz(r) + 1];
      rs[r]->cells = static_cast<int64_t>(c[sz(r)]);
    }
  }

  // dx: in = d(layer output), out = d(layer input).
  void layer_backward(int32_t l, const float* x, float* dx, LayerGradients& g) {
    const DevLayer& W = m_.layers[sz(l)];
    const float* dm = dx;
    if (cfg_.post_norms) {
      rms(m_out_.get(), tmp_.get(), rm_.get(), S_, H_, W.post_ffn_norm);
      rms_back(m_out_.get(), rm_.get(), S_, H_, W.post_ffn_norm, dx, dm_.get(), false);
      dm = dm_.get();
    }
    linear_back(dm, W.w_down, dact_.get(), false);
    act_backward_kernel<<<grid_for(S_ * F_), kThreads, 0, stream_>>>(g_.get(), u_.get(), dact_.get(), S_ * F_,
                                                                     act_kind());
    check_launch("activation backward");
    linear_back(g_.get(), W.w_gate, dh2_.get(), false);
    linear_back(u_.get(), W.w_up, dh2_.get(), true);
    copy(dx2_.get(), dx, sz(S_ * H_));
    rms_back(x2_.get(), r2_.get(), S_, H_, W.ffn_norm, dh2_.get(), dx2_.get(), true);
    const float* da = dx2_.get();
    if (cfg_.post_norms) {
      rms_back(att_.get(), ra_.get(), S_, H_, W.post_attn_norm, dx2_.get(), da_.get(), false);
      da = da_.get();
    }
    linear_back(da, W.wo, dout_.get(), false);
    attention_backward(l, g);
    const size_t r = layer_rope_[sz(l)];
    rope(dq_.get(), NQ_, QD_, r, true);
    rope(dk_.get(), NKV_, KD_, r, true);
    if (cfg_.qk_norm) {
      rms_back(q_pre_.get(), rq_.get(), S_ * NQ_, D_, W.q_norm, dq_.get(), tq_.get(), false);
      copy(dq_.get(), tq_.get(), sz(S_ * QD_));
      rms_back(k_pre_.get(), rk_.get(), S_ * NKV_, D_, W.k_norm, dk_.get(), tq_.get(), false);
      copy(dk_.get(), tq_.get(), sz(S_ * KD_));
    }
    linear_back(dq_.get(), W.wq, dh1_.get(), false);
    linear_back(dk_.get(), W.wk, dh1_.get(), true);
    linear_back(dv_.get(), W.wv, dh1_.get(), true);
    copy(dx, dx2_.get(), sz(S_ * H_));
    rms_back(x, r1_.get(), S_, H_, W.attn_norm, dh1_.get(), dx, true);
  }

  const GradientModel::Impl& m_;
  const ModelConfig& cfg_;
  const GradientOptions& opt_;
  int64_t S_;
  int64_t G_ = 1, nb_ = 0, R_ = 64;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  Tracker tr_;
  size_t peak_used_ = 0;
  std::vector<Buf<float>> cos_, sin_;
  std::vector<size_t> layer_rope_;
  Buf<float> inputs_;
  Buf<float> r1_, h1_, q_pre_, k_pre_, rq_, rk_, q_, k_, v_, lse_, o_, att_, ra_, x2_, r2_, h2_, g_, u_, act_, m_out_,
      rm_, tmp_, P_;
  Buf<float> dP_, dm_, dact_, dh2_, dx2_, da_, dout_, dq_, dk_, dv_, dke_, dve_, dvec_, dh1_, tq_;
  Buf<double> sums_;
  Buf<unsigned long long> cells_;
  const std::function<void(const GradientModel::AttentionView&)>* observe_ = nullptr;
  int32_t observed_layer_ = 0;
};

}  // namespace

GradientResult GradientModel::run(std::span<const int32_t> tokens, std::span<const Target> targets,
                                  const GradientOptions& options, const DeviceRunOptions& run) const {
  GradientOptions o = options;
  o.device = Device::Cuda;
  check_gradient_inputs(impl_->cfg, tokens, targets, o);
  if (!o.loss_only) {  // the block sums come back to the host: 3 doubles per block, head and layer
    const double nb = std::ceil(static_cast<double>(tokens.size()) / o.block);
    check_host_allocation("attention gradients of " + std::to_string(tokens.size()) + " tokens (" + impl_->cfg.name +
                              "): block sums",
                          24.0 * impl_->cfg.num_layers * impl_->cfg.num_q_heads * nb * nb,
                          "use shorter calibration samples");
  }
  const auto t0 = std::chrono::steady_clock::now();
  Pass pass(*impl_, tokens, o, run);
  GradientResult r = pass.run(tokens, targets);
  if (run.stats) {
    run.stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.stats->weight_bytes = impl_->bytes;
    run.stats->peak_pass_bytes = pass.tracker().peak;
    run.stats->peak_used_bytes = pass.peak_used();
    run.stats->chunk_rows = pass.chunk_rows();
  }
  return r;
}

void GradientModel::forward(std::span<const int32_t> tokens, const std::function<void(const AttentionView&)>& observe,
                            const DeviceRunOptions& run) const {
  const ModelConfig& cfg = impl_->cfg;
  check(!tokens.empty(), "forward (CUDA): empty token sequence");
  for (size_t i = 0; i < tokens.size(); ++i)
    check(tokens[i] >= 0 && tokens[i] < cfg.vocab_size,
          "forward (CUDA): token " + std::to_string(i) + " has id " + std::to_string(tokens[i]) +
              ", outside the vocabulary of " + std::to_string(cfg.vocab_size));
  GradientOptions o;
  o.device = Device::Cuda;
  o.loss_only = true;
  const auto t0 = std::chrono::steady_clock::now();
  Pass pass(*impl_, tokens, o, run);
  pass.forward(tokens, observe);
  if (run.stats) {
    run.stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.stats->weight_bytes = impl_->bytes;
    run.stats->peak_pass_bytes = pass.tracker().peak;
    run.stats->peak_used_bytes = pass.peak_used();
    run.stats->chunk_rows = pass.chunk_rows();
  }
}

bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

namespace {

// The last Model's weights on the device (the planners call once per calibration sample with the same Model).
std::mutex g_mutex;
const runtime::Model* g_model = nullptr;
const void* g_model_embedding = nullptr;
std::unique_ptr<GradientModel> g_weights;
RegisteredStats g_stats;

// The device weights of `model` (g_mutex held).
const GradientModel& weights_of(const runtime::Model& model) {
  if (g_model != &model || g_model_embedding != model.weights().embedding.bytes || !g_weights) {
    g_weights.reset();
    g_weights = std::make_unique<GradientModel>(model.config(), model.weights());
    g_model = &model;
    g_model_embedding = model.weights().embedding.bytes;
  }
  return *g_weights;
}

GradientResult run_registered(const runtime::Model& model, std::span<const int32_t> tokens,
                              std::span<const Target> targets, const GradientOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  check(gpu_available(), "attention gradients: --device cuda, but no CUDA device is usable");
  weights_of(model);
  DeviceStats st;
  GradientResult r = g_weights->run(tokens, targets, options, {.stats = &st});
  g_stats.add(st);
  return r;
}

}  // namespace

void with_device_weights(const runtime::Model& model, const std::function<void(const GradientModel&)>& fn) {
  std::lock_guard<std::mutex> lock(g_mutex);
  check(gpu_available(), "plan: --device cuda, but no CUDA device is usable");
  const GradientModel& g = weights_of(model);
  const auto t0 = std::chrono::steady_clock::now();
  fn(g);
  PassCosts pass;
  pass.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pass.weight_bytes = g.bytes();
  g_stats.add(pass);
}

void register_minference();  // minference_cuda.cu

void enable() {
  register_cuda_gradients(&run_registered);
  register_minference();
}

void RegisteredStats::add(const PassCosts& pass) {
  ++passes;
  seconds += pass.seconds;
  weight_bytes = pass.weight_bytes;
  peak_pass_bytes = std::max(peak_pass_bytes, pass.peak_pass_bytes);
  peak_used_bytes = std::max(peak_used_bytes, pass.peak_used_bytes);
}

RegisteredStats registered_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_stats;
}

}  // namespace tessera::plan::cuda
