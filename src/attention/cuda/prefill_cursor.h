// tessera/attention/cuda/prefill_cursor.h — the parameters of the sparse prefill kernels and the walk over
// one item's key tiles (KeyCursor), shared by the mma.sync and the Hopper kernel. Host and device code, so
// that the cursor is tested on the CPU (tests/gpu: PrefillCursorOnHost) against the index and the window.
#pragma once

#include <cuda_runtime.h>  // int2

#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_HD_INLINE __host__ __device__ __forceinline__
#else
#define TESSERA_HD_INLINE inline
#endif

namespace tessera::attn::gpu::detail {

struct PrefillParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // optional
  // Strides in elements.
  int64_t q_tok = 0, q_head = 0, k_tok = 0, k_head = 0, v_tok = 0, v_head = 0, o_tok = 0, o_head = 0;
  int64_t lse_head = 0, lse_tok = 0;
  int32_t q_len = 0;
  int32_t q_begin = 0;
  int32_t kv_len = 0;        // keys in k/v (the TMA kernel's tensor maps)
  int32_t num_q_heads = 0, num_kv_heads = 0;
  int32_t num_tiles = 0;
  int32_t group = 1;        // query heads per kv head
  int32_t window = 0;       // > 0: row-exact sliding window (key j hidden from position p when p - j >= window)
  uint32_t span = 0x7fffffffu;  // window, or 2^31 - 1 without one: key j visible to p iff 0 <= p - j < span
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  const int32_t* range_offsets = nullptr;
  const int2* ranges = nullptr;
  const int32_t* column_offsets = nullptr;
  const int32_t* columns = nullptr;
  const int32_t* order = nullptr;  // num_items + num_units entries (split_plan.h order_with_splits)
  int32_t num_items = 0;
  int32_t* counter = nullptr;
  // Split-K (split_plan.h): unit u = {item, first key tile, end key tile, 0}; its output rows go to part_o
  // [u][tile rows][head_dim] (f32, normalised) and part_lse [u][tile rows] (log2 units, -inf: no key seen).
  const int4* units = nullptr;
  int32_t num_units = 0;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  int32_t part_rows = 0;  // the index tile
  // Host side only: > 0 caps the persistent grid at this many CTAs (the Hopper kernel's self-check runs on 2,
  // so that each CTA takes several items and the item-to-item hand-over is checked too).
  int32_t max_ctas = 0;
  // Hopper kernel only: byte strides of its N-major V descriptor (HopperConfig::kPvLbo / kPvSbo), set by
  // launch_hopper_prefill. Kernel parameters rather than compile-time constants: as constants, ptxas scheduled the
  // consumers' uniform datapath differently, 0.5-0.9% more cycles (ncu, H200, issue 15).
  uint32_t pv_lbo = 0, pv_sbo = 0;
};

struct KeyTile {
  int32_t first = 0;  // first key (range) or first column slot (gathered)
  int32_t count = 0;  // keys in the tile, 0 = no tile
  bool gathered = false;
  bool masked = false;
};

// The key tiles of one item (both kernels): first its ranges, each cut into tiles of BN consecutive keys
// starting at the range's begin, then its columns, BN per tile. With a sliding window (p.window > 0) the
// item starts at the tile's first row's window: ranges ending at or below its lowest visible key
// lo = pos0 - window + 1 are skipped (binary search: ranges are sorted and disjoint, so their ends ascend),
// the first range left is clipped to lo, and columns below lo are skipped (binary search: they ascend).
// A tile is masked when it is partial, holds a key past the first row (causal), or, with a window, a key below
// the last row's window (key < pos_last - window + 1); the per-row mask itself is the kernel's.
// kUnits = false: a kernel that never runs split units (its plan has none) walks whole items without counting.
// PT: the tile the split plan counts in (kPrefillKeyTile keys, attention/index/split_plan.h; lower_tile's costs), a
// multiple of BN: a unit's [tile_begin, tile_end) are PT-key tiles of the walk (ranges cut at their begin, then the
// columns), each returned as PT / BN tiles of BN keys (fewer where a range or the columns end inside it). Head dim
// 256 walks BN = 32 keys under plans of 64: read as 32-key tiles, a unit's bounds covered the first half of its
// item's keys only (issue 34: Gemma-3 prefills from 8,192 keys on attended to half the cache).
template <int BN, bool kUnits = true, int PT = BN>
struct KeyCursor {
  static_assert(PT % BN == 0, "the plan's key tile must be a multiple of the kernel's");
  const int2* ranges;
  const int32_t* columns;
  int r, r_end, c, c_end, rb, re;
  int first_pos;   // absolute position of the tile's first row
  int mask_below;  // window: tiles holding a key below this are masked (the tile's last row does not see it)
  bool windowed;

  int remaining;   // plan tiles (PT keys) left to start (a split unit's share of the item)
  int left = 0;    // keys left in the current plan tile (kUnits)

