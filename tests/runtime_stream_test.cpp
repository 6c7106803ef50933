// Streaming memory (runtime/stream): span discovery and NMS against brute force, retrieval against naive
// references, the streaming layout's attention against an f64 masked reference, the host store's budget errors,
// and the streaming engine against the normal engine on the tiny fixtures (tests/data/hf_tiny).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "plan/retrieval_heads.h"
#include "runtime/engine.h"
#include "runtime/rope.h"
#include "runtime/stream/host_block_store.h"
#include "runtime/stream/span_discovery.h"
#include "runtime/stream/span_index.h"
#include "runtime/stream/span_math.h"
#include "runtime/stream/stream_layout.h"
#include "runtime/stream/stream_options.h"
#include "runtime/stream/streaming_kv.h"
#include "stream_sizes.h"

namespace tessera::runtime {
namespace {

using stream::Span;
using plan::find_tokens;
using plan::RetrievalCase;
using plan::retrieval_head_scores;
using plan::retrieval_heads_text;

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

const Model& model(const char* rel) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[rel];
  if (!m) m = Model::load(kFixtures + rel);
  return *m;
}

std::vector<float> random_map(int32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> m(static_cast<size_t>(n * n));
  for (auto& x : m) x = u(rng);
  return m;
}

// TA(j, i) by its definition.
double brute_score(const std::vector<float>& a, int32_t n, double theta, int32_t j, int32_t i) {
  double s = 0;
  for (int32_t r = j; r <= i; ++r)
    for (int32_t c = j; c <= r; ++c) s += a[static_cast<size_t>(r * n + c)] - theta;
  return s;
}

TEST(SpanDiscovery, TriangleScoresEqualBruteForceSums) {
  const int32_t n = 13;
  const auto a = random_map(n, 1);
  for (double theta : {0.0, 0.37, 0.9}) {
    const stream::TriangleScores s(a, n, theta);
    for (int32_t j = 0; j < n; ++j)
      for (int32_t i = j; i < n; ++i) EXPECT_NEAR(s.score(j, i), brute_score(a, n, theta, j, i), 1e-9) << j << "," << i;
  }
  // Rectangle masses count only causal cells.
  const stream::TriangleScores s(a, n, 0.0);
  double below = 0;
  for (int32_t r = 7; r < n; ++r)
    for (int32_t c = 2; c < 5; ++c) below += a[static_cast<size_t>(r * n + c)];
  EXPECT_NEAR(s.mass(7, n, 2, 5), below, 1e-9);
  double top = 0;
  for (size_t i : {0, 13, 14, 26, 27, 28}) top += a[i];
  EXPECT_NEAR(s.mass(0, 3, 0, n), top, 1e-9);
}

TEST(SpanDiscovery, QuantileIsNearestRankOfCausalEntries) {
  const int32_t n = 6;
  std::vector<float> a(36, 100.0f);  // above the diagonal: ignored
  std::vector<float> causal;
  for (int32_t r = 0; r < n; ++r)
    for (int32_t c = 0; c <= r; ++c) {
      a[static_cast<size_t>(r * n + c)] = static_cast<float>(r * 10 + c);
      causal.push_back(static_cast<float>(r * 10 + c));
    }
  std::sort(causal.begin(), causal.end());
  EXPECT_EQ(stream::causal_quantile(a, n, 0.9), causal[static_cast<size_t>(std::floor(0.9 * 20))]);
  EXPECT_EQ(stream::causal_quantile(a, n, 0.0), 0.0);
  EXPECT_EQ(stream::causal_quantile(a, n, 1.0), 55.0);
}

TEST(SpanDiscovery, CandidatesMatchBruteForce) {
  const int32_t n = 17;
  const auto a = random_map(n, 2);
  const double theta = 0.55;
  const stream::TriangleScores s(a, n, theta);
  // Full: every (j, i) with a positive score.
  std::vector<Span> full = stream::span_candidates(s, false), expect;
  for (int32_t j = 0; j < n; ++j)
    for (int32_t i = j; i < n; ++i)
      if (double v = brute_score(a, n, theta, j, i); v > 0) expect.push_back({j, i + 1, v});
  ASSERT_EQ(full.size(), expect.size());
  for (size_t k = 0; k < full.size(); ++k) {
    EXPECT_EQ(full[k].begin, expect[k].begin);
    EXPECT_EQ(full[k].end, expect[k].end);
    EXPECT_NEAR(full[k].score, expect[k].score, 1e-9);
  }
  // Linear: the best positive point of each anti-diagonal.
  std::vector<Span> lin = stream::span_candidates(s, true);
  std::vector<Span> best;
  for (int32_t d = 0; d <= 2 * (n - 1); ++d) {
    Span b{-1, -1, 0};
    for (const Span& c : expect)
      if (c.begin + (c.end - 1) == d && (b.begin < 0 || c.score > b.score + 1e-12)) b = c;
    if (b.begin >= 0) best.push_back(b);
  }
  ASSERT_EQ(lin.size(), best.size());
  ASSERT_FALSE(lin.empty());
  for (size_t k = 0; k < lin.size(); ++k) {
    EXPECT_EQ(lin[k].begin, best[k].begin);
    EXPECT_EQ(lin[k].end, best[k].end);
  }
}

TEST(SpanDiscovery, NmsKeepsNonOverlappingBestAndEveryDropHasACause) {
  const int32_t n = 24;
  const auto a = random_map(n, 3);
  const stream::TriangleScores s(a, n, 0.5);
  for (bool linear : {false, true}) {
    const std::vector<Span> cands = stream::span_candidates(s, linear);
    const double tau = 0.1;
    const std::vector<Span> kept = stream::nms(cands, tau);
    ASSERT_FALSE(kept.empty());
    // The best candidate is always kept; kept spans overlap by at most tau.
    const auto top = std::max_element(cands.begin(), cands.end(), [](const Span& x, const Span& y) { return x.score < y.score; });
    EXPECT_EQ(kept.front().begin, top->begin);
    EXPECT_EQ(kept.front().end, top->end);
    for (size_t i = 0; i < kept.size(); ++i)
      for (size_t j = i + 1; j < kept.size(); ++j) EXPECT_LE(stream::span_iou(kept[i], kept[j]), tau);
    // Every dropped candidate overlaps a kept one that scores at least as much by more than tau.
    for (const Span& c : cands) {
      if (std::find(kept.begin(), kept.end(), c) != kept.end()) continue;
      const bool cause = std::any_of(kept.begin(), kept.end(), [&](const Span& k) {
        return k.score >= c.score && stream::span_iou(k, c) > tau;
      });
      EXPECT_TRUE(cause) << c.begin << ".." << c.end;
    }
  }
}

// nms() keeps the best remaining candidate and drops what it suppresses, round after round; its twin here is the
// definition: sort by rank, then keep each candidate that no kept span suppresses. Equal on random candidates with
// tied scores, duplicates, nested and disjoint spans, and thresholds below 0 (everything suppresses), at 0, between,
// and at 1 (nothing does: duplicates both kept).
TEST(SpanDiscovery, NmsEqualsTheRankOrderScan) {
  auto scan = [](std::vector<Span> c, double tau) {
    std::sort(c.begin(), c.end(), stream::nms_ranks_before);
    std::vector<Span> kept;
    for (const Span& x : c)
      if (std::none_of(kept.begin(), kept.end(), [&](const Span& k) { return stream::span_iou(x, k) > tau; }))
        kept.push_back(x);
    return kept;
  };
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % 300);
    const size_t count = rng() % (trial % 3 == 0 ? 20 : 600);
    std::vector<Span> c;
    for (size_t i = 0; i < count; ++i) {
      if (!c.empty() && rng() % 10 == 0) {
        c.push_back(c[rng() % c.size()]);  // a duplicate
        continue;
      }
      const int32_t b = static_cast<int32_t>(rng() % static_cast<uint32_t>(n));
      const int32_t e = b + 1 + static_cast<int32_t>(rng() % static_cast<uint32_t>(n - b));
      c.push_back(Span{b, e, static_cast<double>(rng() % 8)});  // few distinct scores: ties ranked by begin, end
    }
    for (double tau : {-0.1, 0.0, 0.1, 0.35, 0.9, 1.0}) {
      const std::vector<Span> want = scan(c, tau), got = stream::nms(c, tau);
      ASSERT_EQ(got, want) << "trial " << trial << ", tau " << tau << ", " << c.size() << " candidates";
    }
  }
  EXPECT_TRUE(stream::nms({}, 0.1).empty());
}

TEST(SpanDiscovery, FindsTwoPlantedTriangles) {
  // Tokens [0, 5) and [5, 12) attend within their group only: two triangles.
  const int32_t n = 12;
  std::vector<float> a(static_cast<size_t>(n * n), 0.0f);
  for (int32_t r = 0; r < n; ++r)
    for (int32_t c = 0; c <= r; ++c)
      if ((r < 5) == (c < 5)) a[static_cast<size_t>(r * n + c)] = 1.0f;
  const stream::TriangleScores s(a, n, 0.5);
  for (bool linear : {false, true}) {
    std::vector<Span> kept = stream::nms(stream::span_candidates(s, linear), 0.1);
    ASSERT_EQ(kept.size(), 2u) << linear;
    EXPECT_EQ(kept[0], (Span{5, 12, 14.0}));
    EXPECT_EQ(kept[1], (Span{0, 5, 7.5}));
  }
  EXPECT_EQ(stream::span_iou({0, 5, 0}, {3, 8, 0}), 2.0 / 8.0);
}

TEST(SpanDiscovery, CoverFillsGapsAndResolvesOverlapsByScore) {
  const std::vector<Span> spans = {{2, 6, 1.0}, {5, 9, 3.0}};
  const std::vector<Span> cover = stream::cover_with_spans(spans, 12);
  const std::vector<Span> expect = {{0, 2, 0.0}, {2, 5, 1.0}, {5, 9, 3.0}, {9, 12, 0.0}};
  EXPECT_EQ(cover, expect);
}

// Host emulation of the device's span discovery (runtime/cuda/stream_decide.cu): its kernels run span_math.h's
// per-thread functions — the fixed-point prefix sums as the kernels cut them (a warp per row: 32 lanes of 4 adjacent
// entries each, the lanes' sums scanned across the warp step by step with the row's carry; then strips of 32 rows: each strip's column sums, then its rows
// from the strips above), the radix select's four passes (order_key, pick_digit; the device's atomic counts are
// integers, so any order gives the same histogram), and per anti-diagonal one warp: diagonal_best_lane on each of 32
// lanes, combined by the kernel's butterfly of diagonal_better — which are run here thread after thread.
struct EmulatedSpanKernels {
  std::vector<uint64_t> prefix;
  double theta = 0;
  std::vector<Span> candidates;
};

