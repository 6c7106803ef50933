// tessera/runtime/sampling.h — choosing the next token from logits, reproducibly.
//
// temperature <= 0 is greedy (argmax; ties go to the smaller id). Otherwise, in this order: logits /
// temperature; keep the top_k largest (top_k <= 0: all); softmax; keep the smallest set of most probable
// tokens whose probability reaches top_p (top_p >= 1: all; at least one token always stays); renormalise and
// draw. "Largest" and "most probable" follow the order of logits, ties to the smaller id; the draw walks the kept
// tokens in id order (sample_token below: the same distribution as a walk in probability order, and what a GPU
// computes without sorting the vocabulary: the batched GPU backend draws with the same rule). So the draw is a
// function of (logits, options, seed, draws so far) alone: the random stream is std::mt19937_64(seed), one
// uniform double per sampled token turned from it by hand (53 bits), not by a standard-library distribution whose
// algorithm differs between implementations. Probabilities and sums are doubles.
//
// Penalties, logit_bias and min_p (issue 34) follow Hugging Face transformers' logits processors, in the order
// its generate() applies them (generation/utils.py _get_logits_processor), on the model's raw logits:
//   1. logit_bias: logits[id] += bias                                (SequenceBiasLogitsProcessor, one-token keys)
//   2. repetition_penalty r over every token of the prompt and of the generated text, once per distinct token:
//      x < 0 ? x * r : x / r                                         (RepetitionPenaltyLogitsProcessor)
//   3. frequency_penalty f and presence_penalty p over the generated tokens only (OpenAI's definition, as vLLM;
//      transformers has no such processor): x - count * f - p for a token generated count > 0 times
//   --- greedy (temperature 0) takes the argmax here; sampling goes on with the warpers:
//   4. temperature, 5. top_k, 6. top_p                               (TemperatureLogitsWarper, TopK..., TopP...)
//   7. min_p m: drop the tokens whose probability (after temperature, among those kept) is below m times the
//      largest one's                                                 (MinPLogitsWarper)
// The edits of steps 1-3 are runtime/logit_edit.h's edit_logit, shared with the GPU. tests/data/sampling/ holds
// transformers' outputs for these (scripts/make_sampling_fixtures.py), tests/runtime_sampling_test.cpp checks them.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/logit_edit.h"

namespace tessera::runtime {

class Grammar;  // runtime/grammar.h
class GrammarMatcher;

struct SamplingOptions {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: no top-k cut
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
  float min_p = 0.0f;               // 0: off; in [0, 1]
  float repetition_penalty = 1.0f;  // 1: off; > 0
  float presence_penalty = 0.0f;    // 0: off
  float frequency_penalty = 0.0f;   // 0: off
  std::vector<std::pair<int32_t, float>> logit_bias{};  // (token id, added to its logit); ids must be in the vocabulary
  // Structured output (runtime/grammar.h): each Sampler follows the grammar with its own matcher; the tokens it
  // forbids get -inf after steps 1-3 (so greedy and every warper see only allowed tokens). null: none.
  std::shared_ptr<const Grammar> grammar{};

  // Whether steps 1-3 change anything (then the sampler keeps the token history).
  bool edits_logits() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f || !logit_bias.empty();
  }
};

// The names of the options in the caller's interface, for error messages (the CLI's flags, the server's fields).
struct SamplingOptionNames {
  const char* temperature = "temperature";
  const char* top_k = "top_k";
  const char* top_p = "top_p";
  const char* min_p = "min_p";
  const char* repetition_penalty = "repetition_penalty";
  const char* presence_penalty = "presence_penalty";
  const char* frequency_penalty = "frequency_penalty";
  const char* logit_bias = "logit_bias";
};
// Throws tessera::Error unless temperature is finite and >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1],
// repetition_penalty finite and > 0, presence / frequency penalties and biases finite, bias ids >= 0, e.g.
//   "top_p must be in (0, 1] (1 = off), got 1.5".
void check_sampling_options(const SamplingOptions& options, const SamplingOptionNames& names = {});

// Index of the largest value; ties go to the smaller index. Throws tessera::Error for empty logits.
int32_t argmax(std::span<const float> logits);

// The rule above for temperature > 0 with the uniform draw u in [0, 1) given: the kept set by partial sorts of
// growing prefixes (no full sort of the vocabulary), then the walk in id order. Throws for empty logits. Steps 4-7
// only: `logits` are already edited (Sampler::edit).
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double u);

// The distribution sample_token draws from (steps 4-7): probability by token id, 0 for the tokens cut, summing to 1.
std::vector<double> token_probabilities(std::span<const float> logits, const SamplingOptions& options);

// Log-probabilities of a chosen token, as the OpenAI API returns them: the log-softmax of the model's raw logits
// (before penalties, bias and temperature, as vLLM's default), the token's own and the `top` most likely tokens'
// (ties to the smaller id), in f64 rounded to f32.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // most likely first
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t top);
// log sum_i exp(x_i), in f64 from the largest element (x non-empty): log p(i) = x_i - log_sum_exp(x).
double log_sum_exp(std::span<const float> x);
// out[r] = logits[r, next[r]] - log_sum_exp(logits[r, :]) for r < next.size() (logits [rows, vocab], rows >=
// next.size()): the log-probability of the token after each row (perplexity, BatchBackend::prefill_chunk_logprobs);
// rows in parallel on the global pool, each row's sum in f64 in vocabulary order.
std::vector<double> next_token_logprobs(std::span<const float> logits, int64_t vocab, std::span<const int32_t> next);

class Sampler {
 public:
  // Checks the options (check_sampling_options).
  explicit Sampler(const SamplingOptions& options = {});
  // The penalties' history: the prompt (the repetition penalty counts it). Call before the first sample().
  void set_prompt(std::span<const int32_t> prompt);
  // argmax when greedy (no draw taken from the stream), else sample_token(logits, options, next_uniform()); on
  // the edited logits (steps 1-3) when options().edits_logits(). The token joins the history (accept).
  int32_t sample(std::span<const float> logits);
  // A generated token chosen elsewhere (the batched engine's backends) joins the history (and the grammar's: a
  // token the grammar forbids throws GrammarError).
  void accept(int32_t token);
  // Steps 1-3 for the history so far, one edit per token that any of them changes (sorted by token; empty when
  // options().edits_logits() is false and there is no grammar). With a grammar, every token it forbids now gets
  // bias -inf. Throws tessera::Error for a logit_bias id >= vocab.
  std::vector<LogitEdit> edits(int32_t vocab) const;
  // Applies edits(logits.size()) to logits in place.
  void edit(std::span<float> logits) const;
  const SamplingOptions& options() const { return options_; }
  bool greedy() const { return options_.temperature <= 0.0f; }
  // The next uniform draw of the stream, for a caller that applies sample_token elsewhere (the GPU).
  double next_uniform() { return uniform(); }

 private:
  double uniform();  // [0, 1)
  std::vector<LogitEdit> penalty_edits(int32_t vocab) const;  // steps 1-3 alone

  SamplingOptions options_;
  std::mt19937_64 rng_;
  std::vector<int32_t> prompt_;                    // sorted, distinct (only when options_.edits_logits())
  std::vector<std::pair<int32_t, int32_t>> counts_;  // generated token -> count, sorted by token
  std::shared_ptr<GrammarMatcher> grammar_;          // options_.grammar's matcher (null: none)
};

}  // namespace tessera::runtime
