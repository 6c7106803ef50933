#include "parallel/shard.h"

#include <algorithm>

#include "core/error.h"

namespace tessera::parallel {

using runtime::LayerWeights;
using runtime::ModelConfig;
using runtime::Weight;

RankPlan rank_plan(const ModelConfig& config, const Placement& placement, int32_t rank) {
  validate(placement, config.num_layers, config.num_q_heads, config.num_kv_heads, "placement");
  check(rank >= 0 && rank < placement.num_gpus,
        "rank " + std::to_string(rank) + " outside [0, " + std::to_string(placement.num_gpus) + ")");
  RankPlan p;
  p.rank = rank;
  p.world = placement.num_gpus;
  const int64_t F = config.intermediate_size;
  p.ffn_begin = F * rank / p.world;
  p.ffn_end = F * (rank + 1) / p.world;
  const int32_t group = config.num_q_heads / config.num_kv_heads;
  for (int32_t l = 0; l < config.num_layers; ++l) {
    RankLayer r;
    r.heads = placement.heads_of(l, rank);
    for (size_t i = 0; i < r.heads.size(); ++i) {
      const int32_t g = r.heads[i] / group;
      if (r.groups.empty() || r.groups.back() != g) {
        r.groups.push_back(g);
        r.group_heads.emplace_back(static_cast<int32_t>(i), static_cast<int32_t>(i));
      }
      r.group_heads.back().second = static_cast<int32_t>(i) + 1;
    }
    p.layers.push_back(std::move(r));
  }
  return p;
}

namespace {

// Blocks of `size` rows (by_rows) or of `size` columns of w, in the order of `blocks`. Either way the output is
// written front to back: per output row (one run for row blocks), one copy per block.
Weight gather(const Weight& w, const std::vector<int32_t>& blocks, int64_t size, bool by_rows) {
  Weight out;
  if (w.empty()) return out;
  const auto n = static_cast<int64_t>(blocks.size());
  out.rows = by_rows ? n * size : w.rows;
  out.cols = by_rows ? w.cols : n * size;
  out.data.resize(static_cast<size_t>(out.rows * out.cols));
  float* dst = out.data.data();
  const int64_t runs = by_rows ? 1 : w.rows, len = by_rows ? size * w.cols : size;
  for (int64_t r = 0; r < runs; ++r)
    for (const int32_t b : blocks) {
      const float* src = w.ptr() + (by_rows ? b * size * w.cols : r * w.cols + b * size);
      dst = std::copy(src, src + len, dst);
    }
  return out;
}

}  // namespace

Weight gather_rows(const Weight& w, const std::vector<int32_t>& blocks, int64_t block_rows) {
  return gather(w, blocks, block_rows, true);
}

Weight gather_cols(const Weight& w, const std::vector<int32_t>& blocks, int64_t block_cols) {
  return gather(w, blocks, block_cols, false);
}

namespace {

Weight row_range(const Weight& w, int64_t r0, int64_t r1) {
  Weight out;
  out.cols = w.cols;
  out.rows = r1 - r0;
  out.data.assign(w.ptr() + r0 * w.cols, w.ptr() + r1 * w.cols);
  return out;
}

Weight col_range(const Weight& w, int64_t c0, int64_t c1) {
  Weight out;
  out.rows = w.rows;
  out.cols = c1 - c0;
  out.data.resize(static_cast<size_t>(out.rows * out.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    std::copy(w.ptr() + r * w.cols + c0, w.ptr() + r * w.cols + c1, out.data.data() + r * out.cols);
  return out;
}

}  // namespace

LayerWeights shard_layer(const LayerWeights& full, const ModelConfig& config, const RankLayer& layer,
                         int64_t ffn_begin, int64_t ffn_end) {
  const int64_t d = config.head_dim;
  LayerWeights s;
  s.attn_norm = full.attn_norm;
  s.wq = gather_rows(full.wq, layer.heads, d);
  s.wk = gather_rows(full.wk, layer.groups, d);
  s.wv = gather_rows(full.wv, layer.groups, d);
  s.wo = gather_cols(full.wo, layer.heads, d);
  // Biases are vectors [1, n]: gather along columns.
  s.bq = gather_cols(full.bq, layer.heads, d);
  s.bk = gather_cols(full.bk, layer.groups, d);
  s.bv = gather_cols(full.bv, layer.groups, d);
  s.q_norm = full.q_norm;
  s.k_norm = full.k_norm;
  s.post_attn_norm = full.post_attn_norm;
  s.ffn_norm = full.ffn_norm;
  s.post_ffn_norm = full.post_ffn_norm;
  s.w_gate = row_range(full.w_gate, ffn_begin, ffn_end);
  s.w_up = row_range(full.w_up, ffn_begin, ffn_end);
  s.w_down = col_range(full.w_down, ffn_begin, ffn_end);
  return s;
}

}  // namespace tessera::parallel
