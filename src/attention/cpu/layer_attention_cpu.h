// tessera/attention/cpu/layer_attention_cpu.h — the one place that decides a layer's attention route on the CPU
// (the counterpart of attention/cuda/layer_attention_cuda.h's CudaLayerAttention).
//
// Given the executor's arguments of one layer (q of the chunk's rows starting at args.q_begin, k/v of every key so
// far, the model's sliding window in args.window) and the policy's patterns of its query heads:
//  - no patterns, or every one dense: the dense executor (dense_attention.h);
//  - otherwise: the dynamic patterns' estimates (estimate.h), the lowering of every head to the range + column index
//    with the CPU executor's query tile (kCpuQueryTile) and the sparse executor (sparse_attention.h). total_len is
//    the length the sequence has at the end of this prefill (MoA spans, Triangle's last rows), at least k's rows.
#pragma once

#include <cstdint>
#include <span>

#include "attention/attention_args.h"
#include "attention/pattern/pattern.h"
#include "core/thread_pool.h"

namespace tessera::attn {

// The query-tile height of the indices the CPU executor runs.
inline constexpr int32_t kCpuQueryTile = 64;

void layer_attention_cpu(const AttentionArgs& args, std::span<const Pattern> patterns, int32_t total_len,
                         ThreadPool& pool);

}  // namespace tessera::attn
