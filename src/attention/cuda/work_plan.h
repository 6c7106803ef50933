// tessera/attention/cuda/work_plan.h — the plan half of plan/run for the CUDA sparse prefill executor.
//
// The executor runs persistent CTAs that take (head, query tile) items from a work list in order (an atomic
// counter hands out the next item). Ordering the list heaviest first makes this a
// longest-processing-time-first schedule, so heads of very different density balance within one launch per
// layer.
//
// The cost of an item is what the kernel spends on it: one unit for loading Q and writing the output, plus
// one per key tile (kPrefillKeyTile keys; a range is cut into ceil(length / 64) tiles, columns are gathered
// 64 at a time). The order is a stable sort by descending cost, so equal costs keep item order (item = head *
// num_tiles
// + tile). The device builds the same order from a device-built index (lower_cuda.h); tests compare the two.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attention/index/sparse_index.h"

namespace tessera::attn::gpu {

inline constexpr int32_t kPrefillKeyTile = 64;

// Cost of one item from its ranges and column count.
inline int32_t prefill_item_cost(std::span<const KeyRange> ranges, int32_t num_columns) {
  int64_t cost = 1;
  for (const KeyRange& r : ranges) cost += (r.end - r.begin + kPrefillKeyTile - 1) / kPrefillKeyTile;
  cost += (num_columns + kPrefillKeyTile - 1) / kPrefillKeyTile;
  return static_cast<int32_t>(cost);
}

// Costs of all items, entry h * num_tiles + t.
std::vector<int32_t> prefill_item_costs(const SparseIndex& index);

// Items in execution order: descending cost, ties by ascending item number.
std::vector<int32_t> heaviest_first_order(const std::vector<int32_t>& costs);

// Both steps.
inline std::vector<int32_t> plan_prefill(const SparseIndex& index) {
  return heaviest_first_order(prefill_item_costs(index));
}

// Largest and mean cost over the items; the ratio bounds how much a static one-item-per-CTA split would lose.
struct PlanSummary {
  int64_t items = 0;
  int64_t total_cost = 0;
  int64_t max_cost = 0;
};
PlanSummary summarize_plan(const std::vector<int32_t>& costs);

}  // namespace tessera::attn::gpu
