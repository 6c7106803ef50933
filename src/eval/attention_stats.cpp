#include "eval/attention_stats.h"

#include <algorithm>
#include <cstdio>
#include <variant>

#include "attention/cpu/metrics.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "core/error.h"

namespace tessera::eval {

HeadAttentionStats LayerAttentionStats::mean() const {
  HeadAttentionStats m{0, 0, 0};
  if (heads.empty()) return HeadAttentionStats{};
  for (const HeadAttentionStats& h : heads) {
    m.recall += h.recall;
    m.rel_error += h.rel_error;
    m.density += h.density;
  }
  const auto n = static_cast<double>(heads.size());
  return {m.recall / n, m.rel_error / n, m.density / n};
}

namespace {

bool is_dense(const attn::Pattern& p) { return std::holds_alternative<attn::DensePattern>(p); }

// Cells dense attention computes for one row at absolute position p: causal, within the window.
int64_t row_cells(int64_t p, int32_t window) { return window > 0 ? std::min<int64_t>(p + 1, window) : p + 1; }

}  // namespace

LayerAttentionStats measure_layer(int32_t layer, const std::vector<attn::Pattern>& patterns,
                                  const attn::AttentionArgs& args, int32_t total_len, int32_t tile,
                                  ThreadPool& pool) {
  attn::validate(args);
  const int64_t nq = args.num_q_heads(), q_len = args.q_len();
  check(static_cast<int64_t>(patterns.size()) == nq,
        "attention stats: " + std::to_string(patterns.size()) + " patterns for a layer of " + std::to_string(nq) +
            " query heads");
  LayerAttentionStats out;
  out.layer = layer;
  out.rows = q_len;
  out.heads.assign(static_cast<size_t>(nq), HeadAttentionStats{});
  if (std::all_of(patterns.begin(), patterns.end(), is_dense)) return out;  // dense keeps everything

  const auto kv_len = static_cast<int32_t>(args.kv_len());
  const attn::LoweringContext ctx{args.q_begin, static_cast<int32_t>(q_len), kv_len, std::max(total_len, kv_len),
                                  tile};
  const std::vector<attn::HeadEstimate> estimates =
      attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool);
  const attn::SparseIndex index = attn::lower_layer(patterns, estimates, ctx);

  const attn::RecallResult recall = attn::attention_recall(args, index, pool);

  std::vector<float> sparse(static_cast<size_t>(q_len * nq * args.head_dim()));
  attn::AttentionArgs sargs = args;
  sargs.out = TensorView(sparse.data(), DType::F32, {q_len, nq, args.head_dim()});
  sargs.lse = TensorView{};
  attn::sparse_attention_cpu(sargs, index, pool);
  const attn::OutputError err = attn::output_error(sargs.out, args.out);

  // Density against what dense computes: per row, the causal (and windowed) cells, and those of them the
  // index keeps. Without a window the index's own accounting is exact; with one, count the window's cells.
  std::vector<attn::IndexStats> per_head;
  if (args.window == 0) per_head = attn::index_stats_per_head(index);
  for (int64_t h = 0; h < nq; ++h) {
    HeadAttentionStats& s = out.heads[static_cast<size_t>(h)];
    s.recall = recall.per_head[static_cast<size_t>(h)];
    s.rel_error = err.per_head_rel[static_cast<size_t>(h)];
    if (args.window == 0) {
      s.density = per_head[static_cast<size_t>(h)].density();
      continue;
    }
    int64_t kept = 0, all = 0;
    for (int64_t r = 0; r < q_len; ++r) {
      const int64_t p = args.q_begin + r;
      all += row_cells(p, args.window);
      for (int64_t key = p - row_cells(p, args.window) + 1; key <= p; ++key)
        kept += index.visible(static_cast<int32_t>(h), static_cast<int32_t>(r), static_cast<int32_t>(key)) ? 1 : 0;
    }
    s.density = all > 0 ? static_cast<double>(kept) / static_cast<double>(all) : 1.0;
  }
  return out;
}

std::string layer_stats_markdown(const std::vector<LayerAttentionStats>& layers) {
  std::string md = "| layer | recall | rel. error | density |\n|---:|---:|---:|---:|\n";
  HeadAttentionStats total{0, 0, 0};
  char line[160];
  for (const LayerAttentionStats& l : layers) {
    const HeadAttentionStats m = l.mean();
    std::snprintf(line, sizeof line, "| %d | %.4f | %.4f | %.3f |\n", l.layer, m.recall, m.rel_error, m.density);
    md += line;
    total.recall += m.recall;
    total.rel_error += m.rel_error;
    total.density += m.density;
  }
  if (!layers.empty()) {
    const auto n = static_cast<double>(layers.size());
    std::snprintf(line, sizeof line, "| **mean** | **%.4f** | **%.4f** | **%.3f** |\n", total.recall / n,
                  total.rel_error / n, total.density / n);
    md += line;
  }
  return md;
}

nlohmann::json layer_stats_to_json(const std::vector<LayerAttentionStats>& layers) {
  nlohmann::json j = nlohmann::json::array();
  for (const LayerAttentionStats& l : layers) {
    nlohmann::json heads = nlohmann::json::array();
    for (const HeadAttentionStats& h : l.heads)
      heads.push_back({{"recall", h.recall}, {"rel_error", h.rel_error}, {"density", h.density}});
    j.push_back({{"layer", l.layer}, {"rows", l.rows}, {"heads", heads}});
  }
  return j;
}

}  // namespace tessera::eval