EmulatedSpanKernels emulate_span_kernels(const std::vector<float>& map, int32_t n, double quantile) {
  namespace sm = stream::span_math;
  EmulatedSpanKernels e;
  const size_t w = static_cast<size_t>(n) + 1;
  e.prefix.assign(w * w, 0);
  for (int32_t r = 0; r < n; ++r) {  // prefix_rows_kernel: 32 lanes of 4 adjacent entries a step
    uint64_t carry = 0;
    for (int32_t c0 = 0; c0 < n; c0 += 128) {
      uint64_t v[32][4], incl[32];
      for (int32_t l = 0; l < 32; ++l) {
        for (int32_t i = 0; i < 4; ++i) {
          const int32_t c = c0 + 4 * l + i;
          v[l][i] = c <= r && c < n ? sm::fixed_mass(map[static_cast<size_t>(r * n + c)]) : 0;
          if (i > 0) v[l][i] += v[l][i - 1];
        }
        incl[l] = v[l][3];
      }
      for (int32_t off = 1; off < 32; off <<= 1)  // Hillis-Steele: every lane reads the values before the step
        for (int32_t l = 31; l >= off; --l) incl[l] += incl[l - off];
      for (int32_t l = 0; l < 32; ++l)
        for (int32_t i = 0; i < 4; ++i) {
          const int32_t c = c0 + 4 * l + i;
          if (c < n) e.prefix[(static_cast<size_t>(r) + 1) * w + static_cast<size_t>(c) + 1] = carry + incl[l] - v[l][3] + v[l][i];
        }
      carry += incl[31];
    }
  }
  const int32_t strips = (n + 31) / 32;  // prefix_strips_kernel, then prefix_apply_kernel
  std::vector<uint64_t> sums(static_cast<size_t>(strips) * static_cast<size_t>(n), 0);
  for (int32_t s = 0; s < strips; ++s)
    for (int32_t c = 0; c < n; ++c)
      for (int32_t r = 32 * s; r < std::min(n, 32 * s + 32); ++r)
        sums[static_cast<size_t>(s * n + c)] += e.prefix[(static_cast<size_t>(r) + 1) * w + static_cast<size_t>(c) + 1];
  for (int32_t s = strips - 1; s >= 0; --s)  // (every strip reads its own rows before any is rewritten: any order)
    for (int32_t c = 0; c < n; ++c) {
      uint64_t acc = 0;
      for (int32_t t = 0; t < s; ++t) acc += sums[static_cast<size_t>(t * n + c)];
      for (int32_t r = 32 * s; r < std::min(n, 32 * s + 32); ++r) {
        uint64_t& p = e.prefix[(static_cast<size_t>(r) + 1) * w + static_cast<size_t>(c) + 1];
        p = acc += p;
      }
    }
  uint64_t rank = sm::quantile_rank(quantile, static_cast<uint64_t>(n) * static_cast<uint64_t>(n + 1) / 2);
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    uint32_t hist[256] = {};
    for (int32_t r = 0; r < n; ++r)
      for (int32_t c = 0; c <= r; ++c) {
        const uint32_t key = sm::order_key(map[static_cast<size_t>(r * n + c)]);
        if ((key & mask) == prefix) ++hist[(key >> shift) & 255u];
      }
    prefix |= sm::pick_digit(hist, &rank) << shift;
    mask |= 255u << shift;
  }
  e.theta = static_cast<double>(sm::from_order_key(prefix));
  // One warp per anti-diagonal: 32 lanes' shares, then the butterfly of __shfl_xor_sync (offsets 16, 8, 4, 2, 1).
  for (int32_t d = 0; d < 2 * n - 1; ++d) {
    struct Lane {
      bool any = false;
      int32_t j = -1;
      double v = 0;
    } lanes[32];
    for (int32_t l = 0; l < 32; ++l) lanes[l].any = sm::diagonal_best_lane(e.prefix.data(), n, e.theta, d, l, 32, &lanes[l].j, &lanes[l].v);
    for (int32_t off = 16; off > 0; off >>= 1) {
      Lane next[32];
      for (int32_t l = 0; l < 32; ++l) {
        const Lane& me = lanes[l];
        const Lane& other = lanes[l ^ off];
        next[l] = other.any && (!me.any || sm::diagonal_better(other.v, other.j, me.v, me.j)) ? other : me;
      }
      std::copy(next, next + 32, lanes);
    }
    Span one;
    const bool any = sm::diagonal_best(e.prefix.data(), n, e.theta, d, &one.begin, &one.end, &one.score);
    EXPECT_EQ(any, lanes[0].any) << d;
    if (lanes[0].any) {
      e.candidates.push_back(Span{lanes[0].j, d - lanes[0].j + 1, lanes[0].v});
      EXPECT_EQ(one, e.candidates.back()) << d;  // the one-lane scan finds the same point
    }
  }
  return e;
}

// A chunk's map as the device makes it: softmax rows summed over heads (ties, tiny and equal entries included).
std::vector<float> softmax_map(int32_t n, int32_t heads, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<float> map(static_cast<size_t>(n * n), 0.0f);
  for (int32_t h = 0; h < heads; ++h)
    for (int32_t r = 0; r < n; ++r) {
      std::vector<float> row(static_cast<size_t>(r + 1));
      float mx = -1e30f, z = 0;
      for (float& x : row) mx = std::max(mx, x = (h == 0 && r % 5 == 0) ? 0.0f : g(rng));
      for (float& x : row) z += (x = std::exp(x - mx));
      for (int32_t c = 0; c <= r; ++c) map[static_cast<size_t>(r * n + c)] += row[static_cast<size_t>(c)] / z;
    }
  return map;
}

// The prefix sums' fixed point (span_math.h): an entry moves by at most half a unit of 2^-36, so a mass of k cells is
// within k * 2^-37 of the exact sum (long double here); NaN counts as 0, infinities and huge values as the clamp.
TEST(SpanDiscovery, FixedPointMassesStayWithinHalfAUnitPerCell) {
  namespace sm = stream::span_math;
  const int32_t n = 300;
  const std::vector<float> a = softmax_map(n, 32, 5);
  const stream::TriangleScores s(a, n, 0.0);
  const long double unit = std::ldexp(1.0L, -sm::kMassBits);
  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> pick(0, n);
  for (int i = 0; i < 2000; ++i) {
    int32_t r0 = pick(rng), r1 = pick(rng), c0 = pick(rng), c1 = pick(rng);
    if (r0 > r1) std::swap(r0, r1);
    if (c0 > c1) std::swap(c0, c1);
    long double exact = 0;
    int64_t cells = 0;
    for (int32_t r = r0; r < r1; ++r)
      for (int32_t c = c0; c < std::min(c1, r + 1); ++c) {
        exact += a[static_cast<size_t>(r * n + c)];
        ++cells;
      }
    const long double got = s.mass(r0, r1, c0, c1);
    ASSERT_LE(std::fabs(got - exact), static_cast<long double>(cells) * unit / 2 + std::fabs(exact) * 0x1p-52L)
        << r0 << " " << r1 << " " << c0 << " " << c1;
  }
  EXPECT_EQ(sm::fixed_mass(std::nanf("")), 0u);
  EXPECT_EQ(sm::fixed_mass(1.0f), uint64_t{1} << sm::kMassBits);
  EXPECT_EQ(sm::fixed_mass(std::ldexp(1.0f, -40)), 0u);       // 1/16 of a unit: rounds to 0
  EXPECT_EQ(sm::fixed_mass(std::ldexp(3.0f, -38)), 1u);       // 0.75 of a unit: to 1
  EXPECT_EQ(sm::fixed_mass(std::ldexp(1.0f, -37)), 0u);       // half a unit: ties to even (0)
  EXPECT_EQ(sm::fixed_mass(std::ldexp(3.0f, -37)), 2u);       // 1.5 units: ties to even (2)
  EXPECT_EQ(sm::fixed_mass(INFINITY), uint64_t{1} << (sm::kMassBits + sm::kMassClamp));
  EXPECT_EQ(sm::fixed_mass(-1e30f), static_cast<uint64_t>(-(int64_t{1} << (sm::kMassBits + sm::kMassClamp))));
  EXPECT_EQ(sm::mass_value(static_cast<uint64_t>(-(int64_t{3} << sm::kMassBits))), -3.0);
  // A map holding NaN and infinities still gives defined masses: the clamped values' sums.
  std::vector<float> bad(16, 1.0f);
  bad[5] = std::nanf("");
  bad[10] = INFINITY;
  const stream::TriangleScores b(bad, 4, 0.0);
  EXPECT_EQ(b.mass(0, 2, 0, 2), 2.0);  // rows 0-1: a[0], a[4] (a[5] is NaN: 0)
  EXPECT_EQ(b.mass(2, 3, 0, 4), 2.0 + std::ldexp(1.0, sm::kMassClamp));
}

