#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/model.h"
#include "runtime/batch_engine.h"
#include "runtime/engine.h"
#include "runtime/sampling.h"

namespace tessera::runtime {
namespace {

const std::vector<float> kLogits = {0.5f, 2.0f, -1.0f, 1.9f, 2.0f, 0.0f, -3.0f, 1.0f};

TEST(RuntimeSampling, ArgmaxTiesGoToTheSmallerId) {
  EXPECT_EQ(argmax(kLogits), 1);
  EXPECT_EQ(argmax(std::vector<float>{-5.0f}), 0);
  EXPECT_THROW(argmax(std::vector<float>{}), Error);
}

TEST(RuntimeSampling, OptionsAreChecked) {
  auto error = [](const SamplingOptions& o, const SamplingOptionNames& n = {}) {
    try {
      check_sampling_options(o, n);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({.temperature = 0.7f, .top_k = 40, .top_p = 0.95f}), "no error");
  EXPECT_EQ(error({.temperature = -1.0f}), "temperature must be a number >= 0 (0 = greedy), got -1");
  EXPECT_EQ(error({.temperature = NAN}), "temperature must be a number >= 0 (0 = greedy), got nan");
  EXPECT_EQ(error({.top_k = -2}), "top_k must be >= 0 (0 = off), got -2");
  EXPECT_EQ(error({.top_p = 0.0f}), "top_p must be in (0, 1] (1 = off), got 0");
  EXPECT_EQ(error({.top_p = 1.5f}, {.top_p = "--top-p"}), "--top-p must be in (0, 1] (1 = off), got 1.5");
  EXPECT_THROW(Sampler({.top_p = 2.0f}), Error);
}

TEST(RuntimeSampling, GreedyIsArgmax) {
  Sampler s({.temperature = 0.0f, .seed = 3});
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s.sample(kLogits), 1);
}

TEST(RuntimeSampling, TopKOneAndTinyTopPAreGreedy) {
  Sampler k1({.temperature = 1.5f, .top_k = 1, .seed = 9});
  Sampler p0({.temperature = 1.5f, .top_p = 1e-6f, .seed = 9});
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(k1.sample(kLogits), 1);
    EXPECT_EQ(p0.sample(kLogits), 1);
  }
}

TEST(RuntimeSampling, SeededRunsRepeat) {
  const SamplingOptions o{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 1234};
  Sampler a(o), b(o), c({.temperature = 1.0f, .seed = 99});
  std::vector<int32_t> ra, rb, rc;
  for (int i = 0; i < 64; ++i) {
    ra.push_back(a.sample(kLogits));
    rb.push_back(b.sample(kLogits));
    rc.push_back(c.sample(kLogits));
  }
  EXPECT_EQ(ra, rb);
  EXPECT_NE(ra, rc);
}

TEST(RuntimeSampling, FrequenciesFollowTheSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f), -100.0f};
  Sampler s({.temperature = 1.0f, .seed = 5});
  std::vector<int> counts(4, 0);
  const int n = 60000;
  for (int i = 0; i < n; ++i) ++counts[static_cast<size_t>(s.sample(logits))];
  EXPECT_NEAR(counts[0] / double(n), 1.0 / 6, 0.01);
  EXPECT_NEAR(counts[1] / double(n), 2.0 / 6, 0.01);
  EXPECT_NEAR(counts[2] / double(n), 3.0 / 6, 0.01);
  EXPECT_EQ(counts[3], 0);
}

