// The BS estimator's kernels (bs_score_kernels.cuh, "BS estimator v2", and bs_select_kernels.cuh, through
// estimate_kernels.cuh) end to end under the host emulation (shim.h), with the host plan of DeviceEstimates
// (plan_bs_waves), against a direct f32 evaluation of the estimate's definition (estimate_cuda.h): pooling,
// scoring and selection over small layers (odd sizes,
// chunks with a cache tail, several block sizes, top_k 0 / 1 / >= blocks, exact ties, many waves, rows longer
// than 2048 blocks), every query block's key blocks compared. Adaptive heads (gamma > 0, issue 16): the count by
// coverage_count's rule (attention/index/estimate.h) over the masses expf(s - max) (f32, the device's definition)
// of the diagonal (forced) and
// the earlier blocks, summed in f64 in the order's own order here (the device sums per lane, then by the warp's
// butterfly: a count may differ only where the target is within rounding of a prefix sum, counted and reported
// as such), the kept blocks then kBsUnused up to the room.
// Usage: pipeline [case name ...]   (all cases when none is named)
#include <random>
#include <cassert>
#include <map>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/estimate_kernels.cuh"
using namespace tessera::attn::gpu;

struct Pat { int top_k, block; double gamma = 0.0; int min_top_k = 0; };
struct Case { std::string name; int q_len, q_begin, extra, hq, hkv, d; bool f16; std::vector<Pat> heads; bool tied; int64_t wave; float sharp = 1.0f; };

uint16_t to_bits(float x, bool f16) {
  if (!f16) { uint32_t u; std::memcpy(&u, &x, 4); uint32_t r = u + 0x7fff + ((u >> 16) & 1); return uint16_t(r >> 16); }
  // f16 round-nearest-even via _Float16
  _Float16 h = (_Float16)x; uint16_t b; std::memcpy(&b, &h, 2); return b;
}
float from_bits(uint16_t b, bool f16) { return f16 ? __half2float(__half{b}) : __bfloat162float(__nv_bfloat16{b}); }

uint32_t okey(float x) { if (x == 0.0f) x = 0.0f; uint32_t u; std::memcpy(&u, &x, 4); return (u & 0x80000000u) ? ~u : (u | 0x80000000u); }

int64_t bs_prefix(int64_t x, int64_t k) { if (x <= k) return x * (x + 1) / 2; return k * (k + 1) / 2 + (x - k) * k; }

