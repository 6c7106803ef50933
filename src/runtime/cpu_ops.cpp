#include "runtime/cpu_ops.h"

#include <algorithm>

#include "core/clock.h"
#include "core/error.h"
#include "runtime/forward.h"
#include "runtime/ops.h"
#include "runtime/rope.h"

namespace tessera::runtime {

CpuOps::CpuOps(const ModelConfig& config, const ModelWeights& weights, ThreadPool& pool)
    : cfg_(config), weights_(weights), pool_(pool) {
  LayerRopes ropes = layer_ropes(cfg_, weights.rope_freq_factors);
  inv_freqs_ = std::move(ropes.inv_freqs);
  layer_rope_ = std::move(ropes.layer);
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
}

void CpuOps::begin(std::span<const int32_t> tokens, int32_t pos, std::span<const int32_t> positions,
                   CpuAttentionStep& step, ForwardTimers& timers) {
  check(positions.empty() || positions.size() == tokens.size(), "forward: one position per row");
  tokens_ = tokens;
  n_ = static_cast<int64_t>(tokens.size());
  step_ = &step;
  timers_ = &timers;
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, F = cfg_.intermediate_size;
  const int64_t QD = cfg_.num_q_heads * D, KD = cfg_.num_kv_heads * D;
  const int64_t n = n_;
  grow_to(x_, n * H);
  grow_to(h_, n * H);
  grow_to(q_, n * QD);
  grow_to(attn_, n * QD);
  grow_to(gate_, n * F);
  grow_to(up_, n * F);
  grow_to(k_, n * KD);
  grow_to(v_, n * KD);
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    grow_to(cos_[r], n * (D / 2));
    grow_to(sin_[r], n * (D / 2));
    if (positions.empty()) {
      rope_tables(inv_freqs_[r], pos, n, cos_[r].data(), sin_[r].data());
    } else {
      for (int64_t i = 0; i < n; ++i)
        rope_tables(inv_freqs_[r], positions[static_cast<size_t>(i)], 1, cos_[r].data() + i * (D / 2),
                    sin_[r].data() + i * (D / 2));
    }
  }
}

void CpuOps::embed() {
  const int64_t H = cfg_.hidden_size;
  for (int64_t t = 0; t < n_; ++t) {
    const int32_t tok = tokens_[static_cast<size_t>(t)];
    check(tok >= 0 && tok < cfg_.vocab_size, "forward: token id " + std::to_string(tok) + " outside the vocabulary");
    float* x = x_.data() + t * H;
    weights_.embedding.rows_f32(tok, 1, x);  // dequantized on lookup
    for (int64_t i = 0; i < H; ++i) x[i] *= cfg_.embedding_scale;
  }
}

void CpuOps::norm_x(const Weight& w) {
  rms_norm(x_.data(), h_.data(), n_, cfg_.hidden_size, w.ptr(), cfg_.rms_norm_eps, pool_);
}

void CpuOps::linear_timed(const float* x, int64_t rows, const Weight& w, const Weight* bias, float* y) {
  const auto t0 = Clock::now();
  linear(x, rows, w, bias, y, &pool_);
  timers_->gemm_seconds += seconds_since(t0);
}

void CpuOps::qkv(int32_t l, bool bias) {
  const LayerWeights& L = weights_.layers[static_cast<size_t>(l)];
  kc_ = step_->k_rows(l);
  vc_ = step_->v_rows(l);
  if (kc_ == nullptr) kc_ = k_.data();
  if (vc_ == nullptr) vc_ = v_.data();
  linear_timed(h_.data(), n_, L.wq, bias ? &L.bq : nullptr, q_.data());
  linear_timed(h_.data(), n_, L.wk, bias ? &L.bk : nullptr, kc_);
  linear_timed(h_.data(), n_, L.wv, bias ? &L.bv : nullptr, vc_);
}

void CpuOps::norm_rope_heads(int32_t l, float* x, int64_t stride, int64_t heads, const Weight* norm, bool rope) {
  const int64_t D = cfg_.head_dim;
  if (norm != nullptr) {
    if (stride == heads * D) {
      rms_norm(x, x, n_ * heads, D, norm->ptr(), cfg_.rms_norm_eps, pool_);
    } else {
      for (int64_t t = 0; t < n_; ++t) rms_norm(x + t * stride, x + t * stride, heads, D, norm->ptr(), cfg_.rms_norm_eps, pool_);
    }
  }
  if (rope) {
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    apply_rope(x, n_, stride, heads, D, cos_[r].data(), sin_[r].data());
  }
}

void CpuOps::qk_norm_rope(int32_t l, bool norm, bool rope) {
  const LayerWeights& L = weights_.layers[static_cast<size_t>(l)];
  const int64_t D = cfg_.head_dim;
  norm_rope_heads(l, q_.data(), cfg_.num_q_heads * D, cfg_.num_q_heads, norm ? &L.q_norm : nullptr, rope);
  norm_rope_heads(l, kc_, cfg_.num_kv_heads * D, cfg_.num_kv_heads, norm ? &L.k_norm : nullptr, rope);
}

void CpuOps::attend(int32_t l) {
  const auto t0 = Clock::now();
  step_->attend(l, q_.data(), kc_, vc_, attn_.data());
  timers_->attention_seconds += seconds_since(t0);
}

void CpuOps::add_to_x(int64_t row0, int64_t rows, float* y, const Weight* post_norm) {
  const int64_t H = cfg_.hidden_size;
  if (post_norm != nullptr) rms_norm(y, y, rows, H, post_norm->ptr(), cfg_.rms_norm_eps, pool_);
  float* x = x_.data() + row0 * H;
  for (int64_t i = 0; i < rows * H; ++i) x[i] += y[i];
}

void CpuOps::out_proj(int32_t l, bool post_norm) {
  const LayerWeights& L = weights_.layers[static_cast<size_t>(l)];
  linear_timed(attn_.data(), n_, L.wo, nullptr, h_.data());
  add_to_x(0, n_, h_.data(), post_norm ? &L.post_attn_norm : nullptr);
}

void CpuOps::mlp(int32_t l, int64_t row0, int64_t rows, Activation act, bool post_norm) {
  const LayerWeights& L = weights_.layers[static_cast<size_t>(l)];
  const int64_t H = cfg_.hidden_size, F = cfg_.intermediate_size;
  float* h = h_.data() + row0 * H;
  linear_timed(h, rows, L.w_gate, nullptr, gate_.data());
  linear_timed(h, rows, L.w_up, nullptr, up_.data());
  gated_activation(gate_.data(), up_.data(), rows * F, act, pool_);
  linear_timed(gate_.data(), rows, L.w_down, nullptr, h);
  add_to_x(row0, rows, h, post_norm ? &L.post_ffn_norm : nullptr);
}

std::vector<float> CpuOps::head(int64_t first) {
  const int64_t H = cfg_.hidden_size;
  const int64_t count = n_ - first;
  if (count <= 0) return {};
  rms_norm(x_.data() + first * H, h_.data(), count, H, weights_.final_norm.ptr(), cfg_.rms_norm_eps, pool_);
  std::vector<float> logits(static_cast<size_t>(count) * static_cast<size_t>(cfg_.vocab_size));
  linear_timed(h_.data(), count, weights_.output(), nullptr, logits.data());
  if (cfg_.final_logit_softcap > 0)
    softcap(logits.data(), static_cast<int64_t>(logits.size()), cfg_.final_logit_softcap);
  return logits;
}

}  // namespace tessera::runtime
