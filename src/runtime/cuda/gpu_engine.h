// tessera/runtime/cuda/gpu_engine.h — one sequence's inference on the GPU: the same API as runtime::Engine.
//
//   auto model = tessera::runtime::Model::load("smollm2.gguf");             // or an HF folder, safetensors
//   auto dev = tessera::runtime::gpu::DeviceModel::upload(*model);         // bf16 weights on the GPU
//   tessera::runtime::gpu::GpuEngineOptions options;
//   options.policy = policy;                                               // empty: dense everywhere
//   tessera::runtime::gpu::GpuEngine engine(*dev, options);
//   std::vector<float> logits = engine.prefill(prompt_ids);                // f32, [vocab], on the host
//   logits = engine.decode(next_id);
//   engine.stats();          // tokens, seconds; GEMM and attention seconds (GPU time, CUDA events)
//   engine.kernel_seconds(); // GPU time of the small kernels: norms, RoPE, activation, the rest
//   engine.memory();         // weights, KV cache, scratch, peak device memory in use
//
// Semantics follow runtime::Engine (engine.h): prefill appends at position() in chunks of chunk_size, each
// attending to all earlier keys under the policy (q_begin = chunk start, total_len = the sequence length at
// the end of this prefill); decode is one token with dense attention over the cache; generate samples with
// runtime::Sampler; errors are tessera::Error with the CPU engine's messages (context limit, token ids).
// The KV cache lives on the device in bf16 and grows like the CPU one. Timing: prefill_seconds and
// decode_seconds are wall time up to the logits on the host (time to first token for a prefill);
// gemm_seconds and attention_seconds are GPU time between CUDA events around every GEMM and every layer's
// attention (estimation, index and kernel), so their sum is at most the wall time; the rest is the small
// kernels (kernel_seconds(), also CUDA events), launches and copies.
//
// Not thread-safe; one engine per sequence; the DeviceModel must outlive it. Uses the current CUDA device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "runtime/engine.h"
#include "runtime/sequence_engine.h"
#include "runtime/cuda/device_kv_cache.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/gpu_decode.h"
#include "runtime/cuda/gpu_forward.h"
#include "runtime/cuda/stream_gpu_kv.h"

namespace tessera::runtime::gpu {

// Whether a CUDA device is usable in this process (false without a driver or device; never throws).
bool gpu_available();
// "NVIDIA H200 (sm_90, 139.8 GB)" for the current device, or the CUDA error.
std::string gpu_description();

struct GpuEngineOptions {
  int32_t chunk_size = 32768;     // prefill chunk (tokens per forward pass); <= 0: the whole prompt at once
  int32_t mlp_chunk = 16384;      // rows per MLP piece inside a chunk
  attn::AttentionPolicy policy;   // per layer and query head; empty table: dense everywhere
  int32_t max_context = 0;        // tokens the cache may hold; 0: the model's context length
  int32_t tile = 128;             // the executor's query tile in prefill (64 or 128)
  AttentionBackend attention = AttentionBackend::kAuto;
  bool timing = true;             // CUDA events around GEMMs, attention (stats().gemm/attention_seconds) and the
                                  // small kernels (kernel_seconds())
  bool dense_fallback = true;     // sparse layers whose index costs more than dense run dense (gpu_forward.h)
  // Decode steps (without streaming) run as the batched engine's decode step over the contiguous cache
  // (gpu_decode.h) where the paged kernel runs the model (head dims 64, 128, 256; GQA groups up to 8; not with the
  // simple attention backend), replayed as CUDA graphs when this is on (their kernels are then not timed by category).
  bool decode_graphs = true;
  // The layers' GEMMs (gemm.h): bf16, or FP8 E4M3 (W8A8, per-row scales: one per output channel and
  // per token, TESSERA_FP8_SCALING=tensor for one per tensor; compute capability 8.9+, the
  // constructor throws check_gemm_precision_supported's error otherwise). FP8 quantizes the weights once per engine
  // (DeviceFp8Weights: ~1 byte per layer weight, beside the bf16 model) and each product's input per call.
  GemmPrecision gemm = GemmPrecision::kBf16;
  // The CUDA attention backend's options (attention/index/prefill_route.h); default: the process defaults.
  attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
  // Streaming memory (runtime/stream/stream_options.h, the GPU twin: stream_gpu_kv.h): method != None reads prompts
  // of any length in stream.chunk-token chunks (chunk_size and the policy are then unused, and there is no context
  // limit but max_context when set, as on the CPU; the KV lives in the streaming workspace and evicted blocks in
  // pinned host memory).
  StreamOptions stream;
};

// GPU time of the small kernels within prefill and decode (CUDA events around each launch; 0 without timing).
struct GpuKernelSeconds {
  double norm = 0;        // RMSNorms (before attention and MLP, Gemma-3's post-norms, final)
  double rope = 0;        // RoPE tables, QK-norm + RoPE of q and k
  double activation = 0;  // the gated MLP's activation
  double misc = 0;        // embedding, QKV bias, logit softcap
  double total() const { return norm + rope + activation + misc; }
};

using GpuMemoryStats = EngineMemory;  // every field (sequence_engine.h)

class GpuEngine final : public SequenceEngine {
 public:
  using Progress = std::function<void(int64_t done, int64_t total)>;
  using OnToken = std::function<bool(int32_t token)>;

