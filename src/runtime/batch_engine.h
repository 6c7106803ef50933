// tessera/runtime/batch_engine.h — many sequences on one device: continuous batching over a paged KV cache.
//
//   runtime::CpuBatchBackend backend(*model);                  // or runtime::gpu::GpuBatchBackend (GPU)
//   runtime::BatchEngineOptions options;
//   options.kv_bytes = 2e9;                                    // the KV budget; blocks = kv_bytes / block size
//   runtime::BatchEngine engine(backend, options);
//   int64_t a = engine.submit({prompt_a, gen_a});              // tessera::Error if it can never fit
//   int64_t b = engine.submit({prompt_b, gen_b, policy_b});    // a request may bring its own attention policy
//   while (engine.busy())
//     for (const runtime::BatchEvent& e : engine.step()) ...   // tokens and finishes, in order
//
// A step (the scheduler, shared by the CPU and GPU backends):
//  1. cancellations (cancel(id)) take effect: a waiting request leaves, one in prefill stops between chunks, a
//     decoding one leaves; their blocks return to the pool;
//  2. admission by memory, first come first served: the oldest waiting request starts its prefill when no other
//     prefill runs, fewer than max_batch sequences run, and the pool has, beyond what running sequences have
//     reserved, every block the request can ever hold (prompt + max_new_tokens under its retention:
//     SequenceBlocks::max_blocks) — so a sequence once admitted never runs out of blocks, and nothing is
//     preempted. A request that could not fit even in an empty pool is refused by submit() with the numbers.
//     A dense request whose prompt starts with cached KV blocks (prefix caching, BatchEngineOptions::prefix_cache)
//     adopts them: its prefill starts after them;
//  3. one prefill chunk (chunk_size tokens) of the sequence in prefill, under its attention policy, attending to
//     all its earlier keys (chunked prefill: the backend stages the prompt's K/V contiguously, as the
//     single-sequence engines do, and moves the kept rows into blocks when the prompt ends); a finished prompt
//     samples its first token. With a token budget (BatchEngineOptions::step_tokens) the chunk is what the budget
//     leaves beside the decoding rows, and a prompt that ends lets the next waiting one start in the same step;
//  4. one decode token of every decoding sequence, all in one batched forward (batch_forward.h), each sequence
//     attending through its block tables with its own per-head retention (MoA spans, sliding windows).
// Sampling is per request (its own seed: the tokens do not depend on what else runs), stop tokens end a request
// without being reported, as in runtime::generate_tokens; so do max_new_tokens and a full context. The tokens of
// a request are those the single-sequence engine generates for it alone (up to floating-point summation order).
//
// Not thread-safe: one thread calls submit / cancel / step.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "runtime/batch_forward.h"
#include "runtime/forward.h"
#include "runtime/generation.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "runtime/paged_kv.h"
#include "runtime/prefix_cache.h"
#include "runtime/sampling.h"
#include "runtime/stream/stream_options.h"
#include "runtime/stream/streaming_kv.h"

