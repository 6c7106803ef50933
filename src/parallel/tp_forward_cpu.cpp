#include "parallel/tp_forward_cpu.h"

#include <algorithm>

#include "attention/attention_args.h"
#include "attention/cpu/layer_attention_cpu.h"
#include "core/clock.h"
#include "core/error.h"
#include "runtime/cpu_ops.h"
#include "runtime/ops.h"
#include "runtime/recipe.h"

namespace tessera::parallel {

using runtime::LayerWeights;
using runtime::grow_to;

namespace {
// The replicated part has no attention step of its own: every call that needs one is the ranks' (below).
class NoAttention final : public runtime::CpuAttentionStep {
 public:
  void attend(int32_t, float*, float*, float*, float*) override {}
};
}  // namespace

// runtime::CpuOps for the replicated residual stream (embedding, norms, head); the QKV, attention, output and MLP
// calls run every rank's shard in rank order, and out_proj / mlp sum the ranks' partials (the all-reduce) before
// the residual add.
class TpForwardCpu::Ops final : public runtime::CpuOps {
 public:
  struct Rank {
    RankPlan plan;
    std::vector<LayerWeights> layers;
    std::vector<std::vector<float>> k, v;  // per layer [max_tokens, groups, d]
    std::vector<float> q, a, gate, up;     // scratch
  };

  Ops(const runtime::Model& model, const Placement& placement, int32_t max_tokens, ThreadPool& pool)
      : CpuOps(model.config(), model.weights(), pool) {
    for (int32_t r = 0; r < placement.num_gpus; ++r) {
      Rank rank;
      rank.plan = rank_plan(cfg_, placement, r);
      for (int32_t l = 0; l < cfg_.num_layers; ++l) {
        const RankLayer& rl = rank.plan.layers[static_cast<size_t>(l)];
        rank.layers.push_back(shard_layer(model.weights().layers[static_cast<size_t>(l)], cfg_, rl,
                                          rank.plan.ffn_begin, rank.plan.ffn_end));
        const size_t kv = static_cast<size_t>(max_tokens) * rl.groups.size() * static_cast<size_t>(cfg_.head_dim);
        rank.k.emplace_back(kv);
        rank.v.emplace_back(kv);
      }
      ranks_.push_back(std::move(rank));
    }
  }

  void start(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy, int32_t total_len,
             runtime::ForwardTimers& timers) {
    pos_ = pos;
    policy_ = policy;
    total_len_ = total_len;
    begin(tokens, pos, {}, no_attention_, timers);
    grow_to(sum_, n_ * cfg_.hidden_size);
  }

  // --- the recipe's calls that run the shards
  void qkv(int32_t l, bool bias) {
    const int64_t D = cfg_.head_dim;
    for (Rank& r : ranks_) {
      const LayerWeights& L = r.layers[static_cast<size_t>(l)];
      const RankLayer& rl = r.plan.layers[static_cast<size_t>(l)];
      const auto m = static_cast<int64_t>(rl.heads.size()), g = static_cast<int64_t>(rl.groups.size());
      if (m == 0) continue;  // no head of this layer
      grow_to(r.q, n_ * m * D);
      grow_to(r.a, n_ * m * D);
      linear_timed(h_.data(), n_, L.wq, bias ? &L.bq : nullptr, r.q.data());
      linear_timed(h_.data(), n_, L.wk, bias ? &L.bk : nullptr, rank_k(r, l, g));
      linear_timed(h_.data(), n_, L.wv, bias ? &L.bv : nullptr, rank_v(r, l, g));
    }
  }
  void qk_norm_rope(int32_t l, bool norm, bool rope) {
    const int64_t D = cfg_.head_dim;
    for (Rank& r : ranks_) {
      const LayerWeights& L = r.layers[static_cast<size_t>(l)];
      const RankLayer& rl = r.plan.layers[static_cast<size_t>(l)];
      const auto m = static_cast<int64_t>(rl.heads.size()), g = static_cast<int64_t>(rl.groups.size());
      if (m == 0) continue;
      norm_rope_heads(l, r.q.data(), m * D, m, norm ? &L.q_norm : nullptr, rope);
      norm_rope_heads(l, rank_k(r, l, g), g * D, g, norm ? &L.k_norm : nullptr, rope);
    }
  }
  bool attention_rotates(int32_t) const { return false; }
  void attend(int32_t l) {
    const auto t0 = Clock::now();
    for (Rank& r : ranks_)
      if (!r.plan.layers[static_cast<size_t>(l)].heads.empty()) rank_attention(r, l);
    timers_->attention_seconds += seconds_since(t0);
  }
  void out_proj(int32_t l, bool post_norm) {
    std::fill(sum_.begin(), sum_.begin() + n_ * cfg_.hidden_size, 0.0f);
    for (Rank& r : ranks_) {
      if (r.plan.layers[static_cast<size_t>(l)].heads.empty()) continue;
      linear_timed(r.a.data(), n_, r.layers[static_cast<size_t>(l)].wo, nullptr, h_.data());
      add_partial();
    }
    add_to_x(0, n_, sum_.data(), post_norm ? &weights_.layers[static_cast<size_t>(l)].post_attn_norm : nullptr);
  }
  void mlp(int32_t l, int64_t row0, int64_t rows, runtime::Activation act, bool post_norm) {
    const int64_t H = cfg_.hidden_size;
    // h holds the ffn-normed rows; the partials go to part_ so that h stays for the next rank.
    grow_to(part_, rows * H);
    std::fill(sum_.begin(), sum_.begin() + rows * H, 0.0f);
    const float* h = h_.data() + row0 * H;
    for (Rank& r : ranks_) {
      const LayerWeights& L = r.layers[static_cast<size_t>(l)];
      const int64_t F = r.plan.ffn_end - r.plan.ffn_begin;
      if (F == 0) continue;
      grow_to(r.gate, rows * F);
      grow_to(r.up, rows * F);
      linear_timed(h, rows, L.w_gate, nullptr, r.gate.data());
      linear_timed(h, rows, L.w_up, nullptr, r.up.data());
      runtime::gated_activation(r.gate.data(), r.up.data(), rows * F, act, pool_);
      linear_timed(r.gate.data(), rows, L.w_down, nullptr, part_.data());
      for (int64_t i = 0; i < rows * H; ++i) sum_[static_cast<size_t>(i)] += part_[static_cast<size_t>(i)];
    }
    add_to_x(row0, rows, sum_.data(), post_norm ? &weights_.layers[static_cast<size_t>(l)].post_ffn_norm : nullptr);
  }

