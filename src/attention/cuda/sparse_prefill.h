// tessera/attention/cuda/sparse_prefill.h — the sparse FlashAttention prefill executor on the GPU.
//
// One executor runs any range+column index (attention/index/sparse_index.h): per (query head, query tile) it
// walks the tile's key ranges in key tiles of 64 (partial tiles and the causal diagonal masked), then its
// gathered columns 64 at a time, with one online softmax over both. Dense causal attention is the same executor
// on the dense index. docs/cuda-backend.md describes the parts.
//
// Arguments are AttentionArgs (attention/attention_args.h) whose views point to device memory:
//   q   [q_len,  num_q_heads,  head_dim]  bf16 or f16
//   k,v [kv_len, num_kv_heads, head_dim]  same dtype as q
//   out [q_len,  num_q_heads,  head_dim]  same dtype as q, written
//   lse [num_q_heads, q_len]              f32, optional, natural log (a row that sees no key: -inf, output 0)
// Any token and head strides are accepted as long as the last dimension is contiguous, strides are multiples
// of 8 elements and the pointers 16-byte aligned (so that fused QKV buffers work without a copy). head_dim is
// 64, 128 or 256. args.window > 0 (a model's row-exact sliding window) intersects the index with the window:
// each item's keys start at its first row's window (whole key tiles below it are skipped, never loaded) and
// tiles straddling a row's lower bound are masked per row, as on the CPU (attention_args.h).
// GQA: query head h reads kv head h / (num_q_heads / num_kv_heads), never materialised. The
// index tile must be 64 or 128 (the kernel's query-tile height) and must describe this call (heads, q_begin,
// q_len, kv_len).
//
// Kernels (the table: prefill_instances.h): the mma.sync kernel (mma_prefill_kernel.cuh) runs every head_dim and
// tile on sm_80 and later, and split-K units; the Hopper kernel (hopper/prefill_kernel.cuh: TMA producer warp, two
// wgmma consumer warpgroups) runs bf16/f16, head_dim 128, tile 128 on compute capability 9.0, plans without split
// units. PrefillKernel::kAuto takes the Hopper kernel where it applies and its self-check passed, else mma.sync. The
// self-check runs once per process, device and dtype, at the first call that could use the Hopper kernel: a small
// problem (ranges, gathered columns, partial tiles, several items per CTA) through both kernels on `stream`,
// compared on the host (so that first call synchronises `stream`). kAuto follows the process options
// (cuda_attention_defaults: TESSERA_PREFILL_KERNEL=mma switches the Hopper kernel off altogether, e.g. after it
// crashed the context on a device; =wgmma asks for it everywhere).
//
// Scheduling (prefill_scheduler.cuh): persistent CTAs (as many as fit on the device, at most one per item) take
// items in the order of `plan` (work_plan.h: heaviest first) through plan.counter, which is reset on `stream`
// before the launch. A plan with split-K units (attention/index/split_plan.h, DeviceWorkPlan::num_units > 0) runs
// each unit's key tiles into the plan's scratch rows and merges them afterwards (split_merge.h: one more launch).
// Everything is asynchronous on `stream`; errors in the arguments throw tessera::Error before anything runs.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cuda/device_index.h"
#include "attention/index/prefill_route.h"

namespace tessera::attn::gpu {

// Throws tessera::Error naming the argument unless the call is one the CUDA executor runs.
void validate_cuda_args(const AttentionArgs& args);

// PrefillKernel, the options and the routing of a layer: attention/index/prefill_route.h.

// Result of the Hopper kernel's self-check for one dtype on the current device (runs it on first use).
struct HopperSelfCheck {
  bool passed = false;
  std::string report;  // one line: errors and non-finite count, or the error
};
const HopperSelfCheck& hopper_prefill_self_check(DType dtype, cudaStream_t stream = nullptr);

// Whether the Hopper kernel is built for this dtype, head_dim and tile (prefill_instances.h).
bool hopper_prefill_built(DType dtype, int head_dim, int tile);
// Whether it applies on the current device (before its self-check): built for the shape, compute capability 9.0,
// not switched off by the process options (TESSERA_PREFILL_KERNEL=mma).
bool wgmma_prefill_applies(DType dtype, int head_dim, int tile);
// Applies and passed its self-check (runs the self-check on first use).
bool hopper_prefill_ready(DType dtype, int head_dim, int tile, cudaStream_t stream = nullptr);

// The kernel a call with `requested` runs (kMma or kWgmma; may run the self-check): kAuto follows the process
// options, then the Hopper kernel where it is ready and the plan has no split units. Throws for kWgmma where it
// cannot run (not applicable, failed self-check, split units).
PrefillKernel resolve_prefill_kernel(PrefillKernel requested, DType dtype, int head_dim, int tile,
                                     bool split_units = false, cudaStream_t stream = nullptr);

void sparse_prefill(const AttentionArgs& args, const DeviceSparseIndex& index, DeviceWorkPlan& plan,
                    cudaStream_t stream = nullptr, PrefillKernel kernel = PrefillKernel::kAuto);

// The shapes a kernel is built for (kMma or kWgmma), from the instantiation table.
struct PrefillShape {
  DType dtype;
  int head_dim, tile;
};
std::vector<PrefillShape> prefill_kernel_table(PrefillKernel kernel);

// Head dimensions and tiles the kernel is built for.
bool sparse_prefill_supports(int head_dim, int tile);

}  // namespace tessera::attn::gpu
