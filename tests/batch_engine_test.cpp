// The batched engine (runtime/batch_engine.h) and its paged KV cache (runtime/paged_kv.h, batch_forward.h):
// block bookkeeping, paged decode attention against the masked f64 reference, and batched generation against the
// single-sequence engine (its slow, obvious twin) on the tiny fixtures and the real SmolLM2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "attention/cpu/reference.h"
#include "attention/index/lower.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "runtime/batch_engine.h"
#include "runtime/engine.h"
#include "model/model.h"
#include "stream_sizes.h"
#include "decode_reference.h"
#include "test_support.h"

namespace tessera::runtime {
namespace {

using namespace tessera::test;

// ---- block bookkeeping ----

TEST(PagedKV, PoolHandsOutEveryBlockOnce) {
  BlockPool pool(5);
  std::set<int32_t> ids;
  for (int i = 0; i < 5; ++i) ids.insert(pool.take());
  EXPECT_EQ(ids, (std::set<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(pool.available(), 0);
  EXPECT_EQ(error_of([&] { pool.take(); }),
            "KV block pool: no free block (a sequence grew past what was reserved for it)");
  pool.give(3);
  EXPECT_EQ(pool.take(), 3);
}

TEST(PagedKV, DenseSequenceHoldsCeilLengthOverBlockBlocksPerHead) {
  const PagedKVShape shape{2, 3, 8, 16};
  BlockPool pool(100);
  SequenceBlocks seq(shape, std::vector<KVRetention>(6));
  seq.grow(33, pool);  // 3 blocks of 16 per (layer, kv head)
  EXPECT_EQ(seq.length(), 33);
  EXPECT_EQ(seq.blocks_held(), 18);
  EXPECT_EQ(pool.used(), 18);
  std::set<int32_t> all;
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 3; ++h)
      for (int64_t pos = 0; pos < 33; ++pos) {
        ASSERT_GE(seq.block(l, h, pos), 0);
        all.insert(seq.block(l, h, pos));
      }
  EXPECT_EQ(all.size(), 18u);  // no block shared between heads
  EXPECT_EQ(seq.block(0, 0, 33), -1);

  // Running out: the message has the numbers and the sequence is unchanged.
  EXPECT_EQ(error_of([&] { seq.grow(16 * 20, pool); }), "KV cache: 120 more blocks of 16 tokens needed, 82 free of 100");
  EXPECT_EQ(seq.length(), 33);
  EXPECT_EQ(pool.used(), 18);
  seq.release(pool);
  EXPECT_EQ(pool.used(), 0);
  EXPECT_EQ(seq.length(), 0);
}

// A window keeps its rows (and the sink's) and gives back every block that falls out, step by step or all at once.
TEST(PagedKV, WindowsKeepTheirRowsAndFreeTheRest) {
  const PagedKVShape shape{1, 3, 4, 16};
  const std::vector<KVRetention> ret{{4, 100}, {0, 1}, {40, 7}};
  BlockPool pool(1000), pool2(1000);
  SequenceBlocks a(shape, ret), b(shape, ret);
  int64_t most = 0;
  for (int64_t len = 1; len <= 700; ++len) {
    a.grow(1, pool);
    most = std::max(most, a.blocks_held());
    ASSERT_EQ(a.blocks_held(), a.blocks_at(len));
    ASSERT_EQ(pool.used(), a.blocks_held());
    for (int h = 0; h < 3; ++h) {
      const KVRetention& r = ret[static_cast<size_t>(h)];
      for (int64_t pos = 0; pos < len; ++pos) {
        const bool needed = pos < r.sink || pos >= len - r.window;
        if (needed) {
          ASSERT_GE(a.block(0, h, pos), 0) << "len " << len << " head " << h << " pos " << pos;
        }
        // A block none of whose rows is needed is not held.
        const int64_t b0 = pos / 16 * 16, b1 = std::min<int64_t>(b0 + 16, len);
        const bool block_needed = b0 < r.sink || b1 - 1 >= len - r.window;
        if (!block_needed) {
          ASSERT_EQ(a.block(0, h, pos), -1) << "len " << len << " head " << h << " pos " << pos;
        }
      }
    }
  }
  EXPECT_LE(most, a.max_blocks(1, 700));
  // At 700 rows: head 0 keeps 1 sink block + rows [600, 700) in blocks 37..43; head 1 one block; head 2 the sink's 3
  // blocks + block 43. Dense would be 3 x 44.
  EXPECT_EQ(a.blocks_held(), (1 + 7) + 1 + (3 + 1));
  b.grow(700, pool2);  // the prompt at once (a prefill)
  EXPECT_EQ(b.blocks_held(), a.blocks_held());
  for (int h = 0; h < 3; ++h)
    for (int64_t pos = 0; pos < 700; ++pos) EXPECT_EQ(b.block(0, h, pos) >= 0, a.block(0, h, pos) >= 0);
}

TEST(PagedKV, DecodeViewRanges) {
  const DecodeView dense;
  const auto r = dense.ranges(10);
  EXPECT_EQ(r.count(), 10);
  const DecodeView moa{3, 4};
  auto m = moa.ranges(20);  // [0, 3) and [16, 20)
  EXPECT_EQ((std::vector<int64_t>{m.a0, m.a1, m.b0, m.b1}), (std::vector<int64_t>{0, 3, 16, 20}));
  m = moa.ranges(5);  // [0, 3) and [3, 5): everything
  EXPECT_EQ(m.count(), 5);
  const DecodeView local{0, kUnbounded, 8};  // a sliding-window layer
  m = local.ranges(20);
  EXPECT_EQ((std::vector<int64_t>{m.a0, m.a1, m.b0, m.b1}), (std::vector<int64_t>{12, 12, 12, 20}));
  const DecodeView both{3, 4, 6};  // the sink is older than the horizon: not seen
  m = both.ranges(20);
  EXPECT_EQ(m.count(), 4);
}

// The decode view of a MoA head is the MoA pattern's own mask (attention/index: pattern_mask) for a decode query
// whose total length is the prompt's, at every position after the prompt.
TEST(PagedKV, MoaDecodeViewIsThePatternsMask) {
  const ModelConfig& cfg = fixture("llama3").config();
  for (const attn::ElasticWindowPattern p :
       {attn::ElasticWindowPattern{5, 0.25, 4}, attn::ElasticWindowPattern{0, 0.1, 0}, attn::ElasticWindowPattern{40, 0, 2}}) {
    const auto policy = attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, p);
    const int32_t N = 60;
    const DecodeView v = decode_views(cfg, &policy, N)[0];
    for (int32_t pos = N; pos < N + 30; ++pos) {
      const attn::LoweringContext ctx{pos, 1, pos + 1, N, 64};
      const std::vector<uint8_t> mask = attn::pattern_mask(p, {}, ctx);
      const auto r = v.ranges(pos + 1);
      for (int32_t j = 0; j <= pos; ++j) {
        const bool seen = (j >= r.a0 && j < r.a1) || (j >= r.b0 && j < r.b1);
        ASSERT_EQ(seen, mask[static_cast<size_t>(j)] != 0) << describe(attn::Pattern(p)) << " pos " << pos << " key " << j;
      }
    }
  }
}

// ---- paged decode attention = the masked f64 reference over the same keys in a contiguous cache ----

TEST(PagedDecodeAttention, MatchesMaskedReference) {
  const int32_t L = 2, Hq = 4, Hkv = 2, d = 16;
  const PagedKVShape shape{L, Hkv, d, 8};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  // Views per (layer, q head): dense, MoA sink + window, a horizon (sliding layer), all three.
  const std::vector<DecodeView> views{{0, kUnbounded, kUnbounded}, {3, 5, kUnbounded}, {0, kUnbounded, 6}, {2, 9, 7},
                                      {1, 1, kUnbounded},          {0, 20, kUnbounded}, {4, 4, 4},           {0, kUnbounded, kUnbounded}};
  std::vector<KVRetention> ret(static_cast<size_t>(L * Hkv));
  for (int l = 0; l < L; ++l)
    for (int g = 0; g < Hkv; ++g) {
      KVRetention r{0, 0};
      for (int h = g * 2; h < g * 2 + 2; ++h) {
        const DecodeView& v = views[static_cast<size_t>(l * Hq + h)];
        r.sink = std::max(r.sink, v.sink);
        r.window = std::max(r.window, std::min(v.window, v.horizon));
      }
      ret[static_cast<size_t>(l * Hkv + g)] = r;
    }
  BlockPool pool(400);
  PagedKVStore store(shape, 400);
  const std::vector<int32_t> lengths{1, 9, 30, 77};
  std::vector<KVCache> caches;
  std::vector<SequenceBlocks> seqs;
  for (int32_t len : lengths) {
    KVCache c(L, Hkv, d, len);
    c.reserve(len);
    for (int l = 0; l < L; ++l)
      for (int64_t i = 0; i < int64_t{len} * Hkv * d; ++i) {
        c.k(l, 0)[i] = nd(rng);
        c.v(l, 0)[i] = nd(rng);
      }
    SequenceBlocks s(shape, ret);
    s.grow(len, pool);
    scatter_to_pages(c, s, store);
    caches.push_back(std::move(c));
    seqs.push_back(std::move(s));
  }
  std::vector<DecodeRow> rows;
  for (const SequenceBlocks& s : seqs) rows.push_back({&s, views});
  const auto B = static_cast<int64_t>(lengths.size());
  std::vector<float> q(static_cast<size_t>(B * Hq * d)), out(q.size());
  for (float& x : q) x = nd(rng);
  const float scale = 0.25f;
  for (int32_t l = 0; l < L; ++l) {
    paged_decode_attention_cpu(q.data(), out.data(), rows, l, Hq, store, scale, ThreadPool::global());
    for (int64_t i = 0; i < B; ++i) {
      const int32_t len = lengths[static_cast<size_t>(i)];
      const std::vector<float> ref =
          decode_reference(q.data() + i * Hq * d, caches[static_cast<size_t>(i)], l, len, views, Hq, d, scale);
      for (int64_t c = 0; c < Hq * d; ++c)
        ASSERT_NEAR(out[static_cast<size_t>(i * Hq * d + c)], ref[static_cast<size_t>(c)], 2e-5)
            << "layer " << l << " sequence " << i << " element " << c;
    }
  }
}

// ---- the batched engine against the single-sequence engine ----

std::vector<int32_t> single(const Model& m, const std::vector<int32_t>& prompt, const GenerateOptions& gen,
                            const attn::AttentionPolicy& policy = {}, int32_t chunk = 16) {
  EngineOptions o;
  o.chunk_size = chunk;
  o.policy = policy;
  Engine e(m, o);
  return e.generate(prompt, gen);
}

// Requests of the given prompt lengths (random tokens from seed0 + i), max_new_tokens new0 + i * step; every
// second one sampled (seed sample_seed0 + i), the others greedy.
std::vector<BatchRequest> mixed_requests(const std::vector<int32_t>& lengths, int32_t vocab, uint32_t seed0,
                                         int32_t new0, int32_t step, uint64_t sample_seed0) {
  std::vector<BatchRequest> reqs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    BatchRequest r;
    r.prompt = random_tokens(lengths[i], vocab, seed0 + static_cast<uint32_t>(i));
    r.options.max_new_tokens = new0 + static_cast<int32_t>(i) * step;
    if (i % 2 == 1) r.options.sampling = {0.8f, 20, 0.9f, sample_seed0 + i};
    reqs.push_back(r);
  }
  return reqs;
}

class BatchedEqualsSingle : public ::testing::TestWithParam<const char*> {};

TEST_P(BatchedEqualsSingle, GreedyAndSampled) {
  const Model& m = fixture(GetParam());
  const int32_t vocab = m.config().vocab_size;
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.chunk_size = 16;
  o.block_tokens = 8;
  o.max_batch = 3;  // six requests: the rest wait for a place
  BatchEngine engine(backend, o);
  const std::vector<BatchRequest> reqs = mixed_requests({5, 37, 100, 64, 1, 16}, vocab, 100, 12, 3, 1000);
  const auto out = engine.generate_all(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(out[i], single(m, reqs[i].prompt, reqs[i].options)) << "request " << i;
    EXPECT_EQ(out[i].size(), static_cast<size_t>(reqs[i].options.max_new_tokens));
  }
  EXPECT_EQ(engine.stats().max_decode_batch, 3);
  EXPECT_EQ(engine.blocks().used(), engine.prefix_cache().ids_held());  // only the prefix cache holds blocks
  EXPECT_EQ(engine.reserved_blocks(), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchedEqualsSingle, ::testing::Values("llama3", "qwen2", "gemma3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

// ---- streaming memory in the batched engine: streamed requests batch ----

// Every streamed request's tokens are those the single-sequence streaming engine generates for it alone, while the
// decode steps run several streamed sequences as one batch (prompts long enough to evict and retrieve blocks).
class StreamedBatchEqualsSingle : public ::testing::TestWithParam<std::tuple<const char*, StreamMethod>> {};

TEST_P(StreamedBatchEqualsSingle, GreedyAndSampled) {
  const Model& m = fixture(std::get<0>(GetParam()));
  const StreamOptions so = small_stream(std::get<1>(GetParam()));
  const int32_t vocab = m.config().vocab_size;
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.max_batch = 3;  // five requests: the rest wait for a place
  o.stream = so;
  BatchEngine engine(backend, o);
  const std::vector<BatchRequest> reqs = mixed_requests({130, 9, 77, 160, 45}, vocab, 300, 20, 4, 2000);
  const auto out = engine.generate_all(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EngineOptions eo;
    eo.stream = so;
    Engine single_engine(m, eo);
    EXPECT_EQ(out[i], single_engine.generate(reqs[i].prompt, reqs[i].options)) << "request " << i;
    EXPECT_EQ(out[i].size(), static_cast<size_t>(reqs[i].options.max_new_tokens));
  }
  EXPECT_EQ(engine.stats().max_decode_batch, 3);
  EXPECT_EQ(engine.running(), 0);
  EXPECT_EQ(engine.kv_bytes_in_use(), 0.0);  // every sequence's memory went with it
}

INSTANTIATE_TEST_SUITE_P(
    Methods, StreamedBatchEqualsSingle,
    ::testing::Combine(::testing::Values("llama3", "gemma3"),
                       ::testing::Values(StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM)),
    [](const ::testing::TestParamInfo<std::tuple<const char*, StreamMethod>>& p) {
      return std::string(std::get<0>(p.param)) + "_" + stream_method_name(std::get<1>(p.param));
    });

TEST(BatchEngine, StreamingRefusesPoliciesAndSequencesOverTheHostBudget) {
  const Model& m = fixture("llama3");
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.stream = small_stream(StreamMethod::Ltri);
  o.policy = attn::AttentionPolicy::uniform(m.config().num_layers, m.config().num_q_heads, m.config().num_kv_heads,
                                            attn::AShapePattern{4, 16});
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }),
            "streaming memory (--stream) runs its own layout with dense attention within it; it cannot be combined "
            "with an attention policy (--attn)");
  o.policy = {};
  o.stream.host_budget = 4096;  // a block of 16 tokens of every layer is more than that
  BatchEngine engine(backend, o);
  BatchRequest r;
  r.prompt = random_tokens(300, m.config().vocab_size, 5);
  r.options.max_new_tokens = 4;
  const std::string err = error_of([&] { engine.submit(r); });
  EXPECT_NE(err.find("over the budget of"), std::string::npos) << err;
  EXPECT_EQ(engine.waiting(), 0);
}

// A stop token ends a request without being reported, as in the single engine.
TEST(BatchEngine, StopTokens) {
  const Model& m = fixture("llama3");
  const auto prompt = random_tokens(20, m.config().vocab_size, 3);
  GenerateOptions gen;
  gen.max_new_tokens = 30;
  const std::vector<int32_t> free_run = single(m, prompt, gen);
  ASSERT_GE(free_run.size(), 10u);
  gen.stop_tokens = {free_run[6]};
  CpuBatchBackend backend(m);
  BatchEngine engine(backend);
  const int64_t id = engine.submit({prompt, gen, std::nullopt});
  std::vector<int32_t> got;
  FinishReason reason = FinishReason::kError;
  while (engine.busy())
    for (const BatchEvent& e : engine.step()) {
      ASSERT_EQ(e.id, id);
      if (e.token >= 0) got.push_back(e.token);
      if (e.finished) reason = e.reason;
    }
  EXPECT_EQ(got, single(m, prompt, gen));
  EXPECT_EQ(reason, FinishReason::kStop);
}

// MoA's per-head caches: a span covering everything decodes as dense does; a short span keeps far fewer blocks and
// a request's tokens do not depend on what else is in the batch.
TEST(BatchEngine, MoaPerHeadCaches) {
  const Model& m = fixture("llama3");
  const ModelConfig& cfg = m.config();
  const auto wide = attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
                                                   attn::ElasticWindowPattern{1000, 0, 4});
  const auto prompt = random_tokens(90, cfg.vocab_size, 11);
  GenerateOptions gen;
  gen.max_new_tokens = 20;
  {
    CpuBatchBackend backend(m);
    BatchEngineOptions o;
    o.block_tokens = 8;
    o.policy = wide;
    BatchEngine engine(backend, o);
    EXPECT_EQ(engine.generate_all({{prompt, gen, std::nullopt}})[0], single(m, prompt, gen, wide, 2048));
  }
  // Per head: different spans within one layer (GQA groups keep their widest).
  std::vector<attn::Pattern> table;
  for (int l = 0; l < cfg.num_layers; ++l)
    for (int h = 0; h < cfg.num_q_heads; ++h) table.push_back(attn::ElasticWindowPattern{4.0 + 3 * h, 0.05 * l, 2});
  const attn::AttentionPolicy moa(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, table);
  auto run = [&](const std::vector<BatchRequest>& reqs, int64_t* peak) {
    CpuBatchBackend backend(m);
    BatchEngineOptions o;
    o.block_tokens = 8;
    o.policy = moa;
    BatchEngine engine(backend, o);
    std::vector<std::vector<int32_t>> out(reqs.size());
    std::vector<int64_t> ids;
    for (const auto& r : reqs) ids.push_back(engine.submit(r));
    while (engine.busy())
      for (const BatchEvent& e : engine.step()) {
        if (peak) *peak = std::max<int64_t>(*peak, engine.blocks().used());
        if (e.token >= 0) out[static_cast<size_t>(std::find(ids.begin(), ids.end(), e.id) - ids.begin())].push_back(e.token);
      }
    return out;
  };
  int64_t peak_alone = 0;
  const auto alone = run({{prompt, gen, std::nullopt}}, &peak_alone);
  const auto together = run({{random_tokens(50, cfg.vocab_size, 12), gen, std::nullopt},
                             {prompt, gen, std::nullopt},
                             {random_tokens(7, cfg.vocab_size, 13), gen, std::nullopt}},
                            nullptr);
  EXPECT_EQ(together[1], alone[0]);
  EXPECT_EQ(alone[0].size(), 20u);
  // Dense would hold ceil(110 / 8) = 14 blocks per (layer, kv head).
  EXPECT_LT(peak_alone, int64_t{14} * cfg.num_layers * cfg.num_kv_heads / 2);
  // The MoA decode differs from dense decode (the spans are short): the test above is not vacuous.
  EXPECT_NE(alone[0], single(m, prompt, gen, moa, 2048));
}