// The device's theta, triangle scores, candidates and span masses EQUAL the CPU's (span_discovery.h) on the same map,
// bit for bit; the spans from the device's candidates (NMS and the cover on the host) are the CPU's spans.
TEST(SpanDiscovery, DeviceKernelsEqualTheCpuOnTheSameMap) {
  int32_t checked = 0;
  for (const int32_t n : {1, 2, 3, 7, 40, 97, 256}) {
    for (const uint32_t seed : {1u, 2u}) {
      const std::vector<float> map = seed == 1 ? softmax_map(n, 4, 100 + static_cast<uint32_t>(n)) : random_map(n, 7);
      for (const double q : {0.0, 0.5, 0.9, 1.0}) {
        SCOPED_TRACE("n " + std::to_string(n) + " seed " + std::to_string(seed) + " quantile " + std::to_string(q));
        const EmulatedSpanKernels e = emulate_span_kernels(map, n, q);
        const double theta = stream::causal_quantile(map, n, q);
        ASSERT_EQ(e.theta, theta);
        const stream::TriangleScores ts(map, n, theta);
        for (int32_t j = 0; j < n; ++j)
          for (int32_t i = j; i < n; ++i)
            ASSERT_EQ(stream::span_math::triangle_score(e.prefix.data(), n, e.theta, j, i), ts.score(j, i))
                << j << ", " << i;
        const std::vector<Span> cands = stream::span_candidates(ts, true);
        ASSERT_EQ(e.candidates, cands);
        const std::vector<Span> spans = stream::cover_with_spans(stream::nms(e.candidates, 0.1), n);
        EXPECT_EQ(stream::spans_from_candidates(e.candidates, 0.1), stream::discover_spans(map, n, {q, 0.1, true}));
        for (const Span& sp : spans) {
          const stream::SpanMasses dev{stream::span_math::mass(e.prefix.data(), n, sp.begin, sp.end, sp.begin, sp.end),
                                       stream::span_math::mass(e.prefix.data(), n, sp.end, n, sp.begin, sp.end)};
          ASSERT_EQ(dev, stream::span_masses(ts, sp));
        }
        checked += static_cast<int32_t>(cands.size());
      }
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(SpanIndex, AreaRatioIsTriangleMassOverItselfAndItsVoters) {
  const int32_t n = 10;
  const auto a = random_map(n, 4);
  const stream::TriangleScores s(a, n, 0.3);
  double tri = 0, below = 0;
  for (int32_t r = 3; r < n; ++r)
    for (int32_t c = 3; c <= std::min(r, 5); ++c) (r <= 5 ? tri : below) += a[static_cast<size_t>(r * n + c)];
  EXPECT_NEAR(stream::area_ratio(s, {3, 6, 0}), tri / (tri + below), 1e-9);
  EXPECT_EQ(stream::area_ratio(s, {7, 10, 0}), 1.0);  // no later rows: no voters
}

TEST(SpanIndex, RetentionFollowsTheAreaRatio) {
  EXPECT_EQ(stream::retained_vectors(20, 1.0, 3, 1, 12), 12);   // clamped to max
  EXPECT_EQ(stream::retained_vectors(20, 0.5, 3, 1, 12), 3);    // 20 * 0.125 = 2.5 -> 3
  EXPECT_EQ(stream::retained_vectors(20, 0.5, 20, 1, 12), 1);   // lambda 20: the minimum
  EXPECT_EQ(stream::retained_vectors(20, 0.5, 20, 2, 12), 2);
  EXPECT_EQ(stream::retained_vectors(3, 1.0, 3, 1, 12), 3);     // never more than the span
  EXPECT_EQ(stream::top_voted(std::vector<float>{0.1f, 5, 2, 5, 0.3f}, 0, 5, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(stream::top_voted(std::vector<float>{0.1f, 5, 2, 5, 0.3f}, 2, 5, 1), (std::vector<int32_t>{3}));
}

// The per-layer lambda search (Sec. 3.3.2): the table's vector count is the sum of the spans' counts with r at its
// range's upper edge (an upper bound of the exact counts), never increases with lambda, and the lambda chosen is the
// smallest that meets the ratio.
TEST(SpanIndex, LambdaSearchMeetsTheRatioWithTheSmallestLambda) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<int32_t> len(1, 64);
  std::uniform_real_distribution<double> ratio(0.0, 1.0);
  stream::LambdaTable table;
  std::vector<std::pair<int32_t, double>> spans;
  int64_t tokens = 0;
  for (int i = 0; i < 500; ++i) {
    spans.emplace_back(len(rng), ratio(rng));
    table.add(spans.back().first, spans.back().second);
    tokens += spans.back().first;
  }
  spans.emplace_back(7, 1.0);  // r = 1 lands in the last range
  table.add(7, 1.0);
  tokens += 7;
  EXPECT_EQ(table.tokens(), tokens);
  EXPECT_EQ(table.spans(), 501);
  int64_t last = std::numeric_limits<int64_t>::max();
  for (double lambda : {0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 20.0, 64.0}) {
    int64_t upper = 0, exact = 0;
    for (const auto& [l, r] : spans) {
      const double edge = std::min(std::floor(r * 256) + 1, 256.0) / 256;
      upper += stream::retained_vectors(l, edge, lambda, 1, 12);
      exact += stream::retained_vectors(l, r, lambda, 1, 12);
    }
    const int64_t v = table.vectors(lambda, 1, 12);
    EXPECT_EQ(v, upper) << lambda;
    EXPECT_GE(v, exact) << lambda;
    EXPECT_LE(v, last) << lambda;  // never increases with lambda
    last = v;
  }
  // At the cap every span keeps its minimum but those in r's last range (r = 1 there: no voters), which keep all
  // they may.
  int64_t floor_count = 0;
  for (const auto& [l, r] : spans) floor_count += std::floor(r * 256) >= 255 ? std::min(l, 12) : 1;
  EXPECT_EQ(table.vectors(stream::LambdaTable::kMaxLambda, 1, 12), floor_count);
  auto meets = [&](double target, double lambda) {
    return static_cast<double>(tokens) >= target * static_cast<double>(table.vectors(lambda, 1, 12));
  };
  EXPECT_FALSE(meets(4, 0));  // lambda 0 keeps min(length, 12) per span: ~3 tokens per vector here
  double prev = 0;
  for (double target : {4.0, 8.0, 16.0, 24.0, 30.0}) {
    const double lambda = table.smallest_lambda(target, 1, 12);
    EXPECT_GE(lambda, prev) << target;  // a higher ratio needs a larger lambda
    EXPECT_GT(lambda, 1e-3) << target;
    EXPECT_LT(lambda, stream::LambdaTable::kMaxLambda) << target;
    prev = lambda;
    EXPECT_TRUE(meets(target, lambda)) << target;
    EXPECT_FALSE(meets(target, lambda - 2e-6)) << target;  // the smallest: any lambda below it misses
  }
  // Ratio 1 is met by any lambda (a span keeps at most its length); one over tokens per span by none (the cap).
  EXPECT_LE(table.smallest_lambda(1, 1, 12), 1e-6);
  EXPECT_EQ(table.smallest_lambda(1000, 1, 12), stream::LambdaTable::kMaxLambda);
  EXPECT_FALSE(meets(1000, stream::LambdaTable::kMaxLambda));
  // min_vectors raises the floor.
  EXPECT_GT(table.vectors(stream::LambdaTable::kMaxLambda, 2, 12), floor_count);
  // Bad targets, with the flag's message.
  for (const auto& [bad, msg] : std::vector<std::pair<double, std::string>>{{0.5, "0.5"}, {-2, "-2"}, {NAN, "nan"}}) {
    try {
      table.smallest_lambda(bad, 1, 12);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "--stream-index-ratio must be at least 1 (evicted tokens per index vector), got " + msg);
    }
  }
  StreamOptions o;
  o.method = StreamMethod::Ltri;
  o.index_ratio = -1;
  try {
    check_stream_options(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--stream-index-ratio must be at least 1 (evicted tokens per index vector), got -1");
  }
  o.index_ratio = 0;  // the fixed lambdas
  EXPECT_NO_THROW(check_stream_options(o));
  table.clear();
  EXPECT_EQ(table.tokens(), 0);
  EXPECT_EQ(table.vectors(3, 1, 12), 0);
}

// Naive Ltri retrieval: sim(t, s) = sum_h w_h mean_a max_b q.k, block = sum_t max_s.
TEST(SpanIndex, BlockScoresEqualNaiveReference) {
  const stream::HeadShape shape{4, 2, 8};
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  stream::SpanIndex index(shape);
  struct Stored { int32_t block; std::vector<float> keys; int32_t count; };
  std::vector<Stored> stored;
  const std::vector<int32_t> blocks = {0, 0, 1, 2, 2, 2, 3};
  for (int32_t b : blocks) {
    const int32_t count = 1 + static_cast<int32_t>(rng() % 3);
    std::vector<float> keys(static_cast<size_t>(count * 2 * 8));
    for (auto& x : keys) x = g(rng);
    index.add(b, keys, count);
    stored.push_back({b, keys, count});
  }
  const std::vector<int32_t> qcounts = {2, 1, 3};
  std::vector<float> queries(6 * 4 * 8);
  for (auto& x : queries) x = g(rng);
  const stream::HeadWeights w = {0.5, 0.0, 1.0, 0.25};
  const std::vector<double> got = index.block_scores(queries, qcounts, w);
  ASSERT_EQ(got.size(), 4u);
  for (int32_t b = 0; b < 4; ++b) {
    double expect = 0;
    int32_t first = 0;
    for (int32_t m : qcounts) {
      double best = -1e300;
      for (const Stored& s : stored) {
        if (s.block != b) continue;
        double sim = 0;
        for (int32_t h = 0; h < 4; ++h) {
          double mean = 0;
          for (int32_t a = 0; a < m; ++a) {
            double mx = -1e300;
            for (int32_t k = 0; k < s.count; ++k) {
              double dot = 0;
              for (int32_t i = 0; i < 8; ++i)
                dot += queries[static_cast<size_t>(((first + a) * 4 + h) * 8 + i)] *
                       s.keys[static_cast<size_t>((k * 2 + h / 2) * 8 + i)];
              mx = std::max(mx, dot);
            }
            mean += mx / m;
          }
          sim += w[static_cast<size_t>(h)] * mean;
        }
        best = std::max(best, sim);
      }
      expect += best;
      first += m;
    }
    EXPECT_NEAR(got[static_cast<size_t>(b)], expect, 1e-4) << b;
  }
  EXPECT_EQ(index.num_vectors(), static_cast<int64_t>(index.bytes() / (2 * 8 * 4)));
  // Top-K: by score, ties to the earlier block, returned in block order.
  EXPECT_EQ(stream::top_blocks(std::vector<double>{1, 5, 3, 5, 0}, 2), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(stream::top_blocks(std::vector<double>{1, 5, 3, 5, 0}, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(stream::top_blocks(std::vector<double>{1, 5}, 7), (std::vector<int32_t>{0, 1}));
}

// top_blocks (one pass keeping a heap of the best k) against the obvious twin: every index stably sorted by score
// descending, the first k, in block order. Scores drawn from few values (many ties), with -inf and +inf among them;
// k from 0 past the count; then long runs (up to 20,000 blocks, k up to 64, as retrieval's top-32 of a 1M index) of
// few or many distinct values.
TEST(SpanIndex, TopBlocksEqualsAFullSort) {
  std::mt19937 rng(17);
  const double inf = std::numeric_limits<double>::infinity();
  for (int trial = 0; trial < 460; ++trial) {
    const bool long_run = trial >= 400;
    const int n = 1 + static_cast<int>(rng() % (long_run ? 20000 : 300));
    const int distinct = 1 + static_cast<int>(rng() % (long_run && trial % 2 == 0 ? 100000 : 12));
    std::vector<double> scores(static_cast<size_t>(n));
    for (double& x : scores) {
      const uint32_t r = rng() % 20;
      x = r == 0 ? -inf : r == 1 ? inf : static_cast<double>(rng() % distinct) * 0.25 - 1.0;
    }
    const int k = static_cast<int>(rng() % (long_run ? 65 : n + 3));
    std::vector<int32_t> want(static_cast<size_t>(n));
    std::iota(want.begin(), want.end(), 0);
    std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) {
      return scores[static_cast<size_t>(a)] > scores[static_cast<size_t>(b)];
    });
    want.resize(static_cast<size_t>(std::min(k, n)));
    std::sort(want.begin(), want.end());
    ASSERT_EQ(stream::top_blocks(scores, k), want) << "trial " << trial << ", n " << n << ", k " << k;
  }
}

TEST(SpanIndex, InfLLMScoresEqualNaiveReference) {
  const stream::HeadShape shape{4, 2, 8};
  std::mt19937 rng(6);
  std::normal_distribution<float> g;
  stream::ReprIndex index(shape);
  std::vector<std::vector<float>> blocks;
  for (int b = 0; b < 5; ++b) {
    std::vector<float> keys(3 * 2 * 8);
    for (auto& x : keys) x = g(rng);
    index.add(keys, 3);
    blocks.push_back(keys);
  }
  const int32_t n = 7;
  std::vector<float> q(static_cast<size_t>(n * 4 * 8));
  for (auto& x : q) x = g(rng);
  const stream::HeadWeights w(4, 0.25);
  const std::vector<double> got = index.block_scores(q, n, w);
  for (int b = 0; b < 5; ++b) {
    double s = 0;  // sum over queries and representative keys, averaged
    for (int32_t i = 0; i < n; ++i)
      for (int32_t r = 0; r < 3; ++r)
        for (int32_t h = 0; h < 4; ++h)
          for (int32_t e = 0; e < 8; ++e)
            s += 0.25 * q[static_cast<size_t>((i * 4 + h) * 8 + e)] * blocks[static_cast<size_t>(b)][static_cast<size_t>((r * 2 + h / 2) * 8 + e)] / (n * 3);
    EXPECT_NEAR(got[static_cast<size_t>(b)], s, 1e-4);
  }
  EXPECT_EQ(index.num_vectors(), 15);
}

// The streaming layout's attention equals dense attention with the same explicit mask, in f64: query row r of
// head h sees every global key through q_global and the local keys [G, G + L + r] through q_local.
void check_layout_attention(const stream::StreamLayout& lay, int32_t nq, int32_t nkv, int32_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  const int32_t n = lay.chunk, kv = lay.kv_len();
  std::vector<float> ql(static_cast<size_t>(n * nq * d)), qg(ql.size()), k(static_cast<size_t>(kv * nkv * d)), v(k.size()),
      out(ql.size());
  for (auto* x : {&ql, &qg, &k, &v})
    for (auto& e : *x) e = g(rng);
  ThreadPool pool(2);
  std::vector<float> lse(static_cast<size_t>(nq * n));
  stream::streaming_attention_cpu(lay, TensorView(ql.data(), DType::F32, {n, nq, d}),
                                  TensorView(qg.data(), DType::F32, {n, nq, d}), TensorView(k.data(), DType::F32, {kv, nkv, d}),
                                  TensorView(v.data(), DType::F32, {kv, nkv, d}), TensorView(out.data(), DType::F32, {n, nq, d}),
                                  0.0f, pool, lse.data());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double worst = 0;
  for (int32_t r = 0; r < n; ++r)
    for (int32_t h = 0; h < nq; ++h) {
      const int32_t kvh = h / (nq / nkv);
      std::vector<double> s;
      std::vector<int32_t> keys;
      for (int32_t j = 0; j < kv; ++j) {
        const bool global = j < lay.global, local = j >= lay.global && j <= lay.global + lay.local + r;
        if (!global && !local) continue;
        const float* q = (global ? qg : ql).data() + (r * nq + h) * d;
        double dot = 0;
        for (int32_t e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * k[static_cast<size_t>((j * nkv + kvh) * d + e)];
        s.push_back(dot * scale);
        keys.push_back(j);
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double x : s) z += std::exp(x - m);
      EXPECT_NEAR(lse[static_cast<size_t>(h * n + r)], m + std::log(z), 1e-4);
      for (int32_t e = 0; e < d; ++e) {
        double o = 0;
        for (size_t i = 0; i < s.size(); ++i)
          o += std::exp(s[i] - m) / z * v[static_cast<size_t>((keys[i] * nkv + kvh) * d + e)];
        worst = std::max(worst, std::fabs(o - out[static_cast<size_t>((r * nq + h) * d + e)]));
      }
    }
  EXPECT_LT(worst, 2e-5) << "global " << lay.global << " local " << lay.local << " chunk " << lay.chunk;
}

TEST(StreamLayout, AttentionEqualsMaskedF64Reference) {
  check_layout_attention({70, 45, 37}, 4, 2, 16, 1);
  check_layout_attention({0, 45, 37}, 4, 2, 16, 2);    // nothing evicted yet: the chunk sees its past densely
  check_layout_attention({131, 0, 70}, 6, 3, 8, 3);    // no local window, tiles of a short last piece
  check_layout_attention({5, 200, 1}, 2, 1, 32, 4);    // decode
}

TEST(StreamLayout, LowersToTwoValidIndexes) {
  const stream::StreamLayout lay{70, 45, 100};
  const stream::StreamIndexes ix = stream::lower_stream_layout(lay, 3, 64);
  ix.global.validate();
  ix.local.validate();
  for (int32_t h = 0; h < 3; ++h)
    for (int32_t r = 0; r < lay.chunk; r += 7)
      for (int32_t j = 0; j < lay.kv_len(); ++j) {
        EXPECT_EQ(ix.global.visible(h, r, j), j < 70);
        EXPECT_EQ(ix.local.visible(h, r, j), j >= 70 && j <= 70 + 45 + r);
      }
}

TEST(HostBlockStore, BudgetErrorsSayWhatIsNeeded) {
  // One block: 4 tokens x 2 kv heads x 8 dims, K and V in f32 = 512 bytes.
  stream::HostBlockStore store(2, 2, 8, 4, 1200);
  EXPECT_EQ(store.block_bytes(), 512);
  const std::vector<float> k(64, 1.0f), v(64, 2.0f);
  store.add(0, k, v);
  store.add(1, k, v);
  EXPECT_EQ(store.bytes(), 1024);
  EXPECT_EQ(store.k(1, 0)[5], 1.0f);
  EXPECT_EQ(store.v(0, 0)[63], 2.0f);
  try {
    store.add(0, k, v);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "streaming host store is full: block 1 of layer 0 needs 512 B more, over the budget of 1.20 kB for "
                 "evicted KV blocks (holding 2 blocks, 1.02 kB); raise --stream-host-budget or shorten the prompt");
  }
  EXPECT_EQ(store.blocks(0), 1);  // unchanged
  EXPECT_EQ(store.bytes(), 1024);
}

TEST(StreamingKV, SequenceOverTheHostBudgetIsRefusedUpFront) {
  StreamOptions o = small_stream(StreamMethod::Ltri);
  o.host_budget = 100000;
  const ModelConfig& cfg = model("smollm2").config();  // 3 layers x 1 kv head x 16 dims: 2 KiB per block and layer
  StreamingKV kv(cfg, o);
  kv.check_sequence(8 + 32 + 16 * 16);  // 16 blocks: 96 kB
  try {
    kv.check_sequence(10000);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "streaming: a sequence of 10,000 tokens evicts 622 blocks of 16 tokens per layer, whose K and V "
                 "need 3.82 MB of host memory (3 layers), over the budget of 100 kB for evicted KV blocks; raise "
                 "--stream-host-budget or shorten the prompt");
  }
  // Only global layers keep evicted blocks: Gemma-3's fixture has 1 of 6 (1 kv head x 16 dims: 2 KiB per block).
  StreamingKV gemma(model("gemma3").config(), o);
  EXPECT_EQ(gemma.global_layers(), 1);
  gemma.check_sequence(8 + 32 + 48 * 16);  // 48 blocks: 96 kB
  try {
    gemma.check_sequence(10000);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "streaming: a sequence of 10,000 tokens evicts 622 blocks of 16 tokens per layer, whose K and V "
                 "need 1.27 MB of host memory (1 global layer of 6), over the budget of 100 kB for evicted KV blocks; "
                 "raise --stream-host-budget or shorten the prompt");
  }
  // The engine refuses such a prompt before any work.
  EngineOptions eo;
  eo.stream = o;
  Engine engine(model("smollm2"), eo);
  const std::vector<int32_t> prompt(10000, 5);
  EXPECT_THROW(engine.prefill(prompt), Error);
  EXPECT_EQ(engine.position(), 0);
}

TEST(StreamingKV, RefusesModelsAndOptionsItCannotRun) {
  // Gemma-3 streams on the CPU and its decisions run with Storage::Device (sliding-window layers too); the GPU path
  // (GpuStreamingKV) refuses a head_dim the CUDA sparse executor does not run (the fixture's 16).
  const ModelConfig& c = model("gemma3").config();
  EXPECT_NO_THROW(StreamingKV(c, small_stream(StreamMethod::Ltri)));
  EXPECT_NO_THROW(StreamingKV(c, small_stream(StreamMethod::Ltri), StreamingKV::Storage::Device));
  EXPECT_NO_THROW(check_model_streams(c, false));
  try {
    check_model_streams(c, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "model " + c.name + " cannot stream on the GPU: its head_dim 16 is not one the CUDA sparse executor "
              "runs (64, 128 or 256); the CPU path streams it (--device cpu)");
  }
  ModelConfig c64 = c;
  c64.head_dim = 64;
  EXPECT_NO_THROW(check_model_streams(c64, true));
  StreamOptions bad = small_stream(StreamMethod::Ltri);
  bad.block = 0;
  EXPECT_THROW(StreamingKV(model("smollm2").config(), bad), Error);
  EXPECT_THROW(parse_stream_method("h2o"), Error);
  EXPECT_EQ(parse_stream_method("infllm"), StreamMethod::InfLLM);
}

// The GPU path's decisions (Storage::Device, plan()) are the CPU path's: the same layouts, retrieved blocks, evictions
// and index on the same q, k, v, chunk after chunk (prefill chunks, the last one, decode), for every method; the
// block rows are only counted (bf16: half the host path's bytes).
// The entry point the GPU's device decisions take (plan() with DeviceDecisions): given the map, votes and block
// scores the CPU computes itself, it decides exactly as plan() computing them (the GPU path's single source of truth),
// asks the block scores for the query vectors the CPU's own retrieval builds, and refuses sizes that do not fit.
TEST(StreamingKV, DeviceDecisionsDecideAsTheCpuOnTheSameMapAndScores) {
  const ModelConfig& cfg = model("llama3").config();
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    const StreamOptions o = small_stream(m);
    StreamingKV own(cfg, o, StreamingKV::Storage::Device), fed(cfg, o, StreamingKV::Storage::Device);
    // emu: what the GPU path hands over without the map — span candidates (the device's, emulated above), the
    // masses of the spans it asks for, the evictions' index keys from a "ring" of every raw K row, and a ready().
    StreamingKV emu(cfg, o, StreamingKV::Storage::Device);
    std::vector<float> ring;  // raw K of every position so far
    std::vector<std::vector<float>> mirror(static_cast<size_t>(cfg.num_layers));  // ltri: the keys kept on the "device"
    int32_t asked_masses = 0, asked_keys = 0, readies = 0;
    std::mt19937 rng(13);
    std::normal_distribution<float> g(0.0f, 1.0f);
    int32_t pos = 0, scored = 0;
    std::vector<std::pair<int32_t, StreamingKV::ChunkKind>> chunks(12, {16, StreamingKV::ChunkKind::Prefill});
    chunks.push_back({5, StreamingKV::ChunkKind::LastPrefill});
    for (int i = 0; i < 2; ++i) chunks.push_back({1, StreamingKV::ChunkKind::Decode});
    for (const auto& [n, kind] : chunks) {
      own.begin_chunk(pos, n, kind);
      fed.begin_chunk(pos, n, kind);
      emu.begin_chunk(pos, n, kind);
      for (int32_t l = 0; l < cfg.num_layers; ++l) {
        std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * nkv * d));
        for (auto* t : {&q, &k})
          for (float& x : *t) x = g(rng);
        const stream::StreamLayout lay = own.plan(l, pos, n, q.data(), k.data(), inv_freq, 0.0f);
        {
          const int64_t row = static_cast<int64_t>(nkv) * d, layers = cfg.num_layers;
          ring.resize(static_cast<size_t>((pos + n) * layers * row));
          std::copy(k.begin(), k.end(), ring.begin() + (static_cast<int64_t>(pos) * layers + l * n) * row);
          auto ring_row = [&](int32_t p) {  // position p of layer l: chunks are stored [layers, n] one after another
            int32_t c0 = 0;
            for (const auto& [cn, ck] : chunks) {
              if (p < c0 + cn) return ring.begin() + (static_cast<int64_t>(c0) * layers + l * cn + (p - c0)) * row;
              c0 += cn;
            }
            return ring.end();
          };
          const EmulatedSpanKernels e = emulate_span_kernels(own.last_map(), n, o.theta_quantile);
          StreamingKV::DeviceDecisions dev;
          const std::vector<float> votes = own.last_votes();
          dev.votes = votes;
          dev.has_candidates = m == StreamMethod::Ltri;
          dev.ready = [&] { ++readies; };
          if (m == StreamMethod::Ltri) dev.candidates = e.candidates;
          dev.span_masses = [&](std::span<const Span> spans) {
            ++asked_masses;
            std::vector<stream::SpanMasses> out;
            for (const Span& sp : spans)
              out.push_back({stream::span_math::mass(e.prefix.data(), n, sp.begin, sp.end, sp.begin, sp.end),
                             stream::span_math::mass(e.prefix.data(), n, sp.end, n, sp.begin, sp.end)});
            return out;
          };
          // ltri: the keys stay on the "device" (mirror[l], appended in order); infllm: they come back.
          dev.keys_on_device = m == StreamMethod::Ltri;
          dev.index_keys = [&](std::span<const int32_t> positions) {
            ++asked_keys;
            std::vector<float> out;
            for (int32_t p : positions) {
              EXPECT_TRUE(p >= o.sinks && p < pos) << p;
              out.insert(out.end(), ring_row(p), ring_row(p) + row);
            }
            if (m != StreamMethod::Ltri) return out;
            mirror[static_cast<size_t>(l)].insert(mirror[static_cast<size_t>(l)].end(), out.begin(), out.end());
            return std::vector<float>{};
          };
          dev.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                 const stream::HeadWeights& w) {
            if (m == StreamMethod::InfLLM) return emu.repr_index(l).block_scores(q, n, w);
            std::vector<float> queries;
            for (int32_t t : tokens) queries.insert(queries.end(), q.begin() + t * nq * d, q.begin() + (t + 1) * nq * d);
            EXPECT_FALSE(emu.span_index(l).holds_keys());  // scored where the keys are: own's equal index here
            return own.span_index(l).block_scores(queries, counts, w);
          };
          EXPECT_EQ(emu.plan(l, pos, n, nullptr, inv_freq, dev), lay) << "layer " << l << " at " << pos;
          EXPECT_EQ(emu.retrieved(l), own.retrieved(l)) << "layer " << l << " at " << pos;
          if (m == StreamMethod::Ltri) {
            EXPECT_TRUE(std::ranges::equal(mirror[static_cast<size_t>(l)], own.span_index(l).keys()));
            EXPECT_EQ(emu.span_index(l).num_vectors(), own.span_index(l).num_vectors());
            EXPECT_TRUE(std::equal(emu.span_index(l).span_count().begin(), emu.span_index(l).span_count().end(),
                                   own.span_index(l).span_count().begin(), own.span_index(l).span_count().end()));
          } else {
            for (int32_t b = 0; b < own.repr_index(l).num_blocks(); ++b)
              EXPECT_TRUE(std::ranges::equal(emu.repr_index(l).mean(b), own.repr_index(l).mean(b)));
          }
        }
        StreamingKV::DeviceDecisions given;
        const std::vector<float> map = own.last_map(), votes = own.last_votes();
        if (m == StreamMethod::Ltri) given.map = map;
        given.votes = votes;
        given.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                 const stream::HeadWeights& w) {
          ++scored;
          if (m == StreamMethod::InfLLM) {
            EXPECT_TRUE(tokens.empty() && counts.empty());
            return fed.repr_index(l).block_scores(q, n, w);
          }
          int64_t total = 0;
          for (int32_t c : counts) total += c;
          EXPECT_EQ(total, static_cast<int64_t>(tokens.size()));
          std::vector<float> queries;
          for (int32_t t : tokens) {
            EXPECT_TRUE(t >= 0 && t < n);
            queries.insert(queries.end(), q.begin() + t * nq * d, q.begin() + (t + 1) * nq * d);
          }
          return fed.span_index(l).block_scores(queries, counts, w);
        };
        EXPECT_EQ(fed.plan(l, pos, n, k.data(), inv_freq, given), lay) << "layer " << l << " at " << pos;
        EXPECT_EQ(fed.retrieved(l), own.retrieved(l)) << "layer " << l << " at " << pos;
        EXPECT_EQ(fed.last_votes(), own.last_votes());
      }
      pos += n;
    }
    EXPECT_GT(scored, 10);
    const StreamStats a = own.stats(), b = fed.stats(), c = emu.stats();
    EXPECT_EQ(a.index_vectors, b.index_vectors);
    EXPECT_EQ(a.index_spans, b.index_spans);
    EXPECT_EQ(a.host_bytes, b.host_bytes);
    EXPECT_EQ(a.index_vectors, c.index_vectors);
    EXPECT_EQ(a.index_spans, c.index_spans);
    EXPECT_EQ(a.host_bytes, c.host_bytes);
    EXPECT_EQ(readies, static_cast<int32_t>(chunks.size()) * cfg.num_layers);
    EXPECT_GT(asked_keys, 5);
    if (m == StreamMethod::Ltri) {
      EXPECT_GT(asked_masses, 10);
    }
    // Sizes that do not fit the chunk.
    auto refused = [&](StreamingKV::DeviceDecisions bad, int32_t n, const std::string& want) {
      StreamingKV kv(cfg, o, StreamingKV::Storage::Device);
      kv.begin_chunk(0, n, StreamingKV::ChunkKind::Prefill);
      const std::vector<float> k(static_cast<size_t>(n * nkv * d), 0.5f);
      try {
        kv.plan(0, 0, n, k.data(), inv_freq, bad);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), want);
      }
    };
    const std::vector<float> ten(10, 0.1f), sixteen(16, 0.1f), three(3, 1.0f), four(4, 1.0f);
    StreamingKV::DeviceDecisions bad;
    bad.votes = three;
    bad.map = sixteen;
    refused(bad, 4, "streaming: the device's votes have 3 entries for a chunk of 4 tokens");
    if (m == StreamMethod::Ltri) {
      bad.map = ten;
      bad.votes = four;
      refused(bad, 4, "streaming: the device's attention map has 10 entries for a chunk of 4 tokens (16 expected)");
      bad.has_candidates = true;
      const std::vector<Span> outside = {{3, 9, 1.0}}, inside = {{0, 2, 1.0}};
      bad.candidates = outside;
      refused(bad, 4, "streaming: the device's span candidate [3, 9) lies outside a chunk of 4 tokens");
      bad.candidates = inside;
      bad.span_masses = [](std::span<const Span>) { return std::vector<stream::SpanMasses>(1); };
      refused(bad, 4, "streaming: the device's span masses have 1 entries for 2 spans");
    }
  }
  // Block scores of the wrong count: past top_k evicted blocks, a retrieval that returns one score too few.
  const StreamOptions o = small_stream(StreamMethod::InfLLM);
  StreamingKV kv(cfg, o, StreamingKV::Storage::Device);
  int32_t pos = 0;
  std::string error;
  for (int c = 0; c < 8 && error.empty(); ++c) {
    kv.begin_chunk(pos, 16, StreamingKV::ChunkKind::Prefill);
    for (int32_t l = 0; l < cfg.num_layers && error.empty(); ++l) {
      const std::vector<float> k(static_cast<size_t>(16 * nkv * d), 0.25f), votes(16, 1.0f);
      StreamingKV::DeviceDecisions given;
      given.votes = votes;
      given.block_scores = [&](std::span<const int32_t>, std::span<const int32_t>, const stream::HeadWeights&) {
        return std::vector<double>(static_cast<size_t>(kv.evicted_blocks() - 1), 0.0);
      };
      try {
        kv.plan(l, pos, 16, k.data(), inv_freq, given);
      } catch (const Error& e) {
        error = e.what();
      }
    }
    pos += 16;
  }
  EXPECT_EQ(error, "streaming: the device's block scores have 2 entries for 3 evicted blocks");
}

