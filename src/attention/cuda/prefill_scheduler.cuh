// tessera/attention/cuda/prefill_scheduler.cuh — the tile scheduler of both prefill kernels: persistent CTAs take
// the plan's work heaviest first.
//
// The plan (work_plan.h, device_index.h DeviceWorkPlan) orders the items (one query tile of one head) by cost,
// heaviest first, and may cut the heaviest items of static heads into split-K units (attention/index/
// split_plan.h: unit u runs key tiles [first, end) of its item into scratch rows; split_merge.cu merges them). The
// grid holds as many CTAs as fit on the device (at most one per slot); each CTA takes the next slot of
// `order` through the plan's counter (one atomicAdd), so long items start first and short ones fill the tail.
// A slot whose item runs as units holds -1 and is passed over. The Hopper kernel runs no units (its plans have
// none: sparse_prefill routes split plans to the mma.sync kernel), so it takes slots without that check.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "attention/cuda/prefill_cursor.h"
#include "cuda/cuda_check.h"

namespace tessera::attn::gpu::detail {

// The next work of a kernel whose whole CTA takes items (thread 0 takes a slot through p.counter, every thread
// reads it from s_slot): slots of items split into units are passed over; item -1 at the end of the plan.
__device__ __forceinline__ PrefillWork take_block_work(const PrefillParams& p, int& s_slot) {
  for (;;) {
    if (threadIdx.x == 0) s_slot = atomicAdd(p.counter, 1);
    __syncthreads();
    const int slot = s_slot;
    if (slot >= p.num_items + p.num_units) return PrefillWork{-1, 0, 0, -1};
    const PrefillWork work = prefill_work(p, slot);
    if (work.item >= 0) return work;
    __syncthreads();  // everyone has read s_slot before thread 0 takes the next
  }
}

// The next slot of a kernel whose one producer warp takes items for its CTA (the Hopper kernel; plans without split
// units): lane 0 takes it, every lane gets it; slot >= p.num_items at the end of the plan, else the item is
// p.order[slot]. (Returning the item instead, with the order read before the end test, cost the Hopper kernel's
// producer 12 bytes of spills.)
__device__ __forceinline__ int take_warp_slot(const PrefillParams& p, int lane) {
  int slot = 0;
  if (lane == 0) slot = atomicAdd(p.counter, 1);
  return __shfl_sync(0xffffffffu, slot, 0);
}

// The launch of every persistent prefill kernel (host): check the shared memory the kernel needs against the
// device, raise its dynamic shared-memory limit, size the grid to the CTAs that fit (at most one per item),
// reset the plan's item counter on `stream` and launch with `args`. `who` names the kernel in errors ("sparse
// prefill (wgmma)"), `shape` optionally what it was built for ("head_dim 128 with tile 128"); `name` is the
// kernel's name for check_launch.
template <class Kernel, class... Args>
void launch_persistent(Kernel kernel, int threads, size_t smem_bytes, const std::string& who,
                       const std::string& shape, const char* name, const PrefillParams& p, cudaStream_t stream,
                       const Args&... args) {
  const DeviceInfo& dev = current_device_info();
  if (static_cast<size_t>(dev.max_smem_per_block) < smem_bytes) {
    throw Error(who + ": " + (shape.empty() ? std::string() : shape + " ") + "needs " + std::to_string(smem_bytes) +
                " bytes of shared memory per block, the device allows " + std::to_string(dev.max_smem_per_block));
  }
  TESSERA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  int per_sm = 0;
  TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
  if (per_sm < 1) throw Error(who + ": kernel does not fit on a multiprocessor");
  int64_t grid_max = static_cast<int64_t>(per_sm) * dev.num_sms;
  if (p.max_ctas > 0) grid_max = std::min<int64_t>(grid_max, p.max_ctas);
  const int grid = static_cast<int>(std::min<int64_t>(int64_t{p.num_items} + p.num_units, grid_max));
  TESSERA_CUDA_CHECK(cudaMemsetAsync(p.counter, 0, sizeof(int32_t), stream));
  if (grid == 0) return;
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  check_launch(name);
}

}  // namespace tessera::attn::gpu::detail
