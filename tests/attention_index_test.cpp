// The index layer: lowering equals the per-cell pattern definition; estimators pick what the definition picks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/split_plan.h"
#include "core/thread_pool.h"

namespace tessera::attn {
namespace {

// Checks index.visible against pattern_mask for every cell, and the index invariants.
void expect_index_matches_definition(const Pattern& p, const HeadEstimate& est, const LoweringContext& ctx) {
  const SparseIndex index = lower_layer({p}, {est}, ctx);
  ASSERT_NO_THROW(index.validate()) << describe(p);
  const std::vector<uint8_t> mask = pattern_mask(p, est, ctx);
  int64_t visible = 0;
  for (int32_t r = 0; r < ctx.q_len; ++r) {
    for (int32_t j = 0; j < ctx.kv_len; ++j) {
      const bool want = mask[static_cast<size_t>(r) * static_cast<size_t>(ctx.kv_len) + static_cast<size_t>(j)] != 0;
      ASSERT_EQ(index.visible(0, r, j), want)
          << describe(p) << " row " << r << " key " << j << " q_begin " << ctx.q_begin << " q_len " << ctx.q_len
          << " tile " << ctx.tile;
      visible += want;
    }
  }
  EXPECT_EQ(index_stats(index).mask_cells, visible) << describe(p);
  // Within a sliding window (a window layer's call): the definition's cells with pos - key < window.
  for (const int64_t window : {1, 5, 37, 300}) {
    int64_t in_window = 0;
    for (int32_t r = 0; r < ctx.q_len; ++r)
      for (int32_t j = 0; j < ctx.kv_len; ++j)
        in_window += mask[static_cast<size_t>(r) * static_cast<size_t>(ctx.kv_len) + static_cast<size_t>(j)] != 0 &&
                     int64_t{ctx.q_begin} + r - j < window;
    const IndexStats ws = index_stats(index, window);
    EXPECT_EQ(ws.mask_cells, in_window) << describe(p) << " window " << window;
    EXPECT_EQ(ws.causal_cells, index_stats(index).causal_cells);
  }
}

VerticalSlashEstimate random_vs(std::mt19937& rng, int32_t kv_len) {
  VerticalSlashEstimate e;
  std::uniform_int_distribution<int32_t> pick(0, std::max(0, kv_len - 1));
  std::set<int32_t> cols, offs;
  const int nc = std::uniform_int_distribution<int>(0, 12)(rng), no = std::uniform_int_distribution<int>(0, 12)(rng);
  for (int i = 0; i < nc; ++i) cols.insert(pick(rng));
  for (int i = 0; i < no; ++i) offs.insert(pick(rng));
  e.columns.assign(cols.begin(), cols.end());
  e.offsets.assign(offs.begin(), offs.end());
  return e;
}

BlockSparseEstimate random_bs(std::mt19937& rng, const LoweringContext& ctx, int32_t block) {
  BlockSparseEstimate e;
  e.block = block;
  e.offsets.assign(1, 0);
  if (ctx.q_len == 0) return e;
  const int32_t qb_first = ctx.q_begin / block, qb_last = (ctx.q_begin + ctx.q_len - 1) / block;
  e.first_q_block = qb_first;
  for (int32_t qb = qb_first; qb <= qb_last; ++qb) {
    for (int32_t kb = 0; kb <= qb; ++kb) {
      if (std::bernoulli_distribution(0.4)(rng)) e.key_blocks.push_back(kb);
    }
    e.offsets.push_back(static_cast<int32_t>(e.key_blocks.size()));
  }
  return e;
}

std::vector<LoweringContext> contexts() {
  std::vector<LoweringContext> out;
  for (int32_t tile : {1, 4, 16, 64}) {
    for (int32_t q_len : {1, 5, 16, 63, 65, 130}) {
      for (int32_t q_begin : {0, 7, 64}) {
        out.push_back({q_begin, q_len, q_begin + q_len, 0, tile});
      }
    }
  }
  out.push_back({10, 20, 30, 200, 8});  // a chunk of a longer prompt (N = 200)
  out.push_back({0, 100, 100, 0, 128}); // S < tile
  return out;
}

TEST(Lowering, StaticPatternsMatchTheirDefinitionCellByCell) {
  const std::vector<Pattern> patterns = {
      DensePattern{},
      AShapePattern{0, 1},
      AShapePattern{4, 8},
      AShapePattern{1000, 3},
      AShapePattern{3, 100000},
      ElasticWindowPattern{5.0, 0.25, 4},
      ElasticWindowPattern{-50.0, 0.1, 0},
      ElasticWindowPattern{0.0, 1.0, 64},
      TrianglePattern{2, 5, 7},
      TrianglePattern{8, 16, 0},
      TrianglePattern{0, 1, 1000},
  };
  for (const LoweringContext& ctx : contexts()) {
    for (const Pattern& p : patterns) {
      expect_index_matches_definition(p, std::monostate{}, ctx);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(Lowering, DynamicPatternsMatchTheirDefinitionForRandomEstimates) {
  std::mt19937 rng(1234);
  for (const LoweringContext& ctx : contexts()) {
    for (int rep = 0; rep < 3; ++rep) {
      expect_index_matches_definition(VerticalSlashPattern{}, random_vs(rng, ctx.kv_len), ctx);
      for (int32_t block : {1, 3, 16, 64}) {
        expect_index_matches_definition(BlockSparsePattern{2, block}, random_bs(rng, ctx, block), ctx);
      }
      if (HasFatalFailure()) return;
    }
  }
}

TEST(Lowering, EmptyEstimatesGiveRowsWithNoKeys) {
  const LoweringContext ctx = LoweringContext::prefill(70, 64);
  const SparseIndex index = lower_layer({VerticalSlashPattern{0, 0}}, {VerticalSlashEstimate{}}, ctx);
  index.validate();
  EXPECT_TRUE(index.ranges.empty());
  EXPECT_TRUE(index.columns.empty());
  EXPECT_EQ(index_stats(index).mask_cells, 0);
}

TEST(Lowering, HandComputedIndexAndStats) {
  // S = 10, tile 4: tiles [0,4), [4,8), [8,10). A-shape sink 2, local 3.
  const SparseIndex index = lower_layer({AShapePattern{2, 3}}, {}, LoweringContext::prefill(10, 4));
  ASSERT_EQ(index.num_tiles(), 3);
  // Tile 0: window from 0-3+1 = -2 -> [0, 4) merged with the sink.
  EXPECT_EQ(std::vector<KeyRange>(index.ranges_of(0, 0).begin(), index.ranges_of(0, 0).end()),
            (std::vector<KeyRange>{{0, 4}}));
  // Tile 1 (rows 4..7): sink [0,2) and window [4-3+1, 8) = [2, 8) -> merged [0, 8).
  EXPECT_EQ(std::vector<KeyRange>(index.ranges_of(0, 1).begin(), index.ranges_of(0, 1).end()),
            (std::vector<KeyRange>{{0, 8}}));
  // Tile 2 (rows 8..9): sink [0,2), window [6, 10).
  EXPECT_EQ(std::vector<KeyRange>(index.ranges_of(0, 2).begin(), index.ranges_of(0, 2).end()),
            (std::vector<KeyRange>{{0, 2}, {6, 10}}));
  const IndexStats s = index_stats(index);
  EXPECT_EQ(s.causal_cells, 55);                     // 1 + 2 + ... + 10
  EXPECT_EQ(s.mask_cells, 10 + 26 + (5 + 6));          // tile0 dense 10; tile1 dense rows 5..8 = 26; row 8: 2+3, row 9: 2+4
  EXPECT_EQ(s.work_cells, 4 * 4 + 4 * 8 + 2 * (2 + 4));
  EXPECT_DOUBLE_EQ(s.density(), 47.0 / 55.0);
  EXPECT_DOUBLE_EQ(s.mask_flops(64), 4.0 * 64 * 47);
}

TEST(Lowering, DenseDensityIsOneAndTriangleLastRowsAreDense) {
  const auto ctx = LoweringContext::prefill(257, 64);
  EXPECT_DOUBLE_EQ(index_stats(lower_layer({DensePattern{}}, {}, ctx)).density(), 1.0);
  const SparseIndex tri = lower_layer({TrianglePattern{8, 16, 1}}, {}, ctx);
  // Only the last tile (row 256) holds the last row: it is dense; tile 3 (rows 192..255) is streaming.
  EXPECT_TRUE(tri.visible(0, 256, 100));
  EXPECT_FALSE(tri.visible(0, 255, 100));
  EXPECT_TRUE(tri.visible(0, 255, 7));
  EXPECT_TRUE(tri.visible(0, 255, 192 - 15));
  EXPECT_FALSE(tri.visible(0, 255, 192 - 16));
}

TEST(Lowering, ErrorsNameTheProblem) {
  try {
    lower_layer({DensePattern{}, VerticalSlashPattern{}}, {std::monostate{}, std::monostate{}},
                LoweringContext::prefill(8));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "lowering: head 1 runs vertical_slash but has no VS estimate");
  }
  try {
    lower_layer({DensePattern{}}, {}, LoweringContext{0, 10, 5, 0, 64});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "lowering: kv_len 5 is smaller than q_begin + q_len = 10");
  }
}

// --- estimators -------------------------------------------------------------------------------------------

struct Qk {
  Tensor q, k;
};

Qk random_qk(std::mt19937& rng, int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d) {
  Qk x{Tensor(DType::F32, {q_len, hq, d}), Tensor(DType::F32, {kv_len, hkv, d})};
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t i = 0; i < x.q.numel(); ++i) x.q.ptr<float>()[i] = n(rng);
  for (int64_t i = 0; i < x.k.numel(); ++i) x.k.ptr<float>()[i] = n(rng);
  return x;
}

// Brute force from the definition: full softmax rows in double, full sorts.
VerticalSlashEstimate brute_vs(const VerticalSlashPattern& p, const Qk& x, int qh, int kvh, const LoweringContext& ctx,
                               float scale) {
  const int64_t d = x.q.dim(2), keys = ctx.q_begin + ctx.q_len;
  std::vector<double> col(static_cast<size_t>(keys), 0.0), diag(static_cast<size_t>(keys), 0.0);
  for (int64_t r = std::max<int64_t>(0, ctx.q_len - p.last_q); r < ctx.q_len; ++r) {
    const int64_t pos = ctx.q_begin + r;
    std::vector<double> s(static_cast<size_t>(pos + 1));
    for (int64_t j = 0; j <= pos; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < d; ++i) acc += double(*x.q.view().at<float>(r, qh, i)) * *x.k.view().at<float>(j, kvh, i);
      s[static_cast<size_t>(j)] = acc * scale;
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double v : s) z += std::exp(v - mx);
    for (int64_t j = 0; j <= pos; ++j) {
      col[static_cast<size_t>(j)] += std::exp(s[static_cast<size_t>(j)] - mx) / z;
      diag[static_cast<size_t>(pos - j)] += std::exp(s[static_cast<size_t>(j)] - mx) / z;
    }
  }
  auto pick = [&](std::vector<double> score, int64_t budget, int64_t forced) {
    budget = std::min<int64_t>(budget, keys);
    forced = std::min(forced, budget);
    for (int64_t i = 0; i < forced; ++i) score[static_cast<size_t>(i)] = INFINITY;
    std::vector<int32_t> idx(static_cast<size_t>(keys));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return score[size_t(a)] > score[size_t(b)]; });
    idx.resize(static_cast<size_t>(budget));
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  return {pick(col, p.vertical, p.forced_columns), pick(diag, p.slash, p.forced_diagonals)};
}

