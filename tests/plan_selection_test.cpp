// Issue 33's pieces of tessera plan: the planned range and its warning, MInference's candidates for a length (the
// degenerate shapes raised or dropped), MoA's pick by held-out validation, the calibration noise of the loss
// estimate (compare_losses), the uniform window of a density, per-sample influence in the profile, and the
// held-out answer agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "plan/calibration.h"
#include "plan/compare.h"
#include "plan/measure.h"
#include "plan/minference_plan.h"
#include "plan/moa_plan.h"
#include "plan/planned_range.h"
#include "plan/profile.h"
#include "plan/trianglemix_plan.h"
#include "plan/validation.h"
#include "model/model.h"
#include "test_support.h"

namespace tessera::plan {
namespace {

using namespace tessera::test;

namespace fs = std::filesystem;

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/";

const runtime::Model& tiny_llama() {
  static std::unique_ptr<runtime::Model> m = runtime::Model::load(kFixtures + "hf_tiny/llama3");
  return *m;
}

attn::VerticalSlashPattern vs(int32_t v, int32_t s) {
  attn::VerticalSlashPattern p;
  p.vertical = v;
  p.slash = s;
  return p;
}

TEST(PlannedRange, WarningOnlyFarOutside) {
  const PlannedRange r{2048, 8192};
  EXPECT_EQ(range_warning(r, 1024, "p.json"), std::nullopt);   // exactly half the shortest
  EXPECT_EQ(range_warning(r, 16384, "p.json"), std::nullopt);  // exactly twice the longest
  EXPECT_EQ(range_warning(r, 4000, "p.json"), std::nullopt);
  EXPECT_EQ(range_warning(r, 1023, "p.json"),
            "warning: plan p.json was made for prompts of 2,048-8,192 tokens; this one has 1,023 (under a half of "
            "the shortest): its patterns were sized for the planned lengths, so density and accuracy may differ from "
            "the plan's; plan again with tessera plan --lengths covering 1023");
  EXPECT_EQ(range_warning(r, 16385, "p.json"),
            "warning: plan p.json was made for prompts of 2,048-8,192 tokens; this one has 16,385 (over twice the "
            "longest): its patterns were sized for the planned lengths, so density and accuracy may differ from the "
            "plan's; plan again with tessera plan --lengths covering 16385");
}

TEST(PlannedRange, ReadFromThePlanFile) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_plan_range_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path plan = dir / "p.json";
  std::ofstream(plan) << R"({"tessera_policy": 1, "num_layers": 2, "num_q_heads": 2, "num_kv_heads": 1,
    "default": {"type": "dense"}, "planned_lengths": [1024, 4096]})";
  // The policy loader accepts the field, and the range reads back.
  EXPECT_EQ(attn::load_policy_file(plan).num_layers(), 2);
  EXPECT_EQ(planned_range_in_file(plan.string()), (PlannedRange{1024, 4096}));
  EXPECT_EQ(planned_range_warning(plan.string(), 9000),
            "warning: plan " + plan.string() + " was made for prompts of 1,024-4,096 tokens; this one has 9,000 (over "
            "twice the longest): its patterns were sized for the planned lengths, so density and accuracy may differ "
            "from the plan's; plan again with tessera plan --lengths covering 9000");
  EXPECT_EQ(planned_range_warning(plan.string(), 600), std::nullopt);
  // Presets and plans without the field: nothing.
  EXPECT_EQ(planned_range_warning("dense", 100000), std::nullopt);
  EXPECT_EQ(planned_range_warning("vs:v=100,s=200", 100000), std::nullopt);
  const fs::path old = dir / "old.json";
  std::ofstream(old) << R"({"tessera_policy": 1, "num_layers": 1, "num_q_heads": 1, "num_kv_heads": 1,
    "default": {"type": "dense"}})";
  EXPECT_EQ(planned_range_in_file(old.string()), std::nullopt);
  // A malformed range is an error naming the file.
  const fs::path bad = dir / "bad.json";
  std::ofstream(bad) << R"({"planned_lengths": [4096, 1024]})";
  EXPECT_EQ(error_of([&] { planned_range_in_file(bad.string()); }),
            bad.string() + ": 'planned_lengths' must be [min, max] with 1 <= min <= max tokens, got [4096,1024]");
  EXPECT_EQ(error_of([&] { planned_range_of(nlohmann::json::parse(R"({"planned_lengths": 2048})"), "x"); }),
            "x: 'planned_lengths' must be [min, max] with 1 <= min <= max tokens, got 2048");
  EXPECT_EQ(planned_range_json({512, 2048}).dump(), "[512,2048]");
  fs::remove_all(dir);
}