namespace tessera::runtime {

// The device side of the batched engine: the KV blocks' storage, one staged prefill, the batched decode.
class BatchBackend {
 public:
  virtual ~BatchBackend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const char* device_name() const = 0;  // "cpu", "cuda"
  virtual double block_bytes(const PagedKVShape& shape) const = 0;  // K and V of one block
  // The KV budget when none is given: CPU, a quarter of the host memory budget; GPU, 70% of the free device memory.
  virtual double default_kv_bytes() const = 0;
  // Allocates the blocks' storage (once, before anything else) for at most max_sequences sequences of at most
  // max_context tokens at once. Throws tessera::Error when it cannot.
  virtual void create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                            int32_t max_context) = 0;
  // Runs tokens at [pos, pos + n) of the staged sequence (pos == 0 starts a new one), attending to all its
  // earlier keys under `policy` (null: dense) with total_len the prompt's length; returns the last token's
  // logits when `logits` is set.
  virtual std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                           const attn::AttentionPolicy* policy, bool logits) = 0;
  // As prefill_chunk, returning the logits of every row of the chunk ([n, vocab]): the prompt's log-probabilities
  // (BatchRequest::prompt_logprobs). This default refuses ("... not available on this backend").
  virtual bool supports_prompt_logits() const { return false; }
  virtual std::vector<float> prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                const attn::AttentionPolicy* policy);
  // As prefill_chunk_rows, each row r < next.size() reduced to the natural-log probability of next[r] (the token
  // that follows it; next.size() <= n), in f64: the perplexity's numbers without the [n, vocab] logits leaving the
  // backend. This default reduces prefill_chunk_rows's logits on the host (next_token_logprobs); the GPU's on the
  // device.
  virtual std::vector<double> prefill_chunk_logprobs(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                     const attn::AttentionPolicy* policy,
                                                     std::span<const int32_t> next);
  // Moves the staged rows [0, seq.length()) that seq keeps into its blocks, then frees the staging memory; from
  // now on seq decodes with `views` (decode_views layout) until release_sequence(seq).
  virtual void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) = 0;
  // seq has ended (its blocks go back to the pool, the scheduler's business); forget what was kept for it.
  virtual void release_sequence(const SequenceBlocks& seq) = 0;
  // Drops the staged sequence (cancelled or failed mid-prefill).
  virtual void abort_prefill() = 0;
  // Prefix caching (BatchEngineOptions::prefix_cache): stages rows [0, rows) of seq's blocks (a cached prefix it
  // adopted) as a new sequence of total_len tokens, whose next prefill_chunk runs at pos = rows. Backends that
  // cannot say false to supports_prefix_cache (the engine then caches nothing); this default refuses.
  virtual bool supports_prefix_cache() const { return false; }
  // BatchEngineOptions::exact_decode: a backend whose decode can add in the prefill's order does (the CPU's: a decoded
  // row then equals the same row prefilled, so a later turn over cached blocks gives the uncached run's answer), at
  // its cost; others ignore it.
  virtual void set_exact_decode(bool) {}
  virtual void load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len);
  // Streaming memory (BatchEngineOptions::stream): one streamed sequence's memory, of this backend's kind (the CPU: a
  // StreamingKV; the GPU: device memory over pinned host blocks). Throws tessera::Error for options the backend cannot
  // run. This default refuses: "streaming memory: the <device> batched backend has none".
  virtual std::unique_ptr<StreamMemory> new_stream(const StreamOptions& options);
  // A prefill chunk of the sequence whose keys and values `kv` (from new_stream) holds, at [pos, pos + n) (pos ==
  // kv.sequence_length()), of the given kind; the last token's logits when `logits` is set. The batched decode of
  // streamed sequences is decode() / decode_select() with DecodeRow::stream set.
  virtual std::vector<float> prefill_stream_chunk(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                                  StreamingKV::ChunkKind kind, bool logits);
  // As prefill_stream_chunk, returning the logits of every row ([n, vocab]); this default refuses.
  virtual std::vector<float> prefill_stream_chunk_rows(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                                       StreamingKV::ChunkKind kind);
  // As prefill_stream_chunk_rows, reduced as prefill_chunk_logprobs (this default: on the host).
  virtual std::vector<double> prefill_stream_chunk_logprobs(StreamMemory& kv, std::span<const int32_t> tokens,
                                                            int32_t pos, StreamingKV::ChunkKind kind,
                                                            std::span<const int32_t> next);
  // Called after every layer's attention of the prefill chunks that follow (runtime/forward.h; null: none); the
  // single-sequence engine's EngineOptions::observer. This default refuses a non-null one.
  virtual void set_observer(const AttentionObserver* observer);
  // One token per row, each at position rows[i].seq->length() - 1 (blocks already grown); logits [B, vocab].
  virtual std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) = 0;
  // The scheduler's decode step: as decode(), then each row's next token chosen from its logits by its sampling
  // options: temperature <= 0, runtime::argmax; else runtime::sample_token(logits, options, u) with the row's
  // uniform draw u (taken from the sequence's Sampler, so that the stream is the single-sequence engine's). This
  // default runs decode() and chooses on the host (the sampled rows in parallel on the thread pool); the GPU
  // backend chooses on the device and copies back only the tokens.
  // The row's logits get `edits` (Sampler::edits: penalties and logit_bias, logit_edit.h) before the choice; with
  // logprobs >= 0 the backend writes the chosen token's token_logprobs(raw logits, token, logprobs) to *logprobs_out.
  struct RowChoice {
    SamplingOptions options;
    double u = 0.0;
    std::vector<LogitEdit> edits{};
    int32_t logprobs = -1;
    TokenLogprobs* logprobs_out = nullptr;
  };
  virtual std::vector<int32_t> decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                             std::span<const RowChoice> choice);
  // Whether the engine runs the mixed step when BatchEngineOptions::mixed_step is unset: where one forward over the
  // chunk and the decode rows pays. The CPU says no (its step is bound by arithmetic, the mixed step measured within
  // the noise, and the stored-weight products of a decode row beside a chunk round otherwise than alone); the GPU yes.
  virtual bool mixed_step_by_default() const { return false; }
  // The mixed step (BatchEngineOptions::mixed_step): a prefill chunk of the staged sequence (as prefill_chunk: tokens
  // `chunk` at [pos, pos + n), total_len, policy; its last row's logits into *chunk_logits when `logits`, else it is
  // left empty) and a decode step of paged rows (as decode_select: their chosen tokens returned) in one call. A
  // backend that mixes (mixes() true: the CPU's, the GPU's) runs them as ONE forward over the chunk's rows and the
  // decode rows together — every product, norm and the head once over all of them, the attention split: the chunk's
  // rows through the prefill path under its policy, the decode rows through the paged decode — so that a step that
  // carries a prefill chunk costs one forward, not two. This default runs prefill_chunk then decode_select.
  virtual bool mixes() const { return false; }
  virtual std::vector<int32_t> mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                          const attn::AttentionPolicy* policy, bool logits,
                                          std::vector<float>* chunk_logits, std::span<const int32_t> tokens,
                                          std::span<const DecodeRow> rows, std::span<const RowChoice> choice);
  // Decode steps that had to build a new executable step (a CUDA graph capture) before running: the GPU backend's
  // cost of a batch shape it had not seen; 0 on the CPU.
  virtual int64_t step_builds() const { return 0; }
  virtual ForwardTimers timers() const = 0;
  // Gives the memory behind the KV blocks back to the system while no block is in use (the single-sequence engine's
  // reset(): otherwise a next, long prompt would hold its staging cache beside the pages the last one's blocks left
  // resident). The default keeps it.
  virtual void release_free_memory() {}

 protected:
  // decode_select's choice on the host: row i's token from logits [B, vocab] by choice[i] (edits, then argmax or
  // sample_token; logprobs), the sampled rows in parallel on the thread pool.
  std::vector<int32_t> choose_on_host(std::span<const float> logits, std::span<const RowChoice> choice) const;
};

