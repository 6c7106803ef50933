// Adaptive budgets (issue 16; pattern.h "Adaptive budgets", estimate.h coverage_count): the count equals an
// exhaustive search over subsets, the estimators keep the minimal set whose estimated mass reaches gamma (against a
// brute force in f64 from the definition), the clamps, gamma = 1 keeping everything, determinism, and the grammar
// (--attn presets, policy JSON) with its errors. The executor on adaptive indexes is checked against dense with the
// same explicit mask in attention_cpu_test (LoweredPatterns).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/pattern/config_io.h"
#include "attention/pattern/presets.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace tessera::attn {
namespace {

// --- coverage_count against every subset ------------------------------------------------------------------

// The smallest size of a set that holds [0, forced) and whose mass is >= gamma * total, by trying every subset
// (integer masses: every sum is exact, so the comparison is the definition's, not a rounding of it).
int64_t smallest_covering_set(const std::vector<double>& mass, int64_t forced, double gamma) {
  const int n = static_cast<int>(mass.size());
  const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
  if (gamma >= 1.0 || total <= 0.0) return n;
  int best = n;
  for (uint32_t set = 0; set < (1u << n); ++set) {
    if ((set & ((1u << forced) - 1u)) != (1u << forced) - 1u) continue;
    double m = 0.0;
    for (int i = 0; i < n; ++i) m += (set >> i) & 1u ? mass[size_t(i)] : 0.0;
    if (m >= gamma * total) best = std::min(best, __builtin_popcount(set));
  }
  return best;
}

TEST(AdaptiveBudgets, CoverageCountIsTheSmallestCoveringSetThenClamped) {
  std::mt19937 rng(16);
  int checked = 0;
  for (int c = 0; c < 400; ++c) {
    const int n = 1 + int(rng() % 12);
    std::vector<double> mass(static_cast<size_t>(n));
    const int spread = c % 3 == 0 ? 3 : 40;  // few distinct values (ties) or many
    for (double& m : mass) m = double(rng() % spread);
    const int64_t forced = int64_t(rng() % (n + 1));
    const double gammas[] = {0.1, 0.5, 0.9, 0.95, 0.999, 1.0};
    const double gamma = gammas[rng() % 6];
    const int64_t max_count = forced + int64_t(rng() % (n - forced + 1));
    const int64_t min_count = int64_t(rng() % (n + 1));
    const int64_t want = std::clamp(smallest_covering_set(mass, forced, gamma),
                                    std::min(std::max(min_count, forced), max_count), max_count);
    EXPECT_EQ(coverage_count(mass, forced, gamma, min_count, max_count), want)
        << "case " << c << " n " << n << " forced " << forced << " gamma " << gamma << " min " << min_count
        << " max " << max_count;
    ++checked;
  }
  EXPECT_EQ(checked, 400);
  // By hand: masses 5, 1, 3, 1 (total 10). gamma 0.5 -> {0} (5 >= 5); 0.8 -> {0, 2} (8); 0.85 -> 3 elements;
  // forced [0, 2) with gamma 0.5 -> 2 (the forced are always in); gamma 1 -> all; clamps.
  const std::vector<double> m = {5, 1, 3, 1};
  EXPECT_EQ(coverage_count(m, 0, 0.5, 0, 4), 1);
  EXPECT_EQ(coverage_count(m, 0, 0.8, 0, 4), 2);
  EXPECT_EQ(coverage_count(m, 0, 0.85, 0, 4), 3);
  EXPECT_EQ(coverage_count(m, 2, 0.5, 0, 4), 2);
  EXPECT_EQ(coverage_count(m, 0, 1.0, 0, 4), 4);
  EXPECT_EQ(coverage_count(m, 0, 0.85, 0, 2), 2);  // max
  EXPECT_EQ(coverage_count(m, 0, 0.5, 3, 4), 3);   // min
  EXPECT_EQ(coverage_count({0, 0, 0}, 0, 0.5, 0, 3), 3);  // no mass anywhere: all (then clamped)
  EXPECT_EQ(coverage_count({}, 0, 0.5, 0, 0), 0);
}

// --- estimators against the definition ------------------------------------------------------------------------

struct Qk {
  Tensor q, k;
};

Qk random_qk(std::mt19937& rng, int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d, float sharp) {
  Qk x{Tensor(DType::F32, {q_len, hq, d}), Tensor(DType::F32, {kv_len, hkv, d})};
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t i = 0; i < x.q.numel(); ++i) x.q.ptr<float>()[i] = sharp * n(rng);
  for (int64_t i = 0; i < x.k.numel(); ++i) x.k.ptr<float>()[i] = n(rng);
  return x;
}

