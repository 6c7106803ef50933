// tessera/runtime/cpu_ops.h — the CPU backend of the layer recipe (recipe.h): f32 activations over the model's
// weights, products through runtime::linear (ops.h), and the attention steps a CPU forward plugs in.
//
//   CpuOps ops(model.config(), model.weights(), pool);
//   ContiguousAttention step(...);                       // or PagedDecodeAttention, StreamAttention, ...
//   ops.begin(tokens, pos, {}, step, timers);            // rows at pos, pos + 1, ... (or one position per row)
//   run_layers(model.config(), ops);
//   std::vector<float> logits = ops.head(n - 1);         // the last row's logits
//
// Every CPU forward runs this one recipe: a sequence's prefill chunk (runtime::Forward), the batched decode of many
// sequences (runtime::BatchForward), a streamed chunk (a KVPolicy) and, with sharded weights, the tensor-parallel
// twin (parallel/tp_forward_cpu.h: ShardedCpuOps derive from these).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tessera::runtime {

// Time spent, accumulated across calls.
struct ForwardTimers {
  double gemm_seconds = 0;       // every matrix product, LM head included
  double attention_seconds = 0;  // estimation, lowering and the executors
};

// The attention of one CPU forward step (the recipe's attend): where the new K/V rows go, whether it rotates q and
// k itself, and the attention proper.
class CpuAttentionStep {
 public:
  virtual ~CpuAttentionStep() = default;
  // Where the products write layer l's new K and V rows ([n, kv_heads * d], contiguous), or null: the backend's
  // scratch (then attend() gets the scratch).
  virtual float* k_rows(int32_t /*layer*/) { return nullptr; }
  virtual float* v_rows(int32_t /*layer*/) { return nullptr; }
  // True: q and k reach attend() before RoPE (after the bias and QK-norm) and the step rotates them.
  virtual bool rotates(int32_t /*layer*/) const { return false; }
  // q [n, q_heads, d], k and v [n, kv_heads, d] (the step's rows), out [n, q_heads, d].
  virtual void attend(int32_t layer, float* q, float* k, float* v, float* out) = 0;
};

// Grows v to at least n elements (scratch buffers of the forward passes).
template <class V>
void grow_to(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// The f32 CPU backend of run_layers (the Ops concept of recipe.h). The products that tensor parallelism splits
// (qkv, out_proj, mlp) are virtual: parallel::ShardedCpuOps runs them over every rank's shard and sums the ranks'
// partials, so that every CPU step (a prefill chunk, the batched decode, a streamed chunk) runs sharded too.
class CpuOps {
 public:
  CpuOps(const ModelConfig& config, const ModelWeights& weights, ThreadPool& pool);
  virtual ~CpuOps() = default;
  CpuOps(const CpuOps&) = delete;
  CpuOps& operator=(const CpuOps&) = delete;

  // Sets up a step of tokens.size() rows: row t at position positions[t], or pos + t when positions is empty;
  // `step` and `timers` must outlive the step (head() included).
  void begin(std::span<const int32_t> tokens, int32_t pos, std::span<const int32_t> positions,
             CpuAttentionStep& step, ForwardTimers& timers);

  // --- the recipe's calls (recipe.h)
  int64_t rows() const { return n_; }
  int64_t mlp_piece() const { return n_; }
  void embed();
  void attn_norm(int32_t l) { norm_x(weights_.layers[static_cast<size_t>(l)].attn_norm); }
  virtual void qkv(int32_t l, bool bias);
  void qk_norm_rope(int32_t l, bool norm, bool rope);
  bool attention_rotates(int32_t l) const { return step_->rotates(l); }
  void attend(int32_t l);
  virtual void out_proj(int32_t l, bool post_norm);
  void ffn_norm(int32_t l) { norm_x(weights_.layers[static_cast<size_t>(l)].ffn_norm); }
  virtual void mlp(int32_t l, int64_t row0, int64_t rows, Activation act, bool post_norm);
  // Logits [n - first, vocab] of rows [first, n) (final norm, LM head, the config's soft-capping).
  std::vector<float> head(int64_t first);

  // The layer's RoPE frequencies (a streaming step rotates with them).
  std::span<const float> inv_freq(int32_t layer) const {
    return inv_freqs_[layer_rope_[static_cast<size_t>(layer)]];
  }
  const ModelConfig& config() const { return cfg_; }
  ThreadPool& pool() const { return pool_; }
  float* q() { return q_.data(); }

 protected:
  // h = RMSNorm(x) * w.
  void norm_x(const Weight& w);
  // y = x W^T (+ bias) over `rows` rows, timed as GEMM.
  void linear_timed(const float* x, int64_t rows, const Weight& w, const Weight* bias, float* y);
  // QK-norm (norm: the head norm's weight, or null) and RoPE (rope) of `heads` heads in each of the step's rows,
  // rows `stride` floats apart, at the rows' positions with layer l's frequencies.
  void norm_rope_heads(int32_t l, float* x, int64_t stride, int64_t heads, const Weight* norm, bool rope);
  // x[rows at row0] += [RMSNorm(post_norm)](y).
  void add_to_x(int64_t row0, int64_t rows, float* y, const Weight* post_norm);

  const ModelConfig& cfg_;
  const ModelWeights& weights_;
  ThreadPool& pool_;
  std::vector<std::vector<float>> inv_freqs_;  // distinct RoPE frequency sets
  std::vector<size_t> layer_rope_;             // layer -> index into inv_freqs_
  // The step.
  std::span<const int32_t> tokens_;
  int64_t n_ = 0;
  CpuAttentionStep* step_ = nullptr;
  ForwardTimers* timers_ = nullptr;
  float* kc_ = nullptr;  // where this layer's new K / V rows are
  float* vc_ = nullptr;
  // Scratch, grown to the largest step seen.
  std::vector<float> x_, h_, q_, attn_, gate_, up_, k_, v_;
  std::vector<std::vector<float>> cos_, sin_;  // per RoPE set, [n, d / 2]
};

}  // namespace tessera::runtime
