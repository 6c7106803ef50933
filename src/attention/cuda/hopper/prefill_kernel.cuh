// tessera/attention/cuda/hopper/prefill_kernel.cuh — the Hopper (sm_90a) sparse prefill kernel, composed of its
// parts (device and launch code; the contract is sparse_prefill.h's):
//   hopper/config.cuh        the one configuration (head_dim 128, query tile 128, 6 stages of 64 keys) and the
//                            shared-memory layout
//   prefill_scheduler.cuh    the tile scheduler: persistent CTAs take the plan's items heaviest first
//   hopper/producer.cuh      one producer warp: Q and range tiles by TMA, gathered columns by cp.async, into the
//                            stages, with mbarriers
//   hopper/consumer.cuh      two consumer warpgroups: wgmma S = Q K^T, online softmax, wgmma P V, ping-pong
//   prefill_epilogue.cuh     normalise and store the rows and their lse (shared with the mma.sync kernel)
//   hopper/tensor_map.h      the TMA tensor maps of Q, K and V
// bf16 and f16 are instantiated from prefill_instances.h (prefill_hopper_{bf16,f16}.cu). The plans it runs have
// no split-K units (sparse_prefill.cu routes those to the mma.sync kernel).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "attention/cuda/hopper/config.cuh"
#include "attention/cuda/hopper/consumer.cuh"
#include "attention/cuda/hopper/producer.cuh"
#include "attention/cuda/hopper/tensor_map.h"
#include "attention/cuda/hopper/wgmma.cuh"
#include "attention/cuda/prefill_scheduler.cuh"

namespace tessera::attn::gpu::detail {

template <typename T>
__global__ void __launch_bounds__(HopperConfig::kThreads, 1)
    hopper_prefill_kernel(const PrefillParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = HopperConfig;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const HopperSmem L(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbarrier_init(L.full(s), 64);  // per producer lane: a data arrive and a descriptor arrive
      mbarrier_init(L.empty(s), 8);  // one per consumer warp
    }
    mbarrier_init(L.qfull(), 1);
    mbarrier_init(L.qempty(), 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Registers: ptxas gives each side the budget of its setmaxnreg (without it the consumer step spills at the
  // kernel's 168); warps 1-3 of the producer warpgroup leave after lowering theirs.
  if (warp >= 4) {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    hopper_consumer_loop<T>(p, L, warp / 4 - 1, warp % 4, lane);
    return;
  }
  setmaxnreg_dec<Cfg::kProducerRegs>();
  if (warp != 0) return;
  hopper_producer_warp<T>(p, L, lane, &tm_q, &tm_k, &tm_v);
#endif
}

// Launches the kernel on `stream` (instantiated in prefill_hopper_{bf16,f16}.cu). Throws tessera::Error when the
// device cannot run it.
template <typename T>
void launch_hopper_prefill(const PrefillParams& params, cudaStream_t stream) {
  using Cfg = HopperConfig;
  PrefillParams p = params;
  p.pv_lbo = Cfg::kPvLbo;
  p.pv_sbo = Cfg::kPvSbo;
  const CUtensorMap tq = make_head_tensor_map<T>(p.q, p.num_q_heads, p.q_len, p.q_head, p.q_tok, Cfg::BM);
  const CUtensorMap tk = make_head_tensor_map<T>(p.k, p.num_kv_heads, p.kv_len, p.k_head, p.k_tok, Cfg::BN);
  const CUtensorMap tv = make_head_tensor_map<T>(p.v, p.num_kv_heads, p.kv_len, p.v_head, p.v_tok, Cfg::BN);
  launch_persistent(hopper_prefill_kernel<T>, Cfg::kThreads, Cfg::kSmemBytes, "sparse prefill (Hopper)", "",
                    "hopper_prefill_kernel", p, stream, p, tq, tk, tv);
}

}  // namespace tessera::attn::gpu::detail
