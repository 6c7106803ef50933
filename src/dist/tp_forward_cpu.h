// tessera/dist/tp_forward_cpu.h — the slow, obvious twin of the tensor-parallel engine: N virtual ranks on
// the CPU.
//
// Each rank holds its shard (dist/shard.h: its heads' Q/O columns, its KV groups' K/V, its MLP columns, all
// reorganised once) and its own KV cache (only its groups). Per layer, every rank computes from the same
// replicated residual stream x:
//   h = RMSNorm(x);  q_r = h wq_r^T;  K_r, V_r = h wk_r^T, h wv_r^T  (+ biases, QK-norm, RoPE)
//   a_r = attention of the rank's heads, one GQA call per held KV group (the policy's patterns of those
//   heads) o_r = a_r wo_r^T
// then the "all-reduce": o = sum over ranks of o_r (in rank order), x += o (Gemma-3: x += RMSNorm(o)); the
// MLP likewise (m_r with the rank's columns, summed). Logits from the replicated final norm and LM head. It
// runs the runtime's own ops and executors (runtime/ops.h, attention/cpu), so that it equals runtime::Forward
// up to the order of the f32 sums (tests/dist_tp_cpu_test.cpp), whatever the placement.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "dist/placement.h"
#include "dist/shard.h"
#include "runtime/model.h"

namespace tessera::dist {

class TpForwardCpu {
 public:
  // Shards `model` for every rank of `placement` (validated against the model). max_tokens: KV rows per rank.
  TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens, ThreadPool& pool);

  // Runs `tokens` at positions [pos, pos + n) (rows [0, pos) of every rank's cache must hold the earlier
  // tokens), with `policy` (null or empty: dense) and the prompt's total length. Returns the logits of the
  // last token (last_only) or of every token, [rows, vocab].
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len, bool last_only);

  int32_t world() const { return static_cast<int32_t>(ranks_.size()); }
  const RankPlan& plan(int32_t rank) const { return ranks_[static_cast<size_t>(rank)].plan; }

 private:
  struct Rank {
    RankPlan plan;
    std::vector<runtime::LayerWeights> layers;
    std::vector<std::vector<float>> k, v;  // per layer [max_tokens, groups, d]
  };
  void attention(Rank& r, int32_t layer, int32_t pos, int32_t n, const attn::AttentionPolicy* policy,
                 int32_t total_len, const float* q, float* out);

  const runtime::Model& model_;
  const runtime::ModelConfig& cfg_;
  ThreadPool& pool_;
  int32_t max_tokens_ = 0;
  std::vector<Rank> ranks_;
  std::vector<std::vector<float>> inv_freqs_;
  std::vector<size_t> layer_rope_;
};

}  // namespace tessera::dist