TEST(MInferenceCandidates, DegenerateShapesDroppedOrRaised) {
  std::vector<attn::Pattern> c = {vs(2, 181), vs(64, 64), attn::AShapePattern{16, 64}, vs(64, 64), vs(500, 63),
                                  attn::AShapePattern{16, 64}, vs(63, 500)};
  EXPECT_EQ(drop_degenerate(c), (std::vector<size_t>{1, 2}));
  EXPECT_EQ(c, (std::vector<attn::Pattern>{vs(64, 64), attn::AShapePattern{16, 64}}));
}

TEST(MInferenceCandidates, SizedForTheLength) {
  // At 1,024 tokens and budget 0.3 the paper's shapes scale to (2, 152), (8, 149), (44, 132), (271, 18): each is
  // raised to the floors with vertical + 2 slash kept, and the second equals the first.
  const auto c = minference_candidates(0.3, 1024);
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(attn::describe(c[1]), attn::describe(vs(64, 121)));
  EXPECT_EQ(attn::describe(c[2]), attn::describe(vs(64, 122)));
  EXPECT_EQ(attn::describe(c[3]), attn::describe(vs(179, 64)));
  EXPECT_EQ(std::get<attn::BlockSparsePattern>(c[4]).top_k, 3);  // 0.3 x 8.5 causal blocks on average
  // At 8,192: (18, 1220) raised to (64, 1197); (66, 1196), (351, 1053) and (2168, 145) as scaled.
  const auto l = minference_candidates(0.3, 8192);
  ASSERT_EQ(l.size(), 6u);
  EXPECT_EQ(attn::describe(l[1]), attn::describe(vs(64, 1197)));
  EXPECT_EQ(attn::describe(l[2]), attn::describe(vs(66, 1196)));
  EXPECT_EQ(attn::describe(l[3]), attn::describe(vs(351, 1053)));
  EXPECT_EQ(attn::describe(l[4]), attn::describe(vs(2168, 145)));
  for (const auto& p : l)
    if (const auto* v = std::get_if<attn::VerticalSlashPattern>(&p)) {
      EXPECT_GE(v->vertical, kMinVerticals);
      EXPECT_GE(v->slash, kMinSlashes);
    }
}

TEST(MoaSelection, HeldOutAgreementFirstThenPerplexity) {
  EXPECT_EQ(select_by_validation({{0.5, 9.0}, {0.75, 12.0}, {0.75, 11.0}, {0.25, 5.0}}), 2u);
  EXPECT_EQ(select_by_validation({{1.0, 9.0}, {1.0, 9.0}}), 0u);              // a full tie: the first
  EXPECT_EQ(select_by_validation({{-1, 9.0}, {-1, 8.5}, {-1, 8.7}}), 1u);     // no agreement measured: perplexity
  EXPECT_EQ(select_by_validation({{0.5, 0}, {0.5, 0}, {1.0, 0}}), 2u);        // no perplexity measured
  EXPECT_EQ(error_of([] { select_by_validation({}); }), "moa: no plans to select from");
}

