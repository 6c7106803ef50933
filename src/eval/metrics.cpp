#include "eval/metrics.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tessera::eval {

namespace {

void check_logprob(double lp) {
  check(!std::isnan(lp) && lp <= 0.0,
        "perplexity: a log-probability must be <= 0 and not NaN, got " + std::to_string(lp));
}

}  // namespace

double perplexity(std::span<const double> logprobs) {
  PerplexityAccumulator acc;
  acc.add(logprobs);
  return acc.perplexity();
}

void PerplexityAccumulator::add(double logprob) {
  check_logprob(logprob);
  nll_sum_ -= logprob;
  ++tokens_;
}

void PerplexityAccumulator::add(std::span<const double> logprobs) {
  for (double lp : logprobs) add(lp);
}

double PerplexityAccumulator::mean_nll() const {
  check(tokens_ > 0, "perplexity: no tokens");
  return nll_sum_ / static_cast<double>(tokens_);
}

double PerplexityAccumulator::perplexity() const {
  return std::exp(mean_nll());
}

double PerplexityAccumulator::bits_per_token() const {
  return mean_nll() / std::log(2.0);
}

Interval wilson_interval(const PassRate& rate, double z) {
  if (rate.total == 0) return {0.0, 1.0};
  const double n = static_cast<double>(rate.total);
  const double p = rate.rate();
  const double z2 = z * z;
  const double centre = (p + z2 / (2 * n)) / (1 + z2 / n);
  const double half = z / (1 + z2 / n) * std::sqrt(p * (1 - p) / n + z2 / (4 * n * n));
  return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
}

double mean(std::span<const double> values) {
  check(!values.empty(), "mean: no values");
  double s = 0;
  for (double v : values) s += v;
  return s / static_cast<double>(values.size());
}

}  // namespace tessera::eval
