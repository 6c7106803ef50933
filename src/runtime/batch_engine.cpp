#include "runtime/batch_engine.h"

#include <algorithm>
#include <chrono>
#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/clock.h"
#include "core/error.h"
#include "core/format.h"
#include "core/memory_budget.h"
#include "core/thread_pool.h"
#include "runtime/input_checks.h"

namespace tessera::runtime {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kContextFull: return "context_full";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "?";
}

// ---- the CPU backend ----

CpuBatchBackend::CpuBatchBackend(const Model& model, ThreadPool* pool, KVType kv_type)
    : model_(model),
      pool_(pool ? *pool : ThreadPool::global()),
      prefill_(model, pool_),
      decode_(prefill_.ops()),
      kv_type_(kv_type) {}

CpuBatchBackend::CpuBatchBackend(const Model& model, ThreadPool* pool, std::unique_ptr<CpuOps> ops)
    : model_(model),
      pool_(pool ? *pool : ThreadPool::global()),
      prefill_(model, pool_, std::move(ops)),
      decode_(prefill_.ops()) {}

double CpuBatchBackend::default_kv_bytes() const { return 0.25 * static_cast<double>(host_memory_budget().bytes); }

void CpuBatchBackend::create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t, int32_t) {
  store_ = PagedKVStore(shape, num_blocks, kv_type_);
}

std::vector<float> CpuBatchBackend::prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                  const attn::AttentionPolicy* policy, bool logits) {
  if (pos == 0) begin_staging(total_len);
  staging_.reserve(pos + static_cast<int32_t>(tokens.size()));
  return prefill_.run(tokens, pos, staging_, policy, total_len, logits ? LogitRows::Last : LogitRows::None, timers_);
}

std::vector<float> CpuBatchBackend::prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos,
                                                       int32_t total_len, const attn::AttentionPolicy* policy) {
  if (pos == 0) begin_staging(total_len);
  staging_.reserve(pos + static_cast<int32_t>(tokens.size()));
  return prefill_.run(tokens, pos, staging_, policy, total_len, LogitRows::All, timers_);
}

void CpuBatchBackend::finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView>) {
  if (seq.length() == 0) {  // a held sequence decoding before any prefill: nothing staged
    staging_.release();
    return;
  }
  // scatter_to_pages a layer at a time, each staged layer's pages handed back to the system once its rows are in the
  // blocks: the sequence's KV is held about once while it moves, not twice (the single-sequence engine's peak RSS).
  check(staging_.type() == store_.type(), "batched prefill: the staging cache and the KV blocks differ in type");
  // Rows [0, staged_from_) came from these blocks (load_prefix: a cached prefix, the sequence's earlier turns) and
  // are there already, bit for bit: only the new rows are written (a shared prefix block is never written again).
  const PagedKVShape& s = seq.shape();
  const size_t head_bytes = store_.row_bytes(), rows = static_cast<size_t>(staging_.capacity());
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (int32_t h = 0; h < s.num_kv_heads; ++h) {
      const std::vector<int32_t>& table = seq.table(l, h);
      const size_t at = static_cast<size_t>(h) * head_bytes;
      for (int64_t pos = staged_from_; pos < seq.length(); ++pos) {
        const int32_t blk = table[static_cast<size_t>(pos / s.block_tokens)];
        if (blk < 0) continue;  // outside the retention
        const auto p = static_cast<int32_t>(pos);
        std::memcpy(store_.k_bytes(blk, pos % s.block_tokens), staging_.k_bytes(l, p) + at, head_bytes);
        std::memcpy(store_.v_bytes(blk, pos % s.block_tokens), staging_.v_bytes(l, p) + at, head_bytes);
      }
    }
    if (rows > 0) {  // the layer's anonymous mappings (kv_cache.h): their pages go, the mappings stay until release()
      madvise(staging_.k_bytes(l, 0), rows * staging_.row_bytes(), MADV_DONTNEED);
      madvise(staging_.v_bytes(l, 0), rows * staging_.row_bytes(), MADV_DONTNEED);
    }
  }
  staging_.release();
  staged_from_ = 0;
}

void CpuBatchBackend::abort_prefill() {
  staging_.release();
  staged_from_ = 0;
}

std::vector<float> BatchBackend::prefill_chunk_rows(std::span<const int32_t>, int32_t, int32_t,
                                                    const attn::AttentionPolicy*) {
  throw Error(std::string("the prompt's log-probabilities are not available on the ") + device_name() +
              " batched backend");
}

std::vector<double> BatchBackend::prefill_chunk_logprobs(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                         const attn::AttentionPolicy* policy,
                                                         std::span<const int32_t> next) {
  check(next.size() <= tokens.size(), "prefill log-probabilities: more next tokens than rows");
  return next_token_logprobs(prefill_chunk_rows(tokens, pos, total_len, policy), config().vocab_size, next);
}

std::vector<double> BatchBackend::prefill_stream_chunk_logprobs(StreamMemory& kv, std::span<const int32_t> tokens,
                                                                int32_t pos, StreamingKV::ChunkKind kind,
                                                                std::span<const int32_t> next) {
  check(next.size() <= tokens.size(), "prefill log-probabilities: more next tokens than rows");
  return next_token_logprobs(prefill_stream_chunk_rows(kv, tokens, pos, kind), config().vocab_size, next);
}

void BatchBackend::load_prefix(const SequenceBlocks&, int32_t, int32_t) {
  throw Error(std::string("prefix caching: the ") + device_name() + " batched backend cannot stage a cached prefix");
}

void CpuBatchBackend::begin_staging(int32_t total_len) {
  const ModelConfig& cfg = model_.config();
  staging_ = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, total_len, kv_type_);
  staged_from_ = 0;
}

