// tessera/attention/cuda/split_merge.h — combining split-K units' rows into their items' output (split_merge.cu).
#pragma once

#include <cuda_runtime.h>

#include "attention/cuda/prefill_cursor.h"

namespace tessera::attn::gpu::detail {

// After the prefill kernel ran a plan with split units: merges[g] = {item, first unit, unit count, 0}; the units'
// rows are in p.part_o / p.part_lse; writes p.out (dtype T, head_dim columns) and p.lse. Asynchronous on stream.
template <typename T>
void launch_split_merge(const PrefillParams& p, const int4* merges, int num_merges, int head_dim, cudaStream_t stream);

}  // namespace tessera::attn::gpu::detail
