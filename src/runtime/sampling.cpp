#include "runtime/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace tessera::runtime {

int32_t argmax(std::span<const float> logits) {
  check(!logits.empty(), "sampling: empty logits");
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

namespace {
std::string show(double v) {
  std::string s = std::to_string(v);
  if (s.find('.') != std::string::npos) {
    s.erase(s.find_last_not_of('0') + 1);
    if (s.back() == '.') s.pop_back();
  }
  return s;
}
}  // namespace

void check_sampling_options(const SamplingOptions& o, const SamplingOptionNames& n) {
  check(std::isfinite(o.temperature) && o.temperature >= 0,
        std::string(n.temperature) + " must be a number >= 0 (0 = greedy), got " + show(o.temperature));
  check(o.top_k >= 0, std::string(n.top_k) + " must be >= 0 (0 = off), got " + std::to_string(o.top_k));
  check(std::isfinite(o.top_p) && o.top_p > 0 && o.top_p <= 1,
        std::string(n.top_p) + " must be in (0, 1] (1 = off), got " + show(o.top_p));
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  check_sampling_options(options);
}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (options_.temperature <= 0.0f) return argmax(logits);
  check(!logits.empty(), "sampling: empty logits");
  const size_t n = logits.size();
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  size_t keep = n;
  if (options_.top_k > 0 && static_cast<size_t>(options_.top_k) < n) {
    keep = static_cast<size_t>(options_.top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(), before);
  } else {
    std::sort(ids.begin(), ids.end(), before);
  }
  ids.resize(keep);

  // Softmax over the candidates, in double.
  const double inv_t = 1.0 / static_cast<double>(options_.temperature);
  const double top = static_cast<double>(logits[static_cast<size_t>(ids[0])]) * inv_t;
  std::vector<double> p(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp(static_cast<double>(logits[static_cast<size_t>(ids[i])]) * inv_t - top);
    sum += p[i];
  }
  if (options_.top_p < 1.0f) {
    double cum = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += p[i] / sum;
      if (cum >= static_cast<double>(options_.top_p)) {
        cut = i + 1;
        break;
      }
    }
    keep = std::max<size_t>(cut, 1);
    sum = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  const double r = uniform() * sum;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (r < acc) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace tessera::runtime
