#include "runtime/input_checks.h"

#include <string>

#include "core/error.h"

namespace tessera::runtime {

void check_token_ids(std::span<const int32_t> tokens, const ModelConfig& cfg) {
  const int32_t vocab = cfg.vocab_size;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw Error("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                  " is outside the vocabulary of " + std::to_string(vocab) + " tokens (model " + cfg.name + ")");
  }
}

void check_prompt_fits(size_t count, int32_t position, int32_t max_context, const ModelConfig& cfg) {
  const int64_t end = static_cast<int64_t>(position) + static_cast<int64_t>(count);
  if (end <= max_context) return;
  std::string what = "prompt of " + std::to_string(count) + " tokens";
  if (position > 0) what += " after " + std::to_string(position) + " tokens already in the context";
  throw Error(what + " exceeds the context limit of " + std::to_string(max_context) + " tokens (model " + cfg.name +
              "); pass a larger max context (--max-context) or shorten the prompt");
}

namespace {
std::string shape_of(int layers, int q_heads, int kv_heads) {
  return std::to_string(layers) + " layers x " + std::to_string(q_heads) + " query heads (" +
         std::to_string(kv_heads) + " kv heads)";
}
}  // namespace

void check_policy_fits(const attn::AttentionPolicy& p, const ModelConfig& cfg) {
  if (!p.table().empty() && (p.num_layers() != cfg.num_layers || p.num_q_heads() != cfg.num_q_heads ||
                             p.num_kv_heads() != cfg.num_kv_heads)) {
    throw Error("attention policy has " + shape_of(p.num_layers(), p.num_q_heads(), p.num_kv_heads()) + "; model " +
                cfg.name + " has " + shape_of(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads));
  }
}

void check_decode_fits(int32_t position, int32_t max_context, const ModelConfig& cfg) {
  if (position + 1 > max_context)
    throw Error("decoding past the context limit of " + std::to_string(max_context) + " tokens (model " + cfg.name +
                "); pass a larger max context (--max-context) or generate fewer tokens");
}

}  // namespace tessera::runtime
