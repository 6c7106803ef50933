// The single-sequence engine (runtime/engine.h) is the batched engine's scheduler with one held sequence. Checked
// against its obvious twin, runtime::Forward run directly over a contiguous KVCache (prefill chunks under the
// policy, dense one-token decodes: what the engine did before it went through the scheduler), and against the
// batched engine's tokens for the same request, over the CPU backend and the tensor-parallel CPU backend, on the
// tiny fixtures (llama3, qwen2, gemma3 with its sliding-window layers, mistral).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "parallel/placement.h"
#include "parallel/tp_forward_cpu.h"
#include "runtime/batch_engine.h"
#include "runtime/engine.h"
#include "runtime/forward.h"
#include "runtime/kv_cache.h"
#include "runtime/sampling.h"
#include "stream_sizes.h"
#include "test_support.h"

namespace tessera::runtime {
namespace {

using namespace tessera::test;

int32_t argmax_of(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The old single-sequence engine, written out: chunks of `chunk` tokens through Forward over one contiguous cache
// (or a StreamingKV), each under the policy with total_len the length at the end of this prefill; decode one token,
// dense.
class Twin {
 public:
  Twin(const Model& m, const attn::AttentionPolicy& policy, int32_t chunk, const StreamOptions& stream)
      : m_(m), policy_(policy), chunk_(chunk), stream_opts_(stream), forward_(m, ThreadPool::global()) {
    const ModelConfig& c = m.config();
    if (stream.method != StreamMethod::None)
      stream_ = std::make_unique<StreamingKV>(c, stream);
    else
      cache_ = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, c.context_length);
  }
  std::vector<float> prefill(std::span<const int32_t> tokens, LogitRows rows) {
    const auto n = static_cast<int64_t>(tokens.size());
    const auto total = static_cast<int32_t>(pos_ + n);
    if (!stream_) cache_.reserve(total);
    std::vector<float> out;
    for (int64_t c0 = 0; c0 < n;) {
      const int64_t c1 = stream_ ? stream_chunk_end(stream_opts_, c0, n) : std::min<int64_t>(n, c0 + chunk_);
      const bool last = c1 == n;
      const LogitRows want = rows == LogitRows::All ? rows : (last ? rows : LogitRows::None);
      const auto piece = tokens.subspan(static_cast<size_t>(c0), static_cast<size_t>(c1 - c0));
      std::vector<float> part;
      if (stream_) {
        stream_->begin_chunk(pos_, static_cast<int32_t>(c1 - c0),
                             last ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill);
        part = forward_.run(piece, pos_, *stream_, want, timers_);
      } else {
        part = forward_.run(piece, pos_, cache_, &policy_, total, want, timers_);
      }
      out.insert(out.end(), part.begin(), part.end());
      pos_ += static_cast<int32_t>(c1 - c0);
      c0 = c1;
    }
    return out;
  }
  std::vector<float> decode(int32_t token) {
    const int32_t one[1] = {token};
    std::vector<float> out;
    if (stream_) {
      stream_->begin_chunk(pos_, 1, StreamingKV::ChunkKind::Decode);
      out = forward_.run(one, pos_, *stream_, LogitRows::Last, timers_);
    } else {
      cache_.reserve(pos_ + 1);
      out = forward_.run(one, pos_, cache_, nullptr, pos_ + 1, LogitRows::Last, timers_);
    }
    ++pos_;
    return out;
  }

 private:
  const Model& m_;
  attn::AttentionPolicy policy_;
  int32_t chunk_;
  StreamOptions stream_opts_;
  Forward forward_;
  KVCache cache_;
  std::unique_ptr<StreamingKV> stream_;
  ForwardTimers timers_;
  int32_t pos_ = 0;
};

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, 2e-4f) << what;
}

struct Case {
  const char* model;
  bool sparse;  // an A-shape prefill policy (a sink and a window)
  StreamMethod stream;
};

std::string case_name(const ::testing::TestParamInfo<Case>& p) {
  return std::string(p.param.model) + (p.param.sparse ? "_ashape" : "") +
         (p.param.stream != StreamMethod::None ? std::string("_") + stream_method_name(p.param.stream) : "");
}

class EngineEqualsTwin : public ::testing::TestWithParam<Case> {};

