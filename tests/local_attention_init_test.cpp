// DeviceModel::random(..., RandomInit::kLocalAttention) on the CPU: the designed Q/K columns and embedding
// values of runtime/cuda/local_attention_init.h (what device_model.cpp writes into the device weights), with
// the rest of the weights uniform random as on the device, through the first layer's RMSNorm, projections
// (bf16 as on the GPU) and the CPU runtime's RoPE, into the CPU VS estimator and lowering: the estimator must
// pick (nearly) the diagonals nearest the diagonal, the sink token's key must score about gain * 38 logits,
// ordinary keys about gain * 32 near the query and less far away. Reduced width (hidden 1024, 8 query / 2 KV
// heads of 128; Llama-3.1's RoPE), 32K tokens (128K with TESSERA_LOCAL_INIT_128K=1). The later layers (the
// residual stream's own updates) are simulated by bench/gpu/local_weights_sim.py.
#include "runtime/cuda/local_attention_init.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "model/model_config.h"
#include "runtime/rope.h"

namespace tessera::runtime::gpu {
namespace {

namespace li = local_init;

constexpr int kH = 1024, kNq = 8, kNkv = 2, kD = 128;

ModelConfig reduced_llama31() {
  ModelConfig c;
  c.name = "reduced llama3.1";
  c.vocab_size = 32000;
  c.hidden_size = kH;
  c.intermediate_size = 3584;
  c.num_layers = 1;
  c.num_q_heads = kNq;
  c.num_kv_heads = kNkv;
  c.head_dim = kD;
  c.context_length = 131072;
  LayerConfig layer;
  layer.rope.theta = 500000.0;
  layer.rope.scaling = RopeScaling::Llama3;
  layer.rope.factor = 8.0;
  c.layers.assign(1, layer);
  return c;
}

float round_bf16(float x) {
  return bf16_to_f32(f32_to_bf16(x));
}

// Rows [first, first + n) of a weight matrix [rows, kH]: uniform (as the device's plain fill) with standard
// deviation 0.02 * sqrt(4096 / kH), so that q and k carry the noise they carry at Llama-3-8B's width (0.02
// with fan-in 4096), then the recipe's special columns.
std::vector<float> weight_rows(std::mt19937& rng, int64_t first, int64_t n,
                               const std::vector<float>& massive_col, const std::vector<float>& sink_col) {
  const float a = 0.02f * std::sqrt(3.0f * 4096.0f / kH);
  std::uniform_real_distribution<float> u(-a, a);
  std::vector<float> w(static_cast<size_t>(n * kH));
  for (float& v : w) v = round_bf16(u(rng));
  const li::Channels ch = li::channels(kH);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j : ch.massive)
      w[static_cast<size_t>(r * kH + j)] = round_bf16(massive_col[static_cast<size_t>(first + r)]);
    for (int64_t j : ch.sink)
      w[static_cast<size_t>(r * kH + j)] = round_bf16(sink_col[static_cast<size_t>(first + r)]);
  }
  return w;
}

