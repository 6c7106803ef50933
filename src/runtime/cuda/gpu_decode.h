// tessera/runtime/cuda/gpu_decode.h — one sequence's decode step over its contiguous device KV cache, run as the
// batched engine runs a decode row (batch_gpu.h): the layer recipe over the GPU ops with the paged attention step
// (gpu_attention.h PagedDecodeStep), the cache seen as a paged store of one-token blocks (block id = position *
// kv_heads + kv head in layer l's own pool, computed by the kernel: no block table). So a single sequence decodes with
// the batched step's launches — the fused QKV GEMM (bf16), paged flash-decoding split over the keys, its new K/V appended
// by a kernel that reads the position from device memory — and the step replays as a CUDA graph (one per split count
// and logits / no logits, captured on first use; with FP8 GEMMs on the second, the first running eagerly so that
// cuBLASLt's plans and the activation buffers are set up outside the capture).
//
// Attention is dense with the model's sliding windows (runtime/paged_kv.h decode_views with no policy), as the
// single-sequence decode always was. The graphs hold the cache's and the scratch's addresses: a cache that grows, or a
// scratch buffer that grows, drops them. With graphs, the step's kernels are not timed by category (the engine's
// EventTimer sees only eager steps).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "cuda/device_buffer.h"
#include "runtime/cuda/device_kv_cache.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/gpu_attention.h"
#include "runtime/cuda/gpu_forward.h"
#include "runtime/cuda/gpu_ops.h"

namespace tessera::runtime::gpu {

class GpuDecode {
 public:
  // As GpuForward's arguments; graphs: replay the step as CUDA graphs (then `timer` is not used).
  GpuDecode(const DeviceModel& model, cudaStream_t stream, Gemm& gemm, EventTimer& timer,
            const DeviceFp8Weights* fp8 = nullptr, bool graphs = true);
  ~GpuDecode();
  GpuDecode(const GpuDecode&) = delete;
  GpuDecode& operator=(const GpuDecode&) = delete;

  // Runs `token` (checked against the vocabulary) at position pos: its K/V go to row pos of `cache` (which holds rows
  // [0, pos) and has room for pos + 1). Returns the logits ([1, vocab]) unless rows is kNone; synchronises the stream.
  std::vector<float> run(int32_t token, int32_t pos, DeviceKVCache& cache, LogitRows rows);

  int64_t graphs() const { return static_cast<int64_t>(graphs_.size()); }
  size_t scratch_bytes() const;
  void release();  // the scratch and the graphs (synchronises the stream)

 private:
  void bind_cache(DeviceKVCache& cache);  // the pools of the cache as it is now
  void launch(bool logits);
  void drop_graphs() noexcept;

  const ModelConfig& cfg_;
  cudaStream_t stream_;
  bool use_graphs_;
  bool fp8_;
  EventTimer untimed_{false};
  GpuOps ops_;
  PagedLayout layout_;
  PagedDecodeStep step_;
  int32_t sms_ = 0;
  std::vector<int32_t> host_step_;                 // token, position, slot 0, length, the new row's blocks
  attn::gpu::DeviceBuffer<int32_t> step_data_;     // the same on the device
  attn::gpu::DeviceBuffer<int32_t> views_;         // [layers * q_heads, 3]
  attn::gpu::DeviceBuffer<float> o_part_, lse_part_;
  std::vector<bf16*> bound_k_, bound_v_;  // the cache's layers the graphs were made for
  int32_t bound_capacity_ = 0;
  std::map<std::pair<int32_t, bool>, cudaGraphExec_t> graphs_;  // (splits, logits) -> the step
  std::set<std::pair<int32_t, bool>> warmed_;                    // FP8: run eagerly once
};

}  // namespace tessera::runtime::gpu
