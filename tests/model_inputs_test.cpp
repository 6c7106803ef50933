// The CPU twin of attention_gpu_bench --inputs model (bench/gpu/model_inputs.h): the same q/k values, the CPU
// VS estimator (MInference Alg. 2 on the last 64 queries) and lowering to 128-row tiles, and the density of
// the index it gives, against the index of the 6096 diagonals nearest the diagonal (with the same columns).
// The inputs are built so that their scores fall with distance as a real model's local heads do; this test
// checks that the estimator then picks (nearly) the nearest diagonals, i.e. that the GPU bench measures VS at
// a realistic density.
//
// 32K (two heads) and 128K (one head; two with TESSERA_MODEL_INPUTS_128K=1), about 5 s on two cores.
// Densities are printed: "[ model inputs ] seq S head h: vs D (nearest N, ratio R) ...".
#include "../bench/gpu/model_inputs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "runtime/rope.h"

namespace tessera::bench {
namespace {

constexpr int kD = 128, kHq = 32, kHkv = 8, kTile = 128;

struct Densities {
  double vs = 0, nearest = 0, ideal = 0, bs = 0;
  int32_t max_offset = 0;  // largest chosen diagonal offset below seq - 100
  int far_offsets = 0;     // chosen offsets in [1.25 * slash budget, seq - 100)
  int sink_offsets = 0;    // chosen offsets >= seq - 100: the diagonals through the sink keys
  int recent_columns = 0;  // chosen columns among the last 8192 keys
  int sink_columns = 0;    // chosen columns below sink_keys
};

// One query head's q (only the last `rows` positions are filled; the estimator reads no other) and its kv
// head's k, as the GPU bench fills them (seeds 1 and 2), rounded to bf16 as on the device.
void fill(const ModelInputs& m, int seq, int q_head, int rows, std::vector<bf16>& q, std::vector<bf16>& k) {
  const int kvh = q_head / (kHq / kHkv), half = kD / 2;
  q.assign(static_cast<size_t>(seq) * kD, bf16{});
  k.assign(static_cast<size_t>(seq) * kD, bf16{});
  float v[2];
  for (int64_t t = 0; t < seq; ++t) {
    for (int i = 0; i < half; ++i) {
      model_input_pair(m, true, t, kHkv, kvh, kvh, i, 2, v);
      k[static_cast<size_t>(t * kD + i)] = f32_to_bf16(v[0]);
      k[static_cast<size_t>(t * kD + i + half)] = f32_to_bf16(v[1]);
      if (t >= seq - rows) {
        model_input_pair(m, false, t, kHq, q_head, kvh, i, 1, v);
        q[static_cast<size_t>(t * kD + i)] = f32_to_bf16(v[0]);
        q[static_cast<size_t>(t * kD + i + half)] = f32_to_bf16(v[1]);
      }
    }
  }
}

Densities measure(const ModelInputs& m, int seq, int q_head, bool with_bs) {
  const attn::VerticalSlashPattern vs{1000, 6096, 64, 30, 100};
  std::vector<bf16> q, k;
  fill(m, seq, q_head, with_bs ? seq : vs.last_q, q, k);
  const TensorView qv(q.data(), DType::BF16, {seq, 1, kD}), kv(k.data(), DType::BF16, {seq, 1, kD});
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(seq, kTile);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  const attn::VerticalSlashEstimate est = attn::estimate_vertical_slash(vs, qv, kv, 0, 0, ctx, scale);
  Densities d;
  d.vs = attn::index_stats(attn::lower_layer({vs}, {est}, ctx)).density();
  attn::VerticalSlashEstimate nearest = est;
  nearest.offsets.resize(static_cast<size_t>(std::min(vs.slash, seq)));
  std::iota(nearest.offsets.begin(), nearest.offsets.end(), 0);
  d.nearest = attn::index_stats(attn::lower_layer({vs}, {nearest}, ctx)).density();
  attn::VerticalSlashEstimate ideal = nearest;  // nearest diagonals, the first 1000 columns
  ideal.columns.resize(static_cast<size_t>(std::min(vs.vertical, seq)));
  std::iota(ideal.columns.begin(), ideal.columns.end(), 0);
  d.ideal = attn::index_stats(attn::lower_layer({vs}, {ideal}, ctx)).density();
  for (int32_t o : est.offsets) {
    if (o >= seq - 100) {
      ++d.sink_offsets;
      continue;
    }
    d.max_offset = std::max(d.max_offset, o);
    d.far_offsets += o >= vs.slash * 5 / 4;
  }
  for (int32_t c : est.columns) {
    d.recent_columns += c >= seq - 8192;
    d.sink_columns += c < m.sink_keys;
  }
  if (with_bs) {
    const attn::BlockSparsePattern bs{100, 64};
    const attn::BlockSparseEstimate be = attn::estimate_block_sparse(bs, qv, kv, 0, 0, ctx, scale);
    d.bs = attn::index_stats(attn::lower_layer({bs}, {be}, ctx)).density();
  }
  std::printf(
      "[ model inputs ] seq %6d head %2d: vs %.4f (nearest 6096 diagonals %.4f, ratio %.3f; nearest + first "
      "1000 columns %.4f), offsets: max %d below S - 100, %d in [7620, S - 100), %d through the sink; "
      "columns: %d recent (last 8192), %d sink",
      seq, q_head, d.vs, d.nearest, d.vs / d.nearest, d.ideal, d.max_offset, d.far_offsets, d.sink_offsets,
      d.recent_columns, d.sink_columns);
  if (with_bs) std::printf("; bs %.4f", d.bs);
  std::printf("\n");
  std::fflush(stdout);
  return d;
}

TEST(ModelInputs, RopeIsLlama31) {
  runtime::RopeConfig rope;
  rope.theta = 500000.0;
  rope.scaling = runtime::RopeScaling::Llama3;
  rope.factor = 8.0;
  EXPECT_EQ(llama31_inv_freq(kD), runtime::rope_inv_freq(rope, kD, {}));
}

TEST(ModelInputs, ScoresFallWithDistance) {
  // The shared part alone (no noise, no sink), one head: the mean score of the diagonal at distance x is
  // above every diagonal beyond 1.5 x, for x in [565, 30K] (the property local_attention_spectrum.h states).
  const ModelInputs m = make_model_inputs(kD, 32.0f, 0.0f, 0.0f, 0);
  const int seq = 131072;
  std::vector<double> h(static_cast<size_t>(seq));
  for (int x = 0; x < seq; ++x) {
    double s = 0;
    for (int i = 0; i < m.half; ++i) s += double{m.amp[i]} * m.amp[i] * std::cos(x * double{m.inv_freq[i]});
    h[static_cast<size_t>(x)] = s / std::sqrt(double{kD});
  }
  EXPECT_NEAR(h[0], 32.0, 1e-3);
  std::vector<double> suffix_max(h);
  for (int x = seq - 2; x >= 0; --x)
    suffix_max[static_cast<size_t>(x)] =
        std::max(h[static_cast<size_t>(x)], suffix_max[static_cast<size_t>(x) + 1]);
  double prefix_min = h[0];
  for (int x = 1; x <= 30000; ++x) {
    prefix_min = std::min(prefix_min, h[static_cast<size_t>(x)]);
    if (x < 565) continue;
    EXPECT_GT(prefix_min - suffix_max[static_cast<size_t>(std::ceil(1.5 * x))], 0.4) << "distance " << x;
  }
}

TEST(ModelInputs, VsPicksNearestDiagonals32K) {
  const ModelInputs m = make_model_inputs(kD);
  for (int head : {0, 13}) {
    const Densities d = measure(m, 32768, head, head == 0);
    EXPECT_LE(d.vs, 1.3 * d.nearest) << "head " << head;
    EXPECT_GE(d.sink_columns, m.sink_keys) << "head " << head;
  }
}

TEST(ModelInputs, VsPicksNearestDiagonals128K) {
  const ModelInputs m = make_model_inputs(kD);
  const char* env = std::getenv("TESSERA_MODEL_INPUTS_128K");
  const bool both = env != nullptr && std::string(env) == "1";
  for (int head : both ? std::vector<int>{0, 13} : std::vector<int>{0}) {
    const Densities d = measure(m, 131072, head, head == 0);
    EXPECT_LE(d.vs, 1.3 * d.nearest) << "head " << head;
  }
}

}  // namespace
}  // namespace tessera::bench
