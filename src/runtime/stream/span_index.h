// tessera/runtime/stream/span_index.h — the index over evicted blocks, and retrieval per chunk.
//
// Ltri-LLM (dynamic span index vectors): a span of length L whose area ratio is r keeps
//     count = clamp(round(L * r^lambda), min_vectors, max_vectors)  (and at most L)
// index vectors: the keys (before RoPE, every kv head) of its `count` most attended tokens (votes: the attention
// a token received within its chunk). r = the span's triangle mass / (its triangle mass + the mass of its row
// neighbours, the later rows of the chunk attending to it) — in [0, 1], high when later tokens say little about
// the span (few or unconvinced voters: keep more vectors). The paper's Eq. 7 did not survive extraction; r^lambda
// is our reading of "a larger lambda restricts more" on r in [0, 1].
//
// Retrieval for a chunk: the chunk is split into spans the same way; each query span t keeps query vectors (the
// queries, before RoPE, of its most attended tokens). With a set of voting heads H (weights w_h):
//     sim(t, s)   = sum_h w_h * mean_{a in t} max_{b in s} q_h(a) . k_{kv(h)}(b)
//     score(blk)  = sum_t max_{s in blk} sim(t, s)
// and the top-K blocks are retrieved (ties: the earlier block).
//
// InfLLM (representative keys): a block keeps the keys of its `repr_keys` most attended tokens;
//     score(blk)  = sum_h w_h * mean_i q_h(i) . mean_r k_{kv(h)}(r)
// over the chunk's queries i.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/stream/span_discovery.h"

namespace tessera::runtime::stream {

// Shapes of the vectors: keys are [kv_heads, head_dim] per token, queries [q_heads, head_dim].
struct HeadShape {
  int32_t q_heads = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t kv_head(int32_t q_head) const { return q_head / (q_heads / kv_heads); }
};

// round(L * r^lambda) clamped to [min_vectors, max_vectors] and to [1, L].
int32_t retained_vectors(int32_t length, double ratio, double lambda, int32_t min_vectors, int32_t max_vectors);

// The masses r is made of: the span's triangle (rows and columns [begin, end)) and its row neighbours (rows
// [end, n), columns [begin, end)); the device computes them from its own prefix sums (stream_decide.h), equal.
struct SpanMasses {
  double tri = 0, below = 0;
  bool operator==(const SpanMasses&) const = default;
};
SpanMasses span_masses(const TriangleScores& map, const Span& span);
// r = tri / (tri + below), 1 when both are 0.
double area_ratio(const SpanMasses& masses);
// The span's area ratio r (above) from the prefix sums of its chunk's map (only raw masses are read, not theta).
double area_ratio(const TriangleScores& map, const Span& span);

// The paper's per-layer choice of lambda for a target compression ratio (Sec. 3.3.2): "collect the values of r, calculate
// the probability of r across various ranges, calculate the expected number of index vectors for any given lambda
// through Eq. 7, and find the smallest lambda that meets the compression ratio (tokens / index vectors) for each
// layer". The table holds the spans a layer indexes (their lengths and area ratios, r in kBins ranges of [0, 1]);
// vectors() is the number of index vectors they would keep at slope lambda, each r counted at its range's upper
// edge — an upper bound, as a span's count never decreases with r — so the lambda found meets the ratio on the
// spans it was calibrated on. vectors() never increases with lambda; smallest_lambda() bisects on it.
class LambdaTable {
 public:
  static constexpr int32_t kBins = 256;
  // The search's cap (where no lambda meets the ratio): there every span whose r is below the last range keeps its
  // minimum ((255/256)^4096 < 1e-7); spans with r = 1 (no later rows voted for them) keep min(length, max) whatever
  // lambda is.
  static constexpr double kMaxLambda = 4096;
  void add(int32_t length, double ratio);
  int64_t tokens() const { return tokens_; }
  int64_t spans() const { return spans_; }
  // Index vectors the spans keep at `lambda`: sum of retained_vectors(length, upper edge of r's range, lambda, ...).
  int64_t vectors(double lambda, int32_t min_vectors, int32_t max_vectors) const;
  // The smallest lambda in (0, kMaxLambda] with tokens() >= ratio * vectors(lambda) (to 1e-6; kMaxLambda when even
  // that one misses: too many spans, or too many with r = 1, for the ratio). Throws tessera::Error on a ratio
  // below 1: "--stream-index-ratio must be at least 1 (evicted tokens per index vector), got 0.5".
  double smallest_lambda(double ratio, int32_t min_vectors, int32_t max_vectors) const;
  void clear();