// The CPU backend: prefill through runtime::Forward into a contiguous staging cache, decode through BatchForward.
class CpuBatchBackend final : public BatchBackend {
 public:
  // kv_type: the element type of the KV blocks and of the staged prefill's contiguous cache (EngineOptions::kv_type,
  // --kv-type; default_kv_type() when not given).
  explicit CpuBatchBackend(const Model& model, ThreadPool* pool = nullptr, KVType kv_type = default_kv_type());
  // The same over another CPU backend of the recipe: parallel::ShardedCpuOps (the tensor-parallel twin, whose
  // prefill chunks and batched decode steps run every rank's shard; parallel/tp_forward_cpu.h).
  CpuBatchBackend(const Model& model, ThreadPool* pool, std::unique_ptr<CpuOps> ops);
  const ModelConfig& config() const override { return model_.config(); }
  const char* device_name() const override { return "cpu"; }
  double block_bytes(const PagedKVShape& shape) const override {
    return PagedKVStore::bytes_per_block(shape, kv_type_);
  }
  double default_kv_bytes() const override;
  void create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                    int32_t max_context) override;
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override;
  bool supports_prompt_logits() const override { return true; }
  std::vector<float> prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                        const attn::AttentionPolicy* policy) override;
  void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) override;
  void release_sequence(const SequenceBlocks&) override {}
  void abort_prefill() override;
  bool supports_prefix_cache() const override { return true; }
  void set_exact_decode(bool on) override { decode_.set_prefill_order(on); }
  void load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) override;
  std::unique_ptr<StreamMemory> new_stream(const StreamOptions& options) override;
  std::vector<float> prefill_stream_chunk(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                          StreamingKV::ChunkKind kind, bool logits) override;
  std::vector<float> prefill_stream_chunk_rows(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                               StreamingKV::ChunkKind kind) override;
  void set_observer(const AttentionObserver* observer) override {
    prefill_.set_observer(observer);
    observer_ = observer;
  }
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) override;
  // One forward (BatchForward::mixed); streamed rows go through the default (two calls).
  bool mixes() const override { return true; }
  std::vector<int32_t> mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                  const attn::AttentionPolicy* policy, bool logits, std::vector<float>* chunk_logits,
                                  std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                  std::span<const RowChoice> choice) override;
  ForwardTimers timers() const override { return timers_; }
  void release_free_memory() override { store_.release_pages(); }
  const PagedKVStore& store() const { return store_; }

 private:
  void begin_staging(int32_t total_len);  // a fresh staging cache for a prompt of total_len tokens
  const Model& model_;
  ThreadPool& pool_;
  Forward prefill_;
  BatchForward decode_;
  KVType kv_type_ = KVType::F32;
  KVCache staging_;
  int64_t staged_from_ = 0;  // rows below it were staged from the sequence's own blocks (load_prefix)
  PagedKVStore store_;
  ForwardTimers timers_;
  const AttentionObserver* observer_ = nullptr;
};

