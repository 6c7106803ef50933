// The CPU twin of tensor parallelism (parallel/tp_forward_cpu.h) against the single-rank forward
// (runtime/forward.h) on the tiny Hugging Face fixtures: N virtual ranks whose all-reduce is a sum give the
// same logits whatever the placement (uniform, greedy, KV groups split over ranks, a rank without heads),
// dense and sparse policies, chunked prefill; and the batched engine over the sharded backend (the twin of
// `serve --gpus N --parallel M`) generates the one-rank batched engine's tokens, paged and streamed.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "core/error.h"
#include "parallel/placement.h"
#include "parallel/shard.h"
#include "parallel/tp_forward_cpu.h"
#include "runtime/batch_engine.h"
#include "runtime/forward.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "stream_sizes.h"
#include "test_support.h"

using namespace tessera;
using namespace tessera::parallel;

namespace {

using namespace tessera::test;

std::vector<int32_t> prompt(int32_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 37 + 11) % vocab;
  return t;
}

// Single-rank logits of every token, in chunks of `chunk`.
std::vector<float> reference(const runtime::Model& m, const std::vector<int32_t>& tokens, int32_t chunk,
                             const attn::AttentionPolicy* policy) {
  const runtime::ModelConfig& c = m.config();
  runtime::KVCache cache(c.num_layers, c.num_kv_heads, c.head_dim, static_cast<int32_t>(tokens.size()));
  cache.reserve(static_cast<int32_t>(tokens.size()));
  runtime::Forward f(m, ThreadPool::global());
  runtime::ForwardTimers timers;
  std::vector<float> all;
  for (size_t p = 0; p < tokens.size(); p += static_cast<size_t>(chunk)) {
    const size_t e = std::min(tokens.size(), p + static_cast<size_t>(chunk));
    std::vector<float> l = f.run(std::span(tokens).subspan(p, e - p), static_cast<int32_t>(p), cache, policy,
                                 static_cast<int32_t>(tokens.size()), runtime::LogitRows::All, timers);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

std::vector<float> tensor_parallel(const runtime::Model& m, const Placement& p,
                                   const std::vector<int32_t>& tokens, int32_t chunk,
                                   const attn::AttentionPolicy* policy) {
  TpForwardCpu tp(m, p, static_cast<int32_t>(tokens.size()), ThreadPool::global());
  std::vector<float> all;
  for (size_t s = 0; s < tokens.size(); s += static_cast<size_t>(chunk)) {
    const size_t e = std::min(tokens.size(), s + static_cast<size_t>(chunk));
    std::vector<float> l = tp.run(std::span(tokens).subspan(s, e - s), static_cast<int32_t>(s), policy,
                                  static_cast<int32_t>(tokens.size()), false);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

Placement custom(const runtime::ModelConfig& c, int32_t gpus, std::vector<std::vector<int32_t>> layers) {
  Placement p;
  p.num_gpus = gpus;
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.method = "custom";
  p.gpu_of_head = std::move(layers);
  return p;
}

// Cost model with made-up per-head costs (a heavy head per layer), for greedy / genetic placements.
CostModel skewed_costs(const runtime::ModelConfig& c) {
  CostModel m;
  m.num_q_heads = c.num_q_heads;
  m.num_kv_heads = c.num_kv_heads;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    LayerCosts lc;
    for (int32_t h = 0; h < c.num_q_heads; ++h) lc.attn.push_back(h == l % c.num_q_heads ? 10.0 : 1.0 + h);
    lc.qo = 0.1;
    lc.kv = 0.2;
    m.layers.push_back(lc);
  }
  return m;
}

constexpr float kTol = 2e-4f;

}  // namespace

TEST(TensorParallelCpu, EqualsSingleRankForEveryPlacement) {
  for (const char* name : {"llama3", "qwen2", "gemma3", "mistral", "smollm2"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    const std::vector<int32_t> tokens = prompt(40, c.vocab_size);
    const std::vector<float> ref = reference(m, tokens, 64, nullptr);
    std::vector<Placement> placements;
    placements.push_back(place(skewed_costs(c), 2, PlacementMethod::kUniform));
    placements.push_back(place(skewed_costs(c), 2, PlacementMethod::kGreedy));
    placements.push_back(place(skewed_costs(c), 3, PlacementMethod::kGenetic));
    placements.push_back(
        place(skewed_costs(c), c.num_q_heads, PlacementMethod::kUniform));  // a head per rank
    // Every head on rank 1 in layer 0 (rank 0 holds none), reversed split in the other layers.
    std::vector<std::vector<int32_t>> layers(static_cast<size_t>(c.num_layers));
    for (int32_t l = 0; l < c.num_layers; ++l)
      for (int32_t h = 0; h < c.num_q_heads; ++h)
        layers[static_cast<size_t>(l)].push_back(l == 0 ? 1 : (h % 2 == 0 ? 1 : 0));
    placements.push_back(custom(c, 2, layers));
    for (const Placement& p : placements) {
      const std::vector<float> got = tensor_parallel(m, p, tokens, 64, nullptr);
      EXPECT_LT(max_abs_diff(got, ref), kTol) << name << ", " << p.method << " on " << p.num_gpus << " ranks";
    }
    // The same in chunks (KV caches local to each rank, rows appended across calls).
    const std::vector<float> chunked = tensor_parallel(m, placements[2], tokens, 16, nullptr);
    EXPECT_LT(max_abs_diff(chunked, reference(m, tokens, 16, nullptr)), kTol) << name << " chunked";
  }
}

TEST(TensorParallelCpu, SparsePolicyPlacementChangesNoOutput) {
  const runtime::Model& m = fixture("llama3");
  const runtime::ModelConfig& c = m.config();
  const std::vector<int32_t> tokens = prompt(200, c.vocab_size);
  attn::AttentionPolicy policy =
      attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 32});
  attn::VerticalSlashPattern vs;
  vs.vertical = 12;
  vs.slash = 24;
  vs.last_q = 16;
  vs.forced_columns = 2;
  vs.forced_diagonals = 4;
  policy.at(0, 1) = vs;
  policy.at(1, 2) = vs;
  policy.at(1, 3) = attn::BlockSparsePattern{2, 64};
  policy.at(0, 3) = attn::DensePattern{};
  const std::vector<float> ref = reference(m, tokens, 256, &policy);
  for (PlacementMethod method :
       {PlacementMethod::kUniform, PlacementMethod::kGreedy, PlacementMethod::kGenetic}) {
    const Placement p = place(flop_costs(policy, 200, c.hidden_size, c.head_dim), 2, method);
    EXPECT_LT(max_abs_diff(tensor_parallel(m, p, tokens, 256, &policy), ref), kTol)
        << placement_method_name(method);
  }
  // Group 0's heads split over both ranks (its K/V computed on each).
  const Placement split = custom(c, 2, {{0, 1, 1, 0}, {1, 0, 0, 1}});
  EXPECT_LT(max_abs_diff(tensor_parallel(m, split, tokens, 256, &policy), ref), kTol);
}

TEST(TensorParallelCpu, ShardsAreContiguousCopiesOfTheirHeads) {
  const runtime::Model& m = fixture("llama3");
  const runtime::ModelConfig& c = m.config();
  const Placement p = custom(c, 2, {{1, 0, 1, 1}, {0, 0, 1, 1}});
  const RankPlan r1 = rank_plan(c, p, 1);
  EXPECT_EQ(r1.layers[0].heads, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(r1.layers[0].groups, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r1.layers[0].group_heads, (std::vector<std::pair<int32_t, int32_t>>{{0, 1}, {1, 3}}));
  EXPECT_EQ(r1.ffn_begin, c.intermediate_size / 2);
  EXPECT_EQ(r1.ffn_end, c.intermediate_size);
  const runtime::LayerWeights& full = m.weights().layers[0];
  const runtime::LayerWeights s = shard_layer(full, c, r1.layers[0], r1.ffn_begin, r1.ffn_end);
  const int64_t d = c.head_dim, H = c.hidden_size;
  ASSERT_EQ(s.wq.rows, 3 * d);
  ASSERT_EQ(s.wo.cols, 3 * d);
  // Local head 1 is global head 2: its wq rows and wo columns.
  EXPECT_EQ(s.wq.ptr()[static_cast<size_t>(1 * d * H + 5)], full.wq.ptr()[static_cast<size_t>(2 * d * H + 5)]);
  EXPECT_EQ(s.wo.ptr()[static_cast<size_t>(7 * s.wo.cols + 1 * d + 3)],
            full.wo.ptr()[static_cast<size_t>(7 * full.wo.cols + 2 * d + 3)]);
  EXPECT_EQ(s.wk.ptr()[static_cast<size_t>(1 * d * H + 9)], full.wk.ptr()[static_cast<size_t>(1 * d * H + 9)]);
  EXPECT_EQ(s.w_down.ptr()[static_cast<size_t>(3 * s.w_down.cols)],
            full.w_down.ptr()[static_cast<size_t>(3 * full.w_down.cols + r1.ffn_begin)]);
  try {
    rank_plan(c, p, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 2 outside [0, 2)");
  }
}

// ---- the batched engine over the sharded backend ----

namespace {

// Requests of the given prompt lengths; every second one sampled; `policy` on the third.
std::vector<runtime::BatchRequest> requests(const std::vector<int32_t>& lengths, int32_t vocab,
                                            const attn::AttentionPolicy* policy) {
  std::vector<runtime::BatchRequest> reqs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    runtime::BatchRequest r;
    r.prompt = prompt(lengths[i], vocab);
    for (int32_t& t : r.prompt) t = (t + static_cast<int32_t>(i) * 101) % vocab;
    r.options.max_new_tokens = 10 + static_cast<int32_t>(i) * 3;
    if (i % 2 == 1) {
      r.options.sampling.temperature = 0.8f;
      r.options.sampling.top_k = 20;
      r.options.sampling.top_p = 0.9f;
      r.options.sampling.seed = 700 + i;
    }
    if (i == 2 && policy != nullptr) r.policy = *policy;
    reqs.push_back(r);
  }
  return reqs;
}

std::vector<std::vector<int32_t>> batched(runtime::BatchBackend& backend, const runtime::BatchEngineOptions& o,
                                          const std::vector<runtime::BatchRequest>& reqs) {
  runtime::BatchEngine engine(backend, o);
  auto out = engine.generate_all(reqs);
  EXPECT_EQ(engine.stats().max_decode_batch, o.max_batch);
  return out;
}

}  // namespace

TEST(TensorParallelCpu, BatchedEngineEqualsOneRank) {
  for (const char* name : {"llama3", "qwen2", "gemma3"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    attn::AttentionPolicy policy =
        attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 16});
    policy.at(0, 1) = attn::ElasticWindowPattern{12.0, 0.1, 2};  // MoA: a per-head decode window
    runtime::BatchEngineOptions o;
    o.chunk_size = 16;
    o.block_tokens = 8;
    o.max_batch = 3;  // five requests: the rest wait for a place
    const auto reqs = requests({5, 37, 90, 64, 1}, c.vocab_size, &policy);
    runtime::CpuBatchBackend one(m);
    const auto ref = batched(one, o, reqs);
    std::vector<std::vector<int32_t>> split(static_cast<size_t>(c.num_layers));
    for (int32_t l = 0; l < c.num_layers; ++l)
      for (int32_t h = 0; h < c.num_q_heads; ++h) split[static_cast<size_t>(l)].push_back(h % 2 == l % 2 ? 1 : 0);
    for (const Placement& p : {place(skewed_costs(c), 2, PlacementMethod::kGreedy),
                               place(skewed_costs(c), 3, PlacementMethod::kGenetic), custom(c, 2, split)}) {
      auto tp = tp_cpu_batch_backend(m, p);
      const auto got = batched(*tp, o, reqs);
      for (size_t i = 0; i < reqs.size(); ++i)
        EXPECT_EQ(got[i], ref[i]) << name << ", " << p.method << " on " << p.num_gpus << " ranks, request " << i;
    }
  }
}

TEST(TensorParallelCpu, StreamedBatchEqualsOneRank) {
  for (const char* name : {"llama3", "gemma3"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    runtime::BatchEngineOptions o;
    o.max_batch = 2;
    o.stream = runtime::small_stream(runtime::StreamMethod::Ltri);
    const auto reqs = requests({130, 9, 77}, c.vocab_size, nullptr);
    runtime::CpuBatchBackend one(m);
    const auto ref = batched(one, o, reqs);
    auto tp = tp_cpu_batch_backend(m, place(skewed_costs(c), 2, PlacementMethod::kGreedy));
    const auto got = batched(*tp, o, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], ref[i]) << name << ", request " << i;
  }
}
