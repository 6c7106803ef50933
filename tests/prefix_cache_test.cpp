// Prefix caching (runtime/prefix_cache.h) in the batched engine: the block bookkeeping (shared blocks, the chain of
// keys, adoption under sliding windows, least-recently-used eviction), and a request that adopts cached blocks
// generating exactly the tokens it generates without the cache, on every fixture architecture: a shared document
// with different questions, a second turn over the first turn's answer, requests running at once, a KV budget so
// small that cached blocks must go.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "runtime/batch_engine.h"
#include "runtime/prefix_cache.h"

namespace tessera::runtime {
namespace {

const Model& fixture(const char* name) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[name];
  if (!m) m = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/" + name);
  return *m;
}

std::vector<int32_t> tokens(int32_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

std::vector<int32_t> operator+(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

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
  const std::vector<int32_t> doc = tokens(14, 100, 1);  // three full blocks and two rows
  SequenceBlocks s = dense_seq();
  s.grow(14, pool);
  cache.insert(doc, s, 3, pool);
  EXPECT_EQ(cache.entries(), 3);
  EXPECT_EQ(cache.ids_held(), 6);
  EXPECT_EQ(pool.holders(s.table(0, 0)[0]), 2);

  // The same first 12 tokens, then others: three blocks (at most max_blocks).
  SequenceBlocks t = dense_seq();
  const std::vector<int32_t> q = std::vector<int32_t>(doc.begin(), doc.begin() + 12) + tokens(9, 100, 2);
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

TEST(PrefixCacheBlocks, SlidingWindowHeadsNeedOnlyTheBlocksTheyKeep) {
  // Layer 0 dense, layer 1 a window of 4 rows: at length 20 layer 1 keeps block 4 only (rows 16-19).
  const PagedKVShape shape{2, 1, 8, 4};
  const std::vector<KVRetention> ret{{}, {0, 4}};
  BlockPool pool(64);
  PrefixCache cache(4);
  const std::vector<int32_t> doc = tokens(20, 100, 3);
  SequenceBlocks s(shape, ret);
  s.grow(20, pool);
  EXPECT_EQ(s.table(1, 0)[0], -1);
  cache.insert(doc, s, 5, pool);
  EXPECT_EQ(cache.ids_held(), 5 + 1);
  EXPECT_EQ(cache.entries(), 5);
  // At 20 rows (5 blocks) the window's blocks are there; at 12 rows (3 blocks) layer 1 would need block 2: gone.
  SequenceBlocks t(shape, ret);
  EXPECT_EQ(cache.match(doc + tokens(3, 100, 4), 5, t).size(), 5u);
  EXPECT_EQ(cache.match(std::vector<int32_t>(doc.begin(), doc.begin() + 13), 5, t).size(), 0u);
  s.release(pool);
  cache.clear(pool);
}

TEST(PrefixCacheBlocks, EvictsLeastRecentlyUsedFirst) {
  BlockPool pool(8);
  PrefixCache cache(4);
  const std::vector<int32_t> a = tokens(4, 100, 5), b = tokens(4, 100, 6);
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
  const std::vector<int32_t> doc = tokens(100, V, 11);
  const std::vector<BatchRequest> reqs{request(doc + tokens(9, V, 12), 10), request(doc + tokens(13, V, 13), 10, 7),
                                       request(doc + tokens(5, V, 14), 10)};
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
  const std::vector<int32_t> turn1 = tokens(61, V, 21);
  const RunResult first = run(m, small(true), {request(turn1, 20)}, true);
  // The second turn: the first prompt, its answer, a new question.
  const std::vector<int32_t> turn2 = turn1 + first.out[0] + tokens(7, V, 22);
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
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back(request(tokens(100, V, 30 + i), 20));
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

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCacheEngine, ::testing::Values("llama3", "qwen2", "gemma3", "mistral"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

TEST(PrefixCacheEngineOptions, SparseRequestsAreNotCached) {
  const Model& m = fixture("llama3");
  const ModelConfig& c = m.config();
  const std::vector<int32_t> doc = tokens(100, c.vocab_size, 41);
  BatchRequest sparse = request(doc + tokens(5, c.vocab_size, 42), 5);
  sparse.policy = attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads,
                                                 attn::AShapePattern{4, 16});
  // The sparse request's blocks are not cached; the dense one after it finds nothing; a sparse one after a dense
  // one does not adopt (its keys would differ).
  const RunResult r = run(m, small(true), {sparse, request(doc + tokens(7, c.vocab_size, 43), 5), sparse}, true);
  EXPECT_EQ(r.cached, (std::vector<int32_t>{0, 0, 0}));
}

}  // namespace
}  // namespace tessera::runtime