struct BatchEngineOptions {
  int32_t chunk_size = 2048;    // prefill chunk (tokens per step of the sequence in prefill)
  int32_t block_tokens = 64;    // rows per KV block
  double kv_bytes = 0;          // KV budget in bytes (blocks = kv_bytes / block size); 0: room for max_batch
                                // sequences of max_context tokens, dense, capped at the backend's default_kv_bytes
  int32_t max_batch = 64;       // most sequences running (prefill + decode) at once
  int32_t max_context = 0;      // tokens a sequence may reach; 0: the model's context length
  attn::AttentionPolicy policy; // the default policy of requests that bring none; empty: dense
  // Streaming memory for every request (method != None): each sequence keeps its keys and values in its own
  // StreamingKV (evicted blocks in host memory, host_budget per sequence) instead of KV blocks, its prompt read in
  // stream.chunk-token chunks, and the decode steps batch the streamed sequences (the products once over all rows,
  // each row attending through its own memory). Needs the default (empty) policy and requests without a policy; no
  // context limit but max_context when set. The CPU and GPU backends run it (BatchBackend::new_stream).
  StreamOptions stream;
  // Automatic prefix caching (runtime/prefix_cache.h): the full KV blocks of densely prefilled prompts (at the end
  // of their prefill) and of finished sequences (prompt and generated tokens) stay in the pool, found again by
  // their tokens; a dense request whose prompt starts with cached blocks adopts them and prefills only the rest.
  // Cached blocks no sequence holds go, least recently used first, when a sequence needs room. Where the backend
  // supports it (CPU, CUDA); not with streaming memory.
  bool prefix_cache = true;
  // Decode rows whose attention adds in the prefill's order (CPU: runtime::decode_in_prefill_order; ~3x the decode
  // step's attention time), so that a row's KV and logits are the same bits decoded or prefilled: answers then do not
  // depend on the prefix cache (a cached run equals an uncached one, both with it). The server's engines keep it on;
  // the single-sequence engine (tessera run, bench, eval) turns it off. TESSERA_DECODE_ORDER overrides either.
  bool exact_decode = true;
  // A token budget per step (vLLM's chunked prefill, SGLang's mixed batches; 0: none, one prefill chunk of
  // chunk_size tokens per step beside the decodes): each step carries one token of every decoding sequence and
  // prefill tokens up to the rest of the budget, so that a long prompt arriving does not stretch the decoding
  // sequences' steps. Prompts are prefilled one after the other within the budget: one that ends within a step
  // (counting the decode token it then brings) lets the next waiting request start in the same step. chunk_size
  // still caps one prefill chunk. Must be more than max_batch (a prefill then always gets a token); not with
  // streaming memory (its prompt chunks are its own).
  int32_t step_tokens = 0;
  // Held sequences (extend with LogitRows::All): rows per prefill chunk when every row's logits are wanted, so that
  // [rows, vocab] f32 stays bounded whatever chunk_size is; 0: chunk_size.
  int32_t logits_chunk = 0;
  // The mixed step: a step that has a prefill chunk and decoding sequences runs them through one call of the
  // backend (BatchBackend::mixed_step; on the CPU and the GPU one forward over the chunk's rows and the decode rows
  // together) instead of the chunk's forward and then the decode step's. The decode rows are those decoding when the
  // step's first prefill chunk runs; a prompt that ends in that chunk decodes from the next step on (without the
  // mixed step, in the same step). The tokens of every request are the same either way (up to floating-point
  // summation order: see BatchBackend::mixed_step). Not for a chunk whose every row's logits are wanted
  // (BatchRequest::prompt_logprobs) nor with streaming memory (those run apart). false: the chunk, then the decode
  // step (the side-by-side). Unset: the backend's choice (BatchBackend::mixed_step_by_default: the GPU on, the CPU
  // off); TESSERA_MIXED_STEP=0 / 1 in the environment turns it off / on in every engine, e.g. `serve`'s.
  std::optional<bool> mixed_step;
};

