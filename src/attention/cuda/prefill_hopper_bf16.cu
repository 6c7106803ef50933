// The Hopper prefill kernel for bf16 (sm_90a; TESSERA_HOPPER_PREFILL_SHAPES in prefill_instances.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/hopper/prefill_kernel.cuh"

namespace tessera::attn::gpu::detail {
template void launch_hopper_prefill<__nv_bfloat16>(const PrefillParams&, cudaStream_t);
}  // namespace tessera::attn::gpu::detail
