#include "plan/minference_plan.h"

#include <algorithm>
#include <atomic>
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

namespace {
std::atomic<DeviceMInferenceFn> g_cuda_minference{nullptr};
}  // namespace

void register_cuda_minference(DeviceMInferenceFn fn) { g_cuda_minference.store(fn); }
bool cuda_minference_registered() { return g_cuda_minference.load() != nullptr; }

std::vector<size_t> drop_degenerate(std::vector<attn::Pattern>& candidates) {
  std::vector<size_t> kept;
  std::vector<attn::Pattern> out;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const attn::Pattern& c = candidates[i];
    if (const auto* vs = std::get_if<attn::VerticalSlashPattern>(&c))
      if (vs->vertical < kMinVerticals || vs->slash < kMinSlashes) continue;
    if (std::find(out.begin(), out.end(), c) != out.end()) continue;
    out.push_back(c);
    kept.push_back(i);
  }
  candidates = std::move(out);
  return kept;
}

namespace {

// The paper's candidate space scaled to the budget at `length`; with `clamp`, VS shapes raised to the floors.
std::vector<attn::Pattern> paper_candidates(double budget, int32_t length, bool clamp) {
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
  if (clamp) {
    // A shape under a floor is raised to it and the other budget lowered so that vertical + 2 slash stays the same
    // (a shape that cannot keep both floors within the budget stays degenerate and is dropped).
    for (attn::Pattern& p : out)
      if (auto* vs = std::get_if<attn::VerticalSlashPattern>(&p)) {
        const int32_t total = vs->vertical + 2 * vs->slash;
        if (vs->vertical < kMinVerticals) {
          vs->vertical = kMinVerticals;
          vs->slash = (total - kMinVerticals) / 2;
        } else if (vs->slash < kMinSlashes) {
          vs->slash = kMinSlashes;
          vs->vertical = total - 2 * kMinSlashes;
        }
      }
  }
  // Block-sparse: top_k blocks of the mean causal count.
  const double nb = std::ceil(n / 64.0);
  out.emplace_back(attn::BlockSparsePattern{static_cast<int32_t>(std::max(1.0, std::round(budget * (nb + 1) / 2))), 64});
  return out;
}

}  // namespace

std::vector<attn::Pattern> minference_candidates(double budget, int32_t length) {
  std::vector<attn::Pattern> out = paper_candidates(budget, length, /*clamp=*/true);
  drop_degenerate(out);
  return out;
}

namespace {

// Mean mask density over the heads of one layer's q/k for a pattern on every head (estimation included).
double measured_density(const attn::Pattern& p, const std::vector<float>& q, const std::vector<float>& k, int64_t n,
                        const runtime::ModelConfig& cfg, ThreadPool& pool) {
  const TensorView qv(const_cast<float*>(q.data()), DType::F32, {n, cfg.num_q_heads, cfg.head_dim});
  const TensorView kv(const_cast<float*>(k.data()), DType::F32, {n, cfg.num_kv_heads, cfg.head_dim});
  const auto len = static_cast<int32_t>(n);
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(len, 64);
  const std::vector<attn::Pattern> patterns(static_cast<size_t>(cfg.num_q_heads), p);
  const float scale = cfg.attention_scale > 0 ? cfg.attention_scale : 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  const auto estimates = attn::estimate_layer(patterns, qv, kv, ctx, scale, pool);
  return attn::index_stats(attn::lower_layer(patterns, estimates, ctx)).density();
}

// A token-major [n, heads, d] view as contiguous f32: the observer's q (f32, or bf16) and k (the KV cache's f32,
// f16 or bf16: the CPU engine's default cache is not f32, and reading its 2-byte rows as floats ran past them).
std::vector<float> token_major_f32(const TensorView& x) {
  const int64_t n = x.dim(0), heads = x.dim(1), d = x.dim(2);
  std::vector<float> out(static_cast<size_t>(n * heads * d));
  float* o = out.data();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < d; ++i, ++o) {
        const int64_t at = t * x.stride[0] + h * x.stride[1] + i * x.stride[2];
        switch (x.dtype) {
          case DType::F32: *o = static_cast<const float*>(x.data)[at]; break;
          case DType::F16: *o = f16_to_f32(static_cast<const f16*>(x.data)[at]); break;
          case DType::BF16: *o = bf16_to_f32(static_cast<const bf16*>(x.data)[at]); break;
          default: throw Error("MInference plan: attention inputs of type " + std::string(dtype_name(x.dtype)));
        }
      }
  return out;
}