// Gemma-3 too: its sliding-window layers' plan() keeps the window's count and layout as attend_window() does (each
// layer with its own RoPE base), its global layer streams.
TEST(StreamingKV, DeviceStoragePlansWhatTheHostPathAttends) {
  for (const char* name : {"llama3", "gemma3"}) {
    const ModelConfig& cfg = model(name).config();
    const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
    const LayerRopes ropes = layer_ropes(cfg);
    for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
      SCOPED_TRACE(std::string(name) + " " + stream_method_name(m));
      const StreamOptions o = small_stream(m);
      StreamingKV host(cfg, o), dev(cfg, o, StreamingKV::Storage::Device);
      std::mt19937 rng(11);
      std::normal_distribution<float> g(0.0f, 1.0f);
      ThreadPool pool(2);
      int32_t pos = 0, compared = 0;
      // 13 prefill chunks of 16 (evicting from the 4th on: more blocks than top_k), a last chunk of 5, 3 decode steps.
      std::vector<std::pair<int32_t, StreamingKV::ChunkKind>> chunks(13, {16, StreamingKV::ChunkKind::Prefill});
      chunks.push_back({5, StreamingKV::ChunkKind::LastPrefill});
      for (int i = 0; i < 3; ++i) chunks.push_back({1, StreamingKV::ChunkKind::Decode});
      for (const auto& [n, kind] : chunks) {
        host.begin_chunk(pos, n, kind);
        dev.begin_chunk(pos, n, kind);
        for (int32_t l = 0; l < cfg.num_layers; ++l) {
          const std::vector<float>& inv_freq = ropes.inv_freqs[ropes.layer[static_cast<size_t>(l)]];
          std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * nkv * d)), v(k.size());
          for (auto* t : {&q, &k, &v})
            for (float& x : *t) x = g(rng);
          const std::vector<float> q0 = q, k0 = k;
          std::vector<float> out(q.size());
          const stream::StreamLayout lay =
              dev.plan(l, pos, n, m == StreamMethod::StreamingLLM ? nullptr : q0.data(),
                       m == StreamMethod::StreamingLLM ? nullptr : k0.data(), inv_freq, 0.0f);
          host.attend(l, pos, n, q.data(), k.data(), v.data(), inv_freq, 0.0f, out.data(), pool);
          EXPECT_EQ(lay, host.last_layout(l)) << "layer " << l << " at " << pos;
          EXPECT_EQ(dev.retrieved(l), host.retrieved(l)) << "layer " << l << " at " << pos;
          EXPECT_EQ(dev.window_tokens(l), host.window_tokens(l)) << "layer " << l << " at " << pos;
          if (host.windowed(l)) {
            EXPECT_EQ(lay, (stream::StreamLayout{0, std::min(pos, cfg.layers[static_cast<size_t>(l)].sliding_window - 1), n}));
          }
          compared += host.evicted_blocks() > o.top_k && !host.retrieved(l).empty();  // a choice among the blocks
        }
        pos += n;
        EXPECT_EQ(dev.evicted_blocks(), host.evicted_blocks());
      }
      EXPECT_EQ(dev.length(), host.length());
      const StreamStats hs = host.stats(), ds = dev.stats();
      EXPECT_GT(hs.evicted_blocks, o.top_k);
      EXPECT_EQ(ds.host_bytes * 2, hs.host_bytes);
      EXPECT_EQ(ds.index_vectors, hs.index_vectors);
      EXPECT_EQ(ds.index_spans, hs.index_spans);
      EXPECT_EQ(ds.workspace_tokens, hs.workspace_tokens);
      if (m == StreamMethod::StreamingLLM)
        EXPECT_EQ(compared, 0);
      else
        EXPECT_GT(compared, 8 * host.global_layers());
    }
  }
  // The device path's budget counts bf16 blocks, with the host store's message.
  stream::HostBlockStore counted(2, 2, 8, 4, 600, 2);
  EXPECT_EQ(counted.block_bytes(), 256);
  counted.account(0);
  counted.account(1);
  EXPECT_EQ(counted.blocks(1), 1);
  try {
    counted.account(1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "streaming host store is full: block 1 of layer 1 needs 256 B more, over the budget of 600 B for "
                 "evicted KV blocks (holding 2 blocks, 512 B); raise --stream-host-budget or shorten the prompt");
  }
  EXPECT_EQ(counted.bytes(), 512);
  // FP8 blocks (StreamOptions::host_fp8): a code per value and an f32 scale per token and kv head, for K and V:
  // 2 x 4 tokens x (16 codes + 2 scales x 4 B) = 192 B, against bf16's 256.
  stream::HostBlockStore fp8(2, 2, 8, 4, 600, 1);
  EXPECT_EQ(fp8.block_bytes(), 192);
  fp8.account(0);
  fp8.account(1);
  fp8.account(0);
  EXPECT_THROW(fp8.account(1), Error);  // 4 x 192 > 600
  EXPECT_EQ(fp8.bytes(), 576);
}

