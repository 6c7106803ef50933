// tessera/parallel/cuda/tp_device_model.h — one tensor-parallel rank's weights on its GPU, in bf16, reorganised
// once.
//
// The shard of parallel/shard.h, laid out for contiguous GEMMs: per layer and per held KV group g (with m_g of
// the rank's query heads), wq_g [m_g d, hidden], wk_g and wv_g [d, hidden], wo_g [hidden, m_g d] (f32 biases
// for Qwen2); the MLP's stacked [gate; up] rows of the rank's columns [2 F_r, hidden] and down [hidden, F_r].
// Norms, embeddings and the LM head are replicated. upload() rounds a loaded model's f32 weights to bf16
// (nearest even, as runtime/cuda/device_model.h does); random() fills every matrix from a hash (kernels.h
// fill_uniform_bf16, standard deviation 0.02 as DeviceModel::random's plain init, norms 1): for benchmarks,
// the same GEMM and attention shapes as the real model.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "cuda/device_buffer.h"
#include "parallel/shard.h"
#include "model/model.h"

namespace tessera::parallel {

struct TpGroupWeights {
  int32_t group = 0;                  // global KV group
  int32_t first_head = 0, heads = 0;  // the rank's local heads [first_head, first_head + heads)
  const bf16 *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

struct TpLayerWeights {
  const float *attn_norm = nullptr, *ffn_norm = nullptr, *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  std::vector<TpGroupWeights> groups;
  int32_t heads = 0;                // the rank's query heads in this layer
  int64_t ffn = 0;                  // F_r
  const bf16* w_gate_up = nullptr;  // [2 F_r, hidden]
  const bf16* w_down = nullptr;     // [hidden, F_r]
};

class TpDeviceModel {
 public:
  // On the current device. Throws Error when device memory does not suffice.
  static std::unique_ptr<TpDeviceModel> upload(const runtime::Model& model, const RankPlan& plan);
  // The same from a config and host weights (tests build small random models without a file).
  static std::unique_ptr<TpDeviceModel> upload(const runtime::ModelConfig& config,
                                               const runtime::ModelWeights& weights, const RankPlan& plan);
  static std::unique_ptr<TpDeviceModel> random(const runtime::ModelConfig& config, const RankPlan& plan,
                                               uint64_t seed = 1);

  const runtime::ModelConfig& config() const { return config_; }
  const RankPlan& plan() const { return plan_; }
  const std::vector<float>& rope_freq_factors() const { return rope_freq_factors_; }
  const TpLayerWeights& layer(int32_t l) const { return layers_[static_cast<size_t>(l)]; }
  const bf16* embedding() const { return embedding_; }
  const bf16* output() const { return output_; }
  const float* final_norm() const { return final_norm_; }
  size_t bytes() const { return bytes_; }

 private:
  TpDeviceModel() = default;
  bf16* bf16_buffer(int64_t count);
  float* f32_buffer(int64_t count);

  runtime::ModelConfig config_;
  RankPlan plan_;
  std::vector<float> rope_freq_factors_;
  std::vector<attn::gpu::DeviceBuffer<bf16>> bf16_;
  std::vector<attn::gpu::DeviceBuffer<float>> f32_;
  std::vector<TpLayerWeights> layers_;
  const bf16* embedding_ = nullptr;
  const bf16* output_ = nullptr;
  const float* final_norm_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace tessera::parallel