void CpuBatchBackend::load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) {
  begin_staging(total_len);
  staging_.reserve(rows);
  gather_from_pages(store_, seq, rows, staging_);
  staged_from_ = rows;  // rows [0, rows) are the blocks' own: finish_prefill does not write them back
}

std::unique_ptr<StreamMemory> BatchBackend::new_stream(const StreamOptions&) {
  throw Error(std::string("streaming memory: the ") + device_name() + " batched backend has none");
}

std::vector<float> BatchBackend::prefill_stream_chunk(StreamMemory&, std::span<const int32_t>, int32_t,
                                                      StreamingKV::ChunkKind, bool) {
  throw Error(std::string("streaming memory: the ") + device_name() + " batched backend has none");
}

std::vector<float> BatchBackend::prefill_stream_chunk_rows(StreamMemory&, std::span<const int32_t>, int32_t,
                                                           StreamingKV::ChunkKind) {
  throw Error(std::string("streaming memory: the ") + device_name() + " batched backend gives no prompt rows' logits");
}

void BatchBackend::set_observer(const AttentionObserver* observer) {
  check(observer == nullptr,
        std::string("the attention observer is not available on the ") + device_name() + " batched backend");
}

std::unique_ptr<StreamMemory> CpuBatchBackend::new_stream(const StreamOptions& options) {
  return std::make_unique<StreamingKV>(model_.config(), options);
}

std::vector<float> CpuBatchBackend::prefill_stream_chunk(StreamMemory& memory, std::span<const int32_t> tokens,
                                                         int32_t pos, StreamingKV::ChunkKind kind, bool logits) {
  auto* host = dynamic_cast<StreamingKV*>(&memory);
  check(host != nullptr, "streaming prefill: memory not made by the CPU backend's new_stream");
  StreamingKV& kv = *host;
  kv.begin_chunk(pos, static_cast<int32_t>(tokens.size()), kind);
  return prefill_.run(tokens, pos, kv, logits ? LogitRows::Last : LogitRows::None, timers_);
}

std::vector<float> CpuBatchBackend::prefill_stream_chunk_rows(StreamMemory& memory, std::span<const int32_t> tokens,
                                                              int32_t pos, StreamingKV::ChunkKind kind) {
  auto* host = dynamic_cast<StreamingKV*>(&memory);
  check(host != nullptr, "streaming prefill: memory not made by the CPU backend's new_stream");
  host->begin_chunk(pos, static_cast<int32_t>(tokens.size()), kind);
  return prefill_.run(tokens, pos, *host, LogitRows::All, timers_);
}

std::vector<int32_t> BatchBackend::decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                                  std::span<const RowChoice> choice) {
  check(choice.size() == tokens.size(), "batched decode: one sampling choice per row");
  const std::vector<float> logits = decode(tokens, rows);
  return choose_on_host(logits, choice);
}

std::vector<int32_t> BatchBackend::choose_on_host(std::span<const float> logits,
                                                  std::span<const RowChoice> choice) const {
  const auto vocab = static_cast<size_t>(config().vocab_size);
  check(logits.size() == choice.size() * vocab, "batched decode: " + std::to_string(logits.size()) +
                                                    " logits for " + std::to_string(choice.size()) + " rows");
  std::vector<int32_t> next(choice.size(), -1);
  auto pick = [&](int64_t i, int) {
    const auto row = std::span<const float>(logits).subspan(static_cast<size_t>(i) * vocab, vocab);
    const RowChoice& c = choice[static_cast<size_t>(i)];
    std::vector<float> edited;
    std::span<const float> use = row;
    if (!c.edits.empty()) {
      edited.assign(row.begin(), row.end());
      for (const LogitEdit& e : c.edits) edited[static_cast<size_t>(e.token)] = edit_logit(edited[static_cast<size_t>(e.token)], e);
      use = edited;
    }
    const int32_t t = c.options.temperature <= 0.0f ? argmax(use) : sample_token(use, c.options, c.u);
    next[static_cast<size_t>(i)] = t;
    if (c.logprobs >= 0 && c.logprobs_out) *c.logprobs_out = token_logprobs(row, t, c.logprobs);
  };
  // A draw over a large vocabulary takes milliseconds: the sampled rows in parallel.
  const bool sampled = std::any_of(choice.begin(), choice.end(), [](const RowChoice& c) { return c.options.temperature > 0.0f; });
  if (sampled && choice.size() > 1 && vocab >= 4096)
    ThreadPool::global().parallel_for(static_cast<int64_t>(choice.size()), pick);
  else
    for (size_t i = 0; i < choice.size(); ++i) pick(static_cast<int64_t>(i), 0);
  return next;
}

std::vector<int32_t> BatchBackend::mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                              const attn::AttentionPolicy* policy, bool logits,
                                              std::vector<float>* chunk_logits, std::span<const int32_t> tokens,
                                              std::span<const DecodeRow> rows, std::span<const RowChoice> choice) {
  check(chunk_logits != nullptr, "mixed step: no place for the chunk's logits");
  *chunk_logits = prefill_chunk(chunk, pos, total_len, policy, logits);
  return decode_select(tokens, rows, choice);
}

std::vector<float> CpuBatchBackend::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  return decode_.decode(tokens, rows, store_, timers_);
}

