// Device lowering of patterns to the range+column index (contract: lower_cuda.h; semantics: index/lower.cpp).
#include <algorithm>
#include <climits>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <string>

#include "cuda/cuda_check.h"
#include "attention/cuda/lower_cuda.h"
#include "attention/cuda/work_plan.h"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace {

struct LowerParams {
  const DeviceHeadPattern* heads = nullptr;
  int32_t num_tiles = 0, tile = 0, q_begin = 0, q_len = 0, kv_len = 0, num_items = 0;
  int64_t n_total = 0;                              // N of the prompt (Triangle's last rows)
  int64_t range_capacity = 0, column_capacity = 0;  // allocated lengths of ranges and columns
  int32_t* range_counts = nullptr;
  int32_t* column_counts = nullptr;
  int32_t* costs = nullptr;
  int32_t* items = nullptr;
  const int32_t* range_offsets = nullptr;
  KeyRange* ranges = nullptr;
  const int32_t* column_offsets = nullptr;
  int32_t* columns = nullptr;
  // Which heads' items this launch lowers: kAll, or only the warp kinds (vertical-slash and block-sparse
  // heads), or only the others (IndexBuildMode::kPerKind runs the warp kernel on the first and the thread
  // kernel on the second).
  int32_t select = 0;
  // VS runs (vs_runs_kernel), used by the warp kernels when use_runs is set: per VS head (run_base), the
  // indices i with offsets[i + 1] - offsets[i] > tile (run_breaks, ascending, run_count[h] of them; -1: the
  // offsets do not qualify, lower by the walk) and the exclusive prefix sums of the key tiles of the runs
  // they close (run_tiles, run_count[h] + 1 entries).
  int32_t use_runs = 0;
  int32_t* run_breaks = nullptr;
  int32_t* run_tiles = nullptr;
  int32_t* run_count = nullptr;
  // VS column coverage (vs_cover_kernel; with use_runs, for the heads whose run_count is >= 0): bit u of
  // head h's cover_words words at cover + h * cover_words is set iff some offset o has u - tile <= o < u.
  // A full tile's column c (0 <= c < key_end) lies in a slash interval iff bit p1 - c is set.
  uint32_t* cover = nullptr;
  int32_t cover_words = 0;
};

constexpr int32_t kSelectAll = 0, kSelectWarpKinds = 1, kSelectOthers = 2;
// Threads per block of the warp kernels (a warp per item; the BS bitmaps are per warp of the block).
constexpr int kWarpKernelThreads = 128;
// Key blocks per window of the BS bitmap (lower_bs_tile_warp): 8192 (256 words, 1 KB per warp), which covers
// 512K keys of 64-key blocks in one window.
constexpr int kBsWindowWords = 256;

__device__ __forceinline__ bool warp_kind(int32_t kind) {
  return kind == DeviceHeadPattern::kVerticalSlash || kind == DeviceHeadPattern::kBlockSparse;
}

__device__ __forceinline__ bool selected(const LowerParams& p, int h) {
  if (p.select == kSelectAll) return true;
  const bool w = warp_kind(p.heads[h].kind);
  return p.select == kSelectWarpKinds ? w : !w;
}

__global__ void lower_count_kernel(const LowerParams p) {
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item > p.num_items) return;
  if (item == p.num_items) {  // the scans run over num_items + 1 counts so that the last offset is the total
    p.range_counts[item] = 0;
    p.column_counts[item] = 0;
    return;
  }
  const int h = item / p.num_tiles, t = item - h * p.num_tiles;
  if (!selected(p, h)) return;
  const TileCounts n = lower_tile(
      p.heads[h], tile_geometry(t, p.tile, p.q_begin, p.q_len, p.kv_len, p.n_total), nullptr, nullptr);
  p.range_counts[item] = n.ranges;
  p.column_counts[item] = n.columns;
  p.costs[item] = n.cost;
  p.items[item] = item;
}

__global__ void lower_fill_kernel(const LowerParams p) {
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= p.num_items) return;
  const int h = item / p.num_tiles, t = item - h * p.num_tiles;
  if (!selected(p, h)) return;
  lower_tile(p.heads[h], tile_geometry(t, p.tile, p.q_begin, p.q_len, p.kv_len, p.n_total),
             p.ranges + p.range_offsets[item], p.columns + p.column_offsets[item]);
}

