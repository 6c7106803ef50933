#include "model/model_config.h"

#include <cmath>
#include <filesystem>
#include <sstream>

#include "core/enum_names.h"
#include "core/error.h"
#include "model/model_file.h"

namespace tessera::runtime {

using nlohmann::json;

namespace {
constexpr std::string_view kArchitectureNames[] = {"llama", "qwen2", "gemma3"};  // Architecture's order
}  // namespace

std::string_view architecture_name(Architecture a) { return enum_name(kArchitectureNames, a); }

bool ModelConfig::has_sliding_window() const {
  for (const auto& l : layers)
    if (l.sliding_window > 0) return true;
  return false;
}

std::string ModelConfig::summary() const {
  std::ostringstream s;
  s << architecture_name(arch) << " (" << name << "): " << num_layers << " layers, hidden " << hidden_size
    << ", heads " << num_q_heads << "/" << num_kv_heads << " x " << head_dim << ", ffn " << intermediate_size
    << ", vocab " << vocab_size << ", context " << context_length;
  int local = 0;
  for (const auto& l : layers) local += l.sliding_window > 0;
  if (local > 0)
    s << ", " << local << " sliding-window layers (window " << layers.front().sliding_window << ")";
  return s.str();
}

namespace {

// A readable model name from a path: the directory of an HF model, or the file's stem.
std::string name_from_path(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec))
    return p.lexically_normal().filename().empty() ? p.lexically_normal().parent_path().filename().string()
                                                   : p.lexically_normal().filename().string();
  if (p.filename() == "model.safetensors" || p.filename() == "config.json")
    return p.parent_path().filename().string();
  return p.stem().string();
}

// A value for messages. GGUF strings are raw bytes: dump() would throw type_error 316 on one that is not UTF-8
// (found by tests/fuzz/fuzz_model_config), so invalid bytes print as U+FFFD.
std::string show(const json& v) {
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

bool present(const json& j, const std::string& key) {
  return j.is_object() && j.contains(key) && !j[key].is_null();
}

// Typed access with errors that name the file and the key.
class Keys {
 public:
  Keys(const json& j, std::string source, std::string prefix = "")
      : j_(j), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool has(const std::string& key) const { return present(j_, prefix_ + key); }
  const json& raw(const std::string& key) const { return j_[prefix_ + key]; }

  double number(const std::string& key) const {
    require(key);
    const json& v = raw(key);
    if (v.is_array()) fail(key, "has one value per layer, which tessera does not support yet");
    if (!v.is_number()) fail(key, "must be a number, got " + show(v));
    return v.get<double>();
  }
  double number(const std::string& key, double fallback) const { return has(key) ? number(key) : fallback; }
  int32_t integer(const std::string& key) const {
    const double v = number(key);
    if (v != std::floor(v) || v < 0 || v > 2147483647.0)
      fail(key, "must be a non-negative integer, got " + show(raw(key)));
    return static_cast<int32_t>(v);
  }
  int32_t integer(const std::string& key, int32_t fallback) const {
    return has(key) ? integer(key) : fallback;
  }
  std::string string(const std::string& key) const {
    require(key);
    if (!raw(key).is_string()) fail(key, "must be a string, got " + show(raw(key)));
    return raw(key).get<std::string>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!raw(key).is_boolean()) fail(key, "must be true or false, got " + show(raw(key)));
    return raw(key).get<bool>();
  }

  void require(const std::string& key) const {
    if (!has(key)) throw Error(source_ + ": missing " + what_ + " " + prefix_ + key);
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(source_ + ": " + what_ + " " + prefix_ + key + " " + why);
  }
  const std::string& source() const { return source_; }
  void set_what(std::string w) { what_ = std::move(w); }

 private:
  const json& j_;
  std::string source_, prefix_;
  std::string what_ = "key";
};

int32_t positive(const Keys& k, const std::string& key, int32_t v) {
  if (v <= 0) k.fail(key, "must be positive, got " + std::to_string(v));
  return v;
}

