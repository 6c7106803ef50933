#include "model/weights.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"
#include "model/model_file.h"
#include "model/quant.h"

namespace tessera::runtime {

namespace {

template <class F>
void for_each_weight(const ModelWeights& w, F&& f) {
  f("embedding", w.embedding);
  f("output", w.lm_head);
  f("norms", w.final_norm);
  for (const auto& l : w.layers) {
    for (const Weight* x : {&l.wq, &l.wk, &l.wv, &l.wo}) f("attention", *x);
    for (const Weight* x : {&l.w_gate, &l.w_up, &l.w_down}) f("mlp", *x);
    for (const Weight* x : {&l.attn_norm, &l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm, &l.post_attn_norm,
                            &l.ffn_norm, &l.post_ffn_norm})
      f("norms", *x);
  }
}

std::string mb(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

}  // namespace

Weight Weight::f32(std::vector<float> values, int64_t rows, int64_t cols, std::string name) {
  check(static_cast<int64_t>(values.size()) == rows * cols,
        "Weight::f32: " + std::to_string(values.size()) + " values for [" + std::to_string(rows) + ", " +
            std::to_string(cols) + "]");
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.type = model::TensorType::F32;
  w.name = std::move(name);
  if (values.empty()) return w;
  auto held = std::make_shared<std::vector<float>>(std::move(values));
  w.bytes = reinterpret_cast<const uint8_t*>(held->data());
  w.owner = std::move(held);
  return w;
}

size_t Weight::row_bytes() const { return model::tensor_type_bytes(type, cols); }

const float* Weight::ptr() const {
  if (empty()) return nullptr;
  if (type != model::TensorType::F32)
    throw Error("weight " + (name.empty() ? std::string("(derived)") : name) + " is kept as " +
                std::string(model::tensor_type_name(type)) + ": read it with to_f32()");
  return reinterpret_cast<const float*>(bytes);
}

void Weight::rows_f32(int64_t r0, int64_t count, float* out) const {
  check(r0 >= 0 && count >= 0 && r0 + count <= rows,
        "weight " + name + ": rows [" + std::to_string(r0) + ", " + std::to_string(r0 + count) + ") outside [0, " +
            std::to_string(rows) + ")");
  if (count == 0) return;
  model::dequantize_row(type, bytes + static_cast<size_t>(r0) * row_bytes(), count * cols, out);
}

std::vector<float> Weight::to_f32() const {
  std::vector<float> out(static_cast<size_t>(empty() ? 0 : numel()));
  if (!empty()) rows_f32(0, rows, out.data());
  return out;
}

size_t ModelWeights::bytes() const {
  size_t total = rope_freq_factors.size() * sizeof(float);
  for_each_weight(*this, [&](const char*, const Weight& w) { total += w.stored_bytes(); });
  return total;
}

size_t ModelWeights::owned_bytes() const {
  size_t total = rope_freq_factors.size() * sizeof(float);
  for_each_weight(*this, [&](const char*, const Weight& w) {
    if (!w.mapped()) total += w.stored_bytes();
  });
  return total;
}

std::vector<ModelWeights::Group> ModelWeights::groups() const {
  std::vector<Group> out;
  auto add = [&](const char* group, model::TensorType type, size_t bytes) {
    for (Group& g : out) {
      if (g.group == group && g.type == type) {
        ++g.tensors;
        g.bytes += bytes;
        return;
      }
    }
    out.push_back({group, type, 1, bytes});
  };
  for_each_weight(*this, [&](const char* group, const Weight& w) {
    if (!w.empty()) add(group, w.type, w.stored_bytes());
  });
  if (!rope_freq_factors.empty()) add("norms", model::TensorType::F32, rope_freq_factors.size() * sizeof(float));
  return out;
}

std::string ModelWeights::summary() const {
  std::string s;
  for (const Group& g : groups()) {
    if (!s.empty()) s += ", ";
    s += g.group + " " + std::string(model::tensor_type_name(g.type)) + " (" + std::to_string(g.tensors) +
         (g.tensors == 1 ? " tensor, " : " tensors, ") + mb(g.bytes) + ")";
  }
  return s + "; " + mb(bytes()) + " in all, " + mb(owned_bytes()) + " outside the file mapping";
}

void unpermute_gguf_rope_rows_bytes(uint8_t* w, int64_t heads, int64_t head_dim, size_t row_bytes) {
  const int64_t half = head_dim / 2;
  std::vector<uint8_t> tmp(static_cast<size_t>(head_dim) * row_bytes);
  for (int64_t h = 0; h < heads; ++h) {
    uint8_t* base = w + static_cast<size_t>(h * head_dim) * row_bytes;
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        const uint8_t* src = base + static_cast<size_t>(2 * i + s) * row_bytes;  // GGUF row 2i + s
        uint8_t* dst = tmp.data() + static_cast<size_t>(s * half + i) * row_bytes;  // HF row s * d/2 + i
        std::memcpy(dst, src, row_bytes);
      }
    }
    std::memcpy(base, tmp.data(), tmp.size());
  }
}

