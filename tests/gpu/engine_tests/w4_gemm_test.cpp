// Weight-only 4-bit products on the GPU (runtime/cuda/w4_gemv.h, DeviceW4Weights in device_model.h, GemmPrecision::kW4)
// against their host twins:
//  - the group quantization: the device's codes and group parameters EQUAL quantize_w4_host's bit for bit (rows of
//    other magnitudes, strided rows, an all-zero group, all-positive and all-negative groups, an outlier, subnormal
//    weights), and the dequantized values stay within half a step of the weights (clamping aside);
//  - the product: gemv_w4a16 against the host's f64 product of the bf16 activations and the dequantized weights
//    (w4_value: exact in f32), at every row count 1-8, within f32 summation (2^-14 of the sum of |terms|) and a bf16
//    y's rounding; beta 0 and 1; a row's result bit-equal whatever the row count; the exact errors;
//  - the layers' 4-bit copy: every matrix equal to the host quantization of its bf16 weights, Q, K and V as rows of
//    the stacked matrix, the bytes;
//  - the engine (GpuEngineOptions::gemm = kW4): the prefill stays bf16 (logits equal to the bf16 engine's), a decode
//    step reads the 4-bit copy (near bf16, within kW4DecodeRelL2); the batched engine's W4 decode is in batch_gpu_test.
// Every comparison prints its numbers ("[w4] ...").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/device_buffer.h"
#include "model/model.h"
#include "model/weights.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/fp8_gemv.h"
#include "runtime/cuda/fp8_quant.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/synthetic_config.h"
#include "runtime/cuda/w4_gemv.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

using attn::gpu::DeviceBuffer;

// One decode step's logits, 4-bit weights against bf16, on the 2-layer Llama-3-8B-shaped random model (relative L2).
// 4 bits with 16 levels a group: one rounding is up to half a step, ~(range / 15) / sqrt(12) RMS, about 8% of a
// weight's RMS for Gaussian-like groups of 128, applied to every layer weight; the random model's logits move much
// less (its residual stream is mostly the embedding). 1.5x the worst of 4 steps on the H200 (2026-11-30, the model of
// seed 9: 0.006149; seed 1 gave 0.006019), as engine_gpu_test's bounds are.
constexpr double kW4DecodeRelL2 = 0.0093;

// v in a new device buffer (copied on `stream`).
template <class T>
DeviceBuffer<T> on_device(const std::vector<T>& v, cudaStream_t stream) {
  DeviceBuffer<T> b;
  b.upload(v, stream);
  return b;
}

// Llama-3-8B's shapes cut to two layers (vocab_size and the ffn width too where given), random weights.
std::unique_ptr<DeviceModel> two_layer_llama3(int32_t vocab, int64_t ffn, RandomInit init, ModelConfig& cfg) {
  cfg = synthetic_config("llama3-8b");
  cfg.num_layers = 2;
  cfg.layers.resize(2);
  if (vocab > 0) cfg.vocab_size = vocab;
  if (ffn > 0) cfg.intermediate_size = static_cast<int32_t>(ffn);
  return DeviceModel::random(cfg, 9, init);
}

struct StreamHolder {
  cudaStream_t s = nullptr;
  StreamHolder() { EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess); }
  ~StreamHolder() { cudaStreamDestroy(s); }
};

// [rows, ld] bf16 weights, N(0, 0.02) with rows of other magnitudes and the special groups of the header comment.
std::vector<bf16> test_weights(int64_t rows, int64_t ld, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<bf16> w(static_cast<size_t>(rows * ld));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < ld; ++c) {
      float v = d(rng) * (r % 5 == 0 ? 20.0f : 1.0f);
      const int64_t g = c / kW4Group;
      if (r == 1 && g == 0) v = 0.0f;                   // an all-zero group
      if (r == 2 && g == 0) v = std::fabs(v) + 0.01f;   // all positive
      if (r == 3 && g == 0) v = -std::fabs(v) - 0.01f;  // all negative
      if (r == 4 && c == 5) v = 3.0f;                   // an outlier
      if (r == 6) v *= 1e-38f;                          // subnormal f32 weights
      w[static_cast<size_t>(r * ld + c)] = f32_to_bf16(v);
    }
  return w;
}

struct HostW4 {
  std::vector<uint8_t> codes;
  std::vector<uint32_t> params;
};