TEST(MoaSelection, PooledOverLengthsAndTexts) {
  const ValidationScore v = pooled_validation(3, 4, {4.0, 9.0});
  EXPECT_DOUBLE_EQ(v.agreement, 0.75);
  EXPECT_NEAR(v.perplexity, 6.0, 1e-12);  // the geometric mean: exp((log 4 + log 9) / 2)
  const ValidationScore one = pooled_validation(0, 2, {17.13});
  EXPECT_DOUBLE_EQ(one.agreement, 0.0);
  EXPECT_DOUBLE_EQ(one.perplexity, 17.13);
  const ValidationScore none = pooled_validation(0, 0, {});
  EXPECT_DOUBLE_EQ(none.agreement, -1.0);  // not measured, as select_by_validation reads it
  EXPECT_DOUBLE_EQ(none.perplexity, 0.0);
  // A plan that is better at one length and worse at the other: the geometric mean weighs relative changes alike.
  EXPECT_EQ(select_by_validation({pooled_validation(2, 2, {5.0, 6.2}), pooled_validation(2, 2, {5.1, 6.0})}), 1u);
  EXPECT_EQ(error_of([] { pooled_validation(0, 1, {5.0, 0.0}); }), "moa: validation perplexity must be > 0, got 0");
  EXPECT_EQ(error_of([] { pooled_validation(3, 2, {}); }), "moa: held-out answers kept 3 of 2");
}

// One layer, one head, 256 tokens (4 blocks), two samples with known influence.
GradientProfile two_sample_profile() {
  GradientProfile p;
  p.num_layers = 1;
  p.num_q_heads = 1;
  LengthProfile lp;
  lp.length = 256;
  lp.num_blocks = 4;
  lp.samples = 2;
  lp.sample_influence.assign(2, std::vector<double>(16, 0.0));
  for (size_t qb = 0; qb < 4; ++qb)
    for (size_t kb = 0; kb <= qb; ++kb) {
      lp.sample_influence[0][qb * 4 + kb] = 1.0 + static_cast<double>(qb) - static_cast<double>(kb);
      lp.sample_influence[1][qb * 4 + kb] = 0.5 * static_cast<double>(qb + kb);
    }
  lp.influence.assign(16, 0.0);
  for (size_t i = 0; i < 16; ++i) lp.influence[i] = (lp.sample_influence[0][i] + lp.sample_influence[1][i]) / 2;
  p.lengths.push_back(lp);
  return p;
}

TEST(MoaNoise, MeanAndStandardErrorOverSamples) {
  const GradientProfile p = two_sample_profile();
  const attn::Pattern dense = attn::DensePattern{};
  const attn::Pattern window = attn::ElasticWindowPattern{64, 0, 0};  // a 64-token window, no sink
  const std::vector<double> kept = block_coverage(window, 256).kept;
  double l[2] = {0, 0};
  for (size_t s = 0; s < 2; ++s)
    for (size_t qb = 0; qb < 4; ++qb)
      for (size_t kb = 0; kb <= qb; ++kb) l[s] += (1 - kept[qb * 4 + kb]) * p.lengths[0].sample_influence[s][qb * 4 + kb];
  ASSERT_GT(std::abs(l[0] - l[1]), 1e-6);
  const auto c = compare_losses(p, {dense}, {window});
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].length, 256);
  EXPECT_EQ(c[0].samples, 2);
  EXPECT_DOUBLE_EQ(c[0].loss, 0.0);  // dense masks nothing
  EXPECT_DOUBLE_EQ(c[0].loss_se, 0.0);
  EXPECT_DOUBLE_EQ(c[0].other, (l[0] + l[1]) / 2);
  EXPECT_DOUBLE_EQ(c[0].other_se, std::abs(l[0] - l[1]) / 2);  // sd / sqrt(2) with n - 1 = 1
  EXPECT_DOUBLE_EQ(c[0].diff, -(l[0] + l[1]) / 2);
  EXPECT_DOUBLE_EQ(c[0].diff_se, std::abs(l[0] - l[1]) / 2);
  // One sample: no standard error.
  GradientProfile one = p;
  one.lengths[0].sample_influence.resize(1);
  EXPECT_TRUE(std::isnan(compare_losses(one, {dense}, {window})[0].other_se));
  EXPECT_EQ(error_of([&] { compare_losses(p, {dense, dense}, {window}); }),
            "moa: compare_losses needs one pattern per head (1), got 2 and 1");
  GradientProfile none = p;
  none.lengths[0].sample_influence.clear();
  EXPECT_EQ(error_of([&] { compare_losses(none, {dense}, {window}); }),
            "moa: compare_losses needs a profile made with keep_samples");
}