TEST(RuntimeSampling, TopKAndTopPRestrictTheCandidates) {
  // top_k = 2 keeps ids 1 and 4 (both 2.0). Over probabilities {0: 1/6, 1: 2/6, 2: 3/6}, top_p = 0.45 keeps
  // id 2 alone (its mass reaches 0.45); top_p = 0.6 needs id 1 as well.
  Sampler k2({.temperature = 1.0f, .top_k = 2, .seed = 11});
  for (int i = 0; i < 200; ++i) {
    const int32_t t = k2.sample(kLogits);
    EXPECT_TRUE(t == 1 || t == 4) << t;
  }
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f)};
  Sampler p5({.temperature = 1.0f, .top_p = 0.45f, .seed = 11});
  Sampler p6({.temperature = 1.0f, .top_p = 0.6f, .seed = 11});
  bool saw1 = false;
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(p5.sample(logits), 2);
    const int32_t t = p6.sample(logits);
    EXPECT_TRUE(t == 1 || t == 2);
    saw1 = saw1 || t == 1;
  }
  EXPECT_TRUE(saw1);
}

// The sampling rule written the obvious way (sampling.h): every candidate sorted, probabilities in double; the
// top_k and top_p cuts in logit order, the draw over the kept tokens in id order. Takes the uniform draw u.
int32_t reference_sample(const std::vector<float>& logits, const SamplingOptions& o, double u) {
  const size_t n = logits.size();
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  });
  std::vector<int32_t> cand = order;
  const bool top_k = o.top_k > 0 && static_cast<size_t>(o.top_k) < n;
  if (top_k) cand.resize(static_cast<size_t>(o.top_k));
  const double inv_t = 1.0 / o.temperature, top = static_cast<double>(logits[static_cast<size_t>(cand[0])]) * inv_t;
  auto p = [&](int32_t id) { return std::exp(static_cast<double>(logits[static_cast<size_t>(id)]) * inv_t - top); };
  std::vector<int32_t> summed = cand;  // the order sample_token sums the total in: logit order after top_k, else id
  if (!top_k) std::sort(summed.begin(), summed.end());
  double sum = 0;
  for (int32_t id : summed) sum += p(id);
  if (o.top_p < 1.0f) {
    double cum = 0;
    size_t keep = cand.size();
    for (size_t i = 0; i < cand.size(); ++i) {
      cum += p(cand[i]) / sum;
      if (cum >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
    cand.resize(keep);
  }
  std::sort(cand.begin(), cand.end());
  double kept = 0;
  for (int32_t id : cand) kept += p(id);
  const double r = u * kept;
  double acc = 0;
  for (int32_t id : cand) {
    acc += p(id);
    if (r < acc) return id;
  }
  return cand.back();
}

// Sampler (partial sorts of growing prefixes) = the obvious rule above on
// vocabulary-sized random logits, token for token, for every combination of the options; the uniform stream is the
// one Sampler documents (mt19937_64(seed), 53 bits).
TEST(RuntimeSampling, EqualsTheFullSortReference) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 2.5f);
  std::vector<float> logits(49152);
  for (auto& x : logits) x = dist(rng);
  for (int i = 0; i < 30; ++i) logits[rng() % logits.size()] += 10.0f;  // a peaked head, as LM logits have
  logits[100] = logits[200] = 40.0f;                                    // a tie at the top
  for (const SamplingOptions& o : {SamplingOptions{.temperature = 0.8f, .seed = 3},
                                   SamplingOptions{.temperature = 1.0f, .top_p = 0.9f, .seed = 4},
                                   SamplingOptions{.temperature = 1.5f, .top_p = 0.999f, .seed = 5},
                                   SamplingOptions{.temperature = 0.7f, .top_k = 40, .seed = 6},
                                   SamplingOptions{.temperature = 2.0f, .top_k = 5000, .top_p = 0.8f, .seed = 8}}) {
    Sampler s(o);
    std::mt19937_64 stream(o.seed);
    for (int i = 0; i < 40; ++i) {
      const double u = static_cast<double>(stream() >> 11) * 0x1.0p-53;
      EXPECT_EQ(s.sample(logits), reference_sample(logits, o, u))
          << "temperature " << o.temperature << " top_k " << o.top_k << " top_p " << o.top_p << " draw " << i;
    }
  }
}

TEST(RuntimeSampling, LowTemperatureConcentrates) {
  Sampler s({.temperature = 0.01f, .seed = 1});
  const std::vector<float> logits = {1.0f, 1.5f, 0.2f};
  for (int i = 0; i < 100; ++i) EXPECT_EQ(s.sample(logits), 1);
}

