// Host emulation of the device index build's VS path (lower_cuda.cu: vs_runs_kernel, vs_cover_kernel,
// lower_count_warp_kernel, lower_fill_warp_kernel with the runs and the column coverage) against lower_tile (the
// walk, itself tested against the CPU lowering); the coverage bits also against their definition:
// random VS heads (offsets dense near the diagonal with gaps, scattered, duplicates, a negative first offset,
// none, more than one block of offsets, an adaptive head's kVsUnused room after them), tiles 64 / 128, q_begin > 0,
// odd q_len (partial last tile).
#include <cstdio>
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/lower_kernels.cuh"

using namespace tessera::attn;
using namespace tessera::attn::gpu;

static long g_run_tiles = 0, g_walk_tiles = 0, g_multi_run_tiles = 0, g_cover_bits = 0, g_cover_columns = 0;

static int check_case(std::mt19937& rng, int ci) {
  const int tile = (rng() % 2) ? 128 : 64;
  const int q_begin = (rng() % 3 == 0) ? int(rng() % 700) : 0;
  const int q_len = 1 + int(rng() % 2600);
  const int kv_len = q_begin + q_len;
  const int heads = 1 + int(rng() % 3);
  std::vector<std::vector<int32_t>> offs(heads), cols(heads);
  std::vector<DeviceHeadPattern> hp(heads);
  int32_t run_entries = 0;
  for (int h = 0; h < heads; ++h) {
    const int mode = int(rng() % 6);
    std::vector<int32_t>& o = offs[h];
    if (mode == 0) {  // dense near the diagonal with a few gaps, plus a far tail
      int x = 0;
      const int n = int(rng() % 1400);
      for (int i = 0; i < n && x < kv_len; ++i) { o.push_back(x); x += (rng() % 40 == 0) ? 1 + int(rng() % 300) : 1; }
      for (int i = 0; i < 20; ++i) o.push_back(int(rng() % kv_len));
    } else if (mode == 1) {  // scattered
      const int n = int(rng() % 900);
      for (int i = 0; i < n; ++i) o.push_back(int(rng() % kv_len));
    } else if (mode == 2) {  // gaps around the tile size
      int x = int(rng() % 5);
      while (x < kv_len) { o.push_back(x); x += tile - 2 + int(rng() % 5); }
    } else if (mode == 3) {  // duplicates
      const int n = int(rng() % 400);
      for (int i = 0; i < n; ++i) { const int v = int(rng() % kv_len); o.push_back(v); o.push_back(v); }
    } else if (mode == 4) {  // negative first offset: the walk must be used
      const int n = int(rng() % 300);
      for (int i = 0; i < n; ++i) o.push_back(int(rng() % kv_len));
      o.push_back(-1 - int(rng() % 50));
    }  // mode 5: none
    std::sort(o.begin(), o.end());
    if (mode != 3) o.erase(std::unique(o.begin(), o.end()), o.end());
    std::vector<int32_t>& c = cols[h];
    const int nc = int(rng() % 200);
    for (int i = 0; i < nc; ++i) c.push_back(int(rng() % (kv_len + 10)) - 5);
    std::sort(c.begin(), c.end());
    if (rng() % 3 == 0) {  // an adaptive head's layout (estimate_cuda.h): unused room filled with kVsUnused
      constexpr int32_t kUnused = 0x7fffffff;  // kVsUnused of estimate_cuda.h
      o.insert(o.end(), 1 + rng() % 40, kUnused);
      c.insert(c.end(), 1 + rng() % 40, kUnused);
    }
    hp[h].kind = DeviceHeadPattern::kVerticalSlash;
    hp[h].offsets = o.data();
    hp[h].num_offsets = int32_t(o.size());
    hp[h].columns = c.data();
    hp[h].num_columns = int32_t(c.size());
    hp[h].run_base = run_entries;
    run_entries += int32_t(o.size()) + 1;
  }
  const int tiles = (q_len + tile - 1) / tile, items = heads * tiles;
  std::vector<int32_t> rb(size_t(run_entries) + 1, -7), rt(size_t(run_entries) + 1, -7), rc(size_t(heads), -7);
  const size_t nit = static_cast<size_t>(items);
  std::vector<int32_t> rcount(nit + 1), ccount(nit + 1), costs(nit), it(nit);
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
  p.use_runs = 1;
  p.run_breaks = rb.data();
  p.run_tiles = rt.data();
  p.run_count = rc.data();
  for (int h = 0; h < heads; ++h) {
    dim3 b; b.x = unsigned(h);
    dim3 d; d.x = 512;
    emu::run_block(b, d, [&] { vs_runs_kernel(p); });
  }
  const int cover_words = (q_begin + q_len) / 32 + 1;
  std::vector<uint32_t> cover(size_t(heads) * size_t(cover_words), 0xdeadbeefu);
  p.cover = cover.data();
  p.cover_words = cover_words;
  for (int h = 0; h < heads; ++h) {
    for (int by = 0; by < (cover_words + 255) / 256; ++by) {
      dim3 b; b.x = unsigned(h); b.y = unsigned(by);
      dim3 d; d.x = 256;
      emu::run_block(b, d, [&] { vs_cover_kernel(p); });
    }
  }
  int bad = 0;
  for (int h = 0; h < heads; ++h) {  // bit u iff some offset in [u - tile, u), for u = 0 .. q_begin + q_len
    if (rc[size_t(h)] < 0) continue;
    const std::vector<int32_t>& o = offs[h];
    for (int64_t u = 0; u <= q_begin + q_len; ++u) {
      const auto it_lo = std::lower_bound(o.begin(), o.end(), u - tile);
      const bool want = it_lo != o.end() && *it_lo < u;
      const bool got = (cover[size_t(h) * size_t(cover_words) + size_t(u >> 5)] >> (u & 31)) & 1u;
      ++g_cover_bits;
      if (want != got && bad++ < 5) std::printf("case %d head %d: cover bit %ld is %d\n", ci, h, long(u), int(got));
    }
  }
  const int blocks_count = (items + 1 + 3) / 4;
  for (int bi = 0; bi < blocks_count; ++bi) {
    dim3 b; b.x = unsigned(bi);
    dim3 d; d.x = 128;
    emu::run_block(b, d, [&] { lower_count_warp_kernel(p); });
  }
  std::vector<int32_t> ro(size_t(items) + 1, 0), co(size_t(items) + 1, 0);
  for (int i = 0; i < items; ++i) { ro[size_t(i) + 1] = ro[size_t(i)] + rcount[size_t(i)]; co[size_t(i) + 1] = co[size_t(i)] + ccount[size_t(i)]; }
  std::vector<KeyRange> ranges(size_t(ro[size_t(items)]) + 1, KeyRange{-9, -9});
  std::vector<int32_t> columns(size_t(co[size_t(items)]) + 1, -9);
  p.range_offsets = ro.data();
  p.column_offsets = co.data();
  p.ranges = ranges.data();
  p.columns = columns.data();
  p.range_capacity = int64_t(ranges.size());
  p.column_capacity = int64_t(columns.size());
  for (int bi = 0; bi < (items + 3) / 4; ++bi) {
    dim3 b; b.x = unsigned(bi);
    dim3 d; d.x = 128;
    emu::run_block(b, d, [&] { lower_fill_warp_kernel(p); });
  }
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tiles; ++t) {
      const int item = h * tiles + t;
      const TileGeometry g = tile_geometry(t, tile, q_begin, q_len, kv_len, kv_len);
      std::vector<KeyRange> er(size_t(offs[h].size()) + 2);
      std::vector<int32_t> ec(cols[h].size() + 1);
      const TileCounts n = lower_tile(hp[h], g, er.data(), ec.data());
      if (rc[size_t(h)] >= 0 && g.p1 - g.p0 == tile) {
        ++g_run_tiles;
        g_multi_run_tiles += n.ranges > 1;
        for (int32_t c : cols[h]) g_cover_columns += c >= 0 && c < g.key_end;
      } else {
        ++g_walk_tiles;
      }
      bool ok = n.ranges == rcount[size_t(item)] && n.columns == ccount[size_t(item)] && n.cost == costs[size_t(item)];
      for (int r = 0; ok && r < n.ranges; ++r) {
        const KeyRange& a = ranges[size_t(ro[size_t(item)] + r)];
        ok = a.begin == er[size_t(r)].begin && a.end == er[size_t(r)].end;
      }
      for (int r = 0; ok && r < n.columns; ++r) ok = columns[size_t(co[size_t(item)] + r)] == ec[size_t(r)];
      if (!ok && bad++ < 5)
        std::printf("case %d head %d tile %d: ranges %d/%d columns %d/%d cost %d/%d (tile %d q_begin %d q_len %d, %zu offsets, runs %d)\n",
                    ci, h, t, rcount[size_t(item)], n.ranges, ccount[size_t(item)], n.columns, costs[size_t(item)], n.cost,
                    tile, q_begin, q_len, offs[h].size(), rc[size_t(h)]);
    }
  }
  return bad;
}