TEST(MoaNoise, FisherLossPerSampleSquares) {
  // The Fisher estimate of a plan's loss per sample is the sum over heads of d_s^2 / 2 (d_s: the sample's masked
  // influence), its mean and standard error over the samples as for the first-order one.
  const GradientProfile p = two_sample_profile();
  const attn::Pattern dense = attn::DensePattern{};
  const attn::Pattern window = attn::ElasticWindowPattern{64, 0, 0};
  const std::vector<double> kept = block_coverage(window, 256).kept;
  double d[2] = {0, 0};
  for (size_t s = 0; s < 2; ++s)
    for (size_t qb = 0; qb < 4; ++qb)
      for (size_t kb = 0; kb <= qb; ++kb) d[s] += (1 - kept[qb * 4 + kb]) * p.lengths[0].sample_influence[s][qb * 4 + kb];
  const double f0 = d[0] * d[0] / 2, f1 = d[1] * d[1] / 2;
  ASSERT_GT(std::abs(f0 - f1), 1e-6);
  const auto c = compare_losses(p, {window}, {dense}, LossEstimate::Fisher);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_DOUBLE_EQ(c[0].loss, (f0 + f1) / 2);
  EXPECT_DOUBLE_EQ(c[0].loss_se, std::abs(f0 - f1) / 2);
  EXPECT_DOUBLE_EQ(c[0].other, 0.0);
  EXPECT_DOUBLE_EQ(c[0].diff, (f0 + f1) / 2);
  // rule_losses agrees with it for the same window as an elastic rule (alpha 64, beta 0, no sink).
  const auto l = rule_losses(p, {ElasticRule{64, 0}}, 0, LossEstimate::Fisher);
  EXPECT_DOUBLE_EQ(l[0][0], (f0 + f1) / 2);
  GradientProfile none = p;
  none.lengths[0].sample_influence.clear();
  EXPECT_EQ(error_of([&] { rule_losses(none, {ElasticRule{64, 0}}, 0, LossEstimate::Fisher); }),
            "moa: the fisher loss needs a profile made with keep_samples");
  EXPECT_EQ(parse_loss_estimate("fisher"), LossEstimate::Fisher);
  EXPECT_EQ(parse_loss_estimate("first-order"), LossEstimate::FirstOrder);
  EXPECT_STREQ(loss_estimate_name(LossEstimate::Fisher), "fisher");
  EXPECT_EQ(error_of([] { parse_loss_estimate("taylor"); }), "--moa-loss must be first-order or fisher, got 'taylor'");
}

TEST(MoaNoise, FisherLossFromEachSamplesOwnPass) {
  // On a real (tiny) model: the Fisher rule loss of a 3-sample profile is 1/2 the mean of the squares of the
  // first-order rule losses of each sample profiled alone (each a separate reverse-mode pass; the first-order
  // influence itself is checked against finite differences in plan_gradients_test).
  const runtime::Model& m = tiny_llama();
  std::vector<CalibrationSample> samples(3);
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t i = 0; i < 180 + 20 * static_cast<int32_t>(s); ++i)
      samples[s].tokens.push_back(static_cast<int32_t>((i * 13 + 7 * s + 3) % 250));
    const auto n = static_cast<int32_t>(samples[s].tokens.size());
    samples[s].targets = {{n - 3, samples[s].tokens[static_cast<size_t>(n - 2)]}, {n - 2, samples[s].tokens.back()}};
  }
  const std::vector<ElasticRule> rules = {{-2048, 0}, {0, 0.25}, {0, 0.5}, {64, 0.125}};
  const GradientProfile all = profile_gradients(m, samples, {256}, {}, ThreadPool::global(), {}, Device::Cpu, true);
  const auto fisher = rule_losses(all, rules, 64, LossEstimate::Fisher);
  std::vector<double> want(fisher[0].size(), 0.0);
  for (const CalibrationSample& s : samples) {
    const auto first = rule_losses(profile_gradients(m, {s}, {256}, {}, ThreadPool::global()), rules, 64);
    for (size_t i = 0; i < want.size(); ++i) want[i] += first[0][i] * first[0][i] / 2 / 3;
  }
  double largest = 0;
  for (double w : want) largest = std::max(largest, w);
  ASSERT_GT(largest, 0);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(fisher[0][i], want[i], 1e-12 * largest) << i;
    EXPECT_GE(fisher[0][i], 0.0);
  }
}

