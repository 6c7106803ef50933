// The planners (src/plan): MoA's rule space, block coverage against the patterns' cell masks, the MIP against
// enumeration, rule losses, the epsilon-constraint Pareto set; TriangleMix's start layer; MInference's candidates
// and search; calibration files and dense answers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attention/index/lower.h"
#include "core/error.h"
#include "plan/calibration.h"
#include "plan/minference_plan.h"
#include "plan/moa_plan.h"
#include "plan/plan_report.h"
#include "plan/profile.h"
#include "plan/rule_mip.h"
#include "plan/trianglemix_plan.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "test_support.h"

namespace tessera::plan {
namespace {

using namespace tessera::test;

namespace fs = std::filesystem;

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/";

const runtime::Model& model(const char* name) {
  static std::map<std::string, std::unique_ptr<runtime::Model>> cache;
  auto& m = cache[name];
  if (!m) m = runtime::Model::load(kFixtures + "hf_tiny/" + name);
  return *m;
}

TEST(MoaRules, SpaceIsSixAlphasByNineBetas) {
  const auto rules = moa_rule_space();
  ASSERT_EQ(rules.size(), 54u);
  EXPECT_EQ(rules.front(), (ElasticRule{-2048, 0}));
  EXPECT_EQ(rules[1], (ElasticRule{-2048, 0.125}));
  EXPECT_EQ(rules.back(), (ElasticRule{8192, 1}));
  std::set<double> alphas, betas;
  for (const auto& r : rules) {
    alphas.insert(r.alpha);
    betas.insert(r.beta);
  }
  EXPECT_EQ(alphas, (std::set<double>{-2048, 0, 2048, 4096, 6144, 8192}));
  EXPECT_EQ(betas.size(), 9u);
  // A finer beta grid (--moa-beta-steps): the same alphas, betas 0, 1/32, ..., 1, MoA's 54 rules among them.
  const auto fine = moa_rule_space(32);
  ASSERT_EQ(fine.size(), 6u * 33u);
  EXPECT_EQ(fine[1], (ElasticRule{-2048, 1.0 / 32}));
  EXPECT_EQ(fine[8], (ElasticRule{-2048, 0.25}));
  for (const auto& r : rules) EXPECT_NE(std::find(fine.begin(), fine.end(), r), fine.end());
  try {
    (void)moa_rule_space(0);
    ADD_FAILURE() << "0 steps accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "moa: beta steps must be in [1, 64], got 0");
  }
}

// Kept fractions per 64 x 64 block equal the cell counts of the pattern's documented mask.
TEST(MoaRules, BlockCoverageMatchesCellMask) {
  const int32_t n = 300;
  for (const attn::Pattern& p :
       {attn::Pattern{attn::ElasticWindowPattern{-20, 0.25, 64}}, attn::Pattern{attn::ElasticWindowPattern{100, 0, 8}},
        attn::Pattern{attn::TrianglePattern{8, 70, 40}}, attn::Pattern{attn::AShapePattern{16, 96}},
        attn::Pattern{attn::DensePattern{}}}) {
    const BlockCoverage c = block_coverage(p, n);
    ASSERT_EQ(c.num_blocks, 5);
    const auto mask = attn::pattern_mask(p, std::monostate{}, attn::LoweringContext::prefill(n, 64));
    std::vector<double> kept(25, 0), causal(25, 0);
    double total = 0, all = 0;
    for (int32_t i = 0; i < n; ++i)
      for (int32_t j = 0; j <= i; ++j) {
        const size_t b = static_cast<size_t>((i / 64) * 5 + j / 64);
        causal[b] += 1;
        all += 1;
        if (mask[static_cast<size_t>(i) * n + static_cast<size_t>(j)]) {
          kept[b] += 1;
          total += 1;
        }
      }
    for (size_t b = 0; b < 25; ++b)
      EXPECT_DOUBLE_EQ(c.kept[b], causal[b] > 0 ? kept[b] / causal[b] : 0.0) << attn::describe(p) << " block " << b;
    EXPECT_DOUBLE_EQ(c.density, total / all) << attn::describe(p);
  }
}

RuleAssignmentProblem random_problem(std::mt19937& rng, int groups, int per_group, int options) {
  std::uniform_real_distribution<double> u(0, 1);
  RuleAssignmentProblem p;
  p.groups = groups;
  p.items_per_group = per_group;
  p.options = options;
  for (int i = 0; i < groups * per_group * options; ++i) p.cost.push_back(u(rng) * 1e-5 - 2e-6);
  std::vector<double> w;
  for (int r = 0; r < options; ++r) w.push_back(0.1 + 0.9 * r / (options - 1));
  p.weights = {w};
  p.weight_limits = {0.5};
  p.max_options_per_group = 2;
  return p;
}

TEST(RuleMip, MatchesEnumeration) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  std::mt19937 rng(7);
  for (int trial = 0; trial < 6; ++trial) {
    RuleAssignmentProblem p = random_problem(rng, 2, 3, 4);
    if (trial % 2 == 1) p.max_options_per_group = 1;
    if (trial >= 4) {  // an epsilon constraint on a second cost table
      std::vector<double> second;
      std::uniform_real_distribution<double> u(0, 1);
      for (size_t i = 0; i < p.cost.size(); ++i) second.push_back(u(rng));
      const auto free = solve_rule_assignment_exhaustive(p);
      ASSERT_TRUE(free);
      p.cap_costs = {second};
      p.caps = {assignment_sum(second, p.options, free->choice) * 0.8};
    }
    const auto want = solve_rule_assignment_exhaustive(p);
    const auto got = solve_rule_assignment(p);
    ASSERT_EQ(want.has_value(), got.has_value()) << "trial " << trial;
    if (!want) continue;
    EXPECT_TRUE(got->proven_optimal);
    EXPECT_NEAR(got->objective, want->objective, 1e-12) << "trial " << trial;
    // The constraints hold for the solver's choice.
    for (int g = 0; g < p.groups; ++g) {
      std::set<int32_t> used(got->choice.begin() + g * 3, got->choice.begin() + g * 3 + 3);
      EXPECT_LE(static_cast<int>(used.size()), p.max_options_per_group);
    }
    double mean = 0;
    for (int32_t c : got->choice) mean += p.weights[0][static_cast<size_t>(c)] / 6.0;
    EXPECT_LE(mean, 0.5 + 1e-12);
  }
  // Infeasible: the budget below the lightest option.
  RuleAssignmentProblem p = random_problem(rng, 2, 2, 3);
  p.weight_limits = {0.05};
  EXPECT_FALSE(solve_rule_assignment(p).has_value());
  EXPECT_FALSE(solve_rule_assignment_exhaustive(p).has_value());
}

// A profile with known influence: one head of one layer.
TEST(RuleMip, ForbiddenOptionsMatchEnumeration) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  std::mt19937 rng(11);
  for (int trial = 0; trial < 6; ++trial) {
    RuleAssignmentProblem p = random_problem(rng, 2, 3, 4);
    // The unconstrained optimum's choice is forbidden to its first item, and a random third of the rest.
    const auto free = solve_rule_assignment_exhaustive(p);
    ASSERT_TRUE(free);
    p.allowed.assign(p.cost.size(), 1);
    p.allowed[static_cast<size_t>(free->choice[0])] = 0;
    for (size_t i = static_cast<size_t>(p.options); i < p.allowed.size(); ++i) p.allowed[i] = rng() % 3 != 0;
    const auto want = solve_rule_assignment_exhaustive(p);
    const auto got = solve_rule_assignment(p);
    ASSERT_EQ(want.has_value(), got.has_value()) << "trial " << trial;
    if (!want) continue;
    EXPECT_NEAR(got->objective, want->objective, 1e-12) << "trial " << trial;
    EXPECT_GE(got->objective, free->objective - 1e-15);
    for (size_t i = 0; i < got->choice.size(); ++i)
      EXPECT_EQ(p.allowed[i * static_cast<size_t>(p.options) + static_cast<size_t>(got->choice[i])], 1) << i;
  }
  // Every option of one item forbidden: infeasible; a table of the wrong size: an error.
  RuleAssignmentProblem p = random_problem(rng, 1, 2, 3);
  p.allowed = {1, 1, 1, 0, 0, 0};
  EXPECT_FALSE(solve_rule_assignment(p).has_value());
  EXPECT_FALSE(solve_rule_assignment_exhaustive(p).has_value());
  p.allowed = {1, 1};
  EXPECT_EQ(error_of([&] { solve_rule_assignment(p); }), "rule assignment: allowed table has the wrong size");
}

