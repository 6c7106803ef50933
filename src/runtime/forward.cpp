#include "runtime/forward.h"

#include <algorithm>
#include <chrono>
#include <variant>

#include "attention/attention_args.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "core/error.h"
#include "runtime/ops.h"
#include "runtime/rope.h"

namespace tessera::runtime {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

bool all_dense(const std::vector<attn::Pattern>& patterns) {
  return std::all_of(patterns.begin(), patterns.end(),
                     [](const attn::Pattern& p) { return std::holds_alternative<attn::DensePattern>(p); });
}

}  // namespace

Forward::Forward(const Model& model, ThreadPool& pool) : model_(model), cfg_(model.config()), pool_(pool) {
  LayerRopes ropes = layer_ropes(cfg_, model.weights().rope_freq_factors);
  inv_freqs_ = std::move(ropes.inv_freqs);
  layer_rope_ = std::move(ropes.layer);
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
}

attn::AttentionArgs Forward::attention(int32_t layer, int32_t pos, int32_t n, KVCache& cache,
                        const attn::AttentionPolicy* policy, int32_t total_len) {
  const int32_t nq = cfg_.num_q_heads, d = cfg_.head_dim, kv_len = pos + n;
  attn::AttentionArgs args;
  args.q = TensorView(q_.data(), DType::F32, {n, nq, d});
  args.k = cache.k_view(layer, kv_len);
  args.v = cache.v_view(layer, kv_len);
  args.out = TensorView(attn_.data(), DType::F32, {n, nq, d});
  args.scale = cfg_.attention_scale;
  args.q_begin = pos;

  // A sliding-window layer's window is part of the model: the executors apply it on top of whatever the
  // policy's pattern keeps (a window covering every key changes nothing, so it is left out).
  const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  if (window > 0 && window < kv_len) args.window = window;
  if (policy == nullptr || policy->table().empty() || all_dense(policy->layer(layer))) {
    attn::dense_attention_cpu(args, pool_);
  } else {
    const std::vector<attn::Pattern> patterns = policy->layer(layer);
    attn::LoweringContext ctx{pos, n, kv_len, std::max(total_len, kv_len), kTile};
    const std::vector<attn::HeadEstimate> estimates =
        attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool_);
    attn::sparse_attention_cpu(args, attn::lower_layer(patterns, estimates, ctx), pool_);
  }
  return args;
}

std::vector<float> Forward::run(std::span<const int32_t> tokens, int32_t pos, KVCache& cache,
                                const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows,
                                ForwardTimers& timers) {
  return run_layers(tokens, pos, &cache, nullptr, policy, total_len, rows, timers);
}

std::vector<float> Forward::run(std::span<const int32_t> tokens, int32_t pos, KVPolicy& kv, LogitRows rows,
                                ForwardTimers& timers) {
  return run_layers(tokens, pos, nullptr, &kv, nullptr, 0, rows, timers);
}

