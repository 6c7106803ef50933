// The mma.sync prefill kernels for bf16: every shape of TESSERA_MMA_PREFILL_SHAPES (prefill_instances.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/mma_prefill_kernel.cuh"
#include "attention/cuda/prefill_instances.h"

namespace tessera::attn::gpu::detail {
#define TESSERA_INSTANTIATE(T, D, BM) template void launch_mma_prefill<T, D, BM>(const PrefillParams&, cudaStream_t);
TESSERA_MMA_PREFILL_SHAPES(TESSERA_INSTANTIATE, __nv_bfloat16)
#undef TESSERA_INSTANTIATE
}  // namespace tessera::attn::gpu::detail
