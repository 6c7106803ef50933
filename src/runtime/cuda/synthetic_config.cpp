#include "runtime/cuda/synthetic_config.h"

#include "core/error.h"

namespace tessera::runtime::gpu {

std::vector<std::string> synthetic_config_names() { return {"llama3-8b"}; }

nlohmann::json synthetic_hf_config(const std::string& name) {
  if (name == "llama3-8b") {
    // meta-llama/Llama-3.1-8B config.json (the fields the architecture uses).
    return nlohmann::json{
        {"_name_or_path", "llama3-8b (synthetic)"},
        {"architectures", {"LlamaForCausalLM"}},
        {"model_type", "llama"},
        {"attention_bias", false},
        {"hidden_act", "silu"},
        {"hidden_size", 4096},
        {"intermediate_size", 14336},
        {"max_position_embeddings", 131072},
        {"num_attention_heads", 32},
        {"num_hidden_layers", 32},
        {"num_key_value_heads", 8},
        {"rms_norm_eps", 1e-5},
        {"rope_theta", 500000.0},
        {"rope_scaling",
         {{"factor", 8.0},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192},
          {"rope_type", "llama3"}}},
        {"tie_word_embeddings", false},
        {"vocab_size", 128256},
        {"torch_dtype", "bfloat16"},
    };
  }
  std::string known;
  for (const std::string& n : synthetic_config_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error("unknown synthetic model '" + name + "' (known: " + known + ")");
}

ModelConfig synthetic_config(const std::string& name) {
  return config_from_hf(synthetic_hf_config(name), "synthetic:" + name);
}

}  // namespace tessera::runtime::gpu
