#include "runtime/stream/streaming_kv.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/format.h"
#include "core/memory_budget.h"
#include "attention/attention_args.h"
#include "attention/cpu/dense_attention.h"
#include "runtime/rope.h"

namespace tessera::runtime {

namespace {

// Blocks evicted from every layer once a chunk starts at `pos`.
int32_t evicted_at(const StreamOptions& o, int64_t pos) {
  const int64_t over = pos - o.sinks - o.local;
  return over >= o.block ? static_cast<int32_t>(over / o.block) : 0;
}

// Row-wise rotation of `rows` rows of `heads` head vectors by table rows [first, first + rows).
void rotate(float* x, int64_t rows, int64_t heads, int64_t d, const float* cos, const float* sin, int64_t first) {
  apply_rope(x, rows, heads * d, heads, d, cos + first * (d / 2), sin + first * (d / 2));
}

}  // namespace

void check_model_streams(const ModelConfig& cfg, bool gpu) {
  if (!gpu) return;  // the CPU streams every model: sliding-window layers keep their own window
  // The GPU path attends through the CUDA sparse executor (sliding-window layers too: their window, row-exact).
  // (Not checked by StreamingKV itself: its Storage::Device decisions also run on the CPU fixtures' head dims.)
  const int32_t d = cfg.head_dim;
  if (d != 64 && d != 128 && d != 256)
    throw Error("model " + cfg.name + " cannot stream on the GPU: its head_dim " + std::to_string(d) +
                " is not one the CUDA sparse executor runs (64, 128 or 256); the CPU path streams it (--device cpu)");
}

StreamingKV::StreamingKV(const ModelConfig& config, StreamOptions options, Storage storage)
    : cfg_(config), opt_(std::move(options)), storage_(storage) {
  check_stream_options(opt_);
  check(opt_.method != StreamMethod::None, "streaming: no method (ltri, infllm or streamingllm)");
  for (const LayerConfig& l : cfg_.layers) global_layers_ += l.sliding_window > 0 ? 0 : 1;
  shape_ = {cfg_.num_q_heads, cfg_.num_kv_heads, cfg_.head_dim};
  row_ = static_cast<int64_t>(cfg_.num_kv_heads) * cfg_.head_dim;
  layers_.resize(static_cast<size_t>(cfg_.num_layers));
  for (Layer& l : layers_) l.repr_index = stream::ReprIndex(shape_);
  const int64_t budget = opt_.host_budget > 0 ? opt_.host_budget : host_memory_budget().bytes;
  store_ = stream::HostBlockStore(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, opt_.block, budget,
                                  storage_ == Storage::Host ? 4 : opt_.host_fp8 ? 1 : 2);
  best_head_.assign(static_cast<size_t>(cfg_.num_layers), -1);
  best_score_.assign(static_cast<size_t>(cfg_.num_layers), 0.0);
  for (const RetrievalHead& h : opt_.retrieval_heads) {
    check(h.layer >= 0 && h.layer < cfg_.num_layers && h.head >= 0 && h.head < cfg_.num_q_heads, [&] {
      return "retrieval head (layer " + std::to_string(h.layer) + ", head " + std::to_string(h.head) +
             ") is outside model " + cfg_.name + " (" + std::to_string(cfg_.num_layers) + " layers x " +
             std::to_string(cfg_.num_q_heads) + " query heads)";
    });
    const auto l = static_cast<size_t>(h.layer);
    if (h.score > 0.1 && h.score > best_score_[l]) {
      best_head_[l] = h.head;
      best_score_[l] = h.score;
    }
  }
  // The kv heads each layer's span index keeps (StreamOptions::index_all_heads): with retrieval heads, a voting layer
  // reads its head's kv head only, a layer after the first voting one is never scored (voted_only()), the layers
  // before it score with every head.
  for (int32_t l = 0; l < cfg_.num_layers; ++l)
    if (best_head_[static_cast<size_t>(l)] >= 0 && !windowed(l)) {
      first_voter_ = l;
      break;
    }
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    int32_t begin = 0, heads = -1;  // all
    if (opt_.method == StreamMethod::Ltri && !opt_.index_all_heads && first_voter_ >= 0 &&
        (l >= first_voter_ || early_voted(l))) {
      const int32_t best = best_head_[static_cast<size_t>(l)];
      if (best >= 0)
        begin = shape_.kv_head(best), heads = 1;
      else
        heads = 0;
    }
    layers_[static_cast<size_t>(l)].span_index = stream::SpanIndex(shape_, begin, heads);
  }
}

bool StreamingKV::voted_only(int32_t layer) const {
  return early_voted(layer) || (opt_.method == StreamMethod::Ltri && !opt_.index_all_heads && first_voter_ >= 0 &&
                                layer > first_voter_ && best_head_[static_cast<size_t>(layer)] < 0);
}

int32_t StreamingKV::map_head(int32_t layer) const {
  return opt_.method == StreamMethod::Ltri && opt_.map_retrieval_head ? best_head_[static_cast<size_t>(layer)] : -1;
}

bool StreamingKV::early_voted(int32_t layer) const {
  return opt_.method == StreamMethod::Ltri && opt_.early_from_votes && first_voter_ >= 0 && layer < first_voter_;
}