std::vector<int32_t> CpuBatchBackend::mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                                 const attn::AttentionPolicy* policy, bool logits,
                                                 std::vector<float>* chunk_logits, std::span<const int32_t> tokens,
                                                 std::span<const DecodeRow> rows, std::span<const RowChoice> choice) {
  const bool streamed = std::any_of(rows.begin(), rows.end(), [](const DecodeRow& r) { return r.stream != nullptr; });
  if (rows.empty() || chunk.empty() || streamed)
    return BatchBackend::mixed_step(chunk, pos, total_len, policy, logits, chunk_logits, tokens, rows, choice);
  check(chunk_logits != nullptr, "mixed step: no place for the chunk's logits");
  check(choice.size() == tokens.size(), "batched decode: one sampling choice per row");
  const ModelConfig& cfg = model_.config();
  if (pos == 0) begin_staging(total_len);
  staging_.reserve(pos + static_cast<int32_t>(chunk.size()));
  const std::vector<float> all = decode_.mixed(chunk, pos, staging_, policy, total_len, observer_, logits, tokens,
                                               rows, store_, timers_);
  const auto vocab = static_cast<size_t>(cfg.vocab_size);
  const size_t first = logits ? vocab : 0;
  if (logits) chunk_logits->assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(vocab));
  else chunk_logits->clear();
  return choose_on_host(std::span<const float>(all).subspan(first), choice);
}

// ---- the scheduler ----

struct BatchEngine::Sequence {
  int64_t id = 0;
  BatchRequest request;
  const attn::AttentionPolicy* policy = nullptr;  // request.policy or the engine's
  bool prefilling = false;                        // admitted, prompt not done
  bool decoding = false;                          // prompt done: the backend holds its views
  // A held sequence whose last extend is still in the backend's staging cache, its blocks grown but not written:
  // they are written at its next decode_one (or extend), so that extend returns its logits before the move.
  bool staged = false;
  int64_t prefilled = 0;
  SequenceBlocks blocks;
  std::vector<DecodeView> views;
  std::unique_ptr<StreamMemory> stream;  // streaming memory (options.stream; the backend's): its keys and values
  int64_t reserved = 0;
  std::optional<Sampler> sampler;
  int32_t generated = 0;
  int32_t pending = -1;  // the token to decode next step
  bool cancelled = false;
  int64_t cached = 0;           // prompt tokens adopted from the prefix cache
  bool reported_cache = false;  // the first event said how many
  std::vector<int32_t> fed;     // the tokens whose K/V the blocks hold: the prompt, then each decoded token
  std::vector<TokenLogprobs> prompt_lp;  // request.prompt_logprobs: the prompt's so far
};

struct BatchEngine::DecodeBatch {
  std::vector<Sequence*> seqs;
  std::vector<int32_t> tokens;
  std::vector<DecodeRow> rows;
  std::vector<BatchBackend::RowChoice> choice;
  std::vector<TokenLogprobs> logprobs;
  std::vector<int32_t> next;
  bool ran = false;   // next holds the chosen tokens (or error is set)
  std::string error;  // the step failed: every row ends with it
  double seconds = 0;
};

BatchEngine::BatchEngine(BatchBackend& backend, BatchEngineOptions options)
    : backend_(backend), options_(std::move(options)), cfg_(backend.config()) {
  // TESSERA_MIXED_STEP=0 / 1 turns the mixed step off / on in every engine of the process (the server's side-by-side).
  mixed_ = options_.mixed_step.value_or(backend.mixed_step_by_default());
  if (const char* e = std::getenv("TESSERA_MIXED_STEP"); e != nullptr && (std::string(e) == "0" || std::string(e) == "1"))
    mixed_ = std::string(e) == "1";
  check(options_.chunk_size > 0, "batch engine: chunk_size must be positive, got " + std::to_string(options_.chunk_size));
  check(options_.block_tokens > 0 && options_.block_tokens <= 4096,
        "batch engine: block_tokens must be in [1, 4096], got " + std::to_string(options_.block_tokens));
  check(options_.max_batch > 0, "batch engine: max_batch must be positive, got " + std::to_string(options_.max_batch));
  check(options_.max_context >= 0, "batch engine: max_context must not be negative");
  check(std::isfinite(options_.kv_bytes) && options_.kv_bytes >= 0,
        "batch engine: the KV budget must be a non-negative number of bytes");
  check_policy_fits(options_.policy, cfg_);
  check(options_.step_tokens == 0 || options_.step_tokens > options_.max_batch,
        "batch engine: step_tokens must be 0 (no budget) or more than max_batch (" +
            std::to_string(options_.max_batch) + "): every decoding sequence takes a token of each step and a "
            "prefill needs one more, got " + std::to_string(options_.step_tokens));
  check(options_.step_tokens == 0 || !streaming(),
        "batch engine: a token budget per step (step_tokens) cannot be combined with streaming memory, whose prompt "
        "chunks are its own");
  if (streaming()) {
    check(options_.policy.table().empty(),
          "streaming memory (--stream) runs its own layout with dense attention within it; it cannot be combined "
          "with an attention policy (--attn)");
    check_stream_options(options_.stream);
    // No context limit but the one asked for, as the single-sequence engine; no KV blocks (each sequence keeps its
    // own memory).
    max_context_ = options_.max_context > 0 ? options_.max_context : std::numeric_limits<int32_t>::max() - 1;
    shape_ = {cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, options_.block_tokens};
    block_bytes_ = backend_.block_bytes(shape_);
    return;
  }
  max_context_ = options_.max_context > 0 ? options_.max_context : cfg_.context_length;
  shape_ = {cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, options_.block_tokens};
  block_bytes_ = backend_.block_bytes(shape_);
  double budget = options_.kv_bytes;
  if (budget <= 0) {
    const double dense = block_bytes_ * static_cast<double>(cfg_.num_layers) * cfg_.num_kv_heads *
                         std::ceil(static_cast<double>(max_context_) / options_.block_tokens) * options_.max_batch;
    budget = std::min(dense, backend_.default_kv_bytes());
  }
  const double blocks = std::floor(budget / block_bytes_);
  check(blocks >= 1, "batch engine: a KV budget of " + format_bytes(budget) + " holds no block of " +
                         format_bytes(block_bytes_));
  check(blocks < 2.0e9, "batch engine: a KV budget of " + format_bytes(budget) + " is over 2^31 blocks; raise block_tokens");
  pool_ = BlockPool(static_cast<int32_t>(blocks));
  prefix_cache_ = PrefixCache(options_.block_tokens);
  backend_.create_store(shape_, pool_.total(), options_.max_batch, max_context_);
  backend_.set_exact_decode(options_.exact_decode);
}