// The dynamic candidates' real density differs from their budget bound (a slash covers a 64-row band per query
// tile, not one cell per row: VS shapes sized by the bound execute about twice the target). Re-size them by
// measurement on the first sample's q/k at a global layer near the middle, by bisection on the scale of each
// shape (VS) or on top_k (BS), to the A-shape's exact density.
// Returns each candidate's measured density there (the A-shape's too).
std::vector<double> size_by_measurement(const runtime::Model& model, const CalibrationSample& sample, double target,
                                        std::vector<attn::Pattern>& candidates, ThreadPool& pool) {
  const auto& cfg = model.config();
  int32_t layer = cfg.num_layers / 2;
  for (int32_t d = 0; d < cfg.num_layers; ++d) {
    for (int32_t l : {cfg.num_layers / 2 + d, cfg.num_layers / 2 - d})
      if (l >= 0 && l < cfg.num_layers && cfg.layers[static_cast<size_t>(l)].sliding_window == 0) {
        layer = l;
        d = cfg.num_layers;
        break;
      }
  }
  std::vector<float> q, k;
  runtime::EngineOptions eo;
  eo.pool = &pool;
  eo.chunk_size = static_cast<int32_t>(sample.tokens.size());
  eo.max_context = static_cast<int32_t>(sample.tokens.size());
  eo.observer = [&](int32_t l, const attn::AttentionArgs& args) {
    if (l != layer) return;
    q = token_major_f32(args.q);
    k = token_major_f32(args.k);
  };
  runtime::Engine engine(model, eo);
  engine.prefill(sample.tokens);
  const int64_t n = static_cast<int64_t>(sample.tokens.size());
  for (attn::Pattern& c : candidates) {
    if (auto* vs = std::get_if<attn::VerticalSlashPattern>(&c)) {
      const double v0 = vs->vertical, s0 = vs->slash;
      auto at = [&](double scale) {
        attn::VerticalSlashPattern p = *vs;
        p.vertical = std::max(kMinVerticals, static_cast<int32_t>(std::round(v0 * scale)));
        p.slash = std::max(kMinSlashes, static_cast<int32_t>(std::round(s0 * scale)));
        return p;
      };
      double lo = 0, hi = 1;  // grow the bracket until the shape reaches the target (column-heavy shapes may not)
      while (hi < 64 && measured_density(at(hi), q, k, n, cfg, pool) < target) {
        lo = hi;
        hi *= 2;
      }
      for (int it = 0; it < 14; ++it) {
        const double mid = (lo + hi) / 2;
        if (measured_density(at(mid), q, k, n, cfg, pool) >= target)
          hi = mid;
        else
          lo = mid;
      }
      c = at(hi);
    } else if (auto* bs = std::get_if<attn::BlockSparsePattern>(&c)) {
      int32_t lo = 1, hi = std::max(1, static_cast<int32_t>((n + bs->block - 1) / bs->block));
      while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        attn::BlockSparsePattern p = *bs;
        p.top_k = mid;
        if (measured_density(p, q, k, n, cfg, pool) >= target)
          hi = mid;
        else
          lo = mid + 1;
      }
      bs->top_k = lo;
    }
  }
  std::vector<double> out;
  for (const attn::Pattern& c : candidates) out.push_back(measured_density(c, q, k, n, cfg, pool));
  return out;
}

}  // namespace

double choice_score(const MInferenceResult& r, size_t head, size_t candidate) {
  const size_t at = head * r.candidates.size() + candidate;
  return r.query_error.empty() ? r.error[at] : (1 - r.query_weight) * r.error[at] + r.query_weight * r.query_error[at];
}