TEST(MoaNoise, UniformWindowOfADensity) {
  for (double d : {0.1, 0.25, 0.5}) {
    const attn::ElasticWindowPattern w = uniform_window_for(d, 4096);
    EXPECT_EQ(w.alpha, 0);
    EXPECT_EQ(w.sink, 64);
    EXPECT_GE(pattern_density_exact(w, 4096), d);
    EXPECT_LT(pattern_density_exact(attn::ElasticWindowPattern{0, w.beta - 2e-6, 64}, 4096), d);
  }
  EXPECT_EQ(error_of([] { uniform_window_for(0, 4096); }), "moa: a window density must be in (0, 1], got 0.000000");
}

TEST(Profile, KeepsEverySamplesInfluence) {
  const runtime::Model& m = tiny_llama();
  std::vector<CalibrationSample> samples(3);
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t i = 0; i < 100 + 10 * static_cast<int32_t>(s); ++i)
      samples[s].tokens.push_back(static_cast<int32_t>((i * 17 + 5 * s + 1) % 250));
    samples[s].targets = {{static_cast<int32_t>(samples[s].tokens.size()) - 2, samples[s].tokens.back()}};
  }
  const GradientProfile p = profile_gradients(m, samples, {128}, {}, ThreadPool::global(), {}, Device::Cpu, true);
  ASSERT_EQ(p.lengths.size(), 1u);
  const LengthProfile& lp = p.lengths[0];
  ASSERT_EQ(lp.sample_influence.size(), 3u);
  double largest = 0;
  for (size_t i = 0; i < lp.influence.size(); ++i) {
    EXPECT_NEAR(lp.influence[i], (lp.sample_influence[0][i] + lp.sample_influence[1][i] + lp.sample_influence[2][i]) / 3,
                1e-15 + 1e-12 * std::abs(lp.influence[i]));
    largest = std::max(largest, std::abs(lp.sample_influence[0][i] - lp.sample_influence[1][i]));
  }
  EXPECT_GT(largest, 0);  // the samples differ
  // Each sample's influence is its own pass's: profiling it alone gives the same numbers.
  const GradientProfile alone = profile_gradients(m, {samples[1]}, {128}, {}, ThreadPool::global());
  for (size_t i = 0; i < lp.influence.size(); ++i) EXPECT_EQ(alone.lengths[0].influence[i], lp.sample_influence[1][i]);
  // Without keep_samples nothing is kept.
  EXPECT_TRUE(alone.lengths[0].sample_influence.empty());
}

