// tessera/attention/pattern/pattern.h — the sparse attention patterns one head can run.
//
// A pattern is a small value type. It says *which* (query, key) cells a head attends to; the index layer
// (attention/index) lowers it to the range+column index that executors run. The precise mask of every pattern
// is defined in docs/patterns.md and implemented cell by cell in attention/index/pattern_mask.h; windows and
// blocks are defined per query tile (the index's tile height), exactly as block-sparse kernels compute them.
//
// Positions: a prefill call covers queries at absolute positions [q_begin, q_begin + q_len) and keys [0, kv_len);
// key j is visible to query p only if j <= p (causal). N ("total_len") is the length of the whole prompt.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <variant>

namespace tessera::attn {

// Full causal attention.
struct DensePattern {
  bool operator==(const DensePattern&) const = default;
};

// A-shape / StreamingLLM: the first `sink` keys plus a local window of `local` keys (local >= 1: every query
// sees at least itself). MInference default (1024, 4096).
struct AShapePattern {
  int32_t sink = 1024;
  int32_t local = 4096;
  bool operator==(const AShapePattern&) const = default;
};

// MoA elastic sliding window: span = alpha + beta * N, clipped to [0, N], plus an unmasked sink.
// The effective local window is max(1, span).
struct ElasticWindowPattern {
  double alpha = 0.0;
  double beta = 0.5;
  int32_t sink = 64;
  int64_t span(int64_t total_len) const;  // clipped to [0, total_len]
  bool operator==(const ElasticWindowPattern&) const = default;
};

// TriangleMix's triangle: streaming (sink + local) plus the last `last` query rows of the prompt computed densely.
struct TrianglePattern {
  int32_t sink = 8;
  int32_t local = 512;
  int32_t last = 128;
  bool operator==(const TrianglePattern&) const = default;
};

// MInference vertical-slash: top-`vertical` key columns and top-`slash` diagonals estimated from the last
// `last_q` queries. As in the reference implementation, the first `forced_columns` columns and the
// `forced_diagonals` diagonals nearest the main one are always chosen (they count against the budgets, and are
// capped by them: vertical = 0 means no columns at all).
//
// Adaptive budgets (gamma > 0; FlexPrefill's coverage gamma): per head and prompt the estimator keeps the
// smallest set of columns (and, separately, of diagonals) whose estimated attention mass reaches gamma of the
// total, with `vertical` / `slash` as the maxima and `min_vertical` / `min_slash` as the minima. Mass: A as
// above (softmax over the causal keys of each of the last `last_q` rows), a column's mass its column sum of A,
// a diagonal's its diagonal sum, each divided by the sum over all columns (diagonals): verticals and slashes
// each cover gamma of their own marginal, as FlexPrefill's vertical-slash search does. The forced columns and
// diagonals are always in and lead the order (their mass counts); the rest follow by mass, descending, ties to
// the smaller index; the count is the shortest such prefix whose mass is >= gamma (gamma = 1: all), clamped to
// [max(min, forced), max] (docs/patterns.md, "Adaptive budgets"). gamma = 0: the fixed budgets above.
struct VerticalSlashPattern {
  int32_t vertical = 1000;
  int32_t slash = 6096;
  int32_t last_q = 64;
  int32_t forced_columns = 30;
  int32_t forced_diagonals = 100;
  double gamma = 0.0;  // 0: fixed budgets; (0, 1]: adaptive, vertical / slash are the maxima
  int32_t min_vertical = 0;
  int32_t min_slash = 0;
  bool adaptive() const { return gamma > 0.0; }
  bool operator==(const VerticalSlashPattern&) const = default;
};

// MInference block-sparse: mean-pool Q and K over `block`-token blocks, keep the top-`top_k` causal key blocks
// per query block.
// Adaptive budgets (gamma > 0; XAttention's per-row threshold): per query block qb, the mass of key block kb is
// softmax over the causal blocks [0, qb] of the pooled scores (the diagonal block included); the diagonal block
// is always kept (it leads the order, its mass counts), then blocks by mass, descending, ties to the smaller
// block, until the kept mass is >= gamma (gamma = 1: all), the count clamped to [min_top_k, top_k] and to
// qb + 1. Per row rather than FlexPrefill's one threshold over the flattened map, so that every query block
// keeps gamma of its own estimated attention.
struct BlockSparsePattern {
  int32_t top_k = 100;
  int32_t block = 64;
  double gamma = 0.0;  // 0: fixed top_k; (0, 1]: adaptive, top_k is the maximum
  int32_t min_top_k = 1;
  bool adaptive() const { return gamma > 0.0; }
  bool operator==(const BlockSparsePattern&) const = default;
};

using Pattern = std::variant<DensePattern, AShapePattern, ElasticWindowPattern, TrianglePattern,
                             VerticalSlashPattern, BlockSparsePattern>;

// Stable names used in config files and tables: "dense", "ashape", "moa_window", "triangle",
// "vertical_slash", "block_sparse".
std::string_view pattern_name(const Pattern& p);
// Dynamic patterns need an online estimate (attention/index/estimate.h) before lowering.
bool is_dynamic(const Pattern& p);
// Every pattern of the list is dense (a layer that needs no index); true for an empty list.
bool all_dense(std::span<const Pattern> patterns);
// One-line human description with parameters, e.g. "vertical_slash(v=1000, s=6096)".
std::string describe(const Pattern& p);
// Throws tessera::Error("<where>: field '<name>' must be ..., got ...") for out-of-range parameters. `namer`, when
// given, says how a field is called where the value came from ("vertical" -> "parameter 'v'" for a --attn preset):
// the message then reads "<where>: parameter 'v' must be >= 0, got -5".
using FieldNamer = std::function<std::string(const char* field)>;
void validate(const Pattern& p, const std::string& where, const FieldNamer& namer = {});

}  // namespace tessera::attn
