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

// An f32 copy of w (the shards of a type whose blocks a column split would cut).
Weight as_f32(const Weight& w) { return Weight::f32(w.to_f32(), w.rows, w.cols, w.name); }

// Blocks of `size` rows (by_rows) or of `size` columns of w, in the order of `blocks`, in w's stored type: rows
// are whole blocks, and a column split keeps the type when `size` is a whole number of blocks (else the shard is
// f32). Either way the output is written front to back: per output row (one run for row blocks), one copy per
// block.
Weight gather(const Weight& w, const std::vector<int32_t>& blocks, int64_t size, bool by_rows) {
  Weight out;
  if (w.empty()) return out;
  if (!by_rows && size % static_cast<int64_t>(model::tensor_type_block_size(w.type)) != 0)
    return gather(as_f32(w), blocks, size, by_rows);
  const auto n = static_cast<int64_t>(blocks.size());
  out.rows = by_rows ? n * size : w.rows;
  out.cols = by_rows ? w.cols : n * size;
  out.type = w.type;
  out.act = w.act;  // the same activation rounding as the unsharded weight
  auto held = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(out.rows) * out.row_bytes());
  uint8_t* dst = held->data();
  const size_t run = by_rows ? static_cast<size_t>(size) * w.row_bytes() : model::tensor_type_bytes(w.type, size);
  const int64_t runs = by_rows ? 1 : w.rows;
  for (int64_t r = 0; r < runs; ++r)
    for (const int32_t b : blocks) {
      const uint8_t* src = w.bytes + (by_rows ? static_cast<size_t>(b) * run : r * w.row_bytes() + b * run);
      dst = std::copy(src, src + run, dst);
    }
  out.bytes = held->data();
  out.owner = std::move(held);
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

// Rows [r0, r1) (a view sharing w's bytes) or columns [c0, c1) (a copy) of w.
Weight row_range(const Weight& w, int64_t r0, int64_t r1) {
  Weight out;
  out.rows = r1 - r0;
  out.cols = w.cols;
  out.type = w.type;
  out.act = w.act;  // the same activation rounding as the unsharded weight
  if (r1 > r0 && !w.empty()) {
    out.bytes = w.bytes + static_cast<size_t>(r0) * w.row_bytes();
    out.owner = w.owner;
  }
  return out;
}

Weight col_range(const Weight& w, int64_t c0, int64_t c1) {
  const auto bs = static_cast<int64_t>(model::tensor_type_block_size(w.type));
  if (c0 % bs != 0 || c1 % bs != 0) return col_range(as_f32(w), c0, c1);
  Weight out;
  out.rows = w.rows;
  out.cols = c1 - c0;
  out.type = w.type;
  out.act = w.act;  // the same activation rounding as the unsharded weight
  if (c1 <= c0 || w.empty()) return out;
  auto held = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(out.rows) * out.row_bytes());
  const size_t off = model::tensor_type_bytes(w.type, c0), len = out.row_bytes();
  for (int64_t r = 0; r < w.rows; ++r)
    std::copy(w.bytes + r * w.row_bytes() + off, w.bytes + r * w.row_bytes() + off + len, held->data() + r * len);
  out.bytes = held->data();
  out.owner = std::move(held);
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
