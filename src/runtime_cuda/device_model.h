// tessera/runtime_cuda/device_model.h — a model's weights in GPU memory, in bf16.
//
//   auto model = tessera::runtime::Model::load("smollm2.gguf");                      // f32 on the host
//   auto dev = tessera::runtime::gpu::DeviceModel::upload(*model);                  // bf16 on the GPU
//   auto synth = tessera::runtime::gpu::DeviceModel::random(llama3_8b_config());    // benchmarks
//
// Matrices are bf16 ([out, in] row-major, as runtime/weights.h holds them); the MLP's gate and up matrices
// are stacked into one [2 * ffn, hidden] matrix (gate rows first) so that one GEMM computes both. Norm
// weights, biases and RoPE factors stay in f32 (they are small, and Gemma's norms hold 1 + w, which bf16 would
// round). Tied embeddings share one matrix. upload() rounds the host's f32 weights (dequantized GGUF or
// safetensors) to nearest-even bf16 on the device; random() fills every matrix from a hash of (seed, tensor,
// element), uniform with standard deviation 0.02 (transformers' initializer_range), norms 1, biases 0: the
// compute cost of a forward pass does not depend on the values, and the same seed gives the same model.
//
// A DeviceModel is immutable after construction and may be shared by several GpuEngines on the same device.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attention/cuda/device_buffer.h"
#include "core/dtype.h"
#include "runtime/model.h"
#include "runtime/model_config.h"

namespace tessera::runtime::gpu {

struct DeviceLayer {
  const float* attn_norm = nullptr;                                         // [hidden]
  const bf16 *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;  // as in runtime/weights.h
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;                 // Qwen2 only
  const float *q_norm = nullptr, *k_norm = nullptr;                        // Gemma-3 only, [head_dim]
  const float* post_attn_norm = nullptr;                                   // Gemma-3 only
  const float* ffn_norm = nullptr;
  const float* post_ffn_norm = nullptr;  // Gemma-3 only
  const bf16* w_gate_up = nullptr;       // [2 * ffn, hidden]: gate rows, then up rows
  const bf16* w_down = nullptr;          // [hidden, ffn]
};

class DeviceModel {
 public:
  // Copies and rounds the weights of a loaded model to the current device. Throws tessera::Error when the
  // device memory does not suffice ("out of device memory: ...").
  static std::unique_ptr<DeviceModel> upload(const Model& model);
  // Deterministic pseudo-random weights of the shapes `config` describes (nothing read from any file).
  static std::unique_ptr<DeviceModel> random(const ModelConfig& config, uint64_t seed = 1);

  const ModelConfig& config() const { return config_; }
  // GGUF rope_freqs factors (llama3 scaling), empty when absent (runtime/weights.h).
  const std::vector<float>& rope_freq_factors() const { return rope_freq_factors_; }
  const DeviceLayer& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  const bf16* embedding() const { return embedding_; }  // [vocab, hidden]
  const bf16* output() const { return output_; }        // [vocab, hidden]; the embedding when tied
  const float* final_norm() const { return final_norm_; }
  size_t bytes() const { return bytes_; }  // device memory held by the weights

 private:
  DeviceModel() = default;
  bf16* alloc_bf16(int64_t count);
  float* alloc_f32(int64_t count);
  void allocate_layout();  // every buffer, for config_

  ModelConfig config_;
  std::vector<float> rope_freq_factors_;
  std::vector<attn::gpu::DeviceBuffer<bf16>> bf16_buffers_;
  std::vector<attn::gpu::DeviceBuffer<float>> f32_buffers_;
  std::vector<DeviceLayer> layers_;
  // Mutable views of the same buffers, for filling them.
  struct LayerSlots {
    float *attn_norm, *bq, *bk, *bv, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    bf16 *wq, *wk, *wv, *wo, *w_gate_up, *w_down;
  };
  std::vector<LayerSlots> slots_;
  bf16* embedding_ = nullptr;
  bf16* output_ = nullptr;
  float* final_norm_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace tessera::runtime::gpu