struct BatchRequest {
  std::vector<int32_t> prompt;
  GenerateOptions options;                      // max_new_tokens >= 1, sampling (seed), stop tokens
  std::optional<attn::AttentionPolicy> policy;  // none: the engine's
  // >= 0: the log-probability of every prompt token after the first, with its `prompt_logprobs` most likely
  // alternatives (token_logprobs), in an event before the first token's (BatchEvent::prompt_logprobs): the echo of
  // /v1/completions with logprobs (lm-evaluation-harness's log-likelihoods). Such a prompt is prefilled whole (no
  // cached prefix) in chunks of at most 2^25 / vocab rows (their logits). Not with streaming memory.
  int32_t prompt_logprobs = -1;
};

enum class FinishReason { kLength, kStop, kContextFull, kCancelled, kError };
const char* finish_reason_name(FinishReason r);  // "length", "stop", "context_full", "cancelled", "error"

struct BatchEvent {
  int64_t id = 0;
  int32_t token = -1;  // >= 0: a generated token
  bool finished = false;
  FinishReason reason = FinishReason::kLength;  // when finished
  std::string error;                            // when reason == kError
  std::optional<TokenLogprobs> logprobs{};      // a token's, when its request asked (GenerateOptions::logprobs)
  int32_t cached_tokens = -1;                   // the request's first event: prompt tokens taken from the prefix cache
  // BatchRequest::prompt_logprobs: entry i for prompt[i + 1], in an event of its own (token -1) before the first
  // token's.
  std::optional<std::vector<TokenLogprobs>> prompt_logprobs{};
};

struct BatchEngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t max_decode_batch = 0;
  int64_t decode_steps = 0;     // steps that ran a decode (some steps only prefill)
  int64_t greedy_tokens = 0;    // decode tokens of greedy rows (the rest were sampled)
  int64_t cached_tokens = 0;    // prompt tokens taken from the prefix cache (not prefilled)
  int64_t prefix_hits = 0;      // requests that took some
  int64_t prefix_evictions = 0; // cached blocks (entries) dropped for room
  int64_t last_step_tokens = 0; // tokens the last step ran: prefill tokens + decode rows
  int64_t max_step_tokens = 0;  // the most of any step (<= step_tokens when it is set)
  int64_t prefill_chunks = 0;   // prefill chunks run (a step may run several with step_tokens)
  int64_t mixed_steps = 0;      // steps whose decode rows ran with a prefill chunk (BatchEngineOptions::mixed_step);
                                // such a step's time counts as prefill_seconds
};

