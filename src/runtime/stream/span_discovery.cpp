#include "runtime/stream/span_discovery.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "runtime/stream/span_math.h"

namespace tessera::runtime::stream {

TriangleScores::TriangleScores(std::span<const float> map, int32_t n, double theta)
    : n_(n), theta_(theta), prefix_(static_cast<size_t>(n + 1) * static_cast<size_t>(n + 1), 0) {
  check(n >= 0 && map.size() >= static_cast<size_t>(n) * static_cast<size_t>(n),
        "span discovery: the attention map has " + std::to_string(map.size()) + " entries, fewer than " +
            std::to_string(n) + " x " + std::to_string(n));
  const size_t w = static_cast<size_t>(n) + 1;
  for (int32_t r = 0; r < n; ++r) {
    uint64_t row = 0;  // the fixed-point running sum of the row's causal entries (span_math.h: wrapping integers)
    const float* in = map.data() + static_cast<size_t>(r) * static_cast<size_t>(n);
    const uint64_t* above = prefix_.data() + static_cast<size_t>(r) * w + 1;
    uint64_t* out = prefix_.data() + (static_cast<size_t>(r) + 1) * w + 1;
    for (int32_t c = 0; c < n; ++c) {
      if (c <= r) row += span_math::fixed_mass(in[c]);
      out[c] = above[c] + row;
    }
  }
}

double TriangleScores::mass(int32_t r0, int32_t r1, int32_t c0, int32_t c1) const {
  return span_math::mass(prefix_.data(), n_, r0, r1, c0, c1);
}

double TriangleScores::score(int32_t j, int32_t i) const {
  return span_math::triangle_score(prefix_.data(), n_, theta_, j, i);
}

double causal_quantile(std::span<const float> map, int32_t n, double quantile) {
  std::vector<float> v;
  v.reserve(static_cast<size_t>(n) * static_cast<size_t>(n + 1) / 2);
  for (int32_t r = 0; r < n; ++r)
    for (int32_t c = 0; c <= r; ++c) v.push_back(map[static_cast<size_t>(r) * static_cast<size_t>(n) + static_cast<size_t>(c)]);
  if (v.empty()) return 0;
  const auto k = static_cast<size_t>(span_math::quantile_rank(quantile, v.size()));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return static_cast<double>(v[k]);
}

double span_iou(const Span& a, const Span& b) {
  const double inter = std::max(0, std::min(a.end, b.end) - std::max(a.begin, b.begin));
  const double uni = static_cast<double>(a.length() + b.length()) - inter;
  return uni > 0 ? inter / uni : 0.0;
}

bool nms_ranks_before(const Span& a, const Span& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.begin != b.begin) return a.begin < b.begin;
  return a.end < b.end;
}

// The best-ranked remaining candidate is kept and every remaining one it suppresses dropped, until none remain: the
// spans of the rank-order scan (a candidate is kept iff no better-ranked kept span suppresses it: each round keeps
// the best candidate that the spans kept so far leave), without sorting the 2n - 1 candidates; each round's one pass
// drops what the new span suppresses and finds the next best. A chunk's few kept spans end it in a few passes (n =
// 1,024, the linear variant: 2,047 candidates, ~10 kept). On the GPU path's host work: stream_host_bench at 1M, chunk
// 1,024, plan() 1.74 -> 1.48 s on a 2-core machine (docs/PERF.md, "NMS without the sort").
std::vector<Span> nms(std::vector<Span> candidates, double iou) {
  std::vector<Span> kept;
  if (candidates.empty()) return kept;
  size_t best = static_cast<size_t>(
      std::min_element(candidates.begin(), candidates.end(), nms_ranks_before) - candidates.begin());
  while (true) {
    const Span k = candidates[best];
    kept.push_back(k);
    candidates[best] = candidates.back();  // the kept one out (by position: an equal duplicate stays, judged by IoU)
    candidates.pop_back();
    size_t w = 0;
    bool any = false;
    for (size_t i = 0; i < candidates.size(); ++i) {
      const Span c = candidates[i];
      // span_iou(c, k) > iou, its division skipped where the spans do not meet (their IoU is 0 then)
      const bool meet = std::min(c.end, k.end) > std::max(c.begin, k.begin);
      if (meet ? span_iou(c, k) > iou : 0.0 > iou) continue;
      candidates[w] = c;
      if (!any || nms_ranks_before(c, candidates[best])) best = w;
      any = true;
      ++w;
    }
    candidates.resize(w);
    if (!any) return kept;
  }
}

std::vector<Span> span_candidates(const TriangleScores& s, bool linear) {
  const int32_t n = s.size();
  std::vector<Span> out;
  if (linear) {
    for (int32_t d = 0; d <= 2 * (n - 1); ++d) {  // anti-diagonal j + i = d, j <= i
      Span best{0, 0, 0};
      bool any = false;
      for (int32_t j = std::max(0, d - (n - 1)); 2 * j <= d; ++j) {
        const int32_t i = d - j;
        const double v = s.score(j, i);
        if (v > 0 && (!any || v > best.score)) {
          best = Span{j, i + 1, v};
          any = true;
        }
      }
      if (any) out.push_back(best);
    }
  } else {
    for (int32_t j = 0; j < n; ++j)
      for (int32_t i = j; i < n; ++i) {
        const double v = s.score(j, i);
        if (v > 0) out.push_back(Span{j, i + 1, v});
      }
  }
  return out;
}

std::vector<Span> spans_from_candidates(std::vector<Span> candidates, double iou) {
  std::vector<Span> kept = nms(std::move(candidates), iou);
  std::sort(kept.begin(), kept.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  return kept;
}

std::vector<Span> discover_spans(std::span<const float> map, int32_t n, const SpanDiscoveryOptions& o) {
  if (n <= 0) return {};
  const TriangleScores scores(map, n, causal_quantile(map, n, o.theta_quantile));
  return spans_from_candidates(span_candidates(scores, o.linear), o.iou);
}

std::vector<Span> cover_with_spans(std::span<const Span> spans, int32_t n) {
  // Owner of each token: the highest-scoring span holding it (spans arrive in any order).
  std::vector<Span> by_score(spans.begin(), spans.end());
  std::stable_sort(by_score.begin(), by_score.end(), [](const Span& a, const Span& b) { return a.score > b.score; });
  std::vector<int32_t> owner(static_cast<size_t>(std::max(n, 0)), -1);
  for (size_t s = 0; s < by_score.size(); ++s)
    for (int32_t t = std::max(0, by_score[s].begin); t < std::min(n, by_score[s].end); ++t)
      if (owner[static_cast<size_t>(t)] < 0) owner[static_cast<size_t>(t)] = static_cast<int32_t>(s);
  std::vector<Span> out;
  for (int32_t t = 0; t < n;) {
    int32_t u = t + 1;
    while (u < n && owner[static_cast<size_t>(u)] == owner[static_cast<size_t>(t)]) ++u;
    const int32_t o = owner[static_cast<size_t>(t)];
    out.push_back(Span{t, u, o < 0 ? 0.0 : by_score[static_cast<size_t>(o)].score});
    t = u;
  }
  return out;
}

}  // namespace tessera::runtime::stream
