// tessera/runtime/forward.h — the f32 forward pass of one chunk of tokens through a decoder-only transformer.
//
// Per layer, for the chunk's n tokens at positions [pos, pos + n) (all products are batched GEMMs over the
// chunk):
//   h = RMSNorm(x)                                   (weights hold 1 + w for Gemma)
//   q = h Wq^T (+bq); k, v likewise, written straight into the KV cache at rows [pos, pos + n)
//   Gemma-3: q, k = RMSNorm per head (QK-norm)
//   q, k = RoPE(q, k)                                (rotate_half; the layer's own base and scaling)
//   a = attention(q, K[0, pos + n), V[0, pos + n))   see below
//   o = a Wo^T;  Gemma-3: o = RMSNorm(o)            (post-attention norm)
//   x = x + o
//   h = RMSNorm(x);  m = (act(h Wg^T) * (h Wu^T)) Wd^T;  Gemma-3: m = RMSNorm(m)
//   x = x + m
// then the final norm and the LM head, only on the rows whose logits are asked for (Gemma-3 may soft-cap
// them).
//
// Attention of a layer:
//  - with no policy (or every head of the layer dense): the dense executor;
//  - otherwise: estimate_layer + lower_layer (query tile 64) + the sparse executor, with q_begin = pos and
//    total_len = the whole prompt's length (MoA spans, Triangle's last rows);
//  - a sliding-window layer (part of the model: Gemma-3 local layers, Mistral) passes its row-exact window
//    as args.window to either executor: a policy's pattern and the window both apply (their intersection).
//    Decode is always dense (within the window).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/attention_args.h"
#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "runtime/cpu_ops.h"
#include "runtime/kv_cache.h"
#include "model/model.h"

namespace tessera::runtime {


enum class LogitRows { None, Last, All };

// Called after each layer's attention of a prefill chunk with the layer index and the executor's arguments:
// q [n, q_heads, d] of the chunk, k/v [pos + n, kv_heads, d] (the whole cache so far), out [n, q_heads, d]
// holding this layer's attention output, q_begin = pos, window = the model's sliding window for the layer
// (0: none). The views are valid only during the call. Used by evaluation (per-layer attention metrics on
// real prompts); costs nothing when unset.
using AttentionObserver = std::function<void(int32_t layer, const attn::AttentionArgs& args)>;

// A prefill chunk at [pos, pos + n) whose keys `cache` holds (its own K/V written to it), under `policy` (null or
// empty: dense) with total_len the prompt's length, and the observer to call after each layer (null: none).
struct StagedChunk {
  KVCache& cache;
  int32_t pos = 0, n = 0;
  const attn::AttentionPolicy* policy = nullptr;
  int32_t total_len = 0;
  const AttentionObserver* observer = nullptr;
};
// The chunk's attention in `layer`: q [n, q_heads, d] -> out under its policy and the layer's sliding window, then
// the observer. The prefill's attention step and the mixed step's chunk rows (batch_forward.cpp) both run it.
void attend_staged_chunk(const ModelConfig& cfg, const StagedChunk& chunk, int32_t layer, float* q, float* out,
                         ThreadPool& pool);

// A KV-cache policy that keeps the keys and values itself and runs each layer's attention (streaming memory,
// runtime/stream/streaming_kv.h). Forward hands it every layer's chunk before RoPE: the policy decides at which
// positions queries and keys are rotated (streaming sees old keys at one fixed distance).
class KVPolicy {
 public:
  virtual ~KVPolicy() = default;
  // Layer `layer` of the chunk at positions [pos, pos + n): q [n, q_heads, d], k and v [n, kv_heads, d], f32,
  // contiguous, after the bias and QK-norm and before RoPE (q and k may be overwritten). inv_freq: the layer's RoPE
  // frequencies (rope.h). Writes the attention output [n, q_heads, d] to out.
  virtual void attend(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v,
                      std::span<const float> inv_freq, float scale, float* out, ThreadPool& pool) = 0;
};

class Forward {
 public:
  Forward(const Model& model, ThreadPool& pool);
  // The same over another CPU backend of the recipe (parallel::ShardedCpuOps: the tensor-parallel twin).
  Forward(const Model& model, ThreadPool& pool, std::unique_ptr<CpuOps> ops);

  // Runs `tokens` at positions [pos, pos + tokens.size()), appending their K/V to `cache` (which must have
  // room for pos + tokens.size() rows and hold valid rows [0, pos)). `policy`: null or empty for dense
  // attention. Returns logits [rows, vocab] for `rows` (Last: the chunk's last token; All: every token; None:
  // nothing).
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, KVCache& cache,
                         const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows,
                         ForwardTimers& timers);

  // The same with a KV-cache policy that owns the keys and values (the observer is not called).
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, KVPolicy& kv, LogitRows rows,
                         ForwardTimers& timers);

  // The observer run() calls after every layer's attention (null or empty: none). Not owned.
  void set_observer(const AttentionObserver* observer) { observer_ = observer; }

  // The backend of the recipe (runtime/recipe.h) this forward runs: other CPU steps (the batched decode) share it.
  CpuOps& ops() { return *ops_; }

 private:
  std::vector<float> finish(int32_t n, LogitRows rows);

  const ModelConfig& cfg_;
  ThreadPool& pool_;
  const AttentionObserver* observer_ = nullptr;
  std::unique_ptr<CpuOps> ops_;
};

}  // namespace tessera::runtime