// Column and diagonal sums of A = softmax of the last rows, in f64 from the definition.
struct VsSums {
  std::vector<double> col, diag;
};
VsSums brute_sums(const VerticalSlashPattern& p, const Qk& x, int qh, int kvh, const LoweringContext& ctx,
                  float scale) {
  const int64_t d = x.q.dim(2), keys = ctx.q_begin + ctx.q_len;
  VsSums s{std::vector<double>(size_t(keys), 0.0), std::vector<double>(size_t(keys), 0.0)};
  for (int64_t r = std::max<int64_t>(0, ctx.q_len - p.last_q); r < ctx.q_len; ++r) {
    const int64_t pos = ctx.q_begin + r;
    std::vector<double> sc(size_t(pos + 1));
    for (int64_t j = 0; j <= pos; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < d; ++i) acc += double(*x.q.view().at<float>(r, qh, i)) * *x.k.view().at<float>(j, kvh, i);
      sc[size_t(j)] = acc * scale;
    }
    const double mx = *std::max_element(sc.begin(), sc.end());
    double z = 0;
    for (double v : sc) z += std::exp(v - mx);
    for (int64_t j = 0; j <= pos; ++j) {
      s.col[size_t(j)] += std::exp(sc[size_t(j)] - mx) / z;
      s.diag[size_t(pos - j)] += std::exp(sc[size_t(j)] - mx) / z;
    }
  }
  return s;
}

// The definition, spelled out: the forced first, the rest by mass (ties to the smaller index); grow the prefix
// until its mass reaches gamma of the total; clamp; return the chosen indices ascending.
std::vector<int32_t> brute_pick(const std::vector<double>& mass, int64_t forced, double gamma, int64_t min_count,
                                int64_t max_count) {
  const int64_t n = int64_t(mass.size());
  max_count = std::min(max_count, n);
  forced = std::min(forced, max_count);
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin() + forced, order.end(),
                   [&](int32_t a, int32_t b) { return mass[size_t(a)] > mass[size_t(b)]; });
  const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
  int64_t count = n;
  double acc = 0;
  for (int64_t c = 1; c <= n && gamma < 1.0; ++c) {
    acc += mass[size_t(order[size_t(c - 1)])];
    if (c >= forced && acc >= gamma * total) {
      count = c;
      break;
    }
  }
  count = std::clamp(count, std::min(std::max(min_count, forced), max_count), max_count);
  std::vector<int32_t> out(order.begin(), order.begin() + count);
  std::sort(out.begin(), out.end());
  return out;
}

double mass_of(const std::vector<double>& mass, const std::vector<int32_t>& set) {
  double m = 0;
  for (int32_t i : set) m += mass[size_t(i)];
  return m;
}

TEST(AdaptiveBudgets, VerticalSlashKeepsTheMinimalSetReachingGamma) {
  std::mt19937 rng(160);
  int minimal_checked = 0;
  for (const auto& [q_begin, q_len, last_q, sharp] : std::vector<std::tuple<int, int, int, float>>{
           {0, 300, 64, 2.0f}, {40, 150, 16, 1.0f}, {0, 37, 64, 3.0f}, {0, 1, 64, 1.0f}, {100, 90, 64, 0.5f}}) {
    const LoweringContext ctx{q_begin, q_len, q_begin + q_len, 0, 64};
    const Qk x = random_qk(rng, q_len, q_begin + q_len, 4, 2, 16, sharp);
    for (const double gamma : {0.3, 0.8, 0.9, 0.95}) {
      VerticalSlashPattern p;
      p.last_q = last_q;
      p.forced_columns = 2;
      p.forced_diagonals = 3;
      p.vertical = 1000;
      p.slash = 1000;
      p.gamma = gamma;
      for (int h = 0; h < 4; ++h) {
        const auto got = estimate_vertical_slash(p, x.q, x.k, h, h / 2, ctx, 0.25f);
        const VsSums s = brute_sums(p, x, h, h / 2, ctx, 0.25f);
        const std::string what = "q_len " + std::to_string(q_len) + " gamma " + std::to_string(gamma) + " head " +
                                 std::to_string(h);
        EXPECT_EQ(got.columns, brute_pick(s.col, 2, gamma, 0, 1000)) << what;
        EXPECT_EQ(got.offsets, brute_pick(s.diag, 3, gamma, 0, 1000)) << what;
        // Coverage and minimality on the f64 sums: the kept mass reaches gamma; without its lightest unforced
        // element it does not (when there is one to drop).
        for (const auto& [mass, set, forced] :
             {std::tuple{s.col, got.columns, 2}, std::tuple{s.diag, got.offsets, 3}}) {
          const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
          EXPECT_GE(mass_of(mass, set), gamma * total * (1 - 1e-12)) << what;
          double lightest = INFINITY;
          for (int32_t i : set)
            if (i >= forced) lightest = std::min(lightest, mass[size_t(i)]);
          if (std::isfinite(lightest)) {
            EXPECT_LT(mass_of(mass, set) - lightest, gamma * total) << what;
            ++minimal_checked;
          }
        }
      }
    }
  }
  EXPECT_GT(minimal_checked, 100);
}

