// tessera/parallel/cuda/collective.h — the one collective tensor parallelism needs: an in-place sum over ranks.
//
//   RankEnv env = rank_env_from_environment();           // parallel/launch.h
//   int dev = select_rank_device(env);                    // cudaSetDevice(LOCAL_RANK), with a clear error
//   NcclCollective comm(env);                             // ncclUniqueId from rank 0 (file or TCP),
//   ncclCommInitRank comm.all_reduce_sum(x, n, stream);                    // ncclAllReduce(ncclFloat,
//   ncclSum), asynchronous
//
// NCCL is the field's collective library (never a hand-made transport). Keep NCCL_NVLS_ENABLE=0 in the
// environment on shared machines (NVLink multicast); NcclCollective sets it when it is unset.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "parallel/launch.h"

namespace tessera::parallel {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t world() const = 0;
  // x[0, count) = sum over ranks of every rank's x, in place, ordered on `stream`.
  virtual void all_reduce_sum(float* x, size_t count, cudaStream_t stream) = 0;
  // x[0, count) (device memory) = rank 0's x[0, count) on every rank, ordered on `stream`.
  virtual void broadcast(int32_t* x, size_t count, cudaStream_t stream) = 0;
  virtual void barrier(cudaStream_t stream) = 0;
};

// A world of one: all_reduce_sum leaves x as it is.
class SingleRank final : public Collective {
 public:
  int32_t rank() const override { return 0; }
  int32_t world() const override { return 1; }
  void all_reduce_sum(float*, size_t, cudaStream_t) override {}
  void broadcast(int32_t*, size_t, cudaStream_t) override {}
  void barrier(cudaStream_t) override {}
};

// Rank 0's token id on every rank (a sum where the other ranks add 0; exact for ids below 2^24). Decoding
// loops use it so that ranks agree on each token even where their logits could differ in the last bit
// (different GPU models).
int32_t broadcast_token(Collective& comm, int32_t token, cudaStream_t stream);

// Makes GPU LOCAL_RANK current. Throws Error("rank 1: LOCAL_RANK 1 needs GPU 1, but this host shows 1 GPU
// (CUDA_VISIBLE_DEVICES=...)") when it is missing. Returns the device index.
int select_rank_device(const RankEnv& env);

// NCCL communicator over env.world ranks (built only with NCCL: TESSERA_WITH_NCCL).
std::unique_ptr<Collective> make_nccl_collective(const RankEnv& env);

}  // namespace tessera::parallel
