// Word-frequency tasks: common words extraction (RULER "cwe") and frequent words extraction (RULER "fwe").
// Their context is a word list rather than a haystack, sized by the number of distinct words.
#include <cmath>
#include <functional>
#include <unordered_set>

#include "core/error.h"
#include "eval/prompt_fit.h"
#include "eval/rng.h"
#include "eval/task_generators.h"
#include "eval/words.h"

namespace tessera::eval {

namespace {

// Whether a and b overlap as substrings, which would let substring scoring credit one for the other.
bool nested(const std::string& a, const std::string& b) {
  return a.find(b) != std::string::npos || b.find(a) != std::string::npos;
}

// An ordered pool of distinct words whose first `answers` words are the asked ones: no later word contains or
// is contained in one of them. Grows on demand, deterministically: first from `source` (already shuffled),
// then from `extra` draws.
class WordPool {
 public:
  WordPool(std::vector<std::string> source, std::function<std::string()> extra, size_t answers)
      : source_(std::move(source)), extra_(std::move(extra)), answers_(answers) {}

  const std::string& operator[](size_t i) {
    grow(i + 1);
    return words_[i];
  }

  void grow(size_t n) {
    size_t collisions = 0;
    while (words_.size() < n) {
      std::string w = next_source_ < source_.size() ? source_[next_source_++] : extra_();
      bool ok = seen_.insert(w).second;
      for (size_t a = 0; ok && a < std::min(answers_, words_.size()); ++a) ok = !nested(w, words_[a]);
      if (ok) {
        words_.push_back(std::move(w));
        collisions = 0;
      } else {
        check(++collisions < 100000, "word pool: cannot draw more distinct words");
      }
    }
  }

