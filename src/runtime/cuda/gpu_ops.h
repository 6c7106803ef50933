// tessera/runtime/cuda/gpu_ops.h — the CUDA backend of the layer recipe (runtime/recipe.h): bf16 activations, the
// residual stream x in f32, products through cuBLAS (gemm.h; FP8 where DeviceFp8Weights are given), the small
// kernels of kernels.h, and the attention step a GPU forward plugs in (gpu_attention.h: contiguous KV under a
// policy, paged decode; gpu_forward.cpp: a streaming GpuKVPolicy).
//
//   GpuOps ops(model, stream, gemm, timer);             // fp8: the layers' GEMMs in E4M3
//   SomeGpuAttentionStep step(...);
//   ops.reserve(n, logit_rows, step);                   // grows the scratch (allocates: outside a graph capture)
//   ops.upload_tokens(tokens);                          // or the step's tokens already on the device
//   ops.begin(n, ops.tokens(), pos, nullptr, step);     // rows at pos, pos + 1, ... (or positions on the device)
//   run_layers(model.config(), ops);
//   ops.head(n - 1);                                    // the last row's logits, on the device (logits())
//
// Everything between begin() and head() only launches work on the stream (no allocation, no synchronisation, no
// host copy) when the step's attend() does not either: the batched decode step is captured into a CUDA graph.
//
// Per call of the recipe (as runtime/forward.h, in bf16 with f32 accumulation):
//   attn_norm / ffn_norm   h = bf16(RMSNorm(x))
//   qkv                    q = h Wq^T, K, V = h Wk^T, h Wv^T (+ bias): three products straight where the step wants
//                          K and V (a contiguous cache's rows; FP8: one quantization of h for the three), or, when
//                          the step takes fused rows (paged decode, bf16), one product with the stacked [Wq; Wk; Wv]
//                          into rows [q | k | v]
//   qk_norm_rope           QK-norm (Gemma-3) and RoPE in one kernel per tensor (fused rows without QK-norm: one
//                          launch rotates the adjacent q and k heads)
//   out_proj               x += a Wo^T (cuBLAS with beta = 1 on f32 x); Gemma-3: x += RMSNorm(a Wo^T)
//   mlp (per piece)        gu = h [Wg; Wu]^T; gu[:, :F] = act(gate) * up; x += gu Wd^T (Gemma-3: RMSNorm first)
//   head                   the final norm, the LM head (bf16 in both precisions, f32 logits), soft-capping
// The small kernels' GPU time goes to the EventTimer by category (a disabled timer records nothing).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cuda/device_buffer.h"
#include "model/model_config.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"

namespace tessera::runtime::gpu {

// The kernels' name of the model's gate activation (kernels.h).
enum class GateActivation;
GateActivation gate_activation(Activation a);

// Grows b to at least count elements (keeping nothing); true when it was reallocated.
template <class T>
bool grow(attn::gpu::DeviceBuffer<T>& b, int64_t count) {
  if (static_cast<int64_t>(b.size()) >= count) return false;
  b.resize(static_cast<size_t>(count));
  return true;
}

// Captures what launch() puts on `stream` into an executable CUDA graph (a step of the ops between begin() and
// head(); the capture is ended and its graph dropped when launch throws). Throws tessera::Error on a CUDA error.
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& launch);

// The q, k and v rows of a step on the device, bf16: q [n, q_heads * d] rows q_ld apart, k and v [n, kv_heads * d]
// rows kv_ld apart (after the bias, QK-norm and, unless the step rotates them itself, RoPE).
struct GpuQkv {
  bf16* q = nullptr;
  bf16* k = nullptr;
  bf16* v = nullptr;
  int64_t q_ld = 0, kv_ld = 0;
};

// The attention of one GPU forward step (the recipe's attend).
class GpuAttentionStep {
 public:
  virtual ~GpuAttentionStep() = default;
  // Where the products write layer l's new K and V rows ([n, kv_heads * d], contiguous), or null: the backend's
  // scratch.
  virtual bf16* k_rows(int32_t /*layer*/) const { return nullptr; }
  virtual bf16* v_rows(int32_t /*layer*/) const { return nullptr; }
  // True: with K and V in the scratch, q, k and v may come from one product as rows [q | k | v] (bf16 only).
  virtual bool fused_qkv() const { return false; }
  // True: q and k reach attend() after the bias and QK-norm but before RoPE, and the step rotates them.
  virtual bool rotates(int32_t /*layer*/) const { return false; }
  // Writes the attention output [n, q_heads * d] (bf16, contiguous) to out, on `stream`.
  virtual void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) = 0;
};

class GpuOps {
 public:
  // A layer's norm weights (f32, on the device; null where the model has none).
  struct LayerNorms {
    const float *attn_norm = nullptr, *ffn_norm = nullptr, *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
    const float *q_norm = nullptr, *k_norm = nullptr;
  };

