// tessera/attention/pattern/policy.h — the attention policy: per layer, per query head, one pattern.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/pattern/pattern.h"

namespace tessera::attn {

class AttentionPolicy {
 public:
  AttentionPolicy() = default;
  // A table of num_layers * num_q_heads patterns, layer-major. num_q_heads must be a multiple of num_kv_heads.
  AttentionPolicy(int num_layers, int num_q_heads, int num_kv_heads, std::vector<Pattern> table);

  static AttentionPolicy uniform(int num_layers, int num_q_heads, int num_kv_heads, const Pattern& p);
  // TriangleMix: layers [0, start_layer) keep `inner`'s patterns (dense or dynamic), layers >= start_layer run
  // `triangle`. start_layer is 0-based here (the paper's 1-based "l > L_tri_start" is start_layer = L_tri_start).
  static AttentionPolicy trianglemix(const AttentionPolicy& inner, int start_layer, const TrianglePattern& triangle);

  int num_layers() const { return num_layers_; }
  int num_q_heads() const { return num_q_heads_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int group_size() const { return num_q_heads_ / num_kv_heads_; }
  int kv_head(int q_head) const { return q_head / group_size(); }  // GQA: query head -> its KV head

  const Pattern& at(int layer, int q_head) const;
  Pattern& at(int layer, int q_head);
  // The patterns of one layer, indexed by query head.
  std::vector<Pattern> layer(int layer) const;
  const std::vector<Pattern>& table() const { return table_; }

  bool operator==(const AttentionPolicy&) const = default;

 private:
  int num_layers_ = 0, num_q_heads_ = 0, num_kv_heads_ = 0;
  std::vector<Pattern> table_;
};

}  // namespace tessera::attn
