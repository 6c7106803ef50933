// tessera/eval/attention_stats.h — what a sparse policy loses, layer by layer and head by head, on a model's
// real activations.
//
// The engine runs a prompt densely and hands every layer's attention arguments to an observer
// (runtime::AttentionObserver). For each layer, measure_layer builds the index a policy would use on exactly
// those queries and keys (estimation included, as the engine would do it) and reports per query head:
//   recall     share of the dense softmax mass the policy's mask keeps (attn::attention_recall), mean over rows
//   rel_error  ||sparse out - dense out|| / ||dense out|| for the head (attn::output_error)
//   density    kept cells / cells dense attention computes (causal, within the layer's own sliding window)
// Measuring on the dense trajectory isolates each layer's loss: errors do not compound across layers, which
// is what an offline planner (MInference's search, MoA's profile) optimises.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/pattern/pattern.h"
#include "core/thread_pool.h"

namespace tessera::eval {

struct HeadAttentionStats {
  double recall = 1;
  double rel_error = 0;
  double density = 1;
  bool operator==(const HeadAttentionStats&) const = default;
};

struct LayerAttentionStats {
  int32_t layer = 0;
  int64_t rows = 0;  // query rows measured
  std::vector<HeadAttentionStats> heads;

  HeadAttentionStats mean() const;  // unweighted mean over heads
};

// `args` are the dense executor's arguments of one layer (out holds the dense output); `patterns` one per
// query head. total_len: the whole prompt's length (for MoA spans and Triangle's last rows); tile: the query
// tile the engine lowers with. Throws tessera::Error when patterns.size() != args.num_q_heads().
LayerAttentionStats measure_layer(int32_t layer, const std::vector<attn::Pattern>& patterns,
                                  const attn::AttentionArgs& args, int32_t total_len, int32_t tile,
                                  ThreadPool& pool = ThreadPool::global());

// Per-layer means and the overall mean (over layers, unweighted) as a markdown table:
// | layer | recall | rel. error | density |.
std::string layer_stats_markdown(const std::vector<LayerAttentionStats>& layers);

// {"layer": l, "rows": n, "heads": [{"recall": .., "rel_error": .., "density": ..}, ...]} per layer.
nlohmann::json layer_stats_to_json(const std::vector<LayerAttentionStats>& layers);

}  // namespace tessera::eval