// warp_lower_bound against detail::lower_bound_index: ascending arrays with duplicates, sizes 0 .. 5000, any
// [lo, hi) and x below, inside and above the values.
static int check_warp_lower_bound(std::mt19937& rng, int trials) {
  int bad = 0;
  for (int t = 0; t < trials; ++t) {
    const int n = (t % 4 == 0) ? int(rng() % 40) : int(rng() % 5000);
    std::vector<int32_t> a(static_cast<size_t>(n));
    int v = int(rng() % 100) - 50;
    for (int& x : a) { x = v; v += (rng() % 3 == 0) ? 0 : 1 + int(rng() % (1 + rng() % 200)); }
    const int lo = n > 0 && rng() % 3 == 0 ? int(rng() % uint32_t(n)) : 0;
    const int hi = n > lo && rng() % 3 == 0 ? lo + int(rng() % uint32_t(n - lo + 1)) : n;
    for (int q = 0; q < 8; ++q) {
      const int64_t x = n > 0 && q < 6 ? int64_t(a[rng() % uint32_t(n)]) + int(rng() % 3) - 1 : int64_t(v) - 200 * (q - 6);
      const int want = detail::lower_bound_index(a.data(), lo, hi, x);
      int got[32];
      dim3 b; dim3 d; d.x = 32;
      emu::run_block(b, d, [&] { got[threadIdx.x] = warp_lower_bound(a.data(), lo, hi, x); });
      for (int l = 0; l < 32; ++l)
        if (got[l] != want && bad++ < 5) std::printf("warp_lower_bound n %d [%d, %d) x %ld: lane %d %d, want %d\n", n, lo, hi, long(x), l, got[l], want);
    }
  }
  std::printf("warp_lower_bound: %d of %d searches differ\n", bad, trials * 8);
  return bad;
}

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 60;
  std::mt19937 rng(12345);
  int bad_cases = check_warp_lower_bound(rng, 400) != 0;
  for (int c = 0; c < cases; ++c) bad_cases += check_case(rng, c) != 0;
  std::printf("vs index runs: %d of %d cases differ (%ld tiles by runs, %ld of them with > 1 range; %ld by the walk; "
              "%ld coverage bits checked, %ld columns tested by coverage)\n",
              bad_cases, cases, g_run_tiles, g_multi_run_tiles, g_walk_tiles, g_cover_bits, g_cover_columns);
  return bad_cases == 0 ? 0 : 1;
}
