// tessera/runtime/input_checks.h — the checks of a prefill's or a decode's input, shared by the CPU engine
// (runtime/engine.h) and the GPU engine (runtime/cuda/gpu_engine.h), so that both refuse the same inputs with
// the same messages. Each throws tessera::Error.
#pragma once

#include <cstdint>
#include <span>

#include "attention/pattern/policy.h"
#include "model/model_config.h"

namespace tessera::runtime {

// Every id within [0, vocab_size):
//   "token id 70000 at index 3 is outside the vocabulary of 49152 tokens (model smollm2)".
void check_token_ids(std::span<const int32_t> tokens, const ModelConfig& cfg);

// `count` more tokens after `position` within `max_context`:
//   "prompt of 9000 tokens exceeds the context limit of 8192 tokens (model smollm2); pass a larger max context
//   (--max-context) or shorten the prompt" (with " after N tokens already in the context" when position > 0).
void check_prompt_fits(size_t count, int32_t position, int32_t max_context, const ModelConfig& cfg);

// An attention policy with the model's layer, query-head and kv-head counts (an empty one fits any model):
//   "attention policy has 30 layers x 9 query heads (3 kv heads); model smollm2 has 24 layers x 9 query heads
//   (3 kv heads)".
void check_policy_fits(const attn::AttentionPolicy& policy, const ModelConfig& cfg);

// One more token after `position` within `max_context`.
void check_decode_fits(int32_t position, int32_t max_context, const ModelConfig& cfg);

}  // namespace tessera::runtime
