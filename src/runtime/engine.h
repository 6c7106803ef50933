// tessera/runtime/engine.h — one sequence's inference: chunked prefill, decode, generation.
//
//   auto model = tessera::runtime::Model::load("smollm2-135m.gguf");
//   tessera::runtime::EngineOptions options;
//   options.policy = policy;                       // empty: dense everywhere
//   tessera::runtime::Engine engine(*model, options);
//   tessera::runtime::GenerateOptions gen;
//   gen.max_new_tokens = 64;
//   std::vector<int32_t> out = engine.generate(prompt_ids, gen, [](int32_t t) {
//     std::cout << detokenize(t) << std::flush;
//     return true;  // false stops the generation
//   });
//
// The engine is the batched engine's scheduler (batch_engine.h) with one held sequence, over a BatchBackend: the
// CPU's (CpuBatchBackend) by default, or any other (the tensor-parallel CPU twin, a GPU backend). prefill() appends
// tokens at position() (a new conversation starts with reset()); chunks of chunk_size tokens go through the
// backend's staged prefill one after the other, each attending to all earlier keys under the attention policy
// (q_begin = the chunk's start, total_len = the length the sequence will have at the end of this prefill), and the
// keys and values then move into the sequence's KV blocks. decode() runs one token as the batched decode step of one
// row, attending densely over the blocks (the model's sliding windows apply). A prefill after decode steps (a chat's
// next turn) stages the sequence again from its blocks (BatchBackend::load_prefix). The KV pool is sized for one
// sequence of max_context tokens (capped at the backend's default KV budget); on the CPU its pages are touched only
// as blocks fill (GPU memory is committed when the pool is made). Errors are tessera::Error; after an error in a streamed prefill the memory may hold a partial chunk: call
// reset().
//
// The GPU engine (runtime/cuda/gpu_engine.h) is this class over the GPU's batched backend.
//
// Not thread-safe: one Engine serves one sequence at a time. Several Engines may share a Model, which must
// outlive them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "runtime/batch_engine.h"
#include "runtime/forward.h"
#include "runtime/generation.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "runtime/sampling.h"
#include "runtime/sequence_engine.h"
#include "runtime/stream/stream_options.h"
#include "runtime/stream/streaming_kv.h"

namespace tessera::runtime {

struct EngineOptions {
  int32_t chunk_size = 2048;     // prefill chunk length (tokens per forward pass)
  attn::AttentionPolicy policy;  // per layer and query head; empty table: dense everywhere
  int32_t max_context = 0;       // tokens the cache may hold; 0: the model's context length
  ThreadPool* pool = nullptr;    // null: ThreadPool::global()
  // The CPU KV cache's element type (--kv-type; runtime/kv_cache.h): bf16/f16 halve its bytes, converted per key
  // block as attention reads them. The GPU engine keeps its own (bf16).
  KVType kv_type = default_kv_type();
  // Called after every layer's attention during prefill (forward.h); empty: none. Evaluation uses it to measure
  // what a sparse policy would lose on the dense model's own activations.
  AttentionObserver observer;
  // Streaming memory (runtime/stream/stream_options.h): method != None reads prompts of any length in
  // stream.chunk-token chunks through a bounded attention workspace (chunk_size and the model's context limit are
  // then unused; max_context, when set, still bounds the sequence). Needs an empty policy and a model without
  // sliding-window layers.
  StreamOptions stream;
  // The GPU engine's knobs (runtime/device.h passes them to the device's engine; the CPU has none of these).
  struct Gpu {
    attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
    bool fp8_gemm = false;  // the layers' GEMMs in FP8 (gemm.h)
    // The decode step's products of up to 8 rows over a 4-bit copy of the layers' weights (w4_gemv.h; the prefill
    // and larger products stay bf16; widths must be multiples of 128).
    bool w4_decode = false;
    // The KV blocks in FP8 E4M3 with a scale per stored row (GpuBatchOptions::kv, paged_decode.h; --kv-type fp8 with
    // --device cuda): half the KV bytes of bf16. The CPU's KV type is kv_type above (f32, bf16, f16; no FP8).
    bool fp8_kv = false;
  } gpu;
};


class Engine : public SequenceEngine {
 public:
  using Progress = std::function<void(int64_t done, int64_t total)>;  // tokens prefilled so far, of total
  using OnToken = std::function<bool(int32_t token)>;                 // return false to stop

