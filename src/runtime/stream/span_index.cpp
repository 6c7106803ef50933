#include "runtime/stream/span_index.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <numeric>
#include <string>

#include "core/error.h"
#include "runtime/stream/span_math.h"

namespace tessera::runtime::stream {

int32_t retained_vectors(int32_t length, double ratio, double lambda, int32_t min_vectors, int32_t max_vectors) {
  const double f = std::pow(std::clamp(ratio, 0.0, 1.0), lambda);
  auto count = static_cast<int64_t>(std::llround(static_cast<double>(length) * f));
  count = std::clamp<int64_t>(count, min_vectors, std::max(min_vectors, max_vectors));
  return static_cast<int32_t>(std::clamp<int64_t>(count, 1, std::max(1, length)));
}

SpanMasses span_masses(const TriangleScores& map, const Span& s) {
  return {map.mass(s.begin, s.end, s.begin, s.end), map.mass(s.end, map.size(), s.begin, s.end)};
}

double area_ratio(const SpanMasses& m) { return m.tri + m.below > 0 ? m.tri / (m.tri + m.below) : 1.0; }

double area_ratio(const TriangleScores& map, const Span& s) { return area_ratio(span_masses(map, s)); }

void check_index_ratio(double ratio) {
  if (!(ratio >= 1)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", ratio);
    throw Error(std::string("--stream-index-ratio must be at least 1 (evicted tokens per index vector), got ") + buf);
  }
}

void LambdaTable::add(int32_t length, double ratio) {
  check(length > 0, "lambda table: a span needs tokens");
  const int64_t bin = std::clamp<int64_t>(static_cast<int64_t>(std::floor(std::clamp(ratio, 0.0, 1.0) * kBins)), 0,
                                          kBins - 1);
  const int64_t cell = static_cast<int64_t>(length) * kBins + bin;
  if (static_cast<int64_t>(counts_.size()) <= cell) counts_.resize(static_cast<size_t>(cell) + 1, 0);
  if (counts_[static_cast<size_t>(cell)]++ == 0) used_.push_back(cell);
  tokens_ += length;
  ++spans_;
}

int64_t LambdaTable::vectors(double lambda, int32_t min_vectors, int32_t max_vectors) const {
  int64_t v = 0;
  for (int64_t cell : used_) {
    const auto length = static_cast<int32_t>(cell / kBins);
    const double r = static_cast<double>(cell % kBins + 1) / kBins;
    v += counts_[static_cast<size_t>(cell)] * retained_vectors(length, r, lambda, min_vectors, max_vectors);
  }
  return v;
}

double LambdaTable::smallest_lambda(double ratio, int32_t min_vectors, int32_t max_vectors) const {
  check_index_ratio(ratio);
  auto meets = [&](double lambda) {
    return static_cast<double>(tokens_) >= ratio * static_cast<double>(vectors(lambda, min_vectors, max_vectors));
  };
  if (!meets(kMaxLambda)) return kMaxLambda;
  double lo = 0, hi = kMaxLambda;  // meets(hi); lo: 0 or a lambda that misses
  while (hi - lo > 1e-6) {
    const double mid = 0.5 * (lo + hi);
    (meets(mid) ? hi : lo) = mid;
  }
  return hi;
}

void LambdaTable::clear() {
  counts_.clear();
  used_.clear();
  tokens_ = spans_ = 0;
}

std::vector<int32_t> top_voted(std::span<const float> votes, int32_t begin, int32_t end, int32_t count) {
  std::vector<int32_t> idx(static_cast<size_t>(std::max(0, end - begin)));
  std::iota(idx.begin(), idx.end(), begin);
  count = std::min<int32_t>(count, static_cast<int32_t>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + count, idx.end(), [&](int32_t a, int32_t b) {
    const float va = votes[static_cast<size_t>(a)], vb = votes[static_cast<size_t>(b)];
    return va != vb ? va > vb : a < b;
  });
  idx.resize(static_cast<size_t>(count));
  std::sort(idx.begin(), idx.end());
  return idx;
}

void SpanIndex::add(int32_t block, std::span<const float> keys, int32_t count) {
  check(count > 0 && static_cast<int64_t>(keys.size()) == count * row(), "span index: wrong key vector count");
  check(block >= num_blocks() - 1 && block >= 0, "span index: blocks are added in order");
  if (block >= num_blocks()) block_spans_.resize(static_cast<size_t>(block) + 1);
  block_spans_[static_cast<size_t>(block)].push_back(num_spans());
  check(holds_keys(), "span index: keys added to an index whose keys are held elsewhere");
  span_first_.push_back(num_vectors());
  span_count_.push_back(count);
  keys_.insert(keys_.end(), keys.begin(), keys.end());
  vectors_ += count;
}

void SpanIndex::add_counted(int32_t block, int32_t count) {
  check(count > 0, "span index: wrong key vector count");
  check(block >= num_blocks() - 1 && block >= 0, "span index: blocks are added in order");
  check(keys_.empty(), "span index: keys held elsewhere added to an index that holds its keys");
  if (block >= num_blocks()) block_spans_.resize(static_cast<size_t>(block) + 1);
  block_spans_[static_cast<size_t>(block)].push_back(num_spans());
  span_first_.push_back(num_vectors());
  span_count_.push_back(count);
  vectors_ += count;
}

std::vector<double> SpanIndex::block_scores(std::span<const float> queries, std::span<const int32_t> query_counts,
                                            const HeadWeights& w) const {
  check(holds_keys(), "span index: its keys are held on the device (score it there: runtime/cuda/stream_decide.h)");
  const int32_t d = shape_.head_dim, nq = shape_.q_heads;
  const int64_t qrow = static_cast<int64_t>(nq) * d;
  int64_t m = 0;
  for (int32_t c : query_counts) m += c;
  const int64_t V = num_vectors();
  // sim[t][s] for every query span t and stored span s; per voting head, all dot products in one GEMM.
  const auto S = static_cast<size_t>(num_spans());
  std::vector<double> sim(query_counts.size() * S, 0.0);
  std::vector<float> dots(static_cast<size_t>(m * V));
  for (int32_t h = 0; h < nq && m > 0 && V > 0; ++h) {
    if (w[static_cast<size_t>(h)] == 0) continue;
    const int32_t g = shape_.kv_head(h) - head_begin_;  // within the kept heads
    check(g >= 0 && g < heads_, [&] {
      return "span index: query head " + std::to_string(h) + " votes, but its kv head " +
             std::to_string(g + head_begin_) + " is not in the index";
    });
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(V), d, 1.0f,
                queries.data() + static_cast<int64_t>(h) * d, static_cast<int>(qrow),
                keys_.data() + static_cast<int64_t>(g) * d, static_cast<int>(row()), 0.0f, dots.data(), static_cast<int>(V));
    int64_t first = 0;
    for (size_t t = 0; t < query_counts.size(); ++t) {
      const int32_t mt = query_counts[t];
      for (size_t sp = 0; sp < S; ++sp) {
        double sum = 0;
        for (int32_t a = 0; a < mt; ++a) {
          const float* row_a = dots.data() + (first + a) * V + span_first_[sp];
          sum += static_cast<double>(*std::max_element(row_a, row_a + span_count_[sp]));
        }
        sim[t * S + sp] += w[static_cast<size_t>(h)] * sum / mt;
      }
      first += mt;
    }
  }
  std::vector<double> scores(static_cast<size_t>(num_blocks()), 0.0);
  for (int32_t b = 0; b < num_blocks(); ++b) {
    const auto& spans = block_spans_[static_cast<size_t>(b)];
    double score = 0;
    for (size_t t = 0; t < query_counts.size(); ++t) {
      double best = -std::numeric_limits<double>::infinity();
      for (int64_t s : spans) best = std::max(best, sim[t * S + static_cast<size_t>(s)]);
      if (!spans.empty()) score += best;
    }
    scores[static_cast<size_t>(b)] = spans.empty() ? -std::numeric_limits<double>::infinity() : score;
  }
  return scores;
}