TEST(Estimators, VerticalSlashEqualsBruteForceOnRandomInputs) {
  std::mt19937 rng(7);
  for (const auto& [q_begin, q_len, vert, slash, last_q] :
       std::vector<std::tuple<int, int, int, int, int>>{{0, 200, 10, 12, 64},
                                                        {0, 37, 5, 3, 64},    // S < last_q
                                                        {50, 90, 500, 500, 16},  // budgets larger than S
                                                        {0, 128, 0, 0, 64},   // zero budgets
                                                        {0, 1, 3, 3, 64}}) {
    const LoweringContext ctx{q_begin, q_len, q_begin + q_len, 0, 64};
    const Qk x = random_qk(rng, q_len, q_begin + q_len, 4, 2, 16);
    VerticalSlashPattern p{vert, slash, last_q, 2, 3};
    for (int h = 0; h < 4; ++h) {
      const auto got = estimate_vertical_slash(p, x.q, x.k, h, h / 2, ctx, 0.25f);
      const auto want = brute_vs(p, x, h, h / 2, ctx, 0.25f);
      EXPECT_EQ(got.columns, want.columns) << "q_len " << q_len << " head " << h;
      EXPECT_EQ(got.offsets, want.offsets) << "q_len " << q_len << " head " << h;
    }
  }
}