  // Throws tessera::Error when the policy does not fit the model or an option is out of range.
  explicit GpuEngine(const DeviceModel& model, GpuEngineOptions options = {});
  ~GpuEngine();
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  std::vector<float> prefill(std::span<const int32_t> tokens, const Progress& progress = {}) override;
  std::vector<float> decode(int32_t token) override;
  std::vector<int32_t> generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                const OnToken& on_token = {}) override;
  // Like prefill, but the logits of every token ([tokens.size(), vocab], row-major). For tests.
  std::vector<float> forward_all_logits(std::span<const int32_t> tokens) override;
  // Log-probabilities of each next token (sequence_engine.h), through forward_all_logits in pieces of 2,048 rows.
  std::vector<double> score(std::span<const int32_t> tokens, const Progress& progress = {}) override;

  void reset() override;
  int32_t position() const override { return position_; }
  int32_t max_context() const override { return max_context_; }
  const EngineStats& stats() const override { return stats_; }
  const GpuKernelSeconds& kernel_seconds() const { return kernel_seconds_; }
  void reset_stats() override {
    stats_ = {};
    kernel_seconds_ = {};
  }
  GpuMemoryStats memory() const override;
  void reset_peak_memory() override { forward_->reset_peak(); }
  double peak_device_bytes() const override { return static_cast<double>(memory().peak_in_use_bytes); }
  const ModelConfig& config() const { return model_.config(); }
  const GpuEngineOptions& options() const { return options_; }
  size_t kv_cache_bytes() const override;  // streaming: its device buffers
  // The streaming memory's decisions (the CPU path's StreamingKV: stats, retrieved blocks), or null when
  // options().stream.method is None; gpu_streaming() the GPU twin itself (copies, pinned memory).
  const StreamingKV* streaming() const override { return streaming_ ? &streaming_->decisions() : nullptr; }
  const GpuStreamingKV* gpu_streaming() const { return streaming_.get(); }
  GpuStreamingKV* gpu_streaming() { return streaming_.get(); }
  // Streaming: allocates the pinned slabs a sequence of `tokens` tokens needs (on a host thread; wait: until done).
  void reserve_stream(int64_t tokens, bool wait);
  // Frees the KV cache and the scratch buffers (the next prefill allocates them again); resets position().
  void release_memory();

 private:
  std::vector<float> run_prefill(std::span<const int32_t> tokens, LogitRows rows, const Progress& progress);
  std::vector<float> run_decode(int32_t token, LogitRows rows);
  void add_timers();
  void discard_timers() noexcept;  // after an error: waits for the stream, drops the recorded events

  const DeviceModel& model_;
  GpuEngineOptions options_;
  int32_t max_context_ = 0;
  int32_t position_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<DeviceFp8Weights> fp8_;  // GemmPrecision::kFp8
  EventTimer timer_;
  DeviceKVCache cache_;
  std::unique_ptr<GpuForward> forward_;
  std::unique_ptr<GpuDecode> decode_;  // null: decode through forward_
  std::unique_ptr<GpuStreamingKV> streaming_;
  EngineStats stats_;
  GpuKernelSeconds kernel_seconds_;
};

}  // namespace tessera::runtime::gpu
