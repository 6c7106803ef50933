#include "attention/cpu/layer_attention_cpu.h"

#include <algorithm>
#include <vector>

#include "attention/cpu/dense_attention.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"

namespace tessera::attn {

void layer_attention_cpu(const AttentionArgs& args, std::span<const Pattern> patterns, int32_t total_len,
                         ThreadPool& pool) {
  if (all_dense(patterns)) {
    dense_attention_cpu(args, pool);
    return;
  }
  const std::vector<Pattern> heads(patterns.begin(), patterns.end());
  const auto n = static_cast<int32_t>(args.q.dim(0));
  const auto kv_len = static_cast<int32_t>(args.k.dim(0));
  const LoweringContext ctx{args.q_begin, n, kv_len, std::max(total_len, kv_len), kCpuQueryTile};
  const std::vector<HeadEstimate> estimates = estimate_layer(heads, args.q, args.k, ctx, args.effective_scale(), pool);
  sparse_attention_cpu(args, lower_layer(heads, estimates, ctx), pool);
}

}  // namespace tessera::attn