void StreamingKV::check_sequence(int64_t tokens) const {
  if (!keeps_evicted()) return;  // streamingllm drops its evicted blocks: no host memory, no limit
  const int64_t blocks = evicted_at(opt_, tokens);
  const double need = static_cast<double>(blocks) * global_layers_ * static_cast<double>(store_.block_bytes());
  const std::string layers = global_layers_ == cfg_.num_layers
                                 ? std::to_string(cfg_.num_layers) + " layers"
                                 : std::to_string(global_layers_) + (global_layers_ == 1 ? " global layer" : " global layers") +
                                       " of " + std::to_string(cfg_.num_layers);
  if (need > static_cast<double>(store_.budget()))
    throw Error("streaming: a sequence of " + with_commas(tokens) + " tokens evicts " + with_commas(blocks) + " blocks of " +
                std::to_string(opt_.block) + " tokens per layer, whose K and V need " + format_bytes(need) +
                 " of host memory (" + layers + "), over the budget of " +
                format_bytes(static_cast<double>(store_.budget())) +
                " for evicted KV blocks; raise --stream-host-budget or shorten the prompt");
}

void StreamingKV::reset() {
  for (Layer& l : layers_) {
    l.sink_count = l.recent_count = 0;
    l.sink_k.clear();
    l.sink_v.clear();
    l.recent_k.clear();
    l.recent_v.clear();
    l.recent_skip = 0;
    l.votes.clear();
    l.spans.clear();
    l.span_index.clear();
    l.repr_index.clear();
    l.retrieved.clear();
    l.persisted.clear();
    l.normalized_scores.clear();
    l.layout = {};
    l.lambda_table.clear();
    l.lambda = 0;
    l.measured_mass = 0;
    l.measured_tokens = 0;
    l.win_count = 0;
    l.win_k.clear();
    l.win_v.clear();
  }
  store_.clear();
  length_ = evicted_ = prev_evicted_ = 0;
  max_workspace_ = 0;
  retrieval_seconds_ = 0;
}

void StreamingKV::begin_chunk(int32_t pos, int32_t n, ChunkKind kind) {
  check(pos == length_, [&] {
    return "streaming: a chunk at position " + std::to_string(pos) + " after " + std::to_string(length_) +
           " tokens (chunks must follow one another)";
  });
  check(n > 0, "streaming: empty chunk");
  prev_evicted_ = evicted_;
  evicted_ = std::max(evicted_, evicted_at(opt_, pos));
  kind_ = kind;
  ++chunk_serial_;
}

bool StreamingKV::collect_votes(int32_t end, size_t blocks) {
  if (vote_chunk_ != chunk_serial_ || vote_sum_.size() != blocks || vote_through_ > end) {
    vote_chunk_ = chunk_serial_;
    vote_sum_.assign(blocks, 0.0);
    vote_through_ = 0;
    vote_any_ = false;
    ++vote_version_;
  }
  for (; vote_through_ < end; ++vote_through_) {
    const auto l = static_cast<size_t>(vote_through_);
    const Layer& V = layers_[l];
    if (best_head_[l] < 0 || V.normalized_scores.size() != blocks) continue;
    vote_any_ = true;
    const double w = best_score_[l];
    for (size_t b = 0; b < blocks; ++b) vote_sum_[b] += w * V.normalized_scores[b];
    ++vote_version_;
  }
  return vote_any_;
}

const std::vector<int32_t>& StreamingKV::vote_top_blocks() {
  if (vote_top_version_ != vote_version_) {
    vote_top_ = stream::top_blocks(vote_sum_, opt_.top_k);
    vote_top_version_ = vote_version_;
  }
  return vote_top_;
}

std::vector<int32_t> StreamingKV::previous_vote_blocks() {
  if (prev_vote_chunk_ == chunk_serial_) return prev_vote_blocks_;
  prev_vote_chunk_ = chunk_serial_;
  // The voting layers have not run yet in this chunk: their normalised scores are the previous chunk's.
  std::vector<double> sum;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<double>& s = layers_[l].normalized_scores;
    if (best_head_[l] < 0 || s.empty()) continue;
    if (sum.size() < s.size()) sum.resize(s.size(), 0.0);
    for (size_t b = 0; b < s.size(); ++b) sum[b] += best_score_[l] * s[b];
  }
  const auto blocks = static_cast<size_t>(evicted_);
  if (sum.empty()) {
    prev_vote_blocks_.resize(static_cast<size_t>(opt_.top_k));
    std::iota(prev_vote_blocks_.begin(), prev_vote_blocks_.end(), evicted_ - opt_.top_k);
  } else {
    sum.resize(blocks, 0.0);
    prev_vote_blocks_ = stream::top_blocks(sum, opt_.top_k);
  }
  return prev_vote_blocks_;
}

stream::HeadWeights StreamingKV::head_weights(int32_t layer) const {
  stream::HeadWeights w(static_cast<size_t>(cfg_.num_q_heads), 0.0);
  const int32_t best = best_head_[static_cast<size_t>(layer)];
  if (best >= 0)
    w[static_cast<size_t>(best)] = 1.0;
  else
    std::fill(w.begin(), w.end(), 1.0 / cfg_.num_q_heads);
  return w;
}

