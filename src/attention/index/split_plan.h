// tessera/attention/index/split_plan.h — split-K for the sparse prefill executor's work plan.
//
// The GPU executor runs persistent CTAs over a heaviest-first list of (head, query tile) items
// (attention/cuda/work_plan.h). An item's cost is 1 + its key tiles; when one item costs more than a CTA's share
// of the whole layer (the prompt's last rows under a Triangle pattern at a small head count, a decode step or
// the last chunk of a chunked prefill over a long cache), the schedule cannot be shorter than that item. Such an
// item is cut into units of consecutive key tiles; each unit runs like an item but leaves its normalised output
// and its log-sum-exp in a scratch buffer, and a merge kernel combines the units of an item (weights
// 2^(lse_u - lse), lse = log2 sum_u 2^lse_u), which is exact up to rounding: softmax over the union of disjoint
// key sets.
//
// Pure host code (no CUDA), so that the plan is tested on the CPU.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::attn {

// Key tiles [tile_begin, tile_end) of `item`, counted as the executor walks the item (ranges, then columns,
// 64 keys per tile).
struct SplitUnit {
  int32_t item = 0;
  int32_t tile_begin = 0;
  int32_t tile_end = 0;
  bool operator==(const SplitUnit&) const = default;
};

// A unit's cost in the plan's units (1 for the item's query tile and output, plus its key tiles).
inline int32_t split_unit_cost(const SplitUnit& u) { return u.tile_end - u.tile_begin + 1; }

// Units no smaller than this many key tiles (4096 keys of 64): the merge costs a few row reads and writes per
// unit, negligible next to this much attention.
inline constexpr int32_t kMinSplitTiles = 64;

// The split of a plan over `num_ctas` persistent CTAs. share = ceil(sum of costs / num_ctas); an item with
// splittable[item] != 0 and cost > share whose key tiles fill at least two units of
// chunk = max(kMinSplitTiles, share / 2) tiles is cut into n = ceil(tiles / chunk) units of near-equal size
// (the first tiles % n units one tile longer). Items not marked splittable keep their cost in the total but are
// never cut (their costs are unknown when the plan is made, e.g. estimated patterns, or passed as 0). Units are
// returned item by item, tiles ascending. splittable may be empty: every item may be cut.
std::vector<SplitUnit> plan_splits(const std::vector<int32_t>& costs, int num_ctas,
                                   const std::vector<uint8_t>& splittable = {});

// The work order with splits: entries 0 .. n-1 are item numbers, n + u is unit u (n = costs.size()); an item
// that was split stays in the list as -1 with cost 0 (the executor skips it: its units run it). Stable
// descending by cost (unit u's cost split_unit_cost), ties in list order (items, then units), as a stable radix
// sort of [costs..., unit costs...] on the device gives.
std::vector<int32_t> order_with_splits(const std::vector<int32_t>& costs, const std::vector<SplitUnit>& units);

}  // namespace tessera::attn
