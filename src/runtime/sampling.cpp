#include "runtime/sampling.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/grammar.h"

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
  check(std::isfinite(o.min_p) && o.min_p >= 0 && o.min_p <= 1,
        std::string(n.min_p) + " must be in [0, 1] (0 = off), got " + show(o.min_p));
  check(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0,
        std::string(n.repetition_penalty) + " must be a number > 0 (1 = off), got " + show(o.repetition_penalty));
  check(std::isfinite(o.presence_penalty),
        std::string(n.presence_penalty) + " must be a finite number (0 = off), got " + show(o.presence_penalty));
  check(std::isfinite(o.frequency_penalty),
        std::string(n.frequency_penalty) + " must be a finite number (0 = off), got " + show(o.frequency_penalty));
  for (const auto& [id, bias] : o.logit_bias) {
    check(id >= 0, std::string(n.logit_bias) + ": token id " + std::to_string(id) + " is negative");
    check(std::isfinite(bias), std::string(n.logit_bias) + ": the bias of token " + std::to_string(id) +
                                   " must be a finite number, got " + show(bias));
  }
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  check_sampling_options(options);
  if (options_.grammar) grammar_ = std::make_shared<GrammarMatcher>(options_.grammar);
}

void Sampler::set_prompt(std::span<const int32_t> prompt) {
  if (!options_.edits_logits() || options_.repetition_penalty == 1.0f) return;
  prompt_.assign(prompt.begin(), prompt.end());
  std::sort(prompt_.begin(), prompt_.end());
  prompt_.erase(std::unique(prompt_.begin(), prompt_.end()), prompt_.end());
}

void Sampler::accept(int32_t token) {
  if (grammar_) grammar_->accept(token);
  if (!options_.edits_logits()) return;
  const auto it = std::lower_bound(counts_.begin(), counts_.end(), std::make_pair(token, 0));
  if (it != counts_.end() && it->first == token) ++it->second;
  else counts_.insert(it, {token, 1});
}

std::vector<LogitEdit> Sampler::edits(int32_t vocab) const {
  std::vector<LogitEdit> out = penalty_edits(vocab);
  if (!grammar_) return out;
  // The grammar's mask merged in: a forbidden token's edit is bias -inf alone (whatever the penalties would add);
  // the penalties' edits of allowed tokens stay. The mask is read a 32-token word at a time.
  const std::span<const uint32_t> bits = grammar_->allowed();
  const int32_t known = grammar_->vocab_size();  // ids from here on (a padded LM head) are never allowed
  auto word_of = [&](int32_t w) {
    uint32_t word = w * 32 < known ? bits[static_cast<size_t>(w)] : 0u;
    if (w * 32 + 32 > known && w * 32 < known) word &= (1u << (known - w * 32)) - 1u;
    return word;
  };
  // One allocation of the exact size (growing by doubling to ~1.4 MB a step cost more than the mask itself).
  size_t forbidden = 0;
  for (int32_t w = 0; w * 32 < vocab; ++w)
    forbidden += static_cast<size_t>(std::min(32, vocab - w * 32) - std::popcount(word_of(w)));
  std::vector<LogitEdit> merged;
  merged.reserve(out.size() + forbidden);
  size_t j = 0;
  for (int32_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t word = word_of(w);
    if (word == 0xffffffffu) continue;
    for (int32_t b = 0; b < 32 && w * 32 + b < vocab; ++b) {
      if ((word >> b) & 1u) continue;
      const int32_t t = w * 32 + b;
      while (j < out.size() && out[j].token < t) merged.push_back(out[j++]);
      if (j < out.size() && out[j].token == t) ++j;
      merged.push_back(LogitEdit{.token = t, .bias = -std::numeric_limits<float>::infinity()});
    }
  }
  merged.insert(merged.end(), out.begin() + static_cast<std::ptrdiff_t>(j), out.end());
  return merged;
}