// MoA's layer repair on a synthetic loss: the plan's rules on layer 1 lose to the uniform window (they add to the
// loss), on the other layers they win; the window's own loss falls with its width. The repair measures each layer,
// keeps the plan's rules on layers 0, 2, 3 and gives layer 1 the window whose beta brings the mean density back to
// the uniform window's.
TEST(MoaLayerRepair, TheWindowWhereThePlansRulesLose) {
  const int L = 4, H = 2;
  const int32_t n = 512;
  std::vector<attn::Pattern> planned;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) planned.push_back(attn::ElasticWindowPattern{8.0, h == 0 ? 0.125 : 0.75, 64});
  const attn::AttentionPolicy plan(L, H, 1, planned);
  int32_t calls = 0;
  auto lp = [&](const attn::AttentionPolicy& p) {
    ++calls;
    double sum = 0;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const attn::Pattern& x = p.at(l, h);
        if (x == planned[static_cast<size_t>(l * H + h)])
          sum += l == 1 ? 1.0 : -1.0;
        else
          sum += -0.5 * std::get<attn::ElasticWindowPattern>(x).beta;
      }
    return sum;
  };
  const double beta = 0.3;
  const LayerRepair r = repair_layers(plan, beta, {n}, lp);
  // W, the plan, W at beta x0.8 and x1.2, 4 layers, and the repaired plans for k = 2 and k = 3 (all good layers).
  EXPECT_EQ(calls, 1 + 1 + 2 + L + 2);
  ASSERT_EQ(r.net.size(), static_cast<size_t>(L));
  EXPECT_GT(r.net[1], 0);
  for (int l : {0, 2, 3}) EXPECT_LT(r.net[static_cast<size_t>(l)], 0) << l;
  EXPECT_EQ(r.kept_layers, (std::vector<int32_t>{0, 2, 3}));
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(r.policy.at(1, h), attn::Pattern(attn::ElasticWindowPattern{0.0, r.free_beta, 64}));
    for (int l : {0, 2, 3}) EXPECT_EQ(r.policy.at(l, h), planned[static_cast<size_t>(l * H + h)]);
  }
  // The mean density at n is the uniform window's (the free beta is the least that reaches it).
  double d = 0, w = pattern_density_exact(attn::ElasticWindowPattern{0.0, beta, 64}, n);
  for (const attn::Pattern& x : r.policy.table()) d += pattern_density_exact(x, n) / (L * H);
  EXPECT_GE(d, w);
  EXPECT_LT(d - w, 0.01);
  EXPECT_DOUBLE_EQ(r.lp, lp(r.policy));
  EXPECT_LT(r.lp, r.window_lp);
  EXPECT_EQ(r.lines.back().rfind("repaired: the plan's rules on 3 layers, window beta ", 0), 0u) << r.lines.back();
  // Every layer's rules losing: the window everywhere.
  auto worse = [&](const attn::AttentionPolicy& p) {
    double sum = 0;
    for (const attn::Pattern& x : p.table())
      sum += std::find(planned.begin(), planned.end(), x) != planned.end()
                 ? 1.0
                 : -0.5 * std::get<attn::ElasticWindowPattern>(x).beta;
    return sum;
  };
  const LayerRepair all = repair_layers(plan, beta, {n}, worse);
  EXPECT_TRUE(all.kept_layers.empty());
  EXPECT_EQ(all.policy.table(), std::vector<attn::Pattern>(L * H, attn::ElasticWindowPattern{0.0, beta, 64}));
  // A model window layer (layer 2) stays as planned everywhere and is not measured.
  const LayerRepair windowed = repair_layers(plan, beta, {n}, worse, {0, 0, 512, 0});
  EXPECT_EQ(windowed.net[2], 0.0);
  for (int h = 0; h < H; ++h) EXPECT_EQ(windowed.policy.at(2, h), planned[static_cast<size_t>(2 * H + h)]);
  const attn::AttentionPolicy ashape(1, 1, 1, {attn::AShapePattern{4, 16}});
  EXPECT_EQ(error_of([&] { repair_layers(ashape, beta, {n}, lp); }),
            "moa repair: layer 0 head 0 is ashape(sink=4, local=16), not a moa_window");
}

// `count` samples of `length` tokens (token i of sample s: (i * mul + add + shift * s) % 200 + 4) answered by the dense
// model with `answer` tokens, named prefix + s.
std::vector<CalibrationSample> answered_samples(const runtime::Model& m, int32_t count, int32_t length, int32_t mul,
                                                int32_t add, int32_t shift, int32_t answer, const std::string& prefix) {
  const auto tok = model::Tokenizer::from_hf_file(kFixtures + "tokenizer/tiny_llama3_tokenizer.json");
  std::vector<CalibrationSample> samples;
  for (int32_t s = 0; s < count; ++s) {
    std::vector<int32_t> prompt;
    for (int32_t i = 0; i < length; ++i) prompt.push_back((i * mul + add + shift * s) % 200 + 4);
    samples.push_back(answer_sample(m, *tok, prefix + std::to_string(s), prompt, answer));
  }
  return samples;
}

