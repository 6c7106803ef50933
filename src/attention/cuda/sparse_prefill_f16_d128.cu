// Instantiation of the sparse prefill kernel for f16, head_dim 128 (one file per variant keeps builds
// parallel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/sparse_prefill_kernel.cuh"

namespace tessera::attn::gpu::detail {
template void launch_sparse_prefill<__half, 128, 64>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill<__half, 128, 128>(const PrefillParams&, cudaStream_t);
}  // namespace tessera::attn::gpu::detail
