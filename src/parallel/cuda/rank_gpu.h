// tessera/parallel/cuda/rank_gpu.h — what every tensor-parallel command needs on each rank before its work: the
// rank's GPU, the communicator over the ranks, a stream and the GEMM handle on it.
//
//   return run_gpu_ranks(gpus, [&](const RankEnv& env, RankGpu& g) -> int {
//     TpGpuForward fwd(*model, g.comm, options, g.stream, g.gemm);
//     ...
//   });
#pragma once

#include <cuda_runtime.h>

#include <functional>

#include "parallel/cuda/collective.h"
#include "parallel/launch.h"
#include "runtime/cuda/gemm.h"

namespace tessera::parallel {

struct RankGpu {
  int device = 0;  // the rank's GPU (select_rank_device)
  Collective& comm;
  cudaStream_t stream;
  runtime::gpu::Gemm& gemm;
};

// Runs body on `gpus` ranks (run_ranks: forked here, or this process's rank under torchrun / mpirun), each with its
// GPU selected, an NCCL communicator, a stream and a Gemm on it (destroyed after body returns or throws). Returns
// what run_ranks returns.
int run_gpu_ranks(int32_t gpus, const std::function<int(const RankEnv&, RankGpu&)>& body);

}  // namespace tessera::parallel