bool BatchEngine::cacheable(const Sequence& s) const {
  return options_.prefix_cache && !streaming() && s.policy->table().empty() && backend_.supports_prefix_cache();
}

void BatchEngine::make_room(int64_t n) {
  if (pool_.available() < n) stats_.prefix_evictions += prefix_cache_.evict(pool_, n);
}

BatchEngine::~BatchEngine() = default;

int64_t BatchEngine::submit(BatchRequest request) {
  if (request.prompt.empty()) throw Error("request: empty prompt");
  check_token_ids(request.prompt, cfg_);
  check(request.options.max_new_tokens >= 1,
        "request: max_new_tokens must be at least 1, got " + std::to_string(request.options.max_new_tokens));
  check_sampling_options(request.options.sampling);
  check_prompt_fits(request.prompt.size() + static_cast<size_t>(request.options.max_new_tokens), 0, max_context_, cfg_);
  if (request.policy) check_policy_fits(*request.policy, cfg_);
  if (request.prompt_logprobs >= 0) {
    check(supports_prompt_logprobs(),
          streaming() ? std::string("request: the prompt's log-probabilities are not available with streaming memory")
                      : std::string("request: the prompt's log-probabilities are not available on the ") +
                            backend_.device_name() + " batched backend");
    check(request.prompt_logprobs <= cfg_.vocab_size,
          "request: prompt_logprobs must be at most the vocabulary's size, got " +
              std::to_string(request.prompt_logprobs));
  }
  auto s = std::make_unique<Sequence>();
  s->id = next_id_;
  s->request = std::move(request);
  s->policy = s->request.policy ? &*s->request.policy : &options_.policy;
  if (streaming()) {
    check(s->policy->table().empty(),
          "request: an attention policy cannot be combined with streaming memory, which attends densely within its "
          "own layout");
    // The host store must hold what the whole sequence evicts: refused now, not mid-prompt.
    StreamingKV probe(cfg_, options_.stream);
    probe.check_sequence(static_cast<int64_t>(s->request.prompt.size()) + s->request.options.max_new_tokens);
    s->sampler.emplace(s->request.options.sampling);
  s->sampler->set_prompt(s->request.prompt);
    ++next_id_;
    waiting_.push_back(std::move(s));
    return next_id_ - 1;
  }
  const auto prompt_len = static_cast<int64_t>(s->request.prompt.size());
  s->views = decode_views(cfg_, s->policy, prompt_len);
  s->blocks = SequenceBlocks(shape_, kv_retention(cfg_, s->views));
  s->reserved = s->blocks.max_blocks(prompt_len, prompt_len + s->request.options.max_new_tokens);
  if (s->reserved > pool_.total()) {
    throw Error("request needs " + with_commas(s->reserved) + " KV blocks (" + std::to_string(shape_.block_tokens) +
                " tokens each; " + format_bytes(static_cast<double>(s->reserved) * block_bytes_) +
                ") for its prompt of " + with_commas(prompt_len) + " tokens and " +
                with_commas(s->request.options.max_new_tokens) + " new ones, but the KV budget holds " +
                with_commas(pool_.total()) + " blocks (" + format_bytes(pool_.total() * block_bytes_) +
                "); shorten the prompt, ask for fewer tokens or raise the KV budget");
  }
  s->sampler.emplace(s->request.options.sampling);
  s->sampler->set_prompt(s->request.prompt);
  ++next_id_;
  waiting_.push_back(std::move(s));
  return next_id_ - 1;
}

bool BatchEngine::cancel(int64_t id) {
  for (auto& s : waiting_)
    if (s->id == id) return s->cancelled = true;
  for (auto& s : running_)
    if (s->id == id) return s->cancelled = true;
  return false;
}

void BatchEngine::finish(Sequence& s, FinishReason reason, std::vector<BatchEvent>& events, std::string error) {
  // What the sequence wrote stays findable (prompt and generated tokens, full blocks), unless a step failed midway.
  if (s.decoding && reason != FinishReason::kError && cacheable(s))
    prefix_cache_.insert(s.fed, s.blocks, s.blocks.length() / shape_.block_tokens, pool_);
  if (s.prefilling) backend_.abort_prefill();
  if (s.decoding) backend_.release_sequence(s.blocks);
  s.decoding = false;
  s.prefilling = false;
  s.blocks.release(pool_);
  s.stream.reset();
  reserved_ -= s.reserved;
  s.reserved = 0;
  s.pending = -1;
  BatchEvent e;
  e.id = s.id;
  e.finished = true;
  e.reason = reason;
  e.error = std::move(error);
  events.push_back(std::move(e));
}

void BatchEngine::admit() {
  const bool prefill_running =
      std::any_of(running_.begin(), running_.end(), [](const auto& s) { return s->prefilling; });
  if (prefill_running || waiting_.empty() || static_cast<int32_t>(running_.size()) >= options_.max_batch) return;
  Sequence& s = *waiting_.front();
  if (reserved_ + s.reserved > pool_.total()) return;  // waits for blocks to come back
  reserved_ += s.reserved;
  if (cacheable(s) && s.request.prompt_logprobs < 0) {  // (the prompt's log-probabilities need every row's logits)
    // The longest cached prefix, leaving at least the prompt's last token to prefill (its logits start the answer).
    const auto n = static_cast<int64_t>(s.request.prompt.size());
    const auto shared = prefix_cache_.match(s.request.prompt, (n - 1) / shape_.block_tokens, s.blocks);
    if (!shared.empty()) {
      s.blocks.adopt(shared, pool_);
      s.cached = s.prefilled = s.blocks.length();
      stats_.cached_tokens += s.cached;
      ++stats_.prefix_hits;
    }
  }
  s.fed = s.request.prompt;
  s.prefilling = true;
  running_.push_back(std::move(waiting_.front()));
  waiting_.pop_front();
}