TEST(Estimators, VerticalSlashFindsPlantedColumns) {
  // Keys 100 and 333 align with every query; everything else is small noise.
  const int64_t S = 512, d = 16;
  std::mt19937 rng(9);
  Qk x = random_qk(rng, S, S, 1, 1, d);
  for (int64_t i = 0; i < x.q.numel(); ++i) x.q.ptr<float>()[i] *= 0.1f;
  for (int64_t i = 0; i < x.k.numel(); ++i) x.k.ptr<float>()[i] *= 0.1f;
  for (int64_t p = 0; p < S; ++p) *x.q.view().at<float>(p, 0, 0) = 1.0f;
  *x.k.view().at<float>(100, 0, 0) = 8.0f;
  *x.k.view().at<float>(333, 0, 0) = 9.0f;
  const auto est = estimate_vertical_slash(VerticalSlashPattern{2, 0, 64, 0, 0}, x.q, x.k, 0, 0,
                                           LoweringContext::prefill(S), 1.0f);
  EXPECT_EQ(est.columns, (std::vector<int32_t>{100, 333}));
  EXPECT_TRUE(est.offsets.empty());
  // With forced columns, the budget of 3 is the forced column 0 plus the two planted ones.
  const auto forced = estimate_vertical_slash(VerticalSlashPattern{3, 0, 64, 1, 0}, x.q, x.k, 0, 0,
                                              LoweringContext::prefill(S), 1.0f);
  EXPECT_EQ(forced.columns, (std::vector<int32_t>{0, 100, 333}));
}