std::vector<float> Forward::run_layers(std::span<const int32_t> tokens, int32_t pos, KVCache* cache, KVPolicy* kv,
                                       const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows,
                                       ForwardTimers& timers) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(kv != nullptr || cache->capacity() >= pos + n, "forward: the KV cache has no room for the chunk");
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, F = cfg_.intermediate_size;
  const int64_t QD = cfg_.num_q_heads * D, KD = cfg_.num_kv_heads * D;
  const ModelWeights& w = model_.weights();

  grow(x_, n * H);
  grow(h_, n * H);
  grow(q_, n * QD);
  grow(attn_, n * QD);
  grow(gate_, n * F);
  grow(up_, n * F);
  if (kv != nullptr) {
    grow(k_, n * KD);
    grow(v_, n * KD);
  }
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    grow(cos_[r], n * (D / 2));
    grow(sin_[r], n * (D / 2));
    rope_tables(inv_freqs_[r], pos, n, cos_[r].data(), sin_[r].data());
  }

  // Embeddings (Gemma scales them by sqrt(hidden)).
  for (int32_t t = 0; t < n; ++t) {
    const int32_t tok = tokens[static_cast<size_t>(t)];
    const float* e = w.embedding.ptr() + static_cast<int64_t>(tok) * H;
    float* x = x_.data() + static_cast<int64_t>(t) * H;
    if (cfg_.embedding_scale == 1.0f)
      std::copy(e, e + H, x);
    else
      for (int64_t i = 0; i < H; ++i) x[i] = e[i] * cfg_.embedding_scale;
  }

  auto gemm = [&](const float* in, const Weight& wt, const Weight* bias, float* out) {
    const auto t0 = Clock::now();
    linear(in, n, wt, bias, out);
    timers.gemm_seconds += since(t0);
  };

  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    float* kc = kv != nullptr ? k_.data() : cache->k(l, pos);
    float* vc = kv != nullptr ? v_.data() : cache->v(l, pos);

    rms_norm(x_.data(), h_.data(), n, H, L.attn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    gemm(h_.data(), L.wq, cfg_.qkv_bias ? &L.bq : nullptr, q_.data());
    gemm(h_.data(), L.wk, cfg_.qkv_bias ? &L.bk : nullptr, kc);
    gemm(h_.data(), L.wv, cfg_.qkv_bias ? &L.bv : nullptr, vc);
    if (cfg_.qk_norm) {
      rms_norm(q_.data(), q_.data(), n * cfg_.num_q_heads, D, L.q_norm.ptr(), cfg_.rms_norm_eps, pool_);
      rms_norm(kc, kc, n * cfg_.num_kv_heads, D, L.k_norm.ptr(), cfg_.rms_norm_eps, pool_);
    }
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    if (kv != nullptr) {
      const auto t0 = Clock::now();
      kv->attend(l, pos, n, q_.data(), kc, vc, inv_freqs_[r], cfg_.attention_scale, attn_.data(), pool_);
      timers.attention_seconds += since(t0);
    } else {
      apply_rope(q_.data(), n, QD, cfg_.num_q_heads, D, cos_[r].data(), sin_[r].data());
      apply_rope(kc, n, KD, cfg_.num_kv_heads, D, cos_[r].data(), sin_[r].data());
      const auto t0 = Clock::now();
      const attn::AttentionArgs args = attention(l, pos, n, *cache, policy, total_len);
      timers.attention_seconds += since(t0);
      if (observer_ != nullptr && *observer_) (*observer_)(l, args);
    }

    gemm(attn_.data(), L.wo, nullptr, h_.data());
    if (cfg_.post_norms)
      rms_norm(h_.data(), h_.data(), n, H, L.post_attn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += h_[static_cast<size_t>(i)];

    rms_norm(x_.data(), h_.data(), n, H, L.ffn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    gemm(h_.data(), L.w_gate, nullptr, gate_.data());
    gemm(h_.data(), L.w_up, nullptr, up_.data());
    gated_activation(gate_.data(), up_.data(), n * F, cfg_.activation, pool_);
    gemm(gate_.data(), L.w_down, nullptr, h_.data());
    if (cfg_.post_norms)
      rms_norm(h_.data(), h_.data(), n, H, L.post_ffn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += h_[static_cast<size_t>(i)];
  }

  if (rows == LogitRows::None) return {};
  const int32_t first = rows == LogitRows::Last ? n - 1 : 0;
  const int32_t count = n - first;
  const float* xr = x_.data() + static_cast<int64_t>(first) * H;
  rms_norm(xr, h_.data(), count, H, w.final_norm.ptr(), cfg_.rms_norm_eps, pool_);
  std::vector<float> logits(static_cast<size_t>(count) * static_cast<size_t>(cfg_.vocab_size));
  const auto t0 = Clock::now();
  linear(h_.data(), count, w.output(), nullptr, logits.data());
  timers.gemm_seconds += since(t0);
  if (cfg_.final_logit_softcap > 0)
    softcap(logits.data(), static_cast<int64_t>(logits.size()), cfg_.final_logit_softcap);
  return logits;
}

}  // namespace tessera::runtime