class BatchEngine {
 public:
  // Allocates the KV blocks through the backend. Throws tessera::Error for options out of range or a policy that
  // does not fit the model.
  BatchEngine(BatchBackend& backend, BatchEngineOptions options = {});
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // Queues a request; returns its id. Throws tessera::Error (and queues nothing) for an empty prompt, token ids
  // outside the vocabulary, a prompt + max_new_tokens over the context limit, max_new_tokens < 1, a policy that
  // does not fit the model, or a request whose KV could never fit the pool:
  //   "request needs 1,024 KV blocks (64 tokens each; 8.39 MB) but the KV budget holds 512 blocks (4.19 MB)..."
  int64_t submit(BatchRequest request);
  // Ends the request at the next step (its blocks return to the pool); false if no such request is queued or
  // running.
  bool cancel(int64_t id);
  // One scheduler step (see above); returns what happened, in order. A request whose prefill or decode fails ends
  // with kError and its message; the others go on. `early`, when set, gets the events of the step's prefill part (a
  // prompt's first token) before a decode step that runs on its own, so that the first token does not wait for the
  // decode of every running request (the same events, in the same order, split in two; a mixed step's decode rows
  // run in the chunk's forward, so there is nothing to wait for). It must not call into the engine.
  using EarlyEvents = std::function<void(std::vector<BatchEvent>&)>;
  std::vector<BatchEvent> step(const EarlyEvents& early = {});
  bool busy() const { return !waiting_.empty() || !running_.empty(); }

  // Runs every request to its end; returns each one's tokens, in submission order. For tests and benches.
  std::vector<std::vector<int32_t>> generate_all(std::vector<BatchRequest> requests);

  int32_t waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t running() const { return static_cast<int32_t>(running_.size()); }
  const BlockPool& blocks() const { return pool_; }
  int64_t reserved_blocks() const { return reserved_; }
  double block_bytes() const { return block_bytes_; }
  const PagedKVShape& shape() const { return shape_; }
  int32_t max_context() const { return max_context_; }
  const BatchEngineStats& stats() const { return stats_; }
  // The KV memory the running sequences hold: their blocks, or with streaming memory their workspaces, host stores
  // and indexes.
  double kv_bytes_in_use() const;
  // The prefix cache: its entries (one per cached logical block) and the block ids it holds; the bytes of the blocks
  // only it holds (free for the taking: not counted in kv_bytes_in_use).
  const PrefixCache& prefix_cache() const { return prefix_cache_; }
  double prefix_cache_bytes() const;
  int64_t step_builds() const { return backend_.step_builds(); }
  // Whether requests may ask for their prompt's log-probabilities (BatchRequest::prompt_logprobs): the backend gives
  // every row's logits, and no streaming memory.
  bool supports_prompt_logprobs() const { return !streaming() && backend_.supports_prompt_logits(); }