GradientProfile toy_profile(int32_t layers, int32_t heads, const std::vector<int32_t>& lengths, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  GradientProfile p;
  p.num_layers = layers;
  p.num_q_heads = heads;
  p.probe.resize(static_cast<size_t>(layers));
  for (int32_t n : lengths) {
    LengthProfile lp;
    lp.length = n;
    lp.num_blocks = (n + 63) / 64;
    lp.samples = 1;
    const size_t nb = static_cast<size_t>(lp.num_blocks);
    lp.influence.assign(static_cast<size_t>(layers * heads) * nb * nb, 0.0);
    for (int32_t hh = 0; hh < layers * heads; ++hh)
      for (size_t qb = 0; qb < nb; ++qb)
        for (size_t kb = 0; kb <= qb; ++kb) {
          // Heads differ in how far back their influence reaches.
          const double reach = 1.0 + (hh % 5) * 3.0;
          const double dist = static_cast<double>(qb - kb);
          lp.influence[(static_cast<size_t>(hh) * nb + qb) * nb + kb] = 1e-4 * std::exp(-dist / reach) * (0.5 + u(rng));
        }
    lp.sample_influence = {lp.influence};  // one sample (the Fisher loss, MoaOptions' default, reads these)
    p.lengths.push_back(std::move(lp));
  }
  return p;
}

TEST(MoaPlan, RuleLossIsMaskedInfluence) {
  const GradientProfile prof = toy_profile(1, 2, {512}, 3);
  const auto rules = moa_rule_space();
  const auto losses = rule_losses(prof, rules, 64);
  ASSERT_EQ(losses.size(), 1u);
  for (size_t r : {size_t{0}, size_t{13}, size_t{53}}) {
    const BlockCoverage c = block_coverage(attn::ElasticWindowPattern{rules[r].alpha, rules[r].beta, 64}, 512);
    for (int32_t h = 0; h < 2; ++h) {
      double want = 0;
      for (int32_t qb = 0; qb < 8; ++qb)
        for (int32_t kb = 0; kb <= qb; ++kb)
          want += (1 - c.kept[static_cast<size_t>(qb * 8 + kb)]) * prof.lengths[0].block(0, h, qb, kb, 2);
      EXPECT_DOUBLE_EQ(losses[0][static_cast<size_t>(h) * 54 + r], want);
    }
  }
  // The densest rule (span = N) keeps everything: no loss.
  EXPECT_DOUBLE_EQ(losses[0][53], 0.0);
}

