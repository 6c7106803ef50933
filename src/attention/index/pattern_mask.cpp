// The per-cell mask of every pattern, written directly from the definitions in docs/patterns.md and kept free of
// the interval arithmetic in lower.cpp, so that tests can check one against the other cell by cell.
#include <algorithm>

#include "attention/index/lower.h"
#include "core/error.h"
#include "core/overloaded.h"

namespace tessera::attn {


std::vector<uint8_t> pattern_mask(const Pattern& pattern, const HeadEstimate& estimate, const LoweringContext& ctx) {
  const int64_t S = ctx.q_len, K = ctx.kv_len, T = ctx.tile, n = ctx.n();
  std::vector<uint8_t> mask(static_cast<size_t>(S * K), 0);
  for (int64_t r = 0; r < S; ++r) {
    const int64_t p = ctx.q_begin + r;
    const int64_t tile_first = ctx.q_begin + (r / T) * T;                            // P0
    const int64_t tile_last = ctx.q_begin + std::min(S, (r / T) * T + T) - 1;        // P1 - 1
    for (int64_t j = 0; j < K; ++j) {
      if (j > p) continue;  // causal
      const bool vis = std::visit(
          Overloaded{
              [&](const DensePattern&) { return true; },
              [&](const AShapePattern& a) { return j < a.sink || j >= tile_first - a.local + 1; },
              [&](const ElasticWindowPattern& e) {
                const int64_t w = std::max<int64_t>(1, e.span(n));
                return j < e.sink || j >= tile_first - w + 1;
              },
              [&](const TrianglePattern& t) {
                // A tile holding any of the prompt's last `last` rows is dense.
                bool tile_has_last_row = false;
                for (int64_t q = tile_first; q <= tile_last; ++q) tile_has_last_row |= q >= n - t.last;
                return tile_has_last_row || j < t.sink || j >= tile_first - t.local + 1;
              },
              [&](const VerticalSlashPattern&) {
                const auto& est = std::get<VerticalSlashEstimate>(estimate);
                if (std::find(est.columns.begin(), est.columns.end(), j) != est.columns.end()) return true;
                // Slash o covers, for the tile, the keys its rows reach along diagonal o: tile_first - o .. tile_last - o.
                for (int32_t o : est.offsets) {
                  if (j >= tile_first - o && j <= tile_last - o) return true;
                }
                return false;
              },
              [&](const BlockSparsePattern&) {
                const auto& est = std::get<BlockSparseEstimate>(estimate);
                // Key block of j chosen by any query block that a row of this tile lies in.
                for (int64_t q = tile_first; q <= tile_last; ++q) {
                  const int64_t e = q / est.block - est.first_q_block;
                  if (e < 0 || e + 1 >= static_cast<int64_t>(est.offsets.size())) continue;
                  for (int32_t i = est.offsets[static_cast<size_t>(e)]; i < est.offsets[static_cast<size_t>(e + 1)]; ++i) {
                    if (est.key_blocks[static_cast<size_t>(i)] == j / est.block) return true;
                  }
                }
                return false;
              }},
          pattern);
      mask[static_cast<size_t>(r * K + j)] = vis ? 1 : 0;
    }
  }
  return mask;
}

}  // namespace tessera::attn