TEST(AdaptiveBudgets, VerticalSlashClampsAndGammaOneKeepsEverything) {
  std::mt19937 rng(161);
  const LoweringContext ctx{0, 200, 200, 0, 64};
  const Qk x = random_qk(rng, 200, 200, 2, 1, 16, 2.0f);
  VerticalSlashPattern p;
  p.forced_columns = 4;
  p.forced_diagonals = 4;
  p.vertical = 100000;
  p.slash = 100000;
  p.gamma = 1.0;
  const auto all = estimate_vertical_slash(p, x.q, x.k, 0, 0, ctx, 0.25f);
  std::vector<int32_t> every(200);
  std::iota(every.begin(), every.end(), 0);
  EXPECT_EQ(all.columns, every);
  EXPECT_EQ(all.offsets, every);
  // A tiny target keeps the forced and the minima; the maxima cap a large one.
  p.gamma = 1e-9;
  p.min_vertical = 10;
  p.min_slash = 2;  // below the 4 forced: the forced win
  auto few = estimate_vertical_slash(p, x.q, x.k, 0, 0, ctx, 0.25f);
  EXPECT_EQ(few.columns.size(), 10u);
  EXPECT_EQ(few.offsets, (std::vector<int32_t>{0, 1, 2, 3}));
  p.gamma = 0.999;
  p.vertical = 7;
  p.slash = 5;
  p.min_vertical = 0;
  p.min_slash = 0;
  few = estimate_vertical_slash(p, x.q, x.k, 0, 0, ctx, 0.25f);
  EXPECT_EQ(few.columns.size(), 7u);
  EXPECT_EQ(few.offsets.size(), 5u);
  // With the maxima as fixed budgets the adaptive estimate is a prefix of the same order: a subset of the fixed one.
  VerticalSlashPattern fixed = p;
  fixed.gamma = 0;
  fixed.vertical = fixed.slash = 60;
  VerticalSlashPattern adaptive = fixed;
  adaptive.gamma = 0.6;
  const auto f = estimate_vertical_slash(fixed, x.q, x.k, 1, 0, ctx, 0.25f);
  const auto a = estimate_vertical_slash(adaptive, x.q, x.k, 1, 0, ctx, 0.25f);
  EXPECT_TRUE(std::includes(f.columns.begin(), f.columns.end(), a.columns.begin(), a.columns.end()));
  EXPECT_TRUE(std::includes(f.offsets.begin(), f.offsets.end(), a.offsets.begin(), a.offsets.end()));
}