  const std::vector<Rank>& ranks() const { return ranks_; }

 private:
  float* rank_k(Rank& r, int32_t l, int64_t g) {
    return r.k[static_cast<size_t>(l)].data() + static_cast<int64_t>(pos_) * g * cfg_.head_dim;
  }
  float* rank_v(Rank& r, int32_t l, int64_t g) {
    return r.v[static_cast<size_t>(l)].data() + static_cast<int64_t>(pos_) * g * cfg_.head_dim;
  }
  // sum += the partial in h (the rank's output projection).
  void add_partial() {
    for (int64_t i = 0; i < n_ * cfg_.hidden_size; ++i) sum_[static_cast<size_t>(i)] += h_[static_cast<size_t>(i)];
  }

  // The rank's heads of layer l, one GQA call per held KV group (the policy's patterns of those heads).
  void rank_attention(Rank& r, int32_t layer) {
    const RankLayer& rl = r.plan.layers[static_cast<size_t>(layer)];
    const int64_t d = cfg_.head_dim, m = static_cast<int64_t>(rl.heads.size());
    const auto g_count = static_cast<int64_t>(rl.groups.size());
    const auto n = static_cast<int32_t>(n_);
    const int32_t kv_len = pos_ + n;
    const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
    const bool sparse = policy_ != nullptr && !policy_->table().empty();
    const float* q = r.q.data();
    float* out = r.a.data();
    for (size_t gi = 0; gi < rl.groups.size(); ++gi) {
      const auto [h0, h1] = rl.group_heads[gi];
      const int64_t mg = h1 - h0;
      // The group's query heads and its K/V, contiguous for the executor.
      std::vector<float> qg(static_cast<size_t>(n * mg * d)), og(qg.size());
      std::vector<float> kg(static_cast<size_t>(kv_len * d)), vg(kg.size());
      for (int64_t t = 0; t < n; ++t) std::copy(q + (t * m + h0) * d, q + (t * m + h1) * d, qg.data() + t * mg * d);
      const float* kc = r.k[static_cast<size_t>(layer)].data();
      const float* vc = r.v[static_cast<size_t>(layer)].data();
      for (int64_t t = 0; t < kv_len; ++t) {
        const int64_t src = (t * g_count + static_cast<int64_t>(gi)) * d;
        std::copy(kc + src, kc + src + d, kg.data() + t * d);
        std::copy(vc + src, vc + src + d, vg.data() + t * d);
      }
      attn::AttentionArgs args;
      args.q = TensorView(qg.data(), DType::F32, {n, mg, d});
      args.k = TensorView(kg.data(), DType::F32, {kv_len, 1, d});
      args.v = TensorView(vg.data(), DType::F32, {kv_len, 1, d});
      args.out = TensorView(og.data(), DType::F32, {n, mg, d});
      args.scale = cfg_.attention_scale;
      args.q_begin = pos_;
      if (window > 0 && window < kv_len) args.window = window;
      std::vector<attn::Pattern> patterns;
      if (sparse)
        for (int32_t h = h0; h < h1; ++h) patterns.push_back(policy_->at(layer, rl.heads[static_cast<size_t>(h)]));
      attn::layer_attention_cpu(args, patterns, total_len_, pool_);
      for (int64_t t = 0; t < n; ++t)
        std::copy(og.data() + t * mg * d, og.data() + (t + 1) * mg * d, out + (t * m + h0) * d);
    }
  }

  std::vector<Rank> ranks_;
  NoAttention no_attention_;
  int32_t pos_ = 0;
  const attn::AttentionPolicy* policy_ = nullptr;
  int32_t total_len_ = 0;
  std::vector<float> sum_, part_;
};

TpForwardCpu::TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens,
                           ThreadPool& pool)
    : model_(model), max_tokens_(max_tokens) {
  check(max_tokens > 0, "tensor-parallel forward: max_tokens must be positive");
  ops_ = std::make_unique<Ops>(model, placement, max_tokens, pool);
}

TpForwardCpu::~TpForwardCpu() = default;

int32_t TpForwardCpu::world() const { return static_cast<int32_t>(ops_->ranks().size()); }

const RankPlan& TpForwardCpu::plan(int32_t rank) const { return ops_->ranks()[static_cast<size_t>(rank)].plan; }

std::vector<float> TpForwardCpu::run(std::span<const int32_t> tokens, int32_t pos,
                                     const attn::AttentionPolicy* policy, int32_t total_len, bool last_only) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(pos + n <= max_tokens_, "tensor-parallel forward: the KV caches have no room for the chunk");
  runtime::ForwardTimers timers;
  ops_->start(tokens, pos, policy, total_len, timers);
  runtime::run_layers(model_.config(), *ops_);
  return ops_->head(last_only ? n - 1 : 0);
}

}  // namespace tessera::parallel