// ---- penalties, logit_bias, min_p against transformers (tests/data/sampling, scripts/make_sampling_fixtures.py) ----

nlohmann::json hf_fixture() {
  std::ifstream f(std::string(TESSERA_SOURCE_DIR) + "/tests/data/sampling/hf_processors.json");
  EXPECT_TRUE(f.good());
  return nlohmann::json::parse(f);
}

SamplingOptions options_from(const nlohmann::json& o) {
  SamplingOptions s;
  s.temperature = o.value("temperature", 0.0f);
  s.top_k = o.value("top_k", 0);
  s.top_p = o.value("top_p", 1.0f);
  s.min_p = o.value("min_p", 0.0f);
  s.repetition_penalty = o.value("repetition_penalty", 1.0f);
  s.presence_penalty = o.value("presence_penalty", 0.0f);
  s.frequency_penalty = o.value("frequency_penalty", 0.0f);
  if (o.contains("logit_bias"))
    for (const auto& b : o["logit_bias"]) s.logit_bias.emplace_back(b[0].get<int32_t>(), b[1].get<float>());
  return s;
}

// Each case: logits, prompt, generated tokens and options; transformers' edited logits (bias, repetition,
// presence / frequency) must equal Sampler::edit's to the float, its distribution after temperature, top_k, top_p
// and min_p token_probabilities' (the same kept set; probabilities to 1e-6), its greedy token argmax's.
TEST(RuntimeSampling, EqualsTransformersLogitsProcessors) {
  const nlohmann::json j = hf_fixture();
  ASSERT_EQ(j["cases"].size(), 10u);
  for (const auto& c : j["cases"]) {
    const SamplingOptions o = options_from(c["options"]);
    const auto logits = c["logits"].get<std::vector<float>>();
    const auto prompt = c["prompt"].get<std::vector<int32_t>>();
    Sampler s(o);
    s.set_prompt(prompt);
    for (int32_t t : c["generated"].get<std::vector<int32_t>>()) s.accept(t);
    std::vector<float> edited = logits;
    s.edit(edited);
    const auto want = c["edited"].get<std::vector<float>>();
    const std::string what = c["options"].dump();
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(edited[i], want[i]) << what << " token " << i;
    EXPECT_EQ(argmax(edited), c["greedy"].get<int32_t>()) << what;
    const std::vector<double> p = token_probabilities(edited, o);
    const auto hf = c["probs"].get<std::vector<double>>();
    for (size_t i = 0; i < hf.size(); ++i) {
      EXPECT_EQ(p[i] > 0, hf[i] > 0) << what << " token " << i << ": kept by one and not the other";
      EXPECT_NEAR(p[i], hf[i], 1e-6) << what << " token " << i;
    }
  }
}

// Greedy generation with penalties and a bias on the tiny llama3 fixture: token for token what transformers'
// generate() gives with its processors (and presence / frequency by OpenAI's formula as a custom processor).
TEST(RuntimeSampling, GreedyWithPenaltiesEqualsTransformersGenerate) {
  const nlohmann::json j = hf_fixture();
  const auto model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/llama3");
  ASSERT_EQ(j["greedy"].size(), 5u);
  for (const auto& g : j["greedy"]) {
    Engine engine(*model);
    GenerateOptions o;
    o.max_new_tokens = 24;
    o.sampling = options_from(g["options"]);
    o.sampling.temperature = 0.0f;
    const auto prompt = g["prompt"].get<std::vector<int32_t>>();
    EXPECT_EQ(engine.generate(prompt, o), g["tokens"].get<std::vector<int32_t>>()) << g["options"].dump();
  }
}