HostW4 host_w4(const std::vector<bf16>& w, int64_t ld, int64_t rows, int64_t cols) {
  HostW4 h{std::vector<uint8_t>(static_cast<size_t>(rows * cols / 2)),
           std::vector<uint32_t>(static_cast<size_t>(rows * cols / kW4Group))};
  quantize_w4_host(w.data(), ld, rows, cols, h.codes.data(), h.params.data());
  return h;
}

HostW4 download(const W4Matrix& q) {
  HostW4 h{std::vector<uint8_t>(static_cast<size_t>(q.rows * q.cols / 2)),
           std::vector<uint32_t>(static_cast<size_t>(q.rows * q.cols / kW4Group))};
  EXPECT_EQ(cudaMemcpy(h.codes.data(), q.codes, h.codes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.params.data(), q.params, h.params.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

void expect_equal(const HostW4& host, const HostW4& dev, const std::string& what) {
  ASSERT_EQ(host.codes.size(), dev.codes.size()) << what;
  ASSERT_EQ(host.params.size(), dev.params.size()) << what;
  size_t codes = 0, params = 0;
  for (size_t i = 0; i < host.codes.size(); ++i) codes += host.codes[i] != dev.codes[i];
  for (size_t i = 0; i < host.params.size(); ++i) params += host.params[i] != dev.params[i];
  std::printf("[w4] %s: %zu code bytes, %zu differ; %zu groups, %zu parameters differ\n", what.c_str(),
              host.codes.size(), codes, host.params.size(), params);
  EXPECT_EQ(codes, 0u) << what;
  EXPECT_EQ(params, 0u) << what;
}

TEST(W4Quantize, DeviceEqualsHostBitForBit) {
  REQUIRE_GPU();
  StreamHolder st;
  const int64_t rows = 37, cols = 1024, ld = 1152;  // strided rows
  const std::vector<bf16> w = test_weights(rows, ld, 11);
  const DeviceBuffer<bf16> dw = on_device(w, st.s);
  DeviceBuffer<uint8_t> codes(static_cast<size_t>(rows * cols / 2));
  DeviceBuffer<uint32_t> params(static_cast<size_t>(rows * cols / kW4Group));
  quantize_w4(dw.data(), ld, rows, cols, codes.data(), params.data(), st.s);
  ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
  const HostW4 host = host_w4(w, ld, rows, cols);
  expect_equal(host, download(W4Matrix{codes.data(), params.data(), rows, cols}), "37 x 1024, ld 1152");
  // The all-zero group; every value within half a step of its weight (+ the scale's rounding to bf16 moving the
  // top of the range: 15 steps of up to 2^-8), but in the subnormal row (bf16 scales of few significant bits).
  EXPECT_EQ(host.params[static_cast<size_t>(1 * cols / kW4Group)], 0u) << "an all-zero group: s = 0, z = 0";
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t p = host.params[static_cast<size_t>(r * (cols / kW4Group) + c / kW4Group)];
      const double s = bf16_to_f32(bf16::from_bits(static_cast<uint16_t>(p & 0xFFFF)));
      const double v = w4_value(host.codes.data(), host.params.data(), cols, r, c);
      const double x = bf16_to_f32(w[static_cast<size_t>(r * ld + c)]);
      if (s == 0) {
        EXPECT_EQ(v, 0.0) << r << ", " << c;
        continue;
      }
      if (r == 6) continue;
      const double err = std::fabs(v - x) / s;
      worst = std::max(worst, err);
      EXPECT_LE(err, 0.5 + 15 * std::ldexp(1.0, -8)) << r << ", " << c << ": weight " << x << ", value " << v;
    }
  std::printf("[w4] worst |value - weight| / step %.3f\n", worst);
}

// y = x W^T (+ beta y0) through gemv_w4a16 against the host's f64 product of the dequantized weights; returns y.
std::vector<float> check_gemv(int64_t m, int64_t in, int64_t out, bool y_f32, float beta, uint32_t seed) {
  StreamHolder st;
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> x(static_cast<size_t>(m * in));
  for (auto& v : x) v = f32_to_bf16(d(rng));
  const std::vector<bf16> w = test_weights(out, in, seed + 1);
  const HostW4 hw = host_w4(w, in, out, in);
  const DeviceBuffer<bf16> dx = on_device(x, st.s);
  const DeviceBuffer<uint8_t> codes = on_device(hw.codes, st.s);
  const DeviceBuffer<uint32_t> params = on_device(hw.params, st.s);
  const W4Matrix wq{codes.data(), params.data(), out, in};
  std::mt19937 rng_y(seed + 2);  // y0's first rows the same for every m
  std::vector<float> y0(static_cast<size_t>(m * out));
  for (auto& v : y0) v = d(rng_y);
  const std::vector<float> got = test::product_into_y(y0, y_f32, st.s, [&](void* y) {
    gemv_w4a16(dx.data(), in, m, wq, y, y_f32, out, y_f32 ? beta : 0.0f, st.s);
  });
  std::vector<float> wf(static_cast<size_t>(out * in));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < in; ++k)
      wf[static_cast<size_t>(o * in + k)] = w4_value(hw.codes.data(), hw.params.data(), in, o, k);
  int64_t bad = 0;
  double worst = 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double sum = 0, sum_abs = 0;
      for (int64_t k = 0; k < in; ++k) {
        const double p = static_cast<double>(bf16_to_f32(x[static_cast<size_t>(r * in + k)])) *
                         wf[static_cast<size_t>(o * in + k)];
        sum += p;
        sum_abs += std::fabs(p);
      }
      const size_t i = static_cast<size_t>(r * out + o);
      const double b = y_f32 ? static_cast<double>(beta) * y0[i] : 0.0;
      const double ref = sum + b;
      double tol = std::ldexp(sum_abs + std::fabs(b), -14) + 1e-37;
      if (!y_f32) tol += std::fabs(ref) * std::ldexp(1.0, -8);
      const double err = std::fabs(got[i] - ref);
      worst = std::max(worst, err / std::max(sum_abs, 1e-30));
      if (!(err <= tol) && bad++ < 3)
        ADD_FAILURE() << "y[" << r << ", " << o << "] = " << got[i] << ", host " << ref << " (tolerance " << tol << ")";
    }
  std::printf("[w4] [%lld x %lld] x [%lld x %lld]^T -> %s, beta %g: worst |err| / sum|x w| %.3g\n",
              static_cast<long long>(m), static_cast<long long>(in), static_cast<long long>(out),
              static_cast<long long>(in), y_f32 ? "f32" : "bf16", static_cast<double>(beta), worst);
  EXPECT_EQ(bad, 0);
  return got;
}