TEST(MoaPlan, ParetoPlansMeetTheBudget) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  const GradientProfile prof = toy_profile(3, 4, {1024, 2048}, 5);
  MoaOptions o;
  o.budget = 0.4;
  int calls = 0;
  const MoaResult r = plan_moa(prof, 2, o, [&](const attn::AttentionPolicy& p) {
    ++calls;
    return ValidationScore{-1, policy_density(p, 3072)};  // any number: the pick must be the smallest
  });
  ASSERT_FALSE(r.pareto.empty());
  EXPECT_EQ(calls, static_cast<int>(r.pareto.size()));
  EXPECT_EQ(r.mips, 2 + 6);  // one program per length, then 6 caps on the shorter length
  // At 1K and 2K: the sink alone (alpha -2048, or beta 0), beta 1/8 .. 7/8 with alpha 0, and dense.
  EXPECT_EQ(r.options, 9);
  for (size_t i = 0; i < r.pareto.size(); ++i) {
    for (double d : r.pareto[i].density) EXPECT_LE(d, 0.4 + 1e-9);
    EXPECT_LE(r.pareto[r.chosen].validation_perplexity, r.pareto[i].validation_perplexity);
    for (size_t j = 0; j < r.pareto.size(); ++j) {  // none dominates another
      if (i == j) continue;
      const bool dominates = r.pareto[j].loss[0] <= r.pareto[i].loss[0] && r.pareto[j].loss[1] <= r.pareto[i].loss[1] &&
                             (r.pareto[j].loss[0] < r.pareto[i].loss[0] || r.pareto[j].loss[1] < r.pareto[i].loss[1]);
      EXPECT_FALSE(dominates) << i << " dominated by " << j;
    }
  }
  // At most two distinct rules per layer, and the policy is the chosen plan's.
  for (int32_t l = 0; l < 3; ++l) {
    std::set<std::string> distinct;
    for (int32_t h = 0; h < 4; ++h) distinct.insert(attn::describe(r.policy.at(l, h)));
    EXPECT_LE(distinct.size(), 2u);
  }
  EXPECT_EQ(r.policy.num_kv_heads(), 2);
  EXPECT_EQ(error_of([&] { o.budget = 1.5; plan_moa(prof, 2, o); }), "moa: budget must be in (0, 1], got 1.500000");
}

// A window model (Gemma-3's kind): the heads of its sliding-window layers are left to the model (DensePattern: the
// executors keep the window), outside the budget, which then holds the mean density of the other layers' heads.
TEST(MoaPlan, WindowLayersAreLeftToTheModelAndOutsideTheBudget) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  const GradientProfile prof = toy_profile(3, 4, {1024, 2048}, 5);
  MoaOptions o;
  o.budget = 0.4;
  o.layer_windows = {0, 512, 0};
  const MoaResult r = plan_moa(prof, 2, o);
  ASSERT_FALSE(r.pareto.empty());
  for (int32_t h = 0; h < 4; ++h) EXPECT_EQ(attn::describe(r.policy.at(1, h)), "dense") << h;
  const auto rules = moa_rule_space();
  for (const MoaCandidate& c : r.pareto) {
    for (size_t k = 0; k < 2; ++k) {
      const auto d = rule_densities(rules, 64, {r.lengths[k]});
      double planned = 0;  // layers 0 and 2
      for (int32_t l : {0, 2})
        for (int32_t h = 0; h < 4; ++h) planned += d[0][static_cast<size_t>(c.rule_of_head[static_cast<size_t>(l * 4 + h)])];
      EXPECT_NEAR(c.density[k], planned / 8, 1e-12);
      EXPECT_LE(c.density[k], 0.4 + 1e-9);
    }
  }
  o.layer_windows = {512, 512, 512};
  EXPECT_EQ(error_of([&] { plan_moa(prof, 2, o); }), "moa: every layer has a sliding window: nothing to plan");
}

TEST(MoaPlan, NoSinkOnlyRulesLeavesEveryHeadAWindow) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  const GradientProfile prof = toy_profile(3, 4, {1024, 2048}, 5);
  MoaOptions o;
  o.budget = 0.4;
  const auto sink_only = [](const attn::ElasticWindowPattern& w, int32_t n) { return w.alpha + w.beta * n <= 0; };
  const auto count_sink_only = [&](const attn::AttentionPolicy& p) {
    int n = 0;
    for (int32_t l = 0; l < 3; ++l)
      for (int32_t h = 0; h < 4; ++h) {
        const auto& w = std::get<attn::ElasticWindowPattern>(p.at(l, h));
        n += sink_only(w, 1024) || sink_only(w, 2048);
      }
    return n;
  };
  const MoaResult with = plan_moa(prof, 2, o);
  ASSERT_GT(count_sink_only(with.policy), 0);  // the toy profile's plan uses them, so leaving them out matters
  o.allow_sink_only = false;
  const MoaResult without = plan_moa(prof, 2, o);
  EXPECT_EQ(without.options, 8);  // the 9 classes at 1K / 2K less the sink alone
  EXPECT_EQ(count_sink_only(without.policy), 0);
  for (const MoaCandidate& c : without.pareto) {
    for (double d : c.density) EXPECT_LE(d, 0.4 + 1e-9);
    for (int32_t r : c.rule_of_head) {
      const ElasticRule rule = moa_rule_space()[static_cast<size_t>(r)];
      EXPECT_GT(rule.alpha + rule.beta * 1024, 0) << r;
    }
  }
  // The least loss at 2K can only grow when options are taken away.
  EXPECT_GE(without.pareto[without.chosen].loss[1] + 1e-12, with.pareto[with.chosen].loss[1]);
  // A budget between the sink alone's density at 1K and the narrowest window's: a plan only with sink-only heads.
  const auto d = rule_densities({{-2048, 0}, {0, 0.125}}, 64, {1024});
  ASSERT_LT(d[0][0], d[0][1]);
  o.budget = (d[0][0] + d[0][1]) / 2;
  EXPECT_EQ(error_of([&] { plan_moa(prof, 2, o); }), "moa: no plan meets the budget (the MIP is infeasible)");
  o.allow_sink_only = true;
  EXPECT_GT(count_sink_only(plan_moa(prof, 2, o).policy), 0);
}

