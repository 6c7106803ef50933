// tessera/dist/cuda/tp_gpu_forward.h — one rank's forward pass of the tensor-parallel engine.
//
// Every rank runs this with its TpDeviceModel on its own GPU, the same tokens and the same policy; per layer
// (as runtime_cuda/gpu_forward.h, in bf16 with f32 accumulation and an f32 residual stream x replicated on
// every rank):
//   h = bf16(RMSNorm(x))
//   per held KV group g (m_g local heads): q_g = h wq_g^T, K_g, V_g = h wk_g^T, h wv_g^T into the rank's own
//   KV
//     cache (only its groups: [groups, capacity, d] per layer), QK-norm + RoPE, then the group's heads'
//     attention as one GQA call (CudaLayerAttention over the policy's patterns of those heads; the simple
//     kernel for head dims the executor does not build, dense only)
//   x_r = (rank 0: x, others: 0) + sum over g of a_g wo_g^T         (cuBLAS, beta = 1 on rank 0's x)
//   all-reduce(x_r) -> x                                              (NCCL, f32, in place)        [Gemma-3:
//   o is h = bf16(RMSNorm(x)); per chunk: x_r += act(h wg_r^T) * (h wu_r^T) wd_r^T; all-reduce   reduced,
//   then
//                                                                                    x += RMSNorm(o)]
// then the final norm and the LM head on every rank (replicated; the logits of rank 0 are the answer).
// Two all-reduces per layer of n x hidden f32 each: the communication does not depend on the placement.
//
// Communication overlaps compute (TpForwardOptions::overlap_comm, FlexAttn's pipelining where it pays): o_proj
// and the MLP run in row pieces of mlp_chunk rows, and each piece's all-reduce runs on a second stream as soon as
// its partial sum is written, while the next pieces compute (the MLP of piece c waits only for piece c's o_proj
// all-reduce). Only the last piece's MLP all-reduce is exposed. The sums are the same either way (row pieces of
// one in-place all-reduce); with overlap_comm off the all-reduces run on the compute stream (the baseline).
//
// Per-layer attention time (CUDA events around the layer's attention, projections excluded) is kept when
// TpForwardOptions::time_layers is on: the per-GPU load the placement balances (bench/gpu/tp_bench).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "cuda/device_buffer.h"
#include "dist/cuda/collective.h"
#include "dist/cuda/tp_device_model.h"
#include "runtime_cuda/gemm.h"

namespace tessera::dist {

struct TpForwardOptions {
  int32_t mlp_chunk = 16384;  // rows per MLP piece
  int32_t tile = 128;         // the executor's query tile in prefill
  bool dense_fallback = true;
  bool time_layers = false;
  bool overlap_comm = true;   // all-reduces on a second stream, per row piece (above)
  attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
};

class TpGpuForward {
 public:
  TpGpuForward(const TpDeviceModel& model, Collective& comm, const TpForwardOptions& options,
               cudaStream_t stream, runtime::gpu::Gemm& gemm);
  ~TpGpuForward();
  TpGpuForward(const TpGpuForward&) = delete;
  TpGpuForward& operator=(const TpGpuForward&) = delete;

  // KV caches for `tokens` rows (keeps nothing written before).
  void reserve(int32_t tokens);
  // Runs tokens at [pos, pos + n) (every rank the same), returns the logits of the last token (last_only) or
  // of every token, [rows, vocab] f32 on the host. policy: null or empty for dense.
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len, bool last_only);

  // Per layer, the milliseconds of the last run's attention on this GPU (time_layers).
  const std::vector<float>& layer_attention_ms() const { return layer_ms_; }
  size_t kv_bytes() const;

 private:
  struct AttentionSet;
  void layer_attention(int32_t layer, int32_t pos, int32_t n, const attn::AttentionPolicy* policy,
                       int32_t total_len, AttentionSet& set);

  const TpDeviceModel& model_;
  const runtime::ModelConfig& cfg_;
  Collective& comm_;
  TpForwardOptions options_;
  cudaStream_t stream_;
  cudaStream_t comm_stream_ = nullptr;  // overlap_comm: the all-reduces' stream
  runtime::gpu::Gemm& gemm_;
  float scale_ = 0;
  int32_t capacity_ = 0;
  std::vector<attn::gpu::DeviceBuffer<float>> inv_freqs_;
  std::vector<size_t> layer_rope_;
  std::vector<attn::gpu::DeviceBuffer<bf16>> k_, v_;  // per layer [groups, capacity, d]
  attn::gpu::DeviceBuffer<int32_t> tokens_;
  attn::gpu::DeviceBuffer<float> x_, o_, logits_;
  attn::gpu::DeviceBuffer<bf16> h_, q_, a_, gu_;
  std::vector<attn::gpu::DeviceBuffer<float>> cos_, sin_;
  std::vector<cudaEvent_t> events_;  // 2 per layer
  // overlap_comm: per row piece, "partial sum written" and "all-reduced" (re-recorded every layer).
  std::vector<cudaEvent_t> written_, reduced_;
  void piece_events(size_t pieces);
  std::vector<float> layer_ms_;
};

}  // namespace tessera::dist
