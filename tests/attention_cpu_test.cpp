// Tests of the CPU attention executors (dense, sparse) against the f64 masked reference, and of the metrics.
// Suite names start with "attention_cpu" so that `ctest -R attention_cpu` selects them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/cpu_kernel.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/metrics.h"
#include "attention/cpu/reference.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "test_support.h"

namespace tessera::attn {
namespace {

using namespace tessera::test;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Fills a [n, heads, d] tensor with N(0, sigma) values (rounded to bf16 when the tensor is bf16).
Tensor random_tensor(DType t, int64_t n, int64_t heads, int64_t d, uint32_t seed, float sigma = 1.0f) {
  Tensor x(t, {n, heads, d});
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = dist(rng);
    if (t == DType::BF16) {
      x.ptr<bf16>()[i] = f32_to_bf16(v);
    } else {
      x.ptr<float>()[i] = v;
    }
  }
  return x;
}

// One attention problem with owned inputs and two outputs (executor, reference).
struct Problem {
  Tensor q, k, v, out, ref_out, lse, ref_lse;
  std::vector<double> ref64;
  AttentionArgs args, ref_args;

  Problem(int64_t q_len, int64_t kv_len, int64_t hq, int64_t hkv, int64_t d, int32_t q_begin, DType dtype,
          uint32_t seed, float scale = 0, float sigma = 1.0f)
      : q(random_tensor(dtype, q_len, hq, d, seed, sigma)),
        k(random_tensor(dtype, kv_len, hkv, d, seed + 1, sigma)),
        v(random_tensor(dtype, kv_len, hkv, d, seed + 2)),
        out(DType::F32, {q_len, hq, d}),
        ref_out(DType::F32, {q_len, hq, d}),
        lse(DType::F32, {hq, q_len}),
        ref_lse(DType::F32, {hq, q_len}) {
    std::fill(out.ptr<float>(), out.ptr<float>() + out.numel(), std::nanf(""));
    args.q = q;
    args.k = k;
    args.v = v;
    args.out = out;
    args.lse = lse;
    args.scale = scale;
    args.q_begin = q_begin;
    ref_args = args;
    ref_args.out = ref_out;
    ref_args.lse = ref_lse;
  }

  // max |out - ref64| and max |lse - ref_lse| (lse compared where finite; -inf must match exactly).
  void expect_matches_reference(double atol, const std::string& what) const {
    const int64_t n = out.numel();
    double worst = 0;
    int64_t worst_i = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double e = std::abs(static_cast<double>(out.ptr<float>()[i]) - ref64[static_cast<size_t>(i)]);
      if (!(e <= worst)) {
        worst = e;
        worst_i = i;
      }
    }
    EXPECT_LE(worst, atol) << what << ": worst output element " << worst_i;
    for (int64_t i = 0; i < lse.numel(); ++i) {
      const float a = lse.ptr<float>()[i], b = ref_lse.ptr<float>()[i];
      if (b == -kInf) {
        ASSERT_EQ(a, -kInf) << what << ": lse " << i;
      } else {
        ASSERT_NEAR(a, b, atol * std::max(1.0f, std::abs(b))) << what << ": lse " << i;
      }
    }
  }
};

// Runs `body` once per kernel this CPU can run, restoring Auto afterwards.
template <class F>
void for_each_kernel(F body) {
  std::vector<CpuKernel> kernels = {CpuKernel::Baseline};
  if (cpu_has_avx512()) kernels.push_back(CpuKernel::Avx512);
  for (CpuKernel kern : kernels) {
    set_cpu_kernel(kern);
    body(std::string(cpu_kernel_name(kern)));
  }
  set_cpu_kernel(CpuKernel::Auto);
}

// ---------------------------------------------------------------------------------------------------------------
// Dense

struct DenseCase {
  int64_t q_len, kv_len, hq, hkv, d;
  int32_t q_begin;
  DType dtype;
  float scale;
};

std::string describe(const DenseCase& c) {
  return "q_len " + std::to_string(c.q_len) + " kv_len " + std::to_string(c.kv_len) + " heads " +
         std::to_string(c.hq) + "/" + std::to_string(c.hkv) + " d " + std::to_string(c.d) + " q_begin " +
         std::to_string(c.q_begin) + " " + std::string(dtype_name(c.dtype)) + " scale " +
         std::to_string(c.scale);
}