int main(int argc, char** argv) {
  std::vector<Case> cases = {
    {"s40", 40, 0, 0, 2, 2, 64, false, {{4, 64}, {2, 16}}, false, 0},
    {"s777_d64", 777, 0, 0, 4, 2, 64, false, {{5, 16}, {2, 32}, {40, 64}, {1, 100}}, false, 0},
    {"chunk_tail_f16", 700, 1000, 37, 4, 1, 128, true, {{7, 64}, {3, 32}, {1000, 16}, {0, 64}}, false, 0},
    {"tied", 1500, 0, 0, 2, 1, 128, false, {{10, 16}, {25, 32}}, true, 0},
    {"waves_d256", 900, 0, 0, 2, 1, 256, true, {{6, 16}, {12, 32}}, false, 800},
    {"waves_chunk_tied", 600, 333, 0, 2, 1, 128, false, {{9, 16}, {4, 64}}, true, 3000},
    {"block1_long", 2200, 0, 0, 1, 1, 64, true, {{30, 1}}, false, 0},
    {"block1_long_bigk", 2150, 0, 0, 1, 1, 64, false, {{2100, 1}}, true, 0},
    {"tiny_ties_allsame", 300, 0, 0, 1, 1, 64, false, {{7, 4}}, true, 0},
    {"waves_chunk_tied2", 600, 333, 0, 2, 1, 128, false, {{9, 16}, {4, 64}}, true, 1000},
    {"chunks_d128_waves", 5000, 0, 3, 2, 1, 128, true, {{50, 16}, {3, 16}}, false, 30000},
    // Adaptive budgets: flat and sharpened scores (q x 6: a few blocks hold most of the mass), maxima below and
    // above qb + 1, min_top_k, gamma 1, exact ties, chunks with a cache tail, waves, rows of 800 and of 2060+ blocks.
    {"adaptive_flat", 1500, 0, 0, 4, 2, 64, false, {{1000, 16, 0.9}, {8, 32, 0.5, 3}, {40, 16, 0.99}, {5, 64, 1.0}}, false, 0},
    {"adaptive_sharp", 2000, 0, 0, 4, 1, 128, true, {{1000, 16, 0.9}, {30, 16, 0.95, 2}, {1000, 32, 0.5}, {6, 64, 0.8}}, false, 0, 6.0f},
    {"adaptive_chunk_tied", 700, 1000, 37, 2, 1, 128, false, {{1000, 16, 0.9}, {12, 32, 0.7, 4}}, true, 3000, 4.0f},
    {"adaptive_d256_waves", 900, 0, 0, 2, 1, 256, true, {{1000, 16, 0.9}, {20, 32, 0.6}}, false, 800, 5.0f},
    {"adaptive_block2_long", 1600, 0, 0, 1, 1, 64, false, {{3000, 2, 0.9}}, false, 0, 8.0f},
    // rows of over 2048 blocks (the coverage count reads the scores once per pass instead of from registers)
    {"adaptive_past2048", 40, 2060, 0, 2, 1, 64, false, {{3000, 1, 0.9}, {50, 1, 0.6, 5}}, false, 0, 8.0f},
  };
  int failures = 0, ran = 0;
  for (const Case& c : cases) {
    if (argc > 1 && std::find(argv + 1, argv + argc, c.name) == argv + argc) continue;
    ++ran;
    std::mt19937_64 rng(std::hash<std::string>{}(c.name));
    std::normal_distribution<float> nd(0.f, 1.f);
    const int kv_len = c.q_begin + c.q_len + c.extra, q_end = c.q_begin + c.q_len, d = c.d;
    std::vector<uint16_t> qb16(size_t(c.q_len) * c.hq * d), kb16(size_t(kv_len) * c.hkv * d);
    for (auto& x : qb16) x = to_bits(c.sharp * nd(rng), c.f16);
    for (auto& x : kb16) x = to_bits(nd(rng), c.f16);
    if (c.tied) {
      const int per = c.name == "tiny_ties_allsame" ? 4 : 192;
      for (int j = per; j < kv_len; ++j) std::copy_n(&kb16[size_t(j % per) * c.hkv * d], size_t(c.hkv) * d, &kb16[size_t(j) * c.hkv * d]);
    }
    auto qf = [&](int r, int h, int e) { return from_bits(qb16[(size_t(r) * c.hq + h) * d + e], c.f16); };
    auto kf = [&](int j, int h, int e) { return from_bits(kb16[(size_t(j) * c.hkv + h) * d + e], c.f16); };
    // head descriptors (as the constructor)
    const int group = c.hq / c.hkv;
    std::vector<BsHeadDesc> bs_;
    std::vector<int32_t> block_sizes, offsets_host;
    int64_t off_total = 0, key_total = 0; int max_q_blocks = 0;
    for (int h = 0; h < c.hq; ++h) {
      const Pat p = c.heads[size_t(h) % c.heads.size()];
      BsHeadDesc dd;
      dd.q_head = h; dd.kv_head = h / group; dd.block = p.block; dd.top_k = p.top_k;
      dd.gamma = p.gamma; dd.min_top_k = p.min_top_k;
      dd.first_q_block = c.q_begin / p.block;
      dd.num_q_blocks = (q_end - 1) / p.block - dd.first_q_block + 1;
      dd.num_key_blocks = (q_end + p.block - 1) / p.block;
      auto it = std::find(block_sizes.begin(), block_sizes.end(), p.block);
      dd.pool_index = int(it - block_sizes.begin());
      if (it == block_sizes.end()) block_sizes.push_back(p.block);
      dd.offsets_base = off_total; dd.key_base = key_total;
      const int64_t base = bs_prefix(dd.first_q_block, dd.top_k);
      for (int e = 0; e <= dd.num_q_blocks; ++e) offsets_host.push_back(int32_t(bs_prefix(dd.first_q_block + e, dd.top_k) - base));
      off_total += dd.num_q_blocks + 1; key_total += offsets_host.back();
      max_q_blocks = std::max(max_q_blocks, dd.num_q_blocks);
      bs_.push_back(dd);
    }
    std::vector<int64_t> pool_base; int64_t pool_total = 0;
    for (int b : block_sizes) { pool_base.push_back(pool_total); pool_total += int64_t(c.hkv) * ((q_end + b - 1) / b) * d; }
    for (auto& dd : bs_) dd.kpool_base = pool_base[size_t(dd.pool_index)] + int64_t(dd.kv_head) * dd.num_key_blocks * d;
    const int head_dim = d;
    bool any_adaptive = false;  // as DeviceEstimates: the select kernel with the coverage count
    for (const auto& dd : bs_) any_adaptive = any_adaptive || dd.gamma > 0.0;
    std::vector<BsWave> bs_waves_;
    std::vector<BsTileDesc> bs_tiles;
    std::vector<BsWorkDesc> bs_work;
    const int64_t bs_scratch =
        plan_bs_waves(bs_, head_dim, c.wave > 0 ? c.wave : int64_t{16} << 20, bs_tiles, bs_work, bs_waves_);
    std::vector<float> kpool(size_t(std::max<int64_t>(pool_total, 1)), NAN), qpool(bs_.size() * size_t(max_q_blocks) * d, NAN);
    std::vector<float> scores(size_t(bs_scratch), NAN);
    std::vector<int32_t> key_blocks(size_t(std::max<int64_t>(key_total, 1)), -7);
    BsParams p;
    p.q = qb16.data(); p.k = kb16.data();
    p.q_tok = int64_t(c.hq) * d; p.q_head = d; p.k_tok = int64_t(c.hkv) * d; p.k_head = d;
    p.q_len = c.q_len; p.q_begin = c.q_begin; p.kv_len = kv_len; p.max_q_blocks = max_q_blocks;
    p.scale = float(1.0 / std::sqrt(double(d)));
    p.heads = bs_.data(); p.kpool = kpool.data(); p.qpool = qpool.data(); p.offsets = offsets_host.data();
    p.key_blocks = key_blocks.data(); p.tiles = bs_tiles.data(); p.work = bs_work.data(); p.scores = scores.data();
    auto launch = [&](dim3 grid, int threads, auto kernel) {
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) emu::run_block(dim3{x, y, 1}, dim3{unsigned(threads), 1, 1}, kernel);
    };
    auto dispatch = [&](auto Dc) {
      constexpr int D = decltype(Dc)::value;
      const int per = kBsPoolThreads / (D / 8);
      for (size_t i = 0; i < block_sizes.size(); ++i) {
        const int b = block_sizes[i], nkb = (q_end + b - 1) / b;
        if (c.f16) launch(dim3{unsigned((nkb + per - 1) / per), unsigned(c.hkv), 1}, kBsPoolThreads, [&] { bs_pool_k_kernel<__half, D>(p, b, nkb, p.kpool + pool_base[i]); });
        else launch(dim3{unsigned((nkb + per - 1) / per), unsigned(c.hkv), 1}, kBsPoolThreads, [&] { bs_pool_k_kernel<__nv_bfloat16, D>(p, b, nkb, p.kpool + pool_base[i]); });
      }
      if (c.f16) launch(dim3{unsigned((max_q_blocks + per - 1) / per), unsigned(bs_.size()), 1}, kBsPoolThreads, [&] { bs_pool_q_kernel<__half, D>(p); });
      else launch(dim3{unsigned((max_q_blocks + per - 1) / per), unsigned(bs_.size()), 1}, kBsPoolThreads, [&] { bs_pool_q_kernel<__nv_bfloat16, D>(p); });
      for (const BsWave& w : bs_waves_) {
        std::fill(scores.begin(), scores.end(), NAN);
        if (w.work_end > w.work_begin) launch(dim3{unsigned(w.work_end - w.work_begin), 1, 1}, kBsScoreThreads, [&] { bs_score_kernel<D>(p, w.work_begin); });
        launch(dim3{unsigned(w.tile_end - w.tile_begin), unsigned(bs_tile_rows(D) / (kBsSelectThreads / 32)), 1}, kBsSelectThreads, [&] { if (any_adaptive) bs_select_kernel<D, true>(p, w.tile_begin); else bs_select_kernel<D, false>(p, w.tile_begin); });
      }
    };
    if (d == 64) dispatch(std::integral_constant<int, 64>{});
    if (d == 128) dispatch(std::integral_constant<int, 128>{});
    if (d == 256) dispatch(std::integral_constant<int, 256>{});
    // reference
    int bad = 0; int64_t checked = 0, adaptive_rows = 0, near_ties = 0, kept_sum = 0, room_sum = 0;
    for (size_t s = 0; s < bs_.size(); ++s) {
      const BsHeadDesc& hd = bs_[s];
      const int B = hd.block;
      std::vector<std::vector<float>> kp;
      for (int kb = 0; kb < hd.num_key_blocks; ++kb) {
        const int j0 = kb * B, j1 = std::min((kb + 1) * B, kv_len);
        std::vector<float> acc(size_t(d), 0.f);
        for (int j = j0; j < j1; ++j) for (int e = 0; e < d; ++e) acc[size_t(e)] += kf(j, hd.kv_head, e);
        for (auto& x : acc) x = x / float(j1 - j0);
        kp.push_back(acc);
      }
      for (int e = 0; e < hd.num_q_blocks; ++e) {
        const int qb = hd.first_q_block + e;
        const int count = std::min(hd.top_k, qb + 1);
        std::vector<int32_t> want;
        if (count >= 1) {
          const int r0 = std::max(qb * B, c.q_begin) - c.q_begin, r1 = std::min((qb + 1) * B, q_end) - c.q_begin;
          std::vector<float> qp(size_t(d), 0.f);
          for (int r = r0; r < r1; ++r) for (int x = 0; x < d; ++x) qp[size_t(x)] += qf(r, hd.q_head, x);
          for (auto& x : qp) x = x / float(r1 - r0);
          std::vector<std::pair<uint32_t, int>> ranked;
          std::vector<float> sc;  // f32 scores of blocks [0, qb], the diagonal last
          for (int kb = 0; kb <= qb; ++kb) {
            float leaf[32];
            for (int l = 0; l < 32; ++l) { float a = 0.f; for (int i = l; i < d; i += 32) a = std::fma(qp[size_t(i)], kp[size_t(kb)][size_t(i)], a); leaf[l] = a; }
            for (int m = 16; m >= 1; m /= 2) for (int l = 0; l < m; ++l) leaf[l] = leaf[l] + leaf[l + m];
            sc.push_back(leaf[0] * p.scale);
            if (kb < qb) ranked.push_back({okey(leaf[0] * p.scale), kb});
          }
          std::sort(ranked.begin(), ranked.end(), [](auto& a, auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
          int keep = count;
          if (hd.gamma > 0.0 && count >= 2) {  // coverage_count's rule, summed in the order's own order
            float top = -INFINITY;
            for (float x : sc) top = std::max(top, x);
            auto ms = [&](int kb) { return double(expf(sc[size_t(kb)] - top)); };  // the device's f32 masses
            std::vector<double> prefix(1, ms(qb));  // the diagonal first, then by score (= by mass, up to ties)
            for (const auto& [key, kb] : ranked) prefix.push_back(prefix.back() + ms(kb));
            double total = ms(qb);
            for (int kb = 0; kb < qb; ++kb) total += ms(kb);
            const double target = hd.gamma * total;
            int n_ref = qb + 1;
            if (hd.gamma < 1.0) {
              for (int i = 0; i <= qb; ++i) if (prefix[size_t(i)] >= target) { n_ref = i + 1; break; }
            }
            keep = std::clamp(n_ref, std::min(std::max(hd.min_top_k, 1), count), count);
            // The device's count, when it differs, must be at a near-tie of the target (rounding of the sums).
            const int o0 = offsets_host[size_t(hd.offsets_base + e)];
            int got_n = 0;
            for (int i = 0; i < count; ++i) got_n += key_blocks[size_t(hd.key_base + o0 + i)] != kBsUnused;
            const int got_raw = got_n;
            if (got_raw != keep && got_raw >= 1 && got_raw <= qb + 1) {
              const int lo = std::min(got_raw, keep) - 1;  // prefix[lo] is below the target on one side
              if (std::abs(prefix[size_t(lo)] - target) <= 1e-12 * total) { keep = got_raw; ++near_ties; }
            }
            ++adaptive_rows;
            kept_sum += keep;
            room_sum += count;
          }
          for (int i = 0; i < std::min(keep - 1, qb); ++i) want.push_back(ranked[size_t(i)].second);
          std::sort(want.begin(), want.end());
          want.push_back(qb);
          while (int(want.size()) < count) want.push_back(kBsUnused);
        }
        const int o0 = offsets_host[size_t(hd.offsets_base + e)], o1 = offsets_host[size_t(hd.offsets_base + e + 1)];
        std::vector<int32_t> got(key_blocks.begin() + hd.key_base + o0, key_blocks.begin() + hd.key_base + o1);
        ++checked;
        if (got != want) {
          if (bad++ < 5) {
            std::printf("  MISMATCH %s head %zu qb %d: got", c.name.c_str(), s, qb);
            for (int x : got) std::printf(" %d", x);
            std::printf(" | want");
            for (int x : want) std::printf(" %d", x);
            std::printf("\n");
          }
        }
      }
    }
    std::printf("%-20s waves %zu tiles %zu work %zu rows %lld: %s", c.name.c_str(), bs_waves_.size(), bs_tiles.size(), bs_work.size(), (long long)checked, bad ? "FAIL" : "ok");
    if (adaptive_rows > 0)
      std::printf(" (adaptive rows %lld: kept %.1f%% of the room, %lld near-ties)", (long long)adaptive_rows,
                  100.0 * double(kept_sum) / double(room_sum), (long long)near_ties);
    std::printf("\n");
    failures += bad != 0;
  }
  if (argc > 1 && ran != argc - 1) {
    std::printf("unknown case name among the arguments\n");
    return 1;
  }
  std::printf(failures ? "FAILED\n" : "all ok\n");
  return failures != 0 ? 1 : 0;
}