void unpermute_gguf_rope_rows(float* w, int64_t heads, int64_t head_dim, int64_t cols) {
  unpermute_gguf_rope_rows_bytes(reinterpret_cast<uint8_t*>(w), heads, head_dim,
                                 static_cast<size_t>(cols) * sizeof(float));
}

namespace {

// True when `name` contains one of the comma-separated non-empty parts of `list` ("*": every name).
bool name_matches(const std::string& list, const std::string& name) {
  if (list == "*") return true;
  size_t b = 0;
  while (b <= list.size()) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    if (e > b && name.find(list.substr(b, e - b)) != std::string::npos) return true;
    b = e + 1;
  }
  return false;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// How a tensor is kept: a matrix (linear weight or embedding table) in its stored type where the products take
// it, or an f32 vector (norms, biases).
enum class Keep { Stored, F32 };

struct Job {
  const model::TensorInfo* tensor = nullptr;
  Weight* dest = nullptr;
  Keep keep = Keep::Stored;
  int64_t rope_heads = 0;            // > 0: a llama GGUF's q/k rows (or bias), put back in rotate_half order
  bool add_one = false;              // HF Gemma's norm: 1 + w
  std::vector<float> f32;            // the values, when kept as f32
  std::vector<uint8_t> copy;         // the stored bytes, when re-ordered or realigned
};

class Loader {
 public:
  Loader(const model::ModelFile& file, const ModelConfig& cfg, const WeightOptions& opt)
      : file_(file), cfg_(cfg), opt_(opt) {}

  // Queues `name` for `dest`, expecting `shape` (outermost first; a vector is {n}).
  void add(const std::string& name, std::vector<int64_t> shape, Weight& dest, Keep keep, int64_t rope_heads = 0,
           bool add_one = false) {
    const model::TensorInfo& t = file_.get(name);  // throws "<file>: missing tensor <name>"
    std::vector<int64_t> got = t.shape;
    // A vector stored as [1, n] or [n] is the same; so is a matrix whose extents match.
    while (got.size() > shape.size() && got.front() == 1) got.erase(got.begin());
    if (got != shape)
      throw Error(file_.path() + ": tensor " + name + " has shape " + t.shape_string() + ", expected " +
                  shape_str(shape) + " for " + cfg_.summary());
    dest.rows = shape.size() == 2 ? shape[0] : 1;
    dest.cols = shape.back();
    dest.name = name;
    Job j;
    j.tensor = &t;
    j.dest = &dest;
    j.keep = keep;
    j.rope_heads = rope_heads;
    j.add_one = add_one;
    jobs_.push_back(std::move(j));
  }
  bool has(const std::string& name) const { return file_.find(name) != nullptr; }

  void run(ThreadPool& pool) {
    // What is copied out of the mapping (f32 expansions, re-ordered rows) is the largest allocation that follows
    // from the input: check it against the host memory budget before making any.
    double bytes = 0;
    for (Job& j : jobs_) {
      const model::TensorType type = j.tensor->type;
      if (j.keep == Keep::Stored && !opt_.expand_f32 && !name_matches(opt_.expand_f32_tensors, j.dest->name) &&
          model::qmatmul_supported(type)) {
        const bool misaligned = type == model::TensorType::F32 && reinterpret_cast<uintptr_t>(j.tensor->data) % 4;
        if (j.rope_heads > 0 || misaligned) bytes += static_cast<double>(j.tensor->bytes);
      } else {
        j.keep = Keep::F32;
        bytes += static_cast<double>(j.tensor->numel()) * sizeof(float);
      }
    }
    check_host_allocation("loading " + file_.path() + " (" + std::to_string(jobs_.size()) +
                              " weight tensors; copies outside the file mapping)",
                          bytes, "use a smaller model");
    pool.parallel_for(static_cast<int64_t>(jobs_.size()), [&](int64_t i, int) { load(jobs_[static_cast<size_t>(i)]); });
    for (Job& j : jobs_) {
      Weight& w = *j.dest;
      if (j.keep == Keep::F32) {
        w = Weight::f32(std::move(j.f32), w.rows, w.cols, std::move(w.name));
      } else if (!j.copy.empty()) {
        auto held = std::make_shared<std::vector<uint8_t>>(std::move(j.copy));
        w.type = j.tensor->type;
        w.bytes = held->data();
        w.owner = std::move(held);
      } else {
        w.type = j.tensor->type;
        w.bytes = j.tensor->data;  // in the mapping
      }
      if (j.keep == Keep::Stored && model::qmatmul_activation_block(w.type) > 0 &&
          name_matches(opt_.int8x2_tensors, w.name))
        w.act = model::QAct::Int8x2;
      else if (j.keep == Keep::Stored && model::qmatmul_activation_block(w.type) > 0 &&
               name_matches(opt_.int8_outlier_tensors, w.name))
        w.act = model::QAct::Int8Outliers;
    }
  }

