// Host emulation of the device index build's block-sparse path (lower_cuda.cu: lower_bs_tile_warp inside
// lower_count_warp_kernel / lower_fill_warp_kernel) against lower_tile, for layers of block-sparse heads mixed
// with dense / streaming / triangle heads, built as IndexBuildMode::kPerKind does (warp kernels on the warp
// kinds, thread kernels on the others) or as kWarp does (warp kernels on every head). Random heads: block
// sizes 1..256 (powers of two and others), tiles 64 / 128, q_begin > 0, partial last tiles, per query block
// sorted key-block lists (the diagonal block, a local window, random blocks, sometimes blocks past the
// diagonal or the keys, duplicates, negative blocks, empty lists, lists padded with an adaptive head's unused
// entries), query blocks outside the head's range, and
// small blocks with long contexts (several bitmap windows, runs across a window's edge).
#include <cstdio>
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/lower_kernels.cuh"

using namespace tessera::attn;
using namespace tessera::attn::gpu;

static long g_tiles = 0, g_bs_tiles = 0, g_multi_window_tiles = 0, g_ranges = 0, g_empty = 0, g_clipped = 0;

struct BsHead {
  std::vector<int32_t> offsets, key_blocks;
};

static void make_bs_head(std::mt19937& rng, int kv_len, int q_begin, int q_len, DeviceHeadPattern& d,
                         BsHead& b, bool& long_ctx) {
  static const int kBlocks[] = {64, 64, 64, 32, 128, 16, 256, 48, 100, 8, 1, 2};
  int blk = kBlocks[rng() % (sizeof kBlocks / sizeof kBlocks[0])];
  if (long_ctx) blk = 1 + int(rng() % 2);
  const int nqb_all = (q_begin + q_len + blk - 1) / blk;
  // The head's query-block range: usually the blocks of the call, sometimes shifted or cut.
  int first = q_begin / blk, num = (q_begin + q_len - 1) / blk - first + 1;
  if (rng() % 4 == 0) { first += int(rng() % 5) - 2; num -= int(rng() % 4); }
  if (first < 0) first = 0;
  if (num < 0) num = 0;
  const int nkb_all = (kv_len + blk - 1) / blk;
  const int style = int(rng() % 8);
  const int top_k = long_ctx ? 1 + int(rng() % 40) : 1 + int(rng() % 120);
  b.offsets.assign(1, 0);
  for (int e = 0; e < num; ++e) {
    const int qb = first + e;
    std::vector<int32_t> l;
    if (style != 7 || rng() % 3 != 0) {  // style 7: some lists empty
      l.push_back(qb);                   // the diagonal block
      const int local = int(rng() % 4);
      for (int i = 1; i <= local; ++i) l.push_back(qb - i);
      for (int i = 0; i < top_k; ++i) l.push_back(int(rng() % uint32_t(qb + 1)));
      if (style == 1) for (int i = 0; i < 4; ++i) l.push_back(qb + 1 + int(rng() % 8));  // past the diagonal
      if (style == 2) l.push_back(nkb_all + int(rng() % 50));                          // past the keys
      if (style == 3) { l.push_back(-1); l.push_back(-1 - int(rng() % 9)); }           // negative
      if (style == 4) {  // long runs of consecutive blocks
        const int a = int(rng() % uint32_t(qb + 1));
        for (int i = a; i <= qb && i < a + 300; ++i) l.push_back(i);
      }
      if (long_ctx) {  // runs around the bitmap's window edges (8192 blocks per window)
        for (int w = 8192; w <= qb + 1; w += 8192) {
          const int a = w - int(rng() % 70), z = w + int(rng() % 70) - 35;
          for (int i = a; i < z && i <= qb; ++i) l.push_back(i);
          if (rng() % 2) l.push_back(w - 1);
          if (rng() % 2) l.push_back(w);
          if (rng() % 2) l.push_back(w + 31);
          if (rng() % 2) l.push_back(w + 32);
        }
      }
      std::sort(l.begin(), l.end());
      if (style != 5) l.erase(std::unique(l.begin(), l.end()), l.end());  // style 5: duplicates kept
      // style 6: an adaptive head's layout (estimate_cuda.h): the room after the kept blocks holds kBsUnused
      // (0x7fffffff), which both builds must ignore.
      if (style == 6) l.insert(l.end(), 1 + rng() % 5, int32_t{0x7fffffff});
    }
    b.key_blocks.insert(b.key_blocks.end(), l.begin(), l.end());
    b.offsets.push_back(int32_t(b.key_blocks.size()));
  }
  (void)nqb_all;
  d = DeviceHeadPattern{};
  d.kind = DeviceHeadPattern::kBlockSparse;
  d.bs_block = blk;
  d.bs_first_q_block = first;
  d.bs_num_q_blocks = num;
  d.bs_offsets = b.offsets.data();
  d.bs_key_blocks = b.key_blocks.data();
}