// Collaborative voting by its formula (Ltri-LLM Sec. 3.5): a layer with a retrieval head ranks the blocks by
// the sum, over the layers up to and including it that have one, of that head's score times the layer's block
// scores normalised to [0, 1]; a later layer without one ranks by the same sum over the layers before it; a
// layer before the first retrieval layer by its own scores, or (StreamOptions::early_from_votes, `--stream-early-layers
// votes`) by the previous chunk's whole vote, the blocks evicted since scoring 0 (the most recent top-K blocks while
// no chunk has voted), without scoring or an index. The block scores are the test's (random, per layer and chunk),
// the expected blocks computed here from them chunk after chunk, and compared with what plan() retrieved
// (StreamingKV keeps the sums between a chunk's layers: this pins them to the explicit ones).
TEST(StreamingKV, CollaborativeVotingRanksBlocksByTheWeightedSumOfEarlierLayersScores) {
  ModelConfig cfg = model("llama3").config();
  cfg.num_layers = 6;
  cfg.layers.resize(6, cfg.layers[0]);
  const int32_t d = cfg.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  auto normalized = [](const std::vector<double>& s) {
    const auto [lo, hi] = std::minmax_element(s.begin(), s.end());
    std::vector<double> out(s.size());
    for (size_t b = 0; b < s.size(); ++b) out[b] = *hi > *lo ? (s[b] - *lo) / (*hi - *lo) : 0.0;
    return out;
  };
  for (const bool early : {false, true}) {
    SCOPED_TRACE(early ? "early layers: the previous chunk's vote" : "early layers: their own scores");
    StreamOptions o = small_stream(StreamMethod::Ltri);
    o.early_from_votes = early;
    // Layer 0: no retrieval head (scores with every head, or takes the previous vote); 1 and 3: retrieval heads; 2,
    // 4, 5: voted only.
    const double w1 = 0.5, w3 = 0.25;
    o.retrieval_heads = {{1, 3, w1}, {3, 0, w3}};
    StreamingKV kv(cfg, o, StreamingKV::Storage::Device);
    EXPECT_EQ(kv.voted_only(0), early);
    EXPECT_EQ(kv.maps_chunk(0), !early);
    EXPECT_EQ(kv.span_index(0).kv_heads_kept(), early ? 0 : cfg.num_kv_heads);
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> u(-3.0, 7.0);
    auto top = [&](const std::vector<double>& s) {  // top_k by score, ties to the lower block, ascending
      std::vector<int32_t> idx(s.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
        return s[static_cast<size_t>(a)] > s[static_cast<size_t>(b)];
      });
      idx.resize(static_cast<size_t>(o.top_k));
      std::sort(idx.begin(), idx.end());
      return idx;
    };
    // The vote of layers [0, end) over `blocks` blocks from the given per-layer scores (empty: did not score).
    auto vote = [&](const std::vector<std::vector<double>>& scores, int32_t end, size_t blocks) {
      std::vector<double> sum(blocks, 0.0);
      for (int32_t v : {1, 3})
        if (v < end && !scores[static_cast<size_t>(v)].empty()) {
          const std::vector<double> nv = normalized(scores[static_cast<size_t>(v)]);
          for (size_t b = 0; b < nv.size(); ++b) sum[b] += (v == 1 ? w1 : w3) * nv[b];
        }
      return sum;
    };
    int32_t pos = 0, ranked = 0, early_ranked = 0;
    std::vector<std::vector<double>> previous(6);  // the previous chunk's block scores per scored layer
    for (int c = 0; c < 14; ++c) {
      const int32_t n = 16;
      kv.begin_chunk(pos, n, StreamingKV::ChunkKind::Prefill);
      std::vector<std::vector<double>> scores(6);  // this chunk's block scores per scored layer
      for (int32_t l = 0; l < 6; ++l) {
        const std::vector<float> votes(static_cast<size_t>(n), 1.0f);
        StreamingKV::DeviceDecisions given;
        given.votes = votes;
        given.has_candidates = true;  // none: the cover is one span of the whole chunk
        given.keys_on_device = true;
        given.index_keys = [](std::span<const int32_t>) { return std::vector<float>{}; };
        given.span_masses = [](std::span<const Span> spans) {
          return std::vector<stream::SpanMasses>(spans.size(), {1.0, 1.0});
        };
        given.block_scores = [&](std::span<const int32_t>, std::span<const int32_t>,
                                 const stream::HeadWeights&) {
          EXPECT_TRUE((l == 0 && !early) || l == 1 || l == 3) << "layer " << l << " is voted only";
          std::vector<double> s(static_cast<size_t>(kv.evicted_blocks()));
          for (double& x : s) x = std::round(u(rng) * 4) / 4;  // (ties on purpose)
          scores[static_cast<size_t>(l)] = s;
          return s;
        };
        kv.plan(l, pos, n, nullptr, inv_freq, given);
        if (kv.evicted_blocks() <= o.top_k) continue;
        const size_t blocks = static_cast<size_t>(kv.evicted_blocks());
        std::vector<int32_t> expect;
        if (l == 0 && early) {
          const bool voted = !previous[1].empty() || !previous[3].empty();
          if (voted) {
            expect = top(vote(previous, 6, blocks));
            ++early_ranked;
          } else {
            for (int32_t b = kv.evicted_blocks() - o.top_k; b < kv.evicted_blocks(); ++b) expect.push_back(b);
          }
        } else {
          expect = top(l == 0 ? scores[0] : vote(scores, l + 1, blocks));
        }
        EXPECT_EQ(kv.retrieved(l), expect) << "layer " << l << " at " << pos;
        ++ranked;
      }
      previous = scores;
      pos += n;
    }
    EXPECT_GT(ranked, 30);
    if (early) {
      EXPECT_GT(early_ranked, 5);
    }
  }
}