void StreamingKV::evict(int32_t layer, int32_t b, int32_t first, std::vector<PendingVectors>& pending) {
  Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t B = opt_.block, s0 = opt_.sinks + b * B;
  const auto rows = static_cast<size_t>(B * row_);
  const int64_t at_row = (L.recent_skip + first) * row_;
  check(L.recent_count >= first + B,
        [&] { return "streaming: block " + std::to_string(b) + " is not in the local window"; });
  if (!keeps_evicted())
    ;  // streamingllm never retrieves a block: dropped
  else if (storage_ == Storage::Host)
    store_.add(layer, std::span<const float>(L.recent_k.data() + at_row, rows),
               std::span<const float>(L.recent_v.data() + at_row, rows));
  else
    store_.account(layer);  // the rows go to the GPU path's pinned store
  const std::span<const float> votes(L.votes.data() + first, static_cast<size_t>(B));
  auto add = [&](const std::vector<int32_t>& tokens, int32_t count) {  // block-relative tokens
    PendingVectors p{b, count, {}};
    for (int32_t t : tokens) p.positions.push_back(s0 + t);
    pending.push_back(std::move(p));
  };
  if (opt_.method == StreamMethod::Ltri) {
    // The block's pieces: its spans clipped to it, and the tokens no span covers (decoded ones) as spans of their own.
    struct Piece {
      int32_t begin, end;  // block-relative
      double ratio;
    };
    std::vector<Piece> pieces;
    int32_t at = 0;  // block-relative: the first token not yet in a piece
    for (const PendingSpan& s : L.spans) {
      const int32_t a = std::max(s.begin - s0, at), e = std::min(s.end - s0, B);
      if (e <= a) continue;
      if (a > at) pieces.push_back({at, a, kUnmeasured});
      pieces.push_back({a, e, s.ratio});
      at = e;
    }
    if (at < B) pieces.push_back({at, B, kUnmeasured});
    std::erase_if(L.spans, [&](const PendingSpan& s) { return s.end <= s0 + B; });
    if (opt_.index_ratio > 0) {
      for (const Piece& p : pieces)
        if (p.ratio != kUnmeasured) {
          L.measured_mass += p.ratio * (p.end - p.begin);
          L.measured_tokens += p.end - p.begin;
        }
      const double mean = L.measured_tokens > 0 ? L.measured_mass / static_cast<double>(L.measured_tokens) : 1.0;
      for (Piece& p : pieces)
        if (p.ratio == kUnmeasured) p.ratio = mean;
      // The paper's lookup: the smallest lambda that meets the ratio on every piece this layer has indexed.
      for (const Piece& p : pieces) L.lambda_table.add(p.end - p.begin, p.ratio);
      L.lambda = L.lambda_table.smallest_lambda(opt_.index_ratio, opt_.min_vectors, opt_.max_vectors);
    } else {
      for (Piece& p : pieces)
        if (p.ratio == kUnmeasured) p.ratio = 1.0;
    }
    const double lam = lambda(layer);
    if (!voted_only(layer))  // (a layer never scored indexes nothing)
      for (const Piece& p : pieces) {
        const int32_t count = stream::retained_vectors(p.end - p.begin, p.ratio, lam, opt_.min_vectors, opt_.max_vectors);
        add(stream::top_voted(votes, p.begin, p.end, count), count);
      }
  } else if (opt_.method == StreamMethod::InfLLM) {
    const std::vector<int32_t> tokens = stream::top_voted(votes, 0, B, std::min(opt_.repr_keys, B));
    add(tokens, static_cast<int32_t>(tokens.size()));
  }
}

void StreamingKV::index_keys(int32_t layer, const std::vector<PendingVectors>& pending) {
  if (pending.empty()) return;
  Layer& L = layers_[static_cast<size_t>(layer)];
  std::vector<int32_t> positions;
  for (const PendingVectors& p : pending) positions.insert(positions.end(), p.positions.begin(), p.positions.end());
  std::vector<float> keys;
  if (given_ != nullptr && given_->index_keys) {
    keys = given_->index_keys(positions);
    if (opt_.method == StreamMethod::Ltri && given_->keys_on_device) {
      check(keys.empty(), "streaming: the device returned index keys it was to keep");
      for (const PendingVectors& p : pending) L.span_index.add_counted(p.block, p.count);
      return;
    }
    check(keys.size() == positions.size() * static_cast<size_t>(row_), [&] {
      return "streaming: the device's index keys have " + std::to_string(keys.size()) + " values for " +
             std::to_string(positions.size()) + " positions (" +
             std::to_string(positions.size() * static_cast<size_t>(row_)) + " expected)";
    });
  } else {
    // The recent rows start at the first block this chunk evicts (drop_front() runs after the index).
    const int32_t first = opt_.sinks + prev_evicted_ * opt_.block;
    keys.reserve(positions.size() * static_cast<size_t>(row_));
    for (int32_t p : positions) {
      const int64_t at = (L.recent_skip + p - first) * row_;
      check(p >= first && at + row_ <= static_cast<int64_t>(L.recent_k.size()), [&] {
        return "streaming: the key of position " + std::to_string(p) +
               " is not held (a sequence takes its index keys "
               "from the device from its first chunk on)";
      });
      keys.insert(keys.end(), L.recent_k.begin() + at, L.recent_k.begin() + at + row_);
    }
  }
  if (opt_.method == StreamMethod::Ltri && L.span_index.row() != row_) {
    // The kv heads the span index keeps, row by row (the same values: the kept heads' scores are unchanged).
    const int64_t kept = L.span_index.row(), first = static_cast<int64_t>(L.span_index.kv_head_begin()) * cfg_.head_dim;
    for (size_t r = 0; r < positions.size(); ++r)
      std::copy_n(keys.begin() + static_cast<std::ptrdiff_t>(static_cast<int64_t>(r) * row_ + first), kept,
                  keys.begin() + static_cast<std::ptrdiff_t>(static_cast<int64_t>(r) * kept));
    keys.resize(positions.size() * static_cast<size_t>(kept));
  }
  const int64_t row = opt_.method == StreamMethod::Ltri ? L.span_index.row() : row_;
  size_t at = 0;
  for (const PendingVectors& p : pending) {
    const std::span<const float> k(keys.data() + at, p.positions.size() * static_cast<size_t>(row));
    at += k.size();
    if (opt_.method == StreamMethod::Ltri)
      L.span_index.add(p.block, k, p.count);
    else
      L.repr_index.add(k, p.count);
  }
}

