#include "eval/prompt_fit.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"

namespace tessera::eval {

FitResult fit_largest(size_t budget, size_t max_n, const std::function<size_t(size_t)>& tokens_of,
                      size_t estimate) {
  std::map<size_t, size_t> memo;
  auto f = [&](size_t n) {
    auto it = memo.find(n);
    if (it != memo.end()) return it->second;
    const size_t t = tokens_of(n);
    memo.emplace(n, t);
    return t;
  };
  auto fits = [&](size_t n) { return f(n) <= budget; };
  const size_t t0 = f(0);
  check(t0 <= budget, "fit_largest: the empty prompt is over the budget");
  if (max_n == 0) return {0, t0};

  // lo always fits; hi (when below max_n + 1) never does.
  size_t lo = 0;
  size_t hi = max_n + 1;
  if (estimate == 0) {
    // No estimate given: measure a small size and extrapolate its tokens per unit.
    const size_t probe = std::min<size_t>(max_n, 16);
    if (!fits(probe)) {
      hi = probe;
    } else {
      lo = probe;
      const double per_unit = std::max(1.0, static_cast<double>(f(probe) - t0)) / static_cast<double>(probe);
      estimate = probe + static_cast<size_t>(static_cast<double>(budget - f(probe)) / per_unit);
    }
  }
  if (hi == max_n + 1) {
    // Gallop from the estimate (steps doubling from ~1.5% of it) until the answer is bracketed.
    estimate = std::clamp<size_t>(estimate, std::max<size_t>(lo, 1), max_n);
    size_t step = std::max<size_t>(1, estimate / 64);
    if (fits(estimate)) {
      lo = estimate;
      while (lo < max_n) {
        const size_t m = std::min(max_n, lo + step);
        if (!fits(m)) {
          hi = m;
          break;
        }
        lo = m;
        step *= 2;
      }
    } else {
      hi = estimate;
      while (hi - lo > step) {
        const size_t m = hi - step;
        if (fits(m)) {
          lo = m;
          break;
        }
        hi = m;
        step *= 2;
      }
    }
  }
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {lo, f(lo)};
}

std::vector<size_t> insertion_boundaries(const std::vector<size_t>& sentence_tokens,
                                         const std::vector<Insertion>& insertions) {
  std::vector<double> prefix(sentence_tokens.size() + 1, 0.0);
  for (size_t i = 0; i < sentence_tokens.size(); ++i) {
    prefix[i + 1] = prefix[i] + static_cast<double>(sentence_tokens[i]);
  }
  const double total = prefix.back();
  std::vector<size_t> out;
  out.reserve(insertions.size());
  for (const Insertion& ins : insertions) {
    const double target = std::clamp(ins.fraction, 0.0, 1.0) * total;
    const size_t k =
        static_cast<size_t>(std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin());
    size_t best = std::min(k, sentence_tokens.size());
    if (best > 0 && target - prefix[best - 1] <= prefix[best] - target) best = best - 1;
    out.push_back(best);
  }
  return out;
}

FittedContext fit_haystack(const Haystack& haystack, size_t start, const std::vector<Insertion>& insertions,
                           const PromptParts& parts, size_t budget, const TokenCounter& count_tokens,
                           const std::string& what) {
  check(!haystack.sentences.empty(), what + ": the haystack '" + haystack.name + "' has no sentences");
  std::vector<size_t> sentence_tokens;  // of sentences start, start + 1, ... (cyclic), grown on demand
  auto count_sentences = [&](size_t n) {
    while (sentence_tokens.size() < n) {
      sentence_tokens.push_back(count_tokens(haystack.sentence(start + sentence_tokens.size())));
    }
  };
  auto build = [&](size_t n, std::vector<size_t>* boundaries_out) {
    count_sentences(n);
    const std::vector<size_t> used(sentence_tokens.begin(),
                                   sentence_tokens.begin() + static_cast<ptrdiff_t>(n));
    const std::vector<size_t> boundaries = insertion_boundaries(used, insertions);
    // Insertions in boundary order, ties in the order given.
    std::vector<size_t> order(insertions.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return boundaries[a] < boundaries[b]; });
    std::string context;
    auto append = [&](const std::string& s) {
      if (!context.empty()) context.push_back(' ');
      context += s;
    };
    size_t next = 0;
    for (size_t k = 0; k <= n; ++k) {
      while (next < order.size() && boundaries[order[next]] == k) append(insertions[order[next++]].text);
      if (k < n) append(haystack.sentence(start + k));
    }
    if (boundaries_out) *boundaries_out = boundaries;
    return context;
  };
  auto tokens_of = [&](size_t n) {
    return count_tokens(
        assemble_prompt(parts.instruction, build(n, nullptr), parts.question, parts.answer_prefix));
  };
  const size_t fixed = tokens_of(0);
  check(fixed <= budget, what + ": the budget of " + std::to_string(budget) +
                             " tokens cannot hold the task's " +
                             "fixed text (instruction, question and needles take " + std::to_string(fixed) +
                             " tokens); use a longer length");
  // Every sentence holds at least one non-space byte, so a sane counter gives it a token; the cap only stops
  // a counter that never grows.
  // Estimate from the sentences' own token counts: usually within a sentence or two of the answer.
  size_t estimate = 0;
  for (size_t used = fixed; estimate < 16 * budget + 64; ++estimate) {
    count_sentences(estimate + 1);
    used += sentence_tokens[estimate];
    if (used > budget) break;
  }
  const FitResult fit = fit_largest(budget, 16 * budget + 64, tokens_of, std::max<size_t>(estimate, 1));
  FittedContext out;
  out.context = build(fit.n, &out.boundaries);
  out.tokens = fit.tokens;
  out.sentences = fit.n;
  return out;
}

}  // namespace tessera::eval
