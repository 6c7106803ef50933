// tessera/parallel/launch.h — one process per GPU: where a rank learns who it is, how ranks start, and how the
// NCCL unique id travels from rank 0 to the others. CPU-only code (no CUDA, no NCCL): the NCCL engine
// (parallel/cuda) uses it, and tests run it with forked processes.
//
// A rank's identity comes from the environment, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT) or Open MPI's (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK); a
// process with none of them is rank 0 of 1. `tessera ... --gpus N` on one host forks N ranks itself
// (launch_local_ranks) and passes the same variables, with a rendezvous file instead of TCP.
//
// Rendezvous (exchange_root_blob): rank 0 has a blob (the 128-byte ncclUniqueId) that every rank needs.
//   file: TESSERA_RENDEZVOUS_FILE=<path> (one host): rank 0 writes <path>.tmp and renames it to <path>; the
//   others
//         wait for <path> (polling, up to timeout_s).
//   tcp:  otherwise, MASTER_ADDR:MASTER_PORT (several hosts): rank 0 listens and sends the blob to every rank
//   that
//         connects (world - 1 of them); the others connect, retrying until timeout_s.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tessera::parallel {

struct RankEnv {
  int32_t rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int32_t master_port = 29500;
  std::string rendezvous_file;  // TESSERA_RENDEZVOUS_FILE, empty: TCP
};

// Reads the variables above. Throws Error for values that do not parse or contradict each other, e.g.
// "RANK=3 is outside [0, WORLD_SIZE=2)".
RankEnv rank_env_from_environment();

// Rank 0: sends `blob` to every other rank and returns it; others: return what rank 0 sent. Throws Error on a
// timeout ("rank 1: no rendezvous from rank 0 at 10.0.0.1:29500 within 60 s") or a short read.
std::vector<uint8_t> exchange_root_blob(const RankEnv& env, const std::vector<uint8_t>& blob,
                                        double timeout_s = 60);

// Forks `world` ranks on this host; each runs body(env) with env = {rank, world, local_rank = rank, the
// rendezvous file `rendezvous_file`} (and the same in its environment: RANK, WORLD_SIZE, LOCAL_RANK,
// TESSERA_RENDEZVOUS_FILE), then exits with body's return value (1 and the message on stderr if it throws).
// The caller must not have initialised CUDA. When a rank fails, the others (which may wait in a collective
// for it) are killed. Returns 0 when every rank returned 0, else the first failing rank's status, and says
// which rank failed on stderr. SIGTERM and SIGINT sent to the launcher while it waits go on to every rank.
int launch_local_ranks(int32_t world, const std::string& rendezvous_file,
                       const std::function<int(const RankEnv&)>& body);

// Whether this process is one rank of a world started outside it (WORLD_SIZE or OMPI_COMM_WORLD_SIZE is set).
bool launched_externally();

// The world a `--gpus N` command runs in: N, or under an external launcher the environment's size, which must
// equal N ("--gpus 4 but the environment says WORLD_SIZE=2").
int32_t world_for_gpus(int32_t gpus);

// The ranks of a `--gpus N` command (tessera run / bench / serve): under an external launcher, body(this
// process's rank); otherwise forks world_for_gpus(gpus) local ranks with a rendezvous file in the temp folder.
// Returns the exit status (launch_local_ranks).
int run_ranks(int32_t gpus, const std::function<int(const RankEnv&)>& body);

}  // namespace tessera::parallel
