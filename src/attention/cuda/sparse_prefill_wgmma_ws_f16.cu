// Instantiation of the warp-specialized wgmma sparse prefill kernel (sm_90a) for f16, head_dim 128, tile 128,
// Q in registers with 4 K/V stages, Q in shared memory with 4; the TMA variants with Q in registers, 4 stages (ping-pong with lazy and with eager rescaling; ping-pong with 128-key steps and 6 stages) (variants of the self-check in sparse_prefill.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/cuda/sparse_prefill_wgmma_ws.cuh"

namespace tessera::attn::gpu::detail {
template void launch_sparse_prefill_wgmma_ws<__half, 4, true>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_ws<__half, 4, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 6, true, false, 8, true>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 6, true, true, 8, true>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 6, true, true, 8, true, 0, true>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 6, true, true, 8, true, 2, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 4, true, false, 8, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 4, true, true, 8, false>(const PrefillParams&, cudaStream_t);
template void launch_sparse_prefill_wgmma_tma<__half, 4, true, true, 0, false>(const PrefillParams&, cudaStream_t);
}  // namespace tessera::attn::gpu::detail