void BatchEngine::take_logits(Sequence& s, std::span<const float> logits, std::vector<BatchEvent>& events) {
  const int32_t tok = s.sampler->sample(logits);
  const int32_t k = s.request.options.logprobs;
  take_token(s, tok, events, k >= 0 ? std::optional<TokenLogprobs>(token_logprobs(logits, tok, k)) : std::nullopt);
}

void BatchEngine::take_token(Sequence& s, int32_t tok, std::vector<BatchEvent>& events,
                             std::optional<TokenLogprobs> logprobs) {
  const std::vector<int32_t>& stops = s.request.options.stop_tokens;
  if (std::find(stops.begin(), stops.end(), tok) != stops.end()) return finish(s, FinishReason::kStop, events);
  const int64_t length = s.stream ? s.stream->sequence_length() : s.blocks.length();
  if (length >= max_context_) return finish(s, FinishReason::kContextFull, events);
  ++s.generated;
  events.push_back(BatchEvent{s.id, tok, false, FinishReason::kLength, {}, std::move(logprobs),
                              s.reported_cache ? -1 : static_cast<int32_t>(s.cached), std::nullopt});
  s.reported_cache = true;
  if (s.generated >= s.request.options.max_new_tokens) return finish(s, FinishReason::kLength, events);
  s.pending = tok;
}

int64_t BatchEngine::prefill_step(std::vector<BatchEvent>& events, int64_t max_tokens, bool* ended) {
  auto it = std::find_if(running_.begin(), running_.end(), [](const auto& s) { return s->prefilling; });
  if (it == running_.end() || max_tokens <= 0) return 0;
  Sequence& s = **it;
  const std::vector<int32_t>& prompt = s.request.prompt;
  const auto n = static_cast<int64_t>(prompt.size());
  const int64_t c0 = s.prefilled;
  const int32_t top = s.request.prompt_logprobs;
  if (top >= 0) max_tokens = std::min<int64_t>(max_tokens, std::max<int64_t>(16, (int64_t{1} << 25) / cfg_.vocab_size));
  const int64_t c1 = streaming() ? stream_chunk_end(options_.stream, c0, n) : std::min<int64_t>(n, c0 + max_tokens);
  const bool last = c1 == n;
  if (ended) *ended = last;
  ++stats_.prefill_chunks;
  const auto t0 = Clock::now();
  try {
    // The backend's streaming memory, made with the first chunk (a failure ends this request only).
    if (streaming() && !s.stream) {
      s.stream = backend_.new_stream(options_.stream);
      s.stream->reserve(n);
    }
    const auto chunk = std::span<const int32_t>(prompt).subspan(static_cast<size_t>(c0), static_cast<size_t>(c1 - c0));
    if (c0 > 0 && c0 == s.cached)  // the first chunk after a cached prefix: stage it
      backend_.load_prefix(s.blocks, static_cast<int32_t>(c0), static_cast<int32_t>(n));
    std::vector<float> logits;
    // The step's decode rows ride with this chunk (the first of the step that runs through prefill_chunk).
    bool mix = false;
    if (top < 0 && !s.stream && ride_ != nullptr && !ride_->ran) {
      collect_decode(*ride_);
      mix = !ride_->seqs.empty();
    }
    if (top >= 0) {
      // Every row's logits: row r predicts prompt[c0 + r + 1]; the last row of the prompt starts the answer.
      const std::vector<float> rows =
          backend_.prefill_chunk_rows(chunk, static_cast<int32_t>(c0), static_cast<int32_t>(n), s.policy);
      const auto vocab = static_cast<size_t>(cfg_.vocab_size);
      check(rows.size() == chunk.size() * vocab, "batched prefill: the backend gave " + std::to_string(rows.size()) +
                                                     " logits for " + std::to_string(chunk.size()) + " rows");
      for (int64_t p = c0; p < c1; ++p) {
        const auto row = std::span<const float>(rows).subspan(static_cast<size_t>(p - c0) * vocab, vocab);
        if (p + 1 < n) s.prompt_lp.push_back(token_logprobs(row, prompt[static_cast<size_t>(p + 1)], top));
        else logits.assign(row.begin(), row.end());
      }
    } else if (mix) {
      // The mixed step: the decoding sequences' rows in this chunk's forward. When it fails (the chunk's staging
      // memory, ...), the prompt ends with the error (below) and the decode rows run alone, as without the mixed
      // step, with the same draws (a row's K/V written again at the same place).
      DecodeBatch& b = *ride_;
      b.ran = true;
      const auto d0 = Clock::now();
      try {
        prepare_decode(b);
      } catch (const Error& e) {  // the decode rows' error (as in decode_step), not the prompt's
        b.error = e.what();
      }
      if (!b.error.empty())
        logits = backend_.prefill_chunk(chunk, static_cast<int32_t>(c0), static_cast<int32_t>(n), s.policy, last);
      else
        try {
          b.next = backend_.mixed_step(chunk, static_cast<int32_t>(c0), static_cast<int32_t>(n), s.policy, last,
                                       &logits, b.tokens, b.rows, b.choice);
        } catch (const Error&) {
          try {
            b.next = backend_.decode_select(b.tokens, b.rows, b.choice);
          } catch (const Error& e) {
            b.error = e.what();
          }
          b.seconds = seconds_since(d0);
          throw;
        }
    } else {
      logits =
        s.stream ? backend_.prefill_stream_chunk(*s.stream, chunk, static_cast<int32_t>(c0),
                                                 last ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill,
                                                 last)
                 : backend_.prefill_chunk(chunk, static_cast<int32_t>(c0), static_cast<int32_t>(n), s.policy, last);
    }
    s.prefilled = c1;
    stats_.prefill_tokens += c1 - c0;
    if (last && s.stream) {
      s.decoding = true;
      s.prefilling = false;
      take_logits(s, logits, events);
    } else if (last) {
      const int64_t rows = n - s.blocks.length();  // a cached prefix is held already
      make_room(s.blocks.need(rows));
      s.blocks.grow(rows, pool_);  // within what was reserved at admission
      backend_.finish_prefill(s.blocks, s.views);
      s.decoding = true;
      s.prefilling = false;
      // The prompt's full blocks, findable by requests that come while this one decodes.
      if (cacheable(s)) prefix_cache_.insert(s.fed, s.blocks, n / shape_.block_tokens, pool_);
      if (top >= 0) {
        BatchEvent e;
        e.id = s.id;
        e.prompt_logprobs = std::move(s.prompt_lp);
        events.push_back(std::move(e));
      }
      take_logits(s, logits, events);
    }
  } catch (const Error& e) {
    if (streaming()) s.prefilling = false;  // no staged prefill in the backend to abort
    finish(s, FinishReason::kError, events, e.what());
  }
  stats_.prefill_seconds += seconds_since(t0);
  return c1 - c0;
}