TEST(MoaPlan, ProfileFileRoundTripsAndPlansTheSame) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  GradientProfile prof = toy_profile(3, 4, {1024, 2048}, 9);
  prof.loss = 2.5;
  prof.lengths[1].samples = 2;  // a second sample at 2K: its own influence, the first one scaled
  prof.lengths[1].sample_influence.push_back(prof.lengths[1].influence);
  for (double& v : prof.lengths[1].sample_influence[1]) v *= -0.5;
  const fs::path dir = fs::temp_directory_path() / ("tessera_moa_profile_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "p.bin").string();
  save_moa_profile(prof, path);
  const GradientProfile back = load_moa_profile(path);
  EXPECT_EQ(back.num_layers, 3);
  EXPECT_EQ(back.num_q_heads, 4);
  EXPECT_EQ(back.loss, 2.5);
  ASSERT_EQ(back.lengths.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(back.lengths[k].length, prof.lengths[k].length);
    EXPECT_EQ(back.lengths[k].num_blocks, prof.lengths[k].num_blocks);
    EXPECT_EQ(back.lengths[k].samples, prof.lengths[k].samples);
    EXPECT_EQ(back.lengths[k].influence, prof.lengths[k].influence);  // bit for bit
    EXPECT_EQ(back.lengths[k].sample_influence, prof.lengths[k].sample_influence);
  }
  MoaOptions o;
  o.budget = 0.4;
  EXPECT_EQ(plan_moa(back, 2, o).pareto[0].rule_of_head, plan_moa(prof, 2, o).pareto[0].rule_of_head);
  // Bad files: another magic, truncated, trailing bytes, a missing file.
  const std::string bad = (dir / "bad.bin").string();
  std::ofstream(bad, std::ios::binary) << "NOTAPROFILE.....";
  EXPECT_EQ(error_of([&] { load_moa_profile(bad); }),
            "moa: the profile file '" + bad + "' is not a MoA profile (no TSMOAPR1 magic)");
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 8);
  EXPECT_EQ(error_of([&] { load_moa_profile(bad); }), "moa: the profile file '" + bad + "' is truncated");
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << bytes << "x";
  EXPECT_EQ(error_of([&] { load_moa_profile(bad); }), "moa: the profile file '" + bad + "' has data after its last length");
  const std::string none = (dir / "none.bin").string();
  EXPECT_EQ(error_of([&] { load_moa_profile(none); }), "moa: cannot read the profile file '" + none + "'");
  fs::remove_all(dir);
}

TEST(MoaPlan, HeadLostShareIsMaskedAbsoluteInfluence) {
  // One layer, two heads, 256 tokens (4 blocks); two samples of opposite signs: the mean influence cancels, the
  // mass (mean of |block sums|) does not.
  GradientProfile prof = toy_profile(1, 2, {256}, 3);
  LengthProfile& lp = prof.lengths[0];
  std::vector<double> a = lp.influence, b = lp.influence;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -3 * a[i];
  std::fill(a.begin() + 16, a.end(), 0.0);  // the second head: no influence in the first sample
  std::fill(b.begin() + 16, b.end(), 0.0);  // nor in the second
  lp.sample_influence = {a, b};
  lp.samples = 2;
  const std::vector<ElasticRule> rules = {{-2048, 0}, {0, 0.5}, {8192, 0}};
  const auto shares = head_lost_shares(prof, rules, 64);
  ASSERT_EQ(shares.size(), 1u);
  ASSERT_EQ(shares[0].size(), 6u);
  for (size_t r = 0; r < 3; ++r) {
    const BlockCoverage c = block_coverage(attn::ElasticWindowPattern{rules[r].alpha, rules[r].beta, 64}, 256);
    double lost = 0, total = 0;
    for (size_t qb = 0; qb < 4; ++qb)
      for (size_t kb = 0; kb <= qb; ++kb) {
        const double m = (std::abs(a[qb * 4 + kb]) + std::abs(b[qb * 4 + kb])) / 2;  // = 2 |a|
        lost += (1 - c.kept[qb * 4 + kb]) * m;
        total += m;
      }
    EXPECT_DOUBLE_EQ(shares[0][r], lost / total) << r;
    EXPECT_EQ(shares[0][3 + r], 0.0) << r;  // no influence: nothing to lose
  }
  EXPECT_GT(shares[0][0], shares[0][1]);  // the sink alone masks more than a half window
  EXPECT_EQ(shares[0][2], 0.0);           // dense masks nothing
}

TEST(MoaPlan, HeadCapBoundsEveryHeadsLostShare) {
  if (!have_mip_solver()) GTEST_SKIP() << "built without CBC";
  const GradientProfile prof = toy_profile(3, 4, {1024, 2048}, 5);
  MoaOptions o;
  o.budget = 0.4;
  const std::vector<ElasticRule> rules = moa_rule_space();
  const auto shares = head_lost_shares(prof, rules, 64);
  auto worst = [&](const MoaCandidate& c) {
    double w = 0;
    for (size_t h = 0; h < c.rule_of_head.size(); ++h)
      for (const auto& s : shares) w = std::max(w, s[h * rules.size() + static_cast<size_t>(c.rule_of_head[h])]);
    return w;
  };
  const MoaResult free = plan_moa(prof, 2, o);
  const double free_worst = worst(free.pareto[free.chosen]);
  o.head_loss_cap = 1;  // no cap: the same plans
  EXPECT_EQ(plan_moa(prof, 2, o).pareto[0].rule_of_head, free.pareto[0].rule_of_head);
  // A cap below the free plan's worst head: every Pareto plan keeps every head within it, at more summed loss.
  o.head_loss_cap = free_worst * 0.9;
  ASSERT_LT(o.head_loss_cap, 1);
  const MoaResult capped = plan_moa(prof, 2, o);
  for (const MoaCandidate& c : capped.pareto) {
    EXPECT_LE(worst(c), o.head_loss_cap + 1e-12);
    for (double d : c.density) EXPECT_LE(d, 0.4 + 1e-9);
  }
  EXPECT_GE(capped.pareto[capped.chosen].loss[1] + 1e-12, free.pareto[free.chosen].loss[1]);
  // A cap that only dense rules meet, under a budget they exceed: the exact error.
  o.head_loss_cap = 1e-9;
  EXPECT_EQ(error_of([&] { plan_moa(prof, 2, o); }), "moa: no plan meets the budget 0.4 within the per-head cap 1e-09");
  o.head_loss_cap = 0;
  EXPECT_EQ(error_of([&] { plan_moa(prof, 2, o); }), "moa: the per-head cap must be > 0, got 0");
}

