// model/qmatmul: every weight type x every instruction-set path this CPU runs, against dequantize_row and an
// f64 dot product, and every SIMD path against the scalar twin.
//
// Tolerances (per output y[i, r] = sum_k x[i, k] W[r, k]):
//  * Activation quantization (quantized types only). x is quantized per activation block b (32 or 256 elements)
//    to q = round(x / d_b), d_b = max|x in b| / 127, so |x_k - d_b q_k| <= d_b / 2 (plus f32 rounding of x / d_b,
//    covered by the 1e-5 |x_k| term). The kernel computes sum_k W[r, k] d_b q_k exactly up to f32 rounding, so
//    |y - y_exact| <= A = sum_k |W[r, k]| (d_b / 2 + 1e-5 |x_k|) + F.
//  * f32 rounding F. Each kernel forms per weight block the exact integer sum and adds (d_w d_x) * isum (and the
//    min / offset term) in f32: at most n + 8 roundings of relative size 2^-24 in a chain (n = blocks per row;
//    cols for the float types), each bounded by the magnitude T = sum_k (|W[r, k]| + O_k) |x_k|, where O_k is the
//    largest size of the block's offset or min term (Q4_0: 8|d|, Q5_0: 16|d|, Q4_1/Q5_1: |m|, Q8_0: 128|d|, Q4_K/Q5_K: 63 |dmin|,
//    Q6_K: 32 * 128 |d|; the integer sums are computed in the unsigned domain and the offset subtracted after):
//    F = 2 (n + 8) 2^-24 T. (n = cols / 16 for the quantized types: the prefill panels add one term per group of
//    16 or 32 elements.) Q8_0's O_k is 128|d|: the prefill panel multiplies q + 128 and subtracts 128 d sum(x).
//  * Two-level activations (QAct::Int8x2): the second level quantizes e = x - d_b q (|e| <= d_b / 2, computed in
//    f32) per block with its own step d2_b = max|e in b| / 127 <= d_b / 254, so |x_k - d_b q_k - d2_b q2_k| <=
//    d_b / 508 (+ the 1e-5 |x_k| term): A shrinks ~250x. The two levels' products are added in f32: F counts 2n
//    terms.
//  * One level plus the outliers' second level (QAct::Int8Outliers): for any m (the row kernels' picks in decode,
//    the panels' pairs in prefill), the blocks whose step d_b exceeds kOutlierRatio x the median step of the row's
//    blocks get the second level (d_b / 508), the others keep their one-level error, bounded per element by
//    |x_k - d_b round(x_k / d_b)| + 1e-4 d_b (d_b in f64 vs the kernel's f32: far from a tie both round alike, near
//    one the term is ~d_b / 2 anyway; a block within 1% of the limit may go either way: d_b / 2). F counts 2n terms.
//  * SIMD vs the scalar twin: checked within 2F here; for the quantized types they are the same bits (qmatmul.h,
//    "Batch invariance": one f32 term per block from exact integers, one summation order), which
//    QMatmulBatchInvariance asserts with memcmp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model_file.h"
#include "model/qmatmul.h"
#include "model/quant.h"

namespace tessera::model {
namespace {

const TensorType kTypes[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q4_0,
                             TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::Q8_0,
                             TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K};
const QIsa kIsas[] = {QIsa::Scalar, QIsa::Avx2, QIsa::Avx512};

float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(f16::from_bits(h));
}

void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v).bits;
  std::memcpy(p, &h, 2);
}

// Random rows of `type`: the reference quantizers for the types that have one (of Gaussian values with a few
// outliers), random bytes with sane scales for the K types (every bit pattern of qs/scales is a valid block).
std::vector<uint8_t> random_weights(TensorType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t row_bytes = tensor_type_bytes(type, cols);
  std::vector<uint8_t> w(row_bytes * static_cast<size_t>(rows));
  if (quantize_supported(type)) {
    std::normal_distribution<float> nd(0.0f, 0.05f);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = nd(rng);
      row[static_cast<size_t>(rng() % cols)] *= 8.0f;
      if (type == TensorType::Q4_1 || type == TensorType::Q5_1)  // asymmetric rows exercise the min term
        for (auto& v : row) v += 0.02f;
      quantize_row(type, row.data(), cols, w.data() + static_cast<size_t>(r) * row_bytes);
    }
    return w;
  }
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> ud(0.0005f, 0.004f);
  const size_t bb = tensor_type_block_bytes(type);
  for (size_t off = 0; off < w.size(); off += bb) {
    uint8_t* b = w.data() + off;
    if (type == TensorType::Q6_K) {
      put_f16(b + 208, ud(rng) / 4);
    } else {
      put_f16(b, ud(rng));
      put_f16(b + 2, ud(rng));
    }
  }
  return w;
}