TEST(W4Gemv, EqualsHostProductOfTheDequantizedWeights) {
  REQUIRE_GPU();
  for (int64_t m = 1; m <= kW4Rows; ++m) {
    SCOPED_TRACE("rows " + std::to_string(m));
    check_gemv(m, 4096, 1030, true, 1.0f, static_cast<uint32_t>(200 + m));  // the residual's x += a W^T; odd width
    check_gemv(m, 640, 1536, false, 0.0f, static_cast<uint32_t>(300 + m));  // Gemma-3-270m's hidden size
    check_gemv(m, 14336, 72, true, 0.0f, static_cast<uint32_t>(400 + m));   // Llama-3-8B's down projection's in
  }
}

// A row's result does not depend on how many rows the product has (a sequence decodes the same alone or batched).
TEST(W4Gemv, RowsEqualWhateverTheRowCount) {
  REQUIRE_GPU();
  for (const float beta : {0.0f, 1.0f}) {
    const std::vector<float> all = check_gemv(kW4Rows, 2048, 522, true, beta, 500);
    for (int64_t m = 1; m < kW4Rows; ++m) {
      const std::vector<float> some = check_gemv(m, 2048, 522, true, beta, 500);
      for (size_t i = 0; i < some.size(); ++i)
        ASSERT_EQ(some[i], all[i]) << "rows " << m << ", beta " << beta << ", element " << i;
    }
  }
}

