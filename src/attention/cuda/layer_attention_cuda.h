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
//
// Which executor runs a call is the layer's route (attention/index/prefill_route.h), computed once per dtype and
// window from the options, the patterns, the shape and the device, and reported by last_path():
//  - an all-dense layer runs on the dense backend: cuDNN's fused SDPA (cudnn_sdpa.h) where the route takes it
//    (whole-prompt prefill, no window, q_len >= kCudnnMinQLen, cuDNN the faster at that length by kCudnnRelTime,
//    measured on an H200), else our kernel on the dense index;
//  - dense shortcut (dense_shortcut.h): a sparse layer whose budgets already cover most keys runs dense without
//    estimation or index build ("dense shortcut X");
//  - dense fallback (per call, on the sparse path): a layer whose built index costs more than dense attention would
//    runs dense instead ("dense fallback X"). Cost = key tiles of 64 plus one per item (work_plan.h), summed on the
//    device by build_index(); fall back iff C_sparse > r * C_dense, r = the dense backend's time per tile relative to
//    our kernel's. Deciding needs the sparse cost on the host: one 8-byte copy and a stream synchronisation per call
//    for layers with dynamic (VS/BS) heads, once per layer for static ones. Not applied with args.window > 0 (the
//    window already bounds the work), nor when attend() is asked for a specific kernel.
// The options (CudaAttentionOptions: kernel, dense backend, fallback, shortcut, split) come from the constructor
// (default: the process defaults, cuda_attention_defaults(), which read the documented environment overrides once).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cuda/device_index.h"
#include "attention/cuda/estimate_cuda.h"
#include "attention/cuda/lower_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/index/estimate.h"
#include "attention/index/prefill_route.h"
#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn::gpu {

class CudaLayerAttention {
 public:
  // patterns: one per query head. Throws tessera::Error for invalid patterns, an unsupported tile or
  // head_dim, or an inconsistent context.
  CudaLayerAttention(std::vector<Pattern> patterns, const LoweringContext& ctx, int num_kv_heads, int head_dim,
                     const CudaAttentionOptions& options = cuda_attention_defaults());

  void estimate(const AttentionArgs& args, cudaStream_t stream = nullptr);
  void build_index(cudaStream_t stream = nullptr);
  // kernel: kAuto follows the route; kMma / kWgmma run that kernel on the sparse index (no dense paths).
  void attend(const AttentionArgs& args, cudaStream_t stream = nullptr, PrefillKernel kernel = PrefillKernel::kAuto);
  // estimate, build_index (skipped for an all-dense layer that runs on cuDNN), attend.
  void run(const AttentionArgs& args, cudaStream_t stream = nullptr);

  // Options (see the top of this file); a change applies from the next call.
  const CudaAttentionOptions& options() const { return options_; }
  void set_options(const CudaAttentionOptions& o);
  void set_dense_backend(DenseBackend b) { set_option(&CudaAttentionOptions::dense_backend, b); }
  DenseBackend dense_backend() const { return options_.dense_backend; }
  void set_dense_fallback(bool on) { set_option(&CudaAttentionOptions::dense_fallback, on); }
  bool dense_fallback() const { return options_.dense_fallback; }
  // The shortcut alone can be switched off (on by default; the dense fallback switch covers both).
  void set_dense_shortcut(bool on) { set_option(&CudaAttentionOptions::dense_shortcut, on); }
  bool all_dense() const { return all_dense_; }
  // The layer's route for a call like `args` (computed on first use for its dtype and window; may build the cuDNN
  // plan and run the Hopper kernel's self-check).
  const PrefillRoute& route(const AttentionArgs& args, cudaStream_t stream = nullptr);
  // The dense backend the route takes for this call: kCudnn or kOurs.
  DenseBackend resolve_dense_backend(const AttentionArgs& args) { return route(args).dense; }
  // What the last attend() ran, e.g. "sparse wgmma", "dense cudnn", "dense fallback cudnn",
  // "dense shortcut mma.sync" (PrefillRoute::name).
  const std::string& last_path() const { return last_path_; }
  // The route took cuDNN and its launch failed (this layer then runs dense on ours; the error is kept).
  bool cudnn_failed() const { return cudnn_failed_; }
  const std::string& cudnn_error() const { return cudnn_error_; }
  // Costs of the dense fallback rule for the last build_index(): sparse (downloaded) and dense (host).
  int64_t sparse_cost(cudaStream_t stream = nullptr) const { return builder_.download_total_cost(stream); }
  int64_t dense_cost() const { return dense_cost_; }