 private:
  std::vector<std::string> source_;
  std::function<std::string()> extra_;
  size_t answers_;
  size_t next_source_ = 0;
  std::vector<std::string> words_;
  std::unordered_set<std::string> seen_;
};

void set_prompt(TaskCase& c, const PromptParts& parts, std::string context, size_t tokens) {
  c.instruction = parts.instruction;
  c.context = std::move(context);
  c.question = parts.question;
  c.answer_prefix = parts.answer_prefix;
  c.prompt_tokens = tokens;
  c.metric = Metric::string_match_all;
}

// The word list that fills the budget: build(n) is the context for size n (it grows with n), and the result
// is the largest n that fits. When not even build(0) fits, the error says the budget cannot hold
// `fixed_part`, then `advice`.
FitResult fit_word_list(const GeneratorInput& in, const PromptParts& parts,
                        const std::function<std::string(size_t)>& build, const std::string& fixed_part,
                        const std::string& advice) {
  auto tokens_of = [&](size_t n) {
    return in.count_tokens(assemble_prompt(parts.instruction, build(n), parts.question, parts.answer_prefix));
  };
  const size_t fixed = tokens_of(0);
  check(fixed <= in.budget, in.what + ": the budget of " + std::to_string(in.budget) +
                                " tokens cannot hold " + fixed_part + " (" + std::to_string(fixed) +
                                " tokens)" + advice);
  return fit_largest(in.budget, in.budget, tokens_of);
}

// r^alpha, exactly for integral alpha (so counts are the same on every libm).
double rank_power(size_t r, double alpha) {
  if (alpha == std::floor(alpha) && alpha >= 0 && alpha <= 8) {
    double p = 1;
    for (int i = 0; i < static_cast<int>(alpha); ++i) p *= static_cast<double>(r);
    return p;
  }
  return std::pow(static_cast<double>(r), alpha);
}

// Occurrences of the words of rank 1, 2, ... for scale `scale`: floor(scale / r^alpha) while >= 1.
std::vector<size_t> zipf_counts(size_t scale, double alpha) {
  std::vector<size_t> counts;
  for (size_t r = 1;; ++r) {
    const auto c = static_cast<size_t>(std::floor(static_cast<double>(scale) / rank_power(r, alpha)));
    if (c == 0) break;
    counts.push_back(c);
  }
  return counts;
}

}  // namespace

void generate_common_words(TaskCase& c, const GeneratorInput& in) {
  const TaskOptions& o = in.options;
  Rng rng(in.case_seed);
  std::vector<std::string> vocabulary =
      in.haystack.vocabulary.empty() ? haystack_vocabulary(in.haystack) : in.haystack.vocabulary;
  rng.shuffle(vocabulary);
  Rng extra_rng(derive_seed(in.case_seed, "extra-words", 0));
  const auto common = static_cast<size_t>(o.cwe_words);
  WordPool pool(
      std::move(vocabulary), [&] { return pseudo_word(extra_rng, 3); }, common);

  PromptParts parts;
  parts.instruction =
      "Below is a numbered list of words. Some of them appear many more times than the others. "
      "Find the words that appear most often.";
  parts.question = "What are the " + std::to_string(common) + " most common words in the list above?";
  parts.answer_prefix = "The " + std::to_string(common) + " most common words in the list above are:";

  // The list with `rare` words besides the common ones, shuffled by a stream of its own.
  auto build = [&](size_t rare) {
    std::vector<size_t> entries;
    entries.reserve(common * static_cast<size_t>(o.cwe_common_count) +
                    rare * static_cast<size_t>(o.cwe_rare_count));
    for (size_t w = 0; w < common + rare; ++w) {
      const int times = w < common ? o.cwe_common_count : o.cwe_rare_count;
      for (int t = 0; t < times; ++t) entries.push_back(w);
    }
    Rng order(derive_seed(in.case_seed, "order", rare));
    order.shuffle(entries);
    std::string list;
    for (size_t i = 0; i < entries.size(); ++i) {
      list += std::to_string(i + 1) + ". " + pool[entries[i]];
      if (i + 1 < entries.size()) list.push_back('\n');
    }
    return list;
  };
  const FitResult fit =
      fit_word_list(in, parts, build,
                    "the " + std::to_string(common) + " common words x " + std::to_string(o.cwe_common_count),
                    "; use a longer length or a smaller cwe_common_count");
  set_prompt(c, parts, build(fit.n), fit.tokens);
  c.haystack = in.haystack.name;
  c.answers.clear();
  for (size_t w = 0; w < common; ++w) c.answers.push_back(pool[w]);
}

void generate_frequent_words(TaskCase& c, const GeneratorInput& in) {
  const TaskOptions& o = in.options;
  Rng rng(in.case_seed);
  const auto asked = static_cast<size_t>(o.fwe_words);
  WordPool pool(
      {}, [&] { return coded_word(rng, 3, 8); }, asked);

  PromptParts parts;
  parts.instruction =
      "Read the following coded text and keep track of how often each coded word appears. Find the " +
      std::to_string(asked) + " most frequent coded words.";
  parts.question = "What are the " + std::to_string(asked) +
                   " most frequently appearing coded words in the coded text above?";
  parts.answer_prefix =
      "The " + std::to_string(asked) + " most frequently appearing coded words in the coded text above are:";

  auto build = [&](size_t scale) {
    const std::vector<size_t> counts = zipf_counts(scale, o.fwe_alpha);
    std::vector<size_t> words;
    for (size_t r = 0; r < counts.size(); ++r) words.insert(words.end(), counts[r], r);
    Rng order(derive_seed(in.case_seed, "order", scale));
    order.shuffle(words);
    std::string text;
    for (size_t i = 0; i < words.size(); ++i) {
      if (i > 0) text.push_back(' ');
      text += pool[words[i]];
    }
    return text;
  };
  const FitResult fit = fit_word_list(in, parts, build, "the instructions", "");
  const std::vector<size_t> counts = zipf_counts(fit.n, o.fwe_alpha);
  check(counts.size() > asked && counts[asked - 1] > counts[asked],
        in.what + ": too short to rank " + std::to_string(asked) +
            " words apart (the most frequent words would tie); use a longer length");
  set_prompt(c, parts, build(fit.n), fit.tokens);
  c.answers.clear();
  for (size_t w = 0; w < asked; ++w) c.answers.push_back(pool[w]);
}

}  // namespace tessera::eval
