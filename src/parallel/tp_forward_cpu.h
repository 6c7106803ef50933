// tessera/parallel/tp_forward_cpu.h — the slow, obvious twin of the tensor-parallel engine: N virtual ranks on
// the CPU, as a backend of the one layer recipe (runtime/recipe.h).
//
// Each rank holds its shard (parallel/shard.h: its heads' Q/O columns, its KV groups' K/V, its MLP columns, all
// reorganised once). Per layer, every rank computes from the same replicated residual stream x:
//   h = RMSNorm(x);  q_r = h wq_r^T;  K_r, V_r = h wk_r^T, h wv_r^T  (+ biases)
//   a_r = attention of the rank's heads;  o_r = a_r wo_r^T
// then the "all-reduce": o = sum over ranks of o_r (in rank order), x += o (Gemma-3: x += RMSNorm(o)); the MLP
// likewise (m_r with the rank's columns, summed). ShardedCpuOps is runtime::CpuOps whose three split products (qkv,
// out_proj, mlp) run every rank's shard: the ranks' q/k/v land in the model's own head layout, so the attention
// step between them is whatever the CPU step plugs in — a prefill chunk under a sparse policy (runtime::Forward),
// the batched engine's paged decode, streaming memory — and each rank's output projection reads its own heads'
// rows. What the twin checks is the sharding (placement, shard_layer, the reductions' order), in every CPU path:
// it equals the single-rank engine up to the order of the f32 sums (tests/parallel_tp_cpu_test.cpp), whatever the
// placement. (The GPU ranks, parallel/cuda, keep only their own groups' K/V; on the CPU one cache holds all.)
#pragma once

#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "parallel/placement.h"
#include "parallel/shard.h"
#include "runtime/batch_engine.h"
#include "runtime/cpu_ops.h"
#include "runtime/forward.h"
#include "runtime/kv_cache.h"

namespace tessera::parallel {

// The all-reduce of one CPU rank among ranks in other threads or processes: x[0, count) = the sum over ranks of
// their x, in rank order, in place.
using CpuAllReduce = std::function<void(float* x, size_t count)>;

// The ranks of one process's threads (the per-rank CPU twin): all_reduce_sum(rank, x, n) returns once every rank
// has called it, each rank's x then 0 + x_0 + x_1 + ... in rank order (the single-process twin's order, so the
// per-rank twin's sums equal ShardedCpuOps' over all ranks bit for bit). Every rank must pass the same count
// (else each throws "host all-reduce: ranks passed different counts ...").
class HostAllReduce {
 public:
  explicit HostAllReduce(int32_t world);
  void all_reduce_sum(int32_t rank, float* x, size_t count);
  CpuAllReduce of_rank(int32_t rank) {
    return [this, rank](float* x, size_t n) { all_reduce_sum(rank, x, n); };
  }

 private:
  std::barrier<> sync_;
  std::vector<float*> x_;
  std::vector<size_t> count_;
};

// runtime::CpuOps over the ranks of `placement` (validated against the model): see above. With `local` set, only
// those ranks' shards run here (one rank of a per-rank twin: its heads' q/k/v, its columns) and `reduce` sums the
// partial products with the other ranks' (the all-reduce hook) before the residual add.
class ShardedCpuOps final : public runtime::CpuOps {
 public:
  ShardedCpuOps(const runtime::Model& model, const Placement& placement, ThreadPool& pool,
                std::vector<int32_t> local = {}, CpuAllReduce reduce = {});

  void qkv(int32_t l, bool bias) override;
  void out_proj(int32_t l, bool post_norm) override;
  void mlp(int32_t l, int64_t row0, int64_t rows, runtime::Activation act, bool post_norm) override;

  int32_t world() const { return static_cast<int32_t>(ranks_.size()); }
  const RankPlan& plan(int32_t rank) const { return ranks_[static_cast<size_t>(rank)].plan; }

 private:
  struct Rank {
    RankPlan plan;
    std::vector<runtime::LayerWeights> layers;
  };
  std::vector<Rank> ranks_;
  CpuAllReduce reduce_;
  std::vector<float> q_r_, k_r_, v_r_, a_r_, part_, sum_;  // scratch
};

// The single-sequence twin: a runtime::Forward over ShardedCpuOps with its own contiguous KV cache.
class TpForwardCpu {
 public:
  // max_tokens: KV rows (all ranks' groups, one cache).
  TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens, ThreadPool& pool);

  // Runs `tokens` at positions [pos, pos + n) (rows [0, pos) of the cache must hold the earlier tokens), with
  // `policy` (null or empty: dense) and the prompt's total length. Returns the logits of the last token
  // (last_only) or of every token, [rows, vocab].
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len, bool last_only);

  int32_t world() const { return ops_->world(); }
  const RankPlan& plan(int32_t rank) const { return ops_->plan(rank); }

 private:
  ShardedCpuOps* ops_ = nullptr;  // owned by forward_ (set while forward_ is built)
  runtime::Forward forward_;
  runtime::KVCache cache_;
};

// The batched engine's tensor-parallel CPU backend (the twin of `serve --gpus N --parallel M`): a CpuBatchBackend
// whose prefill chunks and decode steps run over ShardedCpuOps.
std::unique_ptr<runtime::BatchBackend> tp_cpu_batch_backend(const runtime::Model& model, const Placement& placement,
                                                            ThreadPool* pool = nullptr);

// One rank of the per-rank twin (each rank its own backend, as each GPU is): a CpuBatchBackend whose products run
// only rank `rank`'s shard, the partial sums all-reduced through `reduce` (HostAllReduce::of_rank in tests). Its KV
// store keeps every KV head's rows, but the rank writes and reads only its own groups'.
std::unique_ptr<runtime::BatchBackend> tp_cpu_rank_backend(const runtime::Model& model, const Placement& placement,
                                                           int32_t rank, CpuAllReduce reduce, ThreadPool& pool);

}  // namespace tessera::parallel