TEST(W4Gemv, ExactErrors) {
  REQUIRE_GPU();
  const auto expect_error = [](const std::function<void()>& call, const std::string& message) {
    try {
      call();
      ADD_FAILURE() << "no error for " << message;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  };
  const auto gemv = [](int64_t m, int64_t in, int64_t ldx, bool y_f32, float beta) {
    return [=] { gemv_w4a16(nullptr, ldx, m, W4Matrix{nullptr, nullptr, 4, in}, nullptr, y_f32, 4, beta, nullptr); };
  };
  expect_error(gemv(1, 192, 192, true, 0.0f),
               "gemv_w4a16: in (192) must be a multiple of 128 and ldx (192) of 8, x and the codes 16-byte aligned");
  expect_error(gemv(1, 256, 260, true, 0.0f),
               "gemv_w4a16: in (256) must be a multiple of 128 and ldx (260) of 8, x and the codes 16-byte aligned");
  expect_error(gemv(9, 256, 256, true, 0.0f), "gemv_w4a16: at most 8 rows, got 9");
  expect_error(gemv(1, 256, 256, false, 1.0f), "gemv_w4a16: beta needs an f32 y");
  expect_error([] { quantize_w4(nullptr, 576, 4, 576, nullptr, nullptr, nullptr); },
               "quantize_w4: cols (576) must be a multiple of 128 and ldw (576) at least cols");
  // A model whose widths are not multiples of 128 (SmolLM2-135M's hidden 576; here the hf_tiny SmolLM2 fixture's 64)
  // has no 4-bit copy.
  const auto model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/smollm2");
  const auto dev = DeviceModel::upload(*model);
  expect_error([&] { (void)DeviceW4Weights::quantize(*dev, nullptr); },
               "4-bit weights of " + model->config().name +
                   ": the layers' inputs (hidden 64, q 64, ffn 96) must be multiples of 128");
}

// The layers' 4-bit copy of a 2-layer Llama-3-8B-shaped model (narrowed ffn): each matrix the host quantization of
// its bf16 weights, Q, K and V the stacked matrix's rows, every matrix found by its bf16 weights.
TEST(W4Weights, LayersEqualTheHostQuantization) {
  REQUIRE_GPU();
  ModelConfig cfg;
  const auto dev = two_layer_llama3(512, 1024, RandomInit::kPlain, cfg);
  StreamHolder st;
  const auto w4 = DeviceW4Weights::quantize(*dev, st.s);
  const int64_t H = cfg.hidden_size, F = cfg.intermediate_size, QD = cfg.num_q_heads * cfg.head_dim,
                KD = cfg.num_kv_heads * cfg.head_dim;
  const double elements = cfg.num_layers * static_cast<double>(2 * QD * H + 2 * KD * H + 3 * F * H);
  EXPECT_EQ(static_cast<double>(w4->bytes()), elements / 2 + elements / 32);
  for (int32_t l = 0; l < cfg.num_layers; ++l) {
    const DeviceLayer& L = dev->layer(l);
    const W4Layer& q = w4->layer(l);
    const struct {
      const char* name;
      const bf16* w;
      const W4Matrix& m;
      int64_t rows, cols;
    } mats[] = {{"wqkv", L.wqkv, q.wqkv, QD + 2 * KD, H}, {"wq", L.wq, q.wq, QD, H},
                {"wk", L.wk, q.wk, KD, H},                {"wv", L.wv, q.wv, KD, H},
                {"wo", L.wo, q.wo, H, QD},                {"w_gate_up", L.w_gate_up, q.w_gate_up, 2 * F, H},
                {"w_down", L.w_down, q.w_down, H, F}};
    for (const auto& mt : mats) {
      const std::string what = "layer " + std::to_string(l) + " " + mt.name;
      ASSERT_EQ(mt.m.rows, mt.rows) << what;
      ASSERT_EQ(mt.m.cols, mt.cols) << what;
      const W4Matrix* found = w4->find(mt.w, mt.rows);
      ASSERT_NE(found, nullptr) << what;
      EXPECT_EQ(found->codes, mt.m.codes) << what;
      EXPECT_EQ(found->params, mt.m.params) << what;
      std::vector<bf16> w(static_cast<size_t>(mt.rows * mt.cols));
      ASSERT_EQ(cudaMemcpy(w.data(), mt.w, w.size() * sizeof(bf16), cudaMemcpyDeviceToHost), cudaSuccess);
      expect_equal(host_w4(w, mt.cols, mt.rows, mt.cols), download(mt.m), what);
    }
    EXPECT_EQ(w4->find(L.wq, QD + 1), nullptr);
    EXPECT_EQ(w4->find(dev->embedding(), cfg.vocab_size), nullptr);
  }
}

using test::rel_l2;

// The engine with --gemm w4: the prefill (512 rows) runs the bf16 weights, equal to the bf16 engine's logits; decode
// steps read the 4-bit copy, near bf16; the copy's bytes are in memory().weights_bytes.
TEST(W4Engine, PrefillBf16DecodeNearBf16) {
  REQUIRE_GPU();
  ModelConfig cfg;
  const auto dev = two_layer_llama3(0, 0, RandomInit::kLocalAttention, cfg);
  const std::vector<int32_t> tokens = test::random_tokens(512, cfg.vocab_size, 6, 100);
  GpuEngineOptions o;
  GpuEngine bf(*dev, o);
  o.gemm = GemmPrecision::kW4;
  GpuEngine w4(*dev, o);
  EXPECT_EQ(bf.prefill(tokens), w4.prefill(tokens)) << "the prefill runs bf16 weights in both";
  double worst = 0;
  for (int step = 0; step < 4; ++step) {
    const int32_t t = tokens[static_cast<size_t>(step * 7)];
    const std::vector<float> db = bf.decode(t), dq = w4.decode(t);
    ASSERT_EQ(db.size(), dq.size());
    EXPECT_TRUE(std::all_of(dq.begin(), dq.end(), [](float v) { return std::isfinite(v); }));
    worst = std::max(worst, rel_l2(db, dq));
  }
  const double H = static_cast<double>(cfg.hidden_size), F = static_cast<double>(cfg.intermediate_size);
  const double QD = cfg.num_q_heads * cfg.head_dim, KD = cfg.num_kv_heads * cfg.head_dim;
  const double elements = cfg.num_layers * (2 * QD * H + 2 * KD * H + 3 * F * H);
  std::printf("[w4] llama3-8b shapes, 2 layers: 4 decode steps, w4 vs bf16 worst rel L2 %.4g; 4-bit copy %.1f MB\n",
              worst, static_cast<double>(w4.memory().weights_bytes - bf.memory().weights_bytes) / 1e6);
  EXPECT_LE(worst, kW4DecodeRelL2);
  EXPECT_GT(worst, 0.0) << "the decode step read the 4-bit weights";
  EXPECT_EQ(static_cast<double>(w4.memory().weights_bytes - bf.memory().weights_bytes), elements / 2 + elements / 32);
}

// Issue 35's open question — does the 4-bit decode lose needles on Gemma-3 by its rounding or by a defect? — as a test
// on the real Gemma-3-270M. The engine with --gemm w4 prefills with the bf16 weights and decodes through their 4-bit
// copy, so the like-for-like reference is a model whose bf16 weights are already the 4-bit values (each layer
// matrix's bf16 rows quantized on the host as the device does, quantize_w4_host, then s * (q - z), exact in bf16):
// the w4 engine on that model prefills exactly as the bf16 engine on it, and its decode steps quantize those values
// again. s * (q - z) is not exact in bf16 (an 8-bit scale times a 4-bit integer), so the second quantization moves
// some (on the H200, 2026-11-30: 2,653,816 of 100,270,080, 2.6%; the w4 engine 0.214 from the bf16 engine on the
// same model, 23 of 24 greedy tokens equal): the bound is relative to what the quantizer costs (the 4-bit model
// against the original: 3.39, 14 of 24 greedy tokens) — a quarter of it — which a wrong kernel or wiring (a matrix
// found for the wrong weights, Q/K/V rows of the stacked matrix, an activation) is far past. Printed: prefill and
// decode, in logits and log-probabilities, with the greedy tokens that agree.
TEST(W4Engine, RealGemma3EqualsItsDequantizedWeights) {
  REQUIRE_GPU();
  const std::string path = test::real_model_path("gemma-3-270m-q4_k_m.gguf");
  if (path.empty()) GTEST_SKIP() << "gemma-3-270m-q4_k_m.gguf not present";
  const auto model = Model::load(path);
  const ModelConfig& cfg = model->config();
  ModelWeights four = model->weights();
  int64_t values = 0, moved = 0;  // 4-bit values that a second quantization moves
  auto four_bit_values = [&](const Weight& w) {
    const auto quantize = [&](const std::vector<float>& in, std::vector<float>& out) {
      std::vector<bf16> b(in.size());
      for (size_t i = 0; i < in.size(); ++i) b[i] = f32_to_bf16(in[i]);  // what DeviceModel::upload holds
      std::vector<uint8_t> codes(static_cast<size_t>(w.rows * w.cols / 2));
      std::vector<uint32_t> params(static_cast<size_t>(w.rows * w.cols / kW4Group));
      quantize_w4_host(b.data(), w.cols, w.rows, w.cols, codes.data(), params.data());
      out.resize(in.size());
      for (int64_t r = 0; r < w.rows; ++r)
        for (int64_t c = 0; c < w.cols; ++c)
          out[static_cast<size_t>(r * w.cols + c)] = w4_value(codes.data(), params.data(), w.cols, r, c);
    };
    std::vector<float> v, again;
    quantize(w.to_f32(), v);
    quantize(v, again);
    values += static_cast<int64_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i) moved += v[i] != again[i];
    return Weight::f32(std::move(v), w.rows, w.cols, w.name);
  };
  for (LayerWeights& L : four.layers)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) *w = four_bit_values(*w);
  const auto dev = DeviceModel::upload(*model);
  const auto dev_four = DeviceModel::upload(cfg, four);
  GpuEngineOptions o;
  GpuEngine bf(*dev, o), ref(*dev_four, o);
  o.gemm = GemmPrecision::kW4;
  GpuEngine w4(*dev_four, o), w4_orig(*dev, o);
  const auto log_softmax = [](std::vector<float> v) {
    const float mx = *std::max_element(v.begin(), v.end());
    double sum = 0;
    for (const float x : v) sum += std::exp(static_cast<double>(x - mx));
    const auto lse = static_cast<float>(mx + std::log(sum));
    for (float& x : v) x -= lse;
    return v;
  };
  const auto argmax = [](const std::vector<float>& v) {
    return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
  };
  const std::vector<int32_t> prompt = test::random_tokens(static_cast<int32_t>(kW4Rows), 30000, 35, 100);
  std::vector<float> lw = w4.prefill(prompt), lr = ref.prefill(prompt), lb = bf.prefill(prompt),
                     lo = w4_orig.prefill(prompt);
  EXPECT_EQ(lw, lr) << "the w4 engine prefills with the bf16 weights";
  EXPECT_EQ(lo, lb) << "the w4 engine prefills with the bf16 weights";
  std::printf("[w4] gemma-3-270m: %lld of %lld 4-bit values moved by a second quantization; the 4-bit model's prefill "
              "vs the original's: logits rel L2 %.4g, log-probabilities %.4g, greedy token %s\n",
              static_cast<long long>(moved), static_cast<long long>(values), rel_l2(lb, lr),
              rel_l2(log_softmax(lb), log_softmax(lr)), argmax(lb) == argmax(lr) ? "equal" : "differs");
  double kernel = 0, quantizer = 0, quantizer_lp = 0, w4_vs_bf16 = 0;
  int kernel_equal = 0, quantizer_equal = 0, w4_equal = 0;
  const int steps = 24;
  for (int step = 0; step < steps; ++step) {
    const int32_t next = argmax(lr);  // the 4-bit model's greedy token, fed to all four
    kernel_equal += next == argmax(lw);
    lw = w4.decode(next);
    lr = ref.decode(next);
    lb = bf.decode(next);
    lo = w4_orig.decode(next);
    kernel = std::max(kernel, rel_l2(lr, lw));
    quantizer = std::max(quantizer, rel_l2(lb, lr));
    quantizer_lp = std::max(quantizer_lp, rel_l2(log_softmax(lb), log_softmax(lr)));
    w4_vs_bf16 = std::max(w4_vs_bf16, rel_l2(lb, lo));
    quantizer_equal += argmax(lb) == argmax(lr);
    w4_equal += argmax(lb) == argmax(lo);
  }
  std::printf("[w4] gemma-3-270m, %d-token prompt + %d steps: the w4 engine vs bf16 on the same 4-bit values worst rel "
              "L2 %.4g (greedy equal %d of %d); the quantizer: the 4-bit model vs the original worst rel L2 %.4g "
              "(log-probabilities %.4g, greedy equal %d of %d); the w4 engine on the original weights vs bf16 %.4g "
              "(greedy equal %d of %d)\n",
              static_cast<int>(prompt.size()), steps, kernel, kernel_equal, steps, quantizer, quantizer_lp,
              quantizer_equal, steps, w4_vs_bf16, w4_equal, steps);
  EXPECT_LT(kernel, 0.25 * quantizer) << "the 4-bit path differs from its own dequantized weights by more than a "
                                          "quarter of the quantizer's own error: a defect, not rounding";
  EXPECT_GE(kernel_equal, steps - 2) << "greedy tokens of the 4-bit path against its own dequantized weights";
}

