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
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
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

namespace tessera::runtime::gpu {
namespace {

#define REQUIRE_GPU()                                                  \
  do {                                                                 \
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

std::string model_path(const std::string& file) {
  for (const char* var : {"TESSERA_MODEL_DIR", "TESSERA_MODELS"}) {
    if (const char* env = std::getenv(var); env != nullptr && *env != '\0') {
      const std::string p = std::string(env) + "/" + file;
      if (std::filesystem::exists(p)) return p;
    }
  }
  const char* home = std::getenv("HOME");
  const std::string p = std::string(home != nullptr ? home : ".") + "/.cache/tessera/models/" + file;
  return std::filesystem::exists(p) ? p : std::string();
}

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

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d2 += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    r2 += static_cast<double>(a[i]) * a[i];
  }
  return std::sqrt(d2 / std::max(r2, 1e-30));
}

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

struct Shape {
  const char* file;
  int64_t first_turn;  // turn 1's prompt (its full blocks are cached: a multiple of 64, not of 128 nor 2,048)
};

class RealModelPrefix : public ::testing::TestWithParam<Shape> {};

TEST_P(RealModelPrefix, StagedPrefixEqualsTheDirectPrefill) {
  REQUIRE_GPU();
  const std::string path = model_path(GetParam().file);
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
  const std::string path = model_path(GetParam().file);
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
  const std::string path = model_path(GetParam().file);
  if (path.empty()) GTEST_SKIP() << GetParam().file << " not found (TESSERA_MODEL_DIR)";
  const auto model = Model::load(path);
  const auto dev = DeviceModel::upload(*model);
  const auto tok = model::Tokenizer::from_gguf(model->file().metadata());
  constexpr int kClients = 4, kTurns = 3;
  auto encode = [&](const std::string& t) { return tok->encode(t, {.add_special = false, .parse_special = false}); };
  std::vector<std::vector<int32_t>> docs;
  for (int c = 0; c < kClients; ++c) {
    std::mt19937 rng(static_cast<uint32_t>(2000 + c));
    std::string text = "Read the records below, then answer questions about them.\n\n";
    std::vector<int32_t> ids;
    for (int i = 1; static_cast<int64_t>(ids.size()) < GetParam().first_turn - 100 + 17 * c; i += 40) {
      for (int k = 0; k < 40; ++k) text += paragraph(rng, i + k);
      ids = tok->encode(text, {.add_special = true, .parse_special = false});
    }
    ids.resize(static_cast<size_t>(GetParam().first_turn - 100 + 17 * c));
    docs.push_back(ids);
  }
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
    o.max_batch = kClients;
    o.kv_bytes = 8e9;
    o.prefix_cache = cache;
    BatchEngine engine(backend, o);
    std::vector<std::vector<Turn>> turns(kClients);
    std::vector<std::vector<int32_t>> prompt(kClients);
    std::vector<int64_t> id(kClients, -1);
    auto submit = [&](int c) {
      const int k = static_cast<int>(turns[static_cast<size_t>(c)].size());
      std::vector<int32_t>& p = prompt[static_cast<size_t>(c)];
      if (k == 0) p = docs[static_cast<size_t>(c)];
      else {
        const std::vector<int32_t>& answer = turns[static_cast<size_t>(c)].back().tokens;
        p.insert(p.end(), answer.begin(), answer.end());
      }
      const std::vector<int32_t> q = encode("\nQuestion: What do the people of record " + std::to_string(3 + 7 * k + c) +
                                            " trade in?\nAnswer:");
      p.insert(p.end(), q.begin(), q.end());
      BatchRequest r;
      r.prompt = p;
      r.options.max_new_tokens = 24;
      r.options.logprobs = 5;
      id[static_cast<size_t>(c)] = engine.submit(r);
      turns[static_cast<size_t>(c)].emplace_back();
    };
    for (int c = 0; c < kClients; ++c) submit(c);
    while (engine.busy())
      for (const BatchEvent& e : engine.step()) {
        EXPECT_NE(e.reason, FinishReason::kError) << e.error;
        const auto c = static_cast<int>(std::find(id.begin(), id.end(), e.id) - id.begin());
        if (c >= kClients) continue;
        Turn& t = turns[static_cast<size_t>(c)].back();
        if (e.token >= 0) t.tokens.push_back(e.token);
        if (e.logprobs) t.logprobs.push_back(*e.logprobs);
        if (e.cached_tokens >= 0) t.cached = e.cached_tokens;
        if (e.finished && static_cast<int>(turns[static_cast<size_t>(c)].size()) < kTurns) submit(c);
      }
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

INSTANTIATE_TEST_SUITE_P(Models, RealModelPrefix,
                         ::testing::Values(Shape{"gemma-3-270m-q4_k_m.gguf", 28124},
                                           Shape{"smollm2-135m-instruct-q4_1.gguf", 7004}),
                         [](const ::testing::TestParamInfo<Shape>& p) {
                           return std::string(p.index == 0 ? "gemma3" : "smollm2");
                         });

}  // namespace
}  // namespace tessera::runtime::gpu
