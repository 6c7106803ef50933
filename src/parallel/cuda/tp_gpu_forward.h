// tessera/parallel/cuda/tp_gpu_forward.h — one rank's forward pass of the tensor-parallel engine.
//
// Every rank runs this with its TpDeviceModel on its own GPU, the same tokens and the same policy: the layer recipe
// (runtime/recipe.h) over the CUDA backend (runtime/cuda/gpu_ops.h) whose layer calls run the rank's shard, in bf16
// with f32 accumulation and an f32 residual stream x replicated on every rank. Per layer:
//   h = bf16(RMSNorm(x))                                            (replicated)
//   per held KV group g (m_g local heads): q_g = h wq_g^T, K_g, V_g = h wk_g^T, h wv_g^T into the rank's own KV
//     cache (only its groups: [groups, capacity, d] per layer), QK-norm + RoPE, then the group's heads' attention
//     as one GQA call (runtime/cuda/gpu_attention.h's contiguous route over the policy's patterns of those heads)
//   x_r = (rank 0: x, others: 0) + sum over g of a_g wo_g^T         (cuBLAS, beta = 1 on rank 0's x)
//   all-reduce(x_r) -> x                                            (NCCL, f32, in place) [Gemma-3: o, then
//                                                                                          x += RMSNorm(o)]
//   h = bf16(RMSNorm(x)); per piece: x_r += act(h wg_r^T) * (h wu_r^T) wd_r^T; all-reduce     [likewise]
// then the final norm and the LM head on every rank (replicated; the logits of rank 0 are the answer).
// Two all-reduces per layer of n x hidden f32 each (the recipe's reductions after the output and down projections):
// the communication does not depend on the placement.
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
#include <memory>
#include <span>
#include <vector>

#include "attention/index/prefill_route.h"
#include "attention/pattern/policy.h"
#include "cuda/device_buffer.h"
#include "parallel/cuda/collective.h"
#include "parallel/cuda/tp_device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"

namespace tessera::parallel {

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
  const std::vector<float>& layer_attention_ms() const;
  size_t kv_bytes() const;

 private:
  class Ops;  // the rank's backend of the recipe (tp_gpu_forward.cpp)

  const TpDeviceModel& model_;
  runtime::gpu::EventTimer timer_{false};
  std::unique_ptr<Ops> ops_;
};

}  // namespace tessera::parallel