  // tile_begin / tile_end: the plan tiles [tile_begin, tile_end) of the item's walk only (a split unit).
  TESSERA_HD_INLINE KeyCursor(const PrefillParams& p, int item, int pos0, int rows, int tile_begin = 0,
                              int tile_end = 0x7fffffff)
      : ranges(p.ranges),
        columns(p.columns),
        r(p.range_offsets[item]),
        r_end(p.range_offsets[item + 1]),
        c(p.column_offsets[item]),
        c_end(p.column_offsets[item + 1]),
        rb(0),
        re(0),
        first_pos(pos0),
        mask_below(0),
        windowed(p.window > 0),
        remaining(tile_end - tile_begin) {
    int lo = 0;
    if (windowed) {
      lo = pos0 - p.window + 1 > 0 ? pos0 - p.window + 1 : 0;
      mask_below = pos0 + rows - p.window;
      int a = r, b = r_end;
      while (a < b) {
        const int m = (a + b) / 2;
        if (ranges[m].y <= lo) {
          a = m + 1;
        } else {
          b = m;
        }
      }
      r = a;
      a = c;
      b = c_end;
      while (a < b) {
        const int m = (a + b) / 2;
        if (columns[m] < lo) {
          a = m + 1;
        } else {
          b = m;
        }
      }
      c = a;
    }
    if (r < r_end) {
      const int2 x = ranges[r];
      rb = x.x > lo ? x.x : lo;
      re = x.y;
    }
    if constexpr (kUnits) skip(tile_begin);
  }

  // Moves past the next n plan tiles without returning them (whole ranges at a time): the same walk as the next()
  // calls that return them.
  TESSERA_HD_INLINE void skip(int n) {
    while (n > 0 && r < r_end) {
      const int tiles = (re - rb + PT - 1) / PT;
      if (n < tiles) {
        rb += n * PT;
        return;
      }
      n -= tiles;
      if (++r < r_end) {
        const int2 x = ranges[r];
        rb = x.x;
        re = x.y;
      }
    }
    c = c + n * PT < c_end ? c + n * PT : c_end;
  }

  TESSERA_HD_INLINE KeyTile next() {
    KeyTile kt;
    int most = BN;
    if constexpr (kUnits) {
      if (left <= 0) {  // a new plan tile
        if (remaining <= 0) return kt;
        --remaining;
        left = PT;
      }
      most = left < BN ? left : BN;
    }
    if (r < r_end) {
      kt.first = rb;
      kt.count = re - rb < most ? re - rb : most;
      kt.masked = kt.count < BN || rb + BN - 1 > first_pos || (windowed && rb < mask_below);
      rb += kt.count;
      left = rb >= re ? 0 : left - kt.count;  // a plan tile ends with its range
      if (rb >= re && ++r < r_end) {
        const int2 x = ranges[r];
        rb = x.x;
        re = x.y;
      }
    } else if (c < c_end) {
      kt.first = c;
      kt.count = c_end - c < most ? c_end - c : most;
      kt.gathered = true;
      kt.masked = kt.count < BN || columns[c + kt.count - 1] > first_pos || (windowed && columns[c] < mask_below);
      c += kt.count;
      left -= kt.count;
    }
    return kt;
  }
};

// Work item `item` of the plan (head-major: item = h * num_tiles + t) as its query tile: head, tile, first row,
// row count (the last tile may be partial), absolute position of the first row, KV head.
struct PrefillItem {
  int h, t, row0, rows, pos0, kvh;
};
TESSERA_HD_INLINE PrefillItem prefill_item(const PrefillParams& p, int item, int bm) {
  PrefillItem it;
  it.h = item / p.num_tiles;
  it.t = item - it.h * p.num_tiles;
  it.row0 = it.t * bm;
  it.rows = p.q_len - it.row0 < bm ? p.q_len - it.row0 : bm;
  it.pos0 = p.q_begin + it.row0;
  it.kvh = it.h / p.group;
  return it;
}

// What order[slot] asks for: a whole item (part -1), a split unit's key tiles of an item (part = the unit), or
// nothing (item -1: an item whose units run it).
struct PrefillWork {
  int item, tile_begin, tile_end, part;
};
TESSERA_HD_INLINE PrefillWork prefill_work(const PrefillParams& p, int slot) {
  const int v = p.order[slot];
  if (v < p.num_items) return PrefillWork{v, 0, 0x7fffffff, -1};
  const int4 u = p.units[v - p.num_items];
  return PrefillWork{u.x, u.y, u.z, v - p.num_items};
}

// Key slot of an absent row of a partial tile (shared memory key list): above every position.
inline constexpr int kAbsentKey = 0x7fffffff;

// Whether row position `pos` sees key `key`: 0 <= pos - key < span, span = window, or 2^31 - 1 without a
// window (PrefillParams::span). One unsigned compare covers causality (key > pos wraps to >= 2^31), the window
// and absent rows (kAbsentKey > any pos).
TESSERA_HD_INLINE bool key_visible(int pos, int key, uint32_t span) {
  return static_cast<uint32_t>(pos) - static_cast<uint32_t>(key) < span;
}

}  // namespace tessera::attn::gpu::detail