void check_dense(const DenseCase& c, ThreadPool& pool, double atol = 1e-5) {
  Problem p(c.q_len, c.kv_len, c.hq, c.hkv, c.d, c.q_begin, c.dtype,
            1234u + static_cast<uint32_t>(c.q_len * 7 + c.d), c.scale);
  reference_attention_causal(p.ref_args, &p.ref64);
  for_each_kernel([&](const std::string& kern) {
    dense_attention_cpu(p.args, pool);
    p.expect_matches_reference(atol, describe(c) + " [" + kern + "]");
  });
}

TEST(attention_cpu_dense, OddLengthsAndHeadDims) {
  ThreadPool pool(2);
  for (int64_t s : {1, 7, 63, 64, 65, 130, 257}) {
    for (int64_t d : {64, 128, 40, 80}) {
      check_dense({s, s, 2, 1, d, 0, DType::F32, 0}, pool);
    }
  }
}

TEST(attention_cpu_dense, SmallAndOddHeadDims) {
  ThreadPool pool(2);
  for (int64_t d : {1, 3, 8, 17, 96, 256}) check_dense({70, 70, 1, 1, d, 0, DType::F32, 0}, pool);
}

TEST(attention_cpu_dense, GroupedQueryAttention) {
  ThreadPool pool(2);
  check_dense({130, 130, 8, 2, 64, 0, DType::F32, 0}, pool);
  check_dense({65, 65, 8, 2, 128, 0, DType::F32, 0}, pool);
  check_dense({33, 33, 6, 3, 40, 0, DType::F32, 0}, pool);
}

TEST(attention_cpu_dense, ChunkInTheMiddle) {
  ThreadPool pool(2);
  // A prefill chunk: queries at [q_begin, q_begin + q_len), keys [0, kv_len), aligned and unaligned starts.
  check_dense({100, 300, 2, 1, 64, 200, DType::F32, 0}, pool);
  check_dense({64, 192, 4, 2, 128, 128, DType::F32, 0}, pool);
  check_dense({37, 170, 2, 2, 80, 133, DType::F32, 0}, pool);
  check_dense({1, 258, 1, 1, 64, 257, DType::F32, 0}, pool);
  // A cache longer than the chunk needs: its tail is never visible.
  check_dense({50, 400, 2, 1, 64, 10, DType::F32, 0}, pool);
}

TEST(attention_cpu_dense, Bf16Inputs) {
  ThreadPool pool(2);
  // The reference reads the same bf16 values, so only f32 accumulation separates the two.
  check_dense({130, 130, 4, 2, 64, 0, DType::BF16, 0}, pool);
  check_dense({257, 257, 1, 1, 128, 0, DType::BF16, 0}, pool);
  check_dense({45, 150, 2, 1, 40, 105, DType::BF16, 0}, pool);
}

TEST(attention_cpu_dense, PeakySoftmaxAndExplicitScale) {
  ThreadPool pool(2);
  // scale 1 with d 64: scores of standard deviation 8, so the running max changes often and weights span
  // dozens of orders of magnitude. Scores near 40 carry f32 rounding of about 40 * 2^-24 * sqrt(d) each,
  // which reaches the outputs at the 1e-5 level: the tolerance is 4e-5 here (it is the inputs' precision, not
  // the algorithm's).
  check_dense({200, 200, 2, 1, 64, 0, DType::F32, 1.0f}, pool, 4e-5);
  check_dense({130, 130, 1, 1, 128, 0, DType::F32, 0.5f}, pool, 4e-5);
}

TEST(attention_cpu_dense, MixedDtypesAndStridedViews) {
  ThreadPool pool(2);
  const int64_t s = 97, h = 2, d = 48;
  // q is the first half of every row of a wider [s, h, 2d] buffer; k is bf16 and v f32; out is written
  // through a view whose head dim is the outermost one in memory (dim stride s * h).
  Tensor wide = random_tensor(DType::F32, s, h, 2 * d, 77);
  Tensor k = random_tensor(DType::BF16, s, 1, d, 78);
  Tensor v = random_tensor(DType::F32, s, 1, d, 79);
  TensorView q = wide.view();
  q.shape = {s, h, d, 0};                 // first half of every row; strides stay those of the wide buffer
  Tensor out_buf(DType::F32, {d, s, h});  // out element (i, hh, c) at c * s * h + i * h + hh
  TensorView out(out_buf.ptr<float>(), DType::F32, {s, h, d});
  out.stride = {h, 1, s * h, 0};
  Tensor ref_out(DType::F32, {s, h, d});
  AttentionArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.out = out;
  AttentionArgs ref_args = args;
  ref_args.out = ref_out;
  std::vector<double> ref64;
  reference_attention_causal(ref_args, &ref64);
  for_each_kernel([&](const std::string& kern) {
    dense_attention_cpu(args, pool);
    double worst = 0;
    for (int64_t i = 0; i < s; ++i)
      for (int64_t hh = 0; hh < h; ++hh)
        for (int64_t c = 0; c < d; ++c)
          worst = std::max(
              worst, std::abs(*out.at<float>(i, hh, c) - ref64[static_cast<size_t>((i * h + hh) * d + c)]));
    EXPECT_LE(worst, 1e-5) << kern;
  });
}