// One layer; per_kind: the warp kernels on the warp kinds and the thread kernels on the others, else the warp
// kernels on every head.
static int check_case(std::mt19937& rng, int ci, bool per_kind) {
  const int tile = (rng() % 2) ? 128 : 64;
  bool long_ctx = rng() % 8 == 0;
  const int q_begin = long_ctx ? 8000 + int(rng() % 12000) : (rng() % 3 == 0) ? int(rng() % 700) : 0;
  const int q_len = long_ctx ? 1 + int(rng() % 300) : 1 + int(rng() % 2600);
  const int kv_len = q_begin + q_len;
  const int heads = 1 + int(rng() % 4);
  std::vector<DeviceHeadPattern> hp(static_cast<size_t>(heads));
  std::vector<BsHead> bs(static_cast<size_t>(heads));
  for (int h = 0; h < heads; ++h) {
    const int kind = int(rng() % 6);
    DeviceHeadPattern& d = hp[size_t(h)];
    if (kind == 0 && heads > 1) {
      d.kind = DeviceHeadPattern::kDense;
    } else if (kind == 1 && heads > 1) {
      d.kind = rng() % 2 ? DeviceHeadPattern::kStreaming : DeviceHeadPattern::kTriangle;
      d.sink = int(rng() % 200);
      d.local = 1 + int(rng() % 700);
      d.last = int(rng() % 300);
    } else {
      make_bs_head(rng, kv_len, q_begin, q_len, d, bs[size_t(h)], long_ctx);
    }
  }
  const int tiles = (q_len + tile - 1) / tile, items = heads * tiles;
  const size_t nit = size_t(items);
  std::vector<int32_t> rcount(nit + 1, -7), ccount(nit + 1, -7), costs(nit, -7), it(nit, -7);
  LowerParams p;
  p.heads = hp.data();
  p.num_tiles = tiles;
  p.tile = tile;
  p.q_begin = q_begin;
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.num_items = items;
  p.n_total = kv_len;
  p.range_counts = rcount.data();
  p.column_counts = ccount.data();
  p.costs = costs.data();
  p.items = it.data();
  auto warp_pass = [&](auto kernel, int n) {
    for (int bi = 0; bi < (n + 3) / 4; ++bi) {
      dim3 b; b.x = unsigned(bi);
      dim3 d; d.x = 128;
      emu::run_block(b, d, [&] { kernel(p); });
    }
  };
  auto thread_pass = [&](auto kernel, int n) {
    for (int bi = 0; bi < (n + 127) / 128; ++bi) {
      dim3 b; b.x = unsigned(bi);
      dim3 d; d.x = 128;
      emu::run_block(b, d, [&] { kernel(p); });
    }
  };
  p.select = per_kind ? kSelectWarpKinds : kSelectAll;
  warp_pass(lower_count_warp_kernel, items + 1);
  int bad = 0;
  if (per_kind) {  // the warp kernel lowered exactly the block-sparse items (costs of the others still unset)
    for (size_t i = 0; i < nit; ++i) {
      const bool bs_item = hp[i / size_t(tiles)].kind == DeviceHeadPattern::kBlockSparse;
      if (bs_item != (costs[i] != -7) && bad++ < 5)
        std::printf("case %d: item %zu (%s) %s by the warp kernel\n", ci, i, bs_item ? "BS" : "other",
                    bs_item ? "not lowered" : "lowered");
    }
    p.select = kSelectOthers;
    thread_pass(lower_count_kernel, items + 1);
  }
  std::vector<int32_t> ro(nit + 1, 0), co(nit + 1, 0);
  for (size_t i = 0; i < nit; ++i) { ro[i + 1] = ro[i] + rcount[i]; co[i + 1] = co[i] + ccount[i]; }
  std::vector<KeyRange> ranges(size_t(ro[nit]) + 1, KeyRange{-9, -9});
  std::vector<int32_t> columns(size_t(co[nit]) + 1, -9);
  p.range_offsets = ro.data();
  p.column_offsets = co.data();
  p.ranges = ranges.data();
  p.columns = columns.data();
  p.range_capacity = int64_t(ranges.size());
  p.column_capacity = int64_t(columns.size());
  p.select = per_kind ? kSelectWarpKinds : kSelectAll;
  warp_pass(lower_fill_warp_kernel, items);
  if (per_kind) {
    p.select = kSelectOthers;
    thread_pass(lower_fill_kernel, items);
  }
  if (rcount[nit] != 0 || ccount[nit] != 0) bad++, std::printf("case %d: extra count not zero\n", ci);
  for (int h = 0; h < heads; ++h) {
    const DeviceHeadPattern& d = hp[size_t(h)];
    for (int t = 0; t < tiles; ++t) {
      const size_t item = size_t(h) * size_t(tiles) + size_t(t);
      const TileGeometry g = tile_geometry(t, tile, q_begin, q_len, kv_len, kv_len);
      std::vector<KeyRange> er(size_t(kv_len) + 4);
      const TileCounts n = lower_tile(d, g, er.data(), nullptr);
      ++g_tiles;
      if (d.kind == DeviceHeadPattern::kBlockSparse) {
        ++g_bs_tiles;
        g_multi_window_tiles += (g.key_end + d.bs_block - 1) / d.bs_block > 8192;
        g_ranges += n.ranges;
        g_empty += n.ranges == 0;
        g_clipped += n.ranges > 0 && er[size_t(n.ranges - 1)].end % d.bs_block != 0;
      }
      bool ok = n.ranges == rcount[item] && n.columns == ccount[item] && n.cost == costs[item] &&
                it[item] == int32_t(item);
      for (int r = 0; ok && r < n.ranges; ++r) {
        const KeyRange& a = ranges[size_t(ro[item] + r)];
        ok = a.begin == er[size_t(r)].begin && a.end == er[size_t(r)].end;
      }
      if (!ok && bad++ < 5)
        std::printf("case %d (%s) head %d kind %d tile %d: ranges %d/%d columns %d/%d cost %d/%d (tile %d q_begin %d "
                    "q_len %d blk %d)\n",
                    ci, per_kind ? "per kind" : "warp", h, d.kind, t, rcount[item], n.ranges, ccount[item], n.columns,
                    costs[item], n.cost, tile, q_begin, q_len, d.bs_block);
    }
  }
  return bad;
}

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 80;
  std::mt19937 rng(777);
  int bad_cases = 0;
  for (int c = 0; c < cases; ++c) bad_cases += check_case(rng, c, c % 2 == 0) != 0;
  std::printf("bs index warp: %d of %d cases differ (%ld tiles, %ld block-sparse: %ld ranges, %ld tiles without "
              "ranges, %ld with the last range clipped, %ld over several bitmap windows)\n",
              bad_cases, cases, g_tiles, g_bs_tiles, g_ranges, g_empty, g_clipped, g_multi_window_tiles);
  return bad_cases == 0 ? 0 : 1;
}
