#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "core/clock.h"
#include "core/error.h"
#include "runtime/input_checks.h"

namespace tessera::runtime {

namespace {

}  // namespace

Engine::Engine(const Model& model, EngineOptions options)
    : model_(model),
      options_(std::move(options)),
      pool_(options_.pool ? *options_.pool : ThreadPool::global()),
      forward_(model, pool_) {
  const ModelConfig& cfg = model.config();
  check(options_.chunk_size > 0,
        "engine: chunk_size must be positive, got " + std::to_string(options_.chunk_size));
  check(options_.max_context >= 0, "engine: max_context must not be negative");
  check_policy_fits(options_.policy, cfg);
  if (options_.stream.method != StreamMethod::None) {
    check(options_.policy.table().empty(),
          "streaming memory (--stream) runs its own layout with dense attention within it; it cannot be combined "
          "with an attention policy (--attn)");
    stream_ = std::make_unique<StreamingKV>(cfg, options_.stream);
    // No context limit but the one asked for: positions past the model's trained context are what streaming is for.
    max_context_ = options_.max_context > 0 ? options_.max_context : std::numeric_limits<int32_t>::max() - 1;
    return;
  }
  max_context_ = options_.max_context > 0 ? options_.max_context : cfg.context_length;
  cache_ = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_context_, options_.kv_type);
  // An explicit limit is a promise that the cache may grow that far: refuse one that can never fit now, with the
  // size it needs, rather than once the memory runs out mid-prompt. (The model's own limit is checked per prompt.)
  if (options_.max_context > 0) cache_.check_budget(max_context_);
}

std::vector<float> Engine::run_prefill(std::span<const int32_t> tokens, LogitRows rows,
                                       const Progress& progress, const ChunkLogits& on_logits) {
  if (tokens.empty()) throw Error("prefill: empty prompt");
  check_token_ids(tokens, model_.config());
  check_prompt_fits(tokens.size(), position_, max_context_, model_.config());
  const int64_t end = static_cast<int64_t>(position_) + static_cast<int64_t>(tokens.size());
  if (stream_) stream_->check_sequence(end);
  const auto t0 = Clock::now();
  if (!stream_) {
    cache_.reserve(static_cast<int32_t>(end));
    forward_.set_observer(options_.observer ? &options_.observer : nullptr);
  }
  ForwardTimers timers;
  const auto n = static_cast<int64_t>(tokens.size());
  const auto total_len = static_cast<int32_t>(end);
  std::vector<float> logits;
  // Chunks of chunk_size tokens, attending to all earlier keys under the policy; with streaming memory the stream's
  // own chunks (stream_chunk_end) through it.
  for (int64_t c0 = 0; c0 < n;) {
    const int64_t c1 = stream_ ? stream_chunk_end(options_.stream, c0, n) : std::min<int64_t>(n, c0 + options_.chunk_size);
    const bool last = c1 == n;
    const LogitRows want = rows == LogitRows::All ? LogitRows::All : (last ? rows : LogitRows::None);
    const auto chunk = tokens.subspan(static_cast<size_t>(c0), static_cast<size_t>(c1 - c0));
    std::vector<float> part;
    if (stream_) {
      stream_->begin_chunk(position_, static_cast<int32_t>(c1 - c0),
                           last ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill);
      part = forward_.run(chunk, position_, *stream_, want, timers);
    } else {
      part = forward_.run(chunk, position_, cache_, &options_.policy, total_len, want, timers);
    }
    position_ += static_cast<int32_t>(c1 - c0);
    if (on_logits && want == LogitRows::All)
      on_logits(c0, c1 - c0, part);
    else
      logits.insert(logits.end(), part.begin(), part.end());
    if (progress) progress(c1, n);
    c0 = c1;
  }
  stats_.prefill_tokens += n;
  stats_.prefill_seconds += seconds_since(t0);
  stats_.attention_seconds += timers.attention_seconds;
  stats_.gemm_seconds += timers.gemm_seconds;
  return logits;
}

size_t Engine::kv_cache_bytes() const {
  if (!stream_) return cache_.bytes();
  const StreamStats s = stream_->stats();
  return static_cast<size_t>(stream_->resident_bytes() + s.host_bytes + s.index_bytes);
}

std::vector<float> Engine::prefill(std::span<const int32_t> tokens, const Progress& progress) {
  return run_prefill(tokens, LogitRows::Last, progress);
}

std::vector<float> Engine::forward_all_logits(std::span<const int32_t> tokens) {
  return run_prefill(tokens, LogitRows::All, {});
}

std::vector<double> Engine::score(std::span<const int32_t> tokens, const Progress& progress) {
  const int64_t vocab = model_.config().vocab_size;
  std::vector<double> logprobs;
  logprobs.reserve(tokens.empty() ? 0 : tokens.size() - 1);
  run_prefill(tokens, LogitRows::All, progress, [&](int64_t first, int64_t rows, const std::vector<float>& logits) {
    append_next_token_logprobs(logits, rows, vocab, first, tokens, logprobs);
  });
  return logprobs;
}

std::vector<float> Engine::decode(int32_t token) {
  return run_decode(token, LogitRows::Last);
}

std::vector<float> Engine::run_decode(int32_t token, LogitRows rows) {
  const int32_t one[1] = {token};
  check_token_ids(one, model_.config());
  check_decode_fits(position_, max_context_, model_.config());
  const auto t0 = Clock::now();
  ForwardTimers timers;
  std::vector<float> logits;
  if (stream_) {
    stream_->check_sequence(static_cast<int64_t>(position_) + 1);
    stream_->begin_chunk(position_, 1, StreamingKV::ChunkKind::Decode);
    logits = forward_.run(one, position_, *stream_, rows, timers);
  } else {
    cache_.reserve(position_ + 1);
    forward_.set_observer(nullptr);  // the observer sees prefill chunks only
    logits = forward_.run(one, position_, cache_, nullptr, position_ + 1, rows, timers);
  }
  position_ += 1;
  stats_.decode_tokens += 1;
  stats_.decode_seconds += seconds_since(t0);
  stats_.attention_seconds += timers.attention_seconds;
  stats_.gemm_seconds += timers.gemm_seconds;
  return logits;
}

std::vector<int32_t> Engine::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const OnToken& on_token) {
  return generate_tokens(*this, prompt, options, on_token, [this](int32_t t) { run_decode(t, LogitRows::None); });
}

void Engine::reset() {
  position_ = 0;
  if (stream_) stream_->reset();
}

}  // namespace tessera::runtime