void choose_candidates(MInferenceResult& r, const runtime::ModelConfig& cfg, const std::vector<bool>& excluded) {
  const size_t C = r.candidates.size();
  const size_t heads = r.error.size() / std::max<size_t>(C, 1);
  auto allowed = [&](size_t c) { return c >= excluded.size() || !excluded[c]; };
  r.choice.clear();
  r.score.clear();
  std::vector<attn::Pattern> table;
  for (size_t hh = 0; hh < heads; ++hh) {
    size_t best = C;
    for (size_t c = 0; c < C; ++c)
      if (allowed(c) && (best == C || choice_score(r, hh, c) < choice_score(r, hh, best))) best = c;
    check(best < C, "minference: every candidate excluded");
    r.choice.push_back(static_cast<int32_t>(best));
    r.score.push_back(choice_score(r, hh, best));
    table.push_back(r.candidates[best]);
  }
  r.policy = attn::AttentionPolicy(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, std::move(table));
}

int32_t repair_by_heldout(MInferenceResult& r, const runtime::ModelConfig& cfg, int32_t target,
                          const std::function<int32_t(const attn::AttentionPolicy&)>& kept) {
  const size_t C = r.candidates.size();
  std::vector<bool> excluded(C, false);
  choose_candidates(r, cfg, excluded);
  int32_t now = kept(r.policy);
  r.repair.push_back("held-out answers kept by the plan: " + std::to_string(now) + " of " + std::to_string(target));
  while (now < target) {
    int32_t best_kept = now;
    size_t best = C;
    for (size_t c = 0; c < C; ++c) {
      if (excluded[c] || std::find(r.choice.begin(), r.choice.end(), static_cast<int32_t>(c)) == r.choice.end())
        continue;
      size_t left = 0;
      for (size_t k = 0; k < C; ++k) left += !excluded[k] && k != c;
      if (left == 0) continue;
      MInferenceResult trial = r;
      std::vector<bool> ex = excluded;
      ex[c] = true;
      choose_candidates(trial, cfg, ex);
      const int32_t k = kept(trial.policy);
      r.repair.push_back("without " + attn::describe(r.candidates[c]) + ": " + std::to_string(k) + " of " +
                         std::to_string(target));
      if (k > best_kept) {
        best_kept = k;
        best = c;
      }
    }
    if (best == C) {
      r.repair.push_back("no move keeps more: the plan stays");
      break;
    }
    excluded[best] = true;
    choose_candidates(r, cfg, excluded);
    now = best_kept;
    r.repair.push_back("taken out: " + attn::describe(r.candidates[best]) + " (its heads to their next-best candidate)");
  }
  return now;
}