TEST(attention_cpu_dense, EmptyQueryIsANoOp) {
  ThreadPool pool(2);
  Problem p(0, 5, 2, 1, 16, 5, DType::F32, 1);
  EXPECT_NO_THROW(dense_attention_cpu(p.args, pool));
}

TEST(attention_cpu_dense, ThreadCountDoesNotChangeResult) {
  Problem p(300, 300, 3, 1, 64, 0, DType::F32, 5);
  ThreadPool one(1), two(2);
  dense_attention_cpu(p.args, one);
  std::vector<float> first(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel());
  dense_attention_cpu(p.args, two);
  for (int64_t i = 0; i < p.out.numel(); ++i)
    ASSERT_EQ(first[static_cast<size_t>(i)], p.out.ptr<float>()[i]) << i;
}

// ---------------------------------------------------------------------------------------------------------------
// Argument errors

TEST(attention_cpu_errors, ExactMessages) {
  ThreadPool pool(1);
  Problem p(12, 12, 8, 2, 64, 0, DType::F32, 3);

  AttentionArgs a = p.args;
  a.q = TensorView(p.q.ptr<float>(), DType::F32, {12, 512});
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention q: expected shape [*, *, *], got [12, 512]");

  Tensor k32 = random_tensor(DType::F32, 12, 2, 32, 1);
  a = p.args;
  a.k = k32;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention k: expected shape [*, *, 64], got [12, 2, 32]");

  Tensor v_short = random_tensor(DType::F32, 11, 2, 64, 1);
  a = p.args;
  a.v = v_short;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention v: expected shape [12, 2, 64], got [11, 2, 64]");

  Tensor k3 = random_tensor(DType::F32, 12, 3, 64, 1), v3 = random_tensor(DType::F32, 12, 3, 64, 1);
  a = p.args;
  a.k = k3;
  a.v = v3;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention: 8 query heads are not a multiple of 3 kv heads");

  a = p.args;
  a.q_begin = 2;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention: kv_len 12 is less than q_begin + q_len = 14 (every query must see its own position)");

  a = p.args;
  a.q_begin = -1;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }), "attention: q_begin must be >= 0, got -1");

  Tensor out_bf16(DType::BF16, {12, 8, 64});
  a = p.args;
  a.out = out_bf16;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }), "attention out: expected dtype f32, got bf16");

  Tensor out_small(DType::F32, {12, 4, 64});
  a = p.args;
  a.out = out_small;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention out: expected shape [12, 8, 64], got [12, 4, 64]");

  Tensor lse_t(DType::F32, {12, 8});
  a = p.args;
  a.lse = lse_t;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention lse: expected shape [8, 12], got [12, 8]");

  Tensor q_i32(DType::I32, {12, 8, 64});
  a = p.args;
  a.q = q_i32;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention q: expected dtype f32 or bf16, got i32");

  a = p.args;
  a.window = -1;
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }),
            "attention: window must be >= 0 (0: no window), got -1");
  EXPECT_EQ(error_of([&] { sparse_attention_cpu(a, SparseIndex{}, pool); }),
            "attention: window must be >= 0 (0: no window), got -1");

  a = p.args;
  a.scale = std::nanf("");
  EXPECT_EQ(error_of([&] { dense_attention_cpu(a, pool); }), "attention: scale must be finite, got nan");
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse

// Builds an index from per (head, tile) lists, head-major.
struct IndexBuilder {
  SparseIndex index;
  IndexBuilder(int32_t heads, int32_t tile, int32_t q_begin, int32_t q_len, int32_t kv_len) {
    index.num_heads = heads;
    index.tile = tile;
    index.q_begin = q_begin;
    index.q_len = q_len;
    index.kv_len = kv_len;
    index.range_offsets = {0};
    index.column_offsets = {0};
  }
  // Call once per (head, tile) in order.
  void add(const std::vector<KeyRange>& ranges, const std::vector<int32_t>& columns) {
    index.ranges.insert(index.ranges.end(), ranges.begin(), ranges.end());
    index.columns.insert(index.columns.end(), columns.begin(), columns.end());
    index.range_offsets.push_back(static_cast<int32_t>(index.ranges.size()));
    index.column_offsets.push_back(static_cast<int32_t>(index.columns.size()));
  }
};

