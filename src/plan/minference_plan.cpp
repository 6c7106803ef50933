#include "plan/minference_plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "core/error.h"
#include "plan/moa_plan.h"
#include "runtime/engine.h"

namespace tessera::plan {

std::vector<attn::Pattern> minference_candidates(double budget, int32_t length) {
  check(budget > 0 && budget <= 1, "minference: budget must be in (0, 1], got " + std::to_string(budget));
  check(length >= 64, "minference: calibration length must be >= 64, got " + std::to_string(length));
  std::vector<attn::Pattern> out;
  // A-shape: the smallest local window (sink = local / 4) whose exact density reaches the budget.
  int32_t lo = 1, hi = length;
  auto ashape = [](int32_t local) { return attn::AShapePattern{local / 4, local}; };
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (pattern_density_exact(ashape(mid), length) >= budget)
      hi = mid;
    else
      lo = mid + 1;
  }
  out.emplace_back(ashape(lo));
  // Vertical-slash, the paper's four shapes scaled to the budget.
  const double n = length;
  for (const auto& [v0, s0] : {std::pair{30.0, 2048.0}, {100.0, 1800.0}, {500.0, 1500.0}, {3000.0, 200.0}}) {
    const double c = budget * n / (v0 + 2 * s0);
    attn::VerticalSlashPattern vs;
    vs.vertical = static_cast<int32_t>(std::max(1.0, std::round(c * v0)));
    vs.slash = static_cast<int32_t>(std::max(1.0, std::round(c * s0)));
    out.emplace_back(vs);
  }
  // Block-sparse: top_k blocks of the mean causal count.
  const double nb = std::ceil(n / 64.0);
  out.emplace_back(attn::BlockSparsePattern{static_cast<int32_t>(std::max(1.0, std::round(budget * (nb + 1) / 2))), 64});
  return out;
}

MInferenceResult plan_minference(const runtime::Model& model, const std::vector<CalibrationSample>& samples,
                                 const MInferenceOptions& o, ThreadPool& pool,
                                 const std::function<void(int32_t, int32_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  check(!samples.empty(), "minference: no calibration samples");
  const auto& cfg = model.config();
  MInferenceResult r;
  for (const CalibrationSample& s : samples) r.length = std::max(r.length, static_cast<int32_t>(s.tokens.size()));
  r.candidates = minference_candidates(o.budget, r.length);
  const size_t C = r.candidates.size();
  for (const attn::Pattern& p : r.candidates) {
    if (std::holds_alternative<attn::AShapePattern>(p)) {
      r.candidate_density.push_back(pattern_density_exact(p, r.length));
    } else if (const auto* vs = std::get_if<attn::VerticalSlashPattern>(&p)) {
      r.candidate_density.push_back(std::min(1.0, (vs->vertical + 2.0 * vs->slash) / r.length));
    } else {
      const auto& bs = std::get<attn::BlockSparsePattern>(p);
      r.candidate_density.push_back(std::min(1.0, bs.top_k / ((std::ceil(r.length / 64.0) + 1) / 2)));
    }
  }
  const size_t heads = static_cast<size_t>(cfg.num_layers) * static_cast<size_t>(cfg.num_q_heads);
  r.error.assign(heads * C, 0.0);
  r.measured_density.assign(heads * C, 0.0);
  std::vector<float> out;
  runtime::EngineOptions eo;
  eo.pool = &pool;
  eo.observer = [&](int32_t layer, const attn::AttentionArgs& args) {
    const int64_t n = args.q_len(), nq = args.num_q_heads(), d = args.head_dim();
    out.resize(static_cast<size_t>(n * nq * d));
    const attn::LoweringContext ctx{args.q_begin, static_cast<int32_t>(n), static_cast<int32_t>(args.kv_len()),
                                    static_cast<int32_t>(args.kv_len()), 64};
    const float* dense = static_cast<const float*>(args.out.data);
    for (size_t c = 0; c < C; ++c) {
      const std::vector<attn::Pattern> patterns(static_cast<size_t>(nq), r.candidates[c]);
      const auto estimates = attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool);
      const attn::SparseIndex index = attn::lower_layer(patterns, estimates, ctx);
      attn::AttentionArgs sparse = args;
      sparse.out = TensorView(out.data(), DType::F32, {n, nq, d});
      sparse.lse = TensorView();
      attn::sparse_attention_cpu(sparse, index, pool);
      const auto stats = attn::index_stats_per_head(index);
      for (int64_t h = 0; h < nq; ++h) {
        double num = 0, den = 0;
        for (int64_t t = 0; t < n; ++t)
          for (int64_t i = 0; i < d; ++i) {
            const size_t at = static_cast<size_t>((t * nq + h) * d + i);
            const double e = static_cast<double>(out[at]) - dense[at];
            num += e * e;
            den += static_cast<double>(dense[at]) * dense[at];
          }
        const size_t hh = static_cast<size_t>(layer) * static_cast<size_t>(nq) + static_cast<size_t>(h);
        r.error[hh * C + c] += std::sqrt(num / std::max(den, 1e-300)) / static_cast<double>(samples.size());
        r.measured_density[hh * C + c] += stats[static_cast<size_t>(h)].density() / static_cast<double>(samples.size());
      }
    }
  };
  int32_t done = 0;
  for (const CalibrationSample& s : samples) {
    eo.chunk_size = static_cast<int32_t>(s.tokens.size());
    eo.max_context = static_cast<int32_t>(s.tokens.size());
    runtime::Engine engine(model, eo);
    engine.prefill(s.tokens);
    if (progress) progress(++done, static_cast<int32_t>(samples.size()));
  }
  std::vector<attn::Pattern> table;
  for (size_t hh = 0; hh < heads; ++hh) {
    size_t best = 0;
    for (size_t c = 1; c < C; ++c)
      if (r.error[hh * C + c] < r.error[hh * C + best]) best = c;
    r.choice.push_back(static_cast<int32_t>(best));
    r.score.push_back(r.error[hh * C + best]);
    table.push_back(r.candidates[best]);
  }
  r.policy = attn::AttentionPolicy(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, std::move(table));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace tessera::plan