void SpanIndex::clear() {
  keys_.clear();
  vectors_ = 0;
  span_first_.clear();
  span_count_.clear();
  block_spans_.clear();
}

void ReprIndex::add(std::span<const float> keys, int32_t count) {
  const int64_t row = static_cast<int64_t>(shape_.kv_heads) * shape_.head_dim;
  check(count > 0 && static_cast<int64_t>(keys.size()) == count * row, "repr index: wrong key vector count");
  std::vector<float> mean(static_cast<size_t>(row), 0.0f);
  for (int32_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < row; ++i) mean[static_cast<size_t>(i)] += keys[static_cast<size_t>(r * row + i)] / static_cast<float>(count);
  means_.push_back(std::move(mean));
  vectors_ += count;
}

std::vector<double> ReprIndex::block_scores(std::span<const float> queries, int32_t n, const HeadWeights& w) const {
  const int32_t d = shape_.head_dim, nq = shape_.q_heads;
  std::vector<float> qmean(static_cast<size_t>(nq) * static_cast<size_t>(d), 0.0f);
  for (int32_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < static_cast<int64_t>(nq) * d; ++j)
      qmean[static_cast<size_t>(j)] += queries[static_cast<size_t>(static_cast<int64_t>(i) * nq * d + j)] / static_cast<float>(n);
  std::vector<double> scores(means_.size(), 0.0);
  const int32_t group = nq / shape_.kv_heads;
  for (size_t b = 0; b < means_.size(); ++b)
    scores[b] = span_math::repr_score(qmean.data(), means_[b].data(), w.data(), nq, group, d);
  return scores;
}

void ReprIndex::clear() {
  means_.clear();
  vectors_ = 0;
}

std::vector<int32_t> top_blocks(std::span<const double> scores, int32_t k) {
  const auto n = static_cast<int32_t>(scores.size());
  std::vector<int32_t> top;
  if (k >= n) {
    top.resize(static_cast<size_t>(n));
    std::iota(top.begin(), top.end(), 0);
    return top;
  }
  if (k <= 0) return top;
  // A heap of the best k so far, its front the worst of them (`before`: a ranks before b). One pass: a block whose
  // score is below the worst's cannot enter (the common case, one compare); otherwise the full order decides.
  const auto before = [&](int32_t a, int32_t b) {
    const double sa = scores[static_cast<size_t>(a)], sb = scores[static_cast<size_t>(b)];
    return sa != sb ? sa > sb : a < b;
  };
  top.resize(static_cast<size_t>(k));
  std::iota(top.begin(), top.end(), 0);
  std::make_heap(top.begin(), top.end(), before);
  double worst = scores[static_cast<size_t>(top.front())];
  for (int32_t i = k; i < n; ++i) {
    const double si = scores[static_cast<size_t>(i)];
    if (si < worst || !before(i, top.front())) continue;
    std::pop_heap(top.begin(), top.end(), before);
    top.back() = i;
    std::push_heap(top.begin(), top.end(), before);
    worst = scores[static_cast<size_t>(top.front())];
  }
  std::sort(top.begin(), top.end());
  return top;
}

}  // namespace tessera::runtime::stream