TEST(Estimators, VerticalSlashFindsAPlantedDiagonal) {
  // A rotary-like code: score(p, j) = a^2 cos(theta (p - j - 17)), peaked on the diagonal at offset 17; the period
  // (2 pi / theta) exceeds S so no other diagonal peaks. Offsets 16 and 18 tie for second place.
  const int64_t S = 512, d = 2;
  const double theta = 2.0 * M_PI / 2048.0, a = 40.0;
  Tensor q(DType::F32, {S, 1, d}), k(DType::F32, {S, 1, d});
  for (int64_t p = 0; p < S; ++p) {
    q.ptr<float>()[p * d] = static_cast<float>(a * std::cos(theta * double(p)));
    q.ptr<float>()[p * d + 1] = static_cast<float>(a * std::sin(theta * double(p)));
    k.ptr<float>()[p * d] = static_cast<float>(a * std::cos(theta * double(p + 17)));
    k.ptr<float>()[p * d + 1] = static_cast<float>(a * std::sin(theta * double(p + 17)));
  }
  const auto ctx = LoweringContext::prefill(S);
  EXPECT_EQ(estimate_vertical_slash(VerticalSlashPattern{0, 1, 64, 0, 0}, q, k, 0, 0, ctx, 1.0f).offsets,
            (std::vector<int32_t>{17}));
  EXPECT_EQ(estimate_vertical_slash(VerticalSlashPattern{0, 3, 64, 0, 0}, q, k, 0, 0, ctx, 1.0f).offsets,
            (std::vector<int32_t>{16, 17, 18}));
  // Forced diagonals [0, 2) take two of the five. (Not four: which of the tied 16 and 18 wins then depends on the
  // last bits of the float sums, which differ between builds, e.g. under AddressSanitizer's code generation.)
  EXPECT_EQ(estimate_vertical_slash(VerticalSlashPattern{0, 5, 64, 0, 2}, q, k, 0, 0, ctx, 1.0f).offsets,
            (std::vector<int32_t>{0, 1, 16, 17, 18}));
}