  // `gemm`, `timer` and fp8 (null: bf16 GEMMs) must outlive the ops; everything runs on `stream`. mlp_piece: rows
  // per MLP piece (bounds the [rows, 2F] buffer).
  GpuOps(const DeviceModel& model, cudaStream_t stream, Gemm& gemm, EventTimer& timer,
         const DeviceFp8Weights* fp8 = nullptr, int64_t mlp_piece = 16384);

  // The 4-bit copy of the layers' matrices (GemmPrecision::kW4; null: none, the default): products of up to kW4Rows
  // rows (a decode step) read it through gemv_w4a16, larger ones the bf16 weights. Must outlive the ops.
  void set_w4(const DeviceW4Weights* w4) { w4_ = w4; }

  // Grows the scratch for steps of n rows through `step` with logit_rows rows of logits (allocates: not inside a
  // graph capture). True when a buffer was reallocated (a captured graph that holds its address is stale).
  bool reserve(int64_t n, int64_t logit_rows, const GpuAttentionStep& step);
  // Copies host token ids to tokens() (asynchronous; after reserve()).
  void upload_tokens(std::span<const int32_t> tokens);
  const int32_t* tokens() const { return tokens_.data(); }
  // Sets up a step of n rows (tokens on the device, checked against the vocabulary): row t at position pos + t, or
  // positions[t] (on the device) when positions is not null. Launches the RoPE tables; capturable.
  void begin(int64_t n, const int32_t* tokens, int32_t pos, const int32_t* positions, GpuAttentionStep& step);

  // --- the recipe's calls (recipe.h)
  int64_t rows() const { return n_; }
  int64_t mlp_piece() const { return mlp_piece_; }
  void embed();
  void attn_norm(int32_t l) { norm_x(norms_[static_cast<size_t>(l)].attn_norm); }
  void qkv(int32_t l, bool bias);
  void qk_norm_rope(int32_t l, bool norm, bool rope);
  bool attention_rotates(int32_t l) const { return step_->rotates(l); }
  void attend(int32_t l);
  void out_proj(int32_t l, bool post_norm);
  void ffn_norm(int32_t l) { norm_x(norms_[static_cast<size_t>(l)].ffn_norm); }
  void mlp(int32_t l, int64_t row0, int64_t rows, Activation act, bool post_norm);
  // Logits of rows [first, n) into logits() ([n - first, vocab], f32, on the device): final norm, LM head, the
  // config's soft-capping.
  void head(int64_t first);
  // The logits of the last head() on the host ([count, vocab]); synchronises the stream.
  std::vector<float> download_logits(int64_t count);
  // The log-probability of next[r] under row r of the last head()'s logits, for r < next.size() (f64, on the host:
  // row_logprobs on the device, only next.size() numbers come back); synchronises the stream.
  std::vector<double> download_logprobs(std::span<const int32_t> next);
  float* logits() { return logits_.data(); }

  // Tensor parallelism with one GpuOps per rank over a model of the rank's heads and MLP columns
  // (parallel/cuda/tp_batch_gpu.h): the partial sums of the output and down projections are summed over the ranks
  // by all_reduce (in place, f32, ordered on the stream) before the residual add — rank 0 adds into its x, the
  // others into 0; with post-norms (Gemma-3) the sum of o, then x += RMSNorm(o). Empty all_reduce: one rank.
  struct RankReduce {
    int32_t rank = 0;
    std::function<void(float* x, size_t count, cudaStream_t stream)> all_reduce;
  };
  void set_rank_reduce(RankReduce r) { reduce_ = std::move(r); }

  const ModelConfig& config() const { return cfg_; }
  cudaStream_t stream() const { return stream_; }
  float attention_scale() const { return scale_; }
  // Layer l's RoPE frequencies, on the device and on the host (a rotating step uses them).
  const float* inv_freq(int32_t l) const { return inv_freqs_[layer_rope_[static_cast<size_t>(l)]].data(); }
  std::span<const float> host_inv_freq(int32_t l) const { return host_inv_freqs_[layer_rope_[static_cast<size_t>(l)]]; }

  size_t scratch_bytes() const;
  void release_scratch();  // synchronises the stream first
  // Device memory in use (cudaMemGetInfo: total - free, the whole device) sampled after every layer's attention and
  // the first layer's MLP when sampling is on (not inside a graph capture); the most seen since reset_peak().
  void set_sample_memory(bool on) { sample_ = on; }
  void sample_memory();
  size_t peak_device_bytes() const { return peak_in_use_; }
  void reset_peak() { peak_in_use_ = 0; }

 protected:
  // The replicated part of a model whose layer matrices a derived backend holds (tensor parallelism).
  GpuOps(const ModelConfig& config, std::vector<LayerNorms> norms, const bf16* embedding, const bf16* output,
         const float* final_norm, const std::vector<float>& rope_freq_factors, cudaStream_t stream, Gemm& gemm,
         EventTimer& timer, int64_t mlp_piece);