// A random valid index: per (head, tile) a few ranges of random lengths and random columns between them.
SparseIndex random_index(int32_t heads, int32_t tile, int32_t q_begin, int32_t q_len, int32_t kv_len,
                         uint32_t seed, double keep = 0.3) {
  IndexBuilder b(heads, tile, q_begin, q_len, kv_len);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t t = 0; t < b.index.num_tiles(); ++t) {
      const int32_t end = b.index.tile_key_end(t);
      std::vector<KeyRange> ranges;
      std::vector<int32_t> columns;
      if (u(rng) < 0.1) {  // an empty tile now and then
        b.add(ranges, columns);
        continue;
      }
      int32_t j = 0;
      while (j < end) {
        const double x = u(rng);
        if (x < keep * 0.5) {  // a range of 1..150 keys
          const int32_t len = 1 + static_cast<int32_t>(u(rng) * 150);
          ranges.push_back({j, std::min(end, j + len)});
          j = ranges.back().end + 1;  // keep ranges disjoint and non-adjacent
        } else if (x < keep) {
          columns.push_back(j);
          j += 1 + static_cast<int32_t>(u(rng) * 4);
        } else {
          j += 1 + static_cast<int32_t>(u(rng) * 40);
        }
      }
      b.add(ranges, columns);
    }
  }
  b.index.validate();
  return b.index;
}

void check_sparse(Problem& p, const SparseIndex& index, ThreadPool& pool, const std::string& what,
                  double atol = 1e-5) {
  reference_attention_sparse(p.ref_args, index, &p.ref64);
  for_each_kernel([&](const std::string& kern) {
    std::fill(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel(), std::nanf(""));
    sparse_attention_cpu(p.args, index, pool);
    p.expect_matches_reference(atol, what + " [" + kern + "]");
  });
}

TEST(attention_cpu_sparse, HandBuiltIndex) {
  ThreadPool pool(2);
  // 2 heads, 200 rows, tiles of 64: tiles 0..3 (the last has 8 rows).
  Problem p(200, 200, 2, 1, 64, 0, DType::F32, 11);
  IndexBuilder b(2, 64, 0, 200, 200);
  // head 0
  b.add({{0, 5}, {20, 64}}, {10, 11});         // tile 0: partial ranges, diagonal inside a range
  b.add({{3, 70}, {100, 128}}, {80, 90, 99});  // tile 1: range across a key-tile boundary, causal range end
  b.add({}, {});                               // tile 2: empty -> zero output
  b.add({{190, 200}}, {0, 1, 2, 150});         // tile 3: only the diagonal plus sink columns
  // head 1
  b.add({}, {40, 50});                            // tile 0: rows 0..39 see nothing -> zero, lse -inf
  b.add({{0, 128}}, {});                          // tile 1: dense
  b.add({{128, 129}}, {130, 160, 191});           // tile 2: columns on the diagonal only
  b.add({{0, 64}, {65, 66}, {190, 199}}, {199});  // tile 3
  b.index.validate();
  check_sparse(p, b.index, pool, "hand-built");
  // Rows 0..39 of head 1 see no key.
  for (int r = 0; r < 40; ++r) {
    for (int c = 0; c < 64; ++c) ASSERT_EQ(*p.out.view().at<float>(r, 1, c), 0.0f);
    ASSERT_EQ(*p.lse.view().at<float>(1, r), -kInf);
  }
  for (int r = 128; r < 192; ++r) ASSERT_EQ(*p.out.view().at<float>(r, 0, 5), 0.0f);
}

