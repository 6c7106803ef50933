// The GPU prefix cache (runtime/prefix_cache.h, GpuBatchBackend::load_prefix) at the shapes of the multi-turn workload
// that gave other answers on an H200 (bench/server/prefix_turns.py, Gemma-3-270M, ~28K-token documents, 4 clients x 4
// turns: the cached second turns began with a newline where the uncached ones named the answer). The small synthetic
// tests in batch_gpu_test (64-token chunks, ~1K tokens) pass; these run the real models with real text, the engine's
// 2,048-token chunks, a cached prefix that is not a multiple of the chunk nor of the 128-row query tile, and a tail
// that spans a partial tile (79 rows) or fits a 64-row one (47 rows), over a context long enough for split-K units
// (>= 8,192 keys an item) and past the 512-token sliding windows:
//   StagedPrefixEqualsTheDirectPrefill  the backend alone: a tail prefilled after load_prefix (the cached blocks
//                                       staged back from the pool) against the same tail prefilled after the same
//                                       chunks computed in place (equal: the same products on the same keys), and
//                                       against the whole prompt prefilled in 2,048-token chunks (bf16 rounding)
//   SecondTurnEqualsUncached            the engine: turn 2 (turn 1's prompt, its greedy answer, a question) with the
//                                       prefix cache against --no-prefix-cache, greedy tokens (near ties allowed)
//   ConcurrentConversationsEqualUncached  the same with 4 conversations at once, 3 turns each, as the server runs them
// Models from TESSERA_MODEL_DIR / TESSERA_MODELS / ~/.cache/tessera/models; skipped when absent or without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <climits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/batch_engine.h"
#include "runtime/paged_kv.h"
#include "runtime/prefix_cache.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

// Numbered facts about made-up towns, as bench/server/prefix_turns.py writes its documents.
std::string paragraph(std::mt19937& rng, int i) {
  static const char* towns[] = {"Alder Creek", "Bramblefold", "Cinder Hollow", "Dunmere", "Elmstead", "Fallowby",
                                "Greywater", "Hartwell", "Ivybridge", "Lowmoor", "Marrowgate", "Oakhurst"};
  static const char* trades[] = {"wool", "salt", "copper", "timber", "cheese", "glass", "rope", "honey"};
  static const char* rivers[] = {"the Sable", "the Wend", "the Corrin", "the Lark", "the Ashby", "the Meade"};
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  return "Record " + std::to_string(i) + ". The town of " + towns[pick(12)] + " was founded in the year " +
         std::to_string(1100 + pick(800)) + " on the banks of " + rivers[pick(6)] + ". Its people trade mostly in " +
         trades[pick(8)] + ", and its market opens on day " + std::to_string(1 + pick(28)) +
         " of each month. The town council has " + std::to_string(3 + pick(38)) + " members, the old bridge is " +
         std::to_string(10 + pick(290)) + " meters long, and the harvest festival draws about " +
         std::to_string(100 + pick(8900)) + " visitors every autumn.\n";
}

// The document's first `count` tokens (with the model's BOS).
std::vector<int32_t> document(const model::Tokenizer& tok, int64_t count) {
  std::mt19937 rng(1000);
  std::string text = "Read the records below, then answer questions about them.\n\n";
  int records = 0;
  std::vector<int32_t> ids;
  while (static_cast<int64_t>(ids.size()) < count) {
    // ~75 tokens a record: enough records for the rest at once, then check.
    const int64_t more = std::max<int64_t>(8, (count - static_cast<int64_t>(ids.size())) / 60 + 1);
    for (int64_t k = 0; k < more; ++k) text += paragraph(rng, ++records);
    ids = tok.encode(text, {.add_special = true, .parse_special = false});
  }
  ids.resize(static_cast<size_t>(count));
  return ids;
}

using test::rel_l2;