// Brute-force BS estimate for one head: per query block qb, the diagonal block qb (when top_k >= 1) plus the
// min(top_k, qb + 1) - 1 best-scoring blocks of [0, qb) (ties to the smaller block), ascending; f64 pooling.
std::vector<std::vector<int32_t>> brute_bs(const Qk& y, int64_t top_k, int64_t B, int q_head, int kv_head,
                                           const LoweringContext& ctx, double scale) {
  const int64_t d = y.q.view().dim(2), q_end = ctx.q_begin + ctx.q_len;
  std::vector<std::vector<int32_t>> out;
  if (ctx.q_len == 0) return out;
  for (int64_t qb = ctx.q_begin / B; qb <= (q_end - 1) / B; ++qb) {
    std::vector<double> qp(size_t(d), 0.0);
    const int64_t r0 = std::max<int64_t>(qb * B, ctx.q_begin), r1 = std::min<int64_t>((qb + 1) * B, q_end);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < d; ++i)
        qp[size_t(i)] += *y.q.view().at<float>(r - ctx.q_begin, q_head, i) / double(r1 - r0);
    std::vector<std::pair<double, int32_t>> sc;  // (-score, block): sorting puts the best, then smaller, first
    for (int64_t kb = 0; kb < qb; ++kb) {
      const int64_t k0 = kb * B, k1 = std::min<int64_t>((kb + 1) * B, ctx.kv_len);
      double s = 0;
      for (int64_t i = 0; i < d; ++i) {
        double kp = 0;
        for (int64_t j = k0; j < k1; ++j) kp += *y.k.view().at<float>(j, kv_head, i) / double(k1 - k0);
        s += qp[size_t(i)] * kp;
      }
      sc.push_back({-s * scale, static_cast<int32_t>(kb)});
    }
    std::sort(sc.begin(), sc.end());
    std::vector<int32_t> want;
    const int64_t count = std::min<int64_t>(top_k, qb + 1);
    for (int64_t i = 0; i + 1 < count; ++i) want.push_back(sc[size_t(i)].second);
    if (count >= 1) want.push_back(static_cast<int32_t>(qb));
    std::sort(want.begin(), want.end());
    out.push_back(want);
  }
  return out;
}

std::vector<int32_t> bs_row(const BlockSparseEstimate& e, size_t i) {
  return {e.key_blocks.begin() + e.offsets[i], e.key_blocks.begin() + e.offsets[i + 1]};
}