TEST(attention_cpu_sparse, RandomIndexes) {
  ThreadPool pool(2);
  struct Case {
    int32_t q_len, kv_len, hq, hkv, d, q_begin, tile;
    DType dtype;
  };
  const Case cases[] = {
      {257, 257, 2, 1, 64, 0, 64, DType::F32},    {300, 300, 4, 2, 128, 0, 64, DType::F32},
      {130, 130, 8, 2, 40, 0, 64, DType::F32},    {200, 450, 2, 1, 80, 250, 64, DType::F32},
      {257, 257, 2, 2, 64, 0, 128, DType::F32},   {190, 190, 2, 1, 64, 0, 32, DType::F32},
      {150, 400, 2, 1, 64, 201, 100, DType::F32}, {257, 257, 2, 1, 64, 0, 64, DType::BF16},
      {65, 65, 1, 1, 128, 0, 64, DType::BF16},
  };
  uint32_t seed = 100;
  for (const Case& c : cases) {
    Problem p(c.q_len, c.kv_len, c.hq, c.hkv, c.d, c.q_begin, c.dtype, seed);
    for (double keep : {0.05, 0.3, 0.9}) {
      const SparseIndex index = random_index(c.hq, c.tile, c.q_begin, c.q_len, c.kv_len, seed++, keep);
      check_sparse(p, index, pool,
                   "q_len " + std::to_string(c.q_len) + " d " + std::to_string(c.d) + " tile " +
                       std::to_string(c.tile) + " q_begin " + std::to_string(c.q_begin) + " keep " +
                       std::to_string(keep));
    }
  }
}

TEST(attention_cpu_sparse, DenseIndexEqualsDenseExecutor) {
  ThreadPool pool(2);
  Problem p(300, 300, 2, 1, 64, 0, DType::F32, 21);
  IndexBuilder b(2, 64, 0, 300, 300);
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < b.index.num_tiles(); ++t) b.add({{0, b.index.tile_key_end(t)}}, {});
  sparse_attention_cpu(p.args, b.index, pool);
  std::vector<float> sparse(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel());
  dense_attention_cpu(p.args, pool);
  for (int64_t i = 0; i < p.out.numel(); ++i)
    ASSERT_EQ(sparse[static_cast<size_t>(i)], p.out.ptr<float>()[i]) << i;
}

TEST(attention_cpu_sparse, IndexMustDescribeTheCall) {
  ThreadPool pool(1);
  Problem p(128, 128, 8, 2, 64, 0, DType::F32, 3);
  SparseIndex index = random_index(4, 64, 0, 128, 128, 1);
  EXPECT_EQ(
      error_of([&] { sparse_attention_cpu(p.args, index, pool); }),
      "sparse attention: index has 4 heads, q_begin 0, q_len 128, kv_len 128; the call has 8 query heads, "
      "q_begin 0, q_len 128, kv_len 128");
  IndexBuilder b(8, 64, 0, 128, 128);
  b.add({{0, 100}}, {});  // head 0, tile 0: beyond the tile's last row
  for (int i = 1; i < 16; ++i) b.add({}, {});
  EXPECT_EQ(error_of([&] { sparse_attention_cpu(p.args, b.index, pool); }),
            "sparse index: head 0, tile 0: range [0, 100) is empty or outside [0, 64)");
}