// BS: per query block, pooled scores in f64 from the definition, softmax over [0, qb], diagonal forced.
std::vector<std::vector<int32_t>> brute_bs_adaptive(const Qk& y, const BlockSparsePattern& p, int q_head,
                                                    int kv_head, const LoweringContext& ctx, double scale) {
  const int64_t d = y.q.dim(2), q_end = ctx.q_begin + ctx.q_len, B = p.block;
  auto kpool = [&](int64_t kb, int64_t i) {
    const int64_t k0 = kb * B, k1 = std::min<int64_t>((kb + 1) * B, ctx.kv_len);
    double kp = 0;
    for (int64_t j = k0; j < k1; ++j) kp += *y.k.view().at<float>(j, kv_head, i) / double(k1 - k0);
    return kp;
  };
  std::vector<std::vector<int32_t>> out;
  for (int64_t qb = ctx.q_begin / B; qb <= (q_end - 1) / B; ++qb) {
    std::vector<double> qp(size_t(d), 0.0);
    const int64_t r0 = std::max<int64_t>(qb * B, ctx.q_begin), r1 = std::min<int64_t>((qb + 1) * B, q_end);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < d; ++i) qp[size_t(i)] += *y.q.view().at<float>(r - ctx.q_begin, q_head, i) / double(r1 - r0);
    std::vector<double> score(size_t(qb + 1));
    for (int64_t kb = 0; kb <= qb; ++kb) {
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += qp[size_t(i)] * kpool(kb, i);
      score[size_t(kb)] = s * scale;
    }
    // Order for brute_pick: the diagonal first (forced), then blocks 0 .. qb - 1.
    const double mx = *std::max_element(score.begin(), score.end());
    std::vector<double> mass(size_t(qb + 1));
    mass[0] = std::exp(score[size_t(qb)] - mx);
    for (int64_t kb = 0; kb < qb; ++kb) mass[size_t(kb + 1)] = std::exp(score[size_t(kb)] - mx);
    const int64_t max_count = std::min<int64_t>(p.top_k, qb + 1);
    std::vector<int32_t> row;
    for (int32_t i : brute_pick(mass, 1, max_count >= 2 ? p.gamma : 0.0, max_count >= 2 ? p.min_top_k : 0, max_count))
      row.push_back(i == 0 ? static_cast<int32_t>(qb) : i - 1);
    std::sort(row.begin(), row.end());
    out.push_back(row);
  }
  return out;
}

TEST(AdaptiveBudgets, BlockSparseKeepsPerQueryBlockTheMinimalSetReachingGamma) {
  std::mt19937 rng(162);
  for (const auto& [q_begin, q_len, B] : std::vector<std::tuple<int, int, int>>{
           {0, 300, 16}, {45, 200, 32}, {0, 257, 64}, {100, 1, 16}, {17, 150, 16}}) {
    const LoweringContext ctx{q_begin, q_len, q_begin + q_len, 0, 64};
    const Qk y = random_qk(rng, q_len, q_begin + q_len, 4, 2, 16, 3.0f);
    for (const double gamma : {0.5, 0.9, 0.99, 1.0}) {
      for (const auto& [top_k, min_top_k] : std::vector<std::pair<int, int>>{{1000, 1}, {4, 1}, {1000, 3}}) {
        BlockSparsePattern p{top_k, B, gamma, min_top_k};
        for (int h = 0; h < 4; ++h) {
          const auto got = estimate_block_sparse(p, y.q, y.k, h, h / 2, ctx, 0.5f);
          const auto want = brute_bs_adaptive(y, p, h, h / 2, ctx, 0.5);
          ASSERT_EQ(got.offsets.size(), want.size() + 1);
          for (size_t e = 0; e < want.size(); ++e) {
            const std::vector<int32_t> row(got.key_blocks.begin() + got.offsets[e],
                                           got.key_blocks.begin() + got.offsets[e + 1]);
            EXPECT_EQ(row, want[e]) << "q_begin " << q_begin << " q_len " << q_len << " B " << B << " gamma "
                                    << gamma << " top_k " << top_k << " head " << h << " row " << e;
            const int64_t qb = got.first_q_block + int64_t(e);
            ASSERT_FALSE(row.empty());
            EXPECT_EQ(row.back(), qb);  // the diagonal always
            if (gamma == 1.0) {
              EXPECT_EQ(int64_t(row.size()), std::min<int64_t>(top_k, qb + 1));
            }
            EXPECT_GE(int64_t(row.size()), std::min<int64_t>(min_top_k, qb + 1));
          }
        }
      }
    }
  }
}

TEST(AdaptiveBudgets, EstimatesAreDeterministicAndIndependentOfThreads) {
  std::mt19937 rng(163);
  const LoweringContext ctx{0, 260, 260, 0, 64};
  const Qk x = random_qk(rng, 260, 260, 4, 2, 16, 2.0f);
  VerticalSlashPattern vs;
  vs.gamma = 0.9;
  const std::vector<Pattern> patterns = {vs, BlockSparsePattern{100, 32, 0.9, 1}, vs, BlockSparsePattern{5, 16, 0.8, 2}};
  ThreadPool one(1), two(2);
  const auto a = estimate_layer(patterns, x.q, x.k, ctx, 0.25f, one);
  const auto b = estimate_layer(patterns, x.q, x.k, ctx, 0.25f, two);
  const auto c = estimate_layer(patterns, x.q, x.k, ctx, 0.25f, two);
  EXPECT_EQ(a, b);
  EXPECT_EQ(b, c);
  // Each lowers to a valid index.
  EXPECT_NO_THROW(lower_layer(patterns, a, ctx).validate());
}

