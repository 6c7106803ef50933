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
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>

namespace tessera::runtime {

struct SamplingOptions {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: no top-k cut
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// The names of the options in the caller's interface, for error messages (the CLI's flags, the server's fields).
struct SamplingOptionNames {
  const char* temperature = "temperature";
  const char* top_k = "top_k";
  const char* top_p = "top_p";
};
// Throws tessera::Error unless temperature is finite and >= 0, top_k >= 0 and top_p in (0, 1], e.g.
//   "top_p must be in (0, 1] (1 = off), got 1.5".
void check_sampling_options(const SamplingOptions& options, const SamplingOptionNames& names = {});

// Index of the largest value; ties go to the smaller index. Throws tessera::Error for empty logits.
int32_t argmax(std::span<const float> logits);

// The rule above for temperature > 0 with the uniform draw u in [0, 1) given: the kept set by partial sorts of
// growing prefixes (no full sort of the vocabulary), then the walk in id order. Throws for empty logits.
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double u);

class Sampler {
 public:
  // Checks the options (check_sampling_options).
  explicit Sampler(const SamplingOptions& options = {});
  // argmax when greedy (no draw taken from the stream), else sample_token(logits, options, next_uniform()).
  int32_t sample(std::span<const float> logits);
  const SamplingOptions& options() const { return options_; }
  bool greedy() const { return options_.temperature <= 0.0f; }
  // The next uniform draw of the stream, for a caller that applies sample_token elsewhere (the GPU).
  double next_uniform() { return uniform(); }

 private:
  double uniform();  // [0, 1)

  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace tessera::runtime
