// Lowering of every pattern to the range+column index. The per-cell definitions live in pattern_mask.cpp and
// docs/patterns.md; this file computes the same sets as merged intervals, tile by tile.
#include "attention/index/lower.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/overloaded.h"

namespace tessera::attn {

namespace {

// Collects intervals for one (head, tile), then clips, sorts and merges them.
class TileBuilder {
 public:
  explicit TileBuilder(int32_t key_end) : key_end_(key_end) {}

  void add(int64_t begin, int64_t end) {
    begin = std::max<int64_t>(begin, 0);
    end = std::min<int64_t>(end, key_end_);
    if (begin < end) intervals_.push_back({static_cast<int32_t>(begin), static_cast<int32_t>(end)});
  }

  // Appends the merged ranges, then `columns` (ascending) that fall in no range and before key_end.
  void emit(SparseIndex& index, const std::vector<int32_t>* columns) {
    std::sort(intervals_.begin(), intervals_.end(),
              [](const KeyRange& a, const KeyRange& b) { return a.begin < b.begin; });
    const size_t first = index.ranges.size();
    for (const KeyRange& r : intervals_) {
      if (index.ranges.size() > first && r.begin <= index.ranges.back().end) {
        index.ranges.back().end = std::max(index.ranges.back().end, r.end);
      } else {
        index.ranges.push_back(r);
      }
    }
    index.range_offsets.push_back(static_cast<int32_t>(index.ranges.size()));
    if (columns != nullptr) {
      size_t ri = first;
      for (int32_t c : *columns) {
        if (c < 0) continue;
        if (c >= key_end_) break;
        while (ri < index.ranges.size() && index.ranges[ri].end <= c) ++ri;
        if (ri < index.ranges.size() && index.ranges[ri].begin <= c) continue;
        if (index.columns.size() > static_cast<size_t>(index.column_offsets.back()) && index.columns.back() == c) {
          continue;  // duplicate column
        }
        index.columns.push_back(c);
      }
    }
    index.column_offsets.push_back(static_cast<int32_t>(index.columns.size()));
  }

 private:
  int32_t key_end_;
  std::vector<KeyRange> intervals_;
};

void check_context(const LoweringContext& ctx) {
  check(ctx.tile > 0, "lowering: tile must be positive, got " + std::to_string(ctx.tile));
  check(ctx.q_begin >= 0 && ctx.q_len >= 0, "lowering: q_begin and q_len must be non-negative");
  check(ctx.kv_len >= ctx.q_begin + ctx.q_len,
        "lowering: kv_len " + std::to_string(ctx.kv_len) + " is smaller than q_begin + q_len = " +
            std::to_string(ctx.q_begin + ctx.q_len));
}

void add_streaming(TileBuilder& b, int64_t p0, int64_t p1, int64_t sink, int64_t local) {
  b.add(0, sink);
  b.add(p0 - local + 1, p1);
}

// An index of no heads for ctx's call.
SparseIndex empty_index(const LoweringContext& ctx) {
  SparseIndex index;
  index.tile = ctx.tile;
  index.q_begin = ctx.q_begin;
  index.q_len = ctx.q_len;
  index.kv_len = ctx.kv_len;
  index.range_offsets.assign(1, 0);
  index.column_offsets.assign(1, 0);
  return index;
}

}  // namespace

void lower_head(const Pattern& pattern, const HeadEstimate& estimate, const LoweringContext& ctx, SparseIndex& index) {
  check_context(ctx);
  if (index.range_offsets.empty()) {  // a fresh index
    index = empty_index(ctx);
  } else {
    check(index.tile == ctx.tile && index.q_begin == ctx.q_begin && index.q_len == ctx.q_len &&
              index.kv_len == ctx.kv_len,
          "lowering: context differs from the index being extended");
  }
  const int32_t head = index.num_heads;
  const auto* vs = std::get_if<VerticalSlashEstimate>(&estimate);
  const auto* bs = std::get_if<BlockSparseEstimate>(&estimate);
  if (std::holds_alternative<VerticalSlashPattern>(pattern)) {
    check(vs != nullptr, "lowering: head " + std::to_string(head) + " runs vertical_slash but has no VS estimate");
  }
  if (std::holds_alternative<BlockSparsePattern>(pattern)) {
    check(bs != nullptr, "lowering: head " + std::to_string(head) + " runs block_sparse but has no BS estimate");
  }

  const int64_t n = ctx.n();
  for (int32_t t = 0; t < index.num_tiles(); ++t) {
    const int64_t p0 = ctx.q_begin + static_cast<int64_t>(t) * ctx.tile;
    const int64_t p1 = p0 + index.tile_rows(t);
    TileBuilder b(index.tile_key_end(t));
    const std::vector<int32_t>* columns = nullptr;
    std::visit(Overloaded{
                   [&](const DensePattern&) { b.add(0, p1); },
                   [&](const AShapePattern& a) { add_streaming(b, p0, p1, a.sink, a.local); },
                   [&](const ElasticWindowPattern& e) {
                     add_streaming(b, p0, p1, e.sink, std::max<int64_t>(1, e.span(n)));
                   },
                   [&](const TrianglePattern& tri) {
                     if (p1 - 1 >= n - tri.last) {
                       b.add(0, p1);
                     } else {
                       add_streaming(b, p0, p1, tri.sink, tri.local);
                     }
                   },
                   [&](const VerticalSlashPattern&) {
                     for (int32_t o : vs->offsets) b.add(p0 - o, p1 - o);
                     columns = &vs->columns;
                   },
                   [&](const BlockSparsePattern&) {
                     const int64_t blk = bs->block;
                     const int64_t qb_first = p0 / blk, qb_last = (p1 - 1) / blk;
                     for (int64_t qb = qb_first; qb <= qb_last; ++qb) {
                       const int64_t e = qb - bs->first_q_block;
                       if (e < 0 || e + 1 >= static_cast<int64_t>(bs->offsets.size())) continue;
                       for (int32_t i = bs->offsets[static_cast<size_t>(e)]; i < bs->offsets[static_cast<size_t>(e + 1)]; ++i) {
                         const int64_t kb = bs->key_blocks[static_cast<size_t>(i)];
                         b.add(kb * blk, (kb + 1) * blk);
                       }
                     }
                   }},
               pattern);
    b.emit(index, columns);
  }
  // Offsets were appended tile by tile for this head; the layout is head-major, so heads must be lowered in order.
  ++index.num_heads;
}

SparseIndex lower_layer(const std::vector<Pattern>& patterns, const std::vector<HeadEstimate>& estimates,
                        const LoweringContext& ctx) {
  check(estimates.empty() || estimates.size() == patterns.size(),
        "lowering: " + std::to_string(patterns.size()) + " patterns but " + std::to_string(estimates.size()) +
            " estimates");
  check_context(ctx);
  SparseIndex index = empty_index(ctx);
  const HeadEstimate none;
  for (size_t h = 0; h < patterns.size(); ++h) {
    lower_head(patterns[h], estimates.empty() ? none : estimates[h], ctx, index);
  }
  return index;
}

}  // namespace tessera::attn