  // Grows the scratch: q [q_elems], a [a_elems], gu [gu_elems], k and v [kv_elems] each (0: none), x, h (and o with
  // post-norms) [n, hidden], logits [logit_rows, vocab], the RoPE tables [n, d / 2] (+ the identity rotation's with
  // `identity`). True when a buffer was reallocated.
  bool reserve_buffers(int64_t n, int64_t logit_rows, int64_t q_elems, int64_t a_elems, int64_t gu_elems,
                       int64_t kv_elems, bool identity);
  // One product y = x W^T (+ beta y): bf16 (cuBLAS), or FP8 with w8: up to kW8Rows rows (a decode step) weight-only
  // (fp8_gemv.h: bf16 activations), more W8A8 (the input quantized unless `reuse`: the previous product's input
  // again); with set_w4's weights, up to kW4Rows rows through the 4-bit copy of w (w4_gemv.h). Timed as GEMM, the
  // quantization included.
  void gemm(const bf16* x, int64_t ldx, int64_t m, const bf16* w, const Fp8Matrix* w8, int64_t out, int64_t in,
            void* y, DType y_type, int64_t ldy, float beta, bool reuse = false);
  // h = bf16(RMSNorm(x) * w) over the step's rows.
  void norm_x(const float* w);
  template <class F>
  void timed(EventTimer::Kind kind, F&& launch) {
    timer_.begin(kind, stream_);
    launch();
    timer_.end(kind, stream_);
  }

  const ModelConfig& cfg_;
  cudaStream_t stream_;
  Gemm& gemm_;
  EventTimer& timer_;
  const DeviceModel* model_ = nullptr;  // the layer matrices (null in a derived backend)
  const DeviceFp8Weights* fp8_ = nullptr;
  const DeviceW4Weights* w4_ = nullptr;
  std::vector<LayerNorms> norms_;
  const bf16* embedding_ = nullptr;
  const bf16* output_ = nullptr;
  const float* final_norm_ = nullptr;
  int64_t mlp_piece_;
  float scale_ = 0;  // attention scale
  std::vector<attn::gpu::DeviceBuffer<float>> inv_freqs_;  // distinct RoPE frequency sets, on the device
  std::vector<std::vector<float>> host_inv_freqs_;          // the same on the host
  std::vector<size_t> layer_rope_;                          // layer -> index into inv_freqs_
  // The step.
  int64_t n_ = 0;
  const int32_t* step_tokens_ = nullptr;
  GpuAttentionStep* step_ = nullptr;
  bool fused_ = false;            // this step's q, k, v are rows of one product
  bool identity_ = false;         // this step needs the identity rotation (QK-norm alone)
  GpuQkv qkv_rows_;               // this layer's q, k, v
  Fp8Matrix x8_;                  // the last quantized input (FP8)
  // FP8 per-row W8A8: the norm and the gated activation quantize the rows they make in the same pass
  // (rms_norm_to_fp8_rows, gated_activation_fp8_rows; TESSERA_FP8_FUSED=0: the separate quantization, the same
  // codes), into h8_ ([n, hidden], valid while h8_rows_ > 0) and gu8_ (one MLP piece); pre8_: the codes the next
  // gemm() takes for its input instead of quantizing it.
  bool fuse8_ = true;
  attn::gpu::DeviceBuffer<uint8_t> h8_, gu8_;
  attn::gpu::DeviceBuffer<float> h8_scales_, gu8_scales_;
  int64_t h8_rows_ = 0;
  bool pre8_set_ = false;
  Fp8Matrix pre8_;
  // Whether a product of m rows takes the W8A8 path with per-row activation scales (fused quantization applies).
  bool fused8(int64_t m);
  // Sets pre8_ to h8_'s rows [row0, row0 + rows) when they are there and a product of `rows` rows takes them.
  void use_h8(int64_t row0, int64_t rows);
  bool sample_ = false;
  size_t peak_in_use_ = 0;
  RankReduce reduce_;
  // Scratch, grown to the largest step seen.
  attn::gpu::DeviceBuffer<int32_t> tokens_;
  attn::gpu::DeviceBuffer<float> x_, o_, logits_;
  attn::gpu::DeviceBuffer<int32_t> next_;  // download_logprobs's tokens and results
  attn::gpu::DeviceBuffer<double> logprobs_;
  attn::gpu::DeviceBuffer<bf16> h_, q_, a_, gu_, k_, v_;  // q_: rows [q | k | v] when fused; k_, v_: unfused scratch
  // (h8_, gu8_ and their scales above: FP8 codes of h and of the activation)
  attn::gpu::DeviceBuffer<float> no_freq_, id_cos_, id_sin_;  // the identity rotation (angle 0: cos 1, sin 0)
  std::vector<attn::gpu::DeviceBuffer<float>> cos_, sin_;
};

}  // namespace tessera::runtime::gpu
