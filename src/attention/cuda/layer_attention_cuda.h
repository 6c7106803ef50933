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
// Dense paths (attend() with PrefillKernel::kAuto and no wgmma variant forced):
//  - an all-dense layer runs on the dense backend (DenseBackend): by default cuDNN's fused SDPA
//    (cudnn_sdpa.h) where it is built, supports the call (whole-prompt prefill, no window) and has an engine,
//    q_len >= kCudnnMinQLen and cuDNN is the faster at that length (kCudnnRelTime, measured on an H200:
//    cuDNN 0.894 / 14.65 / 255.3 ms against ours 0.901 / 15.41 / 243.0 ms at 8K / 32K / 128K with the pair-step
//    kernel); else our kernel on the dense index. attention_gpu_bench prints both every run ("dense backends"
//    lines), the figures that set the table.
//  - dense fallback (set_dense_fallback, on by default): a layer with sparse heads whose index costs more
//    than dense attention would, runs dense instead (on the dense backend). Cost = key tiles of 64 plus one
//    per item (work_plan.h), summed on the device by build_index(); the rule, with C_dense the cost of the
//    dense index of the same shape and r the dense backend's time per tile relative to our kernel's
//    (1 for ours, cudnn_rel_tile_cost(q_len) for cuDNN):   fall back  iff  C_sparse > r * C_dense.
//    Deciding needs the sparse cost on the host: one 8-byte copy and a stream synchronisation per call for
//    layers with dynamic (VS/BS) heads, once per layer for static ones. Not applied with args.window > 0
//    (the window already bounds the work), nor when attend() is asked for a specific kernel.
//  - dense shortcut (part of the dense fallback, same switches): before estimating, the static rule of
//    attention/index/dense_shortcut.h (each head's budget or exact coverage of the causal keys against a
//    threshold scaled by r) sends layers whose budgets already cover most keys dense without estimation or
//    index build (VS / BS at 8K: run 3 paid 0.36 ms for them and then fell back anyway). run() and attend()
//    apply it; the path reads "dense shortcut X".
// Environment (read at each call, for experiments): TESSERA_DENSE_BACKEND=ours sends kAuto's dense calls to our
// kernel, =cudnn to cuDNN wherever it can run them (no minimum length); TESSERA_DENSE_FALLBACK=0 switches the
// fallback off.
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
#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn::gpu {

// Who runs dense attention (all-dense layers and the dense fallback).
enum class DenseBackend {
  kAuto,   // cuDNN where it can run the call, q_len >= kCudnnMinQLen and it is the faster (kCudnnRelTime)
  kOurs,   // our prefill kernel (wgmma / mma.sync) on the dense index
  kCudnn,  // cuDNN; attend() throws where it cannot run the call (e.g. a window, q_begin > 0)
};
const char* dense_backend_name(DenseBackend b);

// kAuto sends dense calls shorter than this to our kernel (cuDNN plans are built per shape on first use,
// which costs host time for every new prompt length).
inline constexpr int64_t kCudnnMinQLen = 2048;
// cuDNN's dense time relative to our kernel's (cuDNN / ours, per key tile), by prompt length: H200, the pair-step
// TMA kernel, one sweep of `attention_gpu_bench --patterns dense` (docs/PERF.md, sixth attention run). Neither
// wins everywhere: ours at <= 4K, 16K and 128K, cuDNN by 4-7% at 24K-96K.
struct DenseTimeRatio {
  int64_t q_len;
  double cudnn_over_ours;
};
inline constexpr DenseTimeRatio kCudnnRelTime[] = {
    {1024, 1.054},  {2048, 1.079},  {4096, 1.022},  {8192, 0.993},  {16384, 1.021}, {24576, 0.957},
    {32768, 0.950}, {49152, 0.935}, {65536, 0.965}, {98304, 0.959}, {131072, 1.051}};
// The ratio at q_len: linear in log2(q_len) between the measured lengths, the end values beyond them. kAuto runs
// cuDNN only where it is below 1; the dense fallback and the dense shortcut weigh cuDNN's tiles by it.
double cudnn_rel_tile_cost(int64_t q_len);

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
  // estimate, build_index (skipped for an all-dense layer that runs on cuDNN), attend.
  void run(const AttentionArgs& args, cudaStream_t stream = nullptr);

  // Dense paths (see the top of this file).
  void set_dense_backend(DenseBackend b) { dense_backend_ = b; }
  DenseBackend dense_backend() const { return dense_backend_; }
  void set_dense_fallback(bool on) { dense_fallback_ = on; }
  bool dense_fallback() const { return dense_fallback_; }
  bool all_dense() const { return all_dense_; }
  // The backend kAuto resolves to for this call: kCudnn or kOurs (may build the cuDNN plan).
  DenseBackend resolve_dense_backend(const AttentionArgs& args) const;
  // What the last attend() ran, e.g. "sparse wgmma", "dense cudnn", "dense fallback cudnn",
  // "dense fallback wgmma".
  const std::string& last_path() const { return last_path_; }
  // kAuto chose cuDNN and its launch failed (this layer then runs dense on ours; the error is kept).
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

  // The dense shortcut's answer for this call (see above): true iff attend()/run() will run it dense without
  // looking at the estimates or the index (the bench skips estimation and index build then).
  bool dense_before_estimation(const AttentionArgs& args) const;
  // The shortcut alone can be switched off (on by default; the dense fallback switch covers both).
  void set_dense_shortcut(bool on) { dense_shortcut_ = on; }

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
  void set_split(bool on) { builder_.set_split(on); }
  const DeviceSparseIndex& index() const { return index_; }

 private:
  void check_args(const AttentionArgs& args) const;
  // Dense attention of the call on `backend` (kOurs or kCudnn); the dense index is built on first use.
  void attend_dense(const AttentionArgs& args, cudaStream_t stream, DenseBackend backend);
  bool fall_back_to_dense(const AttentionArgs& args, DenseBackend backend, cudaStream_t stream);

  std::vector<Pattern> patterns_;
  LoweringContext ctx_;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  DeviceEstimates estimates_;
  DeviceIndexBuilder builder_;
  DeviceSparseIndex index_;
  DeviceWorkPlan plan_;
  DenseBackend dense_backend_ = DenseBackend::kAuto;
  bool dense_fallback_ = true;
  bool all_dense_ = false;
  int64_t dense_cost_ = 0;         // cost of the dense index of this shape
  bool dense_shortcut_ = true;
  bool shortcut_ours_ = false, shortcut_cudnn_ = false;  // dense_shortcut.h rule at r = 1 and r = cudnn_rel_tile_cost(q_len)
  int64_t static_sparse_cost_ = -1;  // layers without dynamic heads: the sparse cost, once downloaded
  bool dense_index_built_ = false;
  DeviceSparseIndex dense_index_;  // for the fallback on our kernel
  DeviceWorkPlan dense_plan_;
  std::string last_path_;
  bool index_built_ = false;
  bool cudnn_failed_ = false;
  std::string cudnn_error_;
};

}  // namespace tessera::attn::gpu