void check_first_layer(const int seq) {
  const ModelConfig c = reduced_llama31();
  const uint64_t seed = 1;
  const li::LayerColumns cols = li::layer_columns(c, 0, seed);
  const std::vector<float> zeros(cols.q_massive.size(), 0.0f);
  const li::Channels ch = li::channels(kH);
  const float massive = round_bf16(static_cast<float>(li::massive_value(kH)));

  // The normed hidden state h (bf16) of every position: position 0 the sink token, the others random tokens.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> tok(-static_cast<float>(li::kTokenStd * std::sqrt(3.0)),
                                            static_cast<float>(li::kTokenStd * std::sqrt(3.0)));
  std::vector<float> h(static_cast<size_t>(seq) * kH);
  std::vector<float> x(kH);
  for (int64_t t = 0; t < seq; ++t) {
    if (t == 0) {
      std::fill(x.begin(), x.end(), 0.0f);
      for (int64_t j : ch.sink) x[static_cast<size_t>(j)] = massive;
    } else {
      for (float& v : x) v = round_bf16(tok(rng));
      for (int64_t j : ch.massive) x[static_cast<size_t>(j)] = massive;
      for (int64_t j : ch.sink) x[static_cast<size_t>(j)] = 0.0f;
    }
    double ss = 0;
    for (float v : x) ss += double{v} * v;
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / kH) + c.rms_norm_eps);
    for (int64_t j = 0; j < kH; ++j)
      h[static_cast<size_t>(t * kH + j)] = round_bf16(x[static_cast<size_t>(j)] * inv);
  }
  EXPECT_NEAR(h[static_cast<size_t>(kH + ch.massive[0])], li::normed_massive(kH),
              0.05 * li::normed_massive(kH));
  EXPECT_NEAR(h[static_cast<size_t>(ch.sink[0])], li::normed_sink(kH), 1e-2 * li::normed_sink(kH));

  const std::vector<float> inv_freq = rope_inv_freq(c.layers[0].rope, kD, {});
  const attn::VerticalSlashPattern vs{1000, 6096, 64, 30, 100};
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(seq, 128);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  for (int q_head : {0, 5}) {
    const int kv_head = q_head / (kNq / kNkv);
    const std::vector<float> wq = weight_rows(rng, int64_t{q_head} * kD, kD, cols.q_massive, zeros);
    const std::vector<float> wk = weight_rows(rng, int64_t{kv_head} * kD, kD, cols.k_massive, cols.k_sink);
    // k for every position, q for the last 64 (the estimator reads no other), RoPE'd as the runtime does.
    const int rows = vs.last_q;
    std::vector<float> k(static_cast<size_t>(seq) * kD), q(static_cast<size_t>(seq) * kD, 0.0f);
    for (int64_t t = 0; t < seq; ++t) {
      const float* ht = h.data() + t * kH;
      for (int64_t r = 0; r < kD; ++r) {
        const float* wr = wk.data() + r * kH;
        float acc = 0;
        for (int64_t j = 0; j < kH; ++j) acc += wr[j] * ht[j];
        k[static_cast<size_t>(t * kD + r)] = acc;
        if (t >= seq - rows) {
          const float* qr = wq.data() + r * kH;
          float qa = 0;
          for (int64_t j = 0; j < kH; ++j) qa += qr[j] * ht[j];
          q[static_cast<size_t>(t * kD + r)] = qa;
        }
      }
    }
    std::vector<float> cs(static_cast<size_t>(seq) * (kD / 2)), sn(cs.size());
    rope_tables(inv_freq, 0, seq, cs.data(), sn.data());
    apply_rope(k.data(), seq, kD, 1, kD, cs.data(), sn.data());
    apply_rope(q.data(), seq, kD, 1, kD, cs.data(), sn.data());
    std::vector<bf16> kb(k.size()), qb(q.size());
    for (size_t i = 0; i < k.size(); ++i) kb[i] = f32_to_bf16(k[i]);
    for (size_t i = 0; i < q.size(); ++i) qb[i] = f32_to_bf16(q[i]);
    const TensorView qv(qb.data(), DType::BF16, {seq, 1, kD}), kv(kb.data(), DType::BF16, {seq, 1, kD});

    // Mean scores of the last 64 queries: against the sink key, the 200 keys before each query, the 1000 keys
    // around 16K before it.
    auto score = [&](int64_t query, int64_t key) {
      double s = 0;
      for (int64_t r = 0; r < kD; ++r)
        s += double{bf16_to_f32(qb[static_cast<size_t>(query * kD + r)])} *
             bf16_to_f32(kb[static_cast<size_t>(key * kD + r)]);
      return s * scale;
    };
    double sink = 0, near = 0, far = 0;
    for (int64_t p = seq - rows; p < seq; ++p) {
      sink += score(p, 0) / rows;
      for (int64_t key = p - 200; key < p; ++key) near += score(p, key) / (200.0 * rows);
      for (int64_t key = p - 16384 - 500; key < p - 16384 + 500; ++key)
        far += score(p, key) / (1000.0 * rows);
    }
    const double gain = li::head_gain(seed, 0, q_head);
    std::printf(
        "[ local init ] seq %d head %d (gain %.3f): mean scores of the last 64 queries: sink %.2f, nearest "
        "200 keys "
        "%.2f, around 16K away %.2f (shared part alone: %.1f, %.1f, %.1f)\n",
        seq, q_head, gain, sink, near, far, gain * li::kSinkLogits, gain * li::kDecayLogits,
        gain * li::kDecayLogits * 0.44);
    EXPECT_NEAR(sink, gain * li::kSinkLogits, 2.0);
    EXPECT_NEAR(near, gain * li::kDecayLogits, 2.0);
    EXPECT_NEAR(far, gain * li::kDecayLogits * 0.44, 2.0);

    const attn::VerticalSlashEstimate est = attn::estimate_vertical_slash(vs, qv, kv, 0, 0, ctx, scale);
    const double density = attn::index_stats(attn::lower_layer({vs}, {est}, ctx)).density();
    attn::VerticalSlashEstimate nearest = est;
    nearest.offsets.resize(static_cast<size_t>(vs.slash));
    std::iota(nearest.offsets.begin(), nearest.offsets.end(), 0);
    const double nearest_density = attn::index_stats(attn::lower_layer({vs}, {nearest}, ctx)).density();
    int far_offsets = 0;
    for (int32_t o : est.offsets) far_offsets += o >= vs.slash * 5 / 4 && o < seq - 100;
    std::printf(
        "[ local init ] seq %d head %d: VS density %.4f (nearest 6096 diagonals %.4f, ratio %.3f), %d "
        "offsets in "
        "[7620, S - 100) (the sink's diagonals lie beyond)\n",
        seq, q_head, density, nearest_density, density / nearest_density, far_offsets);
    std::fflush(stdout);
    EXPECT_LE(density, 1.3 * nearest_density) << "head " << q_head;
  }
}

TEST(LocalAttentionInit, FirstLayerIsLocalWithASink32K) {
  check_first_layer(32768);
}

TEST(LocalAttentionInit, FirstLayerIsLocalWithASink128K) {
  const char* env = std::getenv("TESSERA_LOCAL_INIT_128K");
  if (env == nullptr || std::string(env) != "1")
    GTEST_SKIP() << "set TESSERA_LOCAL_INIT_128K=1 (about a minute)";
  check_first_layer(131072);
}

}  // namespace
}  // namespace tessera::runtime::gpu