  // How the index build maps items to threads (lower_cuda.h IndexBuildMode; default kPerKind: a warp per
  // tile for VS heads, a thread per tile for the others). set_warp_index_build(true/false) = kWarp / kThread.
  void set_index_build_mode(IndexBuildMode m) { builder_.set_mode(m); }
  IndexBuildMode index_build_mode() const { return builder_.mode(); }
  void set_warp_index_build(bool on) { builder_.set_warp_per_tile(on); }

  // The dense shortcut's answer for this call: true iff attend()/run() will run it dense without looking at the
  // estimates or the index (the bench skips estimation and index build then).
  bool dense_before_estimation(const AttentionArgs& args) { return route(args).path == RoutePath::kDenseShortcut; }

  bool has_dynamic_heads() const { return !estimates_.empty(); }
  const std::vector<Pattern>& patterns() const { return patterns_; }
  const LoweringContext& context() const { return ctx_; }

  // Inspection (synchronous).
  std::vector<HeadEstimate> download_estimates() const { return estimates_.download(); }
  void upload_estimates(const std::vector<HeadEstimate>& e) { estimates_.upload(e); }
  SparseIndex download_index() const { return index_.download(); }
  std::vector<int32_t> download_plan() const { return plan_.download(); }
  // The split-K units of this layer's plan (DeviceIndexBuilder::set_split; empty: nothing is cut).
  const std::vector<SplitUnit>& split_units() const { return builder_.split_units(); }
  void set_split(bool on) { set_option(&CudaAttentionOptions::split, on); }
  const DeviceSparseIndex& index() const { return index_; }

 private:
  void check_args(const AttentionArgs& args) const;
  // Dense attention of the call on `backend` (kOurs or kCudnn) with our kernel `kernel`; the dense index is built on
  // first use. Returns the backend that ran (kOurs after a cuDNN failure under the auto backend).
  DenseBackend attend_dense(const AttentionArgs& args, cudaStream_t stream, DenseBackend backend,
                            PrefillKernel kernel);
  bool fall_back_to_dense(const PrefillRoute& route, cudaStream_t stream);
  void invalidate_route() { route_valid_ = false; }
  // One option changed through set_options (which keeps the index builder's split switch and the route in step).
  template <class T>
  void set_option(T CudaAttentionOptions::*option, T value) {
    CudaAttentionOptions o = options_;
    o.*option = value;
    set_options(o);
  }

  std::vector<Pattern> patterns_;
  LoweringContext ctx_;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  CudaAttentionOptions options_;
  DeviceEstimates estimates_;
  DeviceIndexBuilder builder_;
  DeviceSparseIndex index_;
  DeviceWorkPlan plan_;
  bool all_dense_ = false;
  int64_t dense_cost_ = 0;         // cost of the dense index of this shape
  bool shortcut_ours_ = false, shortcut_cudnn_ = false;  // dense_shortcut.h rule at r = 1 and r = cudnn_rel_tile_cost(q_len)
  int64_t static_sparse_cost_ = -1;  // layers without dynamic heads: the sparse cost, once downloaded
  bool dense_index_built_ = false;
  DeviceSparseIndex dense_index_;  // for the fallback on our kernel
  DeviceWorkPlan dense_plan_;
  // The route of the last (dtype, window) seen.
  bool route_valid_ = false;
  DType route_dtype_ = DType::BF16;
  int32_t route_window_ = 0;
  PrefillRoute route_;
  std::string last_path_;
  bool index_built_ = false;
  bool cudnn_failed_ = false;
  std::string cudnn_error_;
};

}  // namespace tessera::attn::gpu