  // ---- Held sequences: the single-sequence API (runtime/engine.h) is this scheduler with one request ----
  // A held sequence is opened empty and stays until close(), growing by calls rather than by steps: extend() prefills
  // tokens after what it holds, in chunk_size chunks through the backend's staged prefill under the engine's policy
  // (a sequence that holds tokens already, after decode steps, is staged again from its own blocks by load_prefix, as
  // a prefix-cache hit is); its rows move into its blocks at the next decode_one() or extend() (so that extend returns
  // its logits — the first token — before that copy); decode_one() runs one token as a decode step of one row.
  // It decodes densely (the model's sliding windows apply; the policy shapes the prefill only). With streaming
  // memory its keys and values live in the backend's StreamMemory. step() never touches held sequences; their blocks
  // come from the pool as they grow (nothing is reserved in advance). Errors are tessera::Error with the
  // single-sequence engine's messages (empty prompt, token ids, context limit); an error inside a chunk is prefixed
  // with where it happened ("prefill of 16384 tokens, chunk [0, 4096) at position 0: ..."). A failed extend leaves a
  // paged sequence as it was (a streamed one may hold part of it: clear() it). decode_one() on an empty sequence
  // decodes its first token (no prefill needed).
  using Progress = std::function<void(int64_t done, int64_t total)>;
  // rows == All: each chunk's logits go to on_logits(first token index, chunk rows, logits) when it is set, else into
  // the returned vector; Last: the last token's logits; None: nothing.
  using ChunkLogits = std::function<void(int64_t first, int64_t rows, const std::vector<float>& logits)>;
  // scored (rows == All, no on_logits): for i in [1, n), log p(tokens[i] | everything before it) is appended, the
  // rows reduced by the backend (prefill_chunk_logprobs: on the GPU no logits leave it).
  int64_t open();
  std::vector<float> extend(int64_t id, std::span<const int32_t> tokens, LogitRows rows, const Progress& progress = {},
                            const ChunkLogits& on_logits = {}, std::vector<double>* scored = nullptr);
  std::vector<float> decode_one(int64_t id, int32_t token);  // its logits ([vocab])
  void clear(int64_t id);                                    // empties it (its blocks go back to the pool)
  void close(int64_t id);
  int64_t length(int64_t id) const;
  StreamMemory* stream(int64_t id) const;  // its streaming memory, or null without streaming

 private:
  struct Sequence;
  void admit();
  void finish(Sequence& s, FinishReason reason, std::vector<BatchEvent>& events, std::string error = {});
  // After the prefill's logits for s: sample, then take_token.
  void take_logits(Sequence& s, std::span<const float> logits, std::vector<BatchEvent>& events);
  // s's next token: a token event and/or a finish.
  void take_token(Sequence& s, int32_t tok, std::vector<BatchEvent>& events,
                  std::optional<TokenLogprobs> logprobs = std::nullopt);
  // One prefill chunk of at most max_tokens tokens of the sequence in prefill (none: 0); returns the tokens run, and
  // sets *ended when its prompt ended (it then decodes in this step unless it already finished).
  int64_t prefill_step(std::vector<BatchEvent>& events, int64_t max_tokens, bool* ended = nullptr);
  // The prefill part of a step under options.step_tokens, `decoding` rows taken already; returns the tokens run.
  int64_t budgeted_prefill(std::vector<BatchEvent>& events, int64_t decoding);
  // Returns the rows decoded.
  int64_t decode_step(std::vector<BatchEvent>& events);
  // The decode part of a step: the batch (sequences decoding with a pending token), its rows and choices
  // (prepare_decode: blocks grown, uniform draws taken), the chosen tokens (finish_decode: events; every row ends
  // with kError when the step failed).
  struct DecodeBatch;
  void collect_decode(DecodeBatch& b) const;
  void prepare_decode(DecodeBatch& b);
  void finish_decode(DecodeBatch& b, std::vector<BatchEvent>& events);
  // The step's decode batch, when it is to ride with the step's first prefill chunk (options.mixed_step); null
  // otherwise.
  DecodeBatch* ride_ = nullptr;
  bool mixed_ = false;  // the mixed step runs (options_.mixed_step, else the backend's default; the environment)
  bool streaming() const { return options_.stream.method != StreamMethod::None; }
  Sequence& held(int64_t id) const;
  // Whether s's blocks are cached and may come from the cache: dense, not streamed, the backend can.
  bool cacheable(const Sequence& s) const;
  // A held sequence's last extend, still staged, into its blocks (it decodes from them from now on).
  void finish_staged(Sequence& s);
  // Frees cached blocks until `n` are free (when the pool has fewer).
  void make_room(int64_t n);

  BatchBackend& backend_;
  BatchEngineOptions options_;
  const ModelConfig& cfg_;
  int32_t max_context_ = 0;
  PagedKVShape shape_;
  double block_bytes_ = 0;
  BlockPool pool_;
  PrefixCache prefix_cache_;
  int64_t reserved_ = 0;  // blocks promised to running sequences
  int64_t next_id_ = 1;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::vector<std::unique_ptr<Sequence>> held_;
  BatchEngineStats stats_;
};

}  // namespace tessera::runtime
