// tessera/runtime/cuda/device_model.h — a model's weights in GPU memory, in bf16.
//
//   auto model = tessera::runtime::Model::load("smollm2.gguf");                      // f32 on the host
//   auto dev = tessera::runtime::gpu::DeviceModel::upload(*model);                  // bf16 on the GPU
//   auto synth = tessera::runtime::gpu::DeviceModel::random(llama3_8b_config());    // benchmarks
//
// Matrices are bf16 ([out, in] row-major, as model/weights.h holds them); the MLP's gate and up matrices
// are stacked into one [2 * ffn, hidden] matrix (gate rows first) so that one GEMM computes both. Norm
// weights, biases and RoPE factors stay in f32 (they are small, and Gemma's norms hold 1 + w, which bf16 would
// round). Tied embeddings share one matrix. upload() rounds the host's f32 weights (dequantized GGUF or
// safetensors) to nearest-even bf16 on the device; random() fills every matrix from a hash of (seed, tensor,
// element), uniform with standard deviation 0.02 (transformers' initializer_range), norms 1, biases 0: the
// compute cost of a forward pass does not depend on the values, and the same seed gives the same model.
//
// random(config, seed, RandomInit::kLocalAttention) is a synthetic model shaped to have the attention structure
// real LLMs have, so that the dynamic patterns (VS, BS) meet a realistic index density: with plain random weights
// queries and keys carry no positional structure, MInference's estimator scatters its diagonals and VS runs as
// dense (the worst case). Same shapes, dtypes and GEMM costs; the same pseudo-random matrices except:
//   - a "massive activation": 4 fixed channels of every embedding row hold the same large value (240 for hidden
//     4096; the rest of the row is uniform noise of standard deviation 3, a token part 0.4 times the shared part),
//     like the few huge residual channels of real LLMs; layers neither read them in V, gate and up nor write them in
//     O and down, so the shared part stays what the embedding put there (the layers' own updates to the other
//     channels grow the token part from 0.4 to about 0.47 of it over 32 layers);
//   - Q and K read those channels through designed columns: every query head of a KV group and its KV head get the
//     same vector z (random phase per RoPE pair, per layer and group; queries times a per-head gain 0.8-1.2) whose
//     energy sits on the RoPE pairs of wavelength 4K-262K tokens (runtime/cuda/local_attention_spectrum.h), so that
//     after RoPE q_m . k_n holds sum_i |z_i|^2 cos((m - n) theta_i): about 32 logits at distance 0, falling steadily
//     with distance (0.74 of it at 6096, 0.44 at 16K), above the noise the token part adds (about 1.2 logits);
//   - a sink: embedding row kSinkToken (a BOS-like token; ttft_bench --weights local starts its prompt with it)
//     holds only 2 sink channels, which K maps onto the RoPE pairs that hardly rotate within a prompt, aligned with a
//     part every query carries: about +38 logits at any distance, a value of zero (V reads no special channel), as
//     real models' sinks.
// bench/gpu/local_weights_sim.py simulates this recipe at reduced width (numpy) and prints the VS estimate's
// density per layer. Only for benchmarks: this model computes nothing meaningful.
//
// A DeviceModel is immutable after construction and may be shared by several GpuEngines on the same device.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/device_buffer.h"
#include "core/dtype.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/w4_gemv.h"
#include "model/model.h"
#include "model/model_config.h"

namespace tessera::runtime::gpu {

// One layer's weights on the device: F and B are float and bf16, const-qualified in the readers' view
// (DeviceLayer) and not in the view DeviceModel fills them through.
template <typename F, typename B>
struct LayerPointers {
  F* attn_norm = nullptr;                                         // [hidden]
  B *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;  // as in model/weights.h
  B* wqkv = nullptr;  // [q_dim + 2 kv_dim, hidden]: wq, wk and wv are its three row ranges (one GEMM)
  F *bq = nullptr, *bk = nullptr, *bv = nullptr;                 // Qwen2 only
  F *q_norm = nullptr, *k_norm = nullptr;                        // Gemma-3 only, [head_dim]
  F* post_attn_norm = nullptr;                                   // Gemma-3 only
  F* ffn_norm = nullptr;
  F* post_ffn_norm = nullptr;  // Gemma-3 only
  B* w_gate_up = nullptr;      // [2 * ffn, hidden]: gate rows, then up rows
  B* w_down = nullptr;         // [hidden, ffn]
};
using DeviceLayer = LayerPointers<const float, const bf16>;

// How DeviceModel::random fills the weights (see the header comment).
enum class RandomInit {
  kPlain,           // every matrix uniform with standard deviation 0.02, norms 1: no attention structure
  kLocalAttention,  // the same, shaped so that attention is local with a sink, as in real LLMs
};

class DeviceModel {
 public:
  // kLocalAttention: the embedding row of this token is the sink (a prompt should start with it).
  static constexpr int32_t kSinkToken = 0;

  // Copies and rounds the weights of a loaded model to the current device. Throws tessera::Error when the
  // device memory does not suffice ("out of device memory: ...").
  static std::unique_ptr<DeviceModel> upload(const Model& model);
  // The same from a config and host weights (a tensor-parallel rank's model of its heads: parallel/cuda/tp_batch_gpu.h).
  static std::unique_ptr<DeviceModel> upload(const ModelConfig& config, const ModelWeights& weights);
  // Deterministic pseudo-random weights of the shapes `config` describes (nothing read from any file).
  // kLocalAttention needs hidden_size >= 64 and no QK-norm (throws tessera::Error otherwise).
  static std::unique_ptr<DeviceModel> random(const ModelConfig& config, uint64_t seed = 1,
                                             RandomInit init = RandomInit::kPlain);

