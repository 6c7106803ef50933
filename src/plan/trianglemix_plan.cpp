#include "plan/trianglemix_plan.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <variant>

#include "core/error.h"
#include "plan/moa_plan.h"

namespace tessera::plan {

int32_t trianglemix_start(const std::vector<double>& middle, double threshold) {
  const auto L = static_cast<int32_t>(middle.size());
  if (L == 0) return 0;
  const double top = *std::max_element(middle.begin(), middle.end());
  int32_t start = L;
  while (start > 0 && middle[static_cast<size_t>(start - 1)] <= threshold * top) --start;
  return start;
}

namespace {

double pattern_density(const attn::Pattern& p, int32_t n, std::map<std::string, double>& cache) {
  if (std::holds_alternative<attn::DensePattern>(p)) return 1.0;
  const double N = n;
  if (const auto* vs = std::get_if<attn::VerticalSlashPattern>(&p))
    return std::min(1.0, (vs->vertical / 2.0 + vs->slash) * 2.0 / N);
  if (const auto* bs = std::get_if<attn::BlockSparsePattern>(&p)) {
    const double nb = std::ceil(N / bs->block);
    return std::min(1.0, bs->top_k / ((nb + 1) / 2.0));
  }
  const std::string key = attn::describe(p);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, pattern_density_exact(p, n)).first;
  return it->second;
}

}  // namespace

double policy_density(const attn::AttentionPolicy& policy, int32_t length) {
  if (policy.table().empty()) return 1.0;
  std::map<std::string, double> cache;
  double sum = 0;
  for (const attn::Pattern& p : policy.table()) sum += pattern_density(p, length, cache);
  return sum / static_cast<double>(policy.table().size());
}

attn::AttentionPolicy trianglemix_policy(int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
                                         const attn::AttentionPolicy& inner, const attn::TrianglePattern& triangle,
                                         int32_t start) {
  const attn::AttentionPolicy base =
      inner.table().empty() ? attn::AttentionPolicy::uniform(num_layers, num_q_heads, num_kv_heads, attn::DensePattern{})
                            : inner;
  return attn::AttentionPolicy::trianglemix(base, start, triangle);
}

SplitSelection select_split(int32_t num_layers, int32_t from, double tolerance, const SplitScore& score) {
  check(from >= 0 && from <= num_layers, "trianglemix: the split to select from (" + std::to_string(from) +
                                             ") is outside [0, " + std::to_string(num_layers) + "]");
  check(tolerance >= 0, "trianglemix: the selection's tolerance must be >= 0, got " + std::to_string(tolerance));
  SplitSelection sel;
  std::tie(sel.reference_kept, sel.reference_log_perplexity) = score(num_layers);
  sel.trials.push_back({num_layers, sel.reference_kept, sel.reference_log_perplexity, true});
  auto trial = [&](int32_t s) {
    if (s == num_layers) return true;
    const auto [kept, lp] = score(s);
    const bool ok = kept >= sel.reference_kept && lp <= sel.reference_log_perplexity + tolerance;
    sel.trials.push_back({s, kept, lp, ok});
    return ok;
  };
  int32_t s = from;
  if (trial(s)) {
    while (s > 0 && trial(s - 1)) --s;
  } else {
    do ++s;
    while (!trial(s));
  }
  sel.start = s;
  return sel;
}

TriangleMixResult plan_trianglemix(const GradientProfile& profile, int32_t num_kv_heads,
                                   const attn::AttentionPolicy& inner, const TriangleMixOptions& o) {
  check(!o.budget || (*o.budget > 0 && *o.budget <= 1),
        "trianglemix: budget must be in (0, 1], got " + std::to_string(o.budget.value_or(0)));
  const int32_t L = profile.num_layers;
  TriangleMixResult r;
  for (const LayerProbe& p : profile.probe) {
    r.middle.push_back(p.middle.abs_mean());
    r.last.push_back(p.last.abs_mean());
    r.streaming.push_back(p.streaming.abs_mean());
    r.middle_signed.push_back(p.middle.mean());
  }
  r.probe_start = trianglemix_start(r.middle, o.threshold);
  auto plan = [&](int32_t start) {
    return trianglemix_policy(L, profile.num_q_heads, num_kv_heads, inner, o.triangle, start);
  };
  r.start_layer = r.probe_start;
  if (o.budget) {
    int32_t chosen = -1;
    for (int32_t s = L; s >= 0; --s)
      if (policy_density(plan(s), o.length) <= *o.budget + 1e-12) {
        chosen = s;
        break;
      }
    check(chosen >= 0, "trianglemix: no start layer meets the budget " + std::to_string(*o.budget) + " at length " +
                           std::to_string(o.length) + " (Triangle on every layer has density " +
                           std::to_string(policy_density(plan(0), o.length)) + ")");
    r.start_layer = chosen;
  }
  r.policy = plan(r.start_layer);
  r.density = policy_density(r.policy, o.length);
  return r;
}

}  // namespace tessera::plan
