#include "attention/cpu/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace tessera::attn {

namespace {

// Row `i0` of a [n, heads, d] view, head `h`, as doubles.
void load_row(const TensorView& t, int64_t i0, int64_t h, double* dst) {
  const int64_t d = t.dim(2);
  for (int64_t c = 0; c < d; ++c) {
    dst[c] = t.dtype == DType::BF16 ? bf16_to_f32(*t.at<const bf16>(i0, h, c))
             : t.dtype == DType::F16 ? f16_to_f32(*t.at<const f16>(i0, h, c))
                                     : *t.at<const float>(i0, h, c);
  }
}

}  // namespace

RecallResult attention_recall(const AttentionArgs& args, const SparseIndex& index, ThreadPool& pool) {
  args.q.expect_shape("attention_recall q", {-1, -1, -1});
  args.q.expect_dtype("attention_recall q", {DType::F32, DType::BF16});
  const int64_t q_len = args.q.dim(0), hq = args.q.dim(1), d = args.q.dim(2);
  args.k.expect_shape("attention_recall k", {-1, -1, d});
  args.k.expect_dtype("attention_recall k", {DType::F32, DType::BF16, DType::F16});
  const int64_t kv_len = args.k.dim(0), hkv = args.k.dim(1);
  check(hkv > 0 && hq % hkv == 0, "attention_recall: " + std::to_string(hq) +
                                      " query heads are not a multiple of " + std::to_string(hkv) +
                                      " kv heads");
  check(args.q_begin >= 0 && kv_len >= args.q_begin + q_len,
        "attention_recall: kv_len " + std::to_string(kv_len) +
            " is less than q_begin + q_len = " + std::to_string(args.q_begin + q_len));
  check(index.num_heads == hq && index.q_begin == args.q_begin && index.q_len == q_len &&
            index.kv_len == kv_len,
        "attention_recall: the sparse index does not describe this call (heads, q_begin, q_len, kv_len)");
  check(args.window >= 0,
        "attention_recall: window must be >= 0 (0: no window), got " + std::to_string(args.window));

  RecallResult result;
  result.per_head.assign(static_cast<size_t>(hq), 0.0);
  if (q_len == 0 || hq == 0) return result;
  const double scale = args.effective_scale();
  const int64_t group = hq / hkv;

  // K of every kv head as doubles, [hkv][kv_len][d].
  std::vector<double> keys(static_cast<size_t>(hkv * kv_len * d));
  pool.parallel_for(hkv * kv_len,
                    [&](int64_t i, int) { load_row(args.k, i % kv_len, i / kv_len, keys.data() + i * d); });

  // One item per (head, index tile); per-row recall summed per item, then per head.
  const int64_t tiles = index.num_tiles();
  std::vector<double> item_sum(static_cast<size_t>(hq * tiles), 0.0);
  pool.parallel_for(hq * tiles, [&](int64_t item, int) {
    const int64_t h = item / tiles, t = item % tiles;
    const double* kh = keys.data() + (h / group) * kv_len * d;
    std::vector<double> q(static_cast<size_t>(d)), p(static_cast<size_t>(kv_len));
    const auto ranges = index.ranges_of(static_cast<int32_t>(h), static_cast<int32_t>(t));
    const auto columns = index.columns_of(static_cast<int32_t>(h), static_cast<int32_t>(t));
    double sum = 0;
    for (int64_t r = t * index.tile; r < std::min<int64_t>(q_len, (t + 1) * index.tile); ++r) {
      const int64_t pos = args.q_begin + r;
      const int64_t lo = args.window > 0 ? std::max<int64_t>(0, pos - args.window + 1) : 0;
      load_row(args.q, r, h, q.data());
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = lo; j <= pos; ++j) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += q[static_cast<size_t>(c)] * kh[j * d + c];
        p[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, p[static_cast<size_t>(j)]);
      }
      double total = 0;
      for (int64_t j = lo; j <= pos; ++j)
        total += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx));
      double kept = 0;
      for (const KeyRange& kr : ranges) {
        for (int64_t j = std::max<int64_t>(kr.begin, lo); j < std::min<int64_t>(kr.end, pos + 1); ++j)
          kept += p[static_cast<size_t>(j)];
      }
      for (int32_t j : columns) {
        if (j >= lo && j <= pos) kept += p[static_cast<size_t>(j)];
      }
      sum += kept / total;
    }
    item_sum[static_cast<size_t>(item)] = sum;
  });

  for (int64_t h = 0; h < hq; ++h) {
    double s = 0;
    for (int64_t t = 0; t < tiles; ++t) s += item_sum[static_cast<size_t>(h * tiles + t)];
    result.per_head[static_cast<size_t>(h)] = s / static_cast<double>(q_len);
    result.mean += result.per_head[static_cast<size_t>(h)];
  }
  result.mean /= static_cast<double>(hq);
  return result;
}

OutputError output_error(const TensorView& a, const TensorView& b) {
  b.expect_shape("output_error reference", {-1, -1, -1});
  b.expect_dtype("output_error reference", {DType::F32});
  a.expect_shape("output_error output", {b.dim(0), b.dim(1), b.dim(2)});
  a.expect_dtype("output_error output", {DType::F32});
  const int64_t n = b.dim(0), heads = b.dim(1), d = b.dim(2);
  auto ratio = [](double diff2, double ref2) {
    if (ref2 > 0) return std::sqrt(diff2 / ref2);
    return diff2 > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  };
  OutputError e;
  e.per_head_rel.assign(static_cast<size_t>(heads), 0.0);
  e.per_head_max_abs.assign(static_cast<size_t>(heads), 0.0);
  double diff2_all = 0, ref2_all = 0;
  for (int64_t h = 0; h < heads; ++h) {
    double diff2 = 0, ref2 = 0, mx = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < d; ++c) {
        const double x = *a.at<const float>(i, h, c), y = *b.at<const float>(i, h, c);
        diff2 += (x - y) * (x - y);
        ref2 += y * y;
        mx = std::max(mx, std::abs(x - y));
      }
    }
    e.per_head_rel[static_cast<size_t>(h)] = ratio(diff2, ref2);
    e.per_head_max_abs[static_cast<size_t>(h)] = mx;
    e.max_abs = std::max(e.max_abs, mx);
    diff2_all += diff2;
    ref2_all += ref2;
  }
  e.rel_frobenius = ratio(diff2_all, ref2_all);
  return e;
}

}  // namespace tessera::attn
