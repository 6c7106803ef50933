#include "parallel/tp_forward_cpu.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/ops.h"

namespace tessera::parallel {

using runtime::grow_to;
using runtime::LayerWeights;

HostAllReduce::HostAllReduce(int32_t world)
    : sync_(world), x_(static_cast<size_t>(world), nullptr), count_(static_cast<size_t>(world), 0) {}

void HostAllReduce::all_reduce_sum(int32_t rank, float* x, size_t count) {
  x_[static_cast<size_t>(rank)] = x;
  count_[static_cast<size_t>(rank)] = count;
  sync_.arrive_and_wait();  // every rank's x is posted
  const bool same = std::all_of(count_.begin(), count_.end(), [&](size_t c) { return c == count_[0]; });
  std::vector<float> sum;
  if (same) {
    sum.assign(count, 0.0f);
    for (const float* r : x_)
      for (size_t i = 0; i < count; ++i) sum[i] += r[i];
  }
  const std::string counts = same ? "" : [&] {
    std::string c;
    for (size_t v : count_) c += (c.empty() ? "" : ", ") + std::to_string(v);
    return c;
  }();
  sync_.arrive_and_wait();  // every rank has read every x: each may write its own
  check(same, "host all-reduce: ranks passed different counts (" + counts + ")");
  std::copy(sum.begin(), sum.end(), x);
}

ShardedCpuOps::ShardedCpuOps(const runtime::Model& model, const Placement& placement, ThreadPool& pool,
                             std::vector<int32_t> local, CpuAllReduce reduce)
    : CpuOps(model.config(), model.weights(), pool), reduce_(std::move(reduce)) {
  if (local.empty())
    for (int32_t r = 0; r < placement.num_gpus; ++r) local.push_back(r);
  for (int32_t r : local) {
    check(r >= 0 && r < placement.num_gpus, "tensor-parallel CPU twin: rank " + std::to_string(r) + " outside [0, " +
                                                std::to_string(placement.num_gpus) + ")");
    Rank rank;
    rank.plan = rank_plan(cfg_, placement, r);
    for (int32_t l = 0; l < cfg_.num_layers; ++l)
      rank.layers.push_back(shard_layer(weights_.layers[static_cast<size_t>(l)], cfg_,
                                        rank.plan.layers[static_cast<size_t>(l)], rank.plan.ffn_begin,
                                        rank.plan.ffn_end));
    ranks_.push_back(std::move(rank));
  }
}

// Each rank's products, scattered into the model's head layout: q [n, q_heads, d] and the K/V rows where the
// attention step wants them, [n, kv_heads, d]. A KV group split over ranks is computed by each of them (the same
// rows of the same weights: the same values).
void ShardedCpuOps::qkv(int32_t l, bool bias) {
  kc_ = step_->k_rows(l);
  vc_ = step_->v_rows(l);
  if (kc_ == nullptr) kc_ = k_.data();
  if (vc_ == nullptr) vc_ = v_.data();
  const int64_t D = cfg_.head_dim, QD = cfg_.num_q_heads * D, KD = cfg_.num_kv_heads * D;
  for (Rank& r : ranks_) {
    const LayerWeights& L = r.layers[static_cast<size_t>(l)];
    const RankLayer& rl = r.plan.layers[static_cast<size_t>(l)];
    const auto m = static_cast<int64_t>(rl.heads.size()), g = static_cast<int64_t>(rl.groups.size());
    if (m == 0) continue;  // no head of this layer
    grow_to(q_r_, n_ * m * D);
    grow_to(k_r_, n_ * g * D);
    grow_to(v_r_, n_ * g * D);
    linear_timed(h_.data(), n_, L.wq, bias ? &L.bq : nullptr, q_r_.data());
    linear_timed(h_.data(), n_, L.wk, bias ? &L.bk : nullptr, k_r_.data());
    linear_timed(h_.data(), n_, L.wv, bias ? &L.bv : nullptr, v_r_.data());
    for (int64_t t = 0; t < n_; ++t) {
      for (int64_t i = 0; i < m; ++i)
        std::copy_n(q_r_.data() + (t * m + i) * D, D, q_.data() + t * QD + rl.heads[static_cast<size_t>(i)] * D);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t dst = t * KD + rl.groups[static_cast<size_t>(j)] * D;
        std::copy_n(k_r_.data() + (t * g + j) * D, D, kc_ + dst);
        std::copy_n(v_r_.data() + (t * g + j) * D, D, vc_ + dst);
      }
    }
  }
}