std::vector<LogitEdit> Sampler::penalty_edits(int32_t vocab) const {
  std::vector<LogitEdit> out;
  if (!options_.edits_logits()) return out;
  const SamplingOptions& o = options_;
  const LogitEdit none{.token = 0, .count = 0, .seen = 0, .bias = 0.0f, .repetition = o.repetition_penalty,
                       .frequency = o.frequency_penalty, .presence = o.presence_penalty};
  std::vector<std::pair<int32_t, float>> bias = o.logit_bias;
  for (const auto& [id, b] : bias)
    check(id >= 0 && id < vocab, "logit_bias: token id " + std::to_string(id) + " is outside the vocabulary of " +
                                     std::to_string(vocab) + " tokens");
  std::stable_sort(bias.begin(), bias.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  // Merge the three sorted lists (a repeated bias id: the biases add up, as a JSON object cannot repeat a key).
  size_t ib = 0, ip = 0, ic = 0;
  const bool repetition = o.repetition_penalty != 1.0f;
  for (;;) {
    int32_t t = INT32_MAX;
    if (ib < bias.size()) t = std::min(t, bias[ib].first);
    if (repetition && ip < prompt_.size()) t = std::min(t, prompt_[ip]);
    if (ic < counts_.size()) t = std::min(t, counts_[ic].first);
    if (t == INT32_MAX) break;
    LogitEdit e = none;
    e.token = t;
    while (ib < bias.size() && bias[ib].first == t) e.bias += bias[ib++].second;
    if (repetition && ip < prompt_.size() && prompt_[ip] == t) {
      e.seen = 1;
      ++ip;
    }
    if (ic < counts_.size() && counts_[ic].first == t) {
      e.count = counts_[ic++].second;
      e.seen = 1;
    }
    if (t < 0 || t >= vocab) continue;  // a generated id outside the vocabulary cannot be: nothing to edit
    out.push_back(e);
  }
  return out;
}

void Sampler::edit(std::span<float> logits) const {
  for (const LogitEdit& e : edits(static_cast<int32_t>(logits.size())))
    logits[static_cast<size_t>(e.token)] = edit_logit(logits[static_cast<size_t>(e.token)], e);
}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

namespace {

// Steps 4-7: the kept token ids in id order (ids) and the unnormalised probabilities by id (p).
void kept_tokens(std::span<const float> logits, const SamplingOptions& options, std::vector<int32_t>& ids,
                 std::vector<double>& p) {
  check(!logits.empty(), "sampling: empty logits");
  const size_t n = logits.size();
  auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  ids.resize(n);
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
  p.assign(n, 0.0);
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
  // The kept tokens in id order.
  if (keep < n) {
    ids.resize(keep);
    std::sort(ids.begin(), ids.end());
  } else {
    std::iota(ids.begin(), ids.end(), 0);
  }
  // min_p: relative to the largest kept probability, which is exp(0) = 1 here (p is relative to the largest logit).
  if (options.min_p > 0.0f) {
    const auto threshold = static_cast<double>(options.min_p);
    std::vector<int32_t> above;
    for (int32_t id : ids)
      if (p[static_cast<size_t>(id)] >= threshold) above.push_back(id);
    for (int32_t id : ids)
      if (p[static_cast<size_t>(id)] < threshold) p[static_cast<size_t>(id)] = 0.0;
    ids = std::move(above);  // never empty: the largest has p = 1 >= min_p
  }
  for (size_t i = 0, j = 0; i < n; ++i) {  // p is 0 outside the kept set
    if (j < ids.size() && static_cast<size_t>(ids[j]) == i) ++j;
    else p[i] = 0.0;
  }
}

}  // namespace

std::vector<double> token_probabilities(std::span<const float> logits, const SamplingOptions& options) {
  std::vector<int32_t> ids;
  std::vector<double> p;
  kept_tokens(logits, options, ids, p);
  double kept = 0;
  for (int32_t id : ids) kept += p[static_cast<size_t>(id)];
  for (double& x : p) x /= kept;
  return p;
}

double log_sum_exp(std::span<const float> x) {
  const float mx = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (float v : x) sum += std::exp(static_cast<double>(v) - mx);
  return static_cast<double>(mx) + std::log(sum);
}

std::vector<double> next_token_logprobs(std::span<const float> logits, int64_t vocab, std::span<const int32_t> next) {
  const auto rows = static_cast<int64_t>(next.size());
  check(vocab > 0 && static_cast<int64_t>(logits.size()) >= rows * vocab,
        "log-probabilities: " + std::to_string(logits.size()) + " logits for " + std::to_string(rows) + " rows of " +
            std::to_string(vocab));
  for (const int32_t t : next)
    check(t >= 0 && t < vocab, "log-probabilities: token " + std::to_string(t) + " outside the vocabulary");
  std::vector<double> out(static_cast<size_t>(rows));
  // A log-softmax over the whole vocabulary a row (262,144 exponentials for Gemma-3): rows split over the pool in
  // blocks of 16 (each row's sum in double, in vocabulary order, whatever the split).
  constexpr int64_t kRowsPerItem = 16;
  ThreadPool::global().parallel_for((rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item, int) {
    for (int64_t r = item * kRowsPerItem; r < std::min(rows, (item + 1) * kRowsPerItem); ++r) {
      const std::span<const float> row = logits.subspan(static_cast<size_t>(r * vocab), static_cast<size_t>(vocab));
      out[static_cast<size_t>(r)] =
          static_cast<double>(row[static_cast<size_t>(next[static_cast<size_t>(r)])]) - log_sum_exp(row);
    }
  });
  return out;
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t top) {
  check(!logits.empty(), "log-probabilities: empty logits");
  check(token >= 0 && static_cast<size_t>(token) < logits.size(),
        "log-probabilities: token " + std::to_string(token) + " outside the vocabulary");
  const double lse = log_sum_exp(logits);
  TokenLogprobs out;
  out.token = token;
  out.logprob = static_cast<float>(static_cast<double>(logits[static_cast<size_t>(token)]) - lse);
  const size_t k = std::min(logits.size(), static_cast<size_t>(std::max(top, 0)));
  if (k > 0) {
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
      const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
      return la > lb || (la == lb && a < b);
    });
    for (size_t i = 0; i < k; ++i)
      out.top.push_back({ids[i], static_cast<float>(static_cast<double>(logits[static_cast<size_t>(ids[i])]) - lse)});
  }
  return out;
}

int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double u) {
  std::vector<int32_t> ids;
  std::vector<double> p;
  kept_tokens(logits, options, ids, p);
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
  int32_t token = 0;
  if (options_.edits_logits() || grammar_) {
    std::vector<float> edited(logits.begin(), logits.end());
    for (const LogitEdit& e : penalty_edits(static_cast<int32_t>(edited.size())))
      edited[static_cast<size_t>(e.token)] = edit_logit(edited[static_cast<size_t>(e.token)], e);
    if (grammar_) grammar_->mask(edited);
    token = greedy() ? argmax(edited) : sample_token(edited, options_, uniform());
  } else {
    token = greedy() ? argmax(logits) : sample_token(logits, options_, uniform());
  }
  accept(token);
  return token;
}

}  // namespace tessera::runtime