// Layer counts are read before any weight is looked at, and per-layer tables are sized from them: bound them by
// what the weights can hold (every layer has several tensors) before anything is allocated.
constexpr int32_t kMaxLayers = 4096;
int32_t layer_count(const Keys& k, const std::string& key, int32_t v, int64_t tensor_count) {
  positive(k, key, v);
  if (v > kMaxLayers) k.fail(key, "is " + std::to_string(v) + ", more than tessera's limit of " + std::to_string(kMaxLayers) + " layers");
  if (tensor_count >= 0 && v > tensor_count)
    k.fail(key, "is " + std::to_string(v) + ", but the weights hold only " + std::to_string(tensor_count) +
                    " tensors (each layer has several)");
  return v;
}

void finish(ModelConfig& c, const std::string& source) {
  auto bad = [&](const std::string& what) { throw Error(source + ": " + what); };
  if (c.num_q_heads <= 0 || c.num_kv_heads <= 0 || c.head_dim <= 0 || c.hidden_size <= 0 ||
      c.num_layers <= 0 || c.intermediate_size <= 0 || c.vocab_size <= 0)
    bad("model dimensions must be positive (" + c.summary() + ")");
  if (c.num_q_heads % c.num_kv_heads != 0)
    bad(std::to_string(c.num_q_heads) + " attention heads are not a multiple of " +
        std::to_string(c.num_kv_heads) + " key/value heads");
  if (c.head_dim % 2 != 0)
    bad("head_dim " + std::to_string(c.head_dim) + " is odd; RoPE needs an even head_dim");
  if (c.attention_scale == 0) c.attention_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (c.context_length <= 0) c.context_length = 2048;
}

// ---- Hugging Face config.json
// ----------------------------------------------------------------------------------

RopeConfig parse_hf_rope(const json& p, double default_theta, const Keys& k, const std::string& key) {
  RopeConfig r;
  r.theta = default_theta;
  if (p.is_null()) return r;
  if (!p.is_object()) k.fail(key, "must be an object, got " + show(p));
  auto number = [&](const char* f) -> double {
    if (!p[f].is_number()) k.fail(key, std::string("has ") + f + " " + show(p[f]) + ", which must be a number");
    return p[f].get<double>();
  };
  auto text = [&](const char* f) -> std::string {
    if (!p[f].is_string()) k.fail(key, std::string("has ") + f + " " + show(p[f]) + ", which must be a string");
    return p[f].get<std::string>();
  };
  if (present(p, "rope_theta")) r.theta = number("rope_theta");
  std::string type = "default";
  if (present(p, "rope_type"))
    type = text("rope_type");
  else if (present(p, "type"))
    type = text("type");
  if (present(p, "partial_rotary_factor") && number("partial_rotary_factor") != 1.0)
    k.fail(key, "has partial_rotary_factor " + show(p["partial_rotary_factor"]) +
                    ", which tessera does not support");
  if (type == "default") return r;
  auto need = [&](const char* f) -> double {
    if (!present(p, f)) k.fail(key, std::string("(rope type ") + type + ") lacks " + f);
    return number(f);
  };
  if (type == "linear") {
    r.scaling = RopeScaling::Linear;
    r.factor = need("factor");
  } else if (type == "llama3") {
    r.scaling = RopeScaling::Llama3;
    r.factor = need("factor");
    r.low_freq_factor = need("low_freq_factor");
    r.high_freq_factor = need("high_freq_factor");
    r.original_context = need("original_max_position_embeddings");
    if (r.low_freq_factor == r.high_freq_factor) k.fail(key, "has low_freq_factor == high_freq_factor");
  } else {
    k.fail(key, "has rope type " + type + ", which tessera does not support (default, linear, llama3)");
  }
  if (r.factor <= 0) k.fail(key, "has a non-positive factor");
  return r;
}

}  // namespace