TEST(Estimators, BlockSparseFindsPlantedBlocksAndAlwaysKeepsTheDiagonal) {
  const int64_t S = 300, d = 16, B = 32;
  std::mt19937 rng(3);
  Qk x = random_qk(rng, S, S, 2, 1, d);
  // Scale random data down and plant key block 5 (keys 160..191) as the best for every query block >= 5.
  for (int64_t i = 0; i < x.q.numel(); ++i) x.q.ptr<float>()[i] *= 0.01f;
  for (int64_t i = 0; i < x.k.numel(); ++i) x.k.ptr<float>()[i] *= 0.01f;
  for (int64_t p = 0; p < S; ++p) *x.q.view().at<float>(p, 0, 0) = 1.0f;
  for (int64_t j = 160; j < 192; ++j) *x.k.view().at<float>(j, 0, 0) = 5.0f;
  const auto ctx = LoweringContext::prefill(S);
  // top_k 2: the diagonal block plus the planted one (for query block 5 they coincide: the diagonal plus the
  // best of the rest).
  const auto est = estimate_block_sparse(BlockSparsePattern{2, static_cast<int32_t>(B)}, x.q, x.k, 0, 0, ctx, 1.0f);
  ASSERT_EQ(est.offsets.size(), 11u);  // ceil(300 / 32) query blocks
  EXPECT_EQ(bs_row(est, 0), (std::vector<int32_t>{0}));
  for (int32_t qb = 1; qb < 10; ++qb) {
    const auto row = bs_row(est, size_t(qb));
    ASSERT_EQ(row.size(), 2u) << "query block " << qb;
    EXPECT_EQ(row.back(), qb) << "query block " << qb;
    if (qb > 5) {
      EXPECT_EQ(row.front(), 5) << "query block " << qb;
    }
  }
  // top_k 1: only the diagonal, even where the planted block scores far higher.
  const auto one = estimate_block_sparse(BlockSparsePattern{1, static_cast<int32_t>(B)}, x.q, x.k, 0, 0, ctx, 1.0f);
  for (int32_t qb = 0; qb < 10; ++qb) EXPECT_EQ(bs_row(one, size_t(qb)), (std::vector<int32_t>{qb}));
  // top_k 0 chooses nothing.
  const auto none = estimate_block_sparse(BlockSparsePattern{0, static_cast<int32_t>(B)}, x.q, x.k, 0, 0, ctx, 1.0f);
  EXPECT_TRUE(none.key_blocks.empty());
  EXPECT_EQ(none.offsets, std::vector<int32_t>(11, 0));

  // A diagonal that scores lowest of all is still kept: make every key of blocks 7 and 9 (the partial last
  // block, keys 288..299) anti-aligned with the queries.
  for (int64_t j = 224; j < 256; ++j) *x.k.view().at<float>(j, 0, 0) = -5.0f;
  for (int64_t j = 288; j < 300; ++j) *x.k.view().at<float>(j, 0, 0) = -5.0f;
  const auto low = estimate_block_sparse(BlockSparsePattern{3, static_cast<int32_t>(B)}, x.q, x.k, 0, 0, ctx, 1.0f);
  const auto want = brute_bs(x, 3, B, 0, 0, ctx, 1.0);
  for (int32_t qb : {7, 9}) {
    const auto row = bs_row(low, size_t(qb));
    EXPECT_EQ(row, want[size_t(qb)]) << "query block " << qb;
    ASSERT_EQ(row.size(), 3u);
    EXPECT_NE(std::find(row.begin(), row.end(), 5), row.end()) << "query block " << qb;
    EXPECT_EQ(row[2], qb);
  }
}

