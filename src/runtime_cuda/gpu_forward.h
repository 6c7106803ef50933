// tessera/runtime_cuda/gpu_forward.h — one chunk of tokens through the model on the GPU.
//
// Per layer, for the chunk's n tokens at positions [pos, pos + n) (as runtime/forward.h, in bf16 with f32
// accumulation; the residual stream x stays in f32):
//   h = bf16(RMSNorm(x))
//   q = h Wq^T (+bq);  K, V = h Wk^T, h Wv^T (+bk, bv) straight into the device KV cache rows [pos, pos + n)
//   q, k = RoPE(QK-norm(q, k))                       one kernel per tensor (QK-norm: Gemma-3)
//   a = attention(q, K[0, pos + n), V[0, pos + n))   see below
//   x += a Wo^T                                      cuBLAS with beta = 1 on f32 x (Gemma-3: x += RMSNorm(a Wo^T))
//   h = bf16(RMSNorm(x))
//   for sequence pieces of mlp_chunk rows:  gu = h [Wg; Wu]^T;  gu[:, :F] = act(gate) * up;  x += gu Wd^T
// then the final norm and the LM head (f32 logits) only on the rows asked for; Gemma-3's soft-capping.
// No buffer is S x S or S x vocab (unless every row's logits are asked for); the MLP's [rows, 2F] buffer is
// bounded by mlp_chunk.
//
// Attention of a layer (patterns from the policy as the CPU Forward takes them; no policy: all dense):
//  - the sparse executor (attn::gpu::CudaLayerAttention: estimate, index, prefill kernel) with the lowering
//    context {pos, n, pos + n, total_len, tile}, through CudaLayerAttention::run (which sends all-dense layers to
//    cuDNN where it can run them, and sparse layers whose index costs more than dense to the dense path). Layers
//    with the same patterns share one CudaLayerAttention per chunk; static patterns (dense, A-shape, Triangle,
//    ...) build their index once per chunk and later layers only attend();
//  - the simple kernel (kernels.h simple_attention): dense only, for head dims the executor is not built for
//    (it runs 64, 128 and 256), or when asked for (AttentionBackend::Simple, the reference in tests);
//  - sliding-window layers (Gemma-3 local layers, Mistral) pass their row-exact window: args.window for the
//    executor (which applies it row-exactly on top of any policy), the kernel's own window for the simple kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "runtime_cuda/device_kv_cache.h"
#include "runtime_cuda/device_model.h"
#include "runtime_cuda/event_timer.h"
#include "runtime_cuda/gemm.h"

namespace tessera::runtime::gpu {

enum class AttentionBackend {
  kAuto,      // the executor where it runs the layer (head dim), else the simple kernel (dense layers only)
  kExecutor,  // always the sparse executor
  kSimple,    // always the simple kernel (dense layers only)
};
const char* attention_backend_name(AttentionBackend b);  // "auto", "executor", "simple"
// Throws tessera::Error for other names.
AttentionBackend parse_attention_backend(const std::string& name);


enum class LogitRows { kNone, kLast, kAll };

// A KV-cache policy that owns the keys and values of the GPU forward (runtime_cuda/stream_gpu_kv.h: streaming
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

  size_t scratch_bytes() const;
  void release_scratch();
  // The most device memory seen in use (cudaMemGetInfo: total - free, the whole device) at the sample points
  // inside run() (after each layer's attention and MLP), since the last reset_peak().
  size_t peak_device_bytes() const { return peak_in_use_; }
  void reset_peak() { peak_in_use_ = 0; }
  void sample_memory();

 private:
  struct AttentionSet;
  std::vector<float> run_layers(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache* cache, GpuKVPolicy* kv,
                                const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows);
  void attention(int32_t layer, int32_t pos, int32_t n, DeviceKVCache& cache, const attn::AttentionPolicy* policy,
                 int32_t total_len, AttentionSet& set);

  const DeviceModel& model_;
  const ModelConfig& cfg_;
  ForwardOptions options_;
  cudaStream_t stream_;
  Gemm& gemm_;
  EventTimer& timer_;
  const DeviceFp8Weights* fp8_ = nullptr;
  float scale_ = 0;  // attention scale
  std::vector<attn::gpu::DeviceBuffer<float>> inv_freqs_;  // distinct RoPE frequency sets, on the device
  std::vector<size_t> layer_rope_;                          // layer -> index into inv_freqs_
  std::vector<std::vector<float>> host_inv_freqs_;          // the same on the host (GpuKVPolicy)
  // Scratch, grown to the largest chunk seen.
  attn::gpu::DeviceBuffer<int32_t> tokens_;
  attn::gpu::DeviceBuffer<float> x_, o_, logits_;
  attn::gpu::DeviceBuffer<bf16> h_, q_, a_, gu_;
  attn::gpu::DeviceBuffer<bf16> k_chunk_, v_chunk_;  // a GpuKVPolicy's chunk rows
  attn::gpu::DeviceBuffer<float> no_freq_, id_cos_, id_sin_;  // ... with QK-norm: the identity rotation's tables
  std::vector<attn::gpu::DeviceBuffer<float>> cos_, sin_;
  size_t peak_in_use_ = 0;
};

}  // namespace tessera::runtime::gpu