// VS by runs. For offsets ascending with offsets[0] >= 0 and a full tile (rows = tile, key_end = p1; the
// builder requires kv_len >= q_begin + q_len), the walk of lower_tile adds the intervals [p0 - o, p1 - o) of
// the offsets o < p1 (indices 0 .. hi - 1), from the largest offset down; all are non-empty, only begins can
// be clipped (at 0), and the interval of o_k merges into the open range iff max(0, p0 - o_k) <=
// p1 - o_(k+1), i.e. (o_(k+1) < p1 makes the right side positive) iff o_(k+1) - o_k <= tile. So the tile's
// ranges are the runs of consecutive indices not separated by a break (o_(i+1) - o_i > tile) below hi - 1:
// with nb such breaks, run j = [a_j, z_j] (a_0 = 0, z_j = breaks[j], a_(j+1) = z_j + 1, z_nb = hi - 1) gives
// range nb - j = [max(0, p0 - o_(z_j)), p1 - o_(a_j)). Only run nb can be clipped (o_z > p0 and a break
// after z would put o_(z+1) past p1) or cut short by hi, so every other run's length tile + o_z - o_a, and
// its key tiles, do not depend on the tile: prefix sums per head (run_tiles) give the cost in O(log).
__global__ void __launch_bounds__(512) vs_runs_kernel(const LowerParams p) {
  using Scan = cub::BlockScan<int, 512>;
  __shared__ typename Scan::TempStorage scan;
  const int h = blockIdx.x, tid = threadIdx.x;
  const DeviceHeadPattern hp = p.heads[h];
  if (hp.kind != DeviceHeadPattern::kVerticalSlash || hp.run_base < 0) return;
  const int n = hp.num_offsets;
  const int32_t* o = hp.offsets;
  int32_t* breaks = p.run_breaks + hp.run_base;
  int32_t* tiles = p.run_tiles + hp.run_base;
  bool bad = false;
  int nb = 0;
  for (int base = 0; base < n; base += 512) {
    const int i = base + tid;
    bool flag = false;
    if (i < n) {
      const int64_t x = o[i];
      if (i == 0 && x < 0) bad = true;
      if (i + 1 < n) {
        const int64_t y = o[i + 1];
        if (y < x) bad = true;
        flag = y - x > p.tile;
      }
    }
    int pos = 0, total = 0;
    Scan(scan).ExclusiveSum(flag ? 1 : 0, pos, total);
    if (flag) breaks[nb + pos] = i;
    nb += total;
    __syncthreads();  // scan storage reuse
  }
  if (__syncthreads_or(bad)) {
    if (tid == 0) p.run_count[h] = -1;
    return;
  }
  // breaks[] written by this block is visible after the barrier above.
  int carry = 0;
  for (int base = 0; base < nb; base += 512) {
    const int j = base + tid;
    int t = 0;
    if (j < nb) {
      const int a = j == 0 ? 0 : breaks[j - 1] + 1, z = breaks[j];
      t = (p.tile + o[z] - o[a] + kPrefillKeyTile - 1) / kPrefillKeyTile;
    }
    int pos = 0, total = 0;
    Scan(scan).ExclusiveSum(t, pos, total);
    if (j < nb) tiles[j] = carry + pos;
    carry += total;
    __syncthreads();
  }
  if (tid == 0) {
    tiles[nb] = carry;
    p.run_count[h] = nb;
  }
}

// VS column coverage (LowerParams::cover), one thread per word, after vs_runs_kernel (only heads whose offsets
// it found ascending with offsets[0] >= 0). For ascending offsets, lower_tile's column test on a full tile
// (first offset >= p0 - c is below p1 - c) says whether some offset lies in [p0 - c, p1 - c) = [u - tile, u)
// with u = p1 - c, which is bit u here: j walks to the first offset >= u - tile, bit u is set iff it is < u.
__global__ void __launch_bounds__(256) vs_cover_kernel(const LowerParams p) {
  const int h = blockIdx.x;
  const int w = static_cast<int>(blockIdx.y * 256 + threadIdx.x);
  if (w >= p.cover_words) return;
  const DeviceHeadPattern& hp = p.heads[h];
  if (hp.kind != DeviceHeadPattern::kVerticalSlash || hp.run_base < 0 || p.run_count[h] < 0) return;
  const int32_t* o = hp.offsets;
  const int n = hp.num_offsets;
  const int64_t u0 = int64_t{w} * 32;
  int j = detail::lower_bound_index(o, 0, n, u0 - p.tile);
  uint32_t word = 0;
  int64_t oj = j < n ? o[j] : INT64_MAX;
  for (int b = 0; b < 32; ++b) {
    const int64_t u = u0 + b;
    while (oj < u - p.tile) {
      ++j;
      oj = j < n ? o[j] : INT64_MAX;
    }
    if (oj < u) word |= 1u << b;
  }
  p.cover[int64_t{h} * p.cover_words + w] = word;
}

// lower_bound_index by the whole warp for an ascending array (every lane gets the result): 32 probes per round
// (the first index of each of 32 equal segments; the lanes whose probe is < x are a prefix, the answer lies after
// the last of them and at most at the next probe), then one probe per lane over the last <= 32 entries. About
// log32(n) dependent loads instead of log2(n).
__device__ int warp_lower_bound(const int32_t* a, int lo, int hi, int64_t x) {
  const int lane = threadIdx.x % 32;
  while (hi - lo > 32) {
    const int step = (hi - lo + 31) / 32;
    const int i = lo + lane * step;
    const int k = __popc(__ballot_sync(0xffffffffu, i < hi && a[i] < x));
    if (k == 0) return lo;
    const int z = lo + k * step;
    lo += (k - 1) * step + 1;
    hi = z < hi ? z : hi;
  }
  const int i = lo + lane;
  return lo + __popc(__ballot_sync(0xffffffffu, i < hi && a[i] < x));
}

// The VS ranges of a full tile by runs (above) into out_ranges (when not null; at most range_room), with
// counts.ranges and the ranges' key tiles in counts.cost; false (nothing done) when the runs do not apply.
__device__ bool lower_vs_ranges_by_runs(const LowerParams& p, int h, const DeviceHeadPattern& hp,
                                        const TileGeometry& g, KeyRange* out_ranges, int64_t range_room,
                                        TileCounts& counts) {
  if (!p.use_runs || hp.run_base < 0 || g.p1 - g.p0 != p.tile || g.key_end != g.p1) return false;
  const int nbr = p.run_count[h];
  if (nbr < 0) return false;
  const int lane = threadIdx.x % 32;
  const int32_t* o = hp.offsets;
  const int32_t* breaks = p.run_breaks + hp.run_base;
  const int64_t p0 = g.p0, p1 = g.p1;
  const int hi = warp_lower_bound(o, 0, hp.num_offsets, p1);  // offsets ascending (nbr >= 0)
  counts.ranges = 0;
  counts.cost = 0;
  if (hi == 0) return true;
  const int nb = warp_lower_bound(breaks, 0, nbr, hi - 1);  // breaks below hi - 1
  const int a_top = nb == 0 ? 0 : breaks[nb - 1] + 1;
  const int64_t b_top = p0 - o[hi - 1] < 0 ? 0 : p0 - o[hi - 1], e_top = p1 - o[a_top];
  counts.ranges = nb + 1;
  counts.cost = p.run_tiles[hp.run_base + nb] +
                static_cast<int32_t>((e_top - b_top + kPrefillKeyTile - 1) / kPrefillKeyTile);
  if (out_ranges != nullptr) {
    if (lane == 0 && range_room > 0) {
      out_ranges[0].begin = static_cast<int32_t>(b_top);
      out_ranges[0].end = static_cast<int32_t>(e_top);
    }
    for (int j = lane; j < nb; j += 32) {
      const int a = j == 0 ? 0 : breaks[j - 1] + 1, z = breaks[j];
      if (nb - j < range_room) {
        out_ranges[nb - j].begin = static_cast<int32_t>(p0 - o[z]);
        out_ranges[nb - j].end = static_cast<int32_t>(p1 - o[a]);
      }
    }
  }
  return true;
}