// Each rank's output projection of its own heads' attention rows; the partials summed in rank order (the
// all-reduce), then the residual add.
void ShardedCpuOps::out_proj(int32_t l, bool post_norm) {
  const int64_t D = cfg_.head_dim, QD = cfg_.num_q_heads * D, H = cfg_.hidden_size;
  grow_to(sum_, n_ * H);
  grow_to(part_, n_ * H);
  std::fill_n(sum_.begin(), n_ * H, 0.0f);
  for (Rank& r : ranks_) {
    const RankLayer& rl = r.plan.layers[static_cast<size_t>(l)];
    const auto m = static_cast<int64_t>(rl.heads.size());
    if (m == 0) continue;
    grow_to(a_r_, n_ * m * D);
    for (int64_t t = 0; t < n_; ++t)
      for (int64_t i = 0; i < m; ++i)
        std::copy_n(attn_.data() + t * QD + rl.heads[static_cast<size_t>(i)] * D, D, a_r_.data() + (t * m + i) * D);
    linear_timed(a_r_.data(), n_, r.layers[static_cast<size_t>(l)].wo, nullptr, part_.data());
    for (int64_t i = 0; i < n_ * H; ++i) sum_[static_cast<size_t>(i)] += part_[static_cast<size_t>(i)];
  }
  if (reduce_) reduce_(sum_.data(), static_cast<size_t>(n_ * H));
  add_to_x(0, n_, sum_.data(), post_norm ? &weights_.layers[static_cast<size_t>(l)].post_attn_norm : nullptr);
}

// Each rank's MLP columns; the partials summed in rank order.
void ShardedCpuOps::mlp(int32_t l, int64_t row0, int64_t rows, runtime::Activation act, bool post_norm) {
  const int64_t H = cfg_.hidden_size;
  grow_to(sum_, rows * H);
  grow_to(part_, rows * H);
  std::fill_n(sum_.begin(), rows * H, 0.0f);
  const float* h = h_.data() + row0 * H;
  for (Rank& r : ranks_) {
    const LayerWeights& L = r.layers[static_cast<size_t>(l)];
    const int64_t F = r.plan.ffn_end - r.plan.ffn_begin;
    if (F == 0) continue;
    grow_to(gate_, rows * F);
    grow_to(up_, rows * F);
    linear_timed(h, rows, L.w_gate, nullptr, gate_.data());
    linear_timed(h, rows, L.w_up, nullptr, up_.data());
    runtime::gated_activation(gate_.data(), up_.data(), rows * F, act, pool_);
    linear_timed(gate_.data(), rows, L.w_down, nullptr, part_.data());
    for (int64_t i = 0; i < rows * H; ++i) sum_[static_cast<size_t>(i)] += part_[static_cast<size_t>(i)];
  }
  if (reduce_) reduce_(sum_.data(), static_cast<size_t>(rows * H));
  add_to_x(row0, rows, sum_.data(), post_norm ? &weights_.layers[static_cast<size_t>(l)].post_ffn_norm : nullptr);
}

namespace {
std::unique_ptr<ShardedCpuOps> sharded(const runtime::Model& model, const Placement& placement, ThreadPool& pool,
                                       ShardedCpuOps** keep, std::vector<int32_t> local = {},
                                       CpuAllReduce reduce = {}) {
  auto ops = std::make_unique<ShardedCpuOps>(model, placement, pool, std::move(local), std::move(reduce));
  if (keep != nullptr) *keep = ops.get();
  return ops;
}
}  // namespace

TpForwardCpu::TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens,
                           ThreadPool& pool)
    : forward_(model, pool, sharded(model, placement, pool, &ops_)),
      cache_(model.config().num_layers, model.config().num_kv_heads, model.config().head_dim, max_tokens) {
  check(max_tokens > 0, "tensor-parallel forward: max_tokens must be positive");
  cache_.reserve(max_tokens);
}

std::vector<float> TpForwardCpu::run(std::span<const int32_t> tokens, int32_t pos,
                                     const attn::AttentionPolicy* policy, int32_t total_len, bool last_only) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(pos + n <= cache_.capacity(), "tensor-parallel forward: the KV cache has no room for the chunk");
  runtime::ForwardTimers timers;
  return forward_.run(tokens, pos, cache_, policy, total_len,
                      last_only ? runtime::LogitRows::Last : runtime::LogitRows::All, timers);
}

std::unique_ptr<runtime::BatchBackend> tp_cpu_batch_backend(const runtime::Model& model, const Placement& placement,
                                                            ThreadPool* pool) {
  ThreadPool& p = pool != nullptr ? *pool : ThreadPool::global();
  return std::make_unique<runtime::CpuBatchBackend>(model, &p, sharded(model, placement, p, nullptr));
}

std::unique_ptr<runtime::BatchBackend> tp_cpu_rank_backend(const runtime::Model& model, const Placement& placement,
                                                           int32_t rank, CpuAllReduce reduce, ThreadPool& pool) {
  check(static_cast<bool>(reduce), "tensor-parallel CPU twin: a rank backend needs its all-reduce");
  return std::make_unique<runtime::CpuBatchBackend>(model, &pool,
                                                    sharded(model, placement, pool, nullptr, {rank}, std::move(reduce)));
}

}  // namespace tessera::parallel
