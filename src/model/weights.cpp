#include "model/weights.h"

#include <functional>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"
#include "model/model_file.h"
#include "model/quant.h"

namespace tessera::runtime {

size_t ModelWeights::bytes() const {
  auto b = [](const Weight& w) { return w.data.size() * sizeof(float); };
  size_t total = b(embedding) + b(lm_head) + b(final_norm) + rope_freq_factors.size() * sizeof(float);
  for (const auto& l : layers) {
    for (const Weight* w :
         {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm,
          &l.post_attn_norm, &l.ffn_norm, &l.post_ffn_norm, &l.w_gate, &l.w_up, &l.w_down})
      total += b(*w);
  }
  return total;
}

void unpermute_gguf_rope_rows(float* w, int64_t heads, int64_t head_dim, int64_t cols) {
  const int64_t half = head_dim / 2;
  std::vector<float> tmp(static_cast<size_t>(head_dim * cols));
  for (int64_t h = 0; h < heads; ++h) {
    float* base = w + h * head_dim * cols;
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        const float* src = base + (2 * i + s) * cols;     // GGUF row 2i + s
        float* dst = tmp.data() + (s * half + i) * cols;  // HF row s * d/2 + i
        std::copy(src, src + cols, dst);
      }
    }
    std::copy(tmp.begin(), tmp.end(), base);
  }
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

struct Job {
  const model::TensorInfo* tensor = nullptr;
  Weight* dest = nullptr;
  std::function<void(Weight&)> fix;  // applied after dequantization (GGUF row order, Gemma's 1 + w)
};

class Loader {
 public:
  Loader(const model::ModelFile& file, const ModelConfig& cfg) : file_(file), cfg_(cfg) {}

  // Queues `name` for `dest`, expecting `shape` (outermost first; a vector is {n}).
  void add(const std::string& name, std::vector<int64_t> shape, Weight& dest,
           std::function<void(Weight&)> fix = {}) {
    const model::TensorInfo& t = file_.get(name);  // throws "<file>: missing tensor <name>"
    std::vector<int64_t> got = t.shape;
    // A vector stored as [1, n] or [n] is the same; so is a matrix whose extents match.
    while (got.size() > shape.size() && got.front() == 1) got.erase(got.begin());
    if (got != shape)
      throw Error(file_.path() + ": tensor " + name + " has shape " + t.shape_string() + ", expected " +
                  shape_str(shape) + " for " + cfg_.summary());
    dest.rows = shape.size() == 2 ? shape[0] : 1;
    dest.cols = shape.back();
    jobs_.push_back({&t, &dest, std::move(fix)});
  }
  bool has(const std::string& name) const { return file_.find(name) != nullptr; }

  void run(ThreadPool& pool) {
    // The f32 copies of every weight are the largest allocation that follows from the input: check them against
    // the host memory budget before making any.
    double bytes = 0;
    for (const Job& j : jobs_) bytes += static_cast<double>(j.tensor->numel()) * sizeof(float);
    check_host_allocation("loading " + file_.path() + " (" + std::to_string(jobs_.size()) +
                              " weight tensors, dequantized to f32)",
                          bytes, "use a smaller model");
    pool.parallel_for(static_cast<int64_t>(jobs_.size()), [&](int64_t i, int) {
      Job& j = jobs_[static_cast<size_t>(i)];
      j.dest->data.resize(static_cast<size_t>(j.tensor->numel()));
      model::dequantize(*j.tensor, j.dest->data.data());
      if (j.fix) j.fix(*j.dest);
    });
  }

 private:
  const model::ModelFile& file_;
  const ModelConfig& cfg_;
  std::vector<Job> jobs_;
};

void add_one(Weight& w) {
  for (float& x : w.data) x = 1.0f + x;
}

}  // namespace