int32_t argmax_of(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Prefills tokens [from, to) of `p` in chunks of `chunk` (the engine's walk), the last chunk's logits returned.
std::vector<float> prefill(GpuBatchBackend& b, const std::vector<int32_t>& p, int64_t from, int64_t to,
                           int64_t total, int64_t chunk) {
  std::vector<float> logits;
  for (int64_t c = from; c < to; c += chunk) {
    const int64_t e = std::min(to, c + chunk);
    logits = b.prefill_chunk(std::span<const int32_t>(p).subspan(static_cast<size_t>(c), static_cast<size_t>(e - c)),
                             static_cast<int32_t>(c), static_cast<int32_t>(total), nullptr, e == to);
  }
  return logits;
}

// ---- the concurrent conversations (ConcurrentConversationsEqualUncached and its probe) ----

constexpr int kClients = 4, kTurns = 3;

// Client c's document: records from its own seed, cut at first_turn - 100 + 17 c tokens (with the model's BOS).
std::vector<std::vector<int32_t>> conversation_documents(const model::Tokenizer& tok, int64_t first_turn) {
  std::vector<std::vector<int32_t>> docs;
  for (int c = 0; c < kClients; ++c) {
    std::mt19937 rng(static_cast<uint32_t>(2000 + c));
    std::string text = "Read the records below, then answer questions about them.\n\n";
    std::vector<int32_t> ids;
    for (int i = 1; static_cast<int64_t>(ids.size()) < first_turn - 100 + 17 * c; i += 40) {
      for (int k = 0; k < 40; ++k) text += paragraph(rng, i + k);
      ids = tok.encode(text, {.add_special = true, .parse_special = false});
    }
    ids.resize(static_cast<size_t>(first_turn - 100 + 17 * c));
    docs.push_back(ids);
  }
  return docs;
}

// The server's shape of the batched engine for these runs: 2,048-token chunks, blocks of 64, a slot per client.
BatchEngineOptions conversation_options(bool prefix_cache) {
  BatchEngineOptions o;
  o.chunk_size = 2048;
  o.block_tokens = 64;
  o.max_batch = kClients;
  o.kv_bytes = 8e9;
  o.prefix_cache = prefix_cache;
  return o;
}

// kClients conversations of kTurns turns through `engine`, as a server runs them: each client's next turn (its
// document, then every earlier answer and question, then a new question) is submitted as soon as its answer ends.
// submitted(c, prompt) before each submit; event(c, e) for every event of client c.
void run_conversations(BatchEngine& engine, const model::Tokenizer& tok, const std::vector<std::vector<int32_t>>& docs,
                       const std::function<void(int, const std::vector<int32_t>&)>& submitted,
                       const std::function<void(int, const BatchEvent&)>& event) {
  std::vector<int> turn(kClients, 0);
  std::vector<std::vector<int32_t>> prompt(kClients), answer(kClients);
  std::vector<int64_t> id(kClients, -1);
  auto submit = [&](int c) {
    std::vector<int32_t>& p = prompt[static_cast<size_t>(c)];
    const int k = turn[static_cast<size_t>(c)]++;
    if (k == 0) p = docs[static_cast<size_t>(c)];
    p.insert(p.end(), answer[static_cast<size_t>(c)].begin(), answer[static_cast<size_t>(c)].end());
    answer[static_cast<size_t>(c)].clear();
    const std::vector<int32_t> q = tok.encode("\nQuestion: What do the people of record " +
                                                  std::to_string(3 + 7 * k + c) + " trade in?\nAnswer:",
                                              {.add_special = false, .parse_special = false});
    p.insert(p.end(), q.begin(), q.end());
    submitted(c, p);
    BatchRequest r;
    r.prompt = p;
    r.options.max_new_tokens = 24;
    r.options.logprobs = 5;
    id[static_cast<size_t>(c)] = engine.submit(r);
  };
  for (int c = 0; c < kClients; ++c) submit(c);
  while (engine.busy())
    for (const BatchEvent& e : engine.step()) {
      EXPECT_NE(e.reason, FinishReason::kError) << e.error;
      const auto c = static_cast<int>(std::find(id.begin(), id.end(), e.id) - id.begin());
      if (c >= kClients) continue;
      if (e.token >= 0) answer[static_cast<size_t>(c)].push_back(e.token);
      event(c, e);
      if (e.finished && turn[static_cast<size_t>(c)] < kTurns) submit(c);
    }
}

struct Shape {
  const char* file;
  int64_t first_turn;  // turn 1's prompt (its full blocks are cached: a multiple of 64, not of 128 nor 2,048)
};

class RealModelPrefix : public ::testing::TestWithParam<Shape> {};

TEST_P(RealModelPrefix, StagedPrefixEqualsTheDirectPrefill) {
  REQUIRE_GPU();
  const std::string path = test::real_model_path(GetParam().file);
  if (path.empty()) GTEST_SKIP() << GetParam().file << " not found (TESSERA_MODEL_DIR)";
  const auto model = Model::load(path);
  const auto dev = DeviceModel::upload(*model);
  const ModelConfig& cfg = model->config();
  const auto tok = model::Tokenizer::from_gguf(model->file().metadata());
  constexpr int32_t kBlock = 64, kChunk = 2048;
  const int64_t n1 = GetParam().first_turn, c = n1 / kBlock * kBlock;
  ASSERT_NE(c % 128, 0) << "the cached prefix should not be a multiple of the 128-row query tile";
  const std::vector<int64_t> tails = {79, 47};  // a partial 128-row tile; a 64-row tile
  const std::vector<int32_t> p = document(*tok, c + tails[0]);
  const PagedKVShape shape{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kBlock};
  const auto total_blocks = static_cast<int32_t>((c + 128) / kBlock * cfg.num_layers * cfg.num_kv_heads * 2 + 64);

  // The cache's path: turn 1 prefilled and paged as the engine does, its full blocks cached, then each tail after
  // its prefix is matched, adopted and staged back.
  GpuBatchBackend d(*dev);
  d.create_store(shape, total_blocks, 4, static_cast<int32_t>(c + 256));
  BlockPool pool(total_blocks);
  const std::vector<DecodeView> views1 = decode_views(cfg, nullptr, n1);
  SequenceBlocks s1(shape, kv_retention(cfg, views1));
  prefill(d, p, 0, n1, n1, kChunk);
  s1.grow(n1, pool);
  d.finish_prefill(s1, views1);
  PrefixCache cache(kBlock);
  cache.insert(std::span<const int32_t>(p).first(static_cast<size_t>(n1)), s1, n1 / kBlock, pool);
  d.release_sequence(s1);
  s1.release(pool);
  std::vector<std::vector<float>> staged;
  for (int64_t tail : tails) {
    const int64_t n2 = c + tail;
    SequenceBlocks s2(shape, kv_retention(cfg, decode_views(cfg, nullptr, n2)));
    const auto shared = cache.match(std::span<const int32_t>(p).first(static_cast<size_t>(n2)), (n2 - 1) / kBlock, s2);
    ASSERT_EQ(static_cast<int64_t>(shared.size()), c / kBlock) << "tail " << tail;
    s2.adopt(shared, pool);
    d.load_prefix(s2, static_cast<int32_t>(c), static_cast<int32_t>(n2));
    staged.push_back(prefill(d, p, c, n2, n2, kChunk));
    d.abort_prefill();
    s2.release(pool);
  }

  // The same tails after the same chunks computed in place (no pages), and the whole prompt in 2,048-token chunks.
  GpuBatchBackend a(*dev);
  prefill(a, p, 0, n1, c + tails[0], kChunk);
  std::vector<std::vector<float>> direct;
  for (int64_t tail : tails) direct.push_back(prefill(a, p, c, c + tail, c + tails[0], kChunk));
  a.abort_prefill();
  for (size_t i = 0; i < tails.size(); ++i) {
    const int64_t n2 = c + tails[i];
    GpuBatchBackend b(*dev);
    const std::vector<float> whole = prefill(b, p, 0, n2, n2, kChunk);
    b.abort_prefill();
    const double staged_vs_direct = rel_l2(direct[i], staged[i]), direct_vs_whole = rel_l2(whole, direct[i]);
    std::printf("[prefix] %s: cached %lld of %lld tokens (tail %lld): staged vs direct rel L2 %.3g (argmax %d / %d), "
                "direct vs whole-prompt chunks rel L2 %.3g (argmax %d / %d)\n",
                GetParam().file, static_cast<long long>(c), static_cast<long long>(n2),
                static_cast<long long>(tails[i]), staged_vs_direct, argmax_of(staged[i]), argmax_of(direct[i]),
                direct_vs_whole, argmax_of(direct[i]), argmax_of(whole));
    // The same products on the same keys: only a key the staging lacks (a sliding-window layer's rows below its
    // blocks) could part them, and those are masked.
    EXPECT_LT(staged_vs_direct, 1e-4) << "tail " << tails[i];
    // Other chunk boundaries round differently (bf16), no more.
    EXPECT_LT(direct_vs_whole, 5e-2) << "tail " << tails[i];
  }
}

// Turn 2 of a conversation over the document (turn 1's prompt, its greedy answer and a question) through the engine
// with the prefix cache and without it: the same greedy tokens, or where they part a near tie of the uncached run's
// logits (other chunk boundaries round differently).
TEST_P(RealModelPrefix, SecondTurnEqualsUncached) {
  REQUIRE_GPU();
  const std::string path = test::real_model_path(GetParam().file);
  if (path.empty()) GTEST_SKIP() << GetParam().file << " not found (TESSERA_MODEL_DIR)";
  const auto model = Model::load(path);
  const auto dev = DeviceModel::upload(*model);
  const auto tok = model::Tokenizer::from_gguf(model->file().metadata());
  const int64_t n1 = GetParam().first_turn;
  std::vector<int32_t> first = document(*tok, n1 - 16);
  const std::vector<int32_t> q1 = tok->encode("\nQuestion: In which year was the town of record 3 founded?\nAnswer:",
                                              {.add_special = false, .parse_special = false});
  first.insert(first.end(), q1.begin(), q1.end());
  const std::vector<int32_t> q2 = tok->encode("\nQuestion: What do the people of record 5 trade in?\nAnswer:",
                                              {.add_special = false, .parse_special = false});
  struct Turn {
    std::vector<int32_t> tokens;
    std::vector<TokenLogprobs> logprobs;
    int32_t cached = -1;
  };
  auto run = [&](bool cache) {
    GpuBatchBackend backend(*dev);
    BatchEngineOptions o;
    o.chunk_size = 2048;
    o.block_tokens = 64;
    o.max_batch = 4;
    o.kv_bytes = 2e9;
    o.prefix_cache = cache;
    BatchEngine engine(backend, o);
    std::vector<Turn> turns;
    BatchRequest r;
    r.prompt = first;
    r.options.max_new_tokens = 24;
    r.options.logprobs = 5;
    for (int t = 0; t < 2; ++t) {
      if (t == 1) {
        r.prompt.insert(r.prompt.end(), turns[0].tokens.begin(), turns[0].tokens.end());
        r.prompt.insert(r.prompt.end(), q2.begin(), q2.end());
      }
      const int64_t id = engine.submit(r);
      turns.emplace_back();
      while (engine.busy())
        for (const BatchEvent& e : engine.step()) {
          EXPECT_NE(e.reason, FinishReason::kError) << e.error;
          if (e.id != id) continue;
          if (e.token >= 0) turns.back().tokens.push_back(e.token);
          if (e.logprobs) turns.back().logprobs.push_back(*e.logprobs);
          if (e.cached_tokens >= 0) turns.back().cached = e.cached_tokens;
        }
    }
    return turns;
  };
  const std::vector<Turn> with = run(true), without = run(false);
  ASSERT_EQ(with.size(), 2u);
  ASSERT_EQ(without.size(), 2u);
  EXPECT_EQ(with[0].tokens, without[0].tokens) << "turn 1 runs the same chunks with and without the cache";
  EXPECT_EQ(with[0].cached, 0);
  EXPECT_GE(with[1].cached, static_cast<int32_t>(first.size() / 64 * 64)) << "turn 2 adopts turn 1's full blocks";
  EXPECT_EQ(without[1].cached, 0);
  const std::vector<int32_t>& a = with[1].tokens;
  const std::vector<int32_t>& b = without[1].tokens;
  std::printf("[prefix] %s turn 2 (%zu prompt tokens, %d cached): with the cache \"%s\", without \"%s\"\n",
              GetParam().file, first.size() + with[0].tokens.size() + q2.size(), with[1].cached,
              tok->decode(a).c_str(), tok->decode(b).c_str());
  if (a == b) return;
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  ASSERT_LT(k, std::min(a.size(), b.size())) << "one answer is a prefix of the other";
  ASSERT_LT(k, without[1].logprobs.size());
  // The uncached run's log-probability of the cached run's token at the first difference: within a near tie.
  const TokenLogprobs& lp = without[1].logprobs[k];
  float other = -1e30f;
  for (const TokenLogprob& t : lp.top)
    if (t.token == a[k]) other = t.logprob;
  std::printf("[prefix] parts at token %zu: %d (cached) vs %d, uncached log-probabilities %.4f vs %.4f\n", k, a[k],
              b[k], other, lp.logprob);
  EXPECT_LT(lp.logprob - other, 0.25f) << "turn 2 parts at token " << k << " beyond a near tie";
}

// The server's workload in the engine (prefix_turns.py: 4 clients at once, each its own document, 3 turns): every
// client's next turn is submitted as soon as its answer ends, so cached prefills run while the other clients prefill
// their documents or decode (batched decode steps, several slots, blocks taken and given back around the cached
// ones) — what the one-request-at-a-time tests above do not do. With the cache against without: per client, the
// turns until the first that differs are equal; that turn parts within a near tie of the uncached run's logits (the
// decode batches differ between the runs, so bf16 GEMMs over other row counts round differently).
TEST_P(RealModelPrefix, ConcurrentConversationsEqualUncached) {
  REQUIRE_GPU();
  const std::string path = test::real_model_path(GetParam().file);
  if (path.empty()) GTEST_SKIP() << GetParam().file << " not found (TESSERA_MODEL_DIR)";
  const auto model = Model::load(path);
  const auto dev = DeviceModel::upload(*model);
  const auto tok = model::Tokenizer::from_gguf(model->file().metadata());
  const std::vector<std::vector<int32_t>> docs = conversation_documents(*tok, GetParam().first_turn);
  struct Turn {
    std::vector<int32_t> tokens;
    std::vector<TokenLogprobs> logprobs;
    int32_t cached = -1;
  };
  auto run = [&](bool cache) {
    GpuBatchBackend backend(*dev);
    BatchEngine engine(backend, conversation_options(cache));
    std::vector<std::vector<Turn>> turns(kClients);
    run_conversations(
        engine, *tok, docs, [&](int c, const std::vector<int32_t>&) { turns[static_cast<size_t>(c)].emplace_back(); },
        [&](int c, const BatchEvent& e) {
          Turn& t = turns[static_cast<size_t>(c)].back();
          if (e.token >= 0) t.tokens.push_back(e.token);
          if (e.logprobs) t.logprobs.push_back(*e.logprobs);
          if (e.cached_tokens >= 0) t.cached = e.cached_tokens;
        });
    return turns;
  };
  const auto with = run(true), without = run(false);
  for (int c = 0; c < kClients; ++c) {
    const auto& a = with[static_cast<size_t>(c)];
    const auto& b = without[static_cast<size_t>(c)];
    ASSERT_EQ(a.size(), static_cast<size_t>(kTurns));
    ASSERT_EQ(b.size(), static_cast<size_t>(kTurns));
    for (int k = 0; k < kTurns; ++k) {
      const Turn& x = a[static_cast<size_t>(k)];
      const Turn& y = b[static_cast<size_t>(k)];
      std::printf("[prefix] %s client %d turn %d (cached %d): with the cache \"%s\", without \"%s\"\n", GetParam().file,
                  c, k + 1, x.cached, tok->decode(x.tokens).c_str(), tok->decode(y.tokens).c_str());
      if (k > 0) {
        EXPECT_GT(x.cached, 0) << "client " << c << " turn " << k + 1 << " found no cached prefix";
      }
      if (x.tokens == y.tokens) continue;
      size_t i = 0;
      while (i < x.tokens.size() && i < y.tokens.size() && x.tokens[i] == y.tokens[i]) ++i;
      ASSERT_LT(i, std::min(x.tokens.size(), y.tokens.size())) << "one answer is a prefix of the other";
      ASSERT_LT(i, y.logprobs.size());
      const TokenLogprobs& lp = y.logprobs[i];
      float other = -1e30f;
      for (const TokenLogprob& t : lp.top)
        if (t.token == x.tokens[i]) other = t.logprob;
      std::printf("[prefix] client %d turn %d parts at token %zu: %d (cached) vs %d, uncached log-probabilities %.4f vs "
                  "%.4f\n", c, k + 1, i, x.tokens[i], y.tokens[i], other, lp.logprob);
      EXPECT_LT(lp.logprob - other, 0.25f) << "client " << c << " turn " << k + 1 << " parts at token " << i
                                           << " beyond a near tie";
      break;  // the later turns' prompts differ
    }
  }
}

// ---- Where the concurrent case goes wrong (issue 34): a probe around the engine's GPU backend ----
//
// ConcurrentConversationsEqualUncached fails on the H200 with Gemma-3 (a cached turn 2 starts with "\n" where the
// uncached one names the answer) while the one-at-a-time cases pass. The probe forwards every call to a
// GpuBatchBackend unchanged (the engine runs exactly as there) and checks, in the same concurrent run:
//  - gather: after each load_prefix, every staged row a table keeps equals its pool block's row, bit for bit;
//  - scatter: after each finish_prefill, every kept block holds the staged rows it was given, bit for bit;
//  - tables: after each decode step, the device's block table of every row's slot equals the host's SequenceBlocks
//    in every column the sequence holds, and its views the ones finish_prefill was given (what the decode reads);
//  - rows: at each prefill's end, the staged K and V of every kept row against a reference backend that prefills the
//    same tokens alone, in the engine's 2,048-token chunks from 0 (= the uncached run's prefill), per layer and class:
//      prefilled  rows staged from the cache that an earlier prefill wrote (turn 1's document and question)
//      decoded    rows staged from the cache that a decode step wrote (earlier answers)
//      new        rows this prefill computed (all of turn 1's: equal to the reference but for chunk rounding)
//    a row is "bad" when max |staged - reference| over it exceeds 0.25 x its reference's max |value|;
//  - logits: the prefill's last-row logits against the reference's (rel L2, argmax).
// A line per prefill end and per failed check goes to stdout; with TESSERA_PREFIX_PROBE_LOG=FILE every layer's
// figures go to FILE as well.
enum RowClass { kPrefilled = 0, kDecoded = 1, kNew = 2 };
const char* const kClassNames[] = {"prefilled", "decoded", "new"};

class Probe final : public BatchBackend {
 public:
  Probe(GpuBatchBackend& inner, const DeviceModel& dev, const std::vector<std::vector<int32_t>>& prompts,
        FILE* log_file)
      : inner_(inner), ref_(dev), prompts_(prompts), log_(log_file), cfg_(inner.config()) {}

  const ModelConfig& config() const override { return inner_.config(); }
  const char* device_name() const override { return inner_.device_name(); }
  double block_bytes(const PagedKVShape& shape) const override { return inner_.block_bytes(shape); }
  double default_kv_bytes() const override { return inner_.default_kv_bytes(); }
  void create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                    int32_t max_context) override {
    shape_ = shape;
    decoded_.assign(static_cast<size_t>(num_blocks), 0);
    inner_.create_store(shape, num_blocks, max_sequences, max_context);
  }
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override {
    if (pos == 0) {
      staged_.assign(tokens.begin(), tokens.end());
      prefix_rows_ = 0;
    } else if (pos == prefix_rows_ && static_cast<int64_t>(staged_.size()) < pos) {
      // The first chunk after a cached prefix: the prompt it belongs to gives the staged rows' tokens.
      const std::vector<int32_t>* found = nullptr;
      for (const auto& p : prompts_)
        if (static_cast<int32_t>(p.size()) == total_len &&
            std::equal(tokens.begin(), tokens.end(), p.begin() + pos))
          found = &p;
      EXPECT_NE(found, nullptr) << "probe: no submitted prompt of " << total_len << " tokens has this tail";
      if (found != nullptr) staged_.assign(found->begin(), found->begin() + pos);
      staged_.insert(staged_.end(), tokens.begin(), tokens.end());
    } else {
      staged_.insert(staged_.end(), tokens.begin(), tokens.end());
    }
    total_len_ = total_len;
    std::vector<float> out = inner_.prefill_chunk(tokens, pos, total_len, policy, logits);
    if (logits) last_logits_ = out;
    return out;
  }
  void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) override {
    compare_rows(seq);
    inner_.finish_prefill(seq, views);
    check_scatter(seq);
    // What finish_prefill wrote: the rows past the cached prefix (the prefix's rows are written back unchanged).
    for (size_t i = 0; i < seq.tables(); ++i)
      for (int64_t p = prefix_rows_; p < seq.length(); ++p) {
        const int64_t b = p / shape_.block_tokens;
        const int32_t id = b < static_cast<int64_t>(seq.table(i).size()) ? seq.table(i)[static_cast<size_t>(b)] : -1;
        if (id >= 0) decoded_[static_cast<size_t>(id)] &= ~(uint64_t{1} << (p % shape_.block_tokens));
      }
    std::vector<int32_t>& v = views_[&seq];
    v.clear();
    for (const DecodeView& dv : views) {
      v.push_back(dv.sink);
      v.push_back(static_cast<int32_t>(std::min<int64_t>(dv.window, INT32_MAX)));
      v.push_back(static_cast<int32_t>(std::min<int64_t>(dv.horizon, INT32_MAX)));
    }
  }
  void release_sequence(const SequenceBlocks& seq) override {
    views_.erase(&seq);
    inner_.release_sequence(seq);
  }
  void abort_prefill() override { inner_.abort_prefill(); }
  bool supports_prefix_cache() const override { return true; }
  void load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) override {
    inner_.load_prefix(seq, rows, total_len);
    staged_.clear();
    prefix_rows_ = rows;
    // Each kept row's class (who wrote its block's row), and the staged rows against the pool's, bit for bit.
    const int32_t B = shape_.block_tokens, D = cfg_.head_dim, Hkv = cfg_.num_kv_heads;
    classes_.assign(seq.tables(), std::vector<uint8_t>(static_cast<size_t>(rows), kPrefilled));
    int64_t mismatched_rows = 0, first_layer = -1, first_row = -1;
    std::vector<bf16> k, v, bk, bv;
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      inner_.download_staged(l, rows, k, v);
      for (int32_t h = 0; h < Hkv; ++h) {
        const std::vector<int32_t>& t = seq.table(l, h);
        for (int64_t b = 0; b < static_cast<int64_t>(t.size()) && b * B < rows; ++b) {
          const int32_t id = t[static_cast<size_t>(b)];
          if (id < 0) continue;
          inner_.download_block(id, bk, bv);
          for (int64_t p = b * B; p < std::min<int64_t>((b + 1) * B, rows); ++p) {
            if ((decoded_[static_cast<size_t>(id)] >> (p % B)) & 1)
              classes_[static_cast<size_t>(l) * static_cast<size_t>(Hkv) + static_cast<size_t>(h)]
                      [static_cast<size_t>(p)] = kDecoded;
            const size_t at = static_cast<size_t>(p) * static_cast<size_t>(Hkv * D) + static_cast<size_t>(h * D);
            const size_t in = static_cast<size_t>(p % B) * static_cast<size_t>(D);
            bool same = true;
            for (int32_t c = 0; c < D; ++c)
              same = same && k[at + static_cast<size_t>(c)].bits == bk[in + static_cast<size_t>(c)].bits &&
                     v[at + static_cast<size_t>(c)].bits == bv[in + static_cast<size_t>(c)].bits;
            if (!same && mismatched_rows++ == 0) first_layer = l, first_row = p;
          }
        }
      }
    }
    ++loads_;
    gather_mismatches += mismatched_rows;
    std::printf("[probe] load_prefix #%d: %d rows staged of %d; rows unequal to their pool block: %lld%s\n", loads_,
                rows, total_len, static_cast<long long>(mismatched_rows),
                mismatched_rows > 0 ? (" (first: layer " + std::to_string(first_layer) + " row " +
                                       std::to_string(first_row) + ")").c_str()
                                    : "");
  }
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) override {
    std::vector<float> out = inner_.decode(tokens, rows);
    after_decode(rows);
    return out;
  }
  std::vector<int32_t> decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                     std::span<const RowChoice> choice) override {
    std::vector<int32_t> out = inner_.decode_select(tokens, rows, choice);
    after_decode(rows);
    return out;
  }
  int64_t step_builds() const override { return inner_.step_builds(); }
  ForwardTimers timers() const override { return inner_.timers(); }

  int64_t gather_mismatches = 0, scatter_mismatches = 0, table_mismatches = 0, view_mismatches = 0, bad_rows = 0;
  int64_t first_tokens_differ = 0;
  double worst_new_turn1 = 0;  // the largest row rel of a turn-1 (uncached) prefill against the reference

 private:
  // The decode step wrote each row's K and V at pos = length - 1 into seq.block(l, h, pos); the decode read the
  // device's tables: compare them (and the views) with the host's.
  void after_decode(std::span<const DecodeRow> rows) {
    const int32_t B = shape_.block_tokens, mb = inner_.max_blocks();
    for (const DecodeRow& r : rows) {
      const SequenceBlocks& seq = *r.seq;
      const int64_t pos = seq.length() - 1;
      for (size_t i = 0; i < seq.tables(); ++i) {
        const int64_t b = pos / B;
        const int32_t id = b < static_cast<int64_t>(seq.table(i).size()) ? seq.table(i)[static_cast<size_t>(b)] : -1;
        if (id >= 0) decoded_[static_cast<size_t>(id)] |= uint64_t{1} << (pos % B);
      }
      const std::vector<int32_t> dev = inner_.download_table(seq);
      int64_t bad = 0;
      std::string first;
      for (size_t i = 0; i < seq.tables(); ++i) {
        const std::vector<int32_t>& t = seq.table(i);
        for (int64_t b = 0; b < static_cast<int64_t>(t.size()) && b * B < seq.length() && b < mb; ++b) {
          const int32_t want = t[static_cast<size_t>(b)];
          const int32_t got = dev[i * static_cast<size_t>(mb) + static_cast<size_t>(b)];
          if (want >= 0 && got != want && bad++ == 0)
            first = "table " + std::to_string(i) + " block " + std::to_string(b) + ": device " + std::to_string(got) +
                    ", host " + std::to_string(want);
        }
      }
      const auto it = views_.find(&seq);
      const bool views_equal = it != views_.end() && inner_.download_views(seq) == it->second;
      if (bad > 0 || !views_equal)
        std::printf("[probe] decode step at length %lld: %lld table columns differ from the host's (%s); views %s\n",
                    static_cast<long long>(seq.length()), static_cast<long long>(bad), first.c_str(),
                    views_equal ? "equal" : "DIFFER");
      table_mismatches += bad;
      view_mismatches += views_equal ? 0 : 1;
    }
  }

  // After finish_prefill: every kept block holds the staged rows it was given (paged_copy to the pages), bit for bit.
  void check_scatter(const SequenceBlocks& seq) {
    const int32_t B = shape_.block_tokens, D = cfg_.head_dim, Hkv = cfg_.num_kv_heads;
    int64_t mismatched = 0;
    std::string first;
    std::vector<bf16> bk, bv;
    for (int32_t l = 0; l < cfg_.num_layers && static_cast<size_t>(l) < snap_k_.size(); ++l) {
      const std::vector<bf16>& k = snap_k_[static_cast<size_t>(l)];
      const std::vector<bf16>& v = snap_v_[static_cast<size_t>(l)];
      for (int32_t h = 0; h < Hkv; ++h) {
        const std::vector<int32_t>& t = seq.table(l, h);
        for (int64_t b = 0; b < static_cast<int64_t>(t.size()) && b * B < seq.length(); ++b) {
          const int32_t id = t[static_cast<size_t>(b)];
          if (id < 0) continue;
          inner_.download_block(id, bk, bv);
          for (int64_t p = b * B; p < std::min<int64_t>((b + 1) * B, seq.length()); ++p) {
            const size_t at = static_cast<size_t>(p) * static_cast<size_t>(Hkv * D) + static_cast<size_t>(h * D);
            const size_t in = static_cast<size_t>(p % B) * static_cast<size_t>(D);
            bool same = at + static_cast<size_t>(D) <= k.size();
            for (int32_t c = 0; same && c < D; ++c)
              same = k[at + static_cast<size_t>(c)].bits == bk[in + static_cast<size_t>(c)].bits &&
                     v[at + static_cast<size_t>(c)].bits == bv[in + static_cast<size_t>(c)].bits;
            if (!same && mismatched++ == 0)
              first = " (first: layer " + std::to_string(l) + " row " + std::to_string(p) + ", block " +
                      std::to_string(id) + ")";
          }
        }
      }
    }
    scatter_mismatches += mismatched;
    if (mismatched > 0)
      std::printf("[probe] prefill end #%d: %lld kept rows differ in the pool from the staged rows after "
                  "finish_prefill%s\n", ends_, static_cast<long long>(mismatched), first.c_str());
    snap_k_.clear();
    snap_v_.clear();
  }

  // The staged rows at a prefill's end against the reference prefill of the same tokens.
  void compare_rows(const SequenceBlocks& seq) {
    const auto n = static_cast<int32_t>(seq.length());
    if (static_cast<int32_t>(staged_.size()) != n) {
      ADD_FAILURE() << "probe: " << staged_.size() << " staged tokens for a sequence of " << n;
      return;
    }
    constexpr int64_t kChunk = 2048;
    std::vector<float> ref_logits;
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t e = std::min<int64_t>(n, c + kChunk);
      ref_logits = ref_.prefill_chunk(
          std::span<const int32_t>(staged_).subspan(static_cast<size_t>(c), static_cast<size_t>(e - c)),
          static_cast<int32_t>(c), total_len_, nullptr, e == n);
    }
    const int32_t D = cfg_.head_dim, Hkv = cfg_.num_kv_heads;
    ++ends_;
    snap_k_.assign(static_cast<size_t>(cfg_.num_layers), {});
    snap_v_.assign(static_cast<size_t>(cfg_.num_layers), {});
    std::string worst;
    double worst_rel = 0;
    int64_t bad_here = 0;
    std::vector<bf16> k, v, rk, rv;
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      inner_.download_staged(l, n, k, v);
      ref_.download_staged(l, n, rk, rv);
      snap_k_[static_cast<size_t>(l)] = k;  // for check_scatter
      snap_v_[static_cast<size_t>(l)] = v;
      for (int32_t h = 0; h < Hkv; ++h) {
        const size_t ti = static_cast<size_t>(l) * static_cast<size_t>(Hkv) + static_cast<size_t>(h);
        double max_rel[3] = {0, 0, 0}, max_abs[3] = {0, 0, 0};
        int64_t rows[3] = {0, 0, 0}, bad[3] = {0, 0, 0}, first_bad[3] = {-1, -1, -1}, exact[3] = {0, 0, 0};
        // Staged row pg against reference row pr: max |difference| and, K and V each against their own reference
        // row's largest |value|, the worse relative one.
        auto compare = [&](int64_t pg, int64_t pr, double* rel) {
          const size_t ag = static_cast<size_t>(pg) * static_cast<size_t>(Hkv * D) + static_cast<size_t>(h * D);
          const size_t ar = static_cast<size_t>(pr) * static_cast<size_t>(Hkv * D) + static_cast<size_t>(h * D);
          double d = 0;
          *rel = 0;
          for (int kv = 0; kv < 2; ++kv) {
            const std::vector<bf16>& got = kv == 0 ? k : v;
            const std::vector<bf16>& want = kv == 0 ? rk : rv;
            double dm = 0, sm = 0;
            for (int32_t c = 0; c < D; ++c) {
              const float g = bf16_to_f32(got[ag + static_cast<size_t>(c)]);
              const float w = bf16_to_f32(want[ar + static_cast<size_t>(c)]);
              dm = std::max(dm, std::fabs(static_cast<double>(g) - w));
              sm = std::max(sm, std::fabs(static_cast<double>(w)));
            }
            d = std::max(d, dm);
            *rel = std::max(*rel, dm / std::max(sm, 1e-3));
          }
          return d;
        };
        std::string what_bad[3];
        for (int64_t p = 0; p < n; ++p) {
          if (seq.block(l, h, p) < 0) continue;  // not kept: neither staged nor read
          const int cls =
              p >= prefix_rows_ ? static_cast<int>(kNew) : static_cast<int>(classes_[ti][static_cast<size_t>(p)]);
          double rel = 0;
          const double d = compare(p, p, &rel);
          if (rel > 0.25 && bad[cls] == 0) {
            // What the first bad row holds instead: zeros, or another position's row (a shifted or swapped block).
            const size_t at = static_cast<size_t>(p) * static_cast<size_t>(Hkv * D) + static_cast<size_t>(h * D);
            bool zero = true;
            for (int32_t c = 0; c < D; ++c) zero = zero && k[at + static_cast<size_t>(c)].bits == 0;
            what_bad[cls] = zero ? " zeros" : " not another row at +-1, +-64, +-512";
            if (!zero)
              for (int64_t shift : {-1, 1, -64, 64, -512, 512}) {
                double r2 = 1;
                if (p + shift >= 0 && p + shift < n) compare(p, p + shift, &r2);
                if (r2 < 0.05) {
                  what_bad[cls] = " ~ reference row " + std::to_string(p + shift);
                  break;
                }
              }
          }
          ++rows[cls];
          exact[cls] += d == 0;
          max_abs[cls] = std::max(max_abs[cls], d);
          max_rel[cls] = std::max(max_rel[cls], rel);
          if (rel > 0.25 && bad[cls]++ == 0) first_bad[cls] = p;
        }
        std::string line = "layer " + std::to_string(l) + (cfg_.layers[static_cast<size_t>(l)].sliding_window > 0
                                                                 ? " (window)"
                                                                 : " (global)");
        bool flag = false;
        for (int cls = 0; cls < 3; ++cls) {
          if (rows[cls] == 0) continue;
          char buf[512];
          std::snprintf(buf, sizeof buf,
                        "  %s: %lld rows, %lld exact, max |d| %.3g, max rel %.3g, bad %lld (first %lld%s)",
                        kClassNames[cls], static_cast<long long>(rows[cls]), static_cast<long long>(exact[cls]),
                        max_abs[cls], max_rel[cls], static_cast<long long>(bad[cls]),
                        static_cast<long long>(first_bad[cls]), what_bad[cls].c_str());
          line += buf;
          flag = flag || bad[cls] > 0;
          bad_here += bad[cls];
          if (max_rel[cls] > worst_rel) {
            worst_rel = max_rel[cls];
            worst = std::string(kClassNames[cls]) + " rows of layer " + std::to_string(l);
          }
          if (cls == kNew && prefix_rows_ == 0) worst_new_turn1 = std::max(worst_new_turn1, max_rel[cls]);
        }
        if (log_ != nullptr) std::fprintf(log_, "[probe] prefill end #%d %s\n", ends_, line.c_str());
        if (flag) std::printf("[probe] prefill end #%d %s\n", ends_, line.c_str());
      }
    }
    bad_rows += bad_here;
    const double logit_rel = rel_l2(ref_logits, last_logits_);
    const int32_t a = argmax_of(last_logits_), r = argmax_of(ref_logits);
    first_tokens_differ += a != r;
    int64_t decoded_rows = 0;
    if (prefix_rows_ > 0 && !classes_.empty())
      for (int32_t l = 0; l < cfg_.num_layers; ++l)  // a global layer's table keeps every row
        if (cfg_.layers[static_cast<size_t>(l)].sliding_window <= 0) {
          const std::vector<uint8_t>& cl = classes_[static_cast<size_t>(l) * static_cast<size_t>(Hkv)];
          decoded_rows = std::count(cl.begin(), cl.end(), static_cast<uint8_t>(kDecoded));
          break;
        }
    std::printf("[probe] prefill end #%d: %d tokens (%d staged from the cache, %lld of them decoded rows): bad rows "
                "%lld, worst max rel %.3g (%s); last-row logits rel L2 %.3g vs the reference, argmax %d / %d%s\n",
                ends_, n, prefix_rows_, static_cast<long long>(decoded_rows), static_cast<long long>(bad_here),
                worst_rel, worst.c_str(), logit_rel, a, r, a != r ? "  <-- FIRST TOKEN DIFFERS" : "");
    if (log_ != nullptr) std::fflush(log_);
    std::fflush(stdout);
    ref_.abort_prefill();
    if (prefix_rows_ == 0) classes_.clear();
  }

  GpuBatchBackend& inner_;
  GpuBatchBackend ref_;
  const std::vector<std::vector<int32_t>>& prompts_;
  FILE* log_;
  const ModelConfig& cfg_;
  PagedKVShape shape_;
  std::vector<uint64_t> decoded_;  // per block id: rows a decode step wrote since a prefill last wrote them
  std::map<const SequenceBlocks*, std::vector<int32_t>> views_;
  std::vector<int32_t> staged_;  // the tokens of the staged rows
  int32_t prefix_rows_ = 0, total_len_ = 0;
  std::vector<std::vector<uint8_t>> classes_;  // per table, the staged prefix's rows' RowClass
  std::vector<float> last_logits_;
  std::vector<std::vector<bf16>> snap_k_, snap_v_;  // the staged rows of every layer at the last prefill's end
  int loads_ = 0, ends_ = 0;
};