// Not a check: the decode products' time on Llama-3-8B's layer shapes at 1, 2, 4 and 8 rows, 4-bit weight-only beside
// bf16 (cuBLAS) and FP8 weight-only (gemv_w8a16, per-row scales), as the weights' bytes over time. Each time: 50 calls
// captured into one CUDA graph (no launch gaps), replayed after a warm-up; the whole table twice.
TEST(W4Gemv, Llama3ShapesThroughput) {
  REQUIRE_GPU();
  if (!test::env_on("TESSERA_W4_BENCH")) GTEST_SKIP() << "set TESSERA_W4_BENCH=1";
  StreamHolder st;
  Gemm gemm(st.s);
  struct Shape {
    const char* name;
    int64_t out, in;
    bool y_f32;
  };
  const Shape shapes[] = {{"qkv 6144x4096", 6144, 4096, false},
                          {"o 4096x4096 (+= f32)", 4096, 4096, true},
                          {"gate/up 28672x4096", 28672, 4096, false},
                          {"down 4096x14336 (+= f32)", 4096, 14336, true}};
  const int reps = 50;
  cudaEvent_t e0, e1;
  ASSERT_EQ(cudaEventCreate(&e0), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&e1), cudaSuccess);
  const auto time = [&](const std::function<void()>& body) {
    cudaGraphExec_t g = capture_graph(st.s, [&] {
      for (int i = 0; i < reps; ++i) body();
    });
    cudaGraphLaunch(g, st.s);
    cudaEventRecord(e0, st.s);
    cudaGraphLaunch(g, st.s);
    cudaEventRecord(e1, st.s);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaGraphExecDestroy(g);
    return static_cast<double>(ms) / 1e3 / reps;
  };
  std::printf("[w4] us per call (weights' GB/s): bf16 cuBLAS | fp8 weight-only | w4 weight-only\n");
  for (int pass = 1; pass <= 2; ++pass)
    for (const Shape& sh : shapes) {
      std::vector<bf16> w(static_cast<size_t>(sh.out * sh.in));
      std::mt19937 rng(3);
      std::normal_distribution<float> d(0.0f, 0.02f);
      for (auto& v : w) v = f32_to_bf16(d(rng));
      const DeviceBuffer<bf16> dw = on_device(w, st.s);
      const DeviceBuffer<bf16> x = on_device(std::vector<bf16>(static_cast<size_t>(kW4Rows * sh.in), f32_to_bf16(0.5f)), st.s);
      DeviceBuffer<uint8_t> w8(static_cast<size_t>(sh.out * sh.in)), w4c(static_cast<size_t>(sh.out * sh.in / 2));
      DeviceBuffer<float> s8(static_cast<size_t>(sh.out));
      DeviceBuffer<uint32_t> w4p(static_cast<size_t>(sh.out * sh.in / kW4Group));
      quantize_e4m3_rows(dw.data(), sh.in, sh.out, sh.in, w8.data(), s8.data(), st.s);
      quantize_w4(dw.data(), sh.in, sh.out, sh.in, w4c.data(), w4p.data(), st.s);
      const Fp8Matrix q8{w8.data(), s8.data(), sh.out, sh.in, Fp8Scaling::kRow};
      const W4Matrix q4{w4c.data(), w4p.data(), sh.out, sh.in};
      DeviceBuffer<float> y(static_cast<size_t>(kW4Rows * sh.out));
      const float beta = sh.y_f32 ? 1.0f : 0.0f;
      const double e = static_cast<double>(sh.out) * static_cast<double>(sh.in);
      for (const int64_t m : {1, 2, 4, 8}) {
        const double tb = time([&] {
          gemm.linear(x.data(), sh.in, m, dw.data(), sh.out, sh.in, y.data(), sh.y_f32 ? DType::F32 : DType::BF16,
                      sh.out, beta);
        });
        const double t8 = time([&] { gemv_w8a16(x.data(), sh.in, m, q8, y.data(), sh.y_f32, sh.out, beta, st.s); });
        const double t4 = time([&] { gemv_w4a16(x.data(), sh.in, m, q4, y.data(), sh.y_f32, sh.out, beta, st.s); });
        std::printf("[w4] pass %d %-26s m %lld: bf16 %6.1f (%5.0f) | fp8 %6.1f (%5.0f) | w4 %6.1f (%5.0f)\n", pass,
                    sh.name, static_cast<long long>(m), tb * 1e6, 2 * e / tb / 1e9, t8 * 1e6, (e + 4.0 * sh.out) / t8 / 1e9,
                    t4 * 1e6, (e / 2 + e / 32) / t4 / 1e9);
      }
    }
  std::fflush(stdout);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace
}  // namespace tessera::runtime::gpu