  const ModelConfig& config() const { return config_; }
  // GGUF rope_freqs factors (llama3 scaling), empty when absent (model/weights.h).
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
  void shape_local_attention(uint64_t seed);  // RandomInit::kLocalAttention, after the plain fill

  ModelConfig config_;
  std::vector<float> rope_freq_factors_;
  std::vector<attn::gpu::DeviceBuffer<bf16>> bf16_buffers_;
  std::vector<attn::gpu::DeviceBuffer<float>> f32_buffers_;
  std::vector<DeviceLayer> layers_;
  // Mutable views of the same buffers, for filling them.
  using LayerSlots = LayerPointers<float, bf16>;
  std::vector<LayerSlots> slots_;
  bf16* embedding_ = nullptr;
  bf16* output_ = nullptr;
  float* final_norm_ = nullptr;
  size_t bytes_ = 0;
};

// The layers' matrices of a DeviceModel in FP8 E4M3 for GemmPrecision::kFp8 (gemm.h): Q, K and V separately (their
// rows of wqkv), O, the stacked gate/up, down. Scales (f32, on the device): one per output channel (Fp8Scaling::kRow,
// amax of each row / 448, the default) or one per matrix (kTensor). The embedding and the LM head stay bf16 in the
// DeviceModel. Quantized on the device from the bf16 weights (fp8_quant.h: round-to-nearest-even, saturating), 1 byte
// per element plus 4 per row: an 8B model's layers take ~7 GB beside their bf16 copies.
struct Fp8Layer {
  Fp8Matrix wq, wk, wv, wo, w_gate_up, w_down;
};

class DeviceFp8Weights {
 public:
  // Synchronises `stream` before returning. Throws tessera::Error when the device memory does not suffice or the
  // device has no FP8 tensor cores (check_gemm_precision_supported).
  static std::unique_ptr<DeviceFp8Weights> quantize(const DeviceModel& model, cudaStream_t stream,
                                                    Fp8Scaling scaling);
  // With fp8_scaling_from_env()'s scaling (per row unless TESSERA_FP8_SCALING=tensor).
  static std::unique_ptr<DeviceFp8Weights> quantize(const DeviceModel& model, cudaStream_t stream) {
    return quantize(model, stream, fp8_scaling_from_env());
  }
  const Fp8Layer& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  Fp8Scaling scaling() const { return scaling_; }
  size_t bytes() const { return bytes_; }

 private:
  DeviceFp8Weights() = default;
  Fp8Matrix add(const bf16* w, int64_t rows, int64_t cols, cudaStream_t stream);

  Fp8Scaling scaling_ = Fp8Scaling::kRow;
  std::vector<attn::gpu::DeviceBuffer<uint8_t>> codes_;
  // kTensor: kFp8WorkFloats per matrix (fp8_quant.h: amax, scale); kRow: the rows' scales, each matrix's from a
  // multiple of 4 floats (16-byte aligned, as cuBLASLt's vectors need).
  attn::gpu::DeviceBuffer<float> scales_;
  size_t next_scale_ = 0;
  std::vector<Fp8Layer> layers_;
  size_t bytes_ = 0;
};

// The layers' matrices of a DeviceModel in 4 bits for GemmPrecision::kW4 (gemm.h): the decode step's products of up to
// kW4Rows rows read them through gemv_w4a16 (w4_gemv.h: groups of 128 along `in`, a bf16 scale and a zero point each,
// 4.25 bits a weight), larger products (prefill, bigger batches) the bf16 weights, which stay. Quantized on the device
// from the bf16 weights (quantize_w4: round to nearest, the host's quantize_w4_host bit for bit): Q, K and V as the
// one stacked [q_dim + 2 kv_dim, hidden] matrix (per row: its three row ranges are the three matrices), O, the stacked
// gate/up, down. The embedding and the LM head stay bf16. An 8B model's layers take ~3.7 GB beside their bf16 copies.
struct W4Layer {
  W4Matrix wqkv, wq, wk, wv, wo, w_gate_up, w_down;
};

class DeviceW4Weights {
 public:
  // Synchronises `stream` before returning. Throws tessera::Error when the device memory does not suffice or a
  // matrix's `in` is not a multiple of kW4Group ("4-bit weights of <model>: ...").
  static std::unique_ptr<DeviceW4Weights> quantize(const DeviceModel& model, cudaStream_t stream);
  const W4Layer& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  // The 4-bit copy of the bf16 matrix at `w` with `rows` rows (a layer matrix of the model, or Q, K, V as rows of the
  // stacked one), or null when there is none.
  const W4Matrix* find(const bf16* w, int64_t rows) const;
  size_t bytes() const { return bytes_; }

 private:
  DeviceW4Weights() = default;
  W4Matrix add(const bf16* w, int64_t rows, int64_t cols, cudaStream_t stream);

  std::vector<attn::gpu::DeviceBuffer<uint8_t>> codes_;
  std::vector<attn::gpu::DeviceBuffer<uint32_t>> params_;
  std::vector<W4Layer> layers_;
  std::map<std::pair<const bf16*, int64_t>, W4Matrix> by_weight_;
  size_t bytes_ = 0;
};

}  // namespace tessera::runtime::gpu
