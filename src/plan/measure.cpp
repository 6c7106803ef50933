#include "plan/measure.h"

#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "core/error.h"
#include "runtime/engine.h"

namespace tessera::plan {

std::vector<double> executed_density(const runtime::Model& model, const std::vector<int32_t>& tokens,
                                     const std::vector<attn::AttentionPolicy>& policies, ThreadPool& pool) {
  check(!tokens.empty(), "measure: empty prompt");
  const auto& cfg = model.config();
  for (const attn::AttentionPolicy& p : policies)
    check(p.table().empty() || (p.num_layers() == cfg.num_layers && p.num_q_heads() == cfg.num_q_heads),
          "measure: a policy of " + std::to_string(p.num_layers()) + " layers x " + std::to_string(p.num_q_heads()) +
              " heads for a model of " + std::to_string(cfg.num_layers) + " x " + std::to_string(cfg.num_q_heads));
  std::vector<int64_t> kept(policies.size(), 0), causal(policies.size(), 0);
  runtime::EngineOptions eo;
  eo.pool = &pool;
  eo.chunk_size = static_cast<int32_t>(tokens.size());
  eo.max_context = static_cast<int32_t>(tokens.size());
  eo.observer = [&](int32_t layer, const attn::AttentionArgs& args) {
    const attn::LoweringContext ctx{args.q_begin, static_cast<int32_t>(args.q_len()), static_cast<int32_t>(args.kv_len()),
                                    static_cast<int32_t>(args.kv_len()), 64};
    for (size_t i = 0; i < policies.size(); ++i) {
      const attn::AttentionPolicy& p = policies[i];
      std::vector<attn::Pattern> patterns;
      for (int32_t h = 0; h < cfg.num_q_heads; ++h)
        patterns.push_back(p.table().empty() ? attn::Pattern{attn::DensePattern{}} : p.at(layer, h));
      const auto estimates = attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool);
      // A sliding-window layer executes the policy's mask within its window (the executors clip to it).
      const attn::IndexStats st = attn::index_stats(attn::lower_layer(patterns, estimates, ctx), args.window);
      kept[i] += st.mask_cells;
      causal[i] += st.causal_cells;
    }
  };
  runtime::Engine engine(model, eo);
  engine.prefill(tokens);
  std::vector<double> out;
  for (size_t i = 0; i < policies.size(); ++i)
    out.push_back(causal[i] > 0 ? static_cast<double>(kept[i]) / static_cast<double>(causal[i]) : 1.0);
  return out;
}

}  // namespace tessera::plan