int64_t BatchEngine::budgeted_prefill(std::vector<BatchEvent>& events, int64_t decoding) {
  int64_t left = options_.step_tokens - decoding, ran = 0;
  for (;;) {
    admit();
    const auto it = std::find_if(running_.begin(), running_.end(), [](const auto& s) { return s->prefilling; });
    if (it == running_.end()) break;
    const int64_t rest = static_cast<int64_t>((*it)->request.prompt.size()) - (*it)->prefilled;
    int64_t take = std::min<int64_t>({rest, options_.chunk_size, left});
    if (take == rest && take + 1 > left) take = left - 1;  // the prompt's last chunk brings a decode row now
    if (take <= 0) break;
    bool ended = false;
    const int64_t done = prefill_step(events, take, &ended);
    ran += done;
    left -= done + (ended ? 1 : 0);
    if (!ended) break;  // the chunk size or the budget ended this step's part of the prompt
  }
  return ran;
}

void BatchEngine::collect_decode(DecodeBatch& b) const {
  for (const auto& s : running_)
    if (!s->prefilling && s->pending >= 0) b.seqs.push_back(s.get());
}

void BatchEngine::prepare_decode(DecodeBatch& b) {
  for (Sequence* s : b.seqs) {
    b.tokens.push_back(s->pending);
    if (s->stream) {
      b.rows.push_back(DecodeRow{nullptr, {}, s->stream.get()});
    } else {
      make_room(s->blocks.need(1));
      s->blocks.grow(1, pool_);  // within what was reserved at admission
      s->fed.push_back(s->pending);
      b.rows.push_back(DecodeRow{&s->blocks, s->views, nullptr});
    }
    // A sampled row's uniform draw comes from its own stream, as the single-sequence engine's Sampler takes it.
    b.choice.push_back({s->sampler->options(), s->sampler->greedy() ? 0.0 : s->sampler->next_uniform(),
                        s->sampler->edits(cfg_.vocab_size), s->request.options.logprobs, nullptr});
  }
  b.logprobs.resize(b.seqs.size());
  for (size_t i = 0; i < b.seqs.size(); ++i)
    if (b.choice[i].logprobs >= 0) b.choice[i].logprobs_out = &b.logprobs[i];
}

void BatchEngine::finish_decode(DecodeBatch& b, std::vector<BatchEvent>& events) {
  if (b.error.empty()) {
    if (b.next.size() != b.seqs.size())
      b.error = "batched decode: the backend chose " + std::to_string(b.next.size()) + " tokens for " +
                std::to_string(b.seqs.size()) + " rows";
    for (int32_t t : b.next)
      if (b.error.empty() && (t < 0 || t >= cfg_.vocab_size))
        b.error = "batched decode: the backend chose token " + std::to_string(t) + " outside the vocabulary";
  }
  if (!b.error.empty()) {
    for (Sequence* s : b.seqs) finish(*s, FinishReason::kError, events, b.error);
    stats_.decode_seconds += b.seconds;
    return;
  }
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    if (b.seqs[i]->sampler->greedy()) ++stats_.greedy_tokens;
    b.seqs[i]->sampler->accept(b.next[i]);  // the penalties' history
    take_token(*b.seqs[i], b.next[i], events,
               b.choice[i].logprobs >= 0 ? std::optional<TokenLogprobs>(std::move(b.logprobs[i])) : std::nullopt);
  }
  stats_.decode_tokens += static_cast<int64_t>(b.seqs.size());
  ++stats_.decode_steps;
  stats_.max_decode_batch = std::max<int64_t>(stats_.max_decode_batch, static_cast<int64_t>(b.seqs.size()));
  stats_.decode_seconds += b.seconds;
}

int64_t BatchEngine::decode_step(std::vector<BatchEvent>& events) {
  DecodeBatch b;
  collect_decode(b);
  if (b.seqs.empty()) return 0;
  const auto t0 = Clock::now();
  try {
    prepare_decode(b);
    b.next = backend_.decode_select(b.tokens, b.rows, b.choice);
  } catch (const Error& e) {
    b.error = e.what();
  }
  b.seconds = seconds_since(t0);
  finish_decode(b, events);
  return static_cast<int64_t>(b.seqs.size());
}

