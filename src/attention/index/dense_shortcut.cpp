// The static dense rule (contract: dense_shortcut.h).
#include "attention/index/dense_shortcut.h"

#include <algorithm>
#include <cstdint>
#include <variant>

namespace tessera::attn {

namespace {

// Kept keys of row p (visible keys `vis`) under each pattern kind; `budget` per row for the others.
double coverage_with(const LoweringContext& ctx, int64_t budget, int64_t dense_from_row) {
  double kept = 0, all = 0;
  for (int64_t i = 0; i < ctx.q_len; ++i) {
    const int64_t p = int64_t{ctx.q_begin} + i;
    const int64_t vis = std::min<int64_t>(p + 1, ctx.kv_len);
    if (vis <= 0) continue;
    all += static_cast<double>(vis);
    kept += static_cast<double>(p >= dense_from_row ? vis : std::min(vis, budget));
  }
  return all > 0 ? kept / all : 1.0;
}

}  // namespace

bool coverage_is_bound(const Pattern& pattern) {
  return std::holds_alternative<VerticalSlashPattern>(pattern) || std::holds_alternative<BlockSparsePattern>(pattern);
}

double head_coverage(const Pattern& pattern, const LoweringContext& ctx) {
  constexpr int64_t kNever = INT64_MAX;
  if (std::holds_alternative<DensePattern>(pattern)) return 1.0;
  if (const auto* a = std::get_if<AShapePattern>(&pattern))
    return coverage_with(ctx, int64_t{a->sink} + a->local, kNever);
  if (const auto* e = std::get_if<ElasticWindowPattern>(&pattern))
    return coverage_with(ctx, int64_t{e->sink} + std::max<int64_t>(1, e->span(ctx.n())), kNever);
  if (const auto* t = std::get_if<TrianglePattern>(&pattern))
    return coverage_with(ctx, int64_t{t->sink} + t->local, int64_t{ctx.n()} - t->last);
  if (const auto* v = std::get_if<VerticalSlashPattern>(&pattern))
    return coverage_with(ctx, int64_t{v->vertical} + v->slash, kNever);
  if (const auto* b = std::get_if<BlockSparsePattern>(&pattern))
    return coverage_with(ctx, int64_t{b->top_k} * b->block, kNever);
  return 0.0;
}

bool dense_before_estimation(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                             double rel_dense_cost) {
  if (patterns.empty() || ctx.q_len <= 0) return false;
  bool any_sparse = false;
  const Pattern* prev = nullptr;
  for (const Pattern& p : patterns) {
    if (std::holds_alternative<DensePattern>(p)) continue;
    any_sparse = true;
    if (prev != nullptr && *prev == p) continue;  // same pattern, same answer
    prev = &p;
    const double need = (coverage_is_bound(p) ? kDynamicDenseCoverage : kStaticDenseCoverage) * rel_dense_cost;
    if (head_coverage(p, ctx) < need) return false;
  }
  return any_sparse;
}

}  // namespace tessera::attn