void StreamingKV::drop_front(int32_t layer, int32_t tokens) {
  Layer& L = layers_[static_cast<size_t>(layer)];
  // The rows are erased in bulk once the dropped ones are as many as the kept ones (each kept row moves at most once
  // per row dropped, instead of every kept row on every drop: ~19 MB per layer and chunk at Llama-3-8B's sizes).
  L.recent_skip += tokens;
  L.votes.erase(L.votes.begin(), L.votes.begin() + tokens);
  L.recent_count -= tokens;
  if (L.recent_skip >= L.recent_count) {
    const auto rows = static_cast<std::ptrdiff_t>(L.recent_skip * row_);
    if (keeps_recent_k())
      L.recent_k.erase(L.recent_k.begin(), L.recent_k.begin() + std::min<std::ptrdiff_t>(
                                                                  rows, static_cast<std::ptrdiff_t>(L.recent_k.size())));
    if (storage_ == Storage::Host) L.recent_v.erase(L.recent_v.begin(), L.recent_v.begin() + rows);
    L.recent_skip = 0;
  }
}

namespace {

// out[b] = (x_b - min) / (max - min) for the finite x_b when max > min, else 0 (scores is not empty). Branch-free
// loops, not inlined: inside retrieve() the compiler kept min and max in memory (a store and a load per block).
[[gnu::noinline]] void normalize_scores(std::span<const double> scores, std::vector<double>& out) {
  double lo = scores.front(), hi = scores.front();
  for (const double x : scores) {
    lo = x < lo ? x : lo;
    hi = hi < x ? x : hi;
  }
  const double range = hi - lo;
  const bool spread = hi > lo;
  out.resize(scores.size());
  for (size_t b = 0; b < scores.size(); ++b) {
    const double x = scores[b], t = (x - lo) / range;
    out[b] = spread && std::isfinite(x) ? t : 0.0;
  }
}

}  // namespace

std::vector<int32_t> StreamingKV::retrieve(int32_t layer, const float* q_raw, int32_t n, std::span<const float> map,
                                           std::span<const stream::Span> spans) {
  Layer& L = layers_[static_cast<size_t>(layer)];
  L.normalized_scores.clear();
  if (opt_.method == StreamMethod::StreamingLLM || opt_.top_k == 0 || evicted_ == 0) return {};
  if (kind_ == ChunkKind::Decode && opt_.persist_decode && opt_.method == StreamMethod::Ltri && !L.persisted.empty())
    return L.persisted;
  if (evicted_ <= opt_.top_k) {
    std::vector<int32_t> all(static_cast<size_t>(evicted_));
    for (int32_t b = 0; b < evicted_; ++b) all[static_cast<size_t>(b)] = b;
    return all;
  }
  if (early_voted(layer)) return previous_vote_blocks();
  if (voted_only(layer)) {
    // Collaborative voting replaces this layer's scores (below): no query vectors, no scoring, no index.
    const bool any = collect_votes(layer, static_cast<size_t>(evicted_));
    check(any, [&] {
      return "streaming: layer " + std::to_string(layer) +
             " takes its blocks from the retrieval heads' votes, but "
             "no earlier layer voted in this chunk (layers run in order within a chunk)";
    });
    return vote_top_blocks();
  }
  const stream::HeadWeights w = head_weights(layer);
  std::vector<double> scores;
  if (opt_.method == StreamMethod::InfLLM) {
    if (given_ != nullptr)
      scores = given_->block_scores({}, {}, w);
    else
      scores = L.repr_index.block_scores(std::span<const float>(q_raw, static_cast<size_t>(n) * cfg_.num_q_heads * cfg_.head_dim), n, w);
  } else {
    // Query vectors: per chunk span, the raw queries of its most attended tokens.
    const double lam = lambda(layer);
    const int64_t qrow = static_cast<int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
    std::vector<float> queries;
    std::vector<int32_t> counts, tokens;
    check(chunk_area_.size() == spans.size(), "streaming: the chunk's spans have no area ratios");
    for (size_t i = 0; i < spans.size(); ++i) {
      const stream::Span& s = spans[i];
      const int32_t count = stream::retained_vectors(s.length(), chunk_area_[i], lam, opt_.min_vectors, opt_.max_vectors);
      for (int32_t t : stream::top_voted(chunk_votes_, s.begin, s.end, count)) {
        if (given_ != nullptr)
          tokens.push_back(t);
        else
          queries.insert(queries.end(), q_raw + t * qrow, q_raw + (t + 1) * qrow);
      }
      counts.push_back(count);
    }
    scores = given_ != nullptr ? given_->block_scores(tokens, counts, w) : L.span_index.block_scores(queries, counts, w);
  }
  check(given_ == nullptr || static_cast<int32_t>(scores.size()) == evicted_, [&] {
    return "streaming: the device's block scores have " + std::to_string(scores.size()) + " entries for " +
           std::to_string(evicted_) + " evicted blocks";
  });
  // Normalised to [0, 1] for collaborative voting.
  normalize_scores(scores, L.normalized_scores);
  // Collaborative voting: the layers up to this one that have a retrieval head vote, weighted by its score.
  if (opt_.method == StreamMethod::Ltri && collect_votes(layer + 1, scores.size())) return vote_top_blocks();
  return stream::top_blocks(scores, opt_.top_k);
}

