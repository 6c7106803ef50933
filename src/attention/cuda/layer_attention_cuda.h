// tessera/attention/cuda/layer_attention_cuda.h — one layer's sparse prefill on the GPU, end to end.
//
// Owns what a layer needs across calls of one shape: the device estimates of its dynamic heads, the index
// builder, the index and its work plan. A call is three asynchronous steps on one stream, each usable alone
// (benchmarks time them separately; tests feed CPU estimates or compare each stage with the CPU):
//   estimate(args)     VS/BS estimators (estimate_cuda.h); nothing for static patterns
//   build_index()      device lowering + heaviest-first plan (lower_cuda.h)
//   attend(args)       the sparse prefill executor (sparse_prefill.h)
// The context's tile is the executor's query tile (64 or 128; 128 on Hopper). Dense causal attention is a
// layer whose patterns are all DensePattern.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "attention/cpu/attention_args.h"
#include "attention/cuda/device_index.h"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/lower_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/index/estimate.h"
#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn::gpu {

class CudaLayerAttention {
 public:
  // patterns: one per query head. Throws tessera::Error for invalid patterns, an unsupported tile or
  // head_dim, or an inconsistent context.
  CudaLayerAttention(std::vector<Pattern> patterns, const LoweringContext& ctx, int num_kv_heads,
                     int head_dim);

  void estimate(const AttentionArgs& args, cudaStream_t stream = nullptr);
  void build_index(cudaStream_t stream = nullptr);
  // kernel, wgmma_variant: which prefill kernel runs (sparse_prefill.h; kAuto and its choice by default).
  void attend(const AttentionArgs& args, cudaStream_t stream = nullptr,
              PrefillKernel kernel = PrefillKernel::kAuto, int wgmma_variant = -1);
  void run(const AttentionArgs& args, cudaStream_t stream = nullptr) {
    estimate(args, stream);
    build_index(stream);
    attend(args, stream);
  }

  // Index build with a warp per (head, tile) (DeviceIndexBuilder::set_warp_per_tile; experimental).
  void set_warp_index_build(bool on) { builder_.set_warp_per_tile(on); }

  bool has_dynamic_heads() const { return !estimates_.empty(); }
  const std::vector<Pattern>& patterns() const { return patterns_; }
  const LoweringContext& context() const { return ctx_; }

  // Inspection (synchronous).
  std::vector<HeadEstimate> download_estimates() const { return estimates_.download(); }
  void upload_estimates(const std::vector<HeadEstimate>& e) { estimates_.upload(e); }
  SparseIndex download_index() const { return index_.download(); }
  std::vector<int32_t> download_plan() const { return plan_.download(); }
  const DeviceSparseIndex& index() const { return index_; }

 private:
  void check_args(const AttentionArgs& args) const;

  std::vector<Pattern> patterns_;
  LoweringContext ctx_;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  DeviceEstimates estimates_;
  DeviceIndexBuilder builder_;
  DeviceSparseIndex index_;
  DeviceWorkPlan plan_;
};

}  // namespace tessera::attn::gpu
