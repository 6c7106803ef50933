// tessera/parallel/cuda/tp_batch_gpu.h — one GPU rank of the batched tensor-parallel engine (parallel/tp_batch.h:
// `serve --gpus N --parallel M`).
//
//   TpRankBatchBackend rank(model, placement, r, comm);   // the rank's heads and MLP columns on the current GPU
//   r == 0: TpBatchLeader leader(channel, rank); BatchEngine engine(leader, options); ...; leader.quit();
//   r >  0: tp_batch_worker(channel, rank, shape);
//
// The rank's share of the uniform placement is a model of its own (rank_config / rank_weights: Hq / N query and
// Hkv / N KV heads, F / N MLP columns, the embedding, norms and LM head replicated) run by the one-GPU batched
// backend (runtime/cuda/batch_gpu.h: prefill through the GPU forward, decode as one CUDA-graph step of the layer
// recipe), whose output and down projections all-reduce over the ranks through `comm` (GpuOps::RankReduce: NCCL
// across GPUs). The scheduler's calls name the full model's sequences, views and policies; this backend keeps the
// rank's copies of their block tables (RankTables) and passes the rank's heads' views and policy patterns. Every
// call ends with the rank's stream synchronised, so that the next command's NCCL broadcast (on the channel's stream)
// never runs beside this call's all-reduces on one communicator.
//
// Each rank allocates the scheduler's whole block pool but fills only its KV heads' blocks (block ids are the
// scheduler's, shared by all heads): per-GPU KV memory is not divided by N yet (docs/multi-gpu.md).
//
// SameDeviceGroup: a Collective for several ranks in one process on one GPU (a test of the protocol and the sums on
// one device, where NCCL refuses two ranks): all_reduce_sum is 0 + x_0 + x_1 + ... in rank order, the ranks' host
// threads meeting at a barrier and their streams ordered by events. Not capturable in a CUDA graph: run those
// ranks with GpuBatchOptions::graphs off.
#pragma once

#include <cuda_runtime.h>

#include <barrier>
#include <map>
#include <memory>
#include <vector>

#include "cuda/device_buffer.h"
#include "model/model.h"
#include "parallel/cuda/collective.h"
#include "parallel/placement.h"
#include "parallel/tp_batch.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"

namespace tessera::parallel {

class TpRankBatchBackend final : public runtime::BatchBackend {
 public:
  // Throws for a placement other than the uniform one (rank_slice's error) and comm.world() != placement.num_gpus.
  TpRankBatchBackend(const runtime::Model& model, const Placement& placement, int32_t rank, Collective& comm,
                     runtime::gpu::GpuBatchOptions options = {});

  const runtime::ModelConfig& config() const override { return config_; }
  const char* device_name() const override { return "cuda"; }
  double block_bytes(const runtime::PagedKVShape& shape) const override { return inner_->block_bytes(shape); }
  double default_kv_bytes() const override { return inner_->default_kv_bytes(); }
  void create_store(const runtime::PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                    int32_t max_context) override;
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override;
  bool supports_prompt_logits() const override { return true; }
  std::vector<float> prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                        const attn::AttentionPolicy* policy) override;
  void finish_prefill(const runtime::SequenceBlocks& seq, std::span<const runtime::DecodeView> views) override;
  void release_sequence(const runtime::SequenceBlocks& seq) override;
  void abort_prefill() override;
  bool supports_prefix_cache() const override { return true; }
  void load_prefix(const runtime::SequenceBlocks& seq, int32_t rows, int32_t total_len) override;
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const runtime::DecodeRow> rows) override;
  std::vector<int32_t> decode_select(std::span<const int32_t> tokens, std::span<const runtime::DecodeRow> rows,
                                     std::span<const RowChoice> choice) override;
  int64_t step_builds() const override { return inner_->step_builds(); }
  runtime::ForwardTimers timers() const override { return inner_->timers(); }

  const RankSlice& slice() const { return slice_; }
  runtime::gpu::GpuBatchBackend& inner() { return *inner_; }

 private:
  std::vector<runtime::DecodeRow> rank_rows(std::span<const runtime::DecodeRow> rows);
  void sync();
  void use() const;

  runtime::ModelConfig config_;
  int gpu_ = 0;  // the rank's GPU, made current at every call (a server calls from its own threads)
  RankSlice slice_;
  std::unique_ptr<runtime::gpu::DeviceModel> device_;
  std::unique_ptr<runtime::gpu::GpuBatchBackend> inner_;
  std::unique_ptr<RankTables> tables_;
  std::map<const runtime::SequenceBlocks*, std::vector<runtime::DecodeView>> views_;
};

class SameDeviceGroup {
 public:
  explicit SameDeviceGroup(int32_t world);
  ~SameDeviceGroup();
  SameDeviceGroup(const SameDeviceGroup&) = delete;
  SameDeviceGroup& operator=(const SameDeviceGroup&) = delete;
  // Rank r's Collective (called from rank r's thread; the group must outlive it).
  std::unique_ptr<Collective> rank(int32_t r);

 private:
  class Rank;
  int32_t world_;
  std::barrier<> sync_;
  std::vector<float*> x_;
  std::vector<size_t> count_;
  std::vector<cudaEvent_t> ready_, read_;
};

}  // namespace tessera::parallel