TEST(BatchEngine, AdmissionByMemoryAndCancellation) {
  const Model& m = fixture("llama3");
  const ModelConfig& cfg = m.config();
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.block_tokens = 8;
  o.chunk_size = 8;
  const double per_token_block = backend.block_bytes({cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8});
  const int64_t per_layer_heads = int64_t{cfg.num_layers} * cfg.num_kv_heads;
  // Room for 10 blocks per (layer, kv head): 80 tokens.
  o.kv_bytes = per_token_block * static_cast<double>(per_layer_heads) * 10;
  BatchEngine engine(backend, o);
  EXPECT_EQ(engine.blocks().total(), per_layer_heads * 10);

  GenerateOptions gen;
  gen.max_new_tokens = 8;
  // 72 prompt + 8 new = 80 tokens: fits alone; two of them cannot run at once.
  const auto p1 = random_tokens(72, cfg.vocab_size, 1), p2 = random_tokens(70, cfg.vocab_size, 2);
  const int64_t a = engine.submit({p1, gen, std::nullopt});
  const int64_t b = engine.submit({p2, gen, std::nullopt});
  engine.step();
  EXPECT_EQ(engine.running(), 1);
  EXPECT_EQ(engine.waiting(), 1);
  std::map<int64_t, std::vector<int32_t>> out;
  while (engine.busy())
    for (const BatchEvent& e : engine.step()) {
      if (e.token >= 0) out[e.id].push_back(e.token);
      if (e.id == a && e.finished) {
        EXPECT_EQ(engine.waiting(), 1);  // b waited for a's blocks
      }
    }
  EXPECT_EQ(out[a], single(m, p1, gen));
  EXPECT_EQ(out[b], single(m, p2, gen));

  // One that can never fit.
  EXPECT_EQ(error_of([&] { engine.submit({random_tokens(100, cfg.vocab_size, 3), gen, std::nullopt}); }),
            "request needs " + std::to_string(per_layer_heads * 14) + " KV blocks (8 tokens each; " +
                format_bytes(per_token_block * static_cast<double>(per_layer_heads * 14)) +
                ") for its prompt of 100 tokens and 8 new ones, but the KV budget holds " +
                std::to_string(per_layer_heads * 10) + " blocks (" +
                format_bytes(per_token_block * static_cast<double>(per_layer_heads * 10)) +
                "); shorten the prompt, ask for fewer tokens or raise the KV budget");
  gen.max_new_tokens = 0;
  EXPECT_EQ(error_of([&] { engine.submit({p1, gen, std::nullopt}); }), "request: max_new_tokens must be at least 1, got 0");
  gen.max_new_tokens = 300;
  EXPECT_EQ(error_of([&] { engine.submit({p1, gen, std::nullopt}); }),
            "prompt of 372 tokens exceeds the context limit of 256 tokens (model " + cfg.name +
                "); pass a larger max context (--max-context) or shorten the prompt");
  EXPECT_EQ(error_of([&] { engine.submit({{}, gen, std::nullopt}); }), "request: empty prompt");
  EXPECT_EQ(engine.waiting(), 0);

  // Cancel mid-prefill (72 tokens = 9 chunks of 8) and a waiting one: both end, every block comes back, and a
  // later request runs as if nothing had happened.
  gen.max_new_tokens = 4;
  const int64_t c = engine.submit({p1, gen, std::nullopt});
  const int64_t d = engine.submit({p2, gen, std::nullopt});
  engine.step();
  engine.step();
  EXPECT_TRUE(engine.cancel(c));
  EXPECT_TRUE(engine.cancel(d));
  EXPECT_FALSE(engine.cancel(12345));
  std::map<int64_t, FinishReason> ends;
  for (const BatchEvent& e : engine.step())
    if (e.finished) ends[e.id] = e.reason;
  EXPECT_EQ(ends, (std::map<int64_t, FinishReason>{{c, FinishReason::kCancelled}, {d, FinishReason::kCancelled}}));
  EXPECT_FALSE(engine.busy());
  EXPECT_EQ(engine.blocks().used(), engine.prefix_cache().ids_held());  // only the prefix cache holds blocks
  EXPECT_EQ(engine.reserved_blocks(), 0);
  EXPECT_EQ(engine.generate_all({{p2, gen, std::nullopt}})[0], single(m, p2, gen));
}