// Every pattern through the index layer (lower_layer, estimate_layer), checked against the reference masked
// by the same index.
TEST(attention_cpu_sparse, LoweredPatterns) {
  ThreadPool pool(2);
  struct Shape {
    int32_t q_len, kv_len, q_begin, total_len;
  };
  const Shape shapes[] = {{300, 300, 0, 300}, {130, 400, 270, 500}, {257, 257, 0, 257}};
  const std::vector<Pattern> all = {
      DensePattern{},
      AShapePattern{16, 40},
      ElasticWindowPattern{20, 0.1, 8},
      TrianglePattern{4, 50, 30},
      VerticalSlashPattern{24, 20, 32, 4, 5},
      BlockSparsePattern{3, 32},
      VerticalSlashPattern{0, 3, 16, 0, 1},  // no columns, 3 slashes: many rows see few keys
      BlockSparsePattern{1, 64},
      VerticalSlashPattern{40, 60, 32, 4, 5, 0.8, 2, 3},  // adaptive budgets (gamma 0.8)
      BlockSparsePattern{6, 32, 0.7, 1},
  };
  uint32_t seed = 500;
  for (const Shape& s : shapes) {
    const int hq = 8, hkv = 2;
    Problem p(s.q_len, s.kv_len, hq, hkv, 64, s.q_begin, DType::F32, seed++);
    for (size_t first = 0; first < all.size(); first += 4) {
      // Heads of one layer run different patterns.
      std::vector<Pattern> patterns;
      for (int h = 0; h < hq; ++h) patterns.push_back(all[(first + static_cast<size_t>(h)) % all.size()]);
      LoweringContext ctx{s.q_begin, s.q_len, s.kv_len, s.total_len, 64};
      const auto estimates = estimate_layer(patterns, p.q, p.k, ctx, p.args.effective_scale(), pool);
      const SparseIndex index = lower_layer(patterns, estimates, ctx);
      check_sparse(p, index, pool,
                   "patterns from " + std::to_string(first) + " q_len " + std::to_string(s.q_len));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Row-exact sliding window (args.window), alone and intersected with sparse indexes

struct WindowCase {
  int64_t q_len, kv_len, hq, hkv, d;
  int32_t q_begin;
  DType dtype;
};

std::string describe(const WindowCase& c, int32_t window) {
  return "window " + std::to_string(window) + " q_len " + std::to_string(c.q_len) + " kv_len " +
         std::to_string(c.kv_len) + " heads " + std::to_string(c.hq) + "/" + std::to_string(c.hkv) + " d " +
         std::to_string(c.d) + " q_begin " + std::to_string(c.q_begin) + " " +
         std::string(dtype_name(c.dtype));
}

void check_dense_window(const WindowCase& c, int32_t window, ThreadPool& pool) {
  Problem p(c.q_len, c.kv_len, c.hq, c.hkv, c.d, c.q_begin, c.dtype,
            77u + static_cast<uint32_t>(c.q_len * 3 + c.d + window));
  p.args.window = p.ref_args.window = window;
  reference_attention_causal(p.ref_args, &p.ref64);
  for_each_kernel([&](const std::string& kern) {
    std::fill(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel(), std::nanf(""));
    dense_attention_cpu(p.args, pool);
    p.expect_matches_reference(1e-5, describe(c, window) + " [" + kern + "]");
  });
}

const int32_t kWindows[] = {1, 5, 63, 64, 65, 200, 1000};  // 1000: larger than every sequence below

TEST(attention_cpu_window, DenseWindows) {
  ThreadPool pool(2);
  const WindowCase cases[] = {
      {257, 257, 2, 1, 64, 0, DType::F32},   {130, 130, 8, 2, 40, 0, DType::F32},
      {100, 300, 2, 1, 64, 200, DType::F32}, {37, 170, 2, 2, 80, 133, DType::F32},
      {193, 193, 4, 2, 128, 0, DType::BF16}, {65, 400, 3, 1, 17, 300, DType::BF16},
  };
  for (const WindowCase& c : cases)
    for (int32_t w : kWindows) check_dense_window(c, w, pool);
}

TEST(attention_cpu_window, WindowCoveringEverythingEqualsNoWindow) {
  ThreadPool pool(2);
  Problem p(150, 150, 2, 1, 64, 0, DType::F32, 31);
  dense_attention_cpu(p.args, pool);
  std::vector<float> plain(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel());
  p.args.window = 150;
  dense_attention_cpu(p.args, pool);
  for (int64_t i = 0; i < p.out.numel(); ++i)
    ASSERT_EQ(plain[static_cast<size_t>(i)], p.out.ptr<float>()[i]) << i;
}

TEST(attention_cpu_window, SparseIndexAndWindow) {
  ThreadPool pool(2);
  struct Case {
    int32_t q_len, kv_len, hq, hkv, d, q_begin, tile;
    DType dtype;
  };
  const Case cases[] = {
      {257, 257, 2, 1, 64, 0, 64, DType::F32},  {200, 450, 4, 2, 80, 250, 64, DType::F32},
      {257, 257, 2, 2, 64, 0, 128, DType::F32}, {150, 400, 2, 1, 64, 201, 100, DType::F32},
      {131, 131, 6, 3, 64, 0, 64, DType::BF16},
  };
  uint32_t seed = 900;
  for (const Case& c : cases) {
    Problem p(c.q_len, c.kv_len, c.hq, c.hkv, c.d, c.q_begin, c.dtype, seed);
    for (int32_t w : kWindows) {
      for (double keep : {0.3, 0.9}) {
        const SparseIndex index = random_index(c.hq, c.tile, c.q_begin, c.q_len, c.kv_len, seed++, keep);
        p.args.window = p.ref_args.window = w;
        check_sparse(p, index, pool,
                     "window " + std::to_string(w) + " q_len " + std::to_string(c.q_len) + " tile " +
                         std::to_string(c.tile) + " q_begin " + std::to_string(c.q_begin) + " keep " +
                         std::to_string(keep));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Few rows (decode): items of at most 4 rows take their own path

TEST(attention_cpu_decode, FewRowsAgainstReference) {
  // One worker: every item takes as many heads of a GQA group as fit in 4 rows; two: fewer, to fill both.
  ThreadPool one(1), two(2);
  const WindowCase shapes[] = {
      {0, 150, 7, 1, 32, 0, DType::F32},  {0, 150, 8, 1, 64, 0, DType::BF16},
      {0, 300, 9, 3, 64, 0, DType::F32},  {0, 1000, 4, 1, 256, 0, DType::F32},
      {0, 200, 4, 2, 40, 0, DType::F32},  {0, 129, 2, 1, 17, 0, DType::F32},
      {0, 257, 6, 2, 64, 0, DType::BF16}, {0, 70, 2, 2, 128, 0, DType::BF16},
      {0, 3, 2, 1, 64, 0, DType::F32},
  };
  for (WindowCase c : shapes) {
    for (int64_t q_len = 1; q_len <= 4; ++q_len) {
      if (q_len > c.kv_len) continue;
      c.q_len = q_len;
      c.q_begin = static_cast<int32_t>(c.kv_len - q_len);
      for (int32_t w : {0, 1, 2, 5, 64, 65, 200}) {
        check_dense_window(c, w, one);
        check_dense_window(c, w, two);
      }
    }
  }
  // A chunk that is not at the end of the cache: keys past the last row are ignored.
  check_dense_window({3, 500, 2, 1, 64, 100, DType::F32}, 0, two);
  check_dense_window({3, 500, 2, 1, 64, 100, DType::F32}, 50, one);
}

TEST(attention_cpu_decode, FewRowsSparse) {
  ThreadPool pool(2);
  uint32_t seed = 1300;
  for (int32_t q_len = 1; q_len <= 4; ++q_len) {
    for (auto [kv_len, tile] : {std::pair{700, 64}, std::pair{300, 1}, std::pair{90, 3}}) {
      const int32_t q_begin = kv_len - q_len;
      Problem p(q_len, kv_len, 4, 2, 64, q_begin, seed % 2 ? DType::BF16 : DType::F32, seed);
      for (int32_t w : {0, 5, 100}) {
        const SparseIndex index = random_index(4, tile, q_begin, q_len, kv_len, seed++, 0.4);
        p.args.window = p.ref_args.window = w;
        check_sparse(p, index, pool,
                     "few rows: q_len " + std::to_string(q_len) + " kv_len " + std::to_string(kv_len) +
                         " tile " + std::to_string(tile) + " window " + std::to_string(w));
      }
    }
  }
}

// The last few rows of a prefill (q_len % 64 in 1..4) take the few-row path beside full tiles.
TEST(attention_cpu_decode, PrefillTailTiles) {
  ThreadPool pool(2);
  for (int64_t s : {65, 66, 67, 68, 132})
    for (int32_t w : {0, 7, 64}) check_dense_window({s, s, 2, 1, 64, 0, DType::F32}, w, pool);
}

// ---------------------------------------------------------------------------------------------------------------
// Metrics

TEST(attention_cpu_metrics, RecallByHand) {
  // One query at position 1 (q_begin 1), two keys, d = 1, scale 1: scores 0 and ln 3 -> softmax (1/4, 3/4).
  Tensor q(DType::F32, {1, 1, 1}), k(DType::F32, {2, 1, 1});
  q.ptr<float>()[0] = 1.0f;
  k.ptr<float>()[0] = 0.0f;
  k.ptr<float>()[1] = std::log(3.0f);
  AttentionArgs args;
  args.q = q;
  args.k = k;
  args.scale = 1.0f;
  args.q_begin = 1;
  auto one = [](const std::vector<KeyRange>& r, const std::vector<int32_t>& c) {
    IndexBuilder b(1, 64, 1, 1, 2);
    b.add(r, c);
    return b.index;
  };
  ThreadPool pool(1);
  EXPECT_NEAR(attention_recall(args, one({}, {0}), pool).mean, 0.25, 1e-7);
  EXPECT_NEAR(attention_recall(args, one({{1, 2}}, {}), pool).mean, 0.75, 1e-7);
  EXPECT_NEAR(attention_recall(args, one({{0, 2}}, {}), pool).mean, 1.0, 1e-12);
  EXPECT_EQ(attention_recall(args, one({}, {}), pool).mean, 0.0);
  // A window of 1: the row's only key is its own; key 0 lies outside it.
  args.window = 1;
  EXPECT_EQ(attention_recall(args, one({}, {0}), pool).mean, 0.0);
  EXPECT_NEAR(attention_recall(args, one({{1, 2}}, {}), pool).mean, 1.0, 1e-12);
  args.window = -2;
  EXPECT_EQ(error_of([&] { attention_recall(args, one({}, {}), pool); }),
            "attention_recall: window must be >= 0 (0: no window), got -2");
}

TEST(attention_cpu_metrics, RecallPerHeadAndRows) {
  // Two heads (GQA, one kv head), two queries at positions 0 and 1, keys with scores 0 and ln 3 for row 1.
  // Head 0 keeps only key 0: row 0 keeps everything (it sees only key 0) -> 1, row 1 keeps 1/4: mean 5/8.
  // Head 1 keeps only key 1: row 0 keeps 0, row 1 keeps 3/4: mean 3/8.
  Tensor q(DType::F32, {2, 2, 1}), k(DType::F32, {2, 1, 1});
  for (int i = 0; i < 4; ++i) q.ptr<float>()[i] = 1.0f;
  k.ptr<float>()[0] = 0.0f;
  k.ptr<float>()[1] = std::log(3.0f);
  AttentionArgs args;
  args.q = q;
  args.k = k;
  args.scale = 1.0f;
  IndexBuilder b(2, 64, 0, 2, 2);
  b.add({}, {0});
  b.add({{1, 2}}, {});
  ThreadPool pool(2);
  const RecallResult r = attention_recall(args, b.index, pool);
  ASSERT_EQ(r.per_head.size(), 2u);
  EXPECT_NEAR(r.per_head[0], 5.0 / 8.0, 1e-7);
  EXPECT_NEAR(r.per_head[1], 3.0 / 8.0, 1e-7);
  EXPECT_NEAR(r.mean, 0.5, 1e-7);
}

TEST(attention_cpu_metrics, RecallOfDenseIsOneAndMatchesMaskedSum) {
  ThreadPool pool(2);
  Problem p(150, 150, 4, 2, 32, 0, DType::F32, 9);
  IndexBuilder dense(4, 64, 0, 150, 150);
  for (int h = 0; h < 4; ++h)
    for (int t = 0; t < dense.index.num_tiles(); ++t) dense.add({{0, dense.index.tile_key_end(t)}}, {});
  const RecallResult full = attention_recall(p.args, dense.index, pool);
  EXPECT_NEAR(full.mean, 1.0, 1e-12);
  const SparseIndex index = random_index(4, 64, 0, 150, 150, 3);
  const RecallResult part = attention_recall(p.args, index, pool);
  // Brute force with index.visible.
  const double scale = p.args.effective_scale();
  for (int h = 0; h < 4; ++h) {
    double sum = 0;
    for (int r = 0; r < 150; ++r) {
      std::vector<double> s(static_cast<size_t>(r + 1));
      double mx = -1e300;
      for (int j = 0; j <= r; ++j) {
        double dot = 0;
        for (int c = 0; c < 32; ++c)
          dot += double(*p.q.view().at<float>(r, h, c)) * *p.k.view().at<float>(j, h / 2, c);
        s[static_cast<size_t>(j)] = dot * scale;
        mx = std::max(mx, s[static_cast<size_t>(j)]);
      }
      double total = 0, kept = 0;
      for (int j = 0; j <= r; ++j) {
        const double e = std::exp(s[static_cast<size_t>(j)] - mx);
        total += e;
        if (index.visible(h, r, j)) kept += e;
      }
      sum += kept / total;
    }
    EXPECT_NEAR(part.per_head[static_cast<size_t>(h)], sum / 150, 1e-12) << h;
  }
}

TEST(attention_cpu_metrics, OutputErrorByHand) {
  // Two heads, one row, d = 2. Head 0: a = (1, 2), b = (1, 0): ||a-b|| = 2, ||b|| = 1. Head 1: a = b = (3,
  // 4).
  Tensor a(DType::F32, {1, 2, 2}), b(DType::F32, {1, 2, 2});
  const float av[] = {1, 2, 3, 4}, bv[] = {1, 0, 3, 4};
  std::copy(av, av + 4, a.ptr<float>());
  std::copy(bv, bv + 4, b.ptr<float>());
  const OutputError e = output_error(a, b);
  EXPECT_NEAR(e.rel_frobenius, 2.0 / std::sqrt(26.0), 1e-12);
  EXPECT_EQ(e.max_abs, 2.0);
  EXPECT_NEAR(e.per_head_rel[0], 2.0, 1e-12);
  EXPECT_EQ(e.per_head_rel[1], 0.0);
  EXPECT_EQ(e.per_head_max_abs[0], 2.0);
  EXPECT_EQ(e.per_head_max_abs[1], 0.0);
  Tensor c(DType::F32, {1, 3, 2});
  EXPECT_EQ(error_of([&] { output_error(c, b); }),
            "output_error output: expected shape [1, 2, 2], got [1, 3, 2]");
}

}  // namespace
}  // namespace tessera::attn