TEST(TriangleMixPlan, StartLayerWhereMiddleGradientCollapses) {
  EXPECT_EQ(trianglemix_start({5, 4, 3, 0.2, 0.1, 0.3}, 0.1), 3);
  EXPECT_EQ(trianglemix_start({5, 4, 3, 0.2, 0.1, 3}, 0.1), 6);  // the last layer still matters: no triangle
  EXPECT_EQ(trianglemix_start({0.1, 5, 0.2, 0.1}, 0.1), 2);
  GradientProfile prof = toy_profile(6, 2, {512}, 1);
  const double middle[] = {5, 4, 3, 0.2, 0.1, 0.3};
  for (int l = 0; l < 6; ++l) {
    prof.probe[static_cast<size_t>(l)].middle = {middle[l], middle[l] * 10, 10};
    prof.probe[static_cast<size_t>(l)].last = {1, 1, 10};
  }
  TriangleMixOptions o;
  const TriangleMixResult r = plan_trianglemix(prof, 1, {}, o);
  EXPECT_EQ(r.probe_start, 3);
  EXPECT_EQ(r.start_layer, 3);
  EXPECT_EQ(r.policy.at(2, 0), attn::Pattern{attn::DensePattern{}});
  EXPECT_EQ(r.policy.at(3, 1), attn::Pattern{o.triangle});
  // With a budget: the densest plan within it.
  o.budget = 0.6;
  o.length = 8192;
  const TriangleMixResult b = plan_trianglemix(prof, 1, {}, o);
  EXPECT_LE(b.density, 0.6);
  EXPECT_GT(policy_density(attn::AttentionPolicy::trianglemix(
                               attn::AttentionPolicy::uniform(6, 2, 1, attn::DensePattern{}), b.start_layer + 1, o.triangle),
                           8192),
            0.6);
  o.budget = 0.01;
  EXPECT_EQ(error_of([&] { plan_trianglemix(prof, 1, {}, o); }).substr(0, 47),
            "trianglemix: no start layer meets the budget 0.");
}

TEST(MInferencePlan, CandidatesHaveTheTargetDensity) {
  // At 4,096 the paper's (30, 2048) and (100, 1800) both scale to fewer than 64 verticals: raised to the floor they
  // are the same shape, kept once (plan_selection_test has the exact shapes).
  const auto c = minference_candidates(0.3, 4096);
  ASSERT_EQ(c.size(), 5u);
  const auto& a = std::get<attn::AShapePattern>(c[0]);
  EXPECT_GE(block_coverage(a, 4096).density, 0.3);
  EXPECT_LT(block_coverage(attn::AShapePattern{(a.local - 1) / 4, a.local - 1}, 4096).density, 0.3);
  for (size_t i = 1; i <= 3; ++i) {
    const auto& vs = std::get<attn::VerticalSlashPattern>(c[i]);
    EXPECT_NEAR((vs.vertical + 2.0 * vs.slash) / 4096, 0.3, 0.01);
  }
  EXPECT_EQ(std::get<attn::BlockSparsePattern>(c[4]).top_k, 10);  // 0.3 x 32.5 causal blocks on average
  EXPECT_EQ(error_of([] { minference_candidates(0, 4096); }), "minference: budget must be in (0, 1], got 0.000000");
}

// On a tiny model: at budget 1 the A-shape candidate covers every cell, so its output equals dense.
TEST(MInferencePlan, SearchMeasuresOutputError) {
  const runtime::Model& m = model("llama3");
  std::vector<CalibrationSample> samples(2);
  for (size_t s = 0; s < 2; ++s)
    for (int32_t i = 0; i < 150; ++i) samples[s].tokens.push_back(static_cast<int32_t>((i * 31 + 7 * s + 3) % 256));
  MInferenceOptions o;
  o.budget = 1.0;
  const MInferenceResult r = plan_minference(m, samples, o, ThreadPool::global());
  const size_t C = r.candidates.size();
  ASSERT_EQ(r.error.size(), static_cast<size_t>(m.config().num_layers * m.config().num_q_heads) * C);
  for (size_t hh = 0; hh < r.error.size() / C; ++hh) {
    EXPECT_LE(r.error[hh * C + 0], 1e-5);
    EXPECT_NEAR(r.measured_density[hh * C + 0], 1.0, 1e-12);
    EXPECT_LE(r.query_error[hh * C + 0], 1e-5);
    EXPECT_LE(r.score[hh], choice_score(r, hh, 0));
  }
  // At a low budget errors are real and each head takes its least-score candidate: its error over all rows and
  // over the last query_rows rows, weighted.
  o.budget = 0.2;
  o.query_rows = 20;
  o.query_weight = 0.25;
  const MInferenceResult low = plan_minference(m, samples, o, ThreadPool::global());
  ASSERT_EQ(low.query_error.size(), low.error.size());
  for (size_t hh = 0; hh < low.choice.size(); ++hh) {
    for (size_t c = 0; c < C; ++c) {
      EXPECT_DOUBLE_EQ(choice_score(low, hh, c), 0.75 * low.error[hh * C + c] + 0.25 * low.query_error[hh * C + c]);
      EXPECT_LE(low.score[hh], choice_score(low, hh, c));
    }
    EXPECT_EQ(low.policy.at(static_cast<int>(hh) / m.config().num_q_heads, static_cast<int>(hh) % m.config().num_q_heads),
              low.candidates[static_cast<size_t>(low.choice[hh])]);
  }
  double total = 0, query_total = 0;
  for (double e : low.error) total += e;
  for (double e : low.query_error) query_total += e;
  EXPECT_GT(total, 1e-3);
  EXPECT_GT(query_total, 1e-3);
  // The query rows' error over the whole sample is the error; query_rows 0 measures all rows only (MInference's
  // criterion: the score is the error).
  o.query_rows = 150;
  const MInferenceResult whole = plan_minference(m, samples, o, ThreadPool::global());
  EXPECT_EQ(whole.query_error, whole.error);
  o.query_rows = 0;
  const MInferenceResult all = plan_minference(m, samples, o, ThreadPool::global());
  EXPECT_TRUE(all.query_error.empty());
  EXPECT_EQ(all.error, low.error);
  for (size_t hh = 0; hh < all.choice.size(); ++hh)
    EXPECT_EQ(all.score[hh], all.error[hh * C + static_cast<size_t>(all.choice[hh])]);
}

