// tessera/model/model_config.h — the hyperparameters of a decoder-only transformer, from either file
// format.
//
// One ModelConfig describes every architecture tessera runs, as data: the forward pass (runtime/forward.h)
// has no per-architecture branches beyond the flags below.
//
//   architecture   config.json (architectures[0] / model_type)          GGUF general.architecture
//   Llama          LlamaForCausalLM (Llama-2/3/3.1, SmolLM2),           llama (Mistral and SmolLM2 GGUFs are
//                  MistralForCausalLM                                   "llama" too)
//   Qwen2          Qwen2ForCausalLM                                     qwen2
//   Gemma3         Gemma3ForCausalLM (gemma3_text),                     gemma3
//                  Gemma3ForConditionalGeneration's text_config
//
// Facts that differ between the formats and are resolved here or in weights.cpp (so that both give the same
// logits):
//  - RoPE is always applied in the rotate_half (NeoX) convention. llama.cpp's converter permutes the rows of
//    q_proj/k_proj of the *llama* architecture so that GGUF's adjacent-pair RoPE computes the same thing;
//    weights.cpp undoes that permutation (Qwen2 and Gemma-3 GGUFs are not permuted).
//  - Llama-3.1 "llama3" RoPE scaling is a config entry in HF but a `rope_freqs.weight` tensor of
//  per-frequency
//    divisors in GGUF (weights.h: ModelWeights::rope_freq_factors).
//  - Gemma's RMSNorm multiplies by (1 + w); HF stores w, llama.cpp stores 1 + w. Weights hold 1 + w after
//  load.
//  - Gemma-3 GGUFs carry no query_pre_attn_scalar: llama.cpp uses head_dim, except hidden/heads for the 27B
//    (62 layers); the local-layer RoPE base is rope.freq_base_swa when present, else 10000; every 6th layer
//    is global.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::model {
class ModelFile;
}

namespace tessera::runtime {

enum class Architecture { Llama, Qwen2, Gemma3 };
std::string_view architecture_name(Architecture a);  // "llama", "qwen2", "gemma3"

enum class Activation { SiLU, GeluTanh, Gelu };  // the gate activation of the gated MLP (SwiGLU / GeGLU)

enum class RopeScaling { None, Linear, Llama3 };

struct RopeConfig {
  double theta = 10000.0;
  RopeScaling scaling = RopeScaling::None;
  double factor = 1.0;  // linear and llama3
  // llama3 only
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_context = 8192;
  bool operator==(const RopeConfig&) const = default;
};

struct LayerConfig {
  int32_t sliding_window =
      0;  // 0: global (causal) attention; w > 0: key j visible to query p iff p - w < j <= p
  RopeConfig rope;
};

struct ModelConfig {
  Architecture arch = Architecture::Llama;
  std::string name;    // for messages: general.name, config.json's _name_or_path, or the file/directory name
  std::string source;  // the path it was read from

  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t context_length = 0;  // the model's trained context (max_position_embeddings / context_length)
  float rms_norm_eps = 1e-5f;

  float attention_scale = 0;      // multiplies q.k: 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar)
  float embedding_scale = 1.0f;   // Gemma: sqrt(hidden_size), rounded to f32 as transformers does
  float final_logit_softcap = 0;  // > 0: logits = cap * tanh(logits / cap)
  Activation activation = Activation::SiLU;
  bool tied_embeddings = false;  // the LM head is the embedding matrix
  bool qkv_bias = false;         // Qwen2
  bool qk_norm = false;          // Gemma-3: RMSNorm of every q and k head before RoPE
  bool post_norms = false;       // Gemma-3: norms after attention and after the MLP, before the residual add

  std::vector<LayerConfig> layers;  // num_layers entries

  bool has_sliding_window() const;
  // "llama3 (tiny-llama3): 2 layers, hidden 64, heads 4/2 x 16, ffn 128, vocab 256, context 256"
  std::string summary() const;
};

// From a Hugging Face config.json (already parsed); `source` names the file in errors. Throws tessera::Error
// "<source>: missing key hidden_size", "<source>: architecture Phi3ForCausalLM is not supported (tessera runs
// Llama, Mistral, Qwen2 and Gemma-3 models)", "<source>: rope_scaling type yarn is not supported", ...
ModelConfig config_from_hf(const nlohmann::json& config, const std::string& source, int64_t tensor_count = -1);

// From GGUF metadata (ModelFile::metadata() of a GGUF). vocab_size falls back to `vocab_rows` (the
// embedding's rows) when the metadata has no {arch}.vocab_size. Errors name the file and the key.
ModelConfig config_from_gguf(const nlohmann::json& metadata, const std::string& source, int64_t vocab_rows,
                             int64_t tensor_count = -1);

// Either of the above, by the file's format; vocab and tied embeddings are cross-checked against the tensors.
ModelConfig load_model_config(const model::ModelFile& file);

}  // namespace tessera::runtime