// --stream-map-heads retrieval (StreamOptions::map_retrieval_head): a layer with a retrieval head maps its chunk with
// that head alone. With every other query head's q zero, each of those heads' softmax rows is uniform over the causal
// keys (1 / (r + 1)), so the all-heads map is the retrieval head's map plus (heads - 1) / (r + 1) at every causal
// entry: the two settings' maps differ by exactly that (within f32 rounding), the narrow map's rows are one softmax
// (sum 1), and a layer without a retrieval head maps with every head under both.
TEST(StreamingKV, MapOfTheRetrievalHeadAloneIsTheAllHeadsMapLessTheOtherHeads) {
  ModelConfig cfg = model("llama3").config();
  cfg.num_layers = 2;
  cfg.layers.resize(2, cfg.layers[0]);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  StreamOptions o = small_stream(StreamMethod::Ltri);
  o.retrieval_heads = {{1, 3, 0.5}};
  StreamOptions narrow = o;
  narrow.map_retrieval_head = true;
  StreamingKV all(cfg, o, StreamingKV::Storage::Device), one(cfg, narrow, StreamingKV::Storage::Device);
  EXPECT_EQ(one.map_head(1), 3);
  EXPECT_EQ(one.map_head(0), -1);
  EXPECT_EQ(all.map_head(1), -1);
  const int32_t n = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n * nq * d), 0.0f), k(static_cast<size_t>(n * nkv * d));
  for (int32_t t = 0; t < n; ++t)
    for (int32_t i = 0; i < d; ++i) q[static_cast<size_t>((t * nq + 3) * d + i)] = 2.0f * g(rng);
  for (float& x : k) x = g(rng);
  all.begin_chunk(0, n, StreamingKV::ChunkKind::Prefill);
  one.begin_chunk(0, n, StreamingKV::ChunkKind::Prefill);
  for (int32_t l = 0; l < 2; ++l) {
    all.plan(l, 0, n, q.data(), k.data(), inv_freq, 0.0f);
    one.plan(l, 0, n, q.data(), k.data(), inv_freq, 0.0f);
    const std::vector<float>& a = all.last_map();
    const std::vector<float>& b = one.last_map();
    ASSERT_EQ(a.size(), static_cast<size_t>(n * n));
    ASSERT_EQ(b.size(), a.size());
    double worst = 0, spread = 0;
    for (int32_t r = 0; r < n; ++r) {
      double row = 0;
      for (int32_t c = 0; c <= r; ++c) {
        const size_t i = static_cast<size_t>(r * n + c);
        const double others = l == 1 ? static_cast<double>(nq - 1) / (r + 1) : 0.0;
        worst = std::max(worst, std::fabs(static_cast<double>(b[i]) - (static_cast<double>(a[i]) - others)));
        spread = std::max(spread, std::fabs(static_cast<double>(b[i]) - 1.0 / (r + 1)));
        row += b[i];
      }
      EXPECT_NEAR(row, l == 1 ? 1.0 : static_cast<double>(nq), 1e-4) << "layer " << l << " row " << r;
    }
    EXPECT_LT(worst, 1e-5) << "layer " << l;
    if (l == 1) {
      EXPECT_GT(spread, 0.1);  // (the retrieval head's rows are far from uniform: the test can tell them)
    }
  }
}

// The chunk's map is the sum over heads of each head's causal softmax of scale * q_h . k_g, with q and k rotated at
// their positions and then rounded to bf16 (the values the GPU's attention reads and its map multiplies on the tensor
// cores, stream_decide.h): equal within f32 rounding to a double-precision reference over the rounded values, and
// far from the same reference over the unrounded ones (the test can tell whether the rounding happens).
TEST(StreamingKV, ChunkMapIsTheHeadSumOfSoftmaxesOverBf16RoundedRotations) {
  ModelConfig cfg = model("llama3").config();
  cfg.num_layers = 1;
  cfg.layers.resize(1);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim, group = nq / nkv;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  StreamingKV kv(cfg, small_stream(StreamMethod::Ltri), StreamingKV::Storage::Device);
  const int32_t n = 24, pos = 0;
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * nkv * d));
  for (float& x : q) x = g(rng);
  for (float& x : k) x = g(rng);
  kv.begin_chunk(pos, n, StreamingKV::ChunkKind::Prefill);
  std::vector<float> qa = q, ka = k;  // (plan() reads its own copies; these stay raw)
  kv.plan(0, pos, n, qa.data(), ka.data(), inv_freq, 0.0f);
  const std::vector<float>& map = kv.last_map();
  ASSERT_EQ(map.size(), static_cast<size_t>(n * n));
  // The reference: the same RoPE tables and rotation, then each head's softmax in double.
  std::vector<float> cos(static_cast<size_t>(n * d / 2)), sin(cos.size());
  rope_tables(inv_freq, pos, n, cos.data(), sin.data());
  std::vector<float> qr = q, kr = k;
  apply_rope(qr.data(), n, static_cast<int64_t>(nq) * d, nq, d, cos.data(), sin.data());
  apply_rope(kr.data(), n, static_cast<int64_t>(nkv) * d, nkv, d, cos.data(), sin.data());
  auto reference = [&](bool round) {
    auto value = [&](float x) { return static_cast<double>(round ? bf16_to_f32(f32_to_bf16(x)) : x); };
    const double sc = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> ref(static_cast<size_t>(n * n), 0.0);
    for (int32_t h = 0; h < nq; ++h)
      for (int32_t r = 0; r < n; ++r) {
        std::vector<double> e(static_cast<size_t>(r + 1));
        double mx = -1e300, z = 0;
        for (int32_t c = 0; c <= r; ++c) {
          double dot = 0;
          for (int32_t i = 0; i < d; ++i)
            dot += value(qr[static_cast<size_t>((r * nq + h) * d + i)]) *
                   value(kr[static_cast<size_t>((c * nkv + h / group) * d + i)]);
          e[static_cast<size_t>(c)] = sc * dot;
          mx = std::max(mx, sc * dot);
        }
        for (double& x : e) z += (x = std::exp(x - mx));
        for (int32_t c = 0; c <= r; ++c) ref[static_cast<size_t>(r * n + c)] += e[static_cast<size_t>(c)] / z;
      }
    return ref;
  };
  const std::vector<double> rounded = reference(true), raw = reference(false);
  double worst = 0, apart = 0;
  for (size_t i = 0; i < map.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(map[i]) - rounded[i]));
    apart = std::max(apart, std::fabs(rounded[i] - raw[i]));
  }
  EXPECT_LT(worst, 2e-5);
  EXPECT_GT(apart, 1e-3);  // (the unrounded map differs by much more than the tolerance)
}