std::vector<BatchEvent> BatchEngine::step(const EarlyEvents& early) {
  std::vector<BatchEvent> events;
  ++stats_.steps;
  for (auto& s : waiting_)
    if (s->cancelled) {
      BatchEvent e;
      e.id = s->id;
      e.finished = true;
      e.reason = FinishReason::kCancelled;
      events.push_back(e);
    }
  std::erase_if(waiting_, [](const auto& s) { return s->cancelled; });
  for (auto& s : running_)
    if (s->cancelled) finish(*s, FinishReason::kCancelled, events);
  const auto done = [](const auto& s) { return s->cancelled || (!s->prefilling && s->pending < 0); };
  std::erase_if(running_, done);
  int64_t ran = 0;
  // With the mixed step the decode rows ride with the step's first prefill chunk (prefill_step takes ride_); when
  // none did (no chunk, or one that runs apart), the decode step runs on its own as without it.
  DecodeBatch ride;
  ride_ = mixed_ && !streaming() ? &ride : nullptr;
  try {
    if (options_.step_tokens > 0) {
      const auto decoding = std::count_if(running_.begin(), running_.end(),
                                          [](const auto& s) { return !s->prefilling && s->pending >= 0; });
      ran = budgeted_prefill(events, decoding);
    } else {
      admit();
      ran = prefill_step(events, options_.chunk_size);
    }
  } catch (...) {
    ride_ = nullptr;
    throw;
  }
  ride_ = nullptr;
  if (ride.ran) {
    ++stats_.mixed_steps;
    finish_decode(ride, events);
    ran += static_cast<int64_t>(ride.seqs.size());
  } else {
    if (early && !events.empty()) {
      early(events);
      events.clear();
    }
    ran += decode_step(events);
  }
  stats_.last_step_tokens = ran;
  stats_.max_step_tokens = std::max(stats_.max_step_tokens, ran);
  std::erase_if(running_, done);
  return events;
}

double BatchEngine::prefix_cache_bytes() const {
  return static_cast<double>(prefix_cache_.ids_only_here(pool_)) * block_bytes_;
}

double BatchEngine::kv_bytes_in_use() const {
  double bytes = static_cast<double>(pool_.used() - prefix_cache_.ids_only_here(pool_)) * block_bytes_;
  for (const auto& s : running_)
    if (s->stream) bytes += s->stream->memory_bytes();
  for (const auto& s : held_)
    if (s->stream) bytes += s->stream->memory_bytes();
  return bytes;
}

// ---- held sequences ----

BatchEngine::Sequence& BatchEngine::held(int64_t id) const {
  for (const auto& s : held_)
    if (s->id == id) return *s;
  throw Error("batch engine: no held sequence " + std::to_string(id));
}

int64_t BatchEngine::open() {
  auto s = std::make_unique<Sequence>();
  s->id = next_id_++;
  s->policy = &options_.policy;
  if (streaming()) {
    s->stream = backend_.new_stream(options_.stream);
  } else {
    s->views = decode_views(cfg_, nullptr, 0);  // dense decode; the model's sliding windows
    s->blocks = SequenceBlocks(shape_, kv_retention(cfg_, s->views));
  }
  held_.push_back(std::move(s));
  return held_.back()->id;
}

int64_t BatchEngine::length(int64_t id) const {
  const Sequence& s = held(id);
  return s.stream ? s.stream->sequence_length() : s.blocks.length();
}

StreamMemory* BatchEngine::stream(int64_t id) const { return held(id).stream.get(); }

void BatchEngine::clear(int64_t id) {
  Sequence& s = held(id);
  if (s.staged) backend_.abort_prefill();  // never moved into its blocks: nothing to keep
  s.staged = false;
  if (s.decoding) backend_.release_sequence(s.blocks);
  s.decoding = false;
  s.blocks.release(pool_);
  if (s.stream) s.stream->reset();  // (its pinned slabs kept for the next sequence)
}

void BatchEngine::close(int64_t id) {
  clear(id);
  std::erase_if(held_, [id](const auto& s) { return s->id == id; });
}

