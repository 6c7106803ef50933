#include "attention/pattern/policy.h"

#include "core/error.h"

namespace tessera::attn {

AttentionPolicy::AttentionPolicy(int num_layers, int num_q_heads, int num_kv_heads, std::vector<Pattern> table)
    : num_layers_(num_layers), num_q_heads_(num_q_heads), num_kv_heads_(num_kv_heads), table_(std::move(table)) {
  check(num_layers >= 0 && num_q_heads > 0 && num_kv_heads > 0,
        "attention policy: layer and head counts must be positive, got layers=" + std::to_string(num_layers) +
            " q_heads=" + std::to_string(num_q_heads) + " kv_heads=" + std::to_string(num_kv_heads));
  check(num_q_heads % num_kv_heads == 0, "attention policy: " + std::to_string(num_q_heads) +
                                             " query heads are not a multiple of " + std::to_string(num_kv_heads) +
                                             " KV heads");
  check(table_.size() == static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads),
        "attention policy: table has " + std::to_string(table_.size()) + " patterns, expected layers*q_heads = " +
            std::to_string(num_layers * num_q_heads));
  for (int l = 0; l < num_layers; ++l)
    for (int h = 0; h < num_q_heads; ++h)
      validate(at(l, h), "layer " + std::to_string(l) + ", head " + std::to_string(h));
}

AttentionPolicy AttentionPolicy::uniform(int num_layers, int num_q_heads, int num_kv_heads, const Pattern& p) {
  return AttentionPolicy(num_layers, num_q_heads, num_kv_heads,
                         std::vector<Pattern>(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads), p));
}

AttentionPolicy AttentionPolicy::trianglemix(const AttentionPolicy& inner, int start_layer,
                                             const TrianglePattern& triangle) {
  check(start_layer >= 0 && start_layer <= inner.num_layers(),
        "trianglemix: start_layer must be in [0, " + std::to_string(inner.num_layers()) + "], got " +
            std::to_string(start_layer));
  std::vector<Pattern> table = inner.table();
  for (int l = start_layer; l < inner.num_layers(); ++l)
    for (int h = 0; h < inner.num_q_heads(); ++h)
      table[static_cast<size_t>(l) * static_cast<size_t>(inner.num_q_heads()) + static_cast<size_t>(h)] = triangle;
  return AttentionPolicy(inner.num_layers(), inner.num_q_heads(), inner.num_kv_heads(), std::move(table));
}

const Pattern& AttentionPolicy::at(int layer, int q_head) const {
  check(layer >= 0 && layer < num_layers_ && q_head >= 0 && q_head < num_q_heads_,
        "attention policy: (layer " + std::to_string(layer) + ", head " + std::to_string(q_head) +
            ") out of range for " + std::to_string(num_layers_) + " layers x " + std::to_string(num_q_heads_) +
            " heads");
  return table_[static_cast<size_t>(layer) * static_cast<size_t>(num_q_heads_) + static_cast<size_t>(q_head)];
}

Pattern& AttentionPolicy::at(int layer, int q_head) {
  return const_cast<Pattern&>(static_cast<const AttentionPolicy&>(*this).at(layer, q_head));
}

std::vector<Pattern> AttentionPolicy::layer(int layer) const {
  std::vector<Pattern> out;
  out.reserve(static_cast<size_t>(num_q_heads_));
  for (int h = 0; h < num_q_heads_; ++h) out.push_back(at(layer, h));
  return out;
}

}  // namespace tessera::attn
