// tessera/eval/prompt_fit.h — filling a token budget by measuring, and hiding sentences in a haystack.
//
// Tokenizers are not additive (merges across a join, a leading space), so the generators never trust an
// estimate: they search for the largest filler size whose complete prompt, counted by the real tokenizer,
// fits.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "eval/haystack.h"
#include "eval/task.h"

namespace tessera::eval {

struct FitResult {
  size_t n = 0;       // the largest size that fits
  size_t tokens = 0;  // tokens_of(n)
};

// The largest n in [0, max_n] with tokens_of(n) <= budget, for a tokens_of that grows weakly with n. The
// caller has checked tokens_of(0) <= budget (so that its message can say what did not fit). `estimate` is a
// guess of the answer (0: none; a probe at a small n then gives tokens per unit); it is refined by galloping,
// then bisection, so tokens_of is called O(log(error of the estimate)) times. Every n returned was measured,
// so the result never exceeds the budget even if tokens_of is not perfectly monotone.
FitResult fit_largest(size_t budget, size_t max_n, const std::function<size_t(size_t)>& tokens_of,
                      size_t estimate = 0);

// A sentence to hide, and where: `fraction` in [0, 1] of the haystack's tokens come before it.
struct Insertion {
  std::string text;
  double fraction = 0;
};

// The fixed parts of a haystack task's prompt.
struct PromptParts {
  std::string instruction;
  std::string question;
  std::string answer_prefix;
};

struct FittedContext {
  std::string context;
  size_t tokens = 0;               // count_tokens of the full prompt
  size_t sentences = 0;            // haystack sentences used
  std::vector<size_t> boundaries;  // per insertion: the haystack sentences before it
};

// Places each insertion at the sentence boundary k in [0, n] whose haystack token prefix (the sum of the
// sentences' own token counts) is closest to fraction * total (the earlier boundary on a tie).
std::vector<size_t> insertion_boundaries(const std::vector<size_t>& sentence_tokens,
                                         const std::vector<Insertion>& insertions);

// The context of the largest number of haystack sentences, read cyclically from `start`, that fits the budget
// with the insertions placed by insertion_boundaries (at one boundary, in the order given) and the prompt
// parts around it. Sentences and insertions are joined with one space. Throws tessera::Error starting with
// `what` when even no haystack at all fits.
FittedContext fit_haystack(const Haystack& haystack, size_t start, const std::vector<Insertion>& insertions,
                           const PromptParts& parts, size_t budget, const TokenCounter& count_tokens,
                           const std::string& what);

}  // namespace tessera::eval