 private:
  std::vector<int64_t> counts_;  // spans per cell length * kBins + range
  std::vector<int64_t> used_;    // the cells with spans
  int64_t tokens_ = 0, spans_ = 0;
};

// The check of a target ratio (above); the same message.
void check_index_ratio(double ratio);

// Indices (within `votes`) of the `count` largest votes in [begin, end), ascending (ties: the earlier token).
std::vector<int32_t> top_voted(std::span<const float> votes, int32_t begin, int32_t end, int32_t count);

// Head weights: w[h] for every query head (0: the head does not vote).
using HeadWeights = std::vector<double>;

// The index of one layer: spans with their vectors, grouped by block.
class SpanIndex {
 public:
  // Keeps the kv heads [head_begin, head_begin + heads) of every vector (heads < 0: all of them). Ltri with retrieval
  // heads keeps only the kv head its voting head reads (or none: a layer whose scores collaborative voting replaces);
  // scoring a head whose kv head is not kept throws.
  explicit SpanIndex(HeadShape shape = {}, int32_t head_begin = 0, int32_t heads = -1)
      : shape_(shape), head_begin_(head_begin), heads_(heads < 0 ? shape.kv_heads : heads) {}
  int32_t kv_head_begin() const { return head_begin_; }
  int32_t kv_heads_kept() const { return heads_; }
  // Floats per stored vector: kv_heads_kept() * head_dim.
  int64_t row() const { return static_cast<int64_t>(heads_) * shape_.head_dim; }
  // Adds a span of `block` with the given key vectors ([count, kv_heads_kept(), head_dim], contiguous: the kept heads
  // of each key).
  void add(int32_t block, std::span<const float> keys, int32_t count);
  // Adds a span of `count` vectors whose keys are held elsewhere (the GPU path's device mirror,
  // runtime/cuda/stream_decide.h: gathered there in the same order); an index holds all its keys or none.
  void add_counted(int32_t block, int32_t count);
  bool holds_keys() const { return static_cast<int64_t>(keys_.size()) == vectors_ * row(); }
  int32_t num_blocks() const { return static_cast<int32_t>(block_spans_.size()); }
  int64_t num_spans() const { return static_cast<int64_t>(span_first_.size()); }
  int64_t num_vectors() const { return vectors_; }
  int64_t bytes() const { return vectors_ * row() * static_cast<int64_t>(sizeof(float)); }  // wherever they are held
  int64_t head_vectors() const { return vectors_ * heads_; }  // one per stored token and kept kv head
  // Ltri block scores for query spans: queries [m, q_heads, head_dim] of all query spans, spans given by
  // `query_counts` (the vectors of span t are the next query_counts[t] rows). One score per block.
  std::vector<double> block_scores(std::span<const float> queries, std::span<const int32_t> query_counts,
                                   const HeadWeights& w) const;
  void clear();
  // The stored vectors and their grouping, for a device mirror (runtime/cuda/stream_decide.h): keys [vectors,
  // kv_heads_kept(), head_dim]; span s holds vectors [span_first()[s], + span_count()[s]); a block's spans are consecutive.
  std::span<const float> keys() const { return keys_; }
  std::span<const int64_t> span_first() const { return span_first_; }
  std::span<const int64_t> span_count() const { return span_count_; }
  std::span<const int64_t> block_spans(int32_t block) const { return block_spans_[static_cast<size_t>(block)]; }

 private:
  HeadShape shape_;
  int32_t head_begin_ = 0, heads_ = 0;            // the kv heads kept
  std::vector<float> keys_;                       // [vectors, heads_, head_dim] (empty: held elsewhere)
  int64_t vectors_ = 0;
  std::vector<int64_t> span_first_, span_count_;  // per span: first vector, count
  std::vector<std::vector<int64_t>> block_spans_;  // per block: its spans
};

// InfLLM's index of one layer: repr_keys representative keys per block.
class ReprIndex {
 public:
  explicit ReprIndex(HeadShape shape = {}) : shape_(shape) {}
  // Adds the next block's representative keys ([count, kv_heads, head_dim]).
  void add(std::span<const float> keys, int32_t count);
  int32_t num_blocks() const { return static_cast<int32_t>(means_.size()); }
  int64_t num_vectors() const { return vectors_; }
  int64_t bytes() const { return vectors_ * static_cast<int64_t>(shape_.kv_heads) * shape_.head_dim * 4; }
  // Scores of every block for queries [n, q_heads, head_dim] (the mean query, then span_math::repr_score per block).
  std::vector<double> block_scores(std::span<const float> queries, int32_t n, const HeadWeights& w) const;
  // Block b's mean representative key [kv_heads, head_dim] (a device mirror: runtime/cuda/stream_decide.h).
  std::span<const float> mean(int32_t block) const { return means_[static_cast<size_t>(block)]; }
  void clear();

 private:
  HeadShape shape_;
  std::vector<std::vector<float>> means_;  // per block: the mean representative key, [kv_heads, head_dim]
  int64_t vectors_ = 0;
};

// The top `k` blocks by score, ascending block order (ties in score: the earlier block). All blocks when k >= count.
std::vector<int32_t> top_blocks(std::span<const double> scores, int32_t k);

}  // namespace tessera::runtime::stream