// Ltri with retrieval heads keeps, per layer, only the kv heads its scores read (StreamOptions::index_all_heads false,
// the default): the layers before the first retrieval layer every kv head, a retrieval layer its head's kv head, a
// later layer without one nothing (collaborative voting replaces its scores). Everything it decides and attends is
// EXACTLY the full index's (the dropped heads have weight 0): layouts, retrieved blocks, attention outputs, chunk after
// chunk; the kept keys are the full index's columns of those heads; the index shrinks by the expected factor. The GPU
// path's emulated device (keys gathered from a ring into its mirror: the kept heads only) decides the same.
TEST(StreamingKV, RetrievalHeadIndexKeepsOnlyTheKvHeadsItsVotersReadAndDecidesExactlyAsTheFullIndex) {
  ModelConfig cfg = model("llama3").config();  // 4 query heads, 2 kv heads
  cfg.num_layers = 4;
  cfg.layers.resize(4, cfg.layers[0]);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  ASSERT_EQ(nkv, 2);
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  StreamOptions o = small_stream(StreamMethod::Ltri);
  // Layer 0: a head below 0.1 (no vote: every head scores); layer 1: head 3 (kv head 1); layer 2: head 0 (kv head 0);
  // layer 3: none (voted only).
  o.retrieval_heads = {{0, 1, 0.05}, {1, 3, 0.5}, {2, 0, 0.3}, {2, 2, 0.2}};
  StreamOptions all = o;
  all.index_all_heads = true;
  StreamingKV full(cfg, all), red(cfg, o), emu(cfg, o, StreamingKV::Storage::Device);
  EXPECT_FALSE(full.voted_only(3));
  EXPECT_FALSE(red.voted_only(0) || red.voted_only(1) || red.voted_only(2));
  EXPECT_TRUE(red.voted_only(3));
  const int32_t begins[] = {0, 1, 0, 0}, kept[] = {2, 1, 1, 0};
  for (int32_t l = 0; l < 4; ++l) {
    EXPECT_EQ(red.span_index(l).kv_head_begin(), begins[l]);
    EXPECT_EQ(red.span_index(l).kv_heads_kept(), kept[l]);
    EXPECT_EQ(full.span_index(l).kv_heads_kept(), 2);
  }
  std::vector<float> ring;  // raw K rows of every (position, layer): [pos, layers, nkv * d]
  std::vector<std::vector<float>> mirror(4);
  const int64_t row = static_cast<int64_t>(nkv) * d;
  std::mt19937 rng(21);
  std::normal_distribution<float> g(0.0f, 1.0f);
  ThreadPool pool(2);
  int32_t pos = 0, choices = 0, voted = 0;
  std::vector<std::pair<int32_t, StreamingKV::ChunkKind>> chunks(14, {16, StreamingKV::ChunkKind::Prefill});
  chunks.push_back({5, StreamingKV::ChunkKind::LastPrefill});
  for (int i = 0; i < 3; ++i) chunks.push_back({1, StreamingKV::ChunkKind::Decode});
  for (const auto& [n, kind] : chunks) {
    full.begin_chunk(pos, n, kind);
    red.begin_chunk(pos, n, kind);
    emu.begin_chunk(pos, n, kind);
    ring.resize(static_cast<size_t>((pos + n) * 4 * row));
    for (int32_t l = 0; l < 4; ++l) {
      std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * row)), v(k.size());
      for (auto* t : {&q, &k, &v})
        for (float& x : *t) x = g(rng);
      for (int32_t t = 0; t < n; ++t)
        std::copy_n(k.begin() + t * row, row, ring.begin() + (static_cast<int64_t>(pos + t) * 4 + l) * row);
      const std::vector<float> q0 = q, k0 = k;
      std::vector<float> qa = q, ka = k, va = v, out_full(q.size()), out_red(q.size());
      full.attend(l, pos, n, qa.data(), ka.data(), va.data(), inv_freq, 0.0f, out_full.data(), pool);
      red.attend(l, pos, n, q.data(), k.data(), v.data(), inv_freq, 0.0f, out_red.data(), pool);
      EXPECT_EQ(red.last_layout(l), full.last_layout(l)) << "layer " << l << " at " << pos;
      EXPECT_EQ(red.retrieved(l), full.retrieved(l)) << "layer " << l << " at " << pos;
      EXPECT_EQ(out_red, out_full) << "layer " << l << " at " << pos;  // bitwise
      // The emulated device: its own map (the CPU's, from q and k), the kept heads of the ring's rows into its mirror.
      StreamingKV own(cfg, o, StreamingKV::Storage::Device);  // (only for this chunk's map and votes)
      own.begin_chunk(0, n, StreamingKV::ChunkKind::Prefill);
      own.plan(0, 0, n, q0.data(), k0.data(), inv_freq, 0.0f);
      StreamingKV::DeviceDecisions dev;
      const std::vector<float> map = own.last_map(), votes = own.last_votes();
      dev.map = map;
      dev.votes = votes;
      dev.keys_on_device = true;
      dev.index_keys = [&](std::span<const int32_t> positions) {
        const stream::SpanIndex& ix = emu.span_index(l);
        for (int32_t p : positions) {
          const auto at = ring.begin() + (static_cast<int64_t>(p) * 4 + l) * row + ix.kv_head_begin() * d;
          mirror[static_cast<size_t>(l)].insert(mirror[static_cast<size_t>(l)].end(), at, at + ix.row());
        }
        return std::vector<float>{};
      };
      dev.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                             const stream::HeadWeights& w) {
        std::vector<float> queries;
        for (int32_t t : tokens) queries.insert(queries.end(), q0.begin() + t * nq * d, q0.begin() + (t + 1) * nq * d);
        EXPECT_NE(l, 3) << "a voted-only layer is not scored";
        return red.span_index(l).block_scores(queries, counts, w);  // the same keys as the mirror (asserted below)
      };
      EXPECT_EQ(emu.plan(l, pos, n, nullptr, inv_freq, dev), full.last_layout(l)) << "layer " << l << " at " << pos;
      EXPECT_EQ(emu.retrieved(l), full.retrieved(l)) << "layer " << l << " at " << pos;
      EXPECT_TRUE(std::ranges::equal(mirror[static_cast<size_t>(l)], red.span_index(l).keys()));
      EXPECT_EQ(emu.span_index(l).num_vectors(), red.span_index(l).num_vectors());
      choices += full.evicted_blocks() > o.top_k && kind != StreamingKV::ChunkKind::Decode;
      voted += l == 3 && full.evicted_blocks() > o.top_k;
    }
    pos += n;
  }
  EXPECT_GT(choices, 20);
  EXPECT_GT(voted, 5);
  // The kept keys are the full index's columns of the kept heads; the same spans and vector counts but for layer 3.
  int64_t want_bytes = 0, want_head_vectors = 0;
  for (int32_t l = 0; l < 4; ++l) {
    const stream::SpanIndex &a = full.span_index(l), &b = red.span_index(l);
    if (l == 3) {
      EXPECT_EQ(b.num_vectors(), 0);
      EXPECT_EQ(b.num_spans(), 0);
      EXPECT_GT(a.num_vectors(), 0);
      continue;
    }
    ASSERT_EQ(b.num_vectors(), a.num_vectors());
    EXPECT_TRUE(std::ranges::equal(a.span_count(), b.span_count()));
    for (int64_t r = 0; r < a.num_vectors(); ++r)
      EXPECT_TRUE(std::equal(b.keys().begin() + r * b.row(), b.keys().begin() + (r + 1) * b.row(),
                             a.keys().begin() + r * row + begins[l] * d));
    want_bytes += a.num_vectors() * kept[l] * d * 4;
    want_head_vectors += a.num_vectors() * kept[l];
  }
  const StreamStats fs = full.stats(), rs = red.stats(), es = emu.stats();
  EXPECT_EQ(rs.index_bytes, want_bytes);
  EXPECT_EQ(rs.index_head_vectors, want_head_vectors);
  EXPECT_EQ(fs.index_head_vectors, fs.index_vectors * 2);
  EXPECT_EQ(fs.index_bytes, fs.index_vectors * row * 4);
  EXPECT_EQ(es.index_bytes, rs.index_bytes);
  EXPECT_EQ(es.index_vectors, rs.index_vectors);
  EXPECT_LT(rs.index_bytes * 2, fs.index_bytes);  // (2 + 1 + 1 + 0) of 8 kv-head columns, layer 0 often larger
  std::printf("[stream] retrieval-head index: %lld of %lld bytes (%.2fx smaller), %lld of %lld vectors\n",
              static_cast<long long>(rs.index_bytes), static_cast<long long>(fs.index_bytes),
              static_cast<double>(fs.index_bytes) / static_cast<double>(rs.index_bytes),
              static_cast<long long>(rs.index_vectors), static_cast<long long>(fs.index_vectors));
  // A voted-only layer whose voters did not run this chunk: an error, not a silent guess.
  StreamingKV lone(cfg, o);
  const int32_t n = 16;
  std::vector<float> q(static_cast<size_t>(n * nq * d), 0.1f), k(static_cast<size_t>(n * row), 0.2f), v(k.size(), 0.3f),
      out(q.size());
  int32_t p = 0;
  for (; p < 160; p += n) {
    lone.begin_chunk(p, n, StreamingKV::ChunkKind::Prefill);
    for (int32_t l = 0; l < 4; ++l) {
      std::vector<float> qq = q, kk = k, vv = v;
      lone.attend(l, p, n, qq.data(), kk.data(), vv.data(), inv_freq, 0.0f, out.data(), pool);
    }
  }
  lone.begin_chunk(p, n, StreamingKV::ChunkKind::Prefill);
  std::vector<float> qq = q, kk = k, vv = v;
  lone.attend(0, p, n, qq.data(), kk.data(), vv.data(), inv_freq, 0.0f, out.data(), pool);
  qq = q, kk = k, vv = v;
  try {
    lone.attend(3, p, n, qq.data(), kk.data(), vv.data(), inv_freq, 0.0f, out.data(), pool);  // layers 1, 2 skipped
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "streaming: layer 3 takes its blocks from the retrieval heads' votes, but no earlier layer "
                           "voted in this chunk (layers run in order within a chunk)");
  }
}

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

// The engine with retrieval heads: the retrieval-head index gives the full index's logits, bit for bit.
TEST(StreamingEngine, RetrievalHeadIndexGivesTheFullIndexLogits) {
  for (const char* name : {"llama3", "smollm2"}) {
    SCOPED_TRACE(name);
    const Model& m = model(name);
    const std::vector<int32_t> tokens = random_tokens(300, m.config().vocab_size, 17);
    std::vector<std::vector<float>> logits;
    std::vector<StreamStats> stats;
    for (bool all : {true, false}) {
      EngineOptions so;
      so.stream = small_stream(StreamMethod::Ltri);
      // llama3 (2 layers, 2 kv heads): layer 0 keeps kv head 1, layer 1 nothing; smollm2 (3 layers, 1 kv head):
      // layer 0 every head, layer 1 its one, layer 2 nothing.
      if (std::string(name) == "llama3")
        so.stream.retrieval_heads = {{0, 3, 0.6}};
      else
        so.stream.retrieval_heads = {{1, 2, 0.6}};
      so.stream.index_all_heads = all;
      Engine e(m, so);
      std::vector<float> l = e.prefill(tokens);
      for (int32_t t : {3, 7}) {
        const std::vector<float> step = e.decode(t);
        l.insert(l.end(), step.begin(), step.end());
      }
      logits.push_back(l);
      stats.push_back(e.streaming()->stats());
    }
    EXPECT_EQ(logits[0], logits[1]);
    EXPECT_LT(stats[1].index_bytes, stats[0].index_bytes);
    EXPECT_EQ(stats[1].evicted_blocks, stats[0].evicted_blocks);
    std::printf("[stream] %s: index %lld -> %lld bytes with the retrieval heads' kv heads only\n", name,
                static_cast<long long>(stats[0].index_bytes), static_cast<long long>(stats[1].index_bytes));
  }
}

// While nothing is evicted (window >= prompt) streaming is the dense engine: same logits.
TEST(StreamingEngine, WindowCoveringThePromptEqualsTheNormalEngine) {
  // gemma3: 5 sliding-window layers (window 8, under the chunk of 48: the window is trimmed every chunk) per global
  // one, QK-norm, two RoPE bases.
  for (const char* name : {"smollm2", "llama3", "qwen2", "gemma3"}) {
    const Model& m = model(name);
    const std::vector<int32_t> tokens = random_tokens(200, m.config().vocab_size, 7);
    EngineOptions dense;
    dense.chunk_size = 48;
    dense.max_context = 256;
    Engine a(m, dense);
    const std::vector<float> want = a.forward_all_logits(tokens);
    const std::vector<float> da = a.decode(3);
    for (StreamMethod method : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
      EngineOptions so;
      so.stream = small_stream(method);
      so.stream.chunk = 48;
      so.stream.local = 200;
      Engine b(m, so);
      const std::vector<float> got = b.forward_all_logits(tokens);
      ASSERT_EQ(got.size(), want.size());
      float worst = 0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      EXPECT_LE(worst, 1e-5f) << name << " " << stream_method_name(method);
      EXPECT_EQ(b.streaming()->evicted_blocks(), 0);
      // Decode continues densely as well.
      const std::vector<float> db = b.decode(3);
      for (size_t i = 0; i < da.size(); ++i) EXPECT_NEAR(da[i], db[i], 1e-5f);
    }
  }
}