TEST(Estimators, BlockSparseEqualsBruteForce) {
  // Diagonal plus the top-(k-1) of the earlier blocks, on whole prompts and chunks starting mid-block, with
  // partial last blocks, GQA heads, budgets of 0, 1, a few and more than exist.
  std::mt19937 rng(5);
  const int64_t d = 16;
  for (const auto& [q_begin, q_len, B] : std::vector<std::tuple<int, int, int>>{
           {0, 300, 32}, {45, 200, 32}, {64, 64, 64}, {100, 1, 16}, {0, 7, 16}, {17, 150, 16}, {0, 257, 64}}) {
    const LoweringContext ctx{q_begin, q_len, q_begin + q_len, 0, 64};
    const Qk y = random_qk(rng, q_len, q_begin + q_len, 4, 2, d);
    for (int top_k : {0, 1, 2, 3, 5, 1000}) {
      for (int h = 0; h < 4; ++h) {
        const auto got = estimate_block_sparse(BlockSparsePattern{top_k, B}, y.q, y.k, h, h / 2, ctx, 0.5f);
        const auto want = brute_bs(y, top_k, B, h, h / 2, ctx, 0.5);
        EXPECT_EQ(got.block, B);
        EXPECT_EQ(got.first_q_block, q_begin / B);
        ASSERT_EQ(got.offsets.size(), want.size() + 1);
        for (size_t e = 0; e < want.size(); ++e) {
          EXPECT_EQ(bs_row(got, e), want[e]) << "q_begin " << q_begin << " q_len " << q_len << " B " << B
                                             << " top_k " << top_k << " head " << h << " query block "
                                             << got.first_q_block + int(e);
        }
      }
    }
  }
}

TEST(Estimators, LayerEstimatesFollowGqaAndLowerToValidIndexes) {
  std::mt19937 rng(11);
  const LoweringContext ctx = LoweringContext::prefill(150, 64);
  const Qk x = random_qk(rng, 150, 150, 4, 2, 8);
  const std::vector<Pattern> pats = {DensePattern{}, VerticalSlashPattern{4, 6, 64, 1, 2}, BlockSparsePattern{2, 16},
                                     AShapePattern{4, 16}};
  ThreadPool pool(2);
  const auto ests = estimate_layer(pats, x.q, x.k, ctx, 0.3f, pool);
  ASSERT_EQ(ests.size(), 4u);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(ests[0]));
  EXPECT_EQ(std::get<VerticalSlashEstimate>(ests[1]),
            estimate_vertical_slash(VerticalSlashPattern{4, 6, 64, 1, 2}, x.q, x.k, 1, 0, ctx, 0.3f));
  EXPECT_EQ(std::get<BlockSparseEstimate>(ests[2]),
            estimate_block_sparse(BlockSparsePattern{2, 16}, x.q, x.k, 2, 1, ctx, 0.3f));
  const SparseIndex index = lower_layer(pats, ests, ctx);
  EXPECT_EQ(index.num_heads, 4);
  index.validate();
  for (int h = 0; h < 4; ++h) {
    const auto mask = pattern_mask(pats[size_t(h)], ests[size_t(h)], ctx);
    for (int r = 0; r < 150; ++r)
      for (int j = 0; j < 150; ++j) ASSERT_EQ(index.visible(h, r, j), mask[size_t(r * 150 + j)] != 0);
  }
}

TEST(Estimators, Bf16InputsGiveTheSameEstimateAsTheirF32Values) {
  std::mt19937 rng(5);
  Qk x = random_qk(rng, 100, 100, 1, 1, 16);
  Tensor qb(DType::BF16, {100, 1, 16}), kb(DType::BF16, {100, 1, 16});
  for (int64_t i = 0; i < x.q.numel(); ++i) {
    qb.ptr<bf16>()[i] = f32_to_bf16(x.q.ptr<float>()[i]);
    x.q.ptr<float>()[i] = bf16_to_f32(qb.ptr<bf16>()[i]);
    kb.ptr<bf16>()[i] = f32_to_bf16(x.k.ptr<float>()[i]);
    x.k.ptr<float>()[i] = bf16_to_f32(kb.ptr<bf16>()[i]);
  }
  const auto ctx = LoweringContext::prefill(100);
  const VerticalSlashPattern p{7, 9, 64, 2, 2};
  EXPECT_EQ(estimate_vertical_slash(p, qb, kb, 0, 0, ctx, 0.25f), estimate_vertical_slash(p, x.q, x.k, 0, 0, ctx, 0.25f));
}

