#include "attention/index/split_plan.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "core/error.h"

namespace tessera::attn {

std::vector<SplitUnit> plan_splits(const std::vector<int32_t>& costs, int num_ctas,
                                   const std::vector<uint8_t>& splittable) {
  check(num_ctas > 0, "split plan: num_ctas must be positive, got " + std::to_string(num_ctas));
  check(splittable.empty() || splittable.size() == costs.size(),
        "split plan: " + std::to_string(splittable.size()) + " splittable flags for " +
            std::to_string(costs.size()) + " items");
  int64_t total = 0;
  for (int32_t c : costs) {
    check(c >= 0, "split plan: negative item cost " + std::to_string(c));
    total += c;
  }
  std::vector<SplitUnit> units;
  if (total == 0) return units;
  const int64_t share = (total + num_ctas - 1) / num_ctas;
  const int64_t chunk = std::max<int64_t>(kMinSplitTiles, share / 2);
  for (size_t i = 0; i < costs.size(); ++i) {
    if (!splittable.empty() && splittable[i] == 0) continue;
    const int64_t tiles = int64_t{costs[i]} - 1;
    if (costs[i] <= share || tiles < 2 * chunk) continue;
    const int64_t n = (tiles + chunk - 1) / chunk;
    int64_t begin = 0;
    for (int64_t u = 0; u < n; ++u) {
      const int64_t len = tiles / n + (u < tiles % n ? 1 : 0);
      units.push_back({static_cast<int32_t>(i), static_cast<int32_t>(begin), static_cast<int32_t>(begin + len)});
      begin += len;
    }
  }
  return units;
}

std::vector<int32_t> order_with_splits(const std::vector<int32_t>& costs, const std::vector<SplitUnit>& units) {
  const size_t n = costs.size();
  std::vector<int32_t> key(costs);
  std::vector<int32_t> value(n + units.size());
  std::iota(value.begin(), value.end(), 0);
  for (const SplitUnit& u : units) {
    check(u.item >= 0 && static_cast<size_t>(u.item) < n && u.tile_begin < u.tile_end,
          "split plan: unit of item " + std::to_string(u.item) + " tiles [" + std::to_string(u.tile_begin) + ", " +
              std::to_string(u.tile_end) + ") does not fit " + std::to_string(n) + " items");
    key[static_cast<size_t>(u.item)] = 0;
    value[static_cast<size_t>(u.item)] = -1;
  }
  for (const SplitUnit& u : units) key.push_back(split_unit_cost(u));
  std::vector<size_t> idx(key.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return key[a] > key[b]; });
  std::vector<int32_t> order(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) order[i] = value[idx[i]];
  return order;
}

}  // namespace tessera::attn
