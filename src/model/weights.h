// tessera/model/weights.h — a model's weights, kept as the file stores them, under one naming for both formats.
//
// Linear weights (q/k/v/o, gate/up/down, the LM head) and the embedding table stay in the file's memory mapping in
// their stored type — a GGUF block type (Q4_0 .. Q6_K) or f32/f16/bf16, safetensors' f32/f16/bf16 too — and the CPU
// ops multiply them in place (model/qmatmul.h; runtime::linear). Norm weights, biases and rope factors are small
// and held as f32. Three cases own a copy instead of pointing into the mapping: a llama GGUF's q/k rows, put back
// in rotate_half order (a row permutation, so the copy keeps the stored type and size); an f32 tensor at an
// unaligned offset (safetensors); and types the matrix products do not take (Q2_K, Q3_K, Q8_K: expanded to f32).
// WeightOptions::expand_f32 expands every tensor to f32 at load instead, as tessera did before (the reference the
// stored-weight forward is tested against).
//
// Code that needs f32 values (the planners' backward, the GPU upload, the tensor-parallel shards of a type whose
// blocks a shard would cut) asks for them explicitly: Weight::to_f32() for the whole tensor or
// Weight::rows_f32() for a row range; nothing keeps a second f32 copy of the model.
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
#include <memory>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/model_config.h"
#include "model/model_file.h"
#include "model/qmatmul.h"

namespace tessera::runtime {

// A matrix [rows, cols] (a vector has rows == 1), row-major, in its stored type: each row is
// tensor_type_bytes(type, cols) bytes of consecutive blocks. Copies share the bytes.
struct Weight {
  int64_t rows = 0;
  int64_t cols = 0;
  model::TensorType type = model::TensorType::F32;
  const uint8_t* bytes = nullptr;      // rows * row_bytes() bytes; null for an absent weight
  std::shared_ptr<const void> owner;  // holds `bytes` when they are not in the file's mapping (null: mapped)
  std::string name;                   // the tensor's name in the file ("" for a derived weight)
  model::QAct act = model::QAct::Int8;  // how its products round the activations (WeightOptions::int8x2_tensors)

  // An f32 weight holding `values` (rows * cols of them).
  static Weight f32(std::vector<float> values, int64_t rows, int64_t cols, std::string name = {});

  bool empty() const { return bytes == nullptr; }
  int64_t numel() const { return rows * cols; }
  size_t row_bytes() const;
  size_t stored_bytes() const { return empty() ? 0 : static_cast<size_t>(rows) * row_bytes(); }
  bool mapped() const { return !empty() && owner == nullptr; }
  // The values of an F32 weight (null when empty). Throws tessera::Error for a weight kept in another type
  // ("weight blk.0.attn_q.weight is kept as Q4_1: read it with to_f32()").
  const float* ptr() const;
  // Rows [r0, r0 + count) dequantized to f32 into out[count * cols].
  void rows_f32(int64_t r0, int64_t count, float* out) const;
  // Every value as f32 (a new vector: the caller decides how long it lives).
  std::vector<float> to_f32() const;
  model::QMatrix matrix() const { return {bytes, rows, cols, type, act}; }
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
  // Bytes the weights take as kept (stored bytes, mapped or owned, plus the f32 vectors).
  size_t bytes() const;
  // Bytes held in allocations of their own (not the file mapping).
  size_t owned_bytes() const;

  // What each group of tensors is kept as: one entry per (group, type), in model order; group is "embedding",
  // "output", "attention" (q/k/v/o), "mlp" (gate/up/down) or "norms" (norms, biases, rope factors).
  struct Group {
    std::string group;
    model::TensorType type = model::TensorType::F32;
    int64_t tensors = 0;
    size_t bytes = 0;
  };
  std::vector<Group> groups() const;
  // "embedding Q8_0 (1 tensor, 28.3 MB), attention Q4_1+Q4_0 ..." — one line, for inspect and run.
  std::string summary() const;
};

// The tensors whose products take two-level int8 activations by default (docs/cpu_kernels.md, "Accuracy").
std::string default_int8x2_tensors();
// The tensors whose products take one level plus the second on the outlier blocks (model::QAct::Int8Outliers) by
// default (docs/cpu_kernels.md, "One default for accuracy and speed").
std::string default_int8_outlier_tensors();

struct WeightOptions {
  // Expand every tensor to f32 at load (the old behaviour; 4 bytes a parameter): the reference of the tests.
  bool expand_f32 = false;
  // Only the tensors whose name contains one of these comma-separated parts expanded to f32 ("" none): per-class
  // accuracy experiments (f32 activations for that class alone). TESSERA_WEIGHTS=f32:attn_q,ffn_down sets it.
  std::string expand_f32_tensors;
  // The quantized tensors whose products take two-level int8 activations (model::QAct::Int8x2): names containing
  // one of these comma-separated parts; "*" all, "" none. TESSERA_QACT_X2 in the environment sets it ("none": none).
  std::string int8x2_tensors = default_int8x2_tensors();
  // Those (of the rest) whose products take the second level on the outlier blocks only (model::QAct::Int8Outliers);
  // same syntax. TESSERA_QACT_OUTLIERS in the environment sets it ("none": none).
  std::string int8_outlier_tensors = default_int8_outlier_tensors();
};

// Reads and checks (shapes against the config) every tensor the config needs; keeps the linear weights as stored
// (see the top of this file) and the norms as f32. Throws tessera::Error "<file>: missing tensor <name>" or
// "<file>: tensor <name> has shape [..], expected [..]"; a type tessera does not read fails when the file is
// opened ("<file>: tensor <name> has type IQ2_XS (17), which tessera does not read yet").
ModelWeights load_weights(const model::ModelFile& file, const ModelConfig& config, ThreadPool& pool,
                          const WeightOptions& options = {});

// llama.cpp's converter reorders the rows of each head of q_proj/k_proj (llama architecture) from rotate_half
// order [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] to adjacent pairs [x_0, y_0, x_1, y_1, ...]; this puts them
// back, in place, for a [heads * head_dim, cols] matrix (cols = 1 for a bias).
void unpermute_gguf_rope_rows(float* w, int64_t heads, int64_t head_dim, int64_t cols);
// The same over rows of `row_bytes` bytes of any stored type (a quantized row is whole blocks).
void unpermute_gguf_rope_rows_bytes(uint8_t* w, int64_t heads, int64_t head_dim, size_t row_bytes);

}  // namespace tessera::runtime