// A backend that runs out of (device) memory where a GPU would: the staging of one request's prompt fails. That
// request ends with the error; the others run on, token for token as alone, and every block comes back.
class OutOfMemoryAtPrefill final : public BatchBackend {
 public:
  explicit OutOfMemoryAtPrefill(const Model& m) : inner_(m) {}
  const ModelConfig& config() const override { return inner_.config(); }
  const char* device_name() const override { return "test"; }
  double block_bytes(const PagedKVShape& shape) const override { return inner_.block_bytes(shape); }
  double default_kv_bytes() const override { return inner_.default_kv_bytes(); }
  void create_store(const PagedKVShape& shape, int32_t blocks, int32_t seqs, int32_t ctx) override {
    inner_.create_store(shape, blocks, seqs, ctx);
  }
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override {
    if (total_len == 33 && pos > 0) throw Error("out of device memory: 2.10 GB for the prompt's KV, 0.50 GB free");
    return inner_.prefill_chunk(tokens, pos, total_len, policy, logits);
  }
  void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) override {
    inner_.finish_prefill(seq, views);
  }
  void release_sequence(const SequenceBlocks& seq) override { inner_.release_sequence(seq); }
  void abort_prefill() override {
    ++aborts;
    inner_.abort_prefill();
  }
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) override {
    return inner_.decode(tokens, rows);
  }
  // one_forward: the mixed step is the CPU backend's one forward (failing as its prefill part would), else the
  // default (prefill_chunk, then decode_select).
  bool mixes() const override { return one_forward; }
  std::vector<int32_t> mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                  const attn::AttentionPolicy* policy, bool logits, std::vector<float>* chunk_logits,
                                  std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                  std::span<const RowChoice> choice) override {
    if (!one_forward)
      return BatchBackend::mixed_step(chunk, pos, total_len, policy, logits, chunk_logits, tokens, rows, choice);
    ++mixed;
    if (total_len == 33 && pos > 0) throw Error("out of device memory: 2.10 GB for the prompt's KV, 0.50 GB free");
    return inner_.mixed_step(chunk, pos, total_len, policy, logits, chunk_logits, tokens, rows, choice);
  }
  ForwardTimers timers() const override { return inner_.timers(); }
  int aborts = 0, mixed = 0;
  bool one_forward = false;

 private:
  CpuBatchBackend inner_;
};

