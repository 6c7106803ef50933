// eval/attention_stats: per-head recall, output error and density of a policy on given activations, checked
// against independent computations (the per-cell pattern definition, f64 softmax sums, the masked reference).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/reference.h"
#include "attention/index/lower.h"
#include "core/error.h"
#include "eval/attention_stats.h"

namespace tessera::eval {
namespace {

struct Layer {
  int q_len, kv_len, nq, nkv, d;
  std::vector<float> q, k, v, out;
  attn::AttentionArgs args;

  Layer(int q_len_, int kv_len_, int nq_, int nkv_, int d_, int window, uint64_t seed)
      : q_len(q_len_), kv_len(kv_len_), nq(nq_), nkv(nkv_), d(d_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.f, 1.f);
    q.resize(static_cast<size_t>(q_len) * nq * d);
    k.resize(static_cast<size_t>(kv_len) * nkv * d);
    v.resize(k.size());
    out.resize(q.size());
    for (auto* buf : {&q, &k, &v})
      for (float& x : *buf) x = 1.5f * n(rng);
    args.q = TensorView(q.data(), DType::F32, {q_len, nq, d});
    args.k = TensorView(k.data(), DType::F32, {kv_len, nkv, d});
    args.v = TensorView(v.data(), DType::F32, {kv_len, nkv, d});
    args.out = TensorView(out.data(), DType::F32, {q_len, nq, d});
    args.q_begin = kv_len - q_len;
    args.window = window;
    attn::reference_attention_causal(args);  // the dense output, as the engine's observer would see it
  }
};

// Visible to dense attention at absolute position p: causal and within the window.
bool dense_visible(int p, int key, int window) { return key <= p && (window == 0 || p - key < window); }

void check_against_definitions(const Layer& L, const std::vector<attn::Pattern>& patterns, int total_len) {
  const int tile = 64;
  const LayerAttentionStats got = measure_layer(3, patterns, L.args, total_len, tile);
  ASSERT_EQ(got.layer, 3);
  ASSERT_EQ(got.rows, L.q_len);
  ASSERT_EQ(got.heads.size(), patterns.size());
  const attn::LoweringContext ctx{L.args.q_begin, L.q_len, L.kv_len, std::max(total_len, L.kv_len), tile};
  const double scale = 1.0 / std::sqrt(static_cast<double>(L.d));
  std::vector<std::vector<uint8_t>> masks;
  for (const attn::Pattern& p : patterns) masks.push_back(attn::pattern_mask(p, std::monostate{}, ctx));
  // The sparse output from the f64 reference under the per-cell masks, and the dense one in f64.
  std::vector<double> sparse64, dense64;
  std::vector<float> scratch(L.out.size());
  attn::AttentionArgs a = L.args;
  a.out = TensorView(scratch.data(), DType::F32, {L.q_len, L.nq, L.d});
  attn::reference_attention_masked(
      a, [&](int h, int row, int key) { return masks[static_cast<size_t>(h)][static_cast<size_t>(row) * L.kv_len + key] != 0; },
      &sparse64);
  attn::reference_attention_causal(a, &dense64);
  for (int h = 0; h < L.nq; ++h) {
    const int g = h / (L.nq / L.nkv);
    double recall_sum = 0;
    int64_t kept = 0, all = 0;
    for (int r = 0; r < L.q_len; ++r) {
      const int p = L.args.q_begin + r;
      double total = 0, in_mask = 0;
      for (int key = 0; key < L.kv_len; ++key) {
        if (!dense_visible(p, key, L.args.window)) continue;
        double dot = 0;
        for (int i = 0; i < L.d; ++i)
          dot += static_cast<double>(L.q[(static_cast<size_t>(r) * L.nq + h) * L.d + i]) *
                 L.k[(static_cast<size_t>(key) * L.nkv + g) * L.d + i];
        const double w = std::exp(scale * dot);
        total += w;
        ++all;
        if (masks[static_cast<size_t>(h)][static_cast<size_t>(r) * L.kv_len + key]) {
          in_mask += w;
          ++kept;
        }
      }
      recall_sum += in_mask / total;
    }
    double num = 0, den = 0;
    for (int r = 0; r < L.q_len; ++r)
      for (int i = 0; i < L.d; ++i) {
        const size_t at = (static_cast<size_t>(r) * L.nq + h) * L.d + i;
        num += (sparse64[at] - dense64[at]) * (sparse64[at] - dense64[at]);
        den += dense64[at] * dense64[at];
      }
    const HeadAttentionStats& s = got.heads[static_cast<size_t>(h)];
    EXPECT_NEAR(s.recall, recall_sum / L.q_len, 1e-9) << "head " << h;
    EXPECT_NEAR(s.rel_error, std::sqrt(num / den), 2e-5) << "head " << h;
    EXPECT_DOUBLE_EQ(s.density, static_cast<double>(kept) / static_cast<double>(all)) << "head " << h;
  }
}

TEST(AttentionStats, StaticPatternsMatchTheirDefinitions) {
  const Layer L(200, 200, 4, 2, 32, 0, 1);
  check_against_definitions(L,
                            {attn::AShapePattern{8, 64}, attn::TrianglePattern{4, 64, 32}, attn::DensePattern{},
                             attn::ElasticWindowPattern{16, 0.25, 4}},
                            200);
}

TEST(AttentionStats, ChunkWithQueriesAfterEarlierKeys) {
  const Layer L(100, 230, 4, 1, 16, 0, 2);  // q_begin = 130: a later prefill chunk
  check_against_definitions(L,
                            {attn::AShapePattern{4, 64}, attn::AShapePattern{0, 128}, attn::TrianglePattern{8, 64, 64},
                             attn::ElasticWindowPattern{0, 0.5, 0}},
                            400);
}

TEST(AttentionStats, DensityCountsOnlyTheModelsWindow) {
  const Layer L(150, 150, 2, 2, 16, 40, 3);  // a sliding-window layer (Gemma-3 local, Mistral)
  check_against_definitions(L, {attn::AShapePattern{4, 64}, attn::TrianglePattern{4, 64, 16}}, 150);
}

TEST(AttentionStats, DenseLayerKeepsEverything) {
  const Layer L(70, 70, 2, 1, 8, 0, 4);
  const LayerAttentionStats s = measure_layer(0, {attn::DensePattern{}, attn::DensePattern{}}, L.args, 70, 64);
  EXPECT_EQ(s.rows, 70);
  ASSERT_EQ(s.heads.size(), 2u);
  for (const HeadAttentionStats& h : s.heads) EXPECT_EQ(h, (HeadAttentionStats{1, 0, 1}));
}

TEST(AttentionStats, PatternCountMustMatchHeads) {
  const Layer L(64, 64, 2, 1, 8, 0, 5);
  try {
    measure_layer(0, {attn::DensePattern{}}, L.args, 64, 64);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention stats: 1 patterns for a layer of 2 query heads");
  }
}

TEST(AttentionStats, MarkdownAndJson) {
  LayerAttentionStats a{0, 10, {{1.0, 0.0, 1.0}, {0.5, 0.25, 0.5}}};
  LayerAttentionStats b{1, 10, {{0.9, 0.1, 0.2}, {0.7, 0.3, 0.4}}};
  EXPECT_EQ(layer_stats_markdown({a, b}),
            "| layer | recall | rel. error | density |\n|---:|---:|---:|---:|\n"
            "| 0 | 0.7500 | 0.1250 | 0.750 |\n"
            "| 1 | 0.8000 | 0.2000 | 0.300 |\n"
            "| **mean** | **0.7750** | **0.1625** | **0.525** |\n");
  const nlohmann::json j = layer_stats_to_json({a});
  EXPECT_EQ(j.dump(), R"([{"heads":[{"density":1.0,"recall":1.0,"rel_error":0.0},{"density":0.5,"recall":0.5,"rel_error":0.25}],"layer":0,"rows":10}])");
}

}  // namespace
}  // namespace tessera::eval
