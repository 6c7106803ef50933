#include "attention/index/sparse_index.h"

#include <algorithm>

#include "core/error.h"

namespace tessera::attn {

int32_t SparseIndex::tile_rows(int32_t t) const { return std::min(tile, q_len - t * tile); }

int32_t SparseIndex::tile_key_end(int32_t t) const {
  return std::min(kv_len, q_begin + t * tile + tile_rows(t));
}

bool SparseIndex::visible(int32_t head, int32_t row, int32_t key) const {
  if (row < 0 || row >= q_len || key < 0 || key >= kv_len || key > q_begin + row) return false;
  const int32_t t = row / tile;
  const auto rs = ranges_of(head, t);
  // First range whose end is past the key.
  auto it = std::upper_bound(rs.begin(), rs.end(), key, [](int32_t k, const KeyRange& r) { return k < r.end; });
  if (it != rs.end() && it->begin <= key) return true;
  const auto cs = columns_of(head, t);
  return std::binary_search(cs.begin(), cs.end(), key);
}

void SparseIndex::validate() const {
  auto fail = [](const std::string& what) { throw Error("sparse index: " + what); };
  if (tile <= 0) fail("tile must be positive, got " + std::to_string(tile));
  if (num_heads < 0 || q_len < 0 || q_begin < 0) fail("negative head count, q_len or q_begin");
  if (kv_len < q_begin + q_len) {
    fail("kv_len " + std::to_string(kv_len) + " < q_begin + q_len = " + std::to_string(q_begin + q_len));
  }
  const size_t n = static_cast<size_t>(num_heads) * static_cast<size_t>(num_tiles()) + 1;
  if (range_offsets.size() != n || column_offsets.size() != n) {
    fail("offset arrays must have num_heads * num_tiles + 1 = " + std::to_string(n) + " entries");
  }
  if (range_offsets.front() != 0 || column_offsets.front() != 0 ||
      static_cast<size_t>(range_offsets.back()) != ranges.size() ||
      static_cast<size_t>(column_offsets.back()) != columns.size()) {
    fail("offsets must start at 0 and end at the array sizes");
  }
  for (size_t i = 0; i + 1 < n; ++i) {
    if (range_offsets[i + 1] < range_offsets[i] || column_offsets[i + 1] < column_offsets[i]) {
      fail("offsets must be monotone");
    }
  }
  for (int32_t h = 0; h < num_heads; ++h) {
    for (int32_t t = 0; t < num_tiles(); ++t) {
      const std::string where = "head " + std::to_string(h) + ", tile " + std::to_string(t) + ": ";
      const int32_t end = tile_key_end(t);
      int32_t prev_end = -1;
      const auto rs = ranges_of(h, t);
      for (const KeyRange& r : rs) {
        if (r.begin < 0 || r.end > end || r.begin >= r.end) {
          fail(where + "range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
               ") is empty or outside [0, " + std::to_string(end) + ")");
        }
        if (r.begin < prev_end) fail(where + "ranges are not sorted and disjoint");
        prev_end = r.end;
      }
      int32_t prev = -1;
      size_t ri = 0;
      for (int32_t c : columns_of(h, t)) {
        if (c < 0 || c >= end) fail(where + "column " + std::to_string(c) + " outside [0, " + std::to_string(end) + ")");
        if (c <= prev) fail(where + "columns are not strictly ascending");
        prev = c;
        while (ri < rs.size() && rs[ri].end <= c) ++ri;
        if (ri < rs.size() && rs[ri].begin <= c) fail(where + "column " + std::to_string(c) + " lies inside a range");
      }
    }
  }
}

namespace {
// Visible cells of rows [p0, p1) (absolute positions) within key interval [b, e), causal: j <= p, and within the
// last `window` keys of each row when window > 0: j > p - window.
int64_t causal_cells_in(int64_t p0, int64_t p1, int64_t b, int64_t e, int64_t window = 0) {
  int64_t n = 0;
  for (int64_t p = p0; p < p1; ++p)
    n += std::max<int64_t>(0, std::min(e, p + 1) - (window > 0 ? std::max(b, p - window + 1) : b));
  return n;
}
}  // namespace

std::vector<IndexStats> index_stats_per_head(const SparseIndex& index, int64_t window) {
  std::vector<IndexStats> out(static_cast<size_t>(index.num_heads));
  for (int32_t h = 0; h < index.num_heads; ++h) {
    IndexStats& s = out[static_cast<size_t>(h)];
    for (int32_t t = 0; t < index.num_tiles(); ++t) {
      const int64_t p0 = index.q_begin + static_cast<int64_t>(t) * index.tile;
      const int64_t rows = index.tile_rows(t);
      const int64_t p1 = p0 + rows;
      s.causal_cells += causal_cells_in(p0, p1, 0, index.kv_len);
      for (const KeyRange& r : index.ranges_of(h, t)) {
        s.mask_cells += causal_cells_in(p0, p1, r.begin, r.end, window);
        s.work_cells += rows * (r.end - r.begin);
      }
      for (int32_t c : index.columns_of(h, t)) {
        const int64_t last = window > 0 ? std::min<int64_t>(p1, int64_t{c} + window) : p1;  // rows p < c + window
        s.mask_cells += std::max<int64_t>(0, last - std::max<int64_t>(p0, c));
        s.work_cells += rows;
      }
    }
  }
  return out;
}

IndexStats index_stats(const SparseIndex& index, int64_t window) {
  IndexStats total;
  for (const IndexStats& s : index_stats_per_head(index, window)) {
    total.mask_cells += s.mask_cells;
    total.causal_cells += s.causal_cells;
    total.work_cells += s.work_cells;
  }
  return total;
}

}  // namespace tessera::attn
