// tessera/runtime/cuda/gpu_engine.h — one sequence's inference on the GPU: runtime::Engine over the GPU's batched
// backend.
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
//   engine.memory();         // weights, KV blocks in use, scratch, peak device memory in use
//
// There is one single-sequence engine for every device: this is runtime::Engine (engine.h), the batched scheduler
// with one held sequence, over GpuBatchBackend (batch_gpu.h) — what `tessera run/bench/eval --device cuda`, Python
// and the server's batches run. Prefill: chunks of chunk_size tokens through the backend's staged prefill (the
// sparse executor over a contiguous staging cache, each chunk attending to all earlier keys under the policy), then
// the rows move into the sequence's KV blocks and the staging cache is freed; decode: the batched decode step of one
// row (fused QKV GEMM, paged flash-decoding, replayed as a CUDA graph); a next turn after decode steps is staged
// again from the blocks (load_prefix). Streaming memory (options.stream) keeps the KV in a GpuStreamingKV instead.
// Errors are tessera::Error with the CPU engine's messages (context limit, token ids); an error inside a prefill
// chunk names the chunk ("prefill of 16384 tokens, chunk [0, 4096) at position 0: ...").
//
// Memory: the KV blocks are one pool for a sequence of max_context tokens (capped at 70% of the free device memory
// when made: GpuBatchBackend::default_kv_bytes), allocated when the engine is made; during a prefill the staging
// cache holds the prompt's K/V contiguously beside it (the prompt's KV twice until the rows move into the blocks).
// Timing: prefill_seconds and decode_seconds are wall time up to the logits on the host (time to first token for a
// prefill, the move into the blocks included); gemm_seconds and attention_seconds are GPU time between CUDA events
// around every GEMM and every layer's attention of the prefill (decode steps replayed as graphs are not timed by
// category; with decode_graphs off they are), kernel_seconds() the small kernels.
//
// Not thread-safe; one engine per sequence; the DeviceModel must outlive it. Uses the current CUDA device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "runtime/engine.h"
#include "runtime/sequence_engine.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gemm.h"
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
  int32_t max_context = 0;        // tokens the sequence may hold; 0: the model's context length
  int32_t tile = 128;             // the executor's query tile in prefill (64 or 128)
  // kSimple (the tests' reference) also decodes through the prefill forward (batch_gpu.h), as do models whose shape
  // the paged decode kernel does not run (head dims other than 64, 128, 256; GQA groups over 8).
  AttentionBackend attention = AttentionBackend::kAuto;
  bool timing = true;             // CUDA events around GEMMs, attention (stats().gemm/attention_seconds) and the
                                  // small kernels (kernel_seconds())
  bool dense_fallback = true;     // sparse layers whose index costs more than dense run dense (gpu_forward.h)
  bool decode_graphs = true;      // decode steps replayed as CUDA graphs (GpuBatchOptions::graphs)
  // The layers' GEMMs (gemm.h), prefill and decode: bf16, or FP8 E4M3 (W8A8, per-row scales: one per output channel
  // and per token, TESSERA_FP8_SCALING=tensor for one per tensor; compute capability 8.9+, the constructor throws
  // check_gemm_precision_supported's error otherwise). FP8 quantizes the weights once per engine (DeviceFp8Weights:
  // ~1 byte per layer weight, beside the bf16 model) and each product's input per call. kW4: the prefill in bf16, the
  // decode step's products of up to 8 rows through a 4-bit copy of the layers' weights (DeviceW4Weights, w4_gemv.h:
  // ~0.53 bytes per layer weight beside the bf16 model; widths must be multiples of 128).
  GemmPrecision gemm = GemmPrecision::kBf16;
  // The decode blocks' element type (GpuBatchOptions::kv): bf16, or FP8 E4M3 with per-row scales (paged_decode.h).
  KVPrecision kv = KVPrecision::kBf16;
  // The CUDA attention backend's options (attention/index/prefill_route.h); default: the process defaults.
  attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
  // Streaming memory (runtime/stream/stream_options.h, the GPU twin: stream_gpu_kv.h): method != None reads prompts
  // of any length in stream.chunk-token chunks (chunk_size and the policy are then unused, and there is no context
  // limit but max_context when set, as on the CPU; the KV lives in the streaming workspace and evicted blocks in
  // pinned host memory).
  StreamOptions stream;
};

// The backend options of an engine with these options (what GpuEngine runs on).
GpuBatchOptions batch_options(const GpuEngineOptions& o);

using GpuMemoryStats = EngineMemory;  // every field (sequence_engine.h)

class GpuEngine final : public Engine {
 public:
  // Throws tessera::Error when the policy does not fit the model, an option is out of range or the KV blocks do not
  // fit the device memory.
  explicit GpuEngine(const DeviceModel& model, GpuEngineOptions options = {});
  ~GpuEngine() override;
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  const GpuKernelSeconds& kernel_seconds() const;
  void reset_stats() override;
  // weights (bf16 + the FP8 copy), KV (the blocks the sequence holds; streaming: its device buffers), scratch (the
  // prefill's and decode step's activations, GEMM workspaces, a staged prefill), peak in use, device total.
  GpuMemoryStats memory() const override;
  void reset_peak_memory() override { backend_.reset_peak(); }
  double peak_device_bytes() const override { return static_cast<double>(backend_.peak_device_bytes()); }
  const ModelConfig& config() const { return device_.config(); }
  const GpuEngineOptions& options() const { return gpu_options_; }
  size_t kv_cache_bytes() const override;
  // The streaming memory's decisions (the CPU path's StreamingKV: stats, retrieved blocks), or null when
  // options().stream.method is None; gpu_streaming() the GPU twin itself (copies, pinned memory).
  const StreamingKV* streaming() const override;
  const GpuStreamingKV* gpu_streaming() const { return gpu_stream_kv(stream_memory()); }
  GpuStreamingKV* gpu_streaming() { return gpu_stream_kv(stream_memory()); }
  // Streaming: allocates the pinned slabs a sequence of `tokens` tokens needs (on a host thread; wait: until done).
  void reserve_stream(int64_t tokens, bool wait);
  // Empties the sequence (reset()) and frees the scratch buffers (the next prefill allocates them again). The KV
  // blocks' pool stays.
  void release_memory();
  const GpuBatchBackend& batch_backend() const { return backend_; }

 private:
  GpuEngine(const DeviceModel& model, GpuEngineOptions options, std::unique_ptr<GpuBatchBackend> backend);

  const DeviceModel& device_;
  GpuEngineOptions gpu_options_;
  GpuBatchBackend& backend_;
  GpuKernelSeconds kernel_base_;             // the backend's at the last reset_stats()
  mutable GpuKernelSeconds kernel_seconds_;  // kernel_seconds()'s answer
};

}  // namespace tessera::runtime::gpu