// --- grammar ------------------------------------------------------------------------------------------------

const PolicyShape kShape{2, 4, 2};

std::string error_of(const std::string& spec) {
  try {
    policy_from_spec(spec, kShape);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(AdaptiveBudgets, PresetsAndTheirErrors) {
  VerticalSlashPattern v;
  v.gamma = 0.9;
  EXPECT_EQ(policy_from_spec("vs_adaptive", kShape).at(1, 3), Pattern(v));
  v.gamma = 0.95;
  v.vertical = 500;
  v.slash = 2000;
  v.min_vertical = 40;
  v.min_slash = 200;
  v.last_q = 32;
  EXPECT_EQ(policy_from_spec("vs_adaptive:gamma=0.95,v=500,s=2000,min_v=40,min_s=200,last_q=32", kShape).at(0, 0),
            Pattern(v));
  EXPECT_EQ(describe(v), "vertical_slash(gamma=0.95, v=40..500, s=200..2000)");
  EXPECT_EQ(policy_from_spec("bs_adaptive:gamma=1,top_k=50,min_top_k=4", kShape).at(0, 1),
            Pattern(BlockSparsePattern{50, 64, 1.0, 4}));
  EXPECT_EQ(describe(BlockSparsePattern{50, 64, 1.0, 4}), "block_sparse(gamma=1, top_k=4..50, block=64)");
  EXPECT_EQ(error_of("vs_adaptive:gamma=0"),
            "attention spec 'vs_adaptive:gamma=0': parameter 'gamma' must be in (0, 1], got 0");
  EXPECT_EQ(error_of("vs_adaptive:gamma=1.5"),
            "attention spec 'vs_adaptive:gamma=1.5': parameter 'gamma' must be in (0, 1], got 1.5");
  EXPECT_EQ(error_of("bs_adaptive:gamma=nan"),
            "attention spec 'bs_adaptive:gamma=nan': parameter 'gamma' must be in (0, 1], got nan");
  EXPECT_EQ(error_of("vs_adaptive:gamma=high"),
            "attention spec 'vs_adaptive:gamma=high': parameter 'gamma' must be a number, got 'high'");
  EXPECT_EQ(error_of("vs_adaptive:min_v=2000"),
            "attention spec 'vs_adaptive:min_v=2000': parameter 'min_v' must be in [0, vertical = 1000], got 2000");
  EXPECT_EQ(error_of("bs_adaptive:min_top_k=0"),
            "attention spec 'bs_adaptive:min_top_k=0': parameter 'min_top_k' must be in [1, top_k = 100], got 0");
  EXPECT_EQ(error_of("vs_adaptive:k=3"),
            "attention spec 'vs_adaptive:k=3': unknown parameter 'k' (known: gamma, v, s, min_v, min_s, last_q)");
  EXPECT_EQ(error_of("vs:gamma=0.9"), "attention spec 'vs:gamma=0.9': unknown parameter 'gamma' (known: v, s, last_q)");
  EXPECT_NO_THROW(check_policy_spec("bs_adaptive:gamma=0.5"));
}

TEST(AdaptiveBudgets, PolicyJsonRoundTripsAndRejectsBadValues) {
  VerticalSlashPattern v;
  v.gamma = 0.95;
  v.min_vertical = 30;
  AttentionPolicy policy = AttentionPolicy::uniform(2, 4, 2, v);
  policy.at(1, 2) = BlockSparsePattern{80, 64, 0.9, 2};
  const nlohmann::json j = save_policy_json(policy);
  EXPECT_EQ(parse_tessera_policy(j, "p.json"), policy);
  // The fixed patterns write no adaptive fields (files written before stay byte-identical).
  const nlohmann::json fixed = save_policy_json(AttentionPolicy::uniform(1, 1, 1, VerticalSlashPattern{}));
  EXPECT_EQ(fixed.dump().find("gamma"), std::string::npos);
  nlohmann::json bad = j;
  bad["default"]["gamma"] = 1.5;
  try {
    parse_tessera_policy(bad, "p.json");
    FAIL() << "gamma 1.5 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("field 'gamma' must be in [0, 1] (0: fixed budgets), got 1.5"),
              std::string::npos)
        << e.what();
  }
  bad = j;
  bad["default"]["min_vertical"] = 5000;
  EXPECT_THROW(parse_tessera_policy(bad, "p.json"), Error);
  // The MInference format has no adaptive budgets: a clear refusal.
  try {
    export_minference(policy);
    FAIL() << "exported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot express"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::attn
