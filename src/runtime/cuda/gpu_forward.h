// tessera/runtime/cuda/gpu_forward.h — one chunk of tokens through the model on the GPU.
//
// The layer recipe (runtime/recipe.h) over the CUDA backend (gpu_ops.h: bf16 activations, the residual stream in
// f32, FP8 GEMMs when asked for) for the chunk's n tokens at positions [pos, pos + n), with one of two attention
// steps:
//  - the device KV cache: K and V go straight into its rows [pos, pos + n), and each layer attends under the policy
//    (patterns as the CPU Forward takes them; no policy: all dense) through gpu_attention.h's contiguous route
//    (the sparse executor, or the simple kernel);
//  - a GpuKVPolicy (streaming memory) that holds the keys and values and rotates q and k itself.
// The final norm and the LM head (f32 logits) run only on the rows asked for. No buffer is S x S or S x vocab
// (unless every row's logits are asked for); the MLP's [rows, 2F] buffer is bounded by mlp_chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "runtime/cuda/device_kv_cache.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/gpu_attention.h"
#include "runtime/cuda/gpu_ops.h"

namespace tessera::runtime::gpu {

enum class LogitRows { kNone, kLast, kAll };

// A KV-cache policy that owns the keys and values of the GPU forward (runtime/cuda/stream_gpu_kv.h: streaming
// memory), the GPU twin of runtime/forward.h's KVPolicy. Layer `layer` of the chunk at [pos, pos + n): q
// [n, q_heads, d], k and v [n, kv_heads, d], bf16 on the device, contiguous, after the bias and QK-norm (Gemma-3)
// and before RoPE (q and k may be overwritten); inv_freq: the layer's RoPE frequencies on the device (Gemma-3: its
// local or global base), inv_freq_host the same on the host.
// Writes the attention output [n, q_heads, d] (bf16) to out, on `stream`.
class GpuKVPolicy {
 public:
  virtual ~GpuKVPolicy() = default;
  virtual void attend(int32_t layer, int32_t pos, int32_t n, bf16* q, bf16* k, bf16* v, const float* inv_freq,
                      std::span<const float> inv_freq_host, float scale, bf16* out, cudaStream_t stream) = 0;
};

struct ForwardOptions {
  int32_t mlp_chunk = 16384;  // rows per MLP piece
  int32_t tile = 128;         // query tile of the executor's index in prefill (64 or 128); decode uses 64
  AttentionBackend attention = AttentionBackend::kAuto;
  // The executor's dense fallback (CudaLayerAttention::set_dense_fallback): a sparse layer whose index would
  // cost more than dense attention runs dense. Off: every policy runs its own index (tests, experiments).
  bool dense_fallback = true;
  // The CUDA attention backend's options (prefill kernel, dense backend, ...; attention/index/prefill_route.h):
  // the process defaults, i.e. the documented environment overrides; dense_fallback above is ANDed in.
  attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
};

class GpuForward {
 public:
  // `gemm` and `timer` must outlive the forward; everything runs on `stream`. fp8: the layers' weights in E4M3
  // (device_model.h), which must outlive the forward too: the layers' GEMMs then run in FP8 (activations quantized
  // per product, Q/K/V sharing one quantization; gemm.h), the LM head in bf16. Null: bf16.
  GpuForward(const DeviceModel& model, const ForwardOptions& options, cudaStream_t stream, Gemm& gemm,
             EventTimer& timer, const DeviceFp8Weights* fp8 = nullptr);

  // Runs `tokens` (host ids, already checked against the vocabulary) at positions [pos, pos + n), appending
  // their K/V to `cache` (which must have room for pos + n rows and hold valid rows [0, pos)). `policy`: null
  // or empty for dense attention; total_len: the sequence length at the end of this prefill. Returns the
  // logits of `rows` ([rows, vocab], f32, on the host; synchronises the stream when rows != kNone).
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache& cache,
                         const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows);

  // The same with a KV-cache policy that holds the keys and values (no cache). QK-norm (Gemma-3) is applied here
  // before the policy sees q and k (as the CPU Forward); the policy rotates them with the layer's RoPE table.
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, GpuKVPolicy& kv, LogitRows rows);

  // As run(..., LogitRows::kAll), each row r < next.size() reduced on the device to the log-probability of next[r]
  // (GpuOps::download_logprobs): the [n, vocab] logits stay on the device.
  std::vector<double> score(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache& cache,
                            const attn::AttentionPolicy* policy, int32_t total_len, std::span<const int32_t> next);
  std::vector<double> score(std::span<const int32_t> tokens, int32_t pos, GpuKVPolicy& kv,
                            std::span<const int32_t> next);

  // The mixed step (BatchBackend::mixed_step): a prefill chunk of n tokens at [pos, pos + n) of `cache` (under
  // `policy`, total_len, the model's windows: as run()) and tokens.size() - n decode rows attended by `decode` (the
  // batched engine's paged decode step, its layout set for those rows) as ONE step of the layer recipe over all
  // tokens.size() rows: tokens are the chunk's then the decode rows' (host ids, checked), positions the rows'
  // positions on the device ([tokens.size()]). Every product, norm and the head run once over the rows; the chunk's
  // K/V go into the cache, the decode rows' into their blocks. The logits of the chunk's last row (when
  // chunk_logits) then of the decode rows stay on the device: ops().logits(), [(chunk_logits ? 1 : 0) + rows, vocab].
  // Asynchronous (no synchronisation); no memory sampling (peak_device_bytes() is the single-sequence engine's).
  void run_mixed(std::span<const int32_t> tokens, int32_t n, int32_t pos, DeviceKVCache& cache,
                 const attn::AttentionPolicy* policy, int32_t total_len, const int32_t* positions,
                 GpuAttentionStep& decode, bool chunk_logits);

  size_t scratch_bytes() const { return ops_.scratch_bytes(); }
  void release_scratch() { ops_.release_scratch(); }
  // The most device memory seen in use (cudaMemGetInfo: total - free, the whole device) at the sample points
  // inside run() (after each layer's attention and the first layer's MLP), since the last reset_peak().
  size_t peak_device_bytes() const { return ops_.peak_device_bytes(); }
  void reset_peak() { ops_.reset_peak(); }

  // The backend of the recipe this forward runs (the decode step of the same engine shares it).
  GpuOps& ops() { return ops_; }

 private:
  // The step's layers, then the logits of rows [first, n) on the device (first == n: none).
  void forward(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step, int64_t first);
  std::vector<float> run_step(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step, LogitRows rows);
  std::vector<double> score_step(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step,
                                 std::span<const int32_t> next);

  const ModelConfig& cfg_;
  ContiguousOptions attention_;
  GpuOps ops_;
};

}  // namespace tessera::runtime::gpu