TEST(Validation, AgreementWithTheDenseAnswers) {
  const runtime::Model& m = tiny_llama();
  const std::vector<CalibrationSample> samples = answered_samples(m, 2, 40, 13, 5, 7, 5, "s");
  const Agreement dense = answer_agreement(m, {}, samples);
  EXPECT_EQ(dense.kept, 2);
  EXPECT_EQ(dense.total, 2);
  EXPECT_EQ(dense.per_sample, (std::vector<bool>{true, true}));
  EXPECT_DOUBLE_EQ(dense.share(), 1.0);
  // A target that is not the greedy token: that sample is not kept.
  std::vector<CalibrationSample> changed = samples;
  Target& last = changed[1].targets.back();
  last.token = (last.token + 1) % static_cast<int32_t>(m.config().vocab_size);
  const Agreement a = answer_agreement(m, {}, changed);
  EXPECT_EQ(a.per_sample, (std::vector<bool>{true, false}));
  EXPECT_DOUBLE_EQ(a.share(), 0.5);
  CalibrationSample empty;
  empty.name = "e";
  EXPECT_EQ(error_of([&] { answer_agreement(m, {}, {empty}); }), "validation: sample e has no answer to check");
}

TEST(Measure, ExecutedDensityIsTheIndexAccounting) {
  const runtime::Model& m = tiny_llama();
  const auto& c = m.config();
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 200; ++i) tokens.push_back((i * 29 + 11) % 250);
  const attn::Pattern a = attn::AShapePattern{16, 64};
  const double exact = pattern_density_exact(a, 200);
  ASSERT_LT(exact, 0.9);
  // Layer 0 dense, the others the A-shape: the causal cells of every layer count alike.
  std::vector<attn::Pattern> table(static_cast<size_t>(c.num_layers * c.num_q_heads), a);
  for (int32_t h = 0; h < c.num_q_heads; ++h) table[static_cast<size_t>(h)] = attn::DensePattern{};
  const std::vector<double> d = executed_density(
      m, tokens,
      {attn::AttentionPolicy{}, attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, a),
       attn::AttentionPolicy(c.num_layers, c.num_q_heads, c.num_kv_heads, table)},
      ThreadPool::global());
  ASSERT_EQ(d.size(), 3u);
  EXPECT_DOUBLE_EQ(d[0], 1.0);
  EXPECT_DOUBLE_EQ(d[1], exact);
  EXPECT_NEAR(d[2], (1.0 + (c.num_layers - 1) * exact) / c.num_layers, 1e-12);
  EXPECT_EQ(error_of([&] { executed_density(m, {}, {}, ThreadPool::global()); }), "measure: empty prompt");
  EXPECT_EQ(error_of([&] {
              executed_density(m, tokens, {attn::AttentionPolicy::uniform(1, 2, 1, a)}, ThreadPool::global());
            }),
            "measure: a policy of 1 layers x 2 heads for a model of " + std::to_string(c.num_layers) + " x " +
                std::to_string(c.num_q_heads));
}