// Prefill in chunks, decode steps, a second turn prefilled after them (staged again from the blocks), more decode
// steps, then every row's logits of a third piece: each call's logits equal the twin's.
TEST_P(EngineEqualsTwin, PrefillDecodeAndTheNextTurn) {
  const Case& k = GetParam();
  const Model& m = fixture(k.model);
  const ModelConfig& c = m.config();
  EngineOptions o;
  o.chunk_size = 16;
  o.kv_type = KVType::F32;
  if (k.sparse)
    o.policy = attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 16});
  if (k.stream != StreamMethod::None) o.stream = small_stream(k.stream);
  Engine engine(m, o);
  Twin twin(m, o.policy, o.chunk_size, o.stream);
  const std::vector<int32_t> first = random_tokens(70, c.vocab_size, 1), second = random_tokens(29, c.vocab_size, 2),
                             third = random_tokens(21, c.vocab_size, 3);
  std::vector<float> got = engine.prefill(first), want = twin.prefill(first, LogitRows::Last);
  expect_close(got, want, "first prefill");
  for (int turn = 0; turn < 2; ++turn) {
    for (int i = 0; i < 6; ++i) {
      const int32_t t = argmax_of(want);
      got = engine.decode(t);
      want = twin.decode(t);
      expect_close(got, want, "turn " + std::to_string(turn) + " decode " + std::to_string(i));
    }
    if (turn == 0) {
      got = engine.prefill(second);
      want = twin.prefill(second, LogitRows::Last);
      expect_close(got, want, "second prefill (after decode steps)");
    }
  }
  EXPECT_EQ(engine.position(), 70 + 6 + 29 + 6);
  expect_close(engine.forward_all_logits(third), twin.prefill(third, LogitRows::All), "every row of a third piece");
  EXPECT_EQ(engine.position(), 70 + 6 + 29 + 6 + 21);
  EXPECT_EQ(engine.stats().prefill_tokens, 70 + 29 + 21);
  EXPECT_EQ(engine.stats().decode_tokens, 12);
  EXPECT_EQ(engine.streaming() != nullptr, k.stream != StreamMethod::None);
  // A prefill right after a prefill (the third piece still staged, not yet in its blocks, when the fourth comes),
  // then decode steps over the blocks both moved into.
  const std::vector<int32_t> fourth = random_tokens(13, c.vocab_size, 4);
  want = twin.prefill(fourth, LogitRows::Last);
  expect_close(engine.prefill(fourth), want, "a prefill right after a prefill");
  for (int i = 0; i < 2; ++i) {
    const int32_t t = argmax_of(want);
    want = twin.decode(t);
    expect_close(engine.decode(t), want, "decode " + std::to_string(i) + " after two prefills in a row");
  }
  EXPECT_EQ(engine.position(), 70 + 6 + 29 + 6 + 21 + 13 + 2);
  // reset() empties the sequence: the same prompt gives the first prefill's logits again.
  engine.reset();
  EXPECT_EQ(engine.position(), 0);
  Twin fresh(m, o.policy, o.chunk_size, o.stream);
  want = fresh.prefill(first, LogitRows::Last);
  expect_close(engine.prefill(first), want, "after reset");
  // Decode steps read the blocks again, whose pages reset() gave back to the system (release_free_memory).
  for (int i = 0; i < 3; ++i) {
    const int32_t t = argmax_of(want);
    want = fresh.decode(t);
    expect_close(engine.decode(t), want, "decode " + std::to_string(i) + " after reset");
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineEqualsTwin,
                         ::testing::Values(Case{"llama3", false, StreamMethod::None}, Case{"qwen2", false, StreamMethod::None},
                                           Case{"gemma3", false, StreamMethod::None},
                                           Case{"mistral", false, StreamMethod::None},
                                           Case{"llama3", true, StreamMethod::None}, Case{"gemma3", true, StreamMethod::None},
                                           Case{"llama3", false, StreamMethod::Ltri},
                                           Case{"llama3", false, StreamMethod::StreamingLLM}),
                         case_name);

// score() is every row's log-probability of the next token, whatever the chunking.
TEST(EngineScheduler, ScoreIsTheLogSoftmaxOfEveryRow) {
  const Model& m = fixture("qwen2");
  const ModelConfig& c = m.config();
  const std::vector<int32_t> tokens = random_tokens(50, c.vocab_size, 9);
  EngineOptions o;
  o.chunk_size = 16;
  o.kv_type = KVType::F32;  // the twin's cache
  Engine engine(m, o);
  const std::vector<double> lp = engine.score(tokens);
  Twin twin(m, {}, 16, {});
  const std::vector<float> all = twin.prefill(tokens, LogitRows::All);
  ASSERT_EQ(lp.size(), tokens.size() - 1);
  const auto vocab = static_cast<size_t>(c.vocab_size);
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    const float* row = all.data() + i * vocab;
    const float mx = *std::max_element(row, row + vocab);
    double sum = 0;
    for (size_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    EXPECT_NEAR(lp[i], static_cast<double>(row[tokens[i + 1]]) - mx - std::log(sum), 2e-4) << "row " << i;
  }
}

