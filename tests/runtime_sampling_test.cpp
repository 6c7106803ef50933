#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
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

}  // namespace
}  // namespace tessera::runtime