// The batched engine (CPU backend) applies the same penalties: each request's tokens are transformers' again, all
// of them in one batch; and its log-probabilities equal the single-sequence engine's.
TEST(RuntimeSampling, BatchedEngineAppliesPenaltiesAndLogprobs) {
  const nlohmann::json j = hf_fixture();
  const auto model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/llama3");
  CpuBatchBackend backend(*model);
  BatchEngineOptions bo;
  bo.chunk_size = 4;
  bo.block_tokens = 8;
  BatchEngine engine(backend, bo);
  std::map<int64_t, size_t> which;
  for (size_t i = 0; i < j["greedy"].size(); ++i) {
    const auto& g = j["greedy"][i];
    BatchRequest r;
    r.prompt = g["prompt"].get<std::vector<int32_t>>();
    r.options.max_new_tokens = 24;
    r.options.sampling = options_from(g["options"]);
    r.options.sampling.temperature = 0.0f;
    r.options.logprobs = 2;
    which[engine.submit(std::move(r))] = i;
  }
  std::vector<std::vector<int32_t>> got(which.size());
  std::vector<std::vector<TokenLogprobs>> lps(which.size());
  while (engine.busy())
    for (const BatchEvent& e : engine.step()) {
      ASSERT_NE(e.reason, FinishReason::kError) << e.error;
      if (e.token < 0) continue;
      got[which[e.id]].push_back(e.token);
      ASSERT_TRUE(e.logprobs.has_value());
      lps[which[e.id]].push_back(*e.logprobs);
    }
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& g = j["greedy"][i];
    EXPECT_EQ(got[i], g["tokens"].get<std::vector<int32_t>>()) << g["options"].dump();
    // The single-sequence engine's logits for the same tokens: the log-softmax of each step's raw logits.
    Engine single(*model);
    std::vector<int32_t> seq = g["prompt"].get<std::vector<int32_t>>();
    const size_t n0 = seq.size();
    seq.insert(seq.end(), got[i].begin(), got[i].end());
    const std::vector<float> all = single.forward_all_logits(seq);
    const auto V = static_cast<size_t>(model->config().vocab_size);
    // Within 3e-4: a decode row's products run beside other rows (the batch, and with the mixed step a prefill
    // chunk's), whose BLAS kernels sum in another order than the whole sequence's forward (up to ~1.5e-4 seen).
    for (size_t t = 0; t < got[i].size(); ++t) {
      const auto row = std::span<const float>(all).subspan((n0 - 1 + t) * V, V);
      const TokenLogprobs want = token_logprobs(row, got[i][t], 2);
      EXPECT_NEAR(lps[i][t].logprob, want.logprob, 3e-4) << "request " << i << " token " << t;
      ASSERT_EQ(lps[i][t].top.size(), 2u);
      EXPECT_EQ(lps[i][t].top[0].token, want.top[0].token);
      EXPECT_NEAR(lps[i][t].top[1].logprob, want.top[1].logprob, 3e-4);
    }
  }
}

// generate() reports each returned token's log-probabilities before on_token, none for the stop token.
TEST(RuntimeSampling, GenerateReportsLogprobs) {
  const auto model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/llama3");
  Engine engine(*model);
  const std::vector<int32_t> prompt = {1, 239, 72, 223, 10};
  GenerateOptions o;
  o.max_new_tokens = 6;
  o.logprobs = 3;
  std::vector<TokenLogprobs> seen;
  o.on_logprobs = [&](const TokenLogprobs& l) { seen.push_back(l); };
  const std::vector<int32_t> out = engine.generate(prompt, o);
  ASSERT_EQ(seen.size(), out.size());
  Engine ref(*model);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), out.begin(), out.end());
  const std::vector<float> all = ref.forward_all_logits(seq);
  const auto V = static_cast<size_t>(model->config().vocab_size);
  for (size_t t = 0; t < out.size(); ++t) {
    EXPECT_EQ(seen[t].token, out[t]);
    EXPECT_EQ(seen[t].top.size(), 3u);
    EXPECT_EQ(seen[t].top[0].token, out[t]);  // greedy: the most likely token
    const TokenLogprobs want = token_logprobs(std::span<const float>(all).subspan((prompt.size() - 1 + t) * V, V), out[t], 3);
    EXPECT_NEAR(seen[t].logprob, want.logprob, 1e-4);
  }
}

