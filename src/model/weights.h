// tessera/model/weights.h — a model's weights in f32, under one naming for both file formats.
//
// Every tensor is dequantized to f32 when the model is loaded (quant.h), so the forward pass runs plain f32
// GEMMs (OpenBLAS). That is simple and exact, and costs memory: 4 bytes per parameter (SmolLM2-135M: 0.54 GB,
// Gemma-3-270M: 1.07 GB, an 8B model: 32 GB). Loading time is dominated by dequantization, spread over the
// pool one tensor per item; Model::load_seconds() reports it.
//
// Names (N = layer):
//   role             Hugging Face (safetensors)                           GGUF (llama.cpp)
//   embedding        model.embed_tokens.weight                            token_embd.weight
//   final_norm       model.norm.weight                                    output_norm.weight
//   lm_head          lm_head.weight (absent or ignored when tied)         output.weight (absent when tied)
//   attn_norm        model.layers.N.input_layernorm.weight                blk.N.attn_norm.weight
//   wq wk wv wo      model.layers.N.self_attn.{q,k,v,o}_proj.weight       blk.N.attn_{q,k,v,output}.weight
//   bq bk bv         model.layers.N.self_attn.{q,k,v}_proj.bias (Qwen2)    blk.N.attn_{q,k,v}.bias
//   q_norm k_norm    model.layers.N.self_attn.{q,k}_norm.weight (Gemma)   blk.N.attn_{q,k}_norm.weight
//   post_attn_norm   model.layers.N.post_attention_layernorm.weight (Gemma)  blk.N.post_attention_norm.weight
//   ffn_norm         Llama/Qwen2: model.layers.N.post_attention_layernorm.weight; Gemma:
//                    model.layers.N.pre_feedforward_layernorm.weight       blk.N.ffn_norm.weight
//   post_ffn_norm    model.layers.N.post_feedforward_layernorm.weight      blk.N.post_ffw_norm.weight
//   w_gate w_up      model.layers.N.mlp.{gate,up}_proj.weight               blk.N.ffn_{gate,up}.weight
//   w_down           model.layers.N.mlp.down_proj.weight                    blk.N.ffn_down.weight
//   rope factors     — (llama3 scaling is in config.json)                  rope_freqs.weight (optional)
// The language model of a multimodal Gemma-3 checkpoint is found under language_model.model.* (or
// model.language_model.*).
//
// After loading, weights follow one convention whatever the file: q/k rows in HF's rotate_half order (a llama
// GGUF's permuted rows are put back), Gemma norms hold 1 + w (HF stores w), linear weights are [out, in]
// row-major.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/model_config.h"

namespace tessera::model {
class ModelFile;
}

namespace tessera::runtime {

// A dense f32 matrix [rows, cols] (a vector has rows == 1), row-major.
struct Weight {
  std::vector<float> data;
  int64_t rows = 0;
  int64_t cols = 0;
  bool empty() const { return data.empty(); }
  const float* ptr() const { return data.data(); }
};

struct LayerWeights {
  Weight attn_norm;
  Weight wq, wk, wv, wo;  // [nq*d, hidden], [nkv*d, hidden], [nkv*d, hidden], [hidden, nq*d]
  Weight bq, bk, bv;      // Qwen2 only
  Weight q_norm, k_norm;  // Gemma-3 only, [head_dim]
  Weight post_attn_norm;  // Gemma-3 only
  Weight ffn_norm;
  Weight post_ffn_norm;  // Gemma-3 only
  Weight w_gate, w_up;   // [ffn, hidden]
  Weight w_down;         // [hidden, ffn]
};

struct ModelWeights {
  Weight embedding;  // [vocab, hidden]
  Weight lm_head;    // [vocab, hidden]; empty when the embeddings are tied
  Weight final_norm;
  // GGUF rope_freqs.weight (llama3 scaling): frequency i is divided by factor i; empty when absent.
  std::vector<float> rope_freq_factors;
  std::vector<LayerWeights> layers;

  const Weight& output() const { return lm_head.empty() ? embedding : lm_head; }
  size_t bytes() const;
};

// Reads, checks (shapes against the config) and dequantizes every tensor the config needs. Throws
// tessera::Error
// "<file>: missing tensor <name>" or "<file>: tensor <name> has shape [..], expected [..]"; quantization
// types tessera cannot read fail as quant.h says.
ModelWeights load_weights(const model::ModelFile& file, const ModelConfig& config, ThreadPool& pool);

// llama.cpp's converter reorders the rows of each head of q_proj/k_proj (llama architecture) from rotate_half
// order [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] to adjacent pairs [x_0, y_0, x_1, y_1, ...]; this puts them
// back, in place, for a [heads * head_dim, cols] matrix (cols = 1 for a bias).
void unpermute_gguf_rope_rows(float* w, int64_t heads, int64_t head_dim, int64_t cols);

}  // namespace tessera::runtime
