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

int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double u) {
  check(!logits.empty(), "sampling: empty logits");
  const size_t n = logits.size();
  auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  // ids[0, sorted) is in `before` order and holds the `sorted` first candidates of that order.
  size_t keep = n, sorted = 0;
  if (options.top_k > 0 && static_cast<size_t>(options.top_k) < n) {
    keep = sorted = static_cast<size_t>(options.top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(), before);
    ids.resize(keep);
  }
  auto sort_to = [&](size_t m) {  // extends the ordered prefix to min(m, keep) candidates
    m = std::min(m, keep);
    if (m <= sorted) return;
    std::partial_sort(ids.begin() + static_cast<std::ptrdiff_t>(sorted), ids.begin() + static_cast<std::ptrdiff_t>(m),
                      ids.begin() + static_cast<std::ptrdiff_t>(keep), before);
    sorted = m;
  };

  // Softmax over the candidates, in double (p by token id).
  const double inv_t = 1.0 / static_cast<double>(options.temperature);
  float best = logits[static_cast<size_t>(ids[0])];
  for (size_t i = 1; i < keep; ++i) best = std::max(best, logits[static_cast<size_t>(ids[i])]);
  const double top = static_cast<double>(best) * inv_t;
  std::vector<double> p(n, 0.0);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    const auto id = static_cast<size_t>(ids[i]);
    p[id] = std::exp(static_cast<double>(logits[id]) * inv_t - top);
    sum += p[id];
  }
  if (options.top_p < 1.0f) {
    double cum = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      if (i == sorted) sort_to(std::max<size_t>(64, 4 * sorted));
      cum += p[static_cast<size_t>(ids[i])] / sum;
      if (cum >= static_cast<double>(options.top_p)) {
        cut = i + 1;
        break;
      }
    }
    keep = std::max<size_t>(cut, 1);
  }
  // The kept tokens in id order; the draw.
  if (keep < n) {
    ids.resize(keep);
    std::sort(ids.begin(), ids.end());
  } else {
    std::iota(ids.begin(), ids.end(), 0);
  }
  double kept = 0;
  for (int32_t id : ids) kept += p[static_cast<size_t>(id)];
  const double r = u * kept;
  double acc = 0;
  for (int32_t id : ids) {
    acc += p[static_cast<size_t>(id)];
    if (r < acc) return id;
  }
  return ids.back();
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (greedy()) return argmax(logits);
  return sample_token(logits, options_, uniform());
}

}  // namespace tessera::runtime