void StreamingKV::prepare(int32_t layer, int32_t pos, int32_t n, const float* q, const float* k,
                          std::span<const float> inv_freq, float scale, ThreadPool* pool) {
  check(pos == length_ && layer >= 0 && layer < cfg_.num_layers, "streaming: attend() out of order");
  Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const int64_t qrow = static_cast<int64_t>(nq) * d;
  auto t0 = Clock::now();
  // Every block leaving the window is indexed and stored first, then the recent rows shift once (one move per chunk).
  std::vector<PendingVectors> pending;
  for (int32_t b = prev_evicted_; b < evicted_; ++b) evict(layer, b, (b - prev_evicted_) * opt_.block, pending);
  index_keys(layer, pending);
  if (evicted_ > prev_evicted_) drop_front(layer, (evicted_ - prev_evicted_) * opt_.block);
  if (given_ != nullptr && given_->ready) given_->ready();
  retrieval_seconds_ += seconds_since(t0);

  const bool maps = maps_chunk(layer);  // (a voted-only layer needs no map: no index, no query vectors)
  if (!maps) {
    map_.clear();
    chunk_votes_.clear();
  }
  local_begin_ = evicted_ > 0 ? opt_.sinks + evicted_ * opt_.block : 0;
  span_len_ = pos + n - local_begin_;
  const int64_t half = d / 2;
  const bool given_map = maps && given_ != nullptr;
  if (storage_ == Storage::Host || (maps && !given_map)) {
    check(q != nullptr && k != nullptr, "streaming: this chunk needs its queries and keys");
    // RoPE tables over the local part and the chunk: positions [local_begin, pos + n), and the global queries' one
    // (Storage::Device: the chunk's positions only; the device rotates the window and the global queries).
    const int32_t table_begin = storage_ == Storage::Host ? local_begin_ : pos;
    const int32_t table_rows = pos + n - table_begin;
    cos_.resize(static_cast<size_t>((table_rows + 1) * half));
    sin_.resize(cos_.size());
    rope_tables(inv_freq, table_begin, table_rows, cos_.data(), sin_.data());
    rope_tables(inv_freq, opt_.local, 1, cos_.data() + table_rows * half, sin_.data() + table_rows * half);
    // Queries at their true positions (local); the chunk's keys likewise.
    q_local_.assign(q, q + n * qrow);
    rotate(q_local_.data(), n, nq, d, cos_.data(), sin_.data(), pos - table_begin);
    k_rot_.assign(k, k + n * row_);
    rotate(k_rot_.data(), n, nkv, d, cos_.data(), sin_.data(), pos - table_begin);
  }

  // The chunk's attention map within itself (ltri, infllm): summed over heads, softmax over the chunk's causal keys.
  chunk_spans_.clear();
  chunk_ratios_.clear();
  chunk_area_.clear();
  t0 = Clock::now();
  if (given_map) {
    // The device's map (ltri) and votes.
    const size_t nn = static_cast<size_t>(n) * static_cast<size_t>(n);
    check(opt_.method != StreamMethod::Ltri || given_->has_candidates || given_->map.size() == nn, [&] {
      return "streaming: the device's attention map has " + std::to_string(given_->map.size()) +
             " entries for a chunk of " + std::to_string(n) + " tokens (" + std::to_string(nn) + " expected)";
    });
    check(given_->votes.size() == static_cast<size_t>(n), [&] {
      return "streaming: the device's votes have " + std::to_string(given_->votes.size()) +
             " entries for a chunk of " + std::to_string(n) + " tokens";
    });
    map_.assign(given_->map.begin(), given_->map.end());
    chunk_votes_.assign(given_->votes.begin(), given_->votes.end());
  } else if (maps) {
    // Per head: the softmax rows into its own buffer (heads in parallel), then summed in head order (the same sums
    // whatever the thread count).
    const size_t nn = static_cast<size_t>(n) * static_cast<size_t>(n);
    map_.assign(nn, 0.0f);
    // The heads [h0, h0 + heads) (map_head(): the retrieval head alone, or all).
    const int32_t one = map_head(layer), h0 = one >= 0 ? one : 0, heads = one >= 0 ? 1 : nq;
    head_maps_.resize(static_cast<size_t>(heads) * nn);
    const float sc = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(d));
    // The rotated q and k rounded to bf16, as the GPU's attention reads them and its map multiplies them
    // (stream_decide.h): the products exact in f32 on both sides.
    auto to_bf16 = [](const std::vector<float>& from, std::vector<float>& to) {
      to.resize(from.size());
      for (size_t i = 0; i < from.size(); ++i) to[i] = bf16_to_f32(f32_to_bf16(from[i]));
    };
    to_bf16(q_local_, q_map_);
    to_bf16(k_rot_, k_map_);
    auto head_map = [&](int64_t hh, int /*worker*/) {
      const auto h = h0 + static_cast<int32_t>(hh);
      const int32_t g = shape_.kv_head(h);
      float* sm = head_maps_.data() + static_cast<size_t>(hh) * nn;
      // Causal rows only: rows [r0, r1) against keys [0, r1) (the rest of those rows is never read).
      constexpr int32_t kRows = 64;
      for (int32_t r0 = 0; r0 < n; r0 += kRows) {
        const int32_t r1 = std::min(n, r0 + kRows);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, d, sc,
                    q_map_.data() + static_cast<int64_t>(r0) * qrow + static_cast<int64_t>(h) * d,
                    static_cast<int>(qrow), k_map_.data() + static_cast<int64_t>(g) * d, static_cast<int>(row_), 0.0f,
                    sm + static_cast<int64_t>(r0) * n, n);
      }
      for (int32_t r = 0; r < n; ++r) {
        float* sr = sm + static_cast<int64_t>(r) * n;
        const float m = *std::max_element(sr, sr + r + 1);
        float z = 0;
        for (int32_t c = 0; c <= r; ++c) {
          sr[c] = std::exp(sr[c] - m);
          z += sr[c];
        }
        const float inv = 1.0f / z;
        for (int32_t c = 0; c <= r; ++c) sr[c] *= inv;
      }
    };
    if (pool != nullptr && pool->size() > 1) {
      const int threads = openblas_get_num_threads();
      openblas_set_num_threads(1);  // one GEMM per head and thread
      pool->parallel_for(heads, head_map);
      openblas_set_num_threads(threads);
    } else {
      for (int32_t h = 0; h < heads; ++h) head_map(h, 0);
    }
    for (int32_t h = 0; h < heads; ++h) {
      const float* sm = head_maps_.data() + static_cast<size_t>(h) * nn;
      for (int32_t r = 0; r < n; ++r) {
        float* ar = map_.data() + static_cast<int64_t>(r) * n;
        const float* sr = sm + static_cast<int64_t>(r) * n;
        for (int32_t c = 0; c <= r; ++c) ar[c] += sr[c];
      }
    }
    // Votes: the attention each token received (column sums, rows in order).
    chunk_votes_.assign(static_cast<size_t>(n), 0.0f);
    for (int32_t r = 0; r < n; ++r)
      for (int32_t c = 0; c <= r; ++c) chunk_votes_[static_cast<size_t>(c)] += map_[static_cast<size_t>(r) * static_cast<size_t>(n) + static_cast<size_t>(c)];
  }
  if (maps && opt_.method == StreamMethod::Ltri) {
    std::vector<stream::SpanMasses> masses;
    if (given_map && given_->has_candidates) {
      // The device's candidates: NMS and the cover here, then the masses of the cover's spans from the device.
      for (const stream::Span& c : given_->candidates)
        check(c.begin >= 0 && c.begin < c.end && c.end <= n, [&] {
          return "streaming: the device's span candidate [" + std::to_string(c.begin) + ", " +
                 std::to_string(c.end) + ") lies outside a chunk of " + std::to_string(n) + " tokens";
        });
      std::vector<stream::Span> kept =
          stream::nms(std::vector<stream::Span>(given_->candidates.begin(), given_->candidates.end()), opt_.iou);
      chunk_spans_ = stream::cover_with_spans(kept, n);
      masses = given_->span_masses(chunk_spans_);
      check(masses.size() == chunk_spans_.size(), [&] {
        return "streaming: the device's span masses have " + std::to_string(masses.size()) + " entries for " +
               std::to_string(chunk_spans_.size()) + " spans";
      });
    } else {
      const stream::TriangleScores ts(map_, n, stream::causal_quantile(map_, n, opt_.theta_quantile));
      std::vector<stream::Span> kept = stream::nms(stream::span_candidates(ts, opt_.linear_nms), opt_.iou);
      chunk_spans_ = stream::cover_with_spans(kept, n);
      for (const stream::Span& sp : chunk_spans_) masses.push_back(stream::span_masses(ts, sp));
    }
    for (size_t i = 0; i < chunk_spans_.size(); ++i) {
      chunk_area_.push_back(stream::area_ratio(masses[i]));
      chunk_ratios_.push_back(chunk_spans_[i].end < n ? chunk_area_.back() : kUnmeasured);
    }
  }
  L.retrieved = retrieve(layer, q, n, map_, chunk_spans_);
  if (kind_ == ChunkKind::LastPrefill) L.persisted = L.retrieved;
  retrieval_seconds_ += seconds_since(t0);

  stream::StreamLayout lay;
  lay.global = evicted_ > 0 ? L.sink_count + static_cast<int32_t>(L.retrieved.size()) * opt_.block : 0;
  lay.local = evicted_ > 0 ? L.recent_count : L.sink_count + L.recent_count;
  lay.chunk = n;
  check(lay.local == pos - local_begin_, [&] {
    return "streaming: the local window holds " + std::to_string(lay.local) + " tokens, expected " +
           std::to_string(pos - local_begin_);
  });
  L.layout = lay;
  max_workspace_ = std::max<int64_t>(max_workspace_, lay.kv_len());
}