// Block-sparse tile by the whole warp. lower_tile emits, in ascending order, the union of the key blocks kb
// listed by the query blocks the tile touches (those in [bs_first_q_block, + bs_num_q_blocks)), as [kb * blk,
// (kb + 1) * blk) clipped to [0, key_end) and merged when touching: so its ranges are the maximal runs of
// consecutive blocks of that union among the nkb = ceil(key_end / blk) blocks that meet [0, key_end), run
// [a, z] giving [a * blk, min((z + 1) * blk, key_end)) (negative blocks and blocks >= nkb give nothing). Here the
// union is a bitmap in shared memory (atomicOr from every listed entry, all lanes), per window of
// kBsWindowWords * 32 blocks plus one word of look-ahead (the window's last run may go on); then one word per
// lane: run starts are set bits whose lower neighbour is clear, run ends set bits whose upper neighbour is
// clear; a warp sum of the starts gives each start's range index, a warp max the start of the run an end
// closes when it began in an earlier word. Writes range r only when r < range_room; returns the number of
// ranges and their key tiles (kPrefillKeyTile, as RangeEmitter counts them) on every lane.
__device__ void lower_bs_tile_warp(const DeviceHeadPattern& hp, const TileGeometry& g, KeyRange* out_ranges,
                                   int64_t range_room, int32_t& num_ranges, int32_t& num_key_tiles) {
  __shared__ uint32_t bs_bits[kWarpKernelThreads / 32][kBsWindowWords + 1];
  const int lane = threadIdx.x % 32;
  uint32_t* bits = bs_bits[threadIdx.x / 32];
  const int64_t blk = hp.bs_block, key_end = g.key_end;
  const int64_t qb_first = g.p0 / blk, qb_last = (g.p1 - 1) / blk;
  // Query blocks of the tile inside the head's range: entries e_lo .. e_hi, whose lists are contiguous in the
  // CSR arrays.
  const int64_t e_lo = qb_first - hp.bs_first_q_block < 0 ? 0 : qb_first - hp.bs_first_q_block;
  const int64_t e_hi = qb_last - hp.bs_first_q_block < hp.bs_num_q_blocks ? qb_last - hp.bs_first_q_block
                                                                           : int64_t{hp.bs_num_q_blocks} - 1;
  const int64_t nkb = (key_end + blk - 1) / blk;
  int32_t starts = 0;      // ranges opened so far (all lanes)
  int32_t key_tiles = 0;   // of the ranges this lane closed
  int64_t last_start = -1;  // block where the last run opened so far began (all lanes)
  if (e_lo <= e_hi && nkb > 0) {
    const int i_begin = hp.bs_offsets[e_lo], i_end = hp.bs_offsets[e_hi + 1];
    uint32_t carry = 0;  // is the block before the window set
    for (int64_t wb = 0; wb < nkb; wb += int64_t{kBsWindowWords} * 32) {
      const int64_t wspan = nkb - wb < int64_t{kBsWindowWords} * 32 ? nkb - wb : int64_t{kBsWindowWords} * 32;
      const int nwords = static_cast<int>((wspan + 31) / 32);
      // Blocks [wb, fill_end) go into the bitmap: the window and its look-ahead word, below nkb.
      const int64_t fill_end = nkb - wb < wspan + 32 ? nkb : wb + wspan + 32;
      for (int k = lane; k <= nwords; k += 32) bits[k] = 0;
      __syncwarp();
      for (int i = i_begin + lane; i < i_end; i += 32 * 4) {  // 4 independent loads per lane, then the ORs
        int64_t kb[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) kb[k] = i + 32 * k < i_end ? hp.bs_key_blocks[i + 32 * k] : -1;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (kb[k] >= wb && kb[k] < fill_end) {
            const int64_t r = kb[k] - wb;
            atomicOr(&bits[r >> 5], 1u << (r & 31));
          }
        }
      }
      __syncwarp();
      for (int base = 0; base < nwords; base += 32) {
        const int w = base + lane;
        uint32_t x = 0, prev = 0, next = 0;
        if (w < nwords) {
          x = bits[w];
          prev = w == 0 ? carry : bits[w - 1] >> 31;
          next = bits[w + 1] & 1u;  // w + 1 <= nwords: zeroed, the look-ahead word at most
        }
        const uint32_t st = x & ~((x << 1) | prev);
        const uint32_t en = x & ~((x >> 1) | (next << 31));
        const int ns = __popc(st);
        const int ls = st != 0 ? w * 32 + 31 - __clz(st) : -1;  // this word's last start, window-relative
        int incl = ns, mx = ls;  // inclusive warp scans: sum of starts, max of last starts
        for (int d = 1; d < 32; d *= 2) {
          const int v = __shfl_up_sync(0xffffffffu, incl, d);
          const int m = __shfl_up_sync(0xffffffffu, mx, d);
          if (lane >= d) {
            incl += v;
            mx = m > mx ? m : mx;
          }
        }
        const int before = starts + incl - ns;  // ranges opened before this word
        const int mx_prev = __shfl_up_sync(0xffffffffu, mx, 1);
        const int64_t open_before = lane > 0 && mx_prev >= 0 ? wb + mx_prev : last_start;
        const int64_t wblock = wb + int64_t{w} * 32;
        if (out_ranges != nullptr) {
          int r = before;
          for (uint32_t s = st; s != 0; s &= s - 1u, ++r)
            if (r < range_room) out_ranges[r].begin = static_cast<int32_t>((wblock + __ffs(s) - 1) * blk);
        }
        for (uint32_t e = en; e != 0; e &= e - 1u) {
          const int b = __ffs(e) - 1;
          const uint32_t s_upto = st & ((2u << b) - 1u);  // starts at or below b (2u << 31 is 0)
          const int64_t a = s_upto != 0 ? wblock + 31 - __clz(s_upto) : open_before;
          const int r = before + __popc(s_upto) - 1;
          const int64_t rb = a * blk, re = (wblock + b + 1) * blk < key_end ? (wblock + b + 1) * blk : key_end;
          key_tiles += static_cast<int32_t>((re - rb + kPrefillKeyTile - 1) / kPrefillKeyTile);
          if (out_ranges != nullptr && r < range_room) out_ranges[r].end = static_cast<int32_t>(re);
        }
        starts += __shfl_sync(0xffffffffu, incl, 31);
        const int mx_all = __shfl_sync(0xffffffffu, mx, 31);
        if (mx_all >= 0) last_start = wb + mx_all;
      }
      carry = nwords == kBsWindowWords ? bits[kBsWindowWords - 1] >> 31 : 0u;
      __syncwarp();  // the next window's zeroing after every lane's reads
    }
  }
  for (int o = 16; o > 0; o /= 2) key_tiles += __shfl_xor_sync(0xffffffffu, key_tiles, o);
  num_ranges = starts;
  num_key_tiles = key_tiles;
}

