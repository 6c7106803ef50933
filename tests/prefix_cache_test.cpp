// Prefix caching (runtime/prefix_cache.h) in the batched engine: the block bookkeeping (shared blocks, the chain of
// keys, adoption under sliding windows, least-recently-used eviction), and a request that adopts cached blocks
// generating exactly the tokens it generates without the cache, on every fixture architecture: a shared document
// with different questions, a second turn over the first turn's answer, requests running at once, a KV budget so
// small that cached blocks must go.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "runtime/batch_engine.h"
#include "runtime/prefix_cache.h"
#include "test_support.h"

namespace tessera::runtime {
namespace {

using namespace tessera::test;

// ---- bookkeeping ----

TEST(PrefixCacheBlocks, SharedBlocksAreFreedByTheirLastHolder) {
  BlockPool pool(3);
  const int32_t a = pool.take();
  pool.share(a);
  EXPECT_EQ(pool.holders(a), 2);
  pool.give(a);
  EXPECT_EQ(pool.available(), 2);  // still held once
  pool.give(a);
  EXPECT_EQ(pool.available(), 3);
  try {
    pool.share(a);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "KV block pool: sharing a free block");
  }
}

// Two layers x one kv head, dense, blocks of 4 rows.
SequenceBlocks dense_seq() {
  return SequenceBlocks(PagedKVShape{2, 1, 8, 4}, std::vector<KVRetention>(2));
}

TEST(PrefixCacheBlocks, FindsTheLongestCachedChainAndComparesTokens) {
  BlockPool pool(64);
  PrefixCache cache(4);
  const std::vector<int32_t> doc = random_tokens(14, 100, 1);  // three full blocks and two rows
  SequenceBlocks s = dense_seq();
  s.grow(14, pool);
  cache.insert(doc, s, 3, pool);
  EXPECT_EQ(cache.entries(), 3);
  EXPECT_EQ(cache.ids_held(), 6);
  EXPECT_EQ(pool.holders(s.table(0, 0)[0]), 2);

  // The same first 12 tokens, then others: three blocks (at most max_blocks).
  SequenceBlocks t = dense_seq();
  const std::vector<int32_t> q = std::vector<int32_t>(doc.begin(), doc.begin() + 12) + random_tokens(9, 100, 2);
  auto hit = cache.match(q, 5, t);
  ASSERT_EQ(hit.size(), 3u);
  EXPECT_EQ(*hit[1], (std::vector<int32_t>{s.table(0, 0)[1], s.table(1, 0)[1]}));
  EXPECT_EQ(cache.match(q, 2, t).size(), 2u);
  // A different token in the second block: only the first block is found.
  std::vector<int32_t> r = q;
  r[5] = (r[5] + 1) % 100;
  EXPECT_EQ(cache.match(r, 5, t).size(), 1u);
  r[0] = (r[0] + 1) % 100;
  EXPECT_TRUE(cache.match(r, 5, t).empty());

  // Adopting shares the blocks; the sequence goes on from there.
  t.adopt(hit, pool);
  EXPECT_EQ(t.length(), 12);
  EXPECT_EQ(t.table(1, 0)[2], s.table(1, 0)[2]);
  EXPECT_EQ(pool.holders(s.table(1, 0)[2]), 3);
  const int32_t before = pool.available();
  t.grow(3, pool);
  EXPECT_EQ(pool.available(), before - 2);  // one new block per layer
  s.release(pool);
  t.release(pool);
  EXPECT_EQ(pool.used(), cache.ids_held());
  EXPECT_EQ(cache.ids_only_here(pool), 6);
  cache.clear(pool);
  EXPECT_EQ(pool.used(), 0);
}

// kept_alone() (kept up to date by every share / give / keep / unkeep) equals the count over the blocks, in a random
// walk of holds; the cache's hold cannot be given back as a sequence's.
TEST(PrefixCacheBlocks, KeptAloneCountsWhatOnlyTheCacheHolds) {
  BlockPool pool(16);
  std::vector<int32_t> seq_holds(16, 0), cache_holds(16, 0);
  std::mt19937 rng(7);
  for (int step = 0; step < 4000; ++step) {
    const auto id = static_cast<int32_t>(rng() % 16);
    const auto i = static_cast<size_t>(id);
    const int32_t held = seq_holds[i] + cache_holds[i];
    switch (rng() % 5) {
      case 0:
        if (pool.available() > 0) {
          const int32_t got = pool.take();
          ++seq_holds[static_cast<size_t>(got)];
        }
        break;
      case 1:
        if (held > 0) {
          pool.share(id);
          ++seq_holds[i];
        }
        break;
      case 2:
        if (seq_holds[i] > 0) {
          pool.give(id);
          --seq_holds[i];
        }
        break;
      case 3:
        if (held > 0) {
          pool.keep(id);
          ++cache_holds[i];
        }
        break;
      default:
        if (cache_holds[i] > 0) {
          pool.unkeep(id);
          --cache_holds[i];
        }
        break;
    }
    int32_t alone = 0;
    for (size_t b = 0; b < 16; ++b) {
      ASSERT_EQ(pool.holders(static_cast<int32_t>(b)), seq_holds[b] + cache_holds[b]) << step;
      alone += cache_holds[b] > 0 && seq_holds[b] == 0;
    }
    ASSERT_EQ(pool.kept_alone(), alone) << step;
  }
  BlockPool p2(2);
  const int32_t b = p2.take();
  p2.keep(b);
  p2.give(b);  // the sequence's hold
  EXPECT_EQ(p2.kept_alone(), 1);
  EXPECT_THROW(
      {
        try {
          p2.give(b);
        } catch (const Error& e) {
          EXPECT_STREQ(e.what(), "KV block pool: giving back the prefix cache's hold (unkeep it)");
          throw;
        }
      },
      Error);
  p2.unkeep(b);
  EXPECT_EQ(p2.kept_alone(), 0);
  EXPECT_EQ(p2.available(), 2);
}

TEST(PrefixCacheBlocks, SlidingWindowHeadsNeedOnlyTheBlocksTheyKeep) {
  // Layer 0 dense, layer 1 a window of 4 rows: at length 20 layer 1 keeps block 4 only (rows 16-19).
  const PagedKVShape shape{2, 1, 8, 4};
  const std::vector<KVRetention> ret{{}, {0, 4}};
  BlockPool pool(64);
  PrefixCache cache(4);
  const std::vector<int32_t> doc = random_tokens(20, 100, 3);
  SequenceBlocks s(shape, ret);
  s.grow(20, pool);
  EXPECT_EQ(s.table(1, 0)[0], -1);
  cache.insert(doc, s, 5, pool);
  EXPECT_EQ(cache.ids_held(), 5 + 1);
  EXPECT_EQ(cache.entries(), 5);
  // At 20 rows (5 blocks) the window's blocks are there; at 12 rows (3 blocks) layer 1 would need block 2: gone.
  SequenceBlocks t(shape, ret);
  EXPECT_EQ(cache.match(doc + random_tokens(3, 100, 4), 5, t).size(), 5u);
  EXPECT_EQ(cache.match(std::vector<int32_t>(doc.begin(), doc.begin() + 13), 5, t).size(), 0u);
  s.release(pool);
  cache.clear(pool);
}

TEST(PrefixCacheBlocks, EvictsLeastRecentlyUsedFirst) {
  BlockPool pool(8);
  PrefixCache cache(4);
  const std::vector<int32_t> a = random_tokens(4, 100, 5), b = random_tokens(4, 100, 6);
  for (const auto* toks : {&a, &b}) {
    SequenceBlocks s = dense_seq();
    s.grow(4, pool);
    cache.insert(*toks, s, 1, pool);
    s.release(pool);
  }
  SequenceBlocks probe = dense_seq();
  EXPECT_EQ(cache.match(a, 1, probe).size(), 1u);  // a is now the most recently used
  EXPECT_EQ(pool.available(), 4);
  EXPECT_EQ(cache.evict(pool, 6), 1);  // b's entry goes
  EXPECT_EQ(pool.available(), 6);
  EXPECT_TRUE(cache.match(b, 1, probe).empty());
  EXPECT_EQ(cache.match(a, 1, probe).size(), 1u);
}

// ---- the batched engine: cached prefixes change no token ----

// Whether some layer of the model has a sliding window (Gemma-3's local layers, Mistral): its early blocks are gone
// once a prompt runs past the window, so a prompt that shares only the start of another finds nothing to adopt.
bool windowed(const Model& m) {
  for (const auto& l : m.config().layers)
    if (l.sliding_window > 0) return true;
  return false;
}

BatchEngineOptions small(bool cache) {
  BatchEngineOptions o;
  o.chunk_size = 16;
  o.block_tokens = 8;
  o.max_batch = 4;
  o.prefix_cache = cache;
  return o;
}

// Runs the requests one after another (each to its end before the next: its blocks are cached by then), or all at
// once; returns the tokens and each request's cached_tokens.
struct RunResult {
  std::vector<std::vector<int32_t>> out;
  std::vector<int32_t> cached;
  BatchEngineStats stats;
};
RunResult run(const Model& m, const BatchEngineOptions& o, const std::vector<BatchRequest>& reqs, bool one_by_one) {
  CpuBatchBackend backend(m);
  BatchEngine engine(backend, o);
  RunResult r;
  r.out.resize(reqs.size());
  r.cached.assign(reqs.size(), -1);
  std::map<int64_t, size_t> index;
  auto drain = [&] {
    while (engine.busy())
      for (const BatchEvent& e : engine.step()) {
        const size_t i = index.at(e.id);
        if (e.token >= 0) r.out[i].push_back(e.token);
        if (e.cached_tokens >= 0) r.cached[i] = e.cached_tokens;
        if (e.finished && e.reason == FinishReason::kError) throw Error(e.error);
      }
  };
  for (size_t i = 0; i < reqs.size(); ++i) {
    index[engine.submit(reqs[i])] = i;
    if (one_by_one) drain();
  }
  drain();
  r.stats = engine.stats();
  EXPECT_EQ(engine.blocks().used(), engine.prefix_cache().ids_held());
  EXPECT_EQ(engine.kv_bytes_in_use(), 0.0);
  return r;
}

BatchRequest request(std::vector<int32_t> prompt, int32_t n, uint64_t sample_seed = 0) {
  BatchRequest r;
  r.prompt = std::move(prompt);
  r.options.max_new_tokens = n;
  if (sample_seed != 0) {
    r.options.sampling.temperature = 0.8f;
    r.options.sampling.top_k = 20;
    r.options.sampling.seed = sample_seed;
  }
  return r;
}

class PrefixCacheEngine : public ::testing::TestWithParam<const char*> {};

TEST_P(PrefixCacheEngine, SharedDocumentDifferentQuestions) {
  const Model& m = fixture(GetParam());
  const int32_t V = m.config().vocab_size;
  const std::vector<int32_t> doc = random_tokens(100, V, 11);
  const std::vector<BatchRequest> reqs{request(doc + random_tokens(9, V, 12), 10),
                                       request(doc + random_tokens(13, V, 13), 10, 7),
                                       request(doc + random_tokens(5, V, 14), 10)};
  for (bool one_by_one : {true, false}) {
    const RunResult cached = run(m, small(true), reqs, one_by_one);
    const RunResult plain = run(m, small(false), reqs, one_by_one);
    EXPECT_EQ(cached.out, plain.out) << (one_by_one ? "one by one" : "at once");
    EXPECT_EQ(plain.stats.cached_tokens, 0);
    EXPECT_EQ(cached.cached[0], 0);
    if (!windowed(m)) {
      // Later requests find the document's 12 full blocks (96 tokens); one at a time or admitted after the first
      // one's prefill, whose prompt blocks are cached when its prefill ends.
      EXPECT_EQ(cached.cached[1], 96) << (one_by_one ? "one by one" : "at once");
      EXPECT_EQ(cached.cached[2], 96);
      EXPECT_EQ(cached.stats.prefix_hits, 2);
      EXPECT_EQ(cached.stats.prefill_tokens, plain.stats.prefill_tokens - 2 * 96);
    }
  }
}

TEST_P(PrefixCacheEngine, SecondTurnAdoptsTheFirstTurnsAnswer) {
  const Model& m = fixture(GetParam());
  const int32_t V = m.config().vocab_size;
  const std::vector<int32_t> turn1 = random_tokens(61, V, 21);
  const RunResult first = run(m, small(true), {request(turn1, 20)}, true);
  // The second turn: the first prompt, its answer, a new question.
  const std::vector<int32_t> turn2 = turn1 + first.out[0] + random_tokens(7, V, 22);
  const std::vector<BatchRequest> reqs{request(turn1, 20), request(turn2, 12, 3)};
  const RunResult cached = run(m, small(true), reqs, true);
  const RunResult plain = run(m, small(false), reqs, true);
  EXPECT_EQ(cached.out, plain.out);
  // The first turn's K/V covers its prompt and all but its last generated token: 61 + 19 = 80 rows, 10 blocks (the
  // window layers' last blocks among them).
  EXPECT_EQ(cached.cached[1], 80);
}

TEST_P(PrefixCacheEngine, CachedBlocksGoWhenTheBudgetNeedsThem) {
  const Model& m = fixture(GetParam());
  const int32_t V = m.config().vocab_size;
  const ModelConfig& c = m.config();
  BatchEngineOptions o = small(true);
  // Room for one 120-token sequence (15 blocks per layer and kv head) and a little more.
  o.kv_bytes = 18.0 * c.num_layers * c.num_kv_heads * (2.0 * 8 * c.head_dim * sizeof(float));
  std::vector<BatchRequest> reqs;
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back(request(random_tokens(100, V, 30 + i), 20));
  reqs.push_back(request(reqs[3].prompt, 20));  // the last one's blocks are still cached: a hit
  const RunResult cached = run(m, o, reqs, true);
  BatchEngineOptions p = o;
  p.prefix_cache = false;
  EXPECT_EQ(cached.out, run(m, p, reqs, true).out);
  if (!windowed(m)) {  // (a window's sequences hold a few blocks: no room was short)
    EXPECT_GT(cached.stats.prefix_evictions, 0);
    EXPECT_EQ(cached.cached[4], 96);
  }
}

// Closed-loop clients (bench/server/load.py's shape, issue 34's "--step-tokens loses the prefix cache?"): each of
// `clients` sends the same prompt and, when its answer ends, sends it again (between two steps, as the server's
// loop submits), `rounds` times in all; client c's first request arrives before step c * stagger (stagger 0: all at
// once; more: while earlier ones decode). Odd clients sample (their own seed), even ones are greedy.
struct LoopResult {
  std::vector<std::vector<int32_t>> out;  // [client * rounds + round]: the tokens
  std::vector<int32_t> cached;            // the same: cached_tokens of its first event
  std::vector<int64_t> sent_step;         // the same: the step before which it was submitted
  std::vector<int64_t> first_step;        // the same: the step that brought its first token
  BatchEngineStats stats;
};
LoopResult closed_loop(BatchBackend& backend, const BatchEngineOptions& o, const std::vector<int32_t>& prompt,
                       int32_t clients, int32_t rounds, int64_t stagger, int32_t max_new, bool distinct = false) {
  BatchEngine engine(backend, o);
  const auto total = static_cast<size_t>(clients * rounds);
  LoopResult r;
  r.out.resize(total);
  r.cached.assign(total, -1);
  r.first_step.assign(total, -1);
  r.sent_step.assign(total, -1);
  int64_t step = 0;
  std::map<int64_t, size_t> index;  // engine id -> client * rounds + round
  std::vector<int32_t> sent(static_cast<size_t>(clients), 0);
  auto send = [&](int32_t c) {
    const size_t i = static_cast<size_t>(c * rounds + sent[static_cast<size_t>(c)]++);
    r.sent_step[i] = step;
    std::vector<int32_t> p = prompt;
    if (distinct) p[0] = static_cast<int32_t>(i);  // load.py's "Note <request id>:" in front
    index[engine.submit(request(std::move(p), max_new, c % 2 == 1 ? 100 + static_cast<uint64_t>(i) : 0))] = i;
  };
  for (;; ++step) {
    for (int32_t c = 0; c < clients; ++c)
      if (sent[static_cast<size_t>(c)] == 0 && step >= c * stagger) send(c);
    const bool all_sent = sent.back() > 0;
    if (!engine.busy() && all_sent) break;
    for (const BatchEvent& e : engine.step()) {
      const size_t i = index.at(e.id);
      if (e.finished && e.reason == FinishReason::kError) throw Error(e.error);
      if (e.token >= 0) {
        if (r.out[i].empty()) r.first_step[i] = step;
        r.out[i].push_back(e.token);
      }
      if (e.cached_tokens >= 0) r.cached[i] = e.cached_tokens;
      const auto c = static_cast<int32_t>(i) / rounds;
      if (e.finished && sent[static_cast<size_t>(c)] < rounds) send(c);
    }
  }
  r.stats = engine.stats();
  EXPECT_EQ(engine.blocks().used(), engine.prefix_cache().ids_held());
  EXPECT_EQ(engine.reserved_blocks(), 0);
  return r;
}

// A token budget per step changes how prompts are cut into chunks, not what the prefix cache finds: identical
// prompts from closed-loop clients, all at once or arriving while others decode, get the same prefix hits and cached
// tokens and the same tokens with step_tokens 0 (one chunk of chunk_size a step, here the whole prompt, as on the
// GPU) and with budgets of 64 and 128. Where the cache hits (every request after the first), the largest decode batch
// is the same too and no request sent after the first prompt's prefill waits more steps for its first token under a
// budget (several short cached-prompt remainders share a step). (gemma3's fixture keeps 8-token windows in 16-token
// blocks: a windowed layer no longer holds the block before the match point, so it finds nothing in either mode,
// and each 200-token prompt then takes 200 / budget steps, one prompt after the other.)
TEST_P(PrefixCacheEngine, TokenBudgetKeepsThePrefixHitsOfIdenticalPrompts) {
  const Model& m = fixture(GetParam());
  const std::vector<int32_t> prompt = random_tokens(200, m.config().vocab_size, 51);
  const int32_t clients = 6, rounds = 2, max_new = 10;
  BatchEngineOptions o = small(true);
  o.chunk_size = 512;
  o.block_tokens = 16;
  o.max_batch = 8;
  for (int64_t stagger : {0, 3}) {
    CpuBatchBackend plain_backend(m);
    const LoopResult plain = closed_loop(plain_backend, o, prompt, clients, rounds, stagger, max_new);
    if (!windowed(m)) {
      // Every request after the first adopts the prompt's 12 full blocks (the last token is prefilled): 192 tokens.
      EXPECT_EQ(plain.stats.prefix_hits, clients * rounds - 1) << "stagger " << stagger;
      EXPECT_EQ(plain.stats.cached_tokens, (clients * rounds - 1) * 192) << "stagger " << stagger;
    }
    for (int32_t budget : {64, 128}) {
      BatchEngineOptions b = o;
      b.step_tokens = budget;
      CpuBatchBackend backend(m);
      const LoopResult got = closed_loop(backend, b, prompt, clients, rounds, stagger, max_new);
      const std::string where = "stagger " + std::to_string(stagger) + ", step_tokens " + std::to_string(budget);
      EXPECT_EQ(got.out, plain.out) << where;
      EXPECT_EQ(got.cached, plain.cached) << where;
      EXPECT_EQ(got.stats.prefix_hits, plain.stats.prefix_hits) << where;
      EXPECT_EQ(got.stats.cached_tokens, plain.stats.cached_tokens) << where;
      EXPECT_EQ(got.stats.prefill_tokens, plain.stats.prefill_tokens) << where;
      EXPECT_LE(got.stats.max_step_tokens, budget) << where;
      if (plain.stats.prefix_hits < clients * rounds - 1) continue;
      EXPECT_EQ(got.stats.max_decode_batch, plain.stats.max_decode_batch) << where;
      // Admission does not stall: a request sent once the first prompt's prefill has ended (200 / budget steps under
      // a budget, one without) waits no more steps for its first token than without a budget.
      for (size_t i = 0; i < got.first_step.size(); ++i)
        if (got.sent_step[i] > got.first_step[0]) {
          EXPECT_LE(got.first_step[i] - got.sent_step[i], plain.first_step[i] - plain.sent_step[i])
              << where << ", request " << i;
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCacheEngine, ::testing::Values("llama3", "qwen2", "gemma3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

// The scheduler alone at the scale of issue 34's H200 run (bench/server/load.py: 32 clients x 2 requests of the
// same 6,009-token prompt, 32 tokens out, --parallel 32, blocks of 64 tokens, the GPU's 32K prefill chunk, --step-tokens
// 512): a backend that computes nothing (every logit 0: the same token each time) and counts the prefill rows it runs.
class CountingBackend final : public BatchBackend {
 public:
  explicit CountingBackend(ModelConfig cfg) : cfg_(std::move(cfg)) {}
  const ModelConfig& config() const override { return cfg_; }
  const char* device_name() const override { return "counting"; }
  double block_bytes(const PagedKVShape&) const override { return 1.0; }
  double default_kv_bytes() const override { return 1e6; }
  void create_store(const PagedKVShape&, int32_t, int32_t, int32_t) override {}
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t, int32_t, const attn::AttentionPolicy*,
                                   bool logits) override {
    prefill_rows += static_cast<int64_t>(tokens.size());
    return logits ? std::vector<float>(static_cast<size_t>(cfg_.vocab_size), 0.0f) : std::vector<float>{};
  }
  void finish_prefill(const SequenceBlocks&, std::span<const DecodeView>) override {}
  void release_sequence(const SequenceBlocks&) override {}
  void abort_prefill() override {}
  bool supports_prefix_cache() const override { return true; }
  void load_prefix(const SequenceBlocks&, int32_t rows, int32_t) override { loaded_rows += rows; }
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow>) override {
    return std::vector<float>(tokens.size() * static_cast<size_t>(cfg_.vocab_size), 0.0f);
  }
  ForwardTimers timers() const override { return {}; }
  int64_t prefill_rows = 0, loaded_rows = 0;

 private:
  ModelConfig cfg_;
};

TEST(PrefixCacheEngineOptions, TokenBudgetKeepsThePrefixHitsAtServerScale) {
  ModelConfig cfg = fixture("llama3").config();
  cfg.context_length = 8192;
  const std::vector<int32_t> prompt = random_tokens(6009, cfg.vocab_size, 61);
  BatchEngineOptions o;
  o.chunk_size = 32768;
  o.block_tokens = 64;
  o.max_batch = 32;
  o.kv_bytes = 524288;
  for (int64_t stagger : {0, 2}) {
    CountingBackend plain_backend(cfg);
    const LoopResult plain = closed_loop(plain_backend, o, prompt, 32, 2, stagger, 32);
    // Every request but the first adopts 93 blocks (5,952 tokens) and prefills the other 57.
    EXPECT_EQ(plain.stats.prefix_hits, 63);
    EXPECT_EQ(plain.stats.cached_tokens, 63 * 5952);
    EXPECT_EQ(plain_backend.prefill_rows, 6009 + 63 * 57);
    for (int32_t budget : {512, 128}) {
      BatchEngineOptions b = o;
      b.step_tokens = budget;
      CountingBackend backend(cfg);
      const LoopResult got = closed_loop(backend, b, prompt, 32, 2, stagger, 32);
      const std::string where = "stagger " + std::to_string(stagger) + ", step_tokens " + std::to_string(budget);
      EXPECT_EQ(got.out, plain.out) << where;
      EXPECT_EQ(got.cached, plain.cached) << where;
      EXPECT_EQ(got.stats.prefix_hits, plain.stats.prefix_hits) << where;
      EXPECT_EQ(backend.prefill_rows, plain_backend.prefill_rows) << where;
      // Several cached-prompt remainders (57 tokens + a decode row each) share a step: at least as many decode at once.
      EXPECT_GE(got.stats.max_decode_batch, plain.stats.max_decode_batch) << where;
    }
  }
  // What the H200 run measured: load.py puts "Note <request id>:" before every prompt (so that no server reuses
  // another request's prompt), so no prompt is cached, with a budget or without. Without one, each 6,009-token
  // prompt is prefilled in one step (chunk_size 32K) and the next is admitted in the next step: 31 decode at once.
  // With 512 tokens a step, a prompt takes 12 steps and prompts are prefilled one after the other, so a new answer
  // starts at most every 12 steps while each lasts 32 tokens: at most 32 / 12 + 1 decode at once (the H200: largest
  // batch 7 over the closed loop and the mixed run together).
  for (int32_t budget : {0, 512}) {
    BatchEngineOptions b = o;
    b.step_tokens = budget;
    CountingBackend backend(cfg);
    const LoopResult got = closed_loop(backend, b, prompt, 32, 2, 0, 32, true);
    const std::string where = "distinct prompts, step_tokens " + std::to_string(budget);
    EXPECT_EQ(got.stats.prefix_hits, 0) << where;
    EXPECT_EQ(backend.prefill_rows, 64 * 6009) << where;
    if (budget == 0) {
      EXPECT_EQ(got.stats.max_decode_batch, 31) << where;
    } else {
      EXPECT_LE(got.stats.max_decode_batch, 32 / 12 + 1) << where;
    }
  }
}

// ---- What a staged prefix holds (issue 34) ----
// A backend that computes no model but traces contents: every kept row of every (layer, kv head) block holds a tag
// (the chain hash of the tokens up to and including its position, salted with its table) and the row's token;
// finish_prefill writes the staged rows' tags into the sequence's blocks, a decode step reads the previous row's tag
// through every table that keeps it and writes the new row's, load_prefix reads the cached rows back through the
// sequence's tables. Each read checks what it finds against the tokens the rows were written for (a wrong block, a
// block of another table or another sequence, a row never written, a freed block written again since: all show),
// and the logits name the token chain(prefix) % vocab, so the tokens themselves depend on every row read.
class TracingBackend final : public BatchBackend {
 public:
  explicit TracingBackend(ModelConfig cfg) : cfg_(std::move(cfg)) {}
  const ModelConfig& config() const override { return cfg_; }
  const char* device_name() const override { return "tracing"; }
  double block_bytes(const PagedKVShape&) const override { return 1.0; }
  double default_kv_bytes() const override { return 1e6; }
  void create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t, int32_t) override {
    shape_ = shape;
    rows_.assign(static_cast<size_t>(num_blocks) * static_cast<size_t>(shape.block_tokens), Row{});
  }
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t,
                                   const attn::AttentionPolicy*, bool logits) override {
    if (pos == 0) staged_.clear();
    if (static_cast<int32_t>(staged_.size()) != pos) {
      fail("a prefill chunk at " + std::to_string(pos) + " after " + std::to_string(staged_.size()) + " staged rows");
      staged_.resize(static_cast<size_t>(pos));
    }
    for (int32_t t : tokens) staged_.push_back(Row{next(staged_.empty() ? kStart : staged_.back().chain, t), t});
    return logits ? logits_of(staged_.back().chain) : std::vector<float>{};
  }
  void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView>) override {
    if (static_cast<int64_t>(staged_.size()) != seq.length()) fail("finish_prefill: staged rows != the sequence's");
    for (size_t i = 0; i < seq.tables(); ++i)
      for (int64_t p = 0; p < seq.length() && p < static_cast<int64_t>(staged_.size()); ++p)
        if (Row* r = at(seq, i, p)) {
          const Row& s = staged_[static_cast<size_t>(p)];
          *r = Row{s.chain ^ salt(i), s.token};
        }
    staged_.clear();
  }
  void release_sequence(const SequenceBlocks&) override {}
  void abort_prefill() override { staged_.clear(); }
  bool supports_prefix_cache() const override { return true; }
  void load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t) override {
    ++loads;
    staged_.assign(static_cast<size_t>(rows), Row{0, -1});
    std::vector<bool> seen(static_cast<size_t>(rows), false);
    for (size_t i = 0; i < seq.tables(); ++i)
      for (int64_t p = 0; p < rows; ++p) {
        const Row* r = at(seq, i, p);
        if (r == nullptr) continue;
        const Row found{r->chain ^ salt(i), r->token};
        Row& s = staged_[static_cast<size_t>(p)];
        if (!seen[static_cast<size_t>(p)]) {
          s = found;
          seen[static_cast<size_t>(p)] = true;
        } else if (!(s == found)) {
          fail("load_prefix: row " + std::to_string(p) + " of table " + std::to_string(i) +
               " holds another token chain than the other tables' row");
        }
      }
    // The rows every table dropped (a window's early rows, on a model with no global layer) cannot be checked; the
    // chain of those that can: each row's tag follows from the previous row's and its own token.
    for (int64_t p = 1; p < rows; ++p)
      if (seen[static_cast<size_t>(p)] && seen[static_cast<size_t>(p - 1)] &&
          staged_[static_cast<size_t>(p)].chain !=
              next(staged_[static_cast<size_t>(p - 1)].chain, staged_[static_cast<size_t>(p)].token))
        fail("load_prefix: row " + std::to_string(p) + " does not follow row " + std::to_string(p - 1));
    if (rows > 0 && !seen[static_cast<size_t>(rows - 1)]) fail("load_prefix: the last cached row is in no block");
  }
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) override {
    std::vector<float> out;
    for (size_t r = 0; r < rows.size(); ++r) {
      const SequenceBlocks& seq = *rows[r].seq;
      const int64_t pos = seq.length() - 1;
      uint64_t prev = kStart;
      if (pos > 0) {
        bool have = false;
        for (size_t i = 0; i < seq.tables(); ++i) {
          const Row* row = at(seq, i, pos - 1);
          if (row == nullptr) {
            fail("decode: row " + std::to_string(pos - 1) + " is not kept by table " + std::to_string(i));
            continue;
          }
          const uint64_t c = row->chain ^ salt(i);
          if (have && c != prev) fail("decode: the tables disagree on row " + std::to_string(pos - 1));
          prev = c;
          have = true;
        }
      }
      const uint64_t chain = next(prev, tokens[r]);
      for (size_t i = 0; i < seq.tables(); ++i)
        if (Row* row = at(seq, i, pos)) *row = Row{chain ^ salt(i), tokens[r]};
        else fail("decode: the new row " + std::to_string(pos) + " has no block in table " + std::to_string(i));
      const std::vector<float> l = logits_of(chain);
      out.insert(out.end(), l.begin(), l.end());
    }
    return out;
  }
  ForwardTimers timers() const override { return {}; }

  int64_t errors = 0, loads = 0;
  std::string first_error;

 private:
  struct Row {
    uint64_t chain = 0;
    int32_t token = -1;
    bool operator==(const Row&) const = default;
  };
  static constexpr uint64_t kStart = 0x6a09e667f3bcc908ull;
  static uint64_t next(uint64_t chain, int32_t token) {
    uint64_t x = chain ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  static uint64_t salt(size_t table) { return next(0x5bd1e995ull, static_cast<int32_t>(table)); }
  // The row of position p in table i's block, or null where the table keeps none.
  Row* at(const SequenceBlocks& seq, size_t i, int64_t p) {
    const int64_t b = p / shape_.block_tokens;
    const std::vector<int32_t>& t = seq.table(i);
    if (p < 0 || b >= static_cast<int64_t>(t.size()) || t[static_cast<size_t>(b)] < 0) return nullptr;
    return &rows_[static_cast<size_t>(t[static_cast<size_t>(b)]) * static_cast<size_t>(shape_.block_tokens) +
                  static_cast<size_t>(p % shape_.block_tokens)];
  }
  std::vector<float> logits_of(uint64_t chain) const {
    std::vector<float> l(static_cast<size_t>(cfg_.vocab_size), 0.0f);
    l[static_cast<size_t>(chain % static_cast<uint64_t>(cfg_.vocab_size))] = 1.0f;
    return l;
  }
  void fail(const std::string& what) {
    if (errors++ == 0) first_error = what;
  }

  ModelConfig cfg_;
  PagedKVShape shape_;
  std::vector<Row> rows_;    // [block id, row]
  std::vector<Row> staged_;  // the staged sequence's rows (chain unsalted)
};

