// tessera/eval/metrics.h — model-free numbers: perplexity from log-probabilities, pass rates and their
// confidence intervals, means.
#pragma once

#include <cstddef>
#include <span>

namespace tessera::eval {

// exp(-mean(logprobs)) for natural-log probabilities of the predicted tokens. Throws tessera::Error when
// `logprobs` is empty or holds a value that is NaN or positive (a probability above 1).
double perplexity(std::span<const double> logprobs);

// Perplexity over many documents or chunks: the token-weighted mean negative log-likelihood.
class PerplexityAccumulator {
 public:
  void add(double logprob);  // same checks as perplexity()
  void add(std::span<const double> logprobs);
  size_t tokens() const { return tokens_; }
  double mean_nll() const;        // throws when no token was added
  double perplexity() const;      // exp(mean_nll())
  double bits_per_token() const;  // mean_nll() / ln 2

 private:
  double nll_sum_ = 0;
  size_t tokens_ = 0;
};

// Passed / total over a group of cases.
struct PassRate {
  size_t passed = 0;
  size_t total = 0;

  void add(bool pass) {
    passed += pass ? 1 : 0;
    ++total;
  }
  void add(const PassRate& other) {
    passed += other.passed;
    total += other.total;
  }
  // passed / total; 0 when total == 0 (check total before reading a rate).
  double rate() const { return total == 0 ? 0.0 : static_cast<double>(passed) / static_cast<double>(total); }
  bool operator==(const PassRate&) const = default;
};

struct Interval {
  double low = 0;
  double high = 0;
};

// The Wilson score interval of a pass rate (z = 1.96: 95%). [0, 1] when total == 0. With the few cases a grid
// cell holds, this says whether a sparse policy's drop from dense is more than noise.
Interval wilson_interval(const PassRate& rate, double z = 1.96);

// Arithmetic mean; throws tessera::Error when empty.
double mean(std::span<const double> values);

}  // namespace tessera::eval