  // Over the CPU backend (CpuBatchBackend: options.pool, options.kv_type for the prefill's staging cache). Throws
  // tessera::Error when the policy does not fit the model ("attention policy has 30 layers x 9 query heads (3 kv
  // heads); model smollm2 has 24 layers x 9 query heads (3 kv heads)") or an option is out of range.
  explicit Engine(const Model& model, EngineOptions options = {});
  // Over another backend of the batched engine (e.g. CpuBatchBackend over parallel::ShardedCpuOps: the
  // tensor-parallel twin); `model` is what it runs (memory()'s weights).
  Engine(const Model& model, std::unique_ptr<BatchBackend> backend, EngineOptions options = {});
  ~Engine() override;

  // Appends `tokens` to the sequence and returns the logits of the last one ([vocab]). Throws tessera::Error
  // when a token id is outside the vocabulary or the sequence would exceed max_context:
  //   "prompt of 9000 tokens exceeds the context limit of 8192 tokens (model smollm2); pass a larger max
  //   context
  //    (--max-context) or shorten the prompt"
  std::vector<float> prefill(std::span<const int32_t> tokens, const Progress& progress = {}) override;

  // Appends one token, attends densely over the whole cache, returns its logits ([vocab]).
  std::vector<float> decode(int32_t token) override;

  // prefill(prompt), then sample / decode until max_new_tokens, a stop token or on_token returning false (or
  // the context is full). Returns the generated tokens (without the stop token). Continues from position():
  // reset() first for a new conversation. Every returned token is in the cache afterwards (the last one is
  // run without the LM head), the stop token is not: position() grows by prompt + generated tokens.
  std::vector<int32_t> generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                const OnToken& on_token = {}) override;

  // Like prefill, but returns the logits of every token ([tokens.size(), vocab], row-major). For tests.
  std::vector<float> forward_all_logits(std::span<const int32_t> tokens) override;

  // Like prefill, but returns, for i in [1, tokens.size()), the natural-log probability the model gives
  // tokens[i] after tokens[0..i) (and the cache's earlier tokens): tokens.size() - 1 values, for perplexity.
  // Logits are reduced chunk by chunk, so memory stays at one chunk of logits ([chunk_size, vocab] f32).
  std::vector<double> score(std::span<const int32_t> tokens, const Progress& progress = {}) override;

  void reset() override;  // empties the sequence (its blocks go back to the pool, their pages to the system)
  int32_t position() const override;
  int32_t max_context() const override { return max_context_; }
  const EngineStats& stats() const override { return stats_; }
  void reset_stats() override { stats_ = {}; }
  const Model& model() const { return *model_; }
  const EngineOptions& options() const { return options_; }
  size_t kv_cache_bytes() const override;
  EngineMemory memory() const override { return {model_->weights().bytes(), kv_cache_bytes(), 0, 0, 0}; }
  // The streaming memory, or null when options().stream.method is None.
  const StreamingKV* streaming() const override;
  const BatchEngine& scheduler() const { return *batch_; }

 protected:
  // Over a backend whose weights are not a host Model (the GPU engine, runtime/cuda/gpu_engine.h: model() must not
  // be called, memory() is its own). logits_chunk: rows per prefill chunk when every row's logits are wanted
  // (forward_all_logits, score; BatchEngineOptions::logits_chunk), 0: chunk_size.
  Engine(std::unique_ptr<BatchBackend> backend, EngineOptions options, int32_t logits_chunk);
  BatchBackend& backend() const { return *backend_; }
  // The held sequence's streaming memory (the backend's kind), or null.
  StreamMemory* stream_memory() const { return batch_->stream(seq_); }

 private:
  std::vector<float> run_prefill(std::span<const int32_t> tokens, LogitRows rows, const Progress& progress,
                                 const BatchEngine::ChunkLogits& on_logits = {}, std::vector<double>* scored = nullptr);
  std::vector<float> run_decode(int32_t token);

  const Model* model_ = nullptr;  // null: a device engine's (above)
  EngineOptions options_;
  int32_t max_context_ = 0;
  std::unique_ptr<BatchBackend> backend_;
  std::unique_ptr<BatchEngine> batch_;
  int64_t seq_ = 0;  // the held sequence
  EngineStats stats_;
};

}  // namespace tessera::runtime