ModelConfig config_from_hf(const json& root, const std::string& source, int64_t tensor_count) {
  if (!root.is_object() || root.empty())
    throw Error(source + ": no config.json (a Hugging Face model needs its config.json beside the weights)");
  std::string arch_name, model_type;
  if (present(root, "architectures") && root["architectures"].is_array() && !root["architectures"].empty()) {
    if (!root["architectures"][0].is_string())
      throw Error(source + ": key architectures must list strings, got " + show(root["architectures"]));
    arch_name = root["architectures"][0].get<std::string>();
  }
  if (present(root, "model_type")) {
    if (!root["model_type"].is_string())
      throw Error(source + ": key model_type must be a string, got " + show(root["model_type"]));
    model_type = root["model_type"].get<std::string>();
  }

  const json* cfgp = &root;
  ModelConfig c;
  if (arch_name == "LlamaForCausalLM" || arch_name == "MistralForCausalLM" ||
      (arch_name.empty() && (model_type == "llama" || model_type == "mistral"))) {
    c.arch = Architecture::Llama;
  } else if (arch_name == "Qwen2ForCausalLM" || (arch_name.empty() && model_type == "qwen2")) {
    c.arch = Architecture::Qwen2;
  } else if (arch_name == "Gemma3ForCausalLM" || (arch_name.empty() && model_type == "gemma3_text")) {
    c.arch = Architecture::Gemma3;
  } else if (arch_name == "Gemma3ForConditionalGeneration" || (arch_name.empty() && model_type == "gemma3")) {
    c.arch = Architecture::Gemma3;  // the language model of a multimodal Gemma-3; the vision tower is not run
    if (!present(root, "text_config")) throw Error(source + ": missing key text_config");
    if (!root["text_config"].is_object())
      throw Error(source + ": key text_config must be an object, got " + show(root["text_config"]));
    cfgp = &root["text_config"];
  } else {
    const std::string what =
        !arch_name.empty() ? arch_name : (!model_type.empty() ? model_type : "(none given)");
    throw Error(source + ": architecture " + what +
                " is not supported (tessera runs Llama, Mistral, SmolLM2, Qwen2 and Gemma-3 models)");
  }
  const json& cfg = *cfgp;
  const bool gemma = c.arch == Architecture::Gemma3;
  Keys k(cfg, source, cfgp == &root ? "" : "text_config.");

  c.source = source;
  c.name = present(root, "_name_or_path") && root["_name_or_path"].is_string() &&
                   !root["_name_or_path"].get<std::string>().empty()
               ? root["_name_or_path"].get<std::string>()
               : name_from_path(source);

  // Gemma3TextConfig has defaults for every field (multimodal configs omit some); the others are required.
  if (gemma) {
    c.vocab_size = k.integer("vocab_size", 262208);
    c.hidden_size = k.integer("hidden_size", 2304);
    c.intermediate_size = k.integer("intermediate_size", 9216);
    c.num_layers = layer_count(k, "num_hidden_layers", k.integer("num_hidden_layers", 26), tensor_count);
    c.num_q_heads = k.integer("num_attention_heads", 8);
    c.num_kv_heads = k.integer("num_key_value_heads", 4);
    c.head_dim = k.integer("head_dim", 256);
    c.context_length = k.integer("max_position_embeddings", 131072);
    c.rms_norm_eps = static_cast<float>(k.number("rms_norm_eps", 1e-6));
  } else {
    c.vocab_size = k.integer("vocab_size");
    c.hidden_size = positive(k, "hidden_size", k.integer("hidden_size"));
    c.intermediate_size = k.integer("intermediate_size");
    c.num_layers = layer_count(k, "num_hidden_layers", k.integer("num_hidden_layers"), tensor_count);
    c.num_q_heads = positive(k, "num_attention_heads", k.integer("num_attention_heads"));
    c.num_kv_heads = k.integer("num_key_value_heads", c.num_q_heads);
    c.head_dim = k.integer("head_dim", c.hidden_size / c.num_q_heads);
    c.context_length = k.integer("max_position_embeddings", 2048);
    c.rms_norm_eps = static_cast<float>(k.number("rms_norm_eps", 1e-6));
  }

  const std::string act_key = gemma ? "hidden_activation" : "hidden_act";
  const std::string act = k.has(act_key) ? k.string(act_key) : (gemma ? "gelu_pytorch_tanh" : "silu");
  if (act == "silu" || act == "swish")
    c.activation = Activation::SiLU;
  else if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_fast")
    c.activation = Activation::GeluTanh;
  else if (act == "gelu")
    c.activation = Activation::Gelu;
  else
    k.fail(act_key, "is " + act + ", which tessera does not support (silu, gelu, gelu_pytorch_tanh)");

  if (k.boolean("mlp_bias", false)) k.fail("mlp_bias", "is true, which tessera does not support");
  c.qkv_bias = c.arch == Architecture::Qwen2 || k.boolean("attention_bias", false);
  if (k.boolean("attention_bias", false) && c.arch != Architecture::Qwen2)
    k.fail("attention_bias", "is true, which tessera does not support for this architecture");
  // transformers' per-architecture defaults (LlamaConfig and Qwen2Config: untied; Gemma3: tied).
  c.tied_embeddings = k.boolean("tie_word_embeddings", gemma);

  // Layer types: explicit layer_types, or the architecture's rule.
  std::vector<bool> sliding(static_cast<size_t>(std::max(0, c.num_layers)), false);
  int32_t window = 0;
  if (k.has("layer_types")) {
    const json& lt = k.raw("layer_types");
    if (!lt.is_array() || static_cast<int32_t>(lt.size()) != c.num_layers)
      k.fail("layer_types", "must list one type per layer (" + std::to_string(c.num_layers) + ")");
    for (size_t i = 0; i < lt.size(); ++i) {
      if (!lt[i].is_string()) k.fail("layer_types", "entry " + std::to_string(i) + " must be a string, got " + show(lt[i]));
      const std::string t = lt[i].get<std::string>();
      if (t == "sliding_attention")
        sliding[i] = true;
      else if (t != "full_attention")
        k.fail("layer_types", "has unknown layer type " + t);
    }
  } else if (gemma) {
    int32_t pattern = k.integer("sliding_window_pattern", k.integer("_sliding_window_pattern", 6));
    for (int32_t i = 0; i < c.num_layers; ++i)
      sliding[static_cast<size_t>(i)] = pattern <= 0 || (i + 1) % pattern != 0;
  } else if (model_type == "mistral" || arch_name == "MistralForCausalLM") {
    if (k.has("sliding_window")) sliding.assign(sliding.size(), true);
  } else if (c.arch == Architecture::Qwen2) {
    if (k.boolean("use_sliding_window", false) && k.has("sliding_window")) {
      const int32_t first = k.integer("max_window_layers", c.num_layers);
      for (int32_t i = first; i < c.num_layers; ++i) sliding[static_cast<size_t>(i)] = true;
    }
  }
  bool any_sliding = false;
  for (bool s : sliding) any_sliding = any_sliding || s;
  if (any_sliding) {
    window = gemma ? k.integer("sliding_window", 4096) : k.integer("sliding_window");
    if (window <= 0) k.fail("sliding_window", "must be positive for sliding-window layers");
  }
  if (gemma && k.boolean("use_bidirectional_attention", false))
    k.fail("use_bidirectional_attention", "is true, which tessera does not support");

  // RoPE: transformers >= 5 writes rope_parameters (flat, or nested per layer type); older configs (and the
  // hub's files) write rope_theta + rope_scaling (+ Gemma's rope_local_base_freq, with the scaling on global
  // layers).
  const double default_theta = gemma ? 1000000.0 : 10000.0;
  RopeConfig global_rope, local_rope;
  if (k.has("rope_parameters")) {
    const json& rp = k.raw("rope_parameters");
    const bool nested = rp.is_object() && (rp.contains("full_attention") || rp.contains("sliding_attention"));
    if (nested) {
      global_rope = parse_hf_rope(rp.value("full_attention", json()), k.number("rope_theta", default_theta),
                                  k, "rope_parameters.full_attention");
      local_rope =
          parse_hf_rope(rp.value("sliding_attention", json()), k.number("rope_local_base_freq", 10000.0), k,
                        "rope_parameters.sliding_attention");
    } else {
      global_rope = parse_hf_rope(rp, k.number("rope_theta", default_theta), k, "rope_parameters");
      local_rope = gemma ? RopeConfig{k.number("rope_local_base_freq", 10000.0)} : global_rope;
    }
  } else {
    json scaling = k.has("rope_scaling") ? k.raw("rope_scaling") : json();
    if (scaling.is_object() && !present(scaling, "original_max_position_embeddings") &&
        ((present(scaling, "rope_type") && scaling["rope_type"] == "llama3") ||
         (!present(scaling, "rope_type") && present(scaling, "type") && scaling["type"] == "llama3")))
      scaling["original_max_position_embeddings"] =
          k.number("original_max_position_embeddings", c.context_length);
    if (scaling.is_object()) scaling["rope_theta"] = k.number("rope_theta", default_theta);
    global_rope = parse_hf_rope(scaling, k.number("rope_theta", default_theta), k, "rope_scaling");
    local_rope = gemma ? RopeConfig{k.number("rope_local_base_freq", 10000.0)} : global_rope;
  }
  if (k.has("partial_rotary_factor") && k.number("partial_rotary_factor") != 1.0)
    k.fail("partial_rotary_factor", "is not 1, which tessera does not support");

  c.layers.resize(static_cast<size_t>(std::max(0, c.num_layers)));
  for (size_t i = 0; i < c.layers.size(); ++i) {
    c.layers[i].sliding_window = sliding[i] ? window : 0;
    c.layers[i].rope = sliding[i] ? local_rope : global_rope;
  }

  if (gemma) {
    c.qk_norm = true;
    c.post_norms = true;
    c.embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
    const double qpas = k.number("query_pre_attn_scalar", 256);
    if (qpas <= 0) k.fail("query_pre_attn_scalar", "must be positive");
    c.attention_scale = static_cast<float>(std::pow(qpas, -0.5));
    c.final_logit_softcap = static_cast<float>(k.number("final_logit_softcapping", 0.0));
    if (k.has("attn_logit_softcapping"))
      k.fail("attn_logit_softcapping", "is set, which tessera does not support (Gemma-2 style soft-capping)");
  }
  finish(c, source);
  return c;
}