// O_k of the header: the size of the block's offset or min term, per element of the row.
std::vector<double> offset_magnitude(TensorType type, const uint8_t* row, int64_t cols) {
  std::vector<double> o(static_cast<size_t>(cols), 0.0);
  const int64_t bs = static_cast<int64_t>(tensor_type_block_size(type));
  const size_t bb = tensor_type_block_bytes(type);
  for (int64_t b = 0; bs > 1 && b < cols / bs; ++b) {
    const uint8_t* blk = row + static_cast<size_t>(b) * bb;
    double v = 0;
    switch (type) {
      case TensorType::Q4_0:
        v = 8 * std::fabs(f16_at(blk));
        break;
      case TensorType::Q5_0:
        v = 16 * std::fabs(f16_at(blk));
        break;
      case TensorType::Q4_1:
      case TensorType::Q5_1:
        v = std::fabs(f16_at(blk + 2));
        break;
      case TensorType::Q8_0:
        v = 128 * std::fabs(f16_at(blk));
        break;
      case TensorType::Q4_K:
      case TensorType::Q5_K:
        v = 63 * std::fabs(f16_at(blk + 2));
        break;
      case TensorType::Q6_K:
        v = 32 * 128 * std::fabs(f16_at(blk + 208));
        break;
      default:
        break;
    }
    for (int64_t k = 0; k < bs; ++k) o[static_cast<size_t>(b * bs + k)] = v;
  }
  return o;
}

std::vector<float> random_x(int64_t m, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * cols));
  for (auto& v : x) v = nd(rng);
  for (int64_t i = 0; i < m; ++i) x[static_cast<size_t>(i * cols + static_cast<int64_t>(rng() % cols))] = 20.0f;
  return x;
}

