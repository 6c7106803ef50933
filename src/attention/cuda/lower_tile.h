// tessera/attention/cuda/lower_tile.h — lowering of one (head, query tile), callable on the host and the
// device.
//
// The device lowering (lower_cuda.cu) runs this per item; being plain C++ with host-device annotations, the
// same code also runs on the host, where tests check it against the CPU lowering (attention/index/lower.cpp,
// the contract) without a GPU. Semantics per tile with first query p0, rows, p1 = p0 + rows and
// key_end = min(kv_len, p1): the pattern's intervals, generated in ascending order of begin, clipped to
// [0, key_end) and merged when they overlap or touch; then the VS columns below key_end that lie in no range,
// without duplicates.
#pragma once

#include <cstdint>

#include "attention/cuda/work_plan.h"
#include "attention/index/sparse_index.h"
#include "core/host_device.h"

namespace tessera::attn::gpu {

// What the lowering needs of one head (plain data; the pointers are device pointers into a DeviceEstimates on
// the GPU, host pointers in host tests).
struct DeviceHeadPattern {
  enum Kind : int32_t { kDense = 0, kStreaming = 1, kTriangle = 2, kVerticalSlash = 3, kBlockSparse = 4 };
  int32_t kind = kDense;
  int32_t sink = 0;
  int32_t local = 1;                 // streaming / triangle window (ElasticWindow: max(1, span(N)))
  int32_t last = 0;                  // triangle
  const int32_t* columns = nullptr;  // VS, ascending
  int32_t num_columns = 0;
  const int32_t* offsets = nullptr;  // VS, ascending
  int32_t num_offsets = 0;
  const int32_t* bs_offsets = nullptr;  // BS: CSR over query blocks, head-local
  const int32_t* bs_key_blocks = nullptr;
  int32_t bs_first_q_block = 0;
  int32_t bs_num_q_blocks = 0;
  int32_t bs_block = 64;
  // VS, device build only (lower_cuda.cu "runs"): base of this head's entries in the builder's run arrays,
  // -1 when it has none (host callers leave it).
  int32_t run_base = -1;
};

struct TileGeometry {
  int64_t p0 = 0;       // absolute position of the tile's first query
  int64_t p1 = 0;       // one past its last query
  int64_t key_end = 0;  // min(kv_len, p1)
  int64_t n_total = 0;  // N of the prompt (Triangle's last rows)
};

struct TileCounts {
  int32_t ranges = 0;
  int32_t columns = 0;
  int32_t cost = 0;  // work_plan.h: 1 + key tiles of the ranges + column tiles
};

namespace detail {

// Receives intervals in ascending order of begin; clips to [0, key_end), merges overlapping or touching ones.
// Writes only when `out` is not null.
struct RangeEmitter {
  int64_t key_end = 0;
  KeyRange* out = nullptr;
  int32_t count = 0;
  int32_t key_tiles = 0;
  int64_t cb = 0, ce = 0;
  bool open = false;