// The per-head choice judged on held-out answers: a synthetic plan (errors set by hand) whose A-shape heads in
// layer 1 lose an answer that the others keep. The repair takes the A-shape out (its heads to their next-best
// candidate), and no other candidate, since after that the plan keeps every answer.
TEST(MInferencePlan, HeldOutRepairTakesOutTheCandidateThatLosesAnswers) {
  const runtime::ModelConfig& cfg = model("llama3").config();
  const size_t L = static_cast<size_t>(cfg.num_layers), H = static_cast<size_t>(cfg.num_q_heads);
  ASSERT_GE(L, 2u);
  MInferenceResult r;
  attn::VerticalSlashPattern vs;
  vs.vertical = 64;
  vs.slash = 64;
  r.candidates = {attn::AShapePattern{16, 64}, vs, attn::BlockSparsePattern{2, 64}};
  const size_t C = r.candidates.size();
  // Every head's error order: head h of layer l prefers A-shape when (l + h) is even, else VS; BS is last but for
  // head 0 of layer 0, whose second choice is BS. No query rows: the score is the error.
  r.error.assign(L * H * C, 0.0);
  for (size_t l = 0; l < L; ++l)
    for (size_t h = 0; h < H; ++h) {
      double* e = &r.error[(l * H + h) * C];
      const bool ashape_first = (l + h) % 2 == 0;
      e[0] = ashape_first ? 0.1 : 0.3;
      e[1] = ashape_first ? 0.3 : 0.1;
      e[2] = l == 0 && h == 0 ? 0.2 : 0.5;
    }
  int32_t calls = 0;
  // Two held-out answers: the second is lost while any head of layer 1 uses the A-shape; the first always kept.
  auto kept = [&](const attn::AttentionPolicy& p) {
    ++calls;
    for (size_t h = 0; h < H; ++h)
      if (std::holds_alternative<attn::AShapePattern>(p.at(1, static_cast<int>(h)))) return 1;
    return 2;
  };
  EXPECT_EQ(repair_by_heldout(r, cfg, 2, kept), 2);
  for (size_t l = 0; l < L; ++l)
    for (size_t h = 0; h < H; ++h) {
      const size_t hh = l * H + h;
      const int32_t want = l == 0 && h == 0 ? 2 : 1;  // the A-shape heads to their next best: VS, BS for head 0
      EXPECT_EQ(r.choice[hh], want) << "layer " << l << " head " << h;
      EXPECT_EQ(r.score[hh], r.error[hh * C + static_cast<size_t>(want)]);
      EXPECT_EQ(r.policy.at(static_cast<int>(l), static_cast<int>(h)), r.candidates[static_cast<size_t>(want)]);
    }
  EXPECT_EQ(calls, 3);  // the plan, then each of the two candidates in use taken out once (no head chose BS)
  const std::vector<std::string> want_lines = {
      "held-out answers kept by the plan: 1 of 2", "without ashape(sink=16, local=64): 2 of 2",
      "without vertical_slash(v=64, s=64): 1 of 2",
      "taken out: ashape(sink=16, local=64) (its heads to their next-best candidate)"};
  EXPECT_EQ(r.repair, want_lines);
  // A plan that already keeps every answer is left as chosen; one that no move helps stays too.
  MInferenceResult same = r;
  same.repair.clear();
  EXPECT_EQ(repair_by_heldout(same, cfg, 2, [](const attn::AttentionPolicy&) { return 2; }), 2);
  EXPECT_EQ(same.choice[1], 1);
  EXPECT_EQ(same.choice[0], 0);  // every candidate allowed again: the error order
  EXPECT_EQ(same.repair, std::vector<std::string>{"held-out answers kept by the plan: 2 of 2"});
  MInferenceResult stuck = r;
  stuck.repair.clear();
  EXPECT_EQ(repair_by_heldout(stuck, cfg, 2, [](const attn::AttentionPolicy&) { return 1; }), 1);
  EXPECT_EQ(stuck.choice[0], 0);
  EXPECT_EQ(stuck.repair.back(), "no move keeps more: the plan stays");
}

// Dynamic candidates are re-sized by measurement: on the calibration q/k their mask density is the A-shape's,
// where the budget bound alone makes VS shapes execute far more.
// MInferenceOptions::device = Cuda: without a registered GPU search (this program does not link plan/cuda) an error
// naming the remedy; with one, plan_minference takes its errors and densities (weighted by 1 / samples) and chooses
// from them. The fake below gives head hh's candidate c the error |c - hh % C| + 0.5 and density 0.25 per sample, and
// over the query rows (when asked for them) the error |c - (hh + 1) % C| + 0.5: with the default query weight 0.75
// the choice follows the query rows; with query_rows 0 none are asked for and the choice follows all rows.
namespace {
int32_t g_fake_query_rows = -1;
void fake_gpu_search(const runtime::Model& model, const std::vector<int32_t>& tokens,
                     const std::vector<attn::Pattern>& candidates, double weight, std::vector<double>& error,
                     std::vector<double>& density, int32_t query_rows, std::vector<double>* query_error) {
  const size_t C = candidates.size();
  EXPECT_EQ(error.size(), static_cast<size_t>(model.config().num_layers * model.config().num_q_heads) * C);
  EXPECT_FALSE(tokens.empty());
  g_fake_query_rows = query_error != nullptr ? query_rows : 0;
  for (size_t hh = 0; hh < error.size() / C; ++hh) {
    for (size_t c = 0; c < C; ++c) {
      error[hh * C + c] += weight * (std::abs(static_cast<double>(c) - static_cast<double>(hh % C)) + 0.5);
      density[hh * C + c] += weight * 0.25;
      if (query_error != nullptr)
        (*query_error)[hh * C + c] +=
            weight * (std::abs(static_cast<double>(c) - static_cast<double>((hh + 1) % C)) + 0.5);
    }
  }
}
}  // namespace