// With the mixed step too (through the default mixed_step and through the CPU's one forward): the prompt whose chunk
// fails ends with the error; the decode rows that rode with it run alone and keep their tokens.
TEST(BatchEngine, OutOfMemoryInOnePrefillLeavesTheOthers) {
  for (const int mode : {0, 1, 2}) {  // no mixed step; the default mixed_step; the CPU's one forward
    SCOPED_TRACE("mode " + std::to_string(mode));
    const Model& m = fixture("llama3");
    OutOfMemoryAtPrefill backend(m);
    backend.one_forward = mode == 2;
    BatchEngineOptions o;
    o.mixed_step = mode > 0;
    o.block_tokens = 8;
    o.chunk_size = 8;  // the failing prompt (33 tokens) fails at its second chunk, with others decoding beside it
    BatchEngine engine(backend, o);
    GenerateOptions gen;
    gen.max_new_tokens = 6;
    const auto p1 = random_tokens(20, m.config().vocab_size, 1), bad = random_tokens(33, m.config().vocab_size, 2),
               p3 = random_tokens(45, m.config().vocab_size, 3);
    const int64_t a = engine.submit({p1, gen, std::nullopt});
    const int64_t b = engine.submit({bad, gen, std::nullopt});
    const int64_t c = engine.submit({p3, gen, std::nullopt});
    std::map<int64_t, std::vector<int32_t>> out;
    std::map<int64_t, BatchEvent> end;
    while (engine.busy())
      for (const BatchEvent& e : engine.step()) {
        if (e.token >= 0) out[e.id].push_back(e.token);
        if (e.finished) end[e.id] = e;
      }
    EXPECT_EQ(end[b].reason, FinishReason::kError);
    EXPECT_EQ(end[b].error, "out of device memory: 2.10 GB for the prompt's KV, 0.50 GB free");
    EXPECT_TRUE(out[b].empty());
    EXPECT_EQ(backend.aborts, 1);
    EXPECT_EQ(end[a].reason, FinishReason::kLength);
    EXPECT_EQ(out[a], single(m, p1, gen));
    EXPECT_EQ(out[c], single(m, p3, gen));
    EXPECT_EQ(engine.blocks().used(), engine.prefix_cache().ids_held());  // only the prefix cache holds blocks
    EXPECT_EQ(engine.reserved_blocks(), 0);
    EXPECT_EQ(engine.stats().mixed_steps > 0, mode > 0);
    EXPECT_EQ(backend.mixed > 0, mode == 2);
  }
}