// next_token_logprobs (the host's reduction of score() and BatchBackend::prefill_chunk_logprobs): each row's
// log-softmax at its next token; a token outside the vocabulary or too few logits is refused.
TEST(EngineScheduler, NextTokenLogprobsAndTheirErrors) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f, 3.0f, 0.5f};  // 2 rows of 3
  const std::vector<int32_t> next = {2, 0};
  const std::vector<double> lp = next_token_logprobs(logits, 3, next);
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_NEAR(lp[0], 2.0 - std::log(std::exp(0.0) + std::exp(1.0) + std::exp(2.0)), 1e-12);
  EXPECT_NEAR(lp[1], -1.0 - std::log(std::exp(-1.0) + std::exp(3.0) + std::exp(0.5)), 1e-12);
  EXPECT_EQ(next_token_logprobs(logits, 3, std::vector<int32_t>{1}).size(), 1u);  // fewer rows than logits: fine
  const std::vector<int32_t> bad = {3}, three = {0, 0, 0};
  EXPECT_EQ(error_of([&] { (void)next_token_logprobs(logits, 3, bad); }),
            "log-probabilities: token 3 outside the vocabulary");
  EXPECT_EQ(error_of([&] { (void)next_token_logprobs(logits, 3, three); }),
            "log-probabilities: 6 logits for 3 rows of 3");
}

// The engine's generation equals the batched engine's tokens for the same request (greedy and sampled), over the
// CPU backend and the tensor-parallel CPU backend (two ranks).
TEST(EngineScheduler, GenerateEqualsTheBatchedEngineOnEveryCpuBackend) {
  for (const char* name : {"llama3", "gemma3"}) {
    const Model& m = fixture(name);
    const ModelConfig& c = m.config();
    parallel::CostModel costs;
    costs.num_q_heads = c.num_q_heads;
    costs.num_kv_heads = c.num_kv_heads;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      parallel::LayerCosts lc;
      for (int32_t h = 0; h < c.num_q_heads; ++h) lc.attn.push_back(1.0 + h);
      costs.layers.push_back(lc);
    }
    const parallel::Placement placement = parallel::place(costs, 2, parallel::PlacementMethod::kGreedy);
    for (int sampled = 0; sampled < 2; ++sampled) {
      BatchRequest r;
      r.prompt = random_tokens(45, c.vocab_size, 17);
      r.options.max_new_tokens = 12;
      if (sampled) r.options.sampling = {0.8f, 20, 0.9f, 77};
      CpuBatchBackend batch_backend(m);
      BatchEngineOptions bo;
      bo.chunk_size = 16;
      BatchEngine batched(batch_backend, bo);
      const std::vector<int32_t> want = batched.generate_all({r})[0];
      EngineOptions o;
      o.chunk_size = 16;
      Engine cpu(m, o);
      EXPECT_EQ(cpu.generate(r.prompt, r.options), want) << name << (sampled ? ", sampled" : ", greedy");
      Engine tp(m, parallel::tp_cpu_batch_backend(m, placement), o);
      EXPECT_EQ(tp.generate(r.prompt, r.options), want) << name << (sampled ? ", sampled" : ", greedy") << ", 2 ranks";
      EXPECT_EQ(cpu.position(), 45 + 12);
    }
  }
}

// The context limit's messages are the single-sequence engine's; the KV blocks held are those of one sequence.
TEST(EngineScheduler, ContextLimitAndMemory) {
  const Model& m = fixture("llama3");
  const ModelConfig& c = m.config();
  EngineOptions o;
  o.max_context = 40;
  Engine engine(m, o);
  EXPECT_EQ(engine.max_context(), 40);
  EXPECT_EQ(engine.kv_cache_bytes(), 0u);
  std::string error;
  try {
    engine.prefill(random_tokens(41, c.vocab_size, 4));
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "prompt of 41 tokens exceeds the context limit of 40 tokens (model " + c.name +
                       "); pass a larger max context (--max-context) or shorten the prompt");
  engine.prefill(random_tokens(40, c.vocab_size, 4));
  const double block = engine.scheduler().block_bytes();
  EXPECT_EQ(engine.kv_cache_bytes(), static_cast<size_t>(block * c.num_layers * c.num_kv_heads));  // 40 rows: 1 block
  error.clear();
  try {
    engine.decode(1);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "decoding past the context limit of 40 tokens (model " + c.name +
                       "); pass a larger max context (--max-context) or generate fewer tokens");
  EXPECT_EQ(engine.position(), 40);
}

}  // namespace
}  // namespace tessera::runtime