void StreamingKV::finish(int32_t layer, int32_t pos, int32_t n, const float* k, const float* v) {
  Layer& L = layers_[static_cast<size_t>(layer)];
  const bool maps = maps_chunk(layer);
  // Append the chunk (raw K, V) to the sinks and the local window, with its votes and spans.
  for (int32_t t = 0; t < n; ++t) {
    const int32_t p = pos + t;
    const bool sink = p < opt_.sinks;
    ++(sink ? L.sink_count : L.recent_count);
    if (storage_ == Storage::Host) {
      auto& dk = sink ? L.sink_k : L.recent_k;
      auto& dv = sink ? L.sink_v : L.recent_v;
      dk.insert(dk.end(), k + t * row_, k + (t + 1) * row_);
      dv.insert(dv.end(), v + t * row_, v + (t + 1) * row_);
    } else if (!sink && keeps_recent_k() && k != nullptr) {
      L.recent_k.insert(L.recent_k.end(), k + t * row_, k + (t + 1) * row_);
    }
    if (!sink) L.votes.push_back(maps ? chunk_votes_[static_cast<size_t>(t)] : 0.0f);
  }
  for (size_t i = 0; i < chunk_spans_.size(); ++i) {
    const int32_t b = std::max(pos + chunk_spans_[i].begin, opt_.sinks), e = pos + chunk_spans_[i].end;
    if (e > b) L.spans.push_back(PendingSpan{b, e, chunk_ratios_[i]});
  }
  if (layer == cfg_.num_layers - 1) length_ = pos + n;
}