// Split-K plan (split_plan.h): which items are cut, into which tile ranges, and the order the executor runs.
TEST(SplitPlan, NothingToSplitWhenNoItemExceedsItsShare) {
  EXPECT_TRUE(plan_splits({10, 10, 10, 10}, 2).empty());
  EXPECT_TRUE(plan_splits({}, 132).empty());
  // Cost 100 over a share of 10, but 99 tiles do not fill two units of kMinSplitTiles.
  EXPECT_TRUE(plan_splits({100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 11).empty());
}

TEST(SplitPlan, DecodeLikeItemsSplitIntoEqualUnits) {
  // Four heads, one query tile each over 1024 key tiles (a decode step at 64K keys), 8 CTAs: share 513,
  // chunk 256, so each item becomes four units of 256 tiles.
  const std::vector<SplitUnit> units = plan_splits({1025, 1025, 1025, 1025}, 8);
  ASSERT_EQ(units.size(), 16u);
  for (int i = 0; i < 4; ++i) {
    for (int u = 0; u < 4; ++u) {
      EXPECT_EQ(units[static_cast<size_t>(4 * i + u)], (SplitUnit{i, 256 * u, 256 * (u + 1)}));
    }
  }
}

TEST(SplitPlan, UnevenTilesCoverTheItemExactly) {
  // 1000 tiles, share ceil(1004 / 16) = 63, chunk 64: 16 units, the first 1000 % 16 = 8 one tile longer.
  const std::vector<SplitUnit> units = plan_splits({1, 1001, 1, 1}, 16);
  ASSERT_EQ(units.size(), 16u);
  int32_t next = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    EXPECT_EQ(units[u].item, 1);
    EXPECT_EQ(units[u].tile_begin, next);
    EXPECT_EQ(units[u].tile_end - units[u].tile_begin, u < 8 ? 63 : 62);
    next = units[u].tile_end;
  }
  EXPECT_EQ(next, 1000);
}

TEST(SplitPlan, OnlySplittableItemsAreCut) {
  // Item 0 is not splittable (an estimated pattern): its cost counts in the total, it is never cut.
  const std::vector<SplitUnit> units = plan_splits({2049, 2049, 11, 11}, 4, {0, 1, 1, 1});
  // share ceil(4120 / 4) = 1030, chunk 515: item 1 (2048 tiles) into 4 units of 512.
  ASSERT_EQ(units.size(), 4u);
  for (const SplitUnit& u : units) EXPECT_EQ(u.item, 1);
  EXPECT_EQ(units.back(), (SplitUnit{1, 1536, 2048}));
}

TEST(SplitPlan, OrderRunsUnitsByCostAndSkipsSplitItems) {
  const std::vector<SplitUnit> units = {{1, 0, 150}, {1, 150, 299}};
  // Keys: items 5, 0 (split), 2; units 151, 150. Stable descending: unit 0, unit 1, item 0, item 2, item 1 (-1).
  EXPECT_EQ(order_with_splits({5, 300, 2}, units), (std::vector<int32_t>{3, 4, 0, 2, -1}));
  // Without units it is the plain heaviest-first order.
  EXPECT_EQ(order_with_splits({3, 5, 3, 9, 1}, {}), (std::vector<int32_t>{3, 1, 0, 2, 4}));
}

TEST(SplitPlan, RejectsBadInput) {
  try {
    (void)plan_splits({5}, 0);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "split plan: num_ctas must be positive, got 0");
  }
  try {
    (void)plan_splits({5, 6}, 4, {1});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "split plan: 1 splittable flags for 2 items");
  }
  try {
    (void)order_with_splits({5, 6}, {{2, 0, 3}});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "split plan: unit of item 2 tiles [0, 3) does not fit 2 items");
  }
}

}  // namespace
}  // namespace tessera::attn
