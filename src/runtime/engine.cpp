#include "runtime/engine.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "runtime/input_checks.h"

namespace tessera::runtime {

namespace {

BatchEngineOptions scheduler_options(const ModelConfig& cfg, const EngineOptions& o, int32_t logits_chunk = 0) {
  check(o.chunk_size > 0, "engine: chunk_size must be positive, got " + std::to_string(o.chunk_size));
  check(o.max_context >= 0, "engine: max_context must not be negative");
  check_policy_fits(o.policy, cfg);
  BatchEngineOptions b;
  b.chunk_size = o.chunk_size;
  b.max_batch = 1;  // one sequence: the pool holds max_context tokens of it (capped at the backend's default budget)
  b.max_context = o.max_context;
  b.policy = o.policy;
  b.stream = o.stream;
  b.prefix_cache = false;
  b.exact_decode = false;  // one sequence, no cache: the faster decode walk
  b.logits_chunk = logits_chunk;
  return b;
}

}  // namespace

Engine::Engine(const Model& model, EngineOptions options)
    : Engine(model, std::make_unique<CpuBatchBackend>(model, options.pool, options.kv_type), options) {}

Engine::Engine(const Model& model, std::unique_ptr<BatchBackend> backend, EngineOptions options)
    : model_(&model), options_(std::move(options)), backend_(std::move(backend)) {
  const ModelConfig& cfg = model.config();
  batch_ = std::make_unique<BatchEngine>(*backend_, scheduler_options(cfg, options_));
  max_context_ = batch_->max_context();
  // An explicit limit is a promise that the cache may grow that far: refuse one that can never fit now, with the
  // size it needs, rather than once the memory runs out mid-prompt. (The model's own limit is checked per prompt.)
  if (options_.max_context > 0 && options_.stream.method == StreamMethod::None)
    KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_context_, options_.kv_type).check_budget(max_context_);
  seq_ = batch_->open();
}

Engine::Engine(std::unique_ptr<BatchBackend> backend, EngineOptions options, int32_t logits_chunk)
    : options_(std::move(options)), backend_(std::move(backend)) {
  // (The device's backend checked its memory when it made the KV blocks.)
  batch_ = std::make_unique<BatchEngine>(*backend_, scheduler_options(backend_->config(), options_, logits_chunk));
  max_context_ = batch_->max_context();
  seq_ = batch_->open();
}

Engine::~Engine() = default;

int32_t Engine::position() const { return static_cast<int32_t>(batch_->length(seq_)); }

const StreamingKV* Engine::streaming() const { return dynamic_cast<const StreamingKV*>(batch_->stream(seq_)); }

size_t Engine::kv_cache_bytes() const { return static_cast<size_t>(batch_->kv_bytes_in_use()); }

std::vector<float> Engine::run_prefill(std::span<const int32_t> tokens, LogitRows rows, const Progress& progress,
                                       const BatchEngine::ChunkLogits& on_logits, std::vector<double>* scored) {
  const ForwardTimers before = backend_->timers();
  const double seconds = batch_->stats().prefill_seconds;
  backend_->set_observer(options_.observer ? &options_.observer : nullptr);
  std::vector<float> logits;
  try {
    logits = batch_->extend(seq_, tokens, rows, progress, on_logits, scored);
  } catch (...) {
    backend_->set_observer(nullptr);
    throw;
  }
  backend_->set_observer(nullptr);  // the observer sees prefill chunks only
  const ForwardTimers after = backend_->timers();
  stats_.prefill_tokens += static_cast<int64_t>(tokens.size());
  stats_.prefill_seconds += batch_->stats().prefill_seconds - seconds;
  stats_.attention_seconds += after.attention_seconds - before.attention_seconds;
  stats_.gemm_seconds += after.gemm_seconds - before.gemm_seconds;
  return logits;
}

std::vector<float> Engine::prefill(std::span<const int32_t> tokens, const Progress& progress) {
  return run_prefill(tokens, LogitRows::Last, progress);
}

std::vector<float> Engine::forward_all_logits(std::span<const int32_t> tokens) {
  return run_prefill(tokens, LogitRows::All, {});
}

std::vector<double> Engine::score(std::span<const int32_t> tokens, const Progress& progress) {
  std::vector<double> logprobs;
  logprobs.reserve(tokens.empty() ? 0 : tokens.size() - 1);
  run_prefill(tokens, LogitRows::All, progress, {}, &logprobs);
  return logprobs;
}

std::vector<float> Engine::decode(int32_t token) { return run_decode(token); }

std::vector<float> Engine::run_decode(int32_t token) {
  const ForwardTimers before = backend_->timers();
  const double seconds = batch_->stats().decode_seconds;
  std::vector<float> logits = batch_->decode_one(seq_, token);
  const ForwardTimers after = backend_->timers();
  stats_.decode_tokens += 1;
  stats_.decode_seconds += batch_->stats().decode_seconds - seconds;
  stats_.attention_seconds += after.attention_seconds - before.attention_seconds;
  stats_.gemm_seconds += after.gemm_seconds - before.gemm_seconds;
  return logits;
}

std::vector<int32_t> Engine::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const OnToken& on_token) {
  return generate_tokens(*this, prompt, options, on_token, [this](int32_t t) { run_decode(t); });
}

void Engine::reset() {
  batch_->clear(seq_);
  // The held sequence was the only one: its blocks are free, and their pages go back to the system (a next prompt
  // longer than the last would otherwise hold its staging cache beside them: 2x the KV at its peak).
  backend_->release_free_memory();
}

}  // namespace tessera::runtime