stream::StreamLayout StreamingKV::plan(int32_t layer, int32_t pos, int32_t n, const float* q, const float* k,
                                       std::span<const float> inv_freq, float scale, ThreadPool* pool) {
  check(storage_ == Storage::Device, "streaming: plan() is for the GPU path (Storage::Device); the CPU calls attend()");
  if (windowed(layer)) return plan_window(layer, pos, n);
  prepare(layer, pos, n, q, k, inv_freq, scale, pool);
  finish(layer, pos, n, k, nullptr);
  return layers_[static_cast<size_t>(layer)].layout;
}

stream::StreamLayout StreamingKV::plan(int32_t layer, int32_t pos, int32_t n, const float* k,
                                       std::span<const float> inv_freq, const DeviceDecisions& given) {
  check(storage_ == Storage::Device, "streaming: plan() is for the GPU path (Storage::Device); the CPU calls attend()");
  if (windowed(layer)) return plan_window(layer, pos, n);
  given_ = &given;
  try {
    prepare(layer, pos, n, nullptr, k, inv_freq, 0.0f, nullptr);
  } catch (...) {
    given_ = nullptr;
    throw;
  }
  given_ = nullptr;
  finish(layer, pos, n, k, nullptr);
  return layers_[static_cast<size_t>(layer)].layout;
}

void StreamingKV::attend(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v,
                         std::span<const float> inv_freq, float scale, float* out, ThreadPool& pool,
                         const DeviceDecisions& given) {
  given_ = &given;
  try {
    attend(layer, pos, n, q, k, v, inv_freq, scale, out, pool);
  } catch (...) {
    given_ = nullptr;
    throw;
  }
  given_ = nullptr;
}

double StreamingKV::lambda(int32_t layer) const {
  if (windowed(layer)) return 0;
  const double searched = layers_[static_cast<size_t>(layer)].lambda;
  if (opt_.index_ratio > 0 && searched > 0) return searched;
  return layer < opt_.early_layers ? opt_.lambda_early : opt_.lambda;
}

stream::StreamLayout StreamingKV::plan_window(int32_t layer, int32_t pos, int32_t n) {
  check(pos == length_ && layer >= 0 && layer < cfg_.num_layers, "streaming: attend() out of order");
  Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  const int32_t held = L.win_count, kv_len = held + n;
  max_workspace_ = std::max<int64_t>(max_workspace_, kv_len);
  // Keep the last window - 1 tokens: all the next query (at pos + n) can see.
  L.win_count = std::min(kv_len, window - 1);
  L.layout = stream::StreamLayout{0, held, n};
  if (layer == cfg_.num_layers - 1) length_ = pos + n;
  return L.layout;
}

void StreamingKV::attend_window(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v,
                                std::span<const float> inv_freq, float scale, float* out, ThreadPool& pool) {
  check(pos == length_ && layer >= 0 && layer < cfg_.num_layers, "streaming: attend() out of order");
  Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  const int64_t half = d / 2;
  // Queries and the chunk's keys at their true positions; the held keys were rotated at theirs.
  cos_.resize(static_cast<size_t>(n * half));
  sin_.resize(cos_.size());
  rope_tables(inv_freq, pos, n, cos_.data(), sin_.data());
  rotate(q, n, nq, d, cos_.data(), sin_.data(), 0);
  rotate(k, n, nkv, d, cos_.data(), sin_.data(), 0);
  L.win_k.insert(L.win_k.end(), k, k + n * row_);
  L.win_v.insert(L.win_v.end(), v, v + n * row_);
  const int32_t held = L.win_count, kv_len = held + n;
  attn::AttentionArgs args;
  args.q = TensorView(q, DType::F32, {n, nq, d});
  args.k = TensorView(L.win_k.data(), DType::F32, {kv_len, nkv, d});
  args.v = TensorView(L.win_v.data(), DType::F32, {kv_len, nkv, d});
  args.out = TensorView(out, DType::F32, {n, nq, d});
  args.scale = scale;
  args.q_begin = held;  // positions relative to the first held token: the window's mask is unchanged
  if (window < kv_len) args.window = window;
  attn::dense_attention_cpu(args, pool);
  plan_window(layer, pos, n);  // the bookkeeping (the GPU path's too): the window kept, the layout
  const auto drop = static_cast<std::ptrdiff_t>(static_cast<int64_t>(kv_len - L.win_count) * row_);
  L.win_k.erase(L.win_k.begin(), L.win_k.begin() + drop);
  L.win_v.erase(L.win_v.begin(), L.win_v.begin() + drop);
}