TEST(RuntimeSampling, NewOptionsAreChecked) {
  auto error = [](const SamplingOptions& o) {
    try {
      check_sampling_options(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({.min_p = 1.5f}), "min_p must be in [0, 1] (0 = off), got 1.5");
  EXPECT_EQ(error({.repetition_penalty = 0.0f}), "repetition_penalty must be a number > 0 (1 = off), got 0");
  EXPECT_EQ(error({.presence_penalty = INFINITY}), "presence_penalty must be a finite number (0 = off), got inf");
  EXPECT_EQ(error({.frequency_penalty = NAN}), "frequency_penalty must be a finite number (0 = off), got nan");
  EXPECT_EQ(error({.logit_bias = {{-1, 1.0f}}}), "logit_bias: token id -1 is negative");
  Sampler s({.logit_bias = {{8, 1.0f}}});
  std::vector<float> logits = kLogits;
  try {
    s.edit(logits);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "logit_bias: token id 8 is outside the vocabulary of 8 tokens");
  }
}

// The edits list merges bias, prompt and generated tokens, one per token; sample() records what it returns.
TEST(RuntimeSampling, EditsFollowTheHistory) {
  Sampler s({.repetition_penalty = 2.0f, .presence_penalty = 0.5f, .frequency_penalty = 0.25f,
             .logit_bias = {{4, -1.0f}, {0, 3.0f}}});
  const std::vector<int32_t> prompt = {1, 1, 3};
  s.set_prompt(prompt);
  EXPECT_EQ(s.sample(kLogits), 0);  // 0.5 + 3 = 3.5 beats 2.0 / 2 (1), 1.9 / 2 (3) and 2.0 - 1 (4)
  // 0 now: 3.5 / 2 - 0.25 - 0.5 = 1, as 1 (2.0 / 2), 4 (2.0 - 1) and 7: the tie goes to the smaller id.
  EXPECT_EQ(s.sample(kLogits), 0);
  const std::vector<LogitEdit> e = s.edits(8);
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0].token, 0);
  EXPECT_EQ(e[0].count, 2);
  EXPECT_EQ(e[0].bias, 3.0f);
  EXPECT_EQ(e[1].token, 1);
  EXPECT_EQ(e[1].count, 0);
  EXPECT_EQ(e[1].seen, 1);
  EXPECT_EQ(e[2].token, 3);
  EXPECT_EQ(e[3].token, 4);
  EXPECT_EQ(e[3].count, 0);
  EXPECT_EQ(e[3].seen, 0);
  EXPECT_EQ(e[3].bias, -1.0f);
  std::vector<float> edited = kLogits;
  s.edit(edited);  // 0 after two draws: 3.5 / 2 - 2 * 0.25 - 0.5
  EXPECT_EQ(edited, (std::vector<float>{0.75f, 1.0f, -1.0f, 0.95f, 1.0f, 0.0f, -3.0f, 1.0f}));
}

TEST(RuntimeSampling, TokenLogprobsAreTheLogSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f), std::log(2.0f)};
  const TokenLogprobs l = token_logprobs(logits, 1, 3);
  EXPECT_EQ(l.token, 1);
  EXPECT_FLOAT_EQ(l.logprob, static_cast<float>(std::log(2.0 / 8)));
  ASSERT_EQ(l.top.size(), 3u);
  EXPECT_EQ(l.top[0].token, 2);
  EXPECT_FLOAT_EQ(l.top[0].logprob, static_cast<float>(std::log(3.0 / 8)));
  EXPECT_EQ(l.top[1].token, 1);  // the tie with 3 goes to the smaller id
  EXPECT_EQ(l.top[2].token, 3);
  EXPECT_TRUE(token_logprobs(logits, 0, 0).top.empty());
  EXPECT_THROW(token_logprobs(logits, 4, 1), Error);
}

}  // namespace
}  // namespace tessera::runtime