// ConcurrentConversationsEqualUncached's cached run (4 conversations, 3 turns, as the server runs them) through the
// probe: which rows the later turns' prefills stage wrong, if any, and where they came from (see Probe).
TEST_P(RealModelPrefix, ConcurrentStagedRowsEqualTheirTokens) {
  REQUIRE_GPU();
  const std::string path = test::real_model_path(GetParam().file);
  if (path.empty()) GTEST_SKIP() << GetParam().file << " not found (TESSERA_MODEL_DIR)";
  const auto model = Model::load(path);
  const auto dev = DeviceModel::upload(*model);
  const auto tok = model::Tokenizer::from_gguf(model->file().metadata());
  const std::vector<std::vector<int32_t>> docs = conversation_documents(*tok, GetParam().first_turn);
  FILE* probe_log = nullptr;
  if (const char* f = std::getenv("TESSERA_PREFIX_PROBE_LOG"); f != nullptr && *f != '\0')
    probe_log = std::fopen(f, "w");
  std::vector<std::vector<int32_t>> submitted;
  GpuBatchBackend backend(*dev);
  Probe probe(backend, *dev, submitted, probe_log);
  BatchEngine engine(probe, conversation_options(true));
  run_conversations(
      engine, *tok, docs, [&](int, const std::vector<int32_t>& p) { submitted.push_back(p); },
      [](int, const BatchEvent&) {});
  if (probe_log != nullptr) std::fclose(probe_log);
  std::printf("[probe] %s: gather mismatches %lld, scatter mismatches %lld, device table mismatches %lld, view "
              "mismatches %lld, bad rows %lld, first tokens unlike the reference's %lld, turn-1 prefills' worst row "
              "rel %.3g; prefix hits %lld\n",
              GetParam().file, static_cast<long long>(probe.gather_mismatches),
              static_cast<long long>(probe.scatter_mismatches),
              static_cast<long long>(probe.table_mismatches), static_cast<long long>(probe.view_mismatches),
              static_cast<long long>(probe.bad_rows), static_cast<long long>(probe.first_tokens_differ),
              probe.worst_new_turn1, static_cast<long long>(engine.stats().prefix_hits));
  EXPECT_EQ(engine.stats().prefix_hits, kClients * (kTurns - 1));
  EXPECT_EQ(probe.gather_mismatches, 0) << "load_prefix staged rows unlike the pool's blocks";
  EXPECT_EQ(probe.scatter_mismatches, 0) << "finish_prefill left blocks unlike the staged rows";
  EXPECT_EQ(probe.table_mismatches, 0) << "the decode step read block tables unlike the host's";
  EXPECT_EQ(probe.view_mismatches, 0) << "the decode step read views unlike the sequence's";
  EXPECT_EQ(probe.bad_rows, 0) << "staged rows unlike an uncached prefill of the same tokens";
}

INSTANTIATE_TEST_SUITE_P(Models, RealModelPrefix,
                         ::testing::Values(Shape{"gemma-3-270m-q4_k_m.gguf", 28124},
                                           Shape{"smollm2-135m-instruct-q4_1.gguf", 7004}),
                         [](const ::testing::TestParamInfo<Shape>& p) {
                           return std::string(p.index == 0 ? "gemma3" : "smollm2");
                         });

}  // namespace
}  // namespace tessera::runtime::gpu
