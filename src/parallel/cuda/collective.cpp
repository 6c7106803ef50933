#include "parallel/cuda/collective.h"

#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

namespace tessera::parallel {

int select_rank_device(const RankEnv& env) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env.local_rank >= count)
    throw Error("rank " + std::to_string(env.rank) + ": LOCAL_RANK " + std::to_string(env.local_rank) +
                " needs GPU " + std::to_string(env.local_rank) + ", but this host shows " +
                std::to_string(count) + (count == 1 ? " GPU" : " GPUs") +
                " (CUDA_VISIBLE_DEVICES=" + (visible ? visible : "unset") + ")");
  if (cudaSetDevice(env.local_rank) != cudaSuccess)
    throw Error("rank " + std::to_string(env.rank) + ": cannot use GPU " + std::to_string(env.local_rank) +
                ": " + cudaGetErrorString(cudaGetLastError()));
  return env.local_rank;
}

int32_t broadcast_token(Collective& comm, int32_t token, cudaStream_t stream) {
  if (comm.world() == 1) return token;
  float* d = nullptr;
  if (cudaMalloc(&d, sizeof(float)) != cudaSuccess)
    throw Error("rank " + std::to_string(comm.rank()) + ": cannot allocate the token broadcast's float");
  const float mine = comm.rank() == 0 ? static_cast<float>(token) : 0.0f;
  float out = 0;
  cudaMemcpyAsync(d, &mine, sizeof(float), cudaMemcpyHostToDevice, stream);
  comm.all_reduce_sum(d, 1, stream);
  cudaMemcpyAsync(&out, d, sizeof(float), cudaMemcpyDeviceToHost, stream);
  const cudaError_t err = cudaStreamSynchronize(stream);
  cudaFree(d);
  if (err != cudaSuccess)
    throw Error("rank " + std::to_string(comm.rank()) +
                ": token broadcast failed: " + cudaGetErrorString(err));
  return static_cast<int32_t>(out);
}

namespace {

void nccl_check(ncclResult_t r, const char* what, int32_t rank) {
  if (r != ncclSuccess)
    throw Error("rank " + std::to_string(rank) + ": " + what + " failed: " + ncclGetErrorString(r) +
                " (NCCL_DEBUG=INFO says more)");
}

class NcclCollective final : public Collective {
 public:
  explicit NcclCollective(const RankEnv& env) : rank_(env.rank), world_(env.world) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);  // no NVLink multicast on shared machines, unless asked explicitly
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (env.rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", rank_);
    std::vector<uint8_t> blob(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id);
    blob = exchange_root_blob(env, blob);
    check(blob.size() == sizeof id, "rank " + std::to_string(rank_) + ": the NCCL id from rank 0 has " +
                                        std::to_string(blob.size()) + " bytes, expected " +
                                        std::to_string(sizeof id));
    std::memcpy(&id, blob.data(), sizeof id);
    nccl_check(ncclCommInitRank(&comm_, world_, id, rank_), "ncclCommInitRank", rank_);
  }
  ~NcclCollective() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (scratch_ != nullptr) cudaFree(scratch_);
  }
  int32_t rank() const override { return rank_; }
  int32_t world() const override { return world_; }
  void all_reduce_sum(float* x, size_t count, cudaStream_t stream) override {
    nccl_check(ncclAllReduce(x, x, count, ncclFloat, ncclSum, comm_, stream), "ncclAllReduce", rank_);
  }
  void broadcast(int32_t* x, size_t count, cudaStream_t stream) override {
    nccl_check(ncclBroadcast(x, x, count, ncclInt32, 0, comm_, stream), "ncclBroadcast", rank_);
  }
  void barrier(cudaStream_t stream) override {
    if (scratch_ == nullptr && cudaMalloc(&scratch_, sizeof(float)) != cudaSuccess)
      throw Error("rank " + std::to_string(rank_) + ": cannot allocate the barrier's float");
    all_reduce_sum(static_cast<float*>(scratch_), 1, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess)
      throw Error("rank " + std::to_string(rank_) +
                  ": barrier failed: " + cudaGetErrorString(cudaGetLastError()));
  }

 private:
  int32_t rank_, world_;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;
};

}  // namespace

std::unique_ptr<Collective> make_nccl_collective(const RankEnv& env) {
  if (env.world == 1) return std::make_unique<SingleRank>();
  return std::make_unique<NcclCollective>(env);
}

}  // namespace tessera::parallel