std::vector<float> BatchEngine::extend(int64_t id, std::span<const int32_t> tokens, LogitRows rows,
                                       const Progress& progress, const ChunkLogits& on_logits,
                                       std::vector<double>* scored) {
  Sequence& s = held(id);
  check(scored == nullptr || (rows == LogitRows::All && !on_logits),
        "batched prefill: scored rows are asked with LogitRows::All and no chunk callback");
  if (tokens.empty()) throw Error("prefill: empty prompt");
  check_token_ids(tokens, cfg_);
  const int64_t pos0 = length(id), n = static_cast<int64_t>(tokens.size()), end = pos0 + n;
  check_prompt_fits(tokens.size(), static_cast<int32_t>(pos0), max_context_, cfg_);
  if (s.stream) {
    s.stream->check_sequence(end);
    s.stream->reserve(end);
  }
  // The last extend's rows into their blocks first (before anything here can fail and drop the staging cache); they
  // are staged again below with the rest.
  if (!s.stream) finish_staged(s);
  const auto t0 = Clock::now();
  std::vector<float> logits;
  try {
    if (!s.stream) {
      check(s.blocks.need(n) <= pool_.available(),
            "KV cache: " + with_commas(end) + " tokens need " + with_commas(s.blocks.blocks_at(end)) + " KV blocks (" +
                format_bytes(static_cast<double>(s.blocks.blocks_at(end)) * block_bytes_) + ") but the KV budget holds " +
                with_commas(pool_.total()) + " (" + format_bytes(pool_.total() * block_bytes_) +
                "); pass a smaller max context (--max-context) or shorten the prompt");
      if (s.decoding) backend_.release_sequence(s.blocks);  // staged again below: its decode state is rebuilt
      s.decoding = false;
      if (pos0 > 0) backend_.load_prefix(s.blocks, static_cast<int32_t>(pos0), static_cast<int32_t>(end));
    }
    // Chunks of chunk_size tokens, each attending to all earlier keys under the policy; with streaming memory the
    // stream's own chunks (stream_chunk_end) through it.
    const int64_t chunk_size = rows == LogitRows::All && options_.logits_chunk > 0
                                   ? std::min(options_.chunk_size, options_.logits_chunk)
                                   : options_.chunk_size;
    for (int64_t c0 = 0; c0 < n;) {
      const int64_t c1 = s.stream ? stream_chunk_end(options_.stream, c0, n) : std::min<int64_t>(n, c0 + chunk_size);
      const bool last = c1 == n;
      const auto chunk = tokens.subspan(static_cast<size_t>(c0), static_cast<size_t>(c1 - c0));
      const auto pos = static_cast<int32_t>(pos0 + c0);
      const auto kind = last ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill;
      std::vector<float> part;
      try {
        if (scored != nullptr) {
          // Row r of the chunk predicts tokens[c0 + r + 1]; the prompt's last row predicts nothing here.
          const auto next = tokens.subspan(static_cast<size_t>(c0) + 1, static_cast<size_t>(std::min(c1, n - 1) - c0));
          const std::vector<double> lp =
              s.stream ? backend_.prefill_stream_chunk_logprobs(*s.stream, chunk, pos, kind, next)
                       : backend_.prefill_chunk_logprobs(chunk, pos, static_cast<int32_t>(end), s.policy, next);
          check(lp.size() == next.size(), "batched prefill: the backend scored " + std::to_string(lp.size()) +
                                              " rows of " + std::to_string(next.size()));
          scored->insert(scored->end(), lp.begin(), lp.end());
        } else if (rows == LogitRows::All)
          part = s.stream ? backend_.prefill_stream_chunk_rows(*s.stream, chunk, pos, kind)
                          : backend_.prefill_chunk_rows(chunk, pos, static_cast<int32_t>(end), s.policy);
        else
          part = s.stream ? backend_.prefill_stream_chunk(*s.stream, chunk, pos, kind, last && rows == LogitRows::Last)
                          : backend_.prefill_chunk(chunk, pos, static_cast<int32_t>(end), s.policy,
                                                   last && rows == LogitRows::Last);
      } catch (const Error& e) {
        // Say which part of the prompt was running; the sequence stays usable (a streamed one after clear()).
        throw Error(std::string(s.stream ? "streaming prefill of " : "prefill of ") + std::to_string(n) +
                    " tokens, chunk [" + std::to_string(c0) + ", " + std::to_string(c1) + ") at position " +
                    std::to_string(pos) + ": " + e.what() + " (call reset() before the next prompt)");
      }
      if (on_logits && rows == LogitRows::All)
        on_logits(c0, c1 - c0, part);
      else
        logits.insert(logits.end(), part.begin(), part.end());
      stats_.prefill_tokens += c1 - c0;
      ++stats_.prefill_chunks;
      if (progress) progress(c1, n);
      c0 = c1;
    }
    if (!s.stream) {
      // The rows move into the blocks at the next decode_one (finish_staged): the time to the first token does not
      // wait for the copy (on an H200, 17 GB each way for a 128K Llama-3-8B prompt).
      s.blocks.grow(n, pool_);
      s.staged = true;
    }
  } catch (...) {
    if (!s.stream) backend_.abort_prefill();
    stats_.prefill_seconds += seconds_since(t0);
    throw;
  }
  stats_.prefill_seconds += seconds_since(t0);
  return logits;
}

void BatchEngine::finish_staged(Sequence& s) {
  if (!s.staged) return;
  s.staged = false;
  backend_.finish_prefill(s.blocks, s.views);
  s.decoding = true;
}

std::vector<float> BatchEngine::decode_one(int64_t id, int32_t token) {
  Sequence& s = held(id);
  const int32_t one[1] = {token};
  check_token_ids(one, cfg_);
  const int64_t len = length(id);
  check_decode_fits(static_cast<int32_t>(len), max_context_, cfg_);
  const auto t0 = Clock::now();
  DecodeRow row;
  if (s.stream) {
    s.stream->check_sequence(len + 1);
    row.stream = s.stream.get();
  } else {
    check(s.blocks.need(1) <= pool_.available(),
          "KV cache: the KV budget's " + with_commas(pool_.total()) + " blocks (" +
              format_bytes(pool_.total() * block_bytes_) + ") are full at " + with_commas(len) + " tokens");
    finish_staged(s);
    if (!s.decoding) {  // nothing prefilled yet, or a failed extend: the sequence takes its decode state now
      if (len > 0) backend_.load_prefix(s.blocks, static_cast<int32_t>(len), static_cast<int32_t>(len));
      backend_.finish_prefill(s.blocks, s.views);
      s.decoding = true;
    }
    s.blocks.grow(1, pool_);
    row = DecodeRow{&s.blocks, s.views, nullptr};
  }
  std::vector<float> logits = backend_.decode(one, std::span<const DecodeRow>(&row, 1));
  stats_.decode_tokens += 1;
  ++stats_.decode_steps;
  stats_.max_decode_batch = std::max<int64_t>(stats_.max_decode_batch, 1);
  stats_.decode_seconds += seconds_since(t0);
  return logits;
}

std::vector<std::vector<int32_t>> BatchEngine::generate_all(std::vector<BatchRequest> requests) {
  std::vector<int64_t> ids;
  for (BatchRequest& r : requests) ids.push_back(submit(std::move(r)));
  std::vector<std::vector<int32_t>> out(ids.size());
  while (busy()) {
    for (const BatchEvent& e : step()) {
      const auto i = static_cast<size_t>(std::find(ids.begin(), ids.end(), e.id) - ids.begin());
      if (i >= ids.size()) continue;
      if (e.token >= 0) out[i].push_back(e.token);
      if (e.finished && e.reason == FinishReason::kError) throw Error(e.error);
    }
  }
  return out;
}

}  // namespace tessera::runtime
