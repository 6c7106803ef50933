// tessera/runtime/stream/span_discovery.h — Ltri-LLM's semantic spans: triangles of the attention map, found by NMS.
//
// The arithmetic (prefix sums, masses, scores, the quantile's rank) is span_math.h's, shared with the device
// kernels (runtime/cuda/stream_decide.cu), which find the same theta and candidates on the device.
//
// Input: A, the attention map of n consecutive tokens summed over heads, [n, n] row-major; row r holds what token r
// gives to tokens c <= r (entries above the diagonal are ignored). For a span [j, i] (j <= i) the triangle score is
//     TA(j, i) = sum over r in [j, i], c in [j, r] of (A[r][c] - theta)
// — the mass of the triangle with rows and columns j..i, less theta per cell — computed in O(1) from 2-D prefix
// sums of A (entries above the diagonal count as 0, so the square j..i x j..i holds exactly the triangle). Theta is a
// quantile of A's causal entries (the 90th percentile by default), so a triangle scores above 0 only where its
// tokens attend to each other more than to most.
//
// Every (j, i) with TA > 0 is a 1-D box [j, i + 1) with that score; greedy non-maximum suppression (highest score
// first; a box is dropped when its IoU with a kept box exceeds tau) leaves the spans. The linear variant (Appendix E)
// first keeps only the best point of each anti-diagonal j + i = const (the midpoint of a span), so NMS sees at most
// 2n - 1 boxes instead of n^2 / 2.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tessera::runtime::stream {

struct Span {
  int32_t begin = 0;  // tokens [begin, end), relative to the map's first token
  int32_t end = 0;
  double score = 0;
  int32_t length() const { return end - begin; }
  bool operator==(const Span&) const = default;
};

// 2-D prefix sums of a causal map (fixed point: span_math.h): O(1) triangle and rectangle masses.
class TriangleScores {
 public:
  // `map` is [n, n] row-major (entries above the diagonal ignored); theta is subtracted per causal cell.
  TriangleScores(std::span<const float> map, int32_t n, double theta);
  int32_t size() const { return n_; }
  double theta() const { return theta_; }
  // Mass of the causal cells in rows [r0, r1) x columns [c0, c1) (raw A, no theta).
  double mass(int32_t r0, int32_t r1, int32_t c0, int32_t c1) const;
  // TA(j, i) for j <= i (inclusive bounds).
  double score(int32_t j, int32_t i) const;

 private:
  int32_t n_ = 0;
  double theta_ = 0;
  std::vector<uint64_t> prefix_;  // (n + 1) x (n + 1) fixed point (span_math.h): sum of A over rows < r, columns < c, c' <= r'
};

// The `quantile` (in [0, 1]) of the map's causal entries (j <= i): the nearest-rank value at floor(q * (m - 1)) of
// the m sorted entries.
double causal_quantile(std::span<const float> map, int32_t n, double quantile);

// Intersection over union of [a.begin, a.end) and [b.begin, b.end).
double span_iou(const Span& a, const Span& b);

// Greedy NMS: candidates by score (descending; ties: earlier begin, then earlier end: nms_ranks_before), each kept
// unless its IoU with a kept span exceeds `iou`. Returns the kept spans in that order.
bool nms_ranks_before(const Span& a, const Span& b);
std::vector<Span> nms(std::vector<Span> candidates, double iou);

struct SpanDiscoveryOptions {
  double theta_quantile = 0.9;
  double iou = 0.1;
  bool linear = true;  // best point per anti-diagonal before NMS
};

// The candidates NMS sees: every (j, i) with TA > 0, or (linear) the best of them on each anti-diagonal (ties:
// the smaller j).
std::vector<Span> span_candidates(const TriangleScores& scores, bool linear);

// The host part of span discovery on given candidates (span_candidates()'s, or the device's: stream_decide.h):
// NMS, then sorted by begin.
std::vector<Span> spans_from_candidates(std::vector<Span> candidates, double iou);

// Candidates, then NMS; returned sorted by begin.
std::vector<Span> discover_spans(std::span<const float> map, int32_t n, const SpanDiscoveryOptions& options);

// Spans that cover [0, n) exactly: the discovered spans, each clipped where it overlaps an earlier-kept (higher
// scoring) one, and every gap left between them as a span of its own (score 0). Sorted by begin, disjoint, covering.
std::vector<Span> cover_with_spans(std::span<const Span> spans, int32_t n);

}  // namespace tessera::runtime::stream
