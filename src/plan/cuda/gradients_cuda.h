// tessera/plan/cuda/gradients_cuda.h — the reverse mode of plan/model_gradients.h on the GPU.
//
// The same pass as the CPU's (forward through the layer recipe runtime/recipe.h keeping the layer inputs, then per
// layer from the last: the layer's forward recomputed through the recipe, its backward), in f32 on the device:
//  - the embedding and the RoPE tables by the GPU engine's kernels (runtime/cuda/kernels.h, over f32 weights);
//  - the products (projections, MLP, logits of the target rows, and every product of attention) through cuBLAS
//    (cublasSgemm / cublasSgemmStridedBatched; TF32 tensor cores with GradientOptions::tf32);
//  - attention blockwise, per query chunk of R rows (a multiple of 64): the scores of the chunk against its keys
//    [R, keys] per head, softmax with the log-sum-exp saved (forward), and in the backward the probabilities
//    recomputed from that log-sum-exp, dP = dO V^T, and one tile kernel per 64 x 64 cells that turns them into
//    dS = P (dP - D) (D_i = dO_i . O_i, as FlashAttention's backward) and emits MoA's influence, dL/dtheta and the
//    attention mass summed per block (GradientOptions::block) and TriangleMix's region sums; dQ, dK, dV from dS
//    and P by cuBLAS. R is chosen so that the two [heads, R, S] chunk buffers stay under 1 GiB: no S x S buffer.
//  - the loss on the device, per chunk of target rows (logits within 1 GiB): their logits, the cross-entropy and its
//    gradient (soft-capped as the model says) by one kernel, the twin of plan/cross_entropy.h; only the per-row
//    losses come to the host.
// Everything the planners read is the CPU's GradientResult, equal to it within f32 rounding (tests/gpu/plan).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "plan/model_gradients.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tessera::plan::cuda {

// Registers this path with plan::register_cuda_gradients, so that attention_gradients (and the planners) run on the
// GPU with GradientOptions::device = Device::Cuda. The Model's weights are copied to the device on first use and
// kept for the next calls with the same Model (the planners make one call per calibration sample).
void enable();

// True when a CUDA device is usable (cudaGetDeviceCount > 0).
bool gpu_available();

// Time and device memory of a pass (DeviceStats), or of all passes (RegisteredStats).
struct PassCosts {
  double seconds = 0;            // the pass, from the first upload of tokens to the last block sum on the host
  size_t weight_bytes = 0;       // the f32 weights on the device
  size_t peak_pass_bytes = 0;    // the pass's own device allocations at their peak (weights excluded)
  size_t peak_used_bytes = 0;    // device memory in use (cudaMemGetInfo: total - free) at its largest sample
};

struct DeviceStats : PassCosts {
  int64_t chunk_rows = 0;        // the query chunk R
};

// Of the passes run through the registered path since the program started: their number, total seconds, the
// weights' bytes and the largest peaks (for `tessera plan`'s report).
struct RegisteredStats : PassCosts {
  int64_t passes = 0;
  // Counts one more pass: its seconds added, its weights' bytes kept, the peaks the larger.
  void add(const PassCosts& pass);
};
RegisteredStats registered_stats();


struct DeviceRunOptions {
  int64_t chunk_rows = 0;  // 0: from the 1 GiB chunk budget; else a multiple of 64 (tests force several chunks)
  int64_t loss_rows = 0;   // target rows per loss chunk; 0: as many as keep their logits within 1 GiB
  DeviceStats* stats = nullptr;
};

// A model's weights in f32 on the current device.
class GradientModel {
 public:
  // Copies `weights` (the runtime's f32 weights) to the device.
  GradientModel(const runtime::ModelConfig& config, const runtime::ModelWeights& weights);
  // Random weights generated on the device (benchmarks at real shapes without a weight file): linear weights
  // uniform with standard deviation 1/sqrt(in), the embedding with standard deviation 1, norms 1 (Gemma-3's 1 + w
  // convention: w = 0), biases 0. Deterministic in `seed`.
  static std::unique_ptr<GradientModel> random(const runtime::ModelConfig& config, uint64_t seed);
  ~GradientModel();
  GradientModel(const GradientModel&) = delete;
  GradientModel& operator=(const GradientModel&) = delete;

  const runtime::ModelConfig& config() const;
  size_t bytes() const;

  // attention_gradients on the device: checks the inputs as the CPU does (check_gradient_inputs), then runs.
  // Throws tessera::Error when the device's memory is short (naming the allocation and what is free).
  GradientResult run(std::span<const int32_t> tokens, std::span<const Target> targets,
                     const GradientOptions& options, const DeviceRunOptions& run = {}) const;

  // The forward pass alone (f32, the products in plain f32), for MInference's search on the GPU
  // (minference_cuda.h): after each layer's attention, observe(view) with the layer's q (after QK-norm and RoPE),
  // k, v and dense attention output o on the device, row-major [tokens, heads, head_dim], valid during the call, and
  // the stream the pass runs on (work the observer queues there is ordered with the pass).
  struct AttentionView {
    int32_t layer = 0;
    int64_t tokens = 0;
    const float* q = nullptr;  // [tokens, num_q_heads, head_dim]
    const float* k = nullptr;  // [tokens, num_kv_heads, head_dim]
    const float* v = nullptr;
    const float* o = nullptr;  // [tokens, num_q_heads, head_dim]
    void* stream = nullptr;    // cudaStream_t
  };
  void forward(std::span<const int32_t> tokens, const std::function<void(const AttentionView&)>& observe,
               const DeviceRunOptions& run = {}) const;

  struct Impl;

 private:
  GradientModel();
  std::unique_ptr<Impl> impl_;
};

// Runs fn with the device copy of `model`'s weights that the registered path keeps (made on first use, as for the
// gradient passes; one Model at a time), under that path's lock; counted in registered_stats() as a pass (its
// seconds; not its peaks).
void with_device_weights(const runtime::Model& model, const std::function<void(const GradientModel&)>& fn);

}  // namespace tessera::plan::cuda