TEST(MInferencePlan, DeviceSearchGoesThroughTheRegisteredFunction) {
  const runtime::Model& m = model("llama3");
  std::vector<CalibrationSample> samples(2);
  for (size_t s = 0; s < 2; ++s)
    for (int32_t i = 0; i < 130; ++i) samples[s].tokens.push_back(static_cast<int32_t>((i * 17 + 5 * s + 1) % 256));
  MInferenceOptions o;
  o.size_by_measurement = false;
  o.device = Device::Cuda;
  ASSERT_FALSE(cuda_minference_registered());
  EXPECT_EQ(error_of([&] { plan_minference(m, samples, o, ThreadPool::global()); }),
            "minference: this tessera has no CUDA search (built without the CUDA toolkit, or src/plan/cuda not "
            "linked); use the CPU (--device cpu)");
  register_cuda_minference(&fake_gpu_search);
  const MInferenceResult q = plan_minference(m, samples, o, ThreadPool::global());  // query rows 128, weight 0.75
  EXPECT_EQ(g_fake_query_rows, 128);
  o.query_rows = 0;
  const MInferenceResult r = plan_minference(m, samples, o, ThreadPool::global());
  EXPECT_EQ(g_fake_query_rows, 0);
  register_cuda_minference(nullptr);
  const size_t C = r.candidates.size();
  ASSERT_GE(C, 2u);
  EXPECT_TRUE(r.query_error.empty());
  for (size_t hh = 0; hh < r.choice.size(); ++hh) {
    EXPECT_EQ(r.choice[hh], static_cast<int32_t>(hh % C)) << "head " << hh;
    EXPECT_NEAR(r.score[hh], 0.5, 1e-12) << "head " << hh;
    for (size_t c = 0; c < C; ++c) EXPECT_NEAR(r.measured_density[hh * C + c], 0.25, 1e-12);
    const size_t a = hh % C, b = (hh + 1) % C;
    EXPECT_EQ(q.choice[hh], static_cast<int32_t>(b)) << "head " << hh;
    EXPECT_NEAR(q.score[hh], 0.25 * (std::abs(static_cast<double>(b) - static_cast<double>(a)) + 0.5) + 0.75 * 0.5,
                1e-12)
        << "head " << hh;
  }
}

// The sizing reads one global layer's q and k through the engine's observer, whose k is the KV cache's element type:
// with the CPU's default f16 cache the candidates come out as with an f32 one (within f16's rounding of k) — they were
// read as floats, past the cache's rows (a crash on Gemma-3 at 32K on the GPU machine, garbage sizes before it).
TEST(MInferencePlan, CandidatesSizedAlikeWithAnF16KVCache) {
  const runtime::Model& m = model("llama3");
  std::vector<CalibrationSample> samples(1);
  for (int32_t i = 0; i < 250; ++i) samples[0].tokens.push_back(static_cast<int32_t>((i * 31 + 3) % 256));
  MInferenceOptions o;
  o.budget = 0.8;
  const runtime::KVType was = runtime::default_kv_type();
  runtime::set_default_kv_type(runtime::KVType::F32);
  const MInferenceResult f32 = plan_minference(m, samples, o, ThreadPool::global());
  runtime::set_default_kv_type(runtime::KVType::F16);
  const MInferenceResult f16 = plan_minference(m, samples, o, ThreadPool::global());
  runtime::set_default_kv_type(was);
  ASSERT_EQ(f16.candidates.size(), f32.candidates.size());
  for (size_t c = 0; c < f32.candidates.size(); ++c) {
    EXPECT_EQ(attn::describe(f16.candidates[c]), attn::describe(f32.candidates[c]));
    EXPECT_NEAR(f16.candidate_density[c], f32.candidate_density[c], 0.01) << attn::describe(f32.candidates[c]);
  }
}

TEST(MInferencePlan, CandidatesSizedByMeasuredDensity) {
  const runtime::Model& m = model("llama3");
  std::vector<CalibrationSample> samples(1);
  for (int32_t i = 0; i < 250; ++i) samples[0].tokens.push_back(static_cast<int32_t>((i * 31 + 3) % 256));
  MInferenceOptions o;
  o.budget = 0.8;  // at 250 tokens a VS shape needs a budget of 64 + 2 x 64 cells per row to keep both floors
  const MInferenceResult r = plan_minference(m, samples, o, ThreadPool::global());
  const size_t C = r.candidates.size();
  ASSERT_GE(C, 3u);  // the A-shape, at least one VS shape, BS
  ASSERT_TRUE(std::holds_alternative<attn::BlockSparsePattern>(r.candidates.back()));
  const double target = r.candidate_density[0];
  for (size_t c = 1; c < C; ++c) EXPECT_GE(r.candidate_density[c], target) << attn::describe(r.candidates[c]);
  for (size_t c = 1; c + 1 < C; ++c) {  // VS (BS moves in whole blocks: 4 at this length); the floors may bind
    const auto& vs = std::get<attn::VerticalSlashPattern>(r.candidates[c]);
    if (vs.vertical > kMinVerticals && vs.slash > kMinSlashes) {
      EXPECT_LE(r.candidate_density[c], target + 0.1) << attn::describe(r.candidates[c]);
    }
    EXPECT_GE(vs.vertical, kMinVerticals);
    EXPECT_GE(vs.slash, kMinSlashes);
  }
  // (That the budget bound alone makes VS shapes execute about twice the target shows at real lengths — README,
  // "After these runs" — not within the tiny models' 256 positions once the 64 / 64 floors apply.)
}

