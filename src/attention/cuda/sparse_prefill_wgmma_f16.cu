// Instantiation of the wgmma sparse prefill kernel (sm_90a) for f16, head_dim 128, tile 128: the variants
// (P V as one m64n128 or two m64n64 per 16 keys; with or without the S / P V overlap) that the self-check of
// sparse_prefill.cu chooses from.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/sparse_prefill_wgmma.cuh"

namespace tessera::attn::gpu::detail {
template void launch_sparse_prefill_wgmma<__half, false, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma<__half, true, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma<__half, false, true>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma<__half, true, true>(const PrefillParams&, cudaStream_t);
}  // namespace tessera::attn::gpu::detail
