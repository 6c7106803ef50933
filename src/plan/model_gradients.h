// tessera/plan/model_gradients.h — reverse mode through the model on the CPU, for the offline planners.
//
// One sequence, loss = mean cross-entropy of chosen target tokens:
//   L = -(1/T) * sum_t log softmax(logits[position_t])[token_t]
// The backward pass mirrors runtime/forward.h (Llama family, Qwen2, Gemma-3: biases, QK-norm, post-norms, sliding
// windows, per-layer RoPE, soft-capped logits) and yields, per layer and query head, what the planners need,
// without any S x S buffer (attention is recomputed per query block from the saved log-sum-exp, as
// FlashAttention's backward does; only the layer inputs are kept across layers):
//
//  - MoA's attention influence (moa.txt Eq. 12 with the minus sign docs/papers/DIGEST.md fixes):
//      E_ij = -A_ij / (1 - A_ij) * (dL/dA_ij - sum_n dL/dA_in * A_in)
//    the first-order change of L when A_ij is masked and its row renormalised; summed over `block` x `block`
//    cells (query block, key block) per head. E_ij = 0 where A_ij = 0 (masked or underflowed) or 1 - A_ij is
//    below the precision's resolution (a row with one visible key cannot lose it).
//  - TriangleMix's probe (trianglemix.txt): with A_theta = theta ⊙ A and theta = 1, dL/dtheta_ij = A_ij dL/dA_ij,
//    summed (signed and absolute) over the row-exact Streaming (j < sink or i - j < local), Last-Q (i >= S - last,
//    not streaming) and Middle (every other causal cell) regions, over all heads of a layer; plus its block sums
//    per head.
//
// f32 runs the products through OpenBLAS (sgemm); f64 (for checks against finite differences) the same code in
// double (dgemm, weights converted once per call). Memory: the layer inputs (layers x S x hidden), one layer's
// activations (S x (hidden + q/kv dims + 3 x ffn)), per worker a [block, S] score tile and [S, kv dims] key/value
// gradient sums, and the block sums (layers x heads x (S/block)^2 x 2 doubles).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/model.h"

namespace tessera::plan {

enum class Precision { F32, F64 };

// Where the pass runs. Device::Cuda is the GPU path of src/plan/cuda (f32, cuBLAS products, a blockwise attention
// backward that emits the same block and region sums, no S x S buffer); it exists where tessera was built with the
// CUDA toolkit and that library registered itself (plan::cuda::enable()), and runs f32 only.
enum class Device { Cpu, Cuda };

// The logits at `position` (0-based, < S) are trained to predict `token`.
struct Target {
  int32_t position = 0;
  int32_t token = 0;
  bool operator==(const Target&) const = default;
};

// TriangleMix's regions, row-exact (trianglemix.txt: si, sl, last; the paper's probe used 64, 128, 128).
struct ProbeRegions {
  int32_t sink = 64;
  int32_t local = 128;
  int32_t last = 128;
};

struct RegionSums {
  double sum = 0;      // sum of dL/dtheta over the region's cells
  double abs_sum = 0;  // sum of |dL/dtheta|
  int64_t cells = 0;   // causal cells in the region (all heads)
  double mean() const { return cells ? sum / static_cast<double>(cells) : 0.0; }
  double abs_mean() const { return cells ? abs_sum / static_cast<double>(cells) : 0.0; }
};

struct LayerProbe {
  RegionSums streaming, middle, last;
};

// For finite-difference checks only: the forward pass multiplies one attention probability by `value`
// (A_theta = theta ⊙ softmax, theta = 1 elsewhere). Honoured only with GradientOptions::loss_only.
struct AttentionGate {
  int32_t layer = 0;
  int32_t head = 0;   // query head
  int32_t query = 0;  // row (absolute position)
  int32_t key = 0;
  double value = 1.0;
};

struct GradientOptions {
  Precision precision = Precision::F32;
  int32_t block = 64;        // block sums over block x block cells (1: every cell, for tests)
  ProbeRegions regions;
  bool loss_only = false;    // forward and loss only (no gradients)
  std::optional<AttentionGate> gate;
  Device device = Device::Cpu;
  bool tf32 = false;         // Device::Cuda only: the products on tensor cores in TF32 (faster, ~1e-3 relative)
};

struct LayerGradients {
  // [num_q_heads][num_blocks][num_blocks] row-major (query block, key block); cells above the causal diagonal
  // (or outside a sliding window) contribute nothing.
  std::vector<double> influence;  // MoA E block sums
  std::vector<double> gate_grad;  // dL/dtheta block sums
  std::vector<double> attention;  // A block sums (the attention mass, for reports)
  LayerProbe probe;               // summed over heads
};

struct GradientResult {
  double loss = 0;
  int32_t seq_len = 0;
  int32_t block = 0;
  int32_t num_blocks = 0;  // ceil(seq_len / block)
  int32_t num_q_heads = 0;
  std::vector<LayerGradients> layers;  // empty with loss_only
  double block_sum(const std::vector<double>& v, int32_t head, int32_t qb, int32_t kb) const {
    return v[(static_cast<size_t>(head) * static_cast<size_t>(num_blocks) + static_cast<size_t>(qb)) *
                 static_cast<size_t>(num_blocks) +
             static_cast<size_t>(kb)];
  }
};

// Throws tessera::Error("<model>: tessera has no backward pass for architecture X yet ...") for a model whose
// forward pass this reverse mode does not mirror.
void check_backward_supported(const runtime::ModelConfig& config);

// Runs the forward and backward pass on options.device. Throws tessera::Error for an empty sequence, token ids
// outside the vocabulary, no targets, a target position outside [0, S), a block < 1, or when the buffers exceed the
// host memory budget (core/memory_budget.h); for Device::Cuda also when no CUDA path is registered (a build without
// CUDA), for Precision::F64, or when the device's memory is short.
GradientResult attention_gradients(const runtime::Model& model, std::span<const int32_t> tokens,
                                   std::span<const Target> targets, const GradientOptions& options,
                                   ThreadPool& pool);

// The inputs' checks of attention_gradients (every device), for the device paths that take weights from elsewhere.
void check_gradient_inputs(const runtime::ModelConfig& config, std::span<const int32_t> tokens,
                           std::span<const Target> targets, const GradientOptions& options);

// The GPU path's entry (src/plan/cuda registers it; nullptr unregisters). Receives checked inputs.
using DeviceGradientFn = GradientResult (*)(const runtime::Model& model, std::span<const int32_t> tokens,
                                             std::span<const Target> targets, const GradientOptions& options);
void register_cuda_gradients(DeviceGradientFn fn);
bool cuda_gradients_registered();

// "cpu" or "cuda"; parse_device throws tessera::Error("--device must be cpu or cuda, got 'X'") otherwise.
const char* device_name(Device d);
Device parse_device(const std::string& name);

}  // namespace tessera::plan