// Past the window: the layout holds sinks + retrieved blocks | a bounded local window | the chunk, blocks go to the
// host store, and at most top_k of them are attended per chunk.
TEST(StreamingEngine, BoundedLayoutPastTheWindow) {
  const Model& m = model("smollm2");
  const std::vector<int32_t> tokens = random_tokens(300, m.config().vocab_size, 9);  // past the 256-token context
  for (StreamMethod method : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    EngineOptions so;
    so.stream = small_stream(method);
    Engine e(m, so);
    const std::vector<float> logits = e.prefill(tokens);
    ASSERT_EQ(static_cast<int32_t>(logits.size()), m.config().vocab_size);
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    const StreamingKV& kv = *e.streaming();
    const int32_t last = 288;  // the last chunk: [288, 300)
    const int32_t evicted = (last - 8 - 32) / 16;
    EXPECT_EQ(kv.evicted_blocks(), evicted);
    for (int32_t l = 0; l < m.config().num_layers; ++l) {
      const auto& got = kv.retrieved(l);
      const int32_t want = method == StreamMethod::StreamingLLM ? 0 : 2;
      EXPECT_EQ(static_cast<int32_t>(got.size()), want);
      EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      for (int32_t b : got) EXPECT_LT(b, evicted);
      EXPECT_EQ(kv.last_layout(l), (stream::StreamLayout{8 + want * 16, last - (8 + evicted * 16), 12}));
    }
    const StreamStats st = kv.stats();
    // streamingllm drops its evicted blocks (it never retrieves them).
    EXPECT_EQ(st.host_bytes, method == StreamMethod::StreamingLLM ? 0 : int64_t{evicted} * 3 * 2 * 16 * 16 * 4);
    EXPECT_LE(st.workspace_tokens, so.stream.attended_tokens());
    if (method == StreamMethod::InfLLM) {
      EXPECT_EQ(st.index_vectors, int64_t{evicted} * 3 * 4);
    }
    if (method == StreamMethod::Ltri) {
      EXPECT_GE(st.index_vectors, int64_t{evicted} * 3);  // at least one vector per block
      EXPECT_GE(st.index_spans, int64_t{evicted} * 3);
    }
    // Decode: ltri keeps the last prefill chunk's blocks.
    const std::vector<int32_t> before = kv.retrieved(1);
    e.decode(4);
    if (method == StreamMethod::Ltri) {
      EXPECT_EQ(kv.retrieved(1), before);
    }
    // Same input, same output after reset.
    e.reset();
    EXPECT_EQ(e.prefill(tokens), logits);
  }
}

// Gemma-3 past the window: the global layer runs the streaming layout (its host store and index alone), each
// sliding-window layer holds its last window - 1 tokens and attends to them and the chunk.
TEST(StreamingEngine, GemmaStreamsGlobalLayersAndKeepsTheWindowOfTheOthers) {
  const Model& m = model("gemma3");
  const ModelConfig& c = m.config();
  const std::vector<int32_t> tokens = random_tokens(300, c.vocab_size, 9);  // past the 256-token context
  for (StreamMethod method : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    EngineOptions so;
    so.stream = small_stream(method);
    Engine e(m, so);
    const std::vector<float> logits = e.prefill(tokens);
    ASSERT_EQ(static_cast<int32_t>(logits.size()), c.vocab_size);
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    const StreamingKV& kv = *e.streaming();
    EXPECT_EQ(kv.global_layers(), 1);
    const int32_t last = 288, evicted = (last - 8 - 32) / 16;
    EXPECT_EQ(kv.evicted_blocks(), evicted);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const bool windowed = l != 5;
      EXPECT_EQ(kv.windowed(l), windowed) << l;
      if (windowed) {
        EXPECT_EQ(kv.last_layout(l), (stream::StreamLayout{0, 7, 12})) << l;
        EXPECT_EQ(kv.window_tokens(l), 7) << l;
        EXPECT_TRUE(kv.retrieved(l).empty());
      } else {
        const int32_t want = method == StreamMethod::StreamingLLM ? 0 : 2;
        EXPECT_EQ(static_cast<int32_t>(kv.retrieved(l).size()), want);
        EXPECT_EQ(kv.last_layout(l), (stream::StreamLayout{8 + want * 16, last - (8 + evicted * 16), 12}));
        EXPECT_EQ(kv.window_tokens(l), 0);
      }
    }
    const StreamStats st = kv.stats();
    EXPECT_EQ(st.host_bytes,  // the global layer's blocks only (streamingllm: none kept)
              method == StreamMethod::StreamingLLM ? 0 : int64_t{evicted} * 1 * 2 * 16 * 16 * 4);
    if (method == StreamMethod::InfLLM) {
      EXPECT_EQ(st.index_vectors, int64_t{evicted} * 4);
    }
    if (method == StreamMethod::Ltri) {
      EXPECT_GE(st.index_spans, evicted);
      ASSERT_EQ(st.lambdas.size(), 6u);
      EXPECT_EQ(st.lambdas[0], 0);        // a sliding-window layer indexes nothing
      EXPECT_EQ(st.lambdas[5], 3);        // the global layer is past the first four
    }
    // Resident: the sinks and the local window of the global layer, 7 tokens per sliding-window layer, workspace.
    EXPECT_GE(kv.resident_bytes(), int64_t{5} * 7 * 2 * 16 * 4);
    // Decode keeps the windows at 7 tokens; the same input gives the same output after reset.
    e.decode(3);
    EXPECT_EQ(kv.window_tokens(0), 7);
    EXPECT_EQ(kv.last_layout(0), (stream::StreamLayout{0, 7, 1}));
    e.reset();
    EXPECT_EQ(e.prefill(tokens), logits);
  }
}

// --stream-index-ratio: each layer's lambda is searched; a ratio no lambda meets puts lambda at its cap (one vector
// per span but those with r = 1), ratio 1 is met by any lambda (the smallest: ~0, every span keeps min(length, 12));
// without a ratio the fixed lambdas (20 early, 3 later).
TEST(StreamingEngine, IndexRatioChoosesEachLayersLambda) {
  const Model& m = model("smollm2");
  const std::vector<int32_t> tokens = random_tokens(300, m.config().vocab_size, 9);
  auto run = [&](double ratio) {
    EngineOptions so;
    so.stream = small_stream(StreamMethod::Ltri);
    so.stream.early_layers = 1;
    so.stream.index_ratio = ratio;
    Engine e(m, so);
    e.prefill(tokens);
    return e.streaming()->stats();
  };
  const StreamStats fixed = run(0);
  EXPECT_EQ(fixed.lambdas, (std::vector<double>{20, 3, 3}));
  const StreamStats tight = run(1e6);
  EXPECT_EQ(tight.lambdas, (std::vector<double>(3, stream::LambdaTable::kMaxLambda)));
  EXPECT_GE(tight.index_vectors, tight.index_spans);  // one vector per span but those no later row voted for
  EXPECT_LE(tight.index_vectors, fixed.index_vectors);
  const StreamStats loose = run(1);
  for (double l : loose.lambdas) EXPECT_LE(l, 1e-6);
  EXPECT_GT(loose.index_vectors, fixed.index_vectors);
  // Same input, same choice.
  EXPECT_EQ(run(4).lambdas, run(4).lambdas);
}

TEST(StreamingEngine, LastChunkHoldsTheQueryOnly) {
  const Model& m = model("smollm2");
  const std::vector<int32_t> tokens = random_tokens(150, m.config().vocab_size, 12);
  EngineOptions so;
  so.stream = small_stream(StreamMethod::Ltri);
  so.stream.chunk = 32;
  so.stream.last_chunk = 8;
  Engine e(m, so);
  int chunks = 0;
  e.prefill(tokens, [&](int64_t, int64_t) { ++chunks; });
  EXPECT_EQ(chunks, 6);  // [0, 32) .. [96, 128), [128, 142), then [142, 150)
  EXPECT_EQ(e.streaming()->last_layout(0).chunk, 8);
  EXPECT_EQ(e.streaming()->last_layout(0).local, 142 - (8 + 6 * 16));
}

// StreamingLLM never retrieves an evicted block, so it keeps none: no host bytes, no limit from the host budget (a
// prompt far past the budget runs), and the same logits as a method that keeps them but retrieves none (InfLLM with
// top-k 0: the same sinks + window + chunk), computed here on the same machine.
TEST(StreamingEngine, StreamingLLMKeepsNoEvictedBlocks) {
  const Model& m = model("smollm2");
  const std::vector<int32_t> tokens = random_tokens(300, m.config().vocab_size, 9);
  EngineOptions so;
  so.stream = small_stream(StreamMethod::StreamingLLM);
  so.stream.host_budget = 1;  // one byte: not one block (2 KiB per layer) would fit
  Engine e(m, so);
  const StreamingKV& kv = *e.streaming();
  EXPECT_FALSE(kv.keeps_evicted());
  EXPECT_NO_THROW(kv.check_sequence(int64_t{1} << 40));
  const std::vector<float> logits = e.prefill(tokens);
  const int32_t evicted = (288 - 8 - 32) / 16;
  EXPECT_EQ(kv.evicted_blocks(), evicted);
  EXPECT_EQ(kv.stats().host_bytes, 0);
  const std::vector<float> d = e.decode(4);
  EngineOptions ro;
  ro.stream = small_stream(StreamMethod::InfLLM);
  ro.stream.top_k = 0;
  Engine ref(m, ro);
  EXPECT_TRUE(ref.streaming()->keeps_evicted());
  EXPECT_EQ(ref.prefill(tokens), logits);
  EXPECT_EQ(ref.streaming()->evicted_blocks(), evicted);
  EXPECT_GT(ref.streaming()->stats().host_bytes, 0);
  EXPECT_EQ(ref.decode(4), d);
  EXPECT_EQ(kv.stats().host_bytes, 0);
  // The Device storage (the GPU path's decisions) counts nothing either; ltri still needs the budget.
  StreamingKV dev(m.config(), so.stream, StreamingKV::Storage::Device);
  EXPECT_NO_THROW(dev.check_sequence(int64_t{1} << 40));
  StreamOptions lo = so.stream;
  lo.method = StreamMethod::Ltri;
  EXPECT_TRUE(StreamingKV(m.config(), lo).keeps_evicted());
  EXPECT_THROW(StreamingKV(m.config(), lo).check_sequence(300), Error);
}

TEST(RetrievalHeads, ScoresEveryHeadInZeroOneAndNeedTheNeedleInThePrompt) {
  EXPECT_EQ(find_tokens(std::vector<int32_t>{1, 2, 3, 2, 3}, std::vector<int32_t>{2, 3}), 3);
  EXPECT_EQ(find_tokens(std::vector<int32_t>{1, 2}, std::vector<int32_t>{3}), -1);
  const Model& m = model("smollm2");
  std::vector<int32_t> prompt = random_tokens(60, m.config().vocab_size, 11);
  const std::vector<int32_t> answer(prompt.begin() + 20, prompt.begin() + 24);
  const std::vector<RetrievalCase> cases = {{prompt, answer}};
  const std::vector<RetrievalHead> heads = retrieval_head_scores(m, cases);
  ASSERT_EQ(heads.size(), static_cast<size_t>(m.config().num_layers * m.config().num_q_heads));
  for (const RetrievalHead& h : heads) {
    EXPECT_GE(h.score, 0.0);
    EXPECT_LE(h.score, 1.0);
    EXPECT_DOUBLE_EQ(h.score * 4, std::round(h.score * 4));  // hits out of 4 answer tokens
  }
  EXPECT_EQ(heads[5].layer, 1);
  EXPECT_EQ(heads[5].head, 1);
  const std::vector<RetrievalCase> missing = {{prompt, {static_cast<int32_t>(m.config().vocab_size - 1), 0, 0, 0, 0}}};
  EXPECT_THROW(retrieval_head_scores(m, missing), Error);
  const std::string text = retrieval_heads_text({{0, 1, 0.25}, {2, 3, 0.5}});
  EXPECT_NE(text.find("2 3 0.5000\n0 1 0.2500\n"), std::string::npos);
}

}  // namespace
}  // namespace tessera::runtime