// tessera plan --compare-with: every policy's executed density on each prompt and its held-out agreement, as
// measure.h and validation.h give them one at a time; the report's lines.
TEST(Compare, EachPolicysDensityAndHeldOutAnswers) {
  const runtime::Model& m = tiny_llama();
  const auto& c = m.config();
  const std::vector<CalibrationSample> heldout = answered_samples(m, 3, 120, 17, 3, 11, 4, "h");
  std::vector<std::vector<int32_t>> prompts(2);
  for (int32_t i = 0; i < 200; ++i) prompts[0].push_back((i * 29 + 11) % 250);
  for (int32_t i = 0; i < 150; ++i) prompts[1].push_back((i * 31 + 7) % 250);
  const attn::AttentionPolicy narrow = attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads,
                                                                      attn::AShapePattern{2, 8});
  const std::vector<std::pair<std::string, attn::AttentionPolicy>> pols{{"dense", {}}, {"ashape", narrow}};
  const std::vector<ComparedPolicy> rows = compare_policies(m, pols, prompts, heldout, nullptr, ThreadPool::global());
  ASSERT_EQ(rows.size(), 2u);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].name, pols[i].first);
    ASSERT_EQ(rows[i].density.size(), 2u);
    for (size_t j = 0; j < prompts.size(); ++j)
      EXPECT_EQ(rows[i].density[j], executed_density(m, prompts[j], {pols[i].second}, ThreadPool::global())[0]);
    const Agreement one = answer_agreement(m, pols[i].second, heldout);
    EXPECT_EQ(rows[i].heldout.per_sample, one.per_sample);
    EXPECT_EQ(rows[i].heldout.kept, one.kept);
    EXPECT_EQ(rows[i].heldout.total, 3);
  }
  EXPECT_EQ(rows[0].heldout.kept, 3);  // dense reproduces its own answers
  EXPECT_DOUBLE_EQ(rows[0].density[0], 1.0);
  EXPECT_LT(rows[1].density[0], rows[1].density[1]);  // the fixed window covers less of the longer prompt
  ComparedPolicy r{"vs_adaptive", {0.15493, 0.5}, {}};
  r.heldout.kept = 3;
  r.heldout.total = 4;
  EXPECT_EQ(compare_lines({r}, {16384, 4096}),
            std::vector<std::string>{"vs_adaptive: kept 3 of 4 held-out answers, executed density 0.155 / 0.500 at "
                                     "16384 / 4096"});
  EXPECT_EQ(error_of([&] { compare_lines({r}, {16384}); }), "compare: 2 densities for 1 lengths");
}

// TriangleMix's split by held-out validation: from the probe's split, earlier while the plans keep dense's answers
// and stay within the tolerance of its log perplexity; later when the probe's split does not.
TEST(TriangleMixSelect, EarliestSplitWithinTheToleranceFromEitherSide) {
  constexpr int32_t L = 30;
  std::vector<int32_t> asked;
  const SplitScore score = [&](int32_t s) {
    asked.push_back(s);
    const int32_t kept = s >= 10 ? 4 : 3;                       // dense (s = 30) keeps 4
    return std::pair<int32_t, double>{kept, 2.0 + 0.001 * (L - s)};  // each triangle layer adds 0.001
  };
  // From 25: 24 ... 20 are within 0.01 (0.010 at 20), 19 is not.
  SplitSelection a = select_split(L, 25, 0.0100001, score);
  EXPECT_EQ(a.start, 20);
  EXPECT_EQ(a.reference_kept, 4);
  EXPECT_DOUBLE_EQ(a.reference_log_perplexity, 2.0);
  EXPECT_EQ(asked, (std::vector<int32_t>{30, 25, 24, 23, 22, 21, 20, 19}));
  ASSERT_EQ(a.trials.size(), 8u);
  EXPECT_TRUE(a.trials[6].acceptable);
  EXPECT_FALSE(a.trials[7].acceptable);
  EXPECT_EQ(a.trials[7].start, 19);
  // From 15 (outside the tolerance): later until 20.
  asked.clear();
  EXPECT_EQ(select_split(L, 15, 0.0100001, score).start, 20);
  EXPECT_EQ(asked, (std::vector<int32_t>{30, 15, 16, 17, 18, 19, 20}));
  // A wide tolerance stops at the answers: layer 10 keeps 4, layer 9 three.
  EXPECT_EQ(select_split(L, 25, 1.0, score).start, 10);
  // Nothing acceptable: no triangle at all.
  EXPECT_EQ(select_split(L, 29, 0.0, score).start, L);
  // Errors.
  EXPECT_EQ(error_of([&] { select_split(L, 31, 0.01, score); }),
            "trianglemix: the split to select from (31) is outside [0, 30]");
  EXPECT_EQ(error_of([&] { select_split(L, 5, -1, score); }),
            "trianglemix: the selection's tolerance must be >= 0, got -1.000000");
}

}  // namespace
}  // namespace tessera::plan
