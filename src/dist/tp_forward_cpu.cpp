#include "dist/tp_forward_cpu.h"

#include <algorithm>
#include <variant>

#include "attention/attention_args.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "core/error.h"
#include "runtime/ops.h"
#include "runtime/rope.h"

namespace tessera::dist {

using runtime::LayerWeights;
using runtime::Weight;

TpForwardCpu::TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens,
                           ThreadPool& pool)
    : model_(model), cfg_(model.config()), pool_(pool), max_tokens_(max_tokens) {
  check(max_tokens > 0, "tensor-parallel forward: max_tokens must be positive");
  const runtime::LayerRopes ropes = runtime::layer_ropes(cfg_, model.weights().rope_freq_factors);
  inv_freqs_ = ropes.inv_freqs;
  layer_rope_ = ropes.layer;
  for (int32_t r = 0; r < placement.num_gpus; ++r) {
    Rank rank;
    rank.plan = rank_plan(cfg_, placement, r);
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      const RankLayer& rl = rank.plan.layers[static_cast<size_t>(l)];
      rank.layers.push_back(shard_layer(model.weights().layers[static_cast<size_t>(l)], cfg_, rl,
                                        rank.plan.ffn_begin, rank.plan.ffn_end));
      const size_t kv =
          static_cast<size_t>(max_tokens) * rl.groups.size() * static_cast<size_t>(cfg_.head_dim);
      rank.k.emplace_back(kv);
      rank.v.emplace_back(kv);
    }
    ranks_.push_back(std::move(rank));
  }
}

void TpForwardCpu::attention(Rank& r, int32_t layer, int32_t pos, int32_t n,
                             const attn::AttentionPolicy* policy, int32_t total_len, const float* q,
                             float* out) {
  const RankLayer& rl = r.plan.layers[static_cast<size_t>(layer)];
  const int64_t d = cfg_.head_dim, m = static_cast<int64_t>(rl.heads.size());
  const auto g_count = static_cast<int64_t>(rl.groups.size());
  const int32_t kv_len = pos + n;
  const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  const bool sparse = policy != nullptr && !policy->table().empty();
  for (size_t gi = 0; gi < rl.groups.size(); ++gi) {
    const auto [h0, h1] = rl.group_heads[gi];
    const int64_t mg = h1 - h0;
    // The group's query heads and its K/V, contiguous for the executor.
    std::vector<float> qg(static_cast<size_t>(n * mg * d)), og(qg.size());
    std::vector<float> kg(static_cast<size_t>(kv_len * d)), vg(kg.size());
    for (int64_t t = 0; t < n; ++t)
      std::copy(q + (t * m + h0) * d, q + (t * m + h1) * d, qg.data() + t * mg * d);
    const float* kc = r.k[static_cast<size_t>(layer)].data();
    const float* vc = r.v[static_cast<size_t>(layer)].data();
    for (int64_t t = 0; t < kv_len; ++t) {
      std::copy(kc + (t * g_count + static_cast<int64_t>(gi)) * d,
                kc + (t * g_count + static_cast<int64_t>(gi) + 1) * d, kg.data() + t * d);
      std::copy(vc + (t * g_count + static_cast<int64_t>(gi)) * d,
                vc + (t * g_count + static_cast<int64_t>(gi) + 1) * d, vg.data() + t * d);
    }
    attn::AttentionArgs args;
    args.q = TensorView(qg.data(), DType::F32, {n, mg, d});
    args.k = TensorView(kg.data(), DType::F32, {kv_len, 1, d});
    args.v = TensorView(vg.data(), DType::F32, {kv_len, 1, d});
    args.out = TensorView(og.data(), DType::F32, {n, mg, d});
    args.scale = cfg_.attention_scale;
    args.q_begin = pos;
    if (window > 0 && window < kv_len) args.window = window;
    std::vector<attn::Pattern> patterns;
    if (sparse)
      for (int32_t h = h0; h < h1; ++h)
        patterns.push_back(policy->at(layer, rl.heads[static_cast<size_t>(h)]));
    const bool dense = !sparse || std::all_of(patterns.begin(), patterns.end(), [](const attn::Pattern& p) {
      return std::holds_alternative<attn::DensePattern>(p);
    });
    if (dense) {
      attn::dense_attention_cpu(args, pool_);
    } else {
      const attn::LoweringContext ctx{pos, n, kv_len, std::max(total_len, kv_len), 64};
      const std::vector<attn::HeadEstimate> estimates =
          attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool_);
      attn::sparse_attention_cpu(args, attn::lower_layer(patterns, estimates, ctx), pool_);
    }
    for (int64_t t = 0; t < n; ++t)
      std::copy(og.data() + t * mg * d, og.data() + (t + 1) * mg * d, out + (t * m + h0) * d);
  }
}

