// tessera/runtime/recipe.h — the decoder layer recipe, written once for every backend and every kind of step.
//
// A forward step is n rows (tokens), each at its own position: a prefill chunk (positions pos .. pos + n - 1 of one
// sequence), a batched decode step (one row per sequence), a tensor-parallel rank's share of either. What differs
// between a CPU run, the GPU, a batch and several GPUs is only what is plugged in:
//   Ops   the backend: where the activations live and how each product runs (CPU f32 over the stored weights,
//         CUDA bf16 / FP8, a tensor-parallel backend over sharded weights whose reductions are all-reduces);
//   the attention step, which the backend holds: contiguous KV under a sparse policy, paged decode with per-head
//         views, streaming memory, ... (it decides where the new K/V rows go and whether it rotates q and k itself).
//
// The recipe (Llama family incl. Qwen2's QKV bias, Mistral, SmolLM2; Gemma-3's QK-norm, post-norms, soft-capping):
//   x = embed(tokens)                                         (Gemma: * sqrt(hidden), the config's embedding_scale)
//   per layer:
//     h = RMSNorm(x; attn_norm)
//     q, k, v = h Wq^T, h Wk^T, h Wv^T  (+ bq, bk, bv)       (the backend may run one fused product)
//     q, k = QK-norm (Gemma-3), then RoPE at the rows' positions unless the attention step rotates them itself
//     a = attention step(q, k, v)
//     x += [RMSNorm(post_attn_norm)] (reduce(a Wo^T))        reduce: the tensor-parallel all-reduce hook
//     h = RMSNorm(x; ffn_norm)
//     per piece of rows:  x += [RMSNorm(post_ffn_norm)] (reduce(act(h Wg^T) * (h Wu^T) Wd^T))
//   logits = [softcap] (RMSNorm(x; final_norm) Wout^T)        only on the rows asked for
//
// The Ops concept (each member is one call of the recipe; a backend may fuse what it likes inside one call):
//   int64_t rows() const                       n, the step's rows
//   int64_t mlp_piece() const                  rows per MLP piece (bounds the [rows, 2 ffn] buffer)
//   void embed()                               x = embedding of the step's tokens (times embedding_scale)
//   void attn_norm(int32_t l)                  h = RMSNorm(x) with layer l's attn_norm
//   void qkv(int32_t l, bool bias)             q, k, v = h W^T (+ bias) — k, v where the attention step wants them
//   void qk_norm_rope(int32_t l, bool norm, bool rope)   per-head RMSNorm of q and k (norm) then RoPE (rope)
//   bool attention_rotates(int32_t l)          the attention step rotates q and k itself (streaming)
//   void attend(int32_t l)                     a = the attention step of layer l
//   void out_proj(int32_t l, bool post_norm)   x += [post_attn_norm](reduce(a Wo^T))
//   void ffn_norm(int32_t l)                   h = RMSNorm(x) with layer l's ffn_norm
//   void mlp(int32_t l, int64_t row0, int64_t rows, Activation act, bool post_norm)
//                                              x[row0, row0 + rows) += [post_ffn_norm](reduce(down(act(gate) * up)))
//   R head(int64_t first, float softcap)       logits of rows [first, n): final norm, LM head, soft-capping (> 0)
#pragma once

#include <algorithm>
#include <cstdint>

#include "model/model_config.h"

namespace tessera::runtime {

// Layer l of one step through `ops` (its input in the backend's residual stream x, its output there afterwards).
template <class Ops>
void run_layer(const ModelConfig& cfg, Ops& ops, int32_t l) {
  const int64_t n = ops.rows();
  const int64_t piece = std::max<int64_t>(1, std::min<int64_t>(ops.mlp_piece(), n));
  ops.attn_norm(l);
  ops.qkv(l, cfg.qkv_bias);
  if (ops.attention_rotates(l)) {
    if (cfg.qk_norm) ops.qk_norm_rope(l, true, false);
  } else {
    ops.qk_norm_rope(l, cfg.qk_norm, true);
  }
  ops.attend(l);
  ops.out_proj(l, cfg.post_norms);
  ops.ffn_norm(l);
  for (int64_t r0 = 0; r0 < n; r0 += piece) ops.mlp(l, r0, std::min(piece, n - r0), cfg.activation, cfg.post_norms);
}

// The embedding and every layer of one step through `ops` (see above). The caller has set up the step (tokens,
// positions, the attention step) and asks for the logits afterwards (Ops::head). A caller that needs each layer's
// input (the planners' gradient passes keep them for their backward) runs embed() and run_layer itself.
template <class Ops>
void run_layers(const ModelConfig& cfg, Ops& ops) {
  if (ops.rows() == 0) return;
  ops.embed();
  for (int32_t l = 0; l < cfg.num_layers; ++l) run_layer(cfg, ops, l);
}

}  // namespace tessera::runtime
