#include "attention/index/estimate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/error.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace tessera::attn {

namespace {

// Copies row `pos` of head `head` of a token-major [len, heads, d] view into f32.
void load_row(const TensorView& x, int64_t pos, int head, float* out) {
  const int64_t d = x.dim(2);
  if (x.dtype == DType::F32) {
    const float* src = x.at<float>(pos, head);
    for (int64_t i = 0; i < d; ++i) out[i] = src[i * x.stride[2]];
  } else if (x.dtype == DType::F16) {  // a CPU f16 KV cache
    const f16* src = x.at<f16>(pos, head);
    for (int64_t i = 0; i < d; ++i) out[i] = f16_to_f32(src[i * x.stride[2]]);
  } else {
    const bf16* src = x.at<bf16>(pos, head);
    for (int64_t i = 0; i < d; ++i) out[i] = bf16_to_f32(src[i * x.stride[2]]);
  }
}

float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  for (float v : lanes) sum += v;
#endif
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

void check_inputs(const TensorView& q, const TensorView& k, int q_head, int kv_head, const LoweringContext& ctx,
                  const char* who) {
  const std::string w = who;
  check(q.rank == 3 && k.rank == 3, w + ": q and k must be [len, heads, head_dim]");
  q.expect_dtype(w + ": q", {DType::F32, DType::BF16});
  k.expect_dtype(w + ": k", {DType::F32, DType::BF16, DType::F16});
  check(q.dim(0) == ctx.q_len, w + ": q has " + std::to_string(q.dim(0)) + " rows, context says q_len " +
                                   std::to_string(ctx.q_len));
  check(k.dim(0) >= ctx.kv_len, w + ": k has " + std::to_string(k.dim(0)) + " rows, context says kv_len " +
                                    std::to_string(ctx.kv_len));
  check(q.dim(2) == k.dim(2), w + ": q and k head dims differ");
  check(q_head >= 0 && q_head < q.dim(1) && kv_head >= 0 && kv_head < k.dim(1), w + ": head out of range");
  check(ctx.kv_len >= ctx.q_begin + ctx.q_len, w + ": kv_len smaller than q_begin + q_len");
}

// Indices of the `count` largest values of score[begin, end), ascending by index. Ties go to the smaller index.
std::vector<int32_t> top_k(const std::vector<double>& score, int64_t begin, int64_t end, int64_t count) {
  std::vector<int32_t> idx(static_cast<size_t>(std::max<int64_t>(0, end - begin)));
  std::iota(idx.begin(), idx.end(), static_cast<int32_t>(begin));
  count = std::clamp<int64_t>(count, 0, static_cast<int64_t>(idx.size()));
  auto better = [&](int32_t a, int32_t b) {
    const double sa = score[static_cast<size_t>(a)], sb = score[static_cast<size_t>(b)];
    return sa > sb || (sa == sb && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + count, idx.end(), better);
  idx.resize(static_cast<size_t>(count));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

int64_t coverage_count(const std::vector<double>& mass, int64_t forced, double gamma, int64_t min_count,
                       int64_t max_count) {
  const int64_t n = static_cast<int64_t>(mass.size());
  forced = std::clamp<int64_t>(forced, 0, n);
  max_count = std::clamp<int64_t>(max_count, 0, n);
  const int64_t lo = std::min(std::max(min_count, forced), max_count);
  double total = 0.0;
  for (double m : mass) total += m;
  int64_t count = n;
  if (gamma < 1.0 && total > 0.0) {
    const double target = gamma * total;
    double acc = 0.0;
    for (int64_t i = 0; i < forced; ++i) acc += mass[static_cast<size_t>(i)];
    if (acc >= target) {
      count = forced;
    } else {
      std::vector<int32_t> order(static_cast<size_t>(n - forced));
      std::iota(order.begin(), order.end(), static_cast<int32_t>(forced));
      // Only the prefix up to max_count can matter: a partial sort of that many.
      const auto mid = order.begin() + std::min<int64_t>(max_count - forced < 0 ? 0 : max_count - forced,
                                                         static_cast<int64_t>(order.size()));
      std::partial_sort(order.begin(), mid, order.end(), [&](int32_t a, int32_t b) {
        const double ma = mass[static_cast<size_t>(a)], mb = mass[static_cast<size_t>(b)];
        return ma > mb || (ma == mb && a < b);
      });
      count = n;
      for (auto it = order.begin(); it != mid; ++it) {
        acc += mass[static_cast<size_t>(*it)];
        if (acc >= target) {
          count = forced + (it - order.begin()) + 1;
          break;
        }
      }
    }
  }
  return std::clamp(count, lo, max_count);
}

VerticalSlashEstimate estimate_vertical_slash(const VerticalSlashPattern& p, const TensorView& q,
                                              const TensorView& k, int q_head, int kv_head,
                                              const LoweringContext& ctx, float scale) {
  check_inputs(q, k, q_head, kv_head, ctx, "vertical_slash estimate");
  VerticalSlashEstimate est;
  if (ctx.q_len == 0) return est;
  const int64_t d = q.dim(2);
  const int64_t rows = std::min<int64_t>(p.last_q, ctx.q_len);
  const int64_t last_pos = ctx.q_begin + ctx.q_len - 1;  // keys [0, last_pos] can be visible
  const int64_t keys = last_pos + 1;

  std::vector<double> colsum(static_cast<size_t>(keys), 0.0), diagsum(static_cast<size_t>(keys), 0.0);
  std::vector<float> qrow(static_cast<size_t>(d)), krows(static_cast<size_t>(keys * d));
  for (int64_t j = 0; j < keys; ++j) load_row(k, j, kv_head, krows.data() + j * d);
  std::vector<float> s(static_cast<size_t>(keys));
  for (int64_t r = ctx.q_len - rows; r < ctx.q_len; ++r) {
    const int64_t pos = ctx.q_begin + r;
    load_row(q, r, q_head, qrow.data());
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j <= pos; ++j) {
      s[static_cast<size_t>(j)] = dot(qrow.data(), krows.data() + j * d, d) * scale;
      mx = std::max(mx, s[static_cast<size_t>(j)]);
    }
    double total = 0.0;
    for (int64_t j = 0; j <= pos; ++j) total += std::exp(static_cast<double>(s[static_cast<size_t>(j)] - mx));
    for (int64_t j = 0; j <= pos; ++j) {
      const double a = std::exp(static_cast<double>(s[static_cast<size_t>(j)] - mx)) / total;
      colsum[static_cast<size_t>(j)] += a;
      diagsum[static_cast<size_t>(pos - j)] += a;
    }
  }

  // Forced columns [0, fc) and diagonals [0, fd) come first, within the budgets; the rest by score.
  int64_t kv = std::min<int64_t>(p.vertical, keys), ks = std::min<int64_t>(p.slash, keys);
  const int64_t fc = std::min<int64_t>(p.forced_columns, kv), fd = std::min<int64_t>(p.forced_diagonals, ks);
  if (p.adaptive()) {  // the counts from the coverage target, within [min, max]
    kv = coverage_count(colsum, fc, p.gamma, p.min_vertical, kv);
    ks = coverage_count(diagsum, fd, p.gamma, p.min_slash, ks);
  }
  est.columns.resize(static_cast<size_t>(fc));
  std::iota(est.columns.begin(), est.columns.end(), 0);
  for (int32_t c : top_k(colsum, fc, keys, kv - fc)) est.columns.push_back(c);
  est.offsets.resize(static_cast<size_t>(fd));
  std::iota(est.offsets.begin(), est.offsets.end(), 0);
  for (int32_t o : top_k(diagsum, fd, keys, ks - fd)) est.offsets.push_back(o);
  return est;
}

BlockSparseEstimate estimate_block_sparse(const BlockSparsePattern& p, const TensorView& q, const TensorView& k,
                                          int q_head, int kv_head, const LoweringContext& ctx, float scale) {
  check_inputs(q, k, q_head, kv_head, ctx, "block_sparse estimate");
  BlockSparseEstimate est;
  est.block = p.block;
  est.offsets.assign(1, 0);
  if (ctx.q_len == 0) return est;
  const int64_t d = q.dim(2), B = p.block;
  const int64_t q_end = ctx.q_begin + ctx.q_len;
  const int64_t qb_first = ctx.q_begin / B, qb_last = (q_end - 1) / B;
  const int64_t kb_count = (q_end + B - 1) / B;  // key blocks that can be causal for some query
  est.first_q_block = static_cast<int32_t>(qb_first);

  // Mean-pooled keys per block (a partial last block pools the keys it has).
  std::vector<float> kpool(static_cast<size_t>(kb_count * d), 0.0f), row(static_cast<size_t>(d));
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const int64_t b0 = kb * B, b1 = std::min<int64_t>((kb + 1) * B, ctx.kv_len);
    std::vector<double> acc(static_cast<size_t>(d), 0.0);
    for (int64_t j = b0; j < b1; ++j) {
      load_row(k, j, kv_head, row.data());
      for (int64_t i = 0; i < d; ++i) acc[static_cast<size_t>(i)] += row[static_cast<size_t>(i)];
    }
    for (int64_t i = 0; i < d; ++i) {
      kpool[static_cast<size_t>(kb * d + i)] = static_cast<float>(acc[static_cast<size_t>(i)] / static_cast<double>(b1 - b0));
    }
  }
  std::vector<double> score(static_cast<size_t>(kb_count)), mass;
  std::vector<float> qpool(static_cast<size_t>(d));
  for (int64_t qb = qb_first; qb <= qb_last; ++qb) {
    // Pool the rows of this call that lie in the block.
    const int64_t r0 = std::max<int64_t>(qb * B, ctx.q_begin) - ctx.q_begin;
    const int64_t r1 = std::min<int64_t>((qb + 1) * B, q_end) - ctx.q_begin;
    std::vector<double> acc(static_cast<size_t>(d), 0.0);
    for (int64_t r = r0; r < r1; ++r) {
      load_row(q, r, q_head, row.data());
      for (int64_t i = 0; i < d; ++i) acc[static_cast<size_t>(i)] += row[static_cast<size_t>(i)];
    }
    for (int64_t i = 0; i < d; ++i) {
      qpool[static_cast<size_t>(i)] = static_cast<float>(acc[static_cast<size_t>(i)] / static_cast<double>(r1 - r0));
    }
    // Softmax is monotone within a row, so the top-k of the raw scores is the top-k of the softmax.
    for (int64_t kb = 0; kb < qb; ++kb) {
      score[static_cast<size_t>(kb)] = static_cast<double>(dot(qpool.data(), kpool.data() + kb * d, d) * scale);
    }
    // The diagonal block qb (the block's own keys) is always kept and takes one of the top_k slots; the other
    // min(top_k, qb + 1) - 1 are the best of [0, qb). qb is the largest causal block, so it goes last.
    int64_t count = std::min<int64_t>(p.top_k, qb + 1);
    if (p.adaptive() && count >= 2) {
      // Masses of the causal blocks in the order of coverage_count: the diagonal (forced) first, then 0 .. qb-1.
      const double diag = static_cast<double>(dot(qpool.data(), kpool.data() + qb * d, d) * scale);
      double mx = diag;
      for (int64_t kb = 0; kb < qb; ++kb) mx = std::max(mx, score[static_cast<size_t>(kb)]);
      mass.assign(static_cast<size_t>(qb + 1), 0.0);
      mass[0] = std::exp(diag - mx);
      for (int64_t kb = 0; kb < qb; ++kb) mass[static_cast<size_t>(kb + 1)] = std::exp(score[static_cast<size_t>(kb)] - mx);
      count = coverage_count(mass, 1, p.gamma, p.min_top_k, count);
    }
    if (count >= 1) {
      for (int32_t kb : top_k(score, 0, qb, count - 1)) est.key_blocks.push_back(kb);
      est.key_blocks.push_back(static_cast<int32_t>(qb));
    }
    est.offsets.push_back(static_cast<int32_t>(est.key_blocks.size()));
  }
  return est;
}

std::vector<HeadEstimate> estimate_layer(const std::vector<Pattern>& patterns, const TensorView& q,
                                         const TensorView& k, const LoweringContext& ctx, float scale,
                                         ThreadPool& pool) {
  check(q.rank == 3 && k.rank == 3, "estimate_layer: q and k must be [len, heads, head_dim]");
  const int64_t hq = q.dim(1), hkv = k.dim(1);
  check(static_cast<int64_t>(patterns.size()) == hq,
        "estimate_layer: " + std::to_string(patterns.size()) + " patterns for " + std::to_string(hq) + " query heads");
  check(hkv > 0 && hq % hkv == 0, "estimate_layer: query heads must be a multiple of KV heads");
  const int64_t group = hq / hkv;
  std::vector<HeadEstimate> out(patterns.size());
  pool.parallel_for(hq, [&](int64_t h, int) {
    const int kvh = static_cast<int>(h / group);
    const Pattern& pat = patterns[static_cast<size_t>(h)];
    if (const auto* vs = std::get_if<VerticalSlashPattern>(&pat)) {
      out[static_cast<size_t>(h)] = estimate_vertical_slash(*vs, q, k, static_cast<int>(h), kvh, ctx, scale);
    } else if (const auto* bs = std::get_if<BlockSparsePattern>(&pat)) {
      out[static_cast<size_t>(h)] = estimate_block_sparse(*bs, q, k, static_cast<int>(h), kvh, ctx, scale);
    }
  });
  return out;
}

}  // namespace tessera::attn