MInferenceResult plan_minference(const runtime::Model& model, const std::vector<CalibrationSample>& samples,
                                 const MInferenceOptions& o, ThreadPool& pool,
                                 const std::function<void(int32_t, int32_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  check(!samples.empty(), "minference: no calibration samples");
  const auto& cfg = model.config();
  MInferenceResult r;
  for (const CalibrationSample& s : samples) r.length = std::max(r.length, static_cast<int32_t>(s.tokens.size()));
  {
    const std::vector<attn::Pattern> scaled = paper_candidates(o.budget, r.length, false);
    const std::vector<attn::Pattern> clamped = paper_candidates(o.budget, r.length, true);
    r.candidates = clamped;
    const std::vector<size_t> kept = drop_degenerate(r.candidates);
    for (size_t i = 0, k = 0; i < scaled.size(); ++i) {
      const bool is_kept = k < kept.size() && kept[k] == i;
      if (is_kept) ++k;
      if (!is_kept)
        r.dropped.push_back(attn::describe(scaled[i]) + ": degenerate or a repeat, dropped");
      else if (!(scaled[i] == clamped[i]))
        r.dropped.push_back(attn::describe(scaled[i]) + ": degenerate, raised to " + attn::describe(clamped[i]));
    }
  }
  if (o.size_by_measurement) {
    const double target = pattern_density_exact(r.candidates.front(), r.length);  // the A-shape's
    const auto longest = std::max_element(samples.begin(), samples.end(), [](const auto& a, const auto& b) {
      return a.tokens.size() < b.tokens.size();
    });
    r.candidate_density = size_by_measurement(model, *longest, target, r.candidates, pool);
    // Sizing by measurement may shrink a shape under the floors, or make two shapes equal.
    const std::vector<attn::Pattern> sized = r.candidates;
    const std::vector<size_t> kept = drop_degenerate(r.candidates);
    std::vector<double> density;
    for (size_t i = 0, k = 0; i < sized.size(); ++i)
      if (k < kept.size() && kept[k] == i) {
        density.push_back(r.candidate_density[i]);
        ++k;
      } else {
        r.dropped.push_back(attn::describe(sized[i]) + ": a repeat after sizing, dropped");
      }
    r.candidate_density = std::move(density);
  }
  const size_t C = r.candidates.size();
  for (const attn::Pattern& p : r.candidates) {
    if (o.size_by_measurement) break;
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
  check(o.query_weight >= 0 && o.query_weight <= 1,
        "minference: the query rows' weight must be in [0, 1], got " + std::to_string(o.query_weight));
  if (o.query_rows > 0) {
    r.query_error.assign(heads * C, 0.0);
    r.query_weight = o.query_weight;
  }
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
      const auto stats = attn::index_stats_per_head(index, args.window);
      // The query rows: the sample's last query_rows rows (the search prefills each sample as one chunk).
      const int64_t tail = r.query_error.empty() ? n : n - std::min<int64_t>(o.query_rows, n);
      for (int64_t h = 0; h < nq; ++h) {
        double num = 0, den = 0, qnum = 0, qden = 0;
        for (int64_t t = 0; t < n; ++t) {
          double rn = 0, rd = 0;
          for (int64_t i = 0; i < d; ++i) {
            const size_t at = static_cast<size_t>((t * nq + h) * d + i);
            const double e = static_cast<double>(out[at]) - dense[at];
            rn += e * e;
            rd += static_cast<double>(dense[at]) * dense[at];
          }
          num += rn;
          den += rd;
          if (t >= tail) {
            qnum += rn;
            qden += rd;
          }
        }
        const size_t hh = static_cast<size_t>(layer) * static_cast<size_t>(nq) + static_cast<size_t>(h);
        r.error[hh * C + c] += std::sqrt(num / std::max(den, 1e-300)) / static_cast<double>(samples.size());
        if (!r.query_error.empty())
          r.query_error[hh * C + c] += std::sqrt(qnum / std::max(qden, 1e-300)) / static_cast<double>(samples.size());
        r.measured_density[hh * C + c] += stats[static_cast<size_t>(h)].density() / static_cast<double>(samples.size());
      }
    }
  };
  int32_t done = 0;
  if (o.device == Device::Cuda) {
    const DeviceMInferenceFn fn = g_cuda_minference.load();
    check(fn != nullptr, "minference: this tessera has no CUDA search (built without the CUDA toolkit, or src/plan/cuda "
                         "not linked); use the CPU (--device cpu)");
    for (const CalibrationSample& s : samples) {
      fn(model, s.tokens, r.candidates, 1.0 / static_cast<double>(samples.size()), r.error, r.measured_density,
         o.query_rows, r.query_error.empty() ? nullptr : &r.query_error);
      if (progress) progress(++done, static_cast<int32_t>(samples.size()));
    }
  }
  for (const CalibrationSample& s : samples) {
    if (o.device == Device::Cuda) break;
    eo.chunk_size = static_cast<int32_t>(s.tokens.size());
    eo.max_context = static_cast<int32_t>(s.tokens.size());
    runtime::Engine engine(model, eo);
    engine.prefill(s.tokens);
    if (progress) progress(++done, static_cast<int32_t>(samples.size()));
  }
  choose_candidates(r, cfg);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace tessera::plan