TEST(BatchEngine, BadOptions) {
  const Model& m = fixture("llama3");
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.block_tokens = 0;
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }), "batch engine: block_tokens must be in [1, 4096], got 0");
  o = {};
  o.kv_bytes = 10;
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }).substr(0, 40), "batch engine: a KV budget of 10 B holds ");
  o = {};
  o.policy = attn::AttentionPolicy::uniform(3, 4, 2, attn::DensePattern{});
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }).substr(0, 60),
            "attention policy has 3 layers x 4 query heads (2 kv heads); ");
  o = {};
  o.max_batch = 4;
  o.step_tokens = 4;
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }),
            "batch engine: step_tokens must be 0 (no budget) or more than max_batch (4): every decoding sequence takes "
            "a token of each step and a prefill needs one more, got 4");
  o = {};
  o.step_tokens = 512;
  o.stream = small_stream(StreamMethod::StreamingLLM);
  EXPECT_EQ(error_of([&] { BatchEngine e(backend, o); }),
            "batch engine: a token budget per step (step_tokens) cannot be combined with streaming memory, whose "
            "prompt chunks are its own");
}

// ---- a token budget per step (BatchEngineOptions::step_tokens) ----

// Under a budget every request's tokens are still the single-sequence engine's, no step runs more tokens than the
// budget (prefill tokens + decode rows, the engine's own count), and short prompts share a step (several prefill
// chunks in one step).
class TokenBudget : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenBudget, BatchedEqualsSingleWithinTheBudget) {
  const Model& m = fixture(GetParam());
  const int32_t vocab = m.config().vocab_size;
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.chunk_size = 16;
  o.block_tokens = 8;
  o.max_batch = 4;
  o.step_tokens = 13;
  BatchEngine engine(backend, o);
  const std::vector<BatchRequest> reqs = mixed_requests({5, 37, 3, 100, 2, 64, 1, 16}, vocab, 500, 9, 2, 3000);
  std::vector<int64_t> ids;
  for (const BatchRequest& r : reqs) ids.push_back(engine.submit(r));
  std::map<int64_t, std::vector<int32_t>> out;
  int64_t steps = 0, shared_steps = 0, chunks = 0, most = 0;
  while (engine.busy()) {
    for (const BatchEvent& e : engine.step()) {
      ASSERT_NE(e.reason, FinishReason::kError) << e.error;
      if (e.token >= 0) out[e.id].push_back(e.token);
    }
    ++steps;
    const BatchEngineStats& st = engine.stats();
    EXPECT_LE(st.last_step_tokens, 13) << "step " << steps;
    most = std::max(most, st.last_step_tokens);
    if (st.prefill_chunks - chunks >= 2) ++shared_steps;
    chunks = st.prefill_chunks;
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(out[ids[i]], single(m, reqs[i].prompt, reqs[i].options)) << "request " << i;
    EXPECT_EQ(out[ids[i]].size(), static_cast<size_t>(reqs[i].options.max_new_tokens));
  }
  EXPECT_EQ(engine.stats().max_step_tokens, most);
  EXPECT_EQ(most, 13);        // the budget is used up to its end
  EXPECT_GT(shared_steps, 0);  // several prompts prefilled in one step
  EXPECT_EQ(engine.stats().max_decode_batch, 4);
  EXPECT_EQ(engine.reserved_blocks(), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenBudget, ::testing::Values("llama3", "qwen2", "gemma3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

// A decoding request keeps its pace while a long prompt arrives: it gets a token at every step of the other's
// prefill, which runs in chunks of what the budget leaves (budget - decoding rows), not chunk_size.
TEST(TokenBudget, DecodingKeepsSteppingWhileALongPromptPrefills) {
  const Model& m = fixture("llama3");
  const int32_t vocab = m.config().vocab_size;
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.chunk_size = 64;
  o.block_tokens = 8;
  o.max_batch = 2;
  o.step_tokens = 11;
  BatchEngine engine(backend, o);
  BatchRequest a;
  a.prompt = random_tokens(6, vocab, 1);
  a.options.max_new_tokens = 60;
  const int64_t ia = engine.submit(a);
  std::vector<int32_t> got_a, got_b;
  while (got_a.size() < 3)
    for (const BatchEvent& e : engine.step())
      if (e.token >= 0) got_a.push_back(e.token);
  BatchRequest b;
  b.prompt = random_tokens(150, vocab, 2);
  b.options.max_new_tokens = 4;
  const int64_t ib = engine.submit(b);
  int64_t prefill_steps = 0;
  while (got_b.empty()) {
    const int64_t before = engine.stats().prefill_tokens;
    bool a_stepped = false;
    for (const BatchEvent& e : engine.step()) {
      if (e.id == ia && e.token >= 0) {
        got_a.push_back(e.token);
        a_stepped = true;
      }
      if (e.id == ib && e.token >= 0) got_b.push_back(e.token);
    }
    ++prefill_steps;
    EXPECT_TRUE(a_stepped) << "step " << prefill_steps << " of the long prompt's prefill";
    EXPECT_LE(engine.stats().prefill_tokens - before, 10);  // the budget less a's row
    EXPECT_LE(engine.stats().last_step_tokens, 11);
  }
  // 150 prompt tokens, 10 a step (not 64: chunk_size), except that the 15th step's 10 would end the prompt and bring
  // b's decode row too (12 tokens): it runs 9, and the 16th the last one.
  EXPECT_EQ(prefill_steps, 16);
  while (engine.busy())
    for (const BatchEvent& e : engine.step()) {
      if (e.id == ia && e.token >= 0) got_a.push_back(e.token);
      if (e.id == ib && e.token >= 0) got_b.push_back(e.token);
    }
  EXPECT_EQ(got_a, single(m, a.prompt, a.options));
  EXPECT_EQ(got_b, single(m, b.prompt, b.options));
}

// ---- the mixed step (BatchEngineOptions::mixed_step: a prefill chunk and the decode rows in one forward) ----

struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;
  BatchEngineStats stats;
  int64_t decode_rows_beside_chunks = 0;  // decode rows of steps that also ran a prefill chunk
};

// reqs through one CPU engine with the mixed step on or off; every request's tokens (submission order).
EngineRun run_engine(const Model& m, const std::vector<BatchRequest>& reqs, BatchEngineOptions o, bool mixed) {
  CpuBatchBackend backend(m);
  o.mixed_step = mixed;
  BatchEngine engine(backend, o);
  std::vector<int64_t> ids;
  for (const BatchRequest& r : reqs) ids.push_back(engine.submit(r));
  EngineRun run;
  run.tokens.resize(reqs.size());
  while (engine.busy()) {
    const BatchEngineStats before = engine.stats();
    for (const BatchEvent& e : engine.step()) {
      EXPECT_NE(e.reason, FinishReason::kError) << e.error;
      const auto i = static_cast<size_t>(std::find(ids.begin(), ids.end(), e.id) - ids.begin());
      if (e.token >= 0) run.tokens[i].push_back(e.token);
    }
    const BatchEngineStats& after = engine.stats();
    if (after.prefill_chunks > before.prefill_chunks)
      run.decode_rows_beside_chunks += after.decode_tokens - before.decode_tokens;
  }
  run.stats = engine.stats();
  EXPECT_EQ(engine.reserved_blocks(), 0);
  return run;
}

// With the mixed step every request's tokens are those of the engine without it (a step's prefill chunk and decode
// rows as two forwards) and, for dense requests, of the single-sequence engine: greedy and sampled rows, requests
// with their own sparse prefill policy (A-shape) and MoA per-head decode views, prompts that start with cached
// blocks (prefix hits), the model's sliding windows (gemma3, mistral), with and without a token budget. The mixed
// step does run (mixed_steps > 0, decode rows beside prefill chunks), and not when it is off.
class MixedStep : public ::testing::TestWithParam<const char*> {};

TEST_P(MixedStep, TokensEqualTheTwoForwardStep) {
  const Model& m = fixture(GetParam());
  const ModelConfig& cfg = m.config();
  const int32_t vocab = cfg.vocab_size;
  std::vector<BatchRequest> reqs = mixed_requests({5, 37, 100, 64, 1, 16, 45}, vocab, 700, 10, 2, 4000);
  // Prefix hits: two prompts that start with the first one's 40 tokens (5 blocks of 8).
  const std::vector<int32_t> shared = random_tokens(40, vocab, 71);
  for (uint32_t i = 0; i < 2; ++i) {
    BatchRequest r;
    r.prompt = shared;
    const std::vector<int32_t> tail = random_tokens(9 + 7 * static_cast<int32_t>(i), vocab, 72 + i);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.options.max_new_tokens = 14;
    if (i == 1) r.options.sampling = {0.7f, 0, 0.95f, 91};
    reqs.insert(reqs.begin() + 2 + 3 * i, r);
  }
  BatchRequest first_of_shared;  // the one whose blocks they find
  first_of_shared.prompt = shared;
  first_of_shared.prompt.push_back(5);
  first_of_shared.options.max_new_tokens = 16;
  reqs.insert(reqs.begin(), first_of_shared);
  // Requests with their own policies: an A-shape prefill (sink 4, local 16) and MoA per-head spans.
  BatchRequest ashape;
  ashape.prompt = random_tokens(90, vocab, 81);
  ashape.options.max_new_tokens = 12;
  ashape.policy = attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
                                                 attn::AShapePattern{4, 16});
  reqs.insert(reqs.begin() + 3, ashape);
  std::vector<attn::Pattern> table;
  for (int l = 0; l < cfg.num_layers; ++l)
    for (int h = 0; h < cfg.num_q_heads; ++h) table.push_back(attn::ElasticWindowPattern{4.0 + 3 * h, 0.05 * l, 2});
  BatchRequest moa;
  moa.prompt = random_tokens(70, vocab, 82);
  moa.options.max_new_tokens = 15;
  moa.options.sampling = {0.9f, 30, 1.0f, 92};
  moa.policy = attn::AttentionPolicy(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, table);
  reqs.insert(reqs.begin() + 6, moa);
  for (const int32_t budget : {0, 23}) {
    SCOPED_TRACE("step_tokens " + std::to_string(budget));
    BatchEngineOptions o;
    o.chunk_size = 16;
    o.block_tokens = 8;
    o.max_batch = 4;
    o.step_tokens = budget;
    const EngineRun on = run_engine(m, reqs, o, true), off = run_engine(m, reqs, o, false);
    ASSERT_EQ(on.tokens.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(on.tokens[i], off.tokens[i]) << "request " << i;
      EXPECT_EQ(on.tokens[i].size(), static_cast<size_t>(reqs[i].options.max_new_tokens)) << "request " << i;
    }
    for (size_t i = 0; i < reqs.size(); ++i)
      if (!reqs[i].policy) {
        EXPECT_EQ(on.tokens[i], single(m, reqs[i].prompt, reqs[i].options)) << "request " << i;
      }
    EXPECT_GT(on.stats.mixed_steps, 5);
    EXPECT_GT(on.decode_rows_beside_chunks, 0);
    EXPECT_EQ(off.stats.mixed_steps, 0);
    EXPECT_GT(off.decode_rows_beside_chunks, 0);  // the side-by-side has such steps too
    EXPECT_EQ(on.stats.prefix_hits, 2);
    EXPECT_EQ(off.stats.prefix_hits, 2);
    EXPECT_EQ(on.stats.decode_tokens, off.stats.decode_tokens);
    if (budget > 0) {
      EXPECT_LE(on.stats.max_step_tokens, budget);
    }
  }
}

// The backend's mixed step against its two forwards, teacher-forced, on a second backend with the same state: every
// decode row's chosen token is the argmax of the two-forward logits, its log-probabilities (of the token and the top
// 3) and the chunk's last-row logits within 5e-4, and the prompt's K/V staged by the mixed chunks decode within 5e-4
// of those of the plain chunks (the rows' products run over n + 3 rows instead of n and 3: OpenBLAS sums them in
// another order, the last bits differ: up to 9e-5 on gemma3's fixture, ~2e-6 on the others, printed); three
// rows decode (one with MoA per-head views) while a 50-token prompt prefills in chunks of 16 under an A-shape policy.
TEST_P(MixedStep, BackendEqualsPrefillChunkThenDecode) {
  const Model& m = fixture(GetParam());
  const ModelConfig& cfg = m.config();
  const auto V = static_cast<size_t>(cfg.vocab_size);
  CpuBatchBackend mixed(m), apart(m);
  ASSERT_TRUE(mixed.mixes());
  const PagedKVShape shape{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8};
  mixed.create_store(shape, 400, 8, 256);
  apart.create_store(shape, 400, 8, 256);
  BlockPool pool_m(400), pool_a(400);
  std::vector<attn::Pattern> table;
  for (int l = 0; l < cfg.num_layers; ++l)
    for (int h = 0; h < cfg.num_q_heads; ++h) table.push_back(attn::ElasticWindowPattern{4.0 + 3 * h, 0.05 * l, 2});
  const attn::AttentionPolicy moa(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, table);
  const auto ashape =
      attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, attn::AShapePattern{4, 12});
  const std::vector<int32_t> lengths = {5, 30, 41};
  std::vector<SequenceBlocks> sm, sa;
  std::vector<std::vector<DecodeView>> views;
  sm.reserve(4);
  sa.reserve(4);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::vector<int32_t> prompt = random_tokens(lengths[i], cfg.vocab_size, 300 + static_cast<uint32_t>(i));
    const attn::AttentionPolicy* policy = i == 1 ? &moa : nullptr;
    views.push_back(decode_views(cfg, policy, lengths[i]));
    sm.emplace_back(shape, kv_retention(cfg, views.back()));
    sa.emplace_back(shape, kv_retention(cfg, views.back()));
    mixed.prefill_chunk(prompt, 0, lengths[i], policy, false);
    sm.back().grow(lengths[i], pool_m);
    mixed.finish_prefill(sm.back(), views.back());
    apart.prefill_chunk(prompt, 0, lengths[i], policy, false);
    sa.back().grow(lengths[i], pool_a);
    apart.finish_prefill(sa.back(), views.back());
  }
  const int32_t long_len = 50, chunk = 16;
  const std::vector<int32_t> prompt = random_tokens(long_len, cfg.vocab_size, 310);
  int step = 0;
  double worst = 0;
  for (int32_t pos = 0; pos < long_len; pos += chunk, ++step) {
    const int32_t n = std::min(chunk, long_len - pos);
    const bool last = pos + n == long_len;
    const auto part = std::span<const int32_t>(prompt).subspan(static_cast<size_t>(pos), static_cast<size_t>(n));
    std::vector<int32_t> toks;
    std::vector<DecodeRow> rm, ra;
    for (size_t i = 0; i < lengths.size(); ++i) {
      toks.push_back(static_cast<int32_t>((step * 37 + static_cast<int>(i) * 11) % cfg.vocab_size));
      sm[i].grow(1, pool_m);
      sa[i].grow(1, pool_a);
      rm.push_back({&sm[i], views[i]});
      ra.push_back({&sa[i], views[i]});
    }
    std::vector<BatchBackend::RowChoice> choice(toks.size());
    std::vector<TokenLogprobs> lps(toks.size());
    for (size_t i = 0; i < toks.size(); ++i) {
      choice[i].logprobs = 3;
      choice[i].logprobs_out = &lps[i];
    }
    std::vector<float> chunk_m;
    const std::vector<int32_t> got = mixed.mixed_step(part, pos, long_len, &ashape, last, &chunk_m, toks, rm, choice);
    const std::vector<float> chunk_a = apart.prefill_chunk(part, pos, long_len, &ashape, last);
    const std::vector<float> logits_a = apart.decode(toks, ra);
    ASSERT_EQ(chunk_m.size(), last ? V : 0u);
    ASSERT_EQ(chunk_a.size(), chunk_m.size());
    for (size_t j = 0; j < chunk_m.size(); ++j) worst = std::max(worst, static_cast<double>(std::fabs(chunk_m[j] - chunk_a[j])));
    ASSERT_EQ(got.size(), toks.size());
    for (size_t i = 0; i < toks.size(); ++i) {
      const auto row = std::span<const float>(logits_a).subspan(i * V, V);
      EXPECT_EQ(got[i], argmax(row)) << "chunk at " << pos << ", row " << i;
      const TokenLogprobs want = token_logprobs(row, got[i], 3);
      EXPECT_NEAR(lps[i].logprob, want.logprob, 5e-4) << "chunk at " << pos << ", row " << i;
      worst = std::max(worst, static_cast<double>(std::fabs(lps[i].logprob - want.logprob)));
      ASSERT_EQ(lps[i].top.size(), want.top.size());
      for (size_t k = 0; k < want.top.size(); ++k) {
        EXPECT_EQ(lps[i].top[k].token, want.top[k].token);
        EXPECT_NEAR(lps[i].top[k].logprob, want.top[k].logprob, 5e-4);
      }
    }
  }
  const std::vector<DecodeView> long_views = decode_views(cfg, &ashape, long_len);
  sm.emplace_back(shape, kv_retention(cfg, long_views));
  sa.emplace_back(shape, kv_retention(cfg, long_views));
  sm.back().grow(long_len, pool_m);
  sa.back().grow(long_len, pool_a);
  mixed.finish_prefill(sm.back(), long_views);
  apart.finish_prefill(sa.back(), long_views);
  sm.back().grow(1, pool_m);
  sa.back().grow(1, pool_a);
  const int32_t one[1] = {3};
  const DecodeRow row_m{&sm.back(), long_views}, row_a{&sa.back(), long_views};
  const std::vector<float> after_m = mixed.decode(one, std::span<const DecodeRow>(&row_m, 1));
  const std::vector<float> after_a = apart.decode(one, std::span<const DecodeRow>(&row_a, 1));
  ASSERT_EQ(after_m.size(), V);
  ASSERT_EQ(after_a.size(), V);
  double after = 0;
  for (size_t j = 0; j < V; ++j) after = std::max(after, static_cast<double>(std::fabs(after_m[j] - after_a[j])));
  std::printf("[mixed] %s: mixed vs two forwards, worst difference of the chunk logits and the decode rows' "
              "log-probabilities %.3g; the prompt's decode after its mixed chunks %.3g\n", GetParam(), worst, after);
  EXPECT_LT(worst, 5e-4);
  EXPECT_LT(after, 5e-4);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MixedStep, ::testing::Values("llama3", "qwen2", "gemma3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

// step(early): the events of a step's prefill part (a prompt's first token) come before the step's own decode
// step, and the two parts together are exactly step()'s events: the same ids, tokens, finishes and order, step by
// step, on a second engine. A request arriving alone gets its first token early and its second in the same step;
// one arriving beside a decoding request rides in the mixed step (nothing early: no separate decode step to wait
// for); with the mixed step off it comes early too.
std::vector<std::tuple<int64_t, int32_t, bool>> event_keys(const std::vector<BatchEvent>& events) {
  std::vector<std::tuple<int64_t, int32_t, bool>> keys;
  for (const BatchEvent& e : events) keys.emplace_back(e.id, e.token, e.finished);
  return keys;
}

TEST(BatchEngine, EarlyEventsAreTheStepsPrefillPart) {
  const Model& m = fixture("llama3");
  const std::vector<BatchRequest> reqs = mixed_requests({40, 24}, m.config().vocab_size, 71, 6, 0, 5);
  for (const bool mixed : {true, false}) {
    CpuBatchBackend b1(m), b2(m);
    BatchEngineOptions o;
    o.chunk_size = 16;
    o.mixed_step = mixed;
    BatchEngine plain(b1, o), split(b2, o);
    const int64_t a = plain.submit(reqs[0]);
    ASSERT_EQ(split.submit(reqs[0]), a);
    int64_t early_first_tokens = 0, early_calls = 0;
    for (int32_t step = 0; plain.busy() || split.busy(); ++step) {
      ASSERT_LT(step, 100);
      if (step == 4) {  // the second request comes while the first decodes
        ASSERT_EQ(split.submit(reqs[1]), plain.submit(reqs[1]));
      }
      std::vector<BatchEvent> early;
      const std::vector<BatchEvent> expect = plain.step();
      std::vector<BatchEvent> late = split.step([&](std::vector<BatchEvent>& ev) {
        ++early_calls;
        EXPECT_FALSE(ev.empty());
        for (const BatchEvent& e : ev) early_first_tokens += e.token >= 0 && e.cached_tokens >= 0;
        early.insert(early.end(), ev.begin(), ev.end());
      });
      early.insert(early.end(), late.begin(), late.end());
      ASSERT_EQ(event_keys(early), event_keys(expect)) << "step " << step << (mixed ? " mixed" : "");
    }
    // The first request's first token always comes early (nothing decodes beside its prefill); the second's only
    // without the mixed step (with it, the first request's decode row rides in the second's last chunk).
    EXPECT_EQ(early_first_tokens, mixed ? 1 : 2) << (mixed ? "mixed" : "two forwards");
    EXPECT_EQ(early_calls, early_first_tokens);
  }
}

// ---- the prompt's log-probabilities (BatchRequest::prompt_logprobs: echo with logprobs) ----

// Every prompt token's log-probability and top alternatives equal those of the single-sequence engine's logits of
// the whole prompt (forward_all_logits), whatever the chunking (the rows' logits come in chunks), the token budget
// and what else runs; a prompt the prefix cache holds is still prefilled whole (cached_tokens 0); the tokens
// generated after it are unchanged.
TEST(BatchEngine, PromptLogprobsEqualTheSingleEngine) {
  const Model& m = fixture("llama3");
  const int32_t vocab = m.config().vocab_size;
  CpuBatchBackend backend(m);
  BatchEngineOptions o;
  o.chunk_size = 16;
  o.block_tokens = 8;
  o.max_batch = 3;
  o.step_tokens = 20;
  BatchEngine engine(backend, o);
  BatchRequest plain;
  plain.prompt = random_tokens(50, vocab, 7);
  plain.options.max_new_tokens = 5;
  BatchRequest asks = plain;  // the same prompt: it would find the first one's blocks in the prefix cache
  asks.prompt_logprobs = 3;
  BatchRequest other;
  other.prompt = random_tokens(9, vocab, 8);
  other.options.max_new_tokens = 30;
  const int64_t i0 = engine.submit(other), i1 = engine.submit(plain);
  std::map<int64_t, std::vector<int32_t>> out;
  std::optional<std::vector<TokenLogprobs>> lp;
  int64_t i2 = -1;
  int32_t cached = -1;
  while (engine.busy()) {
    for (const BatchEvent& e : engine.step()) {
      ASSERT_NE(e.reason, FinishReason::kError) << e.error;
      if (e.token >= 0) out[e.id].push_back(e.token);
      if (e.id == i2 && e.cached_tokens >= 0) cached = e.cached_tokens;
      if (e.prompt_logprobs) {
        EXPECT_EQ(e.id, i2);
        EXPECT_TRUE(out[e.id].empty());  // before the first token
        lp = e.prompt_logprobs;
      }
      if (e.id == i1 && e.finished && i2 < 0) i2 = engine.submit(asks);
    }
  }
  ASSERT_TRUE(lp.has_value());
  EXPECT_EQ(cached, 0);
  EngineOptions eo;
  Engine single_engine(m, eo);
  const std::vector<float> logits = single_engine.forward_all_logits(plain.prompt);
  ASSERT_EQ(lp->size(), plain.prompt.size() - 1);
  for (size_t i = 0; i + 1 < plain.prompt.size(); ++i) {
    const TokenLogprobs want = token_logprobs(
        std::span<const float>(logits).subspan(i * static_cast<size_t>(vocab), static_cast<size_t>(vocab)),
        plain.prompt[i + 1], 3);
    const TokenLogprobs& got = (*lp)[i];
    EXPECT_EQ(got.token, plain.prompt[i + 1]);
    EXPECT_NEAR(got.logprob, want.logprob, 1e-4) << "prompt token " << i + 1;
    ASSERT_EQ(got.top.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(got.top[k].token, want.top[k].token) << "prompt token " << i + 1 << " alternative " << k;
      EXPECT_NEAR(got.top[k].logprob, want.top[k].logprob, 1e-4);
    }
  }
  EXPECT_EQ(out[i2], single(m, plain.prompt, plain.options));
  EXPECT_EQ(out[i2], out[i1]);
  EXPECT_EQ(out[i0], single(m, other.prompt, other.options));
  // Streaming memory gives no rows' logits: refused at submit.
  BatchEngineOptions so;
  so.stream = small_stream(StreamMethod::StreamingLLM);
  CpuBatchBackend streamed_backend(m);
  BatchEngine streamed(streamed_backend, so);
  EXPECT_EQ(error_of([&] { streamed.submit(asks); }),
            "request: the prompt's log-probabilities are not available with streaming memory");
}

// ---- the real SmolLM2: batched greedy = single-sequence greedy ----

// Greedy rows and seeded sampled rows (temperature, top_p, top_k) of the batched engine = the single engine.
TEST(BatchEngineRealModel, SmolLM2BatchedGreedyEqualsSingle) {
  const std::string path = required_model_path("smollm2-135m-instruct-q4_1.gguf");
  if (path.empty()) GTEST_SKIP() << "smollm2-135m-instruct-q4_1.gguf is missing";
  // The weights as stored (the default): qmatmul's products give a row the same bits whatever the other rows of the
  // step (model/qmatmul.h, "Batch invariance"), so a decode row batched beside a prefill chunk equals the same row
  // decoded alone.
  const auto model = Model::load(path);
  std::vector<BatchRequest> reqs;
  for (uint32_t i = 0; i < 5; ++i) {
    BatchRequest r;
    r.prompt = random_tokens(40 + 40 * static_cast<int32_t>(i), 20000, 50 + i);
    r.options.max_new_tokens = 12;
    if (i >= 2) {  // sampled rows (49,152-token vocabulary: drawn in parallel by the engine), seeded
      r.options.sampling = {.temperature = 0.9f, .top_k = i == 4 ? 50 : 0, .top_p = i == 3 ? 0.9f : 1.0f, .seed = 7 + i};
    }
    reqs.push_back(r);
  }
  CpuBatchBackend backend(*model);
  BatchEngineOptions o;
  o.chunk_size = 64;
  o.kv_bytes = 256e6;
  o.mixed_step = true;  // off by default on the CPU
  o.exact_decode = false;  // the single-sequence engine's faster decode walk (the exact one is the prefix tests')
  BatchEngine engine(backend, o);
  const auto out = engine.generate_all(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(out[i], single(*model, reqs[i].prompt, reqs[i].options, {}, 64)) << i;
  EXPECT_GT(engine.stats().mixed_steps, 0);  // decode rows rode with the later prompts' chunks
  // The mixed step against the two-forward step: the same tokens.
  CpuBatchBackend apart_backend(*model);
  o.mixed_step = false;
  BatchEngine apart(apart_backend, o);
  const auto out_apart = apart.generate_all(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(out[i], out_apart[i]) << "request " << i << ", mixed step on / off";
  EXPECT_EQ(apart.stats().mixed_steps, 0);
}

}  // namespace
}  // namespace tessera::runtime