// A warp per item (DeviceIndexBuilder::set_warp_per_tile). Vertical-slash tiles are lowered by the whole
// warp, 32 slash intervals (then 32 columns) at a time; block-sparse tiles by lower_bs_tile_warp; other kinds
// by lane 0 with lower_tile. Same output as lower_tile: the intervals of the walk (offsets descending) have
// non-decreasing clipped begins and ends, so the running end of the open range is the end of the previous
// non-empty interval, and interval k opens a new range iff its begin is past that end.
__device__ TileCounts lower_tile_warp(const LowerParams& p, int h, const DeviceHeadPattern& hp,
                                      const TileGeometry& g, KeyRange* out_ranges, int32_t* out_columns,
                                      int64_t range_room, int64_t column_room) {
  const int lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1u;
  if (hp.kind == DeviceHeadPattern::kBlockSparse) {
    TileCounts n;
    int32_t key_tiles = 0;
    lower_bs_tile_warp(hp, g, out_ranges, range_room, n.ranges, key_tiles);
    n.columns = 0;
    n.cost = 1 + key_tiles;
    return n;
  }
  if (hp.kind != DeviceHeadPattern::kVerticalSlash) {
    TileCounts n;
    if (lane == 0) n = lower_tile(hp, g, out_ranges, out_columns);
    n.ranges = __shfl_sync(0xffffffffu, n.ranges, 0);
    n.columns = __shfl_sync(0xffffffffu, n.columns, 0);
    n.cost = __shfl_sync(0xffffffffu, n.cost, 0);
    return n;
  }
  const int64_t p0 = g.p0, p1 = g.p1, key_end = g.key_end;
  int32_t starts = 0;     // ranges opened so far
  int32_t key_tiles = 0;  // of the ranges
  TileCounts by_runs;
  if (lower_vs_ranges_by_runs(p, h, hp, g, out_ranges, range_room, by_runs)) {
    starts = by_runs.ranges;
    key_tiles = by_runs.cost;
  } else {  // the walk, 32 intervals at a time
    const int hi = detail::lower_bound_index(hp.offsets, 0, hp.num_offsets, p1);  // walk i = hi - 1 .. 0
    int64_t cb = 0, ce = 0;  // the open range (when starts > 0)
    for (int base = 0; base < hi; base += 32) {
      const int k = base + lane;
      int64_t b = 0, e = 0;
      if (k < hi) {
        const int64_t o = hp.offsets[hi - 1 - k];
        b = p0 - o < 0 ? 0 : p0 - o;
        e = p1 - o < key_end ? p1 - o : key_end;
      }
      const bool valid = k < hi && b < e;
      const unsigned vmask = __ballot_sync(0xffffffffu, valid);
      const unsigned vprev = vmask & below;
      const int pv = vprev ? 31 - __clz(vprev) : lane;
      const int64_t e_lane = __shfl_sync(0xffffffffu, e, pv);
      const bool has_prev = vprev != 0 || starts > 0;
      const int64_t e_prev = vprev != 0 ? e_lane : ce;
      const bool start = valid && (!has_prev || b > e_prev);
      const unsigned smask = __ballot_sync(0xffffffffu, start);
      const unsigned sprev = smask & below;
      const int ps = sprev ? 31 - __clz(sprev) : lane;
      const int64_t b_lane = __shfl_sync(0xffffffffu, b, ps);
      const int64_t cb_prev = sprev != 0 ? b_lane : cb;
      const int32_t idx = starts + __popc(sprev);  // this start's range
      if (start) {
        if (has_prev) {  // closes range idx - 1 = [cb_prev, e_prev)
          if (out_ranges != nullptr && idx - 1 < range_room)
            out_ranges[idx - 1].end = static_cast<int32_t>(e_prev);
          key_tiles += static_cast<int32_t>((e_prev - cb_prev + kPrefillKeyTile - 1) / kPrefillKeyTile);
        }
        if (out_ranges != nullptr && idx < range_room) out_ranges[idx].begin = static_cast<int32_t>(b);
      }
      if (vmask != 0) ce = __shfl_sync(0xffffffffu, e, 31 - __clz(vmask));
      if (smask != 0) cb = __shfl_sync(0xffffffffu, b, 31 - __clz(smask));
      starts += __popc(smask);
    }
    for (int o = 16; o > 0; o /= 2) key_tiles += __shfl_xor_sync(0xffffffffu, key_tiles, o);
    if (starts > 0) {  // close the last range
      if (out_ranges != nullptr && lane == 0 && starts - 1 < range_room)
        out_ranges[starts - 1].end = static_cast<int32_t>(ce);
      key_tiles += static_cast<int32_t>((ce - cb + kPrefillKeyTile - 1) / kPrefillKeyTile);
    }
  }

  // Columns: c is kept iff 0 <= c < key_end, no offset o has p0 - c <= o < p1 - c, and c differs from the
  // previous column (duplicates). Columns are ascending, so those below key_end are the first jn (lower_tile
  // stops at the first c >= key_end). On a full tile whose head has the coverage bitmap (vs_cover_kernel) the
  // offset test is bit p1 - c; otherwise the binary search of lower_tile. kColumnBatches batches of 32 columns
  // per step for independent loads.
  const int jn = warp_lower_bound(hp.columns, 0, hp.num_columns, key_end);
  const bool by_cover = p.use_runs && p.cover != nullptr && hp.run_base >= 0 && p1 - p0 == p.tile &&
                        p.run_count[h] >= 0;
  const uint32_t* cover = by_cover ? p.cover + int64_t{h} * p.cover_words : nullptr;
  constexpr int kColumnBatches = 4;
  int32_t nc = 0;
  for (int base = 0; base < jn; base += 32 * kColumnBatches) {
    bool keep[kColumnBatches];
    int32_t cv[kColumnBatches];
#pragma unroll
    for (int k = 0; k < kColumnBatches; ++k) {
      const int j = base + 32 * k + lane;
      keep[k] = false;
      cv[k] = -1;
      if (j < jn) {
        const int64_t c = hp.columns[j];
        cv[k] = static_cast<int32_t>(c);
        keep[k] = c >= 0 && (j == 0 || hp.columns[j - 1] != c);
        if (keep[k]) {
          if (cover != nullptr) {
            const int64_t u = p1 - c;  // 1 <= u <= p1
            keep[k] = ((cover[u >> 5] >> (u & 31)) & 1u) == 0;
          } else {
            const int i = detail::lower_bound_index(hp.offsets, 0, hp.num_offsets, p0 - c);
            if (i < hp.num_offsets && hp.offsets[i] < p1 - c) keep[k] = false;
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kColumnBatches; ++k) {
      const unsigned kmask = __ballot_sync(0xffffffffu, keep[k]);
      const int32_t at = nc + __popc(kmask & below);
      if (keep[k] && out_columns != nullptr && at < column_room) out_columns[at] = cv[k];
      nc += __popc(kmask);
    }
  }
  TileCounts counts;
  counts.ranges = starts;
  counts.columns = nc;
  counts.cost = 1 + key_tiles + (nc + kPrefillKeyTile - 1) / kPrefillKeyTile;
  return counts;
}

__global__ void lower_count_warp_kernel(const LowerParams p) {
  const int item = static_cast<int>((blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32;
  if (item > p.num_items) return;  // whole warps: blockDim is a multiple of 32
  if (item == p.num_items) {
    if (lane == 0) {
      p.range_counts[item] = 0;
      p.column_counts[item] = 0;
    }
    return;
  }
  const int h = item / p.num_tiles, t = item - h * p.num_tiles;
  if (!selected(p, h)) return;  // uniform over the warp
  const TileCounts n =
      lower_tile_warp(p, h, p.heads[h], tile_geometry(t, p.tile, p.q_begin, p.q_len, p.kv_len, p.n_total),
                      nullptr, nullptr, 0, 0);
  if (lane == 0) {
    p.range_counts[item] = n.ranges;
    p.column_counts[item] = n.columns;
    p.costs[item] = n.cost;
    p.items[item] = item;
  }
}

__global__ void lower_fill_warp_kernel(const LowerParams p) {
  const int item = static_cast<int>((blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32);
  if (item >= p.num_items) return;
  const int h = item / p.num_tiles, t = item - h * p.num_tiles;
  if (!selected(p, h)) return;  // uniform over the warp
  // Writes stay inside the allocations even if the counts were wrong (an index test then fails, nothing
  // else).
  lower_tile_warp(p, h, p.heads[h], tile_geometry(t, p.tile, p.q_begin, p.q_len, p.kv_len, p.n_total),
                  p.ranges + p.range_offsets[item], p.columns + p.column_offsets[item],
                  p.range_capacity - p.range_offsets[item], p.column_capacity - p.column_offsets[item]);
}

}  // namespace

const char* index_build_mode_name(IndexBuildMode m) {
  switch (m) {
    case IndexBuildMode::kPerKind:
      return "per kind (warp for VS and BS, thread for others)";
    case IndexBuildMode::kWarp:
      return "warp per tile";
    case IndexBuildMode::kThread:
      return "thread per tile";
  }
  return "?";
}

DeviceHeadPattern describe_head(const Pattern& pattern, const LoweringContext& ctx) {
  DeviceHeadPattern d;
  if (const auto* a = std::get_if<AShapePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kStreaming;
    d.sink = a->sink;
    d.local = a->local;
  } else if (const auto* e = std::get_if<ElasticWindowPattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kStreaming;
    d.sink = e->sink;
    d.local = static_cast<int32_t>(std::max<int64_t>(1, e->span(ctx.n())));
  } else if (const auto* tri = std::get_if<TrianglePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kTriangle;
    d.sink = tri->sink;
    d.local = tri->local;
    d.last = tri->last;
  } else if (std::holds_alternative<VerticalSlashPattern>(pattern)) {
    d.kind = DeviceHeadPattern::kVerticalSlash;
  } else if (const auto* bs = std::get_if<BlockSparsePattern>(&pattern)) {
    d.kind = DeviceHeadPattern::kBlockSparse;
    d.bs_block = bs->block;
  }
  return d;
}

// total[0] += sum of the item costs (zeroed before the launch): a grid-stride loop, a warp then a block sum,
// one atomic per block (integers: the order of the additions does not matter).
constexpr int kSumThreads = 256, kSumItemsPerThread = 4;
__global__ void __launch_bounds__(kSumThreads) sum_costs_kernel(const int32_t* costs, int n,
                                                                unsigned long long* total) {
  __shared__ unsigned long long warp_sums[kSumThreads / 32];
  unsigned long long local = 0;
  for (int i = static_cast<int>(blockIdx.x * kSumThreads + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * kSumThreads))
    local += static_cast<unsigned long long>(costs[i]);
  for (int o = 16; o > 0; o /= 2) local += __shfl_xor_sync(0xffffffffu, local, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long block = 0;
    for (int w = 0; w < kSumThreads / 32; ++w) block += warp_sums[w];
    if (block != 0) atomicAdd(total, block);
  }
}

// Split-K (split_plan.h): the items that units replace leave the sort with cost 0 and entry -1 (their full
// costs were summed already); the units' own entries sit after the items' in the sort's input.
__global__ void split_fixup_kernel(const int4* units, int num_units, int32_t* costs, int32_t* items) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= num_units) return;
  costs[units[u].x] = 0;
  items[units[u].x] = -1;
}

DeviceIndexBuilder::DeviceIndexBuilder(const std::vector<Pattern>& patterns, const LoweringContext& ctx,
                                       const DeviceEstimates& estimates)
    : ctx_(ctx), num_heads_(static_cast<int32_t>(patterns.size())) {
  check(ctx.tile > 0 && ctx.q_begin >= 0 && ctx.q_len >= 0 && ctx.kv_len >= ctx.q_begin + ctx.q_len,
        "CUDA lowering: inconsistent context (tile " + std::to_string(ctx.tile) + ", q_begin " +
            std::to_string(ctx.q_begin) + ", q_len " + std::to_string(ctx.q_len) + ", kv_len " +
            std::to_string(ctx.kv_len) + ")");
  num_tiles_ = (ctx.q_len + ctx.tile - 1) / ctx.tile;
  std::vector<DeviceHeadPattern> heads(patterns.size());
  for (size_t h = 0; h < patterns.size(); ++h) {
    DeviceHeadPattern& d = heads[h];
    d = describe_head(patterns[h], ctx);
    if (d.kind == DeviceHeadPattern::kVerticalSlash) {
      const int slot = estimates.vs_slot(static_cast<int>(h));
      check(slot >= 0,
            "CUDA lowering: head " + std::to_string(h) + " runs vertical_slash but has no VS estimate");
      const VsHeadDesc& v = estimates.vs_heads()[static_cast<size_t>(slot)];
      d.columns = estimates.vs_columns() + v.column_base;
      d.num_columns = v.num_columns;
      d.offsets = estimates.vs_offsets() + v.offset_base;
      d.num_offsets = v.num_offsets;
    } else if (d.kind == DeviceHeadPattern::kBlockSparse) {
      const int slot = estimates.bs_slot(static_cast<int>(h));
      check(slot >= 0,
            "CUDA lowering: head " + std::to_string(h) + " runs block_sparse but has no BS estimate");
      const BsHeadDesc& b = estimates.bs_heads()[static_cast<size_t>(slot)];
      d.bs_offsets = estimates.bs_offsets() + b.offsets_base;
      d.bs_key_blocks = estimates.bs_key_blocks() + b.key_base;
      d.bs_first_q_block = b.first_q_block;
      d.bs_num_q_blocks = b.num_q_blocks;
    }
  }

  // Upper bounds of what a tile can hold (see the invariants in sparse_index.h): merged VS ranges are
  // disjoint, non-touching and, but for one clipped at 0, at least `rows` long.
  for (const DeviceHeadPattern& d : heads) {
    for (int32_t t = 0; t < num_tiles_; ++t) {
      const int64_t p0 = int64_t{ctx.q_begin} + int64_t{t} * ctx.tile;
      const int64_t rows = std::min<int64_t>(ctx.tile, ctx.q_len - int64_t{t} * ctx.tile);
      const int64_t p1 = p0 + rows;
      const int64_t key_end = std::min<int64_t>(ctx.kv_len, p1);
      switch (d.kind) {
        case DeviceHeadPattern::kDense:
          range_capacity_ += 1;
          break;
        case DeviceHeadPattern::kStreaming:
        case DeviceHeadPattern::kTriangle:
          range_capacity_ += 2;
          break;
        case DeviceHeadPattern::kVerticalSlash:
          range_capacity_ += std::min<int64_t>(d.num_offsets, key_end / (rows + 1) + 1);
          column_capacity_ += std::min<int64_t>(d.num_columns, key_end);
          break;
        case DeviceHeadPattern::kBlockSparse: {
          const int64_t nq = (p1 - 1) / d.bs_block - p0 / d.bs_block + 1;
          const auto& bs = std::get<BlockSparsePattern>(patterns[static_cast<size_t>(&d - heads.data())]);
          range_capacity_ += std::min<int64_t>(nq * bs.top_k, (key_end + d.bs_block - 1) / d.bs_block);
          break;
        }
        default:
          break;
      }
    }
  }
  check(range_capacity_ < INT32_MAX && column_capacity_ < INT32_MAX,
        "CUDA lowering: the index of this layer could exceed 2^31 entries");
  int64_t run_entries = 0;  // VS runs (vs_runs_kernel): num_offsets + 1 entries per VS head
  for (DeviceHeadPattern& d : heads) {
    if (d.kind == DeviceHeadPattern::kVerticalSlash) {
      has_vs_ = true;
      d.run_base = static_cast<int32_t>(run_entries);
      run_entries += int64_t{d.num_offsets} + 1;
    } else if (d.kind == DeviceHeadPattern::kBlockSparse) {
      has_bs_ = true;
    } else {
      has_other_ = true;
    }
  }
  check(run_entries < INT32_MAX, "CUDA lowering: too many VS offsets in this layer");
  heads_.upload(heads);
  run_breaks_.resize(static_cast<size_t>(std::max<int64_t>(run_entries, 1)));
  run_tiles_.resize(static_cast<size_t>(std::max<int64_t>(run_entries, 1)));
  run_count_.resize(static_cast<size_t>(std::max(num_heads_, 1)));
  // VS column coverage (vs_cover_kernel): bits 0 .. q_begin + q_len (u = p1 - c <= p1) per head.
  cover_words_ = static_cast<int32_t>((int64_t{ctx.q_begin} + ctx.q_len) / 32 + 1);
  if (has_vs_) cover_.resize(static_cast<size_t>(num_heads_) * static_cast<size_t>(cover_words_));

  const int n_items = num_heads_ * num_tiles_;
  // Split-K (split_plan.h) over the static heads, whose item costs the host knows (lower_tile, as the device
  // computes them); estimated heads count as 0 and are never cut.
  {
    std::vector<int32_t> costs(static_cast<size_t>(n_items), 0);
    std::vector<uint8_t> splittable(static_cast<size_t>(n_items), 0);
    bool any = false;
    for (int32_t h = 0; h < num_heads_; ++h) {
      const DeviceHeadPattern& d = heads[static_cast<size_t>(h)];
      if (d.kind != DeviceHeadPattern::kDense && d.kind != DeviceHeadPattern::kStreaming &&
          d.kind != DeviceHeadPattern::kTriangle) {
        continue;
      }
      any = true;
      for (int32_t t = 0; t < num_tiles_; ++t) {
        const size_t item = static_cast<size_t>(h) * static_cast<size_t>(num_tiles_) + static_cast<size_t>(t);
        costs[item] =
            lower_tile(d, tile_geometry(t, ctx.tile, ctx.q_begin, ctx.q_len, ctx.kv_len, ctx.n()), nullptr, nullptr)
                .cost;
        splittable[item] = 1;
      }
    }
    if (any) split_units_ = plan_splits(costs, current_device_info().num_sms, splittable);
  }
  const int n_sort = n_items + static_cast<int>(split_units_.size());
  range_counts_.resize(static_cast<size_t>(n_items) + 1);
  column_counts_.resize(static_cast<size_t>(n_items) + 1);
  costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  sorted_costs_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  items_.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  if (!split_units_.empty()) {  // the units' sort entries (the count pass writes the items' each build)
    std::vector<int32_t> unit_costs, unit_items;
    for (size_t u = 0; u < split_units_.size(); ++u) {
      unit_costs.push_back(split_unit_cost(split_units_[u]));
      unit_items.push_back(n_items + static_cast<int32_t>(u));
    }
    TESSERA_CUDA_CHECK(cudaMemcpy(costs_.data() + n_items, unit_costs.data(), unit_costs.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
    TESSERA_CUDA_CHECK(cudaMemcpy(items_.data() + n_items, unit_items.data(), unit_items.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
  }
  size_t scan_bytes = 0, sort_bytes = 0;
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, range_counts_.data(),
                                                   range_counts_.data(), n_items + 1));
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(),
                                                               items_.data(), std::max(n_sort, 1)));
  scan_temp_.resize(std::max<size_t>(scan_bytes, 1));
  sort_temp_.resize(std::max<size_t>(sort_bytes, 1));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // heads_ was uploaded from a local vector
}

void DeviceIndexBuilder::build(DeviceSparseIndex& index, DeviceWorkPlan& plan, cudaStream_t stream) {
  const int n_items = num_heads_ * num_tiles_;
  index.num_heads = num_heads_;
  index.tile = ctx_.tile;
  index.q_begin = ctx_.q_begin;
  index.q_len = ctx_.q_len;
  index.kv_len = ctx_.kv_len;
  index.range_offsets.resize(static_cast<size_t>(n_items) + 1);
  index.column_offsets.resize(static_cast<size_t>(n_items) + 1);
  index.ranges.resize(static_cast<size_t>(std::max<int64_t>(range_capacity_, 1)));
  index.columns.resize(static_cast<size_t>(std::max<int64_t>(column_capacity_, 1)));
  const bool split = split_ && !split_units_.empty();
  const int n_sort = n_items + (split ? static_cast<int>(split_units_.size()) : 0);
  plan.num_items = n_items;
  plan.order.resize(std::max<size_t>(1, static_cast<size_t>(n_sort)));
  plan.counter.resize(1);
  if (!split) {
    plan.num_units = 0;
    plan.num_merges = 0;
  } else if (plan.num_units != static_cast<int32_t>(split_units_.size()) || plan.units.size() < split_units_.size()) {
    plan.set_units(split_units_, stream);  // once per plan object (synchronises stream)
  }

  LowerParams p;
  p.heads = heads_.data();
  p.num_tiles = num_tiles_;
  p.tile = ctx_.tile;
  p.q_begin = ctx_.q_begin;
  p.q_len = ctx_.q_len;
  p.kv_len = ctx_.kv_len;
  p.num_items = n_items;
  p.n_total = ctx_.n();
  p.range_counts = range_counts_.data();
  p.column_counts = column_counts_.data();
  p.costs = costs_.data();
  p.items = items_.data();
  p.range_offsets = index.range_offsets.data();
  p.ranges = index.ranges.data();
  p.column_offsets = index.column_offsets.data();
  p.columns = index.columns.data();
  p.range_capacity = static_cast<int64_t>(index.ranges.size());
  p.column_capacity = static_cast<int64_t>(index.columns.size());

  constexpr int kThreads = 128;
  constexpr int kWarpItemsPerBlock = kWarpKernelThreads / 32;
  // Which kernel lowers which heads: (warp kernel's selection or -1, thread kernel's selection or -1).
  int32_t warp_sel = -1, thread_sel = -1;
  switch (mode_) {
    case IndexBuildMode::kWarp:
      warp_sel = kSelectAll;
      break;
    case IndexBuildMode::kThread:
      thread_sel = kSelectAll;
      break;
    case IndexBuildMode::kPerKind:
      if ((has_vs_ || has_bs_) && has_other_) {
        warp_sel = kSelectWarpKinds;
        thread_sel = kSelectOthers;
      } else if (has_vs_ || has_bs_) {
        warp_sel = kSelectAll;
      } else {
        thread_sel = kSelectAll;
      }
      break;
  }
  // VS heads lowered by the warp kernel: their runs first (one block per head; others return at once), then
  // the column coverage (a thread per word; heads without runs return at once).
  if (warp_sel >= 0 && has_vs_ && num_tiles_ > 0) {
    p.use_runs = 1;
    p.run_breaks = run_breaks_.data();
    p.run_tiles = run_tiles_.data();
    p.run_count = run_count_.data();
    vs_runs_kernel<<<num_heads_, 512, 0, stream>>>(p);
    check_launch("vs_runs_kernel");
    p.cover = cover_.data();
    p.cover_words = cover_words_;
    const dim3 cover_grid(static_cast<unsigned>(num_heads_), static_cast<unsigned>((cover_words_ + 255) / 256));
    vs_cover_kernel<<<cover_grid, 256, 0, stream>>>(p);
    check_launch("vs_cover_kernel");
  }
  // Both kernels write the extra (num_items-th) zero count, with the same values.
  if (warp_sel >= 0) {
    p.select = warp_sel;
    lower_count_warp_kernel<<<(n_items + 1 + kWarpItemsPerBlock - 1) / kWarpItemsPerBlock, kWarpKernelThreads,
                              0, stream>>>(p);
    check_launch("lower_count_warp_kernel");
  }
  if (thread_sel >= 0) {
    p.select = thread_sel;
    lower_count_kernel<<<(n_items + 1 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
    check_launch("lower_count_kernel");
  }
  size_t bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, range_counts_.data(),
                                                   index.range_offsets.data(), n_items + 1, stream));
  bytes = scan_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp_.data(), bytes, column_counts_.data(),
                                                   index.column_offsets.data(), n_items + 1, stream));
  if (n_items == 0) return;
  if (warp_sel >= 0) {
    p.select = warp_sel;
    lower_fill_warp_kernel<<<(n_items + kWarpItemsPerBlock - 1) / kWarpItemsPerBlock, kWarpKernelThreads, 0,
                             stream>>>(p);
    check_launch("lower_fill_warp_kernel");
  }
  if (thread_sel >= 0) {
    p.select = thread_sel;
    lower_fill_kernel<<<(n_items + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
    check_launch("lower_fill_kernel");
  }
  // The items' full costs are summed before the split fixup zeroes the cut items' entries.
  total_cost_.resize(1);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(total_cost_.data(), 0, sizeof(unsigned long long), stream));
  constexpr int kSumItemsPerBlock = kSumThreads * kSumItemsPerThread;
  const int sum_blocks = std::min((n_items + kSumItemsPerBlock - 1) / kSumItemsPerBlock, 1024);
  sum_costs_kernel<<<sum_blocks, kSumThreads, 0, stream>>>(costs_.data(), n_items, total_cost_.data());
  check_launch("sum_costs_kernel");
  if (split) {
    split_fixup_kernel<<<(plan.num_units + 127) / 128, 128, 0, stream>>>(plan.units.data(), plan.num_units,
                                                                         costs_.data(), items_.data());
    check_launch("split_fixup_kernel");
  }
  bytes = sort_temp_.size();
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(sort_temp_.data(), bytes, costs_.data(),
                                                               sorted_costs_.data(), items_.data(),
                                                               plan.order.data(), n_sort, 0, 32, stream));
}

int64_t DeviceIndexBuilder::download_total_cost(cudaStream_t stream) const {
  if (num_heads_ * num_tiles_ == 0 || total_cost_.size() == 0) return 0;
  unsigned long long total = 0;
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(&total, total_cost_.data(), sizeof total, cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<int64_t>(total);
}

}  // namespace tessera::attn::gpu
