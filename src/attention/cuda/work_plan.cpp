#include "attention/cuda/work_plan.h"

#include <algorithm>
#include <numeric>

namespace tessera::attn::gpu {

std::vector<int32_t> prefill_item_costs(const SparseIndex& index) {
  const int32_t tiles = index.num_tiles();
  std::vector<int32_t> costs(static_cast<size_t>(index.num_heads) * static_cast<size_t>(tiles));
  for (int32_t h = 0; h < index.num_heads; ++h) {
    for (int32_t t = 0; t < tiles; ++t) {
      costs[static_cast<size_t>(h) * static_cast<size_t>(tiles) + static_cast<size_t>(t)] =
          prefill_item_cost(index.ranges_of(h, t), static_cast<int32_t>(index.columns_of(h, t).size()));
    }
  }
  return costs;
}

std::vector<int32_t> heaviest_first_order(const std::vector<int32_t>& costs) {
  std::vector<int32_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return costs[static_cast<size_t>(a)] > costs[static_cast<size_t>(b)];
  });
  return order;
}

PlanSummary summarize_plan(const std::vector<int32_t>& costs) {
  PlanSummary s;
  s.items = static_cast<int64_t>(costs.size());
  for (int32_t c : costs) {
    s.total_cost += c;
    s.max_cost = std::max<int64_t>(s.max_cost, c);
  }
  return s;
}

}  // namespace tessera::attn::gpu