// The GPU case that fails (prefix_cache_gpu_test ConcurrentConversationsEqualUncached: Gemma-3-270M's 18 layers, one
// KV head, windows of 512 in five of every six layers, 4 conversations over ~28K-token documents, 3 turns of 24
// tokens, chunks of 2,048, blocks of 64, each next turn submitted when its answer ends) on the tracing backend: every
// staged prefix and every decode reads the rows its tokens wrote, and the tokens equal the uncached run's.
TEST(PrefixCacheEngineOptions, ConcurrentConversationsStageWhatTheirTokensWrote) {
  ModelConfig cfg = fixture("gemma3").config();
  cfg.num_layers = 18;
  cfg.num_kv_heads = 1;
  cfg.num_q_heads = 4;
  cfg.context_length = 32768;
  cfg.layers.assign(18, LayerConfig{});
  for (int32_t l = 0; l < 18; ++l) cfg.layers[static_cast<size_t>(l)].sliding_window = (l + 1) % 6 == 0 ? 0 : 512;
  constexpr int kClients = 4, kTurns = 3;
  for (const int64_t first_turn : {int64_t{28124}, int64_t{1500}}) {
    std::vector<std::vector<std::vector<int32_t>>> answers[2];
    int64_t hits[2] = {0, 0};
    for (const bool cache : {true, false}) {
      TracingBackend backend(cfg);
      BatchEngineOptions o;
      o.chunk_size = 2048;
      o.block_tokens = 64;
      o.max_batch = kClients;
      o.kv_bytes = 122070;  // the GPU test's 8e9 bytes in blocks of 64 rows x 256 dims, K and V in bf16
      o.prefix_cache = cache;
      BatchEngine engine(backend, o);
      std::vector<std::vector<int32_t>> prompt(kClients);
      std::vector<std::vector<std::vector<int32_t>>> got(kClients);
      std::vector<int64_t> id(kClients, -1);
      auto submit = [&](int c) {
        std::vector<int32_t>& p = prompt[static_cast<size_t>(c)];
        const auto k = static_cast<uint32_t>(got[static_cast<size_t>(c)].size());
        if (k == 0)
          p = random_tokens(static_cast<int32_t>(first_turn - 100 + 17 * c), cfg.vocab_size,
                            900 + static_cast<uint32_t>(c));
        else
          p = p + got[static_cast<size_t>(c)].back();
        p = p + random_tokens(17 + static_cast<int32_t>(k), cfg.vocab_size, 950 + 10 * k + static_cast<uint32_t>(c));
        BatchRequest r;
        r.prompt = p;
        r.options.max_new_tokens = 24;
        id[static_cast<size_t>(c)] = engine.submit(r);
        got[static_cast<size_t>(c)].emplace_back();
      };
      for (int c = 0; c < kClients; ++c) submit(c);
      while (engine.busy())
        for (const BatchEvent& e : engine.step()) {
          ASSERT_NE(e.reason, FinishReason::kError) << e.error;
          const auto c = static_cast<size_t>(std::find(id.begin(), id.end(), e.id) - id.begin());
          if (c >= id.size()) continue;
          if (e.token >= 0) got[c].back().push_back(e.token);
          if (e.finished && got[c].size() < static_cast<size_t>(kTurns)) submit(static_cast<int>(c));
        }
      const std::string where = std::to_string(first_turn) + " tokens, cache " + (cache ? "on" : "off");
      EXPECT_EQ(backend.errors, 0) << where << ": " << backend.first_error;
      EXPECT_EQ(backend.loads, cache ? kClients * (kTurns - 1) : 0) << where;
      answers[cache ? 0 : 1] = got;
      hits[cache ? 0 : 1] = engine.stats().prefix_hits;
    }
    EXPECT_EQ(hits[0], kClients * (kTurns - 1)) << first_turn;
    EXPECT_EQ(hits[1], 0) << first_turn;
    EXPECT_EQ(answers[0], answers[1]) << first_turn << " tokens: the cached run's answers differ";
  }
}

TEST(PrefixCacheEngineOptions, SparseRequestsAreNotCached) {
  const Model& m = fixture("llama3");
  const ModelConfig& c = m.config();
  const std::vector<int32_t> doc = random_tokens(100, c.vocab_size, 41);
  BatchRequest sparse = request(doc + random_tokens(5, c.vocab_size, 42), 5);
  sparse.policy = attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads,
                                                 attn::AShapePattern{4, 16});
  // The sparse request's blocks are not cached; the dense one after it finds nothing; a sparse one after a dense
  // one does not adopt (its keys would differ).
  const RunResult r = run(m, small(true), {sparse, request(doc + random_tokens(7, c.vocab_size, 43), 5), sparse}, true);
  EXPECT_EQ(r.cached, (std::vector<int32_t>{0, 0, 0}));
}

}  // namespace
}  // namespace tessera::runtime