ModelWeights load_weights(const model::ModelFile& file, const ModelConfig& cfg, ThreadPool& pool) {
  const bool gguf = file.format() == model::FileFormat::GGUF;
  const bool gemma = cfg.arch == Architecture::Gemma3;
  const int64_t H = cfg.hidden_size, D = cfg.head_dim, F = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t QD = static_cast<int64_t>(cfg.num_q_heads) * D,
                KD = static_cast<int64_t>(cfg.num_kv_heads) * D;

  ModelWeights w;
  w.layers.resize(static_cast<size_t>(cfg.num_layers));
  Loader ld(file, cfg);

  // Norm fix-ups: HF Gemma stores w for a norm that multiplies by (1 + w); llama.cpp's GGUF stores 1 + w.
  std::function<void(Weight&)> norm_fix;
  if (gemma && !gguf) norm_fix = add_one;
  // The llama architecture's GGUF q/k rows are permuted for adjacent-pair RoPE (see weights.h).
  std::function<void(Weight&)> q_fix, k_fix;
  if (gguf && cfg.arch == Architecture::Llama) {
    q_fix = [&cfg](Weight& t) {
      unpermute_gguf_rope_rows(t.data.data(), cfg.num_q_heads, cfg.head_dim, t.cols);
    };
    k_fix = [&cfg](Weight& t) {
      unpermute_gguf_rope_rows(t.data.data(), cfg.num_kv_heads, cfg.head_dim, t.cols);
    };
  }
  // Bias vectors are [heads * d] with cols 1 for the permutation.
  auto bias_fix = [&cfg](int heads) -> std::function<void(Weight&)> {
    return [&cfg, heads](Weight& t) { unpermute_gguf_rope_rows(t.data.data(), heads, cfg.head_dim, 1); };
  };

  if (gguf) {
    ld.add("token_embd.weight", {V, H}, w.embedding);
    ld.add("output_norm.weight", {H}, w.final_norm);
    if (!cfg.tied_embeddings) ld.add("output.weight", {V, H}, w.lm_head);
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
      ld.add(p + "attn_norm.weight", {H}, L.attn_norm);
      ld.add(p + "attn_q.weight", {QD, H}, L.wq, q_fix);
      ld.add(p + "attn_k.weight", {KD, H}, L.wk, k_fix);
      ld.add(p + "attn_v.weight", {KD, H}, L.wv);
      ld.add(p + "attn_output.weight", {H, QD}, L.wo);
      if (cfg.qkv_bias) {
        const bool perm = cfg.arch == Architecture::Llama;
        ld.add(p + "attn_q.bias", {QD}, L.bq, perm ? bias_fix(cfg.num_q_heads) : nullptr);
        ld.add(p + "attn_k.bias", {KD}, L.bk, perm ? bias_fix(cfg.num_kv_heads) : nullptr);
        ld.add(p + "attn_v.bias", {KD}, L.bv);
      }
      if (cfg.qk_norm) {
        ld.add(p + "attn_q_norm.weight", {D}, L.q_norm);
        ld.add(p + "attn_k_norm.weight", {D}, L.k_norm);
      }
      if (cfg.post_norms) {
        ld.add(p + "post_attention_norm.weight", {H}, L.post_attn_norm);
        ld.add(p + "post_ffw_norm.weight", {H}, L.post_ffn_norm);
      }
      ld.add(p + "ffn_norm.weight", {H}, L.ffn_norm);
      ld.add(p + "ffn_gate.weight", {F, H}, L.w_gate);
      ld.add(p + "ffn_up.weight", {F, H}, L.w_up);
      ld.add(p + "ffn_down.weight", {H, F}, L.w_down);
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
    ld.add(m + "embed_tokens.weight", {V, H}, w.embedding);
    ld.add(m + "norm.weight", {H}, w.final_norm, norm_fix);
    if (!cfg.tied_embeddings) ld.add(head, {V, H}, w.lm_head);
    for (int32_t l = 0; l < cfg.num_layers; ++l) {
      LayerWeights& L = w.layers[static_cast<size_t>(l)];
      const std::string p = m + "layers." + std::to_string(l) + ".";
      ld.add(p + "input_layernorm.weight", {H}, L.attn_norm, norm_fix);
      ld.add(p + "self_attn.q_proj.weight", {QD, H}, L.wq);
      ld.add(p + "self_attn.k_proj.weight", {KD, H}, L.wk);
      ld.add(p + "self_attn.v_proj.weight", {KD, H}, L.wv);
      ld.add(p + "self_attn.o_proj.weight", {H, QD}, L.wo);
      if (cfg.qkv_bias) {
        ld.add(p + "self_attn.q_proj.bias", {QD}, L.bq);
        ld.add(p + "self_attn.k_proj.bias", {KD}, L.bk);
        ld.add(p + "self_attn.v_proj.bias", {KD}, L.bv);
      }
      if (cfg.qk_norm) {
        ld.add(p + "self_attn.q_norm.weight", {D}, L.q_norm, norm_fix);
        ld.add(p + "self_attn.k_norm.weight", {D}, L.k_norm, norm_fix);
      }
      if (cfg.post_norms) {
        ld.add(p + "post_attention_layernorm.weight", {H}, L.post_attn_norm, norm_fix);
        ld.add(p + "pre_feedforward_layernorm.weight", {H}, L.ffn_norm, norm_fix);
        ld.add(p + "post_feedforward_layernorm.weight", {H}, L.post_ffn_norm, norm_fix);
      } else {
        ld.add(p + "post_attention_layernorm.weight", {H}, L.ffn_norm);
      }
      ld.add(p + "mlp.gate_proj.weight", {F, H}, L.w_gate);
      ld.add(p + "mlp.up_proj.weight", {F, H}, L.w_up);
      ld.add(p + "mlp.down_proj.weight", {H, F}, L.w_down);
    }
  }
  ld.run(pool);
  return w;
}

}  // namespace tessera::runtime