// Runs y = x W^T for `mat` on `isa` (serially, on `pool`, and on the scalar twin) and checks every output against
// the f64 product of the dequantized rows with the exact x, within the header's bounds. Returns the outputs
// checked (0 after a failure).
int check_product(const QMatrix& mat, const std::vector<float>& x, int64_t m, QIsa isa, ThreadPool& pool,
                  const std::string& what) {
  const TensorType type = mat.type;
  const int64_t rows = mat.rows, cols = mat.cols;
  const int64_t bs = static_cast<int64_t>(tensor_type_block_size(type));
  const int64_t ab = qmatmul_activation_block(type);
  const size_t row_bytes = tensor_type_bytes(type, cols);
  std::vector<float> wf(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(type, mat.data + static_cast<size_t>(r) * row_bytes, cols, wf.data() + r * cols);
  std::vector<float> y(static_cast<size_t>(m * rows), NAN), ys(y.size(), NAN), yp(y.size(), NAN);
  qmatmul(mat, x.data(), m, y.data(), nullptr, isa);
  qmatmul(mat, x.data(), m, ys.data(), nullptr, QIsa::Scalar);
  qmatmul(mat, x.data(), m, yp.data(), &pool, isa);
  const bool outliers = ab > 0 && mat.act == QAct::Int8Outliers;
  const bool x2 = ab > 0 && mat.act == QAct::Int8x2;
  // float terms per output: at most one per 16 elements (per level)
  const int64_t nterms = (bs == 1 ? cols : cols / 16) * (x2 || outliers ? 2 : 1);
  std::vector<std::vector<double>> off(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    off[static_cast<size_t>(r)] = offset_magnitude(type, mat.data + static_cast<size_t>(r) * row_bytes, cols);
  int checked = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x.data() + i * cols;
    // the bound of the activation error per element: d_b / 2, or d_b / 508 on two levels
    std::vector<double> dx(static_cast<size_t>(cols), 0.0);
    const int64_t nb = ab > 0 ? cols / ab : 0;
    std::vector<double> step(static_cast<size_t>(nb));
    for (int64_t b = 0; b < nb; ++b) {
      double amax = 0;
      for (int64_t k = 0; k < ab; ++k) amax = std::max(amax, std::fabs(double{xi[b * ab + k]}));
      step[static_cast<size_t>(b)] = amax / 127;
    }
    std::vector<double> sorted = step;
    std::sort(sorted.begin(), sorted.end());
    const double limit = nb > 0 ? kOutlierRatio * sorted[static_cast<size_t>(nb / 2)] : 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      const double d = step[static_cast<size_t>(b)];
      const bool second = x2 || (outliers && d > 1.01 * limit);
      const bool first = outliers && d < 0.99 * limit;  // surely one level: the element's own rounding error
      for (int64_t k = 0; k < ab; ++k) {
        const double xk = xi[b * ab + k];
        dx[static_cast<size_t>(b * ab + k)] =
            second ? d / 508 : first && d > 0 ? std::fabs(xk - d * std::nearbyint(xk / d)) + 1e-4 * d : d / 2;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = wf.data() + r * cols;
      const auto& o = off[static_cast<size_t>(r)];
      double exact = 0, act = 0, mag = 0;
      for (int64_t k = 0; k < cols; ++k) {
        const double wk = wr[k], xk = xi[k];
        exact += wk * xk;
        if (ab > 0) act += std::fabs(wk) * (dx[static_cast<size_t>(k)] + 1e-5 * std::fabs(xk));
        mag += (std::fabs(wk) + o[static_cast<size_t>(k)]) * std::fabs(xk);
      }
      const double f32 = 2.0 * static_cast<double>(nterms + 8) * std::ldexp(1.0, -24) * mag;
      const size_t at = static_cast<size_t>(i * rows + r);
      SCOPED_TRACE(what + " " + std::string(tensor_type_name(type)) + " " + std::string(qmatmul_isa_name(isa)) +
                   " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + " m=" + std::to_string(m) +
                   " i=" + std::to_string(i) + " r=" + std::to_string(r) + (outliers ? " int8outliers" : x2 ? " int8x2" : ""));
      EXPECT_NEAR(y[at], exact, act + f32 + 1e-30);
      EXPECT_NEAR(y[at], ys[at], 2 * f32 + 1e-30);
      EXPECT_EQ(y[at], yp[at]);  // the thread split changes which thread computes an output, not how
      if (::testing::Test::HasFailure()) return 0;
      ++checked;
    }
  }
  return checked;
}

struct Case {
  TensorType type;
  QIsa isa;
};

class QMatmul : public ::testing::TestWithParam<Case> {};

TEST_P(QMatmul, MatchesDequantizedF64AndTheScalarTwin) {
  const auto [type, isa] = GetParam();
  if (!qmatmul_isa_available(isa)) GTEST_SKIP() << qmatmul_isa_name(isa) << " is not available on this CPU";
  const int64_t bs = static_cast<int64_t>(tensor_type_block_size(type));
  std::vector<int64_t> col_counts;
  if (bs == 1) col_counts = {1, 7, 37, 256, 1000};
  else if (bs == 32) col_counts = {32, 96, 544, 4096};
  else col_counts = {256, 768, 4096};
  std::mt19937 rng(1234 + static_cast<int>(type) * 7 + static_cast<int>(isa));
  ThreadPool pool(2);
  int checked = 0;
  for (const int64_t rows : {1, 7, 33}) {
    for (const int64_t cols : col_counts) {
      const auto w = random_weights(type, rows, cols, rng);
      for (const QAct act : {QAct::Int8, QAct::Int8x2, QAct::Int8Outliers}) {
        const QMatrix mat{w.data(), rows, cols, type, act};
        for (const int64_t m : {1, 3, 17, 64}) {
          const int n = check_product(mat, random_x(m, cols, rng), m, isa, pool, "random");
          if (n == 0) return;
          checked += n;
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const auto t : kTypes)
    for (const auto isa : kIsas) cases.push_back({t, isa});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QMatmul, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           return std::string(tensor_type_name(p.param.type)) + "_" +
                                  std::string(qmatmul_isa_name(p.param.isa));
                         });

// Batch invariance (qmatmul.h): row i of a product is the same bits whatever else shares the call. For every type,
// path and activation mode, each of 300 x rows multiplied alone (m = 1: the row kernels) is the reference; the
// same rows inside calls of m = 3, 16, 17, 40, 300 (row kernels, panels, panels plus rows left over), at two
// places in x, serially and on a 2-thread pool (other row ranges), must give row i's bits exactly (memcmp). An
// outlier channel (column 40 large in every row) puts one block column's second levels through the panels' pair
// tiles; each row's own large element adds scattered picks. For the quantized types the reference is also the
// scalar twin's bits: every path computes the same terms in the same order.
class QMatmulBatchInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(QMatmulBatchInvariance, EachRowEqualsTheRowAlone) {
  const auto [type, isa] = GetParam();
  if (!qmatmul_isa_available(isa)) GTEST_SKIP() << qmatmul_isa_name(isa) << " is not available on this CPU";
  const int64_t bs = static_cast<int64_t>(tensor_type_block_size(type));
  // 32-blocks: 18 per row (a register of 16 and a tail); K types: 2 super-blocks; float: a vector tail.
  const int64_t cols = bs == 1 ? 583 : bs == 32 ? 576 : 512;
  const int64_t rows = 101, total = 300;  // weight rows: 6 panels and 5 rows left over, split in 48-row pieces
  std::mt19937 rng(4242 + static_cast<int>(type) * 13 + static_cast<int>(isa));
  const auto w = random_weights(type, rows, cols, rng);
  auto x = random_x(total, cols, rng);
  for (int64_t i = 0; i < total; ++i) x[static_cast<size_t>(i * cols + 40)] = 15.0f + static_cast<float>(i % 7);
  ThreadPool pool(2);
  const size_t row_floats = static_cast<size_t>(rows);
  for (const QAct act : {QAct::Int8, QAct::Int8Outliers, QAct::Int8x2}) {
    const QMatrix mat{w.data(), rows, cols, type, act};
    const std::string what = std::string(tensor_type_name(type)) + " " + std::string(qmatmul_isa_name(isa)) +
                             (act == QAct::Int8 ? " int8" : act == QAct::Int8x2 ? " int8x2" : " int8outliers");
    std::vector<float> ref(static_cast<size_t>(total) * row_floats), alone(row_floats);
    for (int64_t i = 0; i < total; ++i) {
      qmatmul(mat, x.data() + i * cols, 1, ref.data() + i * rows, nullptr, isa);
      if (bs > 1 && isa != QIsa::Scalar) {
        qmatmul(mat, x.data() + i * cols, 1, alone.data(), nullptr, QIsa::Scalar);
        ASSERT_EQ(std::memcmp(alone.data(), ref.data() + i * rows, row_floats * sizeof(float)), 0)
            << what << ": row " << i << " alone differs from the scalar twin's";
      }
    }
    for (const int64_t m : {1, 3, 16, 17, 40, 300}) {
      for (const int64_t at : {int64_t{0}, (total - m) / 2}) {
        for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
          std::vector<float> y(static_cast<size_t>(m) * row_floats);
          qmatmul(mat, x.data() + at * cols, m, y.data(), p, isa);
          for (int64_t k = 0; k < m; ++k) {
            const float* got = y.data() + k * rows;
            const float* want = ref.data() + (at + k) * rows;
            if (std::memcmp(got, want, row_floats * sizeof(float)) == 0) continue;
            int64_t r = 0;
            while (std::memcmp(got + r, want + r, sizeof(float)) == 0) ++r;
            FAIL() << what << ": m=" << m << " from row " << at << (p != nullptr ? " threaded" : "") << ": row "
                   << at + k << " output " << r << " is " << got[r] << ", alone " << want[r];
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QMatmulBatchInvariance, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           return std::string(tensor_type_name(p.param.type)) + "_" +
                                  std::string(qmatmul_isa_name(p.param.isa));
                         });

// With m large enough for several x blocks (the L2 tiling) and the prefill panels, rows split over threads into
// several pieces with a remainder: every path against the scalar twin, and threaded == serial bit for bit.
TEST(QMatmulTiling, ManyRowsOfXMatchTheScalarTwin) {
  std::mt19937 rng(7);
  const int64_t rows = 101, cols = 4096, m = 150;
  ThreadPool pool(2);
  for (const auto type : {TensorType::Q4_0, TensorType::Q8_0, TensorType::Q4_K, TensorType::Q6_K, TensorType::BF16}) {
    const auto w = random_weights(type, rows, cols, rng);
    const auto x = random_x(m, cols, rng);
    for (const QAct act : {QAct::Int8, QAct::Int8x2, QAct::Int8Outliers}) {
    const QMatrix mat{w.data(), rows, cols, type, act};
    std::vector<float> ys(static_cast<size_t>(m * rows));
    qmatmul(mat, x.data(), m, ys.data(), nullptr, QIsa::Scalar);
    for (const auto isa : kIsas) {
      if (!qmatmul_isa_available(isa)) continue;
      std::vector<float> y(ys.size()), yp(ys.size());
      qmatmul(mat, x.data(), m, y.data(), nullptr, isa);
      qmatmul(mat, x.data(), m, yp.data(), &pool, isa);
      for (size_t k = 0; k < y.size(); ++k) {
        ASSERT_NEAR(y[k], ys[k], 1e-4 * (std::fabs(ys[k]) + 1.0f))
            << tensor_type_name(type) << " " << qmatmul_isa_name(isa) << " at " << k;
        ASSERT_EQ(y[k], yp[k]) << tensor_type_name(type) << " " << qmatmul_isa_name(isa) << " at " << k;
      }
    }
    }
  }
}

// Int8Outliers with outlier channels as the real models have them (the same columns in every row), so that a
// block column is picked by >= 16 rows and its second levels go through the panels' pair tiles (or, for Q8_0 on
// AVX2 and the scalar twin, the row kernels' picks), beside scattered single picks: every type and path, within the
// bounds above, threaded == serial.
TEST(QMatmulOutliers, OutlierChannelsTakeTheSecondLevel) {
  std::mt19937 rng(11);
  ThreadPool pool(2);
  for (const auto type : kTypes) {
    if (tensor_type_block_size(type) == 1) continue;
    const int64_t rows = 53, cols = 1024, m = 40;
    const auto w = random_weights(type, rows, cols, rng);
    auto x = random_x(m, cols, rng);
    for (int64_t i = 0; i < m; ++i) {
      x[static_cast<size_t>(i * cols + 3)] = 15.0f + static_cast<float>(i % 5);        // block 0
      x[static_cast<size_t>(i * cols + 700)] = -12.0f - static_cast<float>(i % 3);     // a middle block
      if (i % 2 == 0) x[static_cast<size_t>(i * cols + 1023)] = 9.0f;                  // the last block, half the rows
      // ~2.5-3.6x the median step of a row's blocks (its max|x| ~2.1 over 32 normal values, ~2.9 over 256): above
      // kOutlierRatio, so a smaller pick (a larger ratio) leaves it at d_b / 2 and fails the bound
      x[static_cast<size_t>(i * cols + 300)] = 7.5f;
    }
    const QMatrix mat{w.data(), rows, cols, type, QAct::Int8Outliers};
    for (const QIsa isa : kIsas) {
      if (!qmatmul_isa_available(isa)) continue;
      ASSERT_GT(check_product(mat, x, m, isa, pool, "outlier channels"), 0);
    }
  }
}

// The picks alone: every block of x on its own int8 grid (values k / 64, |k| <= 127, one at 127 / 64: d = 1 / 64,
// rounding exact) but the picked ones, which hold normal values and one at +-7.5 (d = 7.5 / 127, 3.8x the median
// step: picked at kOutlierRatio = 2, not at 4). So the whole activation error is the picked blocks' second level's
// (bound d / 508), and a product that leaves a picked block at one level (d / 2), or adds its second level wrongly,
// fails. Block column 5 is picked in every row (>= 16 pairs), another block in one row each. m = 1 and 3: the row
// kernels' picks alone (decode); m = 40 over 37 weight rows: the panels' pair tiles for rows 0-31 and the row
// kernels' picks for the 5 rows left, in one call. A kernel that ignores its picks (or the pairs) leaves d / 2.
TEST(QMatmulOutliers, OnlyThePickedBlocksCarryError) {
  std::mt19937 rng(13);
  ThreadPool pool(2);
  for (const auto type : kTypes) {
    const int64_t ab = qmatmul_activation_block(type);
    if (ab == 0) continue;
    const int64_t rows = 37, cols = 16 * ab, m = 40, nb = cols / ab;
    const auto w = random_weights(type, rows, cols, rng);
    std::vector<float> x(static_cast<size_t>(m * cols));
    std::uniform_int_distribution<int> k127(-127, 127);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        float* xb = x.data() + i * cols + b * ab;
        if (b == 5 || b == (i * 7) % nb) {
          for (int64_t k = 0; k < ab; ++k) xb[k] = nd(rng);
          xb[static_cast<int64_t>(rng() % ab)] = i % 2 == 0 ? 7.5f : -7.5f;
        } else {
          for (int64_t k = 0; k < ab; ++k) xb[k] = static_cast<float>(k127(rng)) / 64.0f;
          xb[static_cast<int64_t>(rng() % ab)] = 127.0f / 64.0f;
        }
      }
    }
    const QMatrix mat{w.data(), rows, cols, type, QAct::Int8Outliers};
    for (const QIsa isa : kIsas) {
      if (!qmatmul_isa_available(isa)) continue;
      for (const int64_t mm : {int64_t{1}, int64_t{3}, m}) ASSERT_GT(check_product(mat, x, mm, isa, pool, "picked blocks only"), 0);
    }
  }
}

// The two real test models (scripts/fetch_models.sh; skipped when absent): blocks written by llama.cpp's
// quantizers. For every type in each file, up to two 2-D tensors, their first 48 rows, m = 1 and 17 (row kernels
// and panels), every path, checked as above.
std::string model_path(const std::string& file) {
  const char* env = std::getenv("TESSERA_MODELS");
  const char* home = std::getenv("HOME");
  const std::string dir = env != nullptr && *env != 0 ? env : std::string(home != nullptr ? home : "/") + "/.cache/tessera/models";
  return dir + "/" + file;
}

TEST(QMatmulRealModels, EveryStoredTypeMatches) {
  int files = 0;
  for (const char* name : {"smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"}) {
    const std::string path = model_path(name);
    if (!std::ifstream(path).good()) continue;
    ++files;
    const auto file = ModelFile::open(path);
    std::map<TensorType, int> seen;
    std::mt19937 rng(5);
    ThreadPool pool(2);
    for (const TensorInfo& t : file->tensors()) {
      if (t.shape.size() != 2 || !qmatmul_supported(t.type) || seen[t.type] >= 2) continue;
      ++seen[t.type];
      const int64_t rows = std::min<int64_t>(48, t.rows()), cols = t.row_length();
      for (const QAct act : {QAct::Int8, QAct::Int8x2, QAct::Int8Outliers}) {
        const QMatrix mat{t.data, rows, cols, t.type, act};
        for (const QIsa isa : kIsas) {
          if (!qmatmul_isa_available(isa)) continue;
          for (const int64_t m : {1, 17}) {
            if (check_product(mat, random_x(m, cols, rng), m, isa, pool, std::string(name) + " " + t.name) == 0)
              return;
          }
        }
      }
    }
    std::string types;
    for (const auto& [type, n] : seen) types += " " + std::string(tensor_type_name(type));
    std::printf("qmatmul: %s: checked%s\n", name, types.c_str());
  }
  if (files == 0) GTEST_SKIP() << "no test model under " << model_path("");
}

TEST(QMatmulErrors, UnsupportedTypeIsNamed) {
  const uint8_t bytes[84] = {};
  float x[256] = {}, y[1];
  for (const auto type : {TensorType::Q2_K, TensorType::Q3_K, TensorType::Q8_K}) {
    EXPECT_FALSE(qmatmul_supported(type));
    try {
      qmatmul(QMatrix{bytes, 1, 256, type}, x, 1, y);
      FAIL() << "no error for " << tensor_type_name(type);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("weight type " + std::string(tensor_type_name(type)) + " ("),
                std::string::npos)
          << e.what();
    }
  }
  try {
    qmatmul(QMatrix{bytes, 1, 256, static_cast<TensorType>(20)}, x, 1, y);  // IQ4_NL
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("IQ4_NL"), std::string::npos) << e.what();
  }
}

TEST(QMatmulErrors, RaggedColumnsAreRejected) {
  const uint8_t bytes[64] = {};
  float x[48] = {}, y[1];
  EXPECT_THROW(qmatmul(QMatrix{bytes, 1, 48, TensorType::Q4_0}, x, 1, y), Error);
  EXPECT_THROW(qmatmul(QMatrix{bytes, 1, 48, TensorType::Q4_K}, x, 1, y), Error);
}

TEST(QMatmulIsa, BestIsAvailableAndNamed) {
  EXPECT_TRUE(qmatmul_isa_available(QIsa::Scalar));
  EXPECT_TRUE(qmatmul_isa_available(qmatmul_best_isa()));
  std::printf("qmatmul: best path on this CPU: %s\n", std::string(qmatmul_isa_name(qmatmul_best_isa())).c_str());
}

}  // namespace
}  // namespace tessera::model
