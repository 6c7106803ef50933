// tessera/runtime/generation.h — the sampling loop shared by the CPU engine and the GPU engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "runtime/sampling.h"

namespace tessera::runtime {

struct GenerateOptions {
  int32_t max_new_tokens = 128;
  SamplingOptions sampling;
  std::vector<int32_t> stop_tokens;  // generation ends when one is sampled (it is not returned or reported)
  // >= 0: on_logprobs gets, before on_token, each returned token's log-probability and its `logprobs` most likely
  // alternatives (token_logprobs in sampling.h: the raw logits' log-softmax).
  int32_t logprobs = -1;
  std::function<void(const TokenLogprobs&)> on_logprobs;
};

// prefill(prompt), then sample / decode until max_new_tokens, a stop token, on_token returning false, or a full
// context. The last returned token goes into the cache through `append_last` (a decode without the LM head), so
// every returned token is in the cache afterwards and the stop token is not. EngineT provides prefill(tokens),
// decode(token), position() and max_context().
template <class EngineT>
std::vector<int32_t> generate_tokens(EngineT& engine, std::span<const int32_t> prompt, const GenerateOptions& options,
                                     const std::function<bool(int32_t)>& on_token,
                                     const std::function<void(int32_t)>& append_last) {
  std::vector<int32_t> out;
  if (options.max_new_tokens <= 0) {
    engine.prefill(prompt);
    return out;
  }
  Sampler sampler(options.sampling);
  sampler.set_prompt(prompt);
  std::vector<float> logits = engine.prefill(prompt);
  for (;;) {
    const int32_t tok = sampler.sample(logits);
    if (std::find(options.stop_tokens.begin(), options.stop_tokens.end(), tok) != options.stop_tokens.end())
      break;
    if (engine.position() >= engine.max_context()) break;  // the context is full: stop rather than fail
    if (options.logprobs >= 0 && options.on_logprobs) options.on_logprobs(token_logprobs(logits, tok, options.logprobs));
    out.push_back(tok);
    const bool more =
        (!on_token || on_token(tok)) && static_cast<int32_t>(out.size()) < options.max_new_tokens;
    if (!more) {
      append_last(tok);
      break;
    }
    logits = engine.decode(tok);
  }
  return out;
}

}  // namespace tessera::runtime
