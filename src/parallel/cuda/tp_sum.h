// tessera/parallel/cuda/tp_sum.h — the same-device all-reduce's sum (SameDeviceGroup, parallel/cuda/tp_batch_gpu.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace tessera::parallel {

// out[i] = 0 + x[0][i] + x[1][i] + ... (ranks in order, 1 to 8 of them; device pointers), on `stream`.
void sum_in_rank_order(const std::vector<const float*>& x, float* out, size_t count, cudaStream_t stream);

}  // namespace tessera::parallel
