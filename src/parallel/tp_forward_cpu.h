// tessera/parallel/tp_forward_cpu.h — the slow, obvious twin of the tensor-parallel engine: N virtual ranks on
// the CPU.
//
// Each rank holds its shard (parallel/shard.h: its heads' Q/O columns, its KV groups' K/V, its MLP columns, all
// reorganised once) and its own KV cache (only its groups). Per layer, every rank computes from the same
// replicated residual stream x:
//   h = RMSNorm(x);  q_r = h wq_r^T;  K_r, V_r = h wk_r^T, h wv_r^T  (+ biases, QK-norm, RoPE)
//   a_r = attention of the rank's heads, one GQA call per held KV group (the policy's patterns of those
//   heads) o_r = a_r wo_r^T
// then the "all-reduce": o = sum over ranks of o_r (in rank order), x += o (Gemma-3: x += RMSNorm(o)); the
// MLP likewise (m_r with the rank's columns, summed). Logits from the replicated final norm and LM head. It is the
// one layer recipe (runtime/recipe.h) over a backend whose QKV, attention, output and MLP calls run every rank's
// shard and whose reductions sum the ranks' partials (runtime::CpuOps for the replicated rest: embedding, norms,
// head), with the runtime's own executors (attention/cpu), so that it equals runtime::Forward up to the order of the
// f32 sums (tests/parallel_tp_cpu_test.cpp), whatever the placement.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "parallel/placement.h"
#include "parallel/shard.h"
#include "model/model.h"

namespace tessera::parallel {

class TpForwardCpu {
 public:
  // Shards `model` for every rank of `placement` (validated against the model). max_tokens: KV rows per rank.
  TpForwardCpu(const runtime::Model& model, const Placement& placement, int32_t max_tokens, ThreadPool& pool);
  ~TpForwardCpu();

  // Runs `tokens` at positions [pos, pos + n) (rows [0, pos) of every rank's cache must hold the earlier
  // tokens), with `policy` (null or empty: dense) and the prompt's total length. Returns the logits of the
  // last token (last_only) or of every token, [rows, vocab].
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len, bool last_only);

  int32_t world() const;
  const RankPlan& plan(int32_t rank) const;

  // The backend of the layer recipe (runtime/recipe.h) over the ranks' shards: defined in tp_forward_cpu.cpp.
  class Ops;

 private:
  const runtime::Model& model_;
  int32_t max_tokens_ = 0;
  std::unique_ptr<Ops> ops_;
};

}  // namespace tessera::parallel
