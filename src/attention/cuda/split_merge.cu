// The merge of split-K units (attention/index/split_plan.h): per split item, its units' rows (normalised output
// O_u in f32 and lse_u in log2 units, from store_rows) become the item's rows: lse = log2 sum_u 2^lse_u,
// O = sum_u 2^(lse_u - lse) O_u, written in the output dtype with the lse in natural log, as an unsplit item
// writes them. A row no unit saw a key for is written as zeros with lse -inf.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_check.h"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/split_merge.h"

namespace tessera::attn::gpu::detail {

namespace {

// One block per split item, one warp per row, lanes over head_dim.
template <typename T>
__global__ void __launch_bounds__(256) split_merge_kernel(const PrefillParams p, const int4* merges, int d) {
  const float neg_inf = -__int_as_float(0x7f800000);
  const int4 g = merges[blockIdx.x];  // item, first unit, unit count
  const PrefillItem it = prefill_item(p, g.x, p.part_rows);
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < it.rows; r += blockDim.x / 32) {
    float mx = neg_inf;
    for (int u = 0; u < g.z; ++u) mx = fmaxf(mx, p.part_lse[static_cast<int64_t>(g.y + u) * p.part_rows + r]);
    float wsum = 0.0f;
    for (int u = 0; u < g.z; ++u) {
      const float lu = p.part_lse[static_cast<int64_t>(g.y + u) * p.part_rows + r];
      wsum += mx == neg_inf ? 0.0f : exp2f(lu - mx);
    }
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    T* dst = static_cast<T*>(p.out) + it.h * p.o_head + static_cast<int64_t>(it.row0 + r) * p.o_tok;
    for (int c = 2 * lane; c < d; c += 64) {
      float ax = 0.0f, ay = 0.0f;
      for (int u = 0; u < g.z; ++u) {
        const int64_t slot = static_cast<int64_t>(g.y + u) * p.part_rows + r;
        const float lu = p.part_lse[slot];
        if (lu == neg_inf) continue;
        const float w = exp2f(lu - mx);
        const float2 o = *reinterpret_cast<const float2*>(p.part_o + slot * d + c);
        ax += w * o.x;
        ay += w * o.y;
      }
      *reinterpret_cast<uint32_t*>(dst + c) = MmaTraits<T>::pack(ax * inv, ay * inv);
    }
    if (p.lse != nullptr && lane == 0) {
      p.lse[it.h * p.lse_head + static_cast<int64_t>(it.row0 + r) * p.lse_tok] =
          wsum > 0.0f ? (mx + __log2f(wsum)) * 0.69314718055994531f : neg_inf;
    }
  }
}

}  // namespace

template <typename T>
void launch_split_merge(const PrefillParams& p, const int4* merges, int num_merges, int head_dim,
                        cudaStream_t stream) {
  if (num_merges == 0) return;
  split_merge_kernel<T><<<num_merges, 256, 0, stream>>>(p, merges, head_dim);
  check_launch("split_merge_kernel");
}

template void launch_split_merge<__nv_bfloat16>(const PrefillParams&, const int4*, int, int, cudaStream_t);
template void launch_split_merge<__half>(const PrefillParams&, const int4*, int, int, cudaStream_t);

}  // namespace tessera::attn::gpu::detail