void StreamingKV::attend(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v,
                         std::span<const float> inv_freq, float scale, float* out, ThreadPool& pool) {
  check(storage_ == Storage::Host, "streaming: attend() needs Storage::Host (the GPU path calls plan())");
  if (windowed(layer)) {
    attend_window(layer, pos, n, q, k, v, inv_freq, scale, out, pool);
    return;
  }
  prepare(layer, pos, n, q, k, inv_freq, scale, &pool);
  Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const int64_t qrow = static_cast<int64_t>(nq) * d;
  const int64_t half = d / 2;
  const stream::StreamLayout lay = L.layout;

  // The workspace: [sinks + retrieved blocks (raw) | local window (rotated) | chunk (rotated)].
  const int32_t B = opt_.block;
  const auto total = static_cast<size_t>(lay.kv_len() * row_);
  ws_k_.resize(total);
  ws_v_.resize(total);
  float* wk = ws_k_.data();
  float* wv = ws_v_.data();
  auto put = [&](const float* kk, const float* vv, int64_t rows) {
    std::copy(kk, kk + rows * row_, wk);
    std::copy(vv, vv + rows * row_, wv);
    wk += rows * row_;
    wv += rows * row_;
  };
  put(L.sink_k.data(), L.sink_v.data(), L.sink_count);
  if (evicted_ > 0)
    for (int32_t b : L.retrieved) put(store_.k(layer, b).data(), store_.v(layer, b).data(), B);
  float* local_k = wk;
  put(L.recent_k.data() + L.recent_skip * row_, L.recent_v.data() + L.recent_skip * row_, L.recent_count);
  if (evicted_ == 0) local_k = ws_k_.data();  // the sinks are local too
  rotate(local_k, lay.local, nkv, d, cos_.data(), sin_.data(), 0);
  put(k_rot_.data(), v, n);

  const TensorView wk_view(ws_k_.data(), DType::F32, {lay.kv_len(), nkv, d});
  const TensorView wv_view(ws_v_.data(), DType::F32, {lay.kv_len(), nkv, d});
  const TensorView ql(q_local_.data(), DType::F32, {n, nq, d});
  TensorView qg = ql;
  if (lay.global > 0) {
    q_global_.assign(q, q + n * qrow);
    for (int32_t r = 0; r < n; ++r)
      apply_rope(q_global_.data() + r * qrow, 1, qrow, nq, d, cos_.data() + span_len_ * half, sin_.data() + span_len_ * half);
    qg = TensorView(q_global_.data(), DType::F32, {n, nq, d});
  }
  stream::streaming_attention_cpu(lay, ql, qg, wk_view, wv_view, TensorView(out, DType::F32, {n, nq, d}), scale, pool);
  finish(layer, pos, n, k, v);
}

StreamStats StreamingKV::stats() const {
  StreamStats s;
  s.evicted_blocks = evicted_;
  s.host_bytes = store_.bytes();
  for (const Layer& l : layers_) {
    if (opt_.method == StreamMethod::Ltri) {
      s.index_vectors += l.span_index.num_vectors();
      s.index_bytes += l.span_index.bytes();
      s.index_head_vectors += l.span_index.head_vectors();
      s.index_spans += l.span_index.num_spans();
    } else if (opt_.method == StreamMethod::InfLLM) {
      s.index_vectors += l.repr_index.num_vectors();
      s.index_bytes += l.repr_index.bytes();
      s.index_head_vectors += l.repr_index.num_vectors() * cfg_.num_kv_heads;
    }
  }
  if (opt_.method == StreamMethod::Ltri)
    for (int32_t l = 0; l < layers(); ++l) s.lambdas.push_back(lambda(l));
  s.workspace_tokens = max_workspace_;
  s.retrieval_seconds = retrieval_seconds_;
  return s;
}

int64_t StreamingKV::resident_bytes() const {
  int64_t b = 0;
  for (const Layer& l : layers_)
    b += static_cast<int64_t>((l.sink_k.size() + l.sink_v.size() + l.recent_k.size() + l.recent_v.size() +
                               l.win_k.size() + l.win_v.size()) * sizeof(float));
  return b + static_cast<int64_t>((ws_k_.size() + ws_v_.size()) * sizeof(float));
}

double StreamingKV::memory_bytes() const {
  const StreamStats s = stats();
  return static_cast<double>(resident_bytes() + s.host_bytes + s.index_bytes);
}

}  // namespace tessera::runtime
