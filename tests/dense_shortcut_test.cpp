// The static "go dense before estimating" rule (attention/index/dense_shortcut.h), on the CPU.
#include "attention/index/dense_shortcut.h"

#include <gtest/gtest.h>

#include <vector>

namespace tessera::attn {
namespace {

std::vector<Pattern> layer_of(const Pattern& p, int heads = 32) {
  return std::vector<Pattern>(static_cast<size_t>(heads), p);
}

TEST(DenseShortcut, CoverageOfStaticPatternsIsExact) {
  const LoweringContext ctx = LoweringContext::prefill(1000);
  EXPECT_DOUBLE_EQ(head_coverage(DensePattern{}, ctx), 1.0);
  // A-shape with sink + local >= every row: everything.
  EXPECT_DOUBLE_EQ(head_coverage(AShapePattern{10, 990}, ctx), 1.0);
  // sink 0 + local 1: one key per row out of p + 1: 1000 / (1000 * 1001 / 2).
  EXPECT_NEAR(head_coverage(AShapePattern{0, 1}, ctx), 1000.0 / 500500.0, 1e-12);
  // Triangle whose last rows cover the whole prompt: dense.
  EXPECT_DOUBLE_EQ(head_coverage(TrianglePattern{0, 1, 1000}, ctx), 1.0);
  // Triangle with budget 1 and the last 10 rows dense: (990 + sum_{p=990}^{999} (p + 1)) / 500500.
  double last = 0;
  for (int p = 990; p < 1000; ++p) last += p + 1;
  EXPECT_NEAR(head_coverage(TrianglePattern{0, 1, 10}, ctx), (990.0 + last) / 500500.0, 1e-12);
  // Chunked call: rows 500..599 of a 600-key cache, budget 100.
  const LoweringContext chunk{500, 100, 600, 600, 64};
  double all = 0;
  for (int p = 500; p < 600; ++p) all += p + 1;
  EXPECT_NEAR(head_coverage(AShapePattern{0, 100}, chunk), 100.0 * 100.0 / all, 1e-12);
}

TEST(DenseShortcut, BudgetBoundOfDynamicPatterns) {
  // VS 1000 + 6096 at 8K: 1 - (1096 / 8192)^2 = 0.982; at 32K: 2b - b^2 with b = 7096 / 32768 = 0.386.
  const VerticalSlashPattern vs{1000, 6096, 64, 30, 100};
  EXPECT_NEAR(head_coverage(vs, LoweringContext::prefill(8192, 128)), 0.982, 2e-3);
  EXPECT_NEAR(head_coverage(vs, LoweringContext::prefill(32768, 128)), 0.386, 2e-3);
  // BS top 100 x 64 at 8K: 0.952; at 32K: 0.353.
  const BlockSparsePattern bs{100, 64};
  EXPECT_NEAR(head_coverage(bs, LoweringContext::prefill(8192, 128)), 0.952, 2e-3);
  EXPECT_NEAR(head_coverage(bs, LoweringContext::prefill(32768, 128)), 0.353, 2e-3);
  EXPECT_TRUE(coverage_is_bound(vs));
  EXPECT_TRUE(coverage_is_bound(bs));
  EXPECT_FALSE(coverage_is_bound(AShapePattern{}));
}

// The run-3 (H200) decisions the rule is set by (dense_shortcut.h): our kernel dense (r = 1) and cuDNN dense
// (r = 0.55).
TEST(DenseShortcut, Run3Decisions) {
  const VerticalSlashPattern vs{1000, 6096, 64, 30, 100};
  const BlockSparsePattern bs{100, 64};
  const AShapePattern ashape{128, 4096};
  const TrianglePattern tri{8, 512, 128};
  const auto ctx8 = LoweringContext::prefill(8192, 128), ctx32 = LoweringContext::prefill(32768, 128),
             ctx128 = LoweringContext::prefill(131072, 128);
  // r = 1 (ours): VS and BS at 8K go dense; nothing at 32K and 128K; A-shape and Triangle never.
  EXPECT_TRUE(dense_before_estimation(layer_of(vs), ctx8, 1.0));
  EXPECT_TRUE(dense_before_estimation(layer_of(bs), ctx8, 1.0));
  EXPECT_FALSE(dense_before_estimation(layer_of(ashape), ctx8, 1.0));
  EXPECT_FALSE(dense_before_estimation(layer_of(tri), ctx8, 1.0));
  for (const auto& ctx : {ctx32, ctx128}) {
    EXPECT_FALSE(dense_before_estimation(layer_of(vs), ctx, 1.0));
    EXPECT_FALSE(dense_before_estimation(layer_of(bs), ctx, 1.0));
    EXPECT_FALSE(dense_before_estimation(layer_of(ashape), ctx, 1.0));
  }
  // r = 0.55 (cuDNN): VS at 32K dense, BS at 32K not, A-shape at 8K dense but not at 32K.
  EXPECT_TRUE(dense_before_estimation(layer_of(vs), ctx32, 0.55));
  EXPECT_FALSE(dense_before_estimation(layer_of(bs), ctx32, 0.55));
  EXPECT_TRUE(dense_before_estimation(layer_of(ashape), ctx8, 0.55));
  EXPECT_FALSE(dense_before_estimation(layer_of(ashape), ctx32, 0.55));
  EXPECT_FALSE(dense_before_estimation(layer_of(vs), ctx128, 0.55));
  // r = 0.95 (cuDNN against the TMA warp-specialized kernel; now cudnn_rel_tile_cost(8K) = 0.993): VS at 8K still
  // dense (bound 0.98 >= 0.65 x 0.95), VS at 32K estimates (0.39; with local attention its executed density is
  // 0.36, H200 fifth run), A-shape at 8K now sparse (0.77 < 0.9 x 0.95 = 0.855: our kernel at 77% of the tiles
  // beats cuDNN's dense).
  EXPECT_TRUE(dense_before_estimation(layer_of(vs), ctx8, 0.95));
  EXPECT_FALSE(dense_before_estimation(layer_of(vs), ctx32, 0.95));
  EXPECT_FALSE(dense_before_estimation(layer_of(bs), ctx32, 0.95));
  EXPECT_FALSE(dense_before_estimation(layer_of(ashape), ctx8, 0.95));
  EXPECT_FALSE(dense_before_estimation(layer_of(ashape), ctx32, 0.95));
}

TEST(DenseShortcut, LayerRules) {
  const auto ctx8 = LoweringContext::prefill(8192, 128);
  const VerticalSlashPattern vs{1000, 6096, 64, 30, 100};
  // All-dense layers are not this rule's (they run dense anyway); empty layers and calls: no.
  EXPECT_FALSE(dense_before_estimation(layer_of(DensePattern{}), ctx8, 1.0));
  EXPECT_FALSE(dense_before_estimation({}, ctx8, 1.0));
  EXPECT_FALSE(dense_before_estimation(layer_of(vs), LoweringContext{0, 0, 0, 0, 128}, 1.0));
  // Dense heads do not block; one uncovered head does.
  std::vector<Pattern> mixed = layer_of(vs, 4);
  mixed.push_back(DensePattern{});
  EXPECT_TRUE(dense_before_estimation(mixed, ctx8, 1.0));
  mixed.push_back(AShapePattern{128, 512});
  EXPECT_FALSE(dense_before_estimation(mixed, ctx8, 1.0));
}

}  // namespace
}  // namespace tessera::attn