std::vector<float> TpForwardCpu::run(std::span<const int32_t> tokens, int32_t pos,
                                     const attn::AttentionPolicy* policy, int32_t total_len, bool last_only) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(pos + n <= max_tokens_, "tensor-parallel forward: the KV caches have no room for the chunk");
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim;
  const float eps = cfg_.rms_norm_eps;
  const runtime::ModelWeights& w = model_.weights();

  std::vector<float> x(static_cast<size_t>(n * H)), h(x.size()), sum(x.size()), part(x.size());
  for (int32_t t = 0; t < n; ++t) {
    const float* e = w.embedding.ptr() + static_cast<int64_t>(tokens[static_cast<size_t>(t)]) * H;
    for (int64_t i = 0; i < H; ++i) x[static_cast<size_t>(t * H + i)] = e[i] * cfg_.embedding_scale;
  }
  std::vector<std::vector<float>> cos(inv_freqs_.size()), sin(inv_freqs_.size());
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    cos[r].resize(static_cast<size_t>(n * (D / 2)));
    sin[r].resize(cos[r].size());
    runtime::rope_tables(inv_freqs_[r], pos, n, cos[r].data(), sin[r].data());
  }

  // The all-reduce of the CPU twin: partials summed in rank order, then added to the residual stream.
  auto reduce_into_x = [&](const float* post_norm) {
    if (post_norm != nullptr) runtime::rms_norm(sum.data(), sum.data(), n, H, post_norm, eps, pool_);
    for (size_t i = 0; i < x.size(); ++i) x[i] += sum[i];
  };

  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& full = w.layers[static_cast<size_t>(l)];
    const size_t rope = layer_rope_[static_cast<size_t>(l)];
    runtime::rms_norm(x.data(), h.data(), n, H, full.attn_norm.ptr(), eps, pool_);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (Rank& r : ranks_) {
      const LayerWeights& L = r.layers[static_cast<size_t>(l)];
      const RankLayer& rl = r.plan.layers[static_cast<size_t>(l)];
      const auto m = static_cast<int64_t>(rl.heads.size()), g = static_cast<int64_t>(rl.groups.size());
      if (m == 0) continue;  // no head of this layer: nothing to add
      std::vector<float> q(static_cast<size_t>(n * m * D)), a(q.size());
      float* kc = r.k[static_cast<size_t>(l)].data() + static_cast<int64_t>(pos) * g * D;
      float* vc = r.v[static_cast<size_t>(l)].data() + static_cast<int64_t>(pos) * g * D;
      runtime::linear(h.data(), n, L.wq, cfg_.qkv_bias ? &L.bq : nullptr, q.data());
      runtime::linear(h.data(), n, L.wk, cfg_.qkv_bias ? &L.bk : nullptr, kc);
      runtime::linear(h.data(), n, L.wv, cfg_.qkv_bias ? &L.bv : nullptr, vc);
      if (cfg_.qk_norm) {
        runtime::rms_norm(q.data(), q.data(), n * m, D, L.q_norm.ptr(), eps, pool_);
        runtime::rms_norm(kc, kc, n * g, D, L.k_norm.ptr(), eps, pool_);
      }
      runtime::apply_rope(q.data(), n, m * D, m, D, cos[rope].data(), sin[rope].data());
      runtime::apply_rope(kc, n, g * D, g, D, cos[rope].data(), sin[rope].data());
      attention(r, l, pos, n, policy, total_len, q.data(), a.data());
      runtime::linear(a.data(), n, L.wo, nullptr, part.data());
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    reduce_into_x(cfg_.post_norms ? full.post_attn_norm.ptr() : nullptr);

    runtime::rms_norm(x.data(), h.data(), n, H, full.ffn_norm.ptr(), eps, pool_);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (Rank& r : ranks_) {
      const LayerWeights& L = r.layers[static_cast<size_t>(l)];
      const int64_t F = r.plan.ffn_end - r.plan.ffn_begin;
      if (F == 0) continue;
      std::vector<float> gate(static_cast<size_t>(n * F)), up(gate.size());
      runtime::linear(h.data(), n, L.w_gate, nullptr, gate.data());
      runtime::linear(h.data(), n, L.w_up, nullptr, up.data());
      runtime::gated_activation(gate.data(), up.data(), n * F, cfg_.activation, pool_);
      runtime::linear(gate.data(), n, L.w_down, nullptr, part.data());
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    reduce_into_x(cfg_.post_norms ? full.post_ffn_norm.ptr() : nullptr);
  }

  const int32_t first = last_only ? n - 1 : 0;
  const int32_t count = n - first;
  runtime::rms_norm(x.data() + static_cast<int64_t>(first) * H, h.data(), count, H, w.final_norm.ptr(), eps,
                    pool_);
  std::vector<float> logits(static_cast<size_t>(count) * static_cast<size_t>(cfg_.vocab_size));
  runtime::linear(h.data(), count, w.output(), nullptr, logits.data());
  if (cfg_.final_logit_softcap > 0)
    runtime::softcap(logits.data(), static_cast<int64_t>(logits.size()), cfg_.final_logit_softcap);
  return logits;
}

}  // namespace tessera::dist
