// tessera/attention/cuda/lower_kernels.cuh — the device index build's kernels and their parameters (device
// code of lower_cuda.cu, which launches them; contract: lower_cuda.h).
//
// Only lower_cuda.cu includes this (the kernels keep internal linkage, as when they lived there) and the
// host emulation of tests/emulation, which compiles the same code with the host compiler and runs every CUDA
// lane as a fiber (lower_runs.cpp, lower_bs.cpp).
#pragma once

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "attention/cuda/lower_tile.h"

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

}  // namespace tessera::attn::gpu