 private:
  void load(Job& j) {
    const model::TensorInfo& t = *j.tensor;
    if (j.keep == Keep::F32) {
      j.f32.resize(static_cast<size_t>(t.numel()));
      model::dequantize(t, j.f32.data());
      if (j.rope_heads > 0)
        unpermute_gguf_rope_rows(j.f32.data(), j.rope_heads, cfg_.head_dim, j.dest->rows == 1 ? 1 : t.row_length());
      if (j.add_one)
        for (float& x : j.f32) x = 1.0f + x;
      return;
    }
    const bool misaligned = t.type == model::TensorType::F32 && reinterpret_cast<uintptr_t>(t.data) % 4;
    if (j.rope_heads > 0 || misaligned) {
      j.copy.assign(t.data, t.data + t.bytes);
      if (j.rope_heads > 0) unpermute_gguf_rope_rows_bytes(j.copy.data(), j.rope_heads, cfg_.head_dim, t.row_bytes());
    }
  }

  const model::ModelFile& file_;
  const ModelConfig& cfg_;
  const WeightOptions& opt_;
  std::vector<Job> jobs_;
};

}  // namespace

// None by default: one-level int8 activations, as llama.cpp's. On 1,024 tokens of markdown text they put both real
// models' perplexity 0.66-0.81% above the f32 expansion (llama.cpp's own: +1.05% / +0.59%), within 0.3% on prose, and
// no subset of the tensor classes brought both reliably within 0.5%; two levels everywhere (TESSERA_QACT_X2=*) give
// +0.00% / -0.00% but cost prefill ~0.63x and decode 0.75-0.84x on one thread (docs/cpu_kernels.md, "Accuracy:
// two-level int8 activations"): an option; the default is the outlier blocks' second level (below).
std::string default_int8x2_tensors() {
  return "";
}

// Every quantized product by default: one level plus the second level on the outlier blocks (above 2x the row's
// median scale, ~15% of the blocks), multiplied inside the kernels' own pass. It brings both real models within
// 0.25% of the f32 expansion on README and GPL-3 (one level: +0.81% / +0.66% on README) for, at 2 threads, decode
// 0.91-1.02x and prefill 0.84-0.92x of one level's tokens/s (the 32-element block types pay most), and keeps every row
// of the side-by-side with llama.cpp above it (prefill 1.19-3.50x, decode 1.10-4.33x, docs/cpu_kernels.md, "The
// default: the outlier blocks' second level"). TESSERA_QACT_OUTLIERS=none goes back to one level.
std::string default_int8_outlier_tensors() {
  return "*";
}

