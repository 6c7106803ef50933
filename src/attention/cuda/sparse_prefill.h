// tessera/attention/cuda/sparse_prefill.h — the sparse FlashAttention prefill executor on the GPU.
//
// One kernel runs any range+column index (attention/index/sparse_index.h): per (query head, query tile) it
// walks the tile's key ranges in key tiles of 64 (partial tiles and the causal diagonal masked), then its
// gathered columns 64 at a time, with one online softmax over both. Dense causal attention is the same kernel
// on the dense index. mma.sync m16n8k16 (bf16 or f16 operands, f32 accumulation), cp.async double buffering.
//
// Arguments are AttentionArgs (attention/cpu/attention_args.h) whose views point to device memory:
//   q   [q_len,  num_q_heads,  head_dim]  bf16 or f16
//   k,v [kv_len, num_kv_heads, head_dim]  same dtype as q
//   out [q_len,  num_q_heads,  head_dim]  same dtype as q, written
//   lse [num_q_heads, q_len]              f32, optional, natural log (a row that sees no key: -inf, output 0)
// Any token and head strides are accepted as long as the last dimension is contiguous, strides are multiples
// of 8 elements and the pointers 16-byte aligned (so that fused QKV buffers work without a copy). head_dim is
// 64, 128 or 256. GQA: query head h reads kv head h / (num_q_heads / num_kv_heads), never materialised. The
// index tile must be 64 or 128 (the kernel's query-tile height) and must describe this call (heads, q_begin,
// q_len, kv_len).
//
// Scheduling: persistent CTAs (as many as fit on the device, at most one per item) take items in the order of
// `plan` (work_plan.h: heaviest first) through plan.counter, which is reset on `stream` before the launch.
// Everything is asynchronous on `stream`; errors in the arguments throw tessera::Error before anything runs.
#pragma once

#include <cuda_runtime.h>

#include "attention/cpu/attention_args.h"
#include "attention/cuda/device_index.h"

namespace tessera::attn::gpu {

// Throws tessera::Error naming the argument unless the call is one the CUDA executor runs.
void validate_cuda_args(const AttentionArgs& args);

void sparse_prefill(const AttentionArgs& args, const DeviceSparseIndex& index, DeviceWorkPlan& plan,
                    cudaStream_t stream = nullptr);

// Head dimensions and tiles the kernel is built for.
bool sparse_prefill_supports(int head_dim, int tile);

}  // namespace tessera::attn::gpu
