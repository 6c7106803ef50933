#include "attention/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace tessera::attn {

namespace {

double element(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  if (t.dtype == DType::BF16) return bf16_to_f32(*t.at<const bf16>(i0, i1, i2));
  if (t.dtype == DType::F16) return f16_to_f32(*t.at<const f16>(i0, i1, i2));
  return *t.at<const float>(i0, i1, i2);
}

}  // namespace

void reference_attention_masked(const AttentionArgs& args,
                                const std::function<bool(int head, int row, int key)>& visible,
                                std::vector<double>* out_f64) {
  validate(args);
  const int64_t q_len = args.q_len(), kv_len = args.kv_len(), hq = args.num_q_heads(), d = args.head_dim();
  const double scale = args.effective_scale();
  if (out_f64 != nullptr) out_f64->assign(static_cast<size_t>(q_len * hq * d), 0.0);

  ThreadPool::global().parallel_for(hq, [&](int64_t h, int) {
    const int64_t g = args.kv_head(h);
    std::vector<double> scores(static_cast<size_t>(kv_len));
    std::vector<double> acc(static_cast<size_t>(d));
    for (int64_t r = 0; r < q_len; ++r) {
      const int64_t pos = args.q_begin + r;
      double max_score = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < kv_len; ++j) {
        const bool vis = j <= pos && (args.window == 0 || pos - j < args.window) &&
                         visible(static_cast<int>(h), static_cast<int>(r), static_cast<int>(j));
        if (!vis) {
          scores[static_cast<size_t>(j)] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += element(args.q, r, h, c) * element(args.k, j, g, c);
        s *= scale;
        scores[static_cast<size_t>(j)] = s;
        if (s > max_score) max_score = s;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double sum = 0;
      if (max_score > -std::numeric_limits<double>::infinity()) {
        for (int64_t j = 0; j < kv_len; ++j) {
          const double s = scores[static_cast<size_t>(j)];
          if (s == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(s - max_score);
          sum += p;
          for (int64_t c = 0; c < d; ++c) acc[static_cast<size_t>(c)] += p * element(args.v, j, g, c);
        }
      }
      for (int64_t c = 0; c < d; ++c) {
        const double o = sum > 0 ? acc[static_cast<size_t>(c)] / sum : 0.0;
        *args.out.at<float>(r, h, c) = static_cast<float>(o);
        if (out_f64 != nullptr) (*out_f64)[static_cast<size_t>((r * hq + h) * d + c)] = o;
      }
      if (args.has_lse()) {
        *args.lse.at<float>(h, r) =
            sum > 0 ? static_cast<float>(max_score + std::log(sum)) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

void reference_attention_sparse(const AttentionArgs& args, const SparseIndex& index,
                                std::vector<double>* out_f64) {
  validate(args);
  check(index.num_heads == args.num_q_heads() && index.q_begin == args.q_begin &&
            index.q_len == args.q_len() && index.kv_len == args.kv_len(),
        "reference attention: the sparse index does not describe this call");
  reference_attention_masked(
      args, [&](int h, int r, int j) { return index.visible(h, r, j); }, out_f64);
}

void reference_attention_causal(const AttentionArgs& args, std::vector<double>* out_f64) {
  reference_attention_masked(
      args, [](int, int, int) { return true; }, out_f64);
}

}  // namespace tessera::attn
