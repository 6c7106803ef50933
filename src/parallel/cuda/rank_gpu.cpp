#include "parallel/cuda/rank_gpu.h"

#include <memory>

#include "cuda/cuda_check.h"

namespace tessera::parallel {

int run_gpu_ranks(int32_t gpus, const std::function<int(const RankEnv&, RankGpu&)>& body) {
  return run_ranks(gpus, [&](const RankEnv& env) -> int {
    const int device = select_rank_device(env);
    std::unique_ptr<Collective> comm = make_nccl_collective(env);
    cudaStream_t stream;
    TESSERA_CUDA_CHECK(cudaStreamCreate(&stream));
    struct Destroy {
      cudaStream_t s;
      ~Destroy() { cudaStreamDestroy(s); }
    } destroy{stream};
    runtime::gpu::Gemm gemm(stream);
    RankGpu g{device, *comm, stream, gemm};
    return body(env, g);
  });
}

}  // namespace tessera::parallel
