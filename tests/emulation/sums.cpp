// The VS estimator's kernels (estimate_kernels.cuh: vs_stats, vs_merge_stats, vs_sums, vs_merge_diag,
// vs_topk) end to end under the host emulation (shim.h; ldmatrix / mma.sync by the fragment layout, the
// mma.sync path: the wgmma one is sm_90a device code) on small layers, against an f64 evaluation of the
// estimate's definition (estimate_cuda.h) on the same bf16 / f16 inputs: row statistics (maxima in log2 units
// to 1e-5, normalisers to 1e-4), column and diagonal sums to 1e-3 (relative); and the columns and offsets
// exactly against the selection rule (forced prefix, then the top-k of block_topk.cuh's order keys, ties to
// the smaller index, ascending) applied to the kernels' own sums. Layers: D 64 / 128 / 256, GQA with groups
// of up to four heads (and groups with idle warps), rows < 64, q_len 1, q_begin > 0, chunks of 64 to 2048
// keys with a partial last chunk, f16. Usage: sums [case name ...]   (all cases when none is named)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/estimate_kernels.cuh"

using namespace tessera::attn::gpu;

namespace {

struct Case {
  const char* name;
  int hq, hkv, d, q_len, q_begin, last_q, chunk_keys;
  bool f16;
  int vertical, slash, forced_columns, forced_offsets;
};

uint16_t to_bits(float x, bool f16) {
  if (f16) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bits(uint16_t b, bool f16) {
  return f16 ? __half2float(__half{b}) : __bfloat162float(__nv_bfloat16{b});
}

dim3 d3(unsigned x, unsigned y = 1) {
  dim3 r;
  r.x = x;
  r.y = y;
  return r;
}

template <typename T, int D>
int run_case(const Case& c, std::mt19937& rng) {
  const bool f16 = c.f16;
  const int keys = c.q_begin + c.q_len;
  const int chunks = std::max(1, (keys + c.chunk_keys - 1) / c.chunk_keys);
  std::vector<uint16_t> q(size_t(c.q_len) * c.hq * D), k(size_t(keys) * c.hkv * D);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = to_bits(2.0f * nd(rng), f16);
  for (auto& x : k) x = to_bits(nd(rng), f16);
  // Heads and groups as DeviceEstimates lays them out.
  const int group = c.hq / c.hkv;
  std::vector<VsHeadDesc> heads(size_t(c.hq));
  int64_t col_total = 0, off_total = 0;
  for (int h = 0; h < c.hq; ++h) {
    VsHeadDesc& d = heads[size_t(h)];
    d.q_head = h;
    d.kv_head = h / group;
    d.rows = std::min(c.last_q, c.q_len);
    d.num_columns = std::min(c.vertical, keys);
    d.num_offsets = std::min(c.slash, keys);
    d.forced_columns = std::min(c.forced_columns, d.num_columns);
    d.forced_offsets = std::min(c.forced_offsets, d.num_offsets);
    d.column_base = col_total;
    d.offset_base = off_total;
    col_total += d.num_columns;
    off_total += d.num_offsets;
  }
  constexpr int G = vs_group<D>();
  std::vector<VsGroupDesc> groups;
  for (int kvh = 0; kvh < c.hkv; ++kvh) {
    int filled = G;
    for (int h = 0; h < c.hq; ++h) {
      if (heads[size_t(h)].kv_head != kvh) continue;
      if (filled == G) {
        groups.push_back(VsGroupDesc{{-1, -1, -1, -1}});
        filled = 0;
      }
      groups.back().slot[filled++] = h;
    }
  }
  const size_t smem = size_t{kVsStages} * 64u * D * sizeof(T) + 1024u +
                      size_t{G} * static_cast<size_t>(vs_sums_head_floats(c.chunk_keys)) * sizeof(float);
  if (smem > emu::kArenaBytes) {
    std::printf("%s: %zu bytes of shared memory do not fit the emulation's arena\n", c.name, smem);
    return 1;
  }
  const size_t n = size_t(c.hq);
  std::vector<float2> partial(n * size_t(chunks) * kVsRows, {NAN, NAN}), stats(n * kVsRows, {NAN, NAN});
  std::vector<float> colsum(n * size_t(keys), NAN), diag(n * size_t(keys), NAN);
  std::vector<float> diag_partial(n * size_t(chunks) * size_t(c.chunk_keys + kVsRows - 1), NAN);
  std::vector<int32_t> columns(size_t(std::max<int64_t>(col_total, 1)) + 1, -7);
  std::vector<int32_t> offsets(size_t(std::max<int64_t>(off_total, 1)) + 1, -7);
  VsParams p;
  p.q = q.data();
  p.k = k.data();
  p.q_tok = int64_t(c.hq) * D;
  p.q_head = D;
  p.k_tok = int64_t(c.hkv) * D;
  p.k_head = D;
  p.q_len = c.q_len;
  p.q_begin = c.q_begin;
  p.keys = keys;
  p.chunks = chunks;
  p.chunk_keys = c.chunk_keys;
  p.scale = 1.0f / std::sqrt(float(D));
  p.heads = heads.data();
  p.groups = groups.data();
  p.partial = partial.data();
  p.stats = stats.data();
  p.colsum = colsum.data();
  p.diag_partial = diag_partial.data();
  p.diag = diag.data();
  p.columns = columns.data();
  p.offsets = offsets.data();
  // The launches of launch_vs (grids x fastest).
  const unsigned ng = unsigned(groups.size()), nc = unsigned(chunks), nh = unsigned(c.hq);
  for (unsigned y = 0; y < nc; ++y)
    for (unsigned x = 0; x < ng; ++x)
      emu::run_block(d3(x, y), d3(128 * G), [&] { vs_stats_kernel<T, D>(p); });
  for (unsigned x = 0; x < nh; ++x) emu::run_block(d3(x), d3(kVsRows), [&] { vs_merge_stats_kernel(p); });
  for (unsigned y = 0; y < nc; ++y)
    for (unsigned x = 0; x < ng; ++x) emu::run_block(d3(x, y), d3(128 * G), [&] { vs_sums_kernel<T, D>(p); });
  for (unsigned y = 0; y < nh; ++y)
    for (unsigned x = 0; x < unsigned((keys + 255) / 256); ++x)
      emu::run_block(d3(x, y), d3(256), [&] { vs_merge_diag_kernel(p); });
  for (unsigned y = 0; y < 2; ++y)
    for (unsigned x = 0; x < nh; ++x) emu::run_block(d3(x, y), d3(kTopKThreads), [&] { vs_topk_kernel(p); });

  int bad = 0;
  auto report = [&](const char* what, int h, int i, double got, double want) {
    if (++bad <= 10) std::printf("  %s head %d [%d]: got %.9g want %.9g\n", what, h, i, got, want);
  };
  // f64 definition.
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> col(static_cast<size_t>(keys)), dg(col), sc(col);
  for (int h = 0; h < c.hq; ++h) {
    const VsHeadDesc& hd = heads[size_t(h)];
    std::fill(col.begin(), col.end(), 0.0);
    std::fill(dg.begin(), dg.end(), 0.0);
    for (int r = 0; r < kVsRows; ++r) {
      const float2 st = stats[size_t(h) * kVsRows + size_t(r)];
      if (r >= hd.rows) {  // no scores: max -inf, sum 0
        if (!(std::isinf(st.x) && st.x < 0 && st.y == 0.0f))
          report("stats (empty row)", h, r, st.x, -INFINITY);
        continue;
      }
      const int qr = c.q_len - hd.rows + r, pos = c.q_begin + qr;
      double mx = -INFINITY;
      for (int j = 0; j <= pos; ++j) {
        double dot = 0;
        for (int e = 0; e < D; ++e)
          dot += double(from_bits(q[(size_t(qr) * c.hq + h) * D + e], f16)) *
                 from_bits(k[(size_t(j) * c.hkv + hd.kv_head) * D + e], f16);
        sc[size_t(j)] = dot * scale;
        mx = std::max(mx, sc[size_t(j)]);
      }
      double tot = 0;
      for (int j = 0; j <= pos; ++j) tot += std::exp(sc[size_t(j)] - mx);
      const double m2 = mx / std::log(2.0);  // maxima in log2 units (vs_stats)
      if (!(std::fabs(st.x - m2) <= 1e-5 * (1.0 + std::fabs(m2)))) report("stats max", h, r, st.x, m2);
      if (!(std::fabs(st.y - tot) <= 1e-4 * tot)) report("stats sum", h, r, st.y, tot);
      for (int j = 0; j <= pos; ++j) {
        const double a = std::exp(sc[size_t(j)] - mx) / tot;
        col[size_t(j)] += a;
        dg[size_t(pos - j)] += a;
      }
    }
    for (int j = 0; j < keys; ++j) {
      const size_t i = size_t(h) * size_t(keys) + size_t(j);
      if (!(std::fabs(colsum[i] - col[size_t(j)]) <= 1e-3 * col[size_t(j)] + 1e-7))
        report("colsum", h, j, colsum[i], col[size_t(j)]);
      if (!(std::fabs(diag[i] - dg[size_t(j)]) <= 1e-3 * dg[size_t(j)] + 1e-7))
        report("diag", h, j, diag[i], dg[size_t(j)]);
    }
    // The selection rule on the kernels' own sums.
    auto check_topk = [&](const char* what, const float* score, const int32_t* got, int count, int forced) {
      std::vector<int> idx;
      for (int i = forced; i < keys; ++i) idx.push_back(i);
      std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) {
        return detail::order_key(score[x]) > detail::order_key(score[y]);
      });
      std::vector<int> want;
      for (int i = 0; i < forced; ++i) want.push_back(i);
      std::vector<int> top(idx.begin(), idx.begin() + std::min<size_t>(idx.size(), size_t(count - forced)));
      std::sort(top.begin(), top.end());
      want.insert(want.end(), top.begin(), top.end());
      for (int i = 0; i < count; ++i)
        if (got[i] != want[size_t(i)]) {
          report(what, h, i, got[i], want[size_t(i)]);
          break;
        }
    };
    check_topk("columns", &colsum[size_t(h) * size_t(keys)], &columns[size_t(hd.column_base)], hd.num_columns,
               hd.forced_columns);
    check_topk("offsets", &diag[size_t(h) * size_t(keys)], &offsets[size_t(hd.offset_base)], hd.num_offsets,
               hd.forced_offsets);
  }
  if (columns[size_t(col_total)] != -7 || offsets[size_t(off_total)] != -7)
    report("written past the end", 0, 0, 0, 0);
  std::printf("%-30s keys %5d chunks %2d groups %d: %s\n", c.name, keys, chunks, int(groups.size()),
              bad ? "MISMATCH" : "ok");
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const Case cases[] = {
      // name, hq, hkv, d, q_len, q_begin, last_q, chunk_keys, f16, vertical, slash, forced columns / offsets
      {"d128_gqa4_partial_tile", 4, 1, 128, 100, 1000, 64, 512, false, 100, 300, 4, 64},
      {"d64_rows40_one_tile", 2, 2, 64, 40, 0, 64, 512, false, 10, 1000, 1, 0},
      {"d64_exact_chunks", 2, 1, 64, 64, 960, 64, 512, false, 1024, 77, 0, 5},
      {"d64_lastq37_idle_warps", 3, 1, 64, 50, 700, 37, 128, false, 50, 90, 2, 30},
      {"d128_qlen1", 2, 1, 128, 1, 530, 64, 512, false, 30, 30, 0, 0},
      {"d256_two_chunks", 2, 1, 256, 70, 530, 64, 512, false, 64, 128, 4, 64},
      {"d128_f16_two_groups_chunk64", 6, 1, 128, 80, 300, 64, 64, true, 40, 60, 4, 16},
      {"d64_f16_chunk2048", 2, 1, 64, 64, 2500, 64, 2048, true, 200, 400, 0, 64},
  };
  int bad = 0, ran = 0;
  for (const Case& c : cases) {
    if (argc > 1 && std::find_if(argv + 1, argv + argc,
                                 [&](const char* a) { return std::string(a) == c.name; }) == argv + argc)
      continue;
    ++ran;
    std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
    if (c.d == 64) bad += c.f16 ? run_case<__half, 64>(c, rng) : run_case<__nv_bfloat16, 64>(c, rng);
    if (c.d == 128) bad += c.f16 ? run_case<__half, 128>(c, rng) : run_case<__nv_bfloat16, 128>(c, rng);
    if (c.d == 256) bad += c.f16 ? run_case<__half, 256>(c, rng) : run_case<__nv_bfloat16, 256>(c, rng);
  }
  if (argc > 1 && ran != argc - 1) {
    std::printf("unknown case name among the arguments\n");
    return 1;
  }
  std::printf(bad ? "FAILED\n" : "all ok\n");
  return bad ? 1 : 0;
}
