#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "parallel/cuda/tp_sum.h"

namespace tessera::parallel {

namespace {

constexpr int kMaxRanks = 8;

struct RankPointers {
  const float* x[kMaxRanks];
  int ranks;
};

__global__ void sum_kernel(RankPointers p, float* out, size_t count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int r = 0; r < p.ranks; ++r) s += p.x[r][i];
    out[i] = s;
  }
}

}  // namespace

void sum_in_rank_order(const std::vector<const float*>& x, float* out, size_t count, cudaStream_t stream) {
  check(!x.empty() && x.size() <= kMaxRanks,
        "same-device all-reduce: 1 to " + std::to_string(kMaxRanks) + " ranks, got " + std::to_string(x.size()));
  if (count == 0) return;
  RankPointers p{};
  for (size_t r = 0; r < x.size(); ++r) p.x[r] = x[r];
  p.ranks = static_cast<int>(x.size());
  const size_t blocks = std::min<size_t>((count + 255) / 256, 4096);
  sum_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, out, count);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::parallel