  TESSERA_HOST_DEVICE void add(int64_t b, int64_t e) {
    b = b < 0 ? 0 : b;
    e = e < key_end ? e : key_end;
    if (b >= e) return;
    if (open && b <= ce) {
      ce = e > ce ? e : ce;
      return;
    }
    flush();
    cb = b;
    ce = e;
    open = true;
  }
  TESSERA_HOST_DEVICE void flush() {
    if (!open) return;
    if (out != nullptr) {
      out[count].begin = static_cast<int32_t>(cb);
      out[count].end = static_cast<int32_t>(ce);
    }
    key_tiles += static_cast<int32_t>((ce - cb + kPrefillKeyTile - 1) / kPrefillKeyTile);
    ++count;
    open = false;
  }
};

// First index in [lo, hi) of the ascending array a whose value is > x (hi when none).
TESSERA_HOST_DEVICE inline int upper_bound_index(const int32_t* a, int lo, int hi, int64_t x) {
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (a[mid] <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// First index in [lo, hi) of the ascending array a whose value is >= x (hi when none).
TESSERA_HOST_DEVICE inline int lower_bound_index(const int32_t* a, int lo, int hi, int64_t x) {
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (a[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace detail

// Lowers one tile; writes ranges to out_ranges and columns to out_columns when they are not null (a counting
// pass passes null). Returns the counts and the plan cost.
TESSERA_HOST_DEVICE inline TileCounts lower_tile(const DeviceHeadPattern& hp, const TileGeometry& g,
                                                 KeyRange* out_ranges, int32_t* out_columns) {
  detail::RangeEmitter em;
  em.key_end = g.key_end;
  em.out = out_ranges;
  const int64_t p0 = g.p0, p1 = g.p1;
  switch (hp.kind) {
    case DeviceHeadPattern::kDense:
      em.add(0, p1);
      break;
    case DeviceHeadPattern::kTriangle:
      if (p1 - 1 >= g.n_total - hp.last) {
        em.add(0, p1);
        break;
      }
      [[fallthrough]];
    case DeviceHeadPattern::kStreaming:
      em.add(0, hp.sink);
      em.add(p0 - hp.local + 1, p1);
      break;
    case DeviceHeadPattern::kVerticalSlash:
      // Offsets ascending -> intervals [p0 - o, p1 - o) with descending begins: walk them backwards, from
      // the last offset below p1 (larger ones give empty intervals).
      for (int i = detail::lower_bound_index(hp.offsets, 0, hp.num_offsets, p1) - 1; i >= 0; --i)
        em.add(p0 - hp.offsets[i], p1 - hp.offsets[i]);
      break;
    case DeviceHeadPattern::kBlockSparse: {
      // Union of the key blocks chosen by every query block the tile touches: a merge of sorted lists that
      // takes the smallest block above the last one emitted.
      const int64_t blk = hp.bs_block;
      const int64_t qb_first = p0 / blk, qb_last = (p1 - 1) / blk;
      int64_t last = -1;
      for (;;) {
        int64_t next = INT64_MAX;
        for (int64_t qb = qb_first; qb <= qb_last; ++qb) {
          const int64_t e = qb - hp.bs_first_q_block;
          if (e < 0 || e >= hp.bs_num_q_blocks) continue;
          const int lo = hp.bs_offsets[e], hi = hp.bs_offsets[e + 1];
          const int i = detail::upper_bound_index(hp.bs_key_blocks, lo, hi, last);
          if (i < hi && hp.bs_key_blocks[i] < next) next = hp.bs_key_blocks[i];
        }
        if (next == INT64_MAX) break;
        em.add(next * blk, (next + 1) * blk);
        last = next;
      }
      break;
    }
    default:
      break;
  }
  em.flush();

  // VS columns. Column c lies in the interval of offset o iff p0 - c <= o < p1 - c; `i` tracks the first
  // offset >= p0 - c (a binary search for the first column, then it only moves left as c grows).
  int32_t nc = 0;
  if (hp.kind == DeviceHeadPattern::kVerticalSlash) {
    int i = -1;
    int64_t prev = -1;
    for (int j = 0; j < hp.num_columns; ++j) {
      const int64_t c = hp.columns[j];
      if (c < 0) continue;
      if (c >= g.key_end) break;
      if (i < 0) {
        i = detail::lower_bound_index(hp.offsets, 0, hp.num_offsets, p0 - c);
      } else {
        while (i > 0 && hp.offsets[i - 1] >= p0 - c) --i;
      }
      if (i < hp.num_offsets && hp.offsets[i] < p1 - c) continue;
      if (c == prev) continue;
      if (out_columns != nullptr) out_columns[nc] = static_cast<int32_t>(c);
      ++nc;
      prev = c;
    }
  }
  TileCounts counts;
  counts.ranges = em.count;
  counts.columns = nc;
  counts.cost = 1 + em.key_tiles + (nc + kPrefillKeyTile - 1) / kPrefillKeyTile;
  return counts;
}

// Geometry of tile t of a call.
TESSERA_HOST_DEVICE inline TileGeometry tile_geometry(int32_t t, int32_t tile, int32_t q_begin, int32_t q_len,
                                                      int32_t kv_len, int64_t n_total) {
  TileGeometry g;
  g.p0 = int64_t{q_begin} + int64_t{t} * tile;
  const int64_t rows_left = int64_t{q_len} - int64_t{t} * tile;
  g.p1 = g.p0 + (rows_left < tile ? rows_left : tile);
  g.key_end = g.p1 < kv_len ? g.p1 : kv_len;
  g.n_total = n_total;
  return g;
}

}  // namespace tessera::attn::gpu