// ---- GGUF metadata
// ---------------------------------------------------------------------------------------------

ModelConfig config_from_gguf(const json& md, const std::string& source, int64_t vocab_rows, int64_t tensor_count) {
  Keys g(md, source);
  g.set_what("metadata key");
  const std::string arch = g.string("general.architecture");
  ModelConfig c;
  if (arch == "llama")
    c.arch = Architecture::Llama;
  else if (arch == "qwen2")
    c.arch = Architecture::Qwen2;
  else if (arch == "gemma3")
    c.arch = Architecture::Gemma3;
  else
    throw Error(source + ": architecture " + arch +
                " is not supported (tessera runs the GGUF architectures llama, qwen2 and gemma3)");
  const bool gemma = c.arch == Architecture::Gemma3;
  Keys k(md, source, arch + ".");
  k.set_what("metadata key");

  c.source = source;
  c.name = g.has("general.name") && md["general.name"].is_string() ? md["general.name"].get<std::string>()
                                                                   : name_from_path(source);
  c.hidden_size = positive(k, "embedding_length", k.integer("embedding_length"));
  c.num_layers = layer_count(k, "block_count", k.integer("block_count"), tensor_count);
  c.intermediate_size = k.integer("feed_forward_length");
  c.num_q_heads = positive(k, "attention.head_count", k.integer("attention.head_count"));
  c.num_kv_heads = k.integer("attention.head_count_kv", c.num_q_heads);
  c.head_dim = k.integer("attention.key_length", c.hidden_size / c.num_q_heads);
  if (k.has("attention.value_length") && k.integer("attention.value_length") != c.head_dim)
    k.fail("attention.value_length", "differs from the key length, which tessera does not support");
  if (k.has("rope.dimension_count") && k.integer("rope.dimension_count") != c.head_dim)
    k.fail("rope.dimension_count", "is " + std::to_string(k.integer("rope.dimension_count")) +
                                       ", not the head dimension " + std::to_string(c.head_dim) +
                                       " (partial RoPE is not supported)");
  c.context_length = k.integer("context_length", gemma ? 131072 : 2048);
  c.rms_norm_eps = static_cast<float>(k.number("attention.layer_norm_rms_epsilon"));
  c.vocab_size = k.has("vocab_size") ? k.integer("vocab_size") : static_cast<int32_t>(vocab_rows);
  c.qkv_bias = c.arch == Architecture::Qwen2;

  RopeConfig rope;
  rope.theta = k.number("rope.freq_base", gemma ? 1000000.0 : 10000.0);
  if (k.has("rope.scaling.type")) {
    const std::string type = k.string("rope.scaling.type");
    if (type == "linear") {
      rope.scaling = RopeScaling::Linear;
      rope.factor = k.number("rope.scaling.factor");
      if (rope.factor <= 0) k.fail("rope.scaling.factor", "must be positive");
      if (rope.factor == 1.0) rope.scaling = RopeScaling::None;
    } else if (type != "none") {
      k.fail("rope.scaling.type", "is " + type + ", which tessera does not support (none, linear)");
    }
  } else if (k.has("rope.scale_linear")) {  // older GGUFs
    rope.factor = k.number("rope.scale_linear");
    if (rope.factor != 1.0) rope.scaling = RopeScaling::Linear;
  }
  // Llama-3.1's "llama3" scaling travels as the rope_freqs.weight tensor (ModelWeights::rope_freq_factors).

  c.layers.resize(static_cast<size_t>(c.num_layers));
  for (auto& l : c.layers) l.rope = rope;

  if (gemma) {
    c.qk_norm = true;
    c.post_norms = true;
    c.activation = Activation::GeluTanh;
    c.embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
    const int32_t window = k.integer("attention.sliding_window", 0);
    if (window > 0) {
      const int32_t pattern = 6;  // llama.cpp: set_swa_pattern(6) for gemma3
      const RopeConfig local{k.number("rope.freq_base_swa", 10000.0)};
      for (int32_t i = 0; i < c.num_layers; ++i) {
        if ((i + 1) % pattern != 0) {
          c.layers[static_cast<size_t>(i)].sliding_window = window;
          c.layers[static_cast<size_t>(i)].rope = local;
        }
      }
    }
    // llama.cpp: 1/sqrt(n_embd / n_head) for the 27B (62 layers), 1/sqrt(head_dim) otherwise.
    const float qpas = c.num_layers == 62 ? static_cast<float>(c.hidden_size / c.num_q_heads)
                                          : static_cast<float>(c.head_dim);
    c.attention_scale = 1.0f / std::sqrt(qpas);
    c.final_logit_softcap = static_cast<float>(k.number("final_logit_softcapping", 0.0));
    if (k.has("attn_logit_softcapping"))
      k.fail("attn_logit_softcapping", "is set, which tessera does not support (Gemma-2 style soft-capping)");
  }
  finish(c, source);
  return c;
}

ModelConfig load_model_config(const model::ModelFile& file) {
  if (file.format() == model::FileFormat::GGUF) {
    const model::TensorInfo* emb = file.find("token_embd.weight");
    ModelConfig c = config_from_gguf(file.metadata(), file.path(), emb ? emb->rows() : 0,
                                     static_cast<int64_t>(file.tensors().size()));
    // The embedding is the truth about the vocabulary (llama.cpp trims Gemma's unused rows; vocab_size may be
    // absent).
    if (emb != nullptr) c.vocab_size = static_cast<int32_t>(emb->rows());
    c.tied_embeddings = file.find("output.weight") == nullptr;
    return c;
  }
  return config_from_hf(file.metadata(), file.path(), static_cast<int64_t>(file.tensors().size()));
}

}  // namespace tessera::runtime
