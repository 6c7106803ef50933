// tessera/plan/cuda/gradient_model.cu — GradientModel's f32 device weights (from a Model, or random at real shapes
// for benchmarks) and the path registered with the planners (plan::register_cuda_gradients): one Model's weights
// kept on the device across the calibration samples. The pass itself is gradients_cuda.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "plan/cuda/gradient_weights.h"
#include "plan/cuda/gradients_cuda.h"
#include "runtime/cuda/kernels.h"

namespace tessera::plan::cuda {

using runtime::ModelConfig;

namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

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

constexpr int kThreads = 256;

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
  if (amp == 0.0f) {
    runtime::gpu::fill_f32(d.buf.get(), n, 1.0f, nullptr);
  } else {
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8));
    random_kernel<<<blocks, kThreads>>>(d.buf.get(), n, seed, amp);
    attn::gpu::check_launch("random weights");
  }
  bytes += sz(n) * sizeof(float);
}

}  // namespace

GradientModel::GradientModel() : impl_(std::make_unique<Impl>()) {}
GradientModel::~GradientModel() = default;
const ModelConfig& GradientModel::config() const { return impl_->cfg; }
size_t GradientModel::bytes() const { return impl_->bytes; }

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
