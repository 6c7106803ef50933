// tessera/parallel/cuda/tp_service_cuda.h — parallel/tp_service.h over NCCL and the tensor-parallel GPU engine.
//
//   NcclCommandChannel: a command is two ncclBroadcasts from rank 0 on the rank's stream (the header, then the
//   payload when it has one), through a device buffer. The other ranks wait in the header's broadcast between
//   requests (an idle server's workers hold one NCCL kernel each).
//   TpRankForward: the rank's TpGpuForward with its KV cache reserved once for the server's context.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "cuda/device_buffer.h"
#include "parallel/cuda/collective.h"
#include "parallel/cuda/tp_gpu_forward.h"
#include "parallel/tp_service.h"

namespace tessera::parallel {

class NcclCommandChannel final : public CommandChannel {
 public:
  // `device`: the rank's GPU, made current before each command (the server sends from its own threads).
  NcclCommandChannel(Collective& comm, cudaStream_t stream, int device);
  void send(const TpCommand& c) override;
  TpCommand receive() override;

 private:
  void broadcast(std::vector<int32_t>& host);
  Collective& comm_;
  cudaStream_t stream_;
  int device_;
  attn::gpu::DeviceBuffer<int32_t> buf_;
};

class TpRankForward final : public RankForward {
 public:
  // `device`: the rank's GPU, made current before every run (the server calls from its own threads).
  TpRankForward(TpGpuForward& forward, int device, int32_t max_context);
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len) override;

 private:
  TpGpuForward& forward_;
  int device_;
};

}  // namespace tessera::parallel
