#include "attention/cuda/layer_attention_cuda.h"

#include <string>
#include <utility>

#include "attention/cuda/sparse_prefill.h"
#include "core/error.h"

namespace tessera::attn::gpu {

CudaLayerAttention::CudaLayerAttention(std::vector<Pattern> patterns, const LoweringContext& ctx,
                                       int num_kv_heads, int head_dim)
    : patterns_(std::move(patterns)), ctx_(ctx), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  for (size_t h = 0; h < patterns_.size(); ++h)
    validate(patterns_[h], "CUDA layer attention head " + std::to_string(h));
  check(sparse_prefill_supports(head_dim, ctx.tile),
        "CUDA layer attention: head_dim " + std::to_string(head_dim) + " with tile " +
            std::to_string(ctx.tile) + " is not supported (head_dim 64, 128 or 256; tile 64 or 128)");
  estimates_ = DeviceEstimates(patterns_, ctx_, num_kv_heads, head_dim);
  builder_ = DeviceIndexBuilder(patterns_, ctx_, estimates_);
}

void CudaLayerAttention::check_args(const AttentionArgs& args) const {
  validate_cuda_args(args);
  check(args.num_q_heads() == static_cast<int64_t>(patterns_.size()) &&
            args.num_kv_heads() == num_kv_heads_ && args.head_dim() == head_dim_ &&
            args.q_len() == ctx_.q_len && args.kv_len() == ctx_.kv_len && args.q_begin == ctx_.q_begin,
        "CUDA layer attention: the call (q " + args.q.shape_string() + ", k " + args.k.shape_string() +
            ", q_begin " + std::to_string(args.q_begin) + ") does not match the layer's shape");
}

void CudaLayerAttention::estimate(const AttentionArgs& args, cudaStream_t stream) {
  if (estimates_.empty()) return;
  check_args(args);
  estimates_.estimate(args.q, args.k, args.effective_scale(), stream);
}

void CudaLayerAttention::build_index(cudaStream_t stream) {
  builder_.build(index_, plan_, stream);
}

void CudaLayerAttention::attend(const AttentionArgs& args, cudaStream_t stream, PrefillKernel kernel,
                                int wgmma_variant) {
  check_args(args);
  sparse_prefill(args, index_, plan_, stream, kernel, wgmma_variant);
}

}  // namespace tessera::attn::gpu