ModelWeights load_weights(const model::ModelFile& file, const ModelConfig& cfg, ThreadPool& pool,
                          const WeightOptions& options) {
  const bool gguf = file.format() == model::FileFormat::GGUF;
  const bool gemma = cfg.arch == Architecture::Gemma3;
  const int64_t H = cfg.hidden_size, D = cfg.head_dim, F = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t QD = static_cast<int64_t>(cfg.num_q_heads) * D,
                KD = static_cast<int64_t>(cfg.num_kv_heads) * D;

  ModelWeights w;
  w.layers.resize(static_cast<size_t>(cfg.num_layers));
  Loader ld(file, cfg, options);
  constexpr Keep S = Keep::Stored, V32 = Keep::F32;

  // Norm fix-ups: HF Gemma stores w for a norm that multiplies by (1 + w); llama.cpp's GGUF stores 1 + w.
  const bool one = gemma && !gguf;
  // The llama architecture's GGUF q/k rows are permuted for adjacent-pair RoPE (see weights.h).
  const bool perm = gguf && cfg.arch == Architecture::Llama;
  const int64_t q_heads = perm ? cfg.num_q_heads : 0, kv_heads = perm ? cfg.num_kv_heads : 0;

  if (gguf) {
    ld.add("token_embd.weight", {V, H}, w.embedding, S);
    ld.add("output_norm.weight", {H}, w.final_norm, V32);
    if (!cfg.tied_embeddings) ld.add("output.weight", {V, H}, w.lm_head, S);
    if (ld.has("rope_freqs.weight")) {
      const model::TensorInfo& t = file.get("rope_freqs.weight");
      if (t.numel() != D / 2)
        throw Error(file.path() + ": tensor rope_freqs.weight has shape " + t.shape_string() +
                    ", expected [" + std::to_string(D / 2) + "]");
      w.rope_freq_factors.resize(static_cast<size_t>(D / 2));
      model::dequantize(t, w.rope_freq_factors.data());
    }
    for (int32_t l = 0; l < cfg.num_layers; ++l) {
      LayerWeights& L = w.layers[static_cast<size_t>(l)];
      const std::string p = "blk." + std::to_string(l) + ".";
      ld.add(p + "attn_norm.weight", {H}, L.attn_norm, V32);
      ld.add(p + "attn_q.weight", {QD, H}, L.wq, S, q_heads);
      ld.add(p + "attn_k.weight", {KD, H}, L.wk, S, kv_heads);
      ld.add(p + "attn_v.weight", {KD, H}, L.wv, S);
      ld.add(p + "attn_output.weight", {H, QD}, L.wo, S);
      if (cfg.qkv_bias) {
        ld.add(p + "attn_q.bias", {QD}, L.bq, V32, q_heads);
        ld.add(p + "attn_k.bias", {KD}, L.bk, V32, kv_heads);
        ld.add(p + "attn_v.bias", {KD}, L.bv, V32);
      }
      if (cfg.qk_norm) {
        ld.add(p + "attn_q_norm.weight", {D}, L.q_norm, V32);
        ld.add(p + "attn_k_norm.weight", {D}, L.k_norm, V32);
      }
      if (cfg.post_norms) {
        ld.add(p + "post_attention_norm.weight", {H}, L.post_attn_norm, V32);
        ld.add(p + "post_ffw_norm.weight", {H}, L.post_ffn_norm, V32);
      }
      ld.add(p + "ffn_norm.weight", {H}, L.ffn_norm, V32);
      ld.add(p + "ffn_gate.weight", {F, H}, L.w_gate, S);
      ld.add(p + "ffn_up.weight", {F, H}, L.w_up, S);
      ld.add(p + "ffn_down.weight", {H, F}, L.w_down, S);
    }
  } else {
    // The text model's prefix: plain causal LMs, or the language model inside a multimodal Gemma-3
    // checkpoint.
    std::string m = "model.", head = "lm_head.weight";
    for (const char* prefix : {"model.", "language_model.model.", "model.language_model."}) {
      if (ld.has(std::string(prefix) + "embed_tokens.weight")) {
        m = prefix;
        break;
      }
    }
    if (m == "language_model.model." && ld.has("language_model.lm_head.weight"))
      head = "language_model.lm_head.weight";
    ld.add(m + "embed_tokens.weight", {V, H}, w.embedding, S);
    ld.add(m + "norm.weight", {H}, w.final_norm, V32, 0, one);
    if (!cfg.tied_embeddings) ld.add(head, {V, H}, w.lm_head, S);
    for (int32_t l = 0; l < cfg.num_layers; ++l) {
      LayerWeights& L = w.layers[static_cast<size_t>(l)];
      const std::string p = m + "layers." + std::to_string(l) + ".";
      ld.add(p + "input_layernorm.weight", {H}, L.attn_norm, V32, 0, one);
      ld.add(p + "self_attn.q_proj.weight", {QD, H}, L.wq, S);
      ld.add(p + "self_attn.k_proj.weight", {KD, H}, L.wk, S);
      ld.add(p + "self_attn.v_proj.weight", {KD, H}, L.wv, S);
      ld.add(p + "self_attn.o_proj.weight", {H, QD}, L.wo, S);
      if (cfg.qkv_bias) {
        ld.add(p + "self_attn.q_proj.bias", {QD}, L.bq, V32);
        ld.add(p + "self_attn.k_proj.bias", {KD}, L.bk, V32);
        ld.add(p + "self_attn.v_proj.bias", {KD}, L.bv, V32);
      }
      if (cfg.qk_norm) {
        ld.add(p + "self_attn.q_norm.weight", {D}, L.q_norm, V32, 0, one);
        ld.add(p + "self_attn.k_norm.weight", {D}, L.k_norm, V32, 0, one);
      }
      if (cfg.post_norms) {
        ld.add(p + "post_attention_layernorm.weight", {H}, L.post_attn_norm, V32, 0, one);
        ld.add(p + "pre_feedforward_layernorm.weight", {H}, L.ffn_norm, V32, 0, one);
        ld.add(p + "post_feedforward_layernorm.weight", {H}, L.post_ffn_norm, V32, 0, one);
      } else {
        ld.add(p + "post_attention_layernorm.weight", {H}, L.ffn_norm, V32);
      }
      ld.add(p + "mlp.gate_proj.weight", {F, H}, L.w_gate, S);
      ld.add(p + "mlp.up_proj.weight", {F, H}, L.w_up, S);
      ld.add(p + "mlp.down_proj.weight", {H, F}, L.w_down, S);
    }
  }
  ld.run(pool);
  return w;
}

}  // namespace tessera::runtime