class CalibrationFiles : public ::testing::Test {
 protected:
  fs::path dir = fs::temp_directory_path() / ("tessera_plan_test_" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
  fs::path write(const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return dir / name;
  }
};

TEST_F(CalibrationFiles, Errors) {
  EXPECT_EQ(error_of([&] { check_calibration_file(dir / "missing.jsonl"); }),
            (dir / "missing.jsonl").string() + ": no such calibration file");
  const auto empty = write("empty.jsonl", "\n  \n");
  EXPECT_EQ(error_of([&] { check_calibration_file(empty); }),
            empty.string() + ": no calibration samples (the file is empty)");
  const auto bad = write("bad.jsonl", "{\"prompt\": \"a\"}\n\n{\"prompt\": 3}\n");
  EXPECT_EQ(error_of([&] { check_calibration_file(bad); }),
            bad.string() + ": line 3: expected a JSON object with a string \"prompt\"");
  const auto broken = write("broken.jsonl", "{\"prompt\": \"a\", \"target\": \"b\"}\n{\"prompt\": \n");
  EXPECT_EQ(error_of([&] { check_calibration_file(broken); }),
            broken.string() + ": line 2: not valid JSON (each line of a .jsonl calibration file is one object "
                              "{\"prompt\": \"...\", \"target\": \"...\"})");
  const auto target = write("target.jsonl", "{\"prompt\": \"a\", \"target\": 5}\n");
  EXPECT_EQ(error_of([&] { check_calibration_file(target); }), target.string() + ": line 1: \"target\" must be a string");
  const auto text = write("notes.txt", "Some text.");
  EXPECT_EQ(error_of([&] { check_calibration_file(text); }), "(no error)");
}

// Targets are the dense model's greedy tokens, each predicted at the position before it.
TEST(Calibration, AnswersAreTheDenseModelsGreedyTokens) {
  const runtime::Model& m = model("llama3");
  const auto tok = model::Tokenizer::from_hf_file(kFixtures + "tokenizer/tiny_llama3_tokenizer.json");
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 30; ++i) prompt.push_back((i * 13 + 5) % 200 + 4);
  const CalibrationSample s = answer_sample(m, *tok, "t", prompt, 6);
  EXPECT_EQ(s.prompt_tokens, 30);
  ASSERT_FALSE(s.targets.empty());
  ASSERT_LE(s.targets.size(), 6u);
  EXPECT_EQ(s.tokens.size(), 30 + s.targets.size() - 1);
  runtime::Engine engine(m);
  const std::vector<float> logits = engine.forward_all_logits(s.tokens);
  const int64_t V = m.config().vocab_size;
  for (size_t k = 0; k < s.targets.size(); ++k) {
    EXPECT_EQ(s.targets[k].position, 29 + static_cast<int32_t>(k));
    const float* row = logits.data() + s.targets[k].position * V;
    EXPECT_EQ(std::max_element(row, row + V) - row, s.targets[k].token) << "answer token " << k;
    if (k + 1 < s.targets.size()) {
      EXPECT_EQ(s.tokens[static_cast<size_t>(30 + k)], s.targets[k].token);
    }
  }
  // A given target is used as is.
  const CalibrationSample g = answer_sample(m, *tok, "g", prompt, 6, {7, 8, 9});
  EXPECT_EQ(g.targets, (std::vector<Target>{{29, 7}, {30, 8}, {31, 9}}));
  EXPECT_EQ(g.tokens.size(), 32u);
}

TEST(PlanReport, CostsAndPicture) {
  const auto policy = attn::AttentionPolicy::trianglemix(attn::AttentionPolicy::uniform(4, 2, 1, attn::DensePattern{}), 2,
                                                         attn::TrianglePattern{});
  const auto costs = plan_costs(policy, 4, 2, 64, {1024, 8192});
  ASSERT_EQ(costs.size(), 2u);
  const double tri = block_coverage(attn::TrianglePattern{}, 8192).density;
  EXPECT_NEAR(costs[1].density, (1.0 + tri) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(costs[1].dense_flops, 4.0 * 64 * 8192.0 * 8193 / 2 * 8);
  EXPECT_DOUBLE_EQ(costs[1].flops, costs[1].density * costs[1].dense_flops);
  // A window model: layer 1 (dense) has a 512-token window, counted at the window's density, the exact cell count.
  const auto windowed = plan_costs(policy, 4, 2, 64, {8192}, {0, 512, 0, 0});
  int64_t window_cells = 0;
  for (int64_t row = 0; row < 8192; ++row) window_cells += std::min<int64_t>(row + 1, 512);
  EXPECT_NEAR(window_density(512, 8192), static_cast<double>(window_cells) / (8192.0 * 8193 / 2), 1e-15);
  EXPECT_NEAR(windowed[0].density, (1.0 + window_density(512, 8192) + 2 * tri) / 4, 1e-12);
  EXPECT_EQ(window_density(512, 300), 1.0);
  const std::string svg = plan_svg(policy, 4, 2, 8192, "t <1>");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("t &lt;1&gt;"), std::string::npos);
  size_t cells = 0;
  for (size_t at = svg.find("<title>layer"); at != std::string::npos; at = svg.find("<title>layer", at + 1)) ++cells;
  EXPECT_EQ(cells, 8u);
  const auto lines = layer_summary(policy, 4, 2, 8192);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "layer  0: dense 2  (1 distinct)  density 1.000");
  EXPECT_EQ(lines[3].substr(0, 34), "layer  3: triangle 2  (1 distinct)");
}

}  // namespace
}  // namespace tessera::plan
