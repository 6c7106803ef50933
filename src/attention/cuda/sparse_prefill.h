// tessera/attention/cuda/sparse_prefill.h — the sparse FlashAttention prefill executor on the GPU.
//
// One kernel runs any range+column index (attention/index/sparse_index.h): per (query head, query tile) it
// walks the tile's key ranges in key tiles of 64 (partial tiles and the causal diagonal masked), then its
// gathered columns 64 at a time, with one online softmax over both. Dense causal attention is the same kernel
// on the dense index. mma.sync m16n8k16 (bf16 or f16 operands, f32 accumulation), cp.async double buffering.
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
// Kernels: the mma.sync kernel (sparse_prefill_kernel.cuh) runs every head_dim and tile on sm_80 and later;
// the Hopper kernel (sparse_prefill_wgmma.cuh: wgmma, 2 warpgroups) runs bf16/f16, head_dim 128, tile 128 on
// compute capability 9.0. PrefillKernel::kAuto takes the wgmma kernel where it applies and its self-check
// passed, else the mma.sync kernel. The self-check runs once per process, device and dtype, at the first call
// that could use the wgmma kernel: a small problem (ranges, gathered columns, partial tiles) through both
// kernels on `stream`, compared on the host (so that first call synchronises `stream`); it runs every
// variant of the wgmma kernel (wgmma_prefill_variant_name) and uses the first that matches. The environment
// variable TESSERA_PREFILL_KERNEL=wgmma|auto overrides kAuto (a test or benchmark can still ask for one
// kernel); TESSERA_PREFILL_KERNEL=mma switches the wgmma kernel off altogether (wgmma_prefill_applies is
// false, no self-check runs), e.g. after it crashed the context on a device. TESSERA_WGMMA_VARIANT=N runs wgmma
// variant N (it must have passed the self-check) wherever the self-check's choice would run.
//
// Scheduling: persistent CTAs (as many as fit on the device, at most one per item) take items in the order of
// `plan` (work_plan.h: heaviest first) through plan.counter, which is reset on `stream` before the launch.
// A plan with split-K units (attention/index/split_plan.h, DeviceWorkPlan::num_units > 0) runs each unit's key
// tiles into the plan's scratch rows and merges them afterwards (split_merge.h: one more launch); the wgmma pair
// variant runs no units, so such plans run on the first non-pair variant that passed the self-check.
// Everything is asynchronous on `stream`; errors in the arguments throw tessera::Error before anything runs.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cuda/device_index.h"

namespace tessera::attn::gpu {

// Throws tessera::Error naming the argument unless the call is one the CUDA executor runs.
void validate_cuda_args(const AttentionArgs& args);

enum class PrefillKernel {
  kAuto,   // wgmma where it applies and passed its self-check, else mma.sync
  kMma,    // the mma.sync kernel
  kWgmma,  // the wgmma kernel; throws tessera::Error where it does not apply or failed its self-check
};
const char* prefill_kernel_name(PrefillKernel kernel);

// Result of the wgmma kernel's self-check for one dtype on the current device (runs it on first use).
struct WgmmaSelfCheck {
  bool passed = false;
  int variant = -1;                  // the variant kAuto / kWgmma use: the first that passed
  std::vector<bool> variant_passed;  // per variant (all are tried)
  std::string report;                // one line per variant (errors and non-finite count), or the error
};
const WgmmaSelfCheck& wgmma_prefill_self_check(DType dtype, cudaStream_t stream = nullptr);

// Whether the wgmma kernel applies to this dtype, head_dim and tile on the current device (before its
// self-check: compute capability 9.0, bf16/f16, head_dim 128, tile 128, built for sm_90a; not switched off by
// TESSERA_PREFILL_KERNEL=mma).
bool wgmma_prefill_applies(DType dtype, int head_dim, int tile);

// The kernel a call with `requested` runs (kMma or kWgmma; may run the self-check). Throws like
// sparse_prefill for kWgmma where it cannot run.
PrefillKernel resolve_prefill_kernel(PrefillKernel requested, DType dtype, int head_dim, int tile,
                                     cudaStream_t stream = nullptr);

// The wgmma kernel's variants (schedule and P V form), for benchmarks: how many, and their names.
int wgmma_prefill_variants();
const char* wgmma_prefill_variant_name(int variant);

// wgmma_variant >= 0 runs that variant of the wgmma kernel when the call runs the wgmma kernel (it must have
// passed the self-check; throws otherwise); -1 runs the self-check's choice.
void sparse_prefill(const AttentionArgs& args, const DeviceSparseIndex& index, DeviceWorkPlan& plan,
                    cudaStream_t stream = nullptr, PrefillKernel kernel = PrefillKernel::kAuto,
                    int wgmma_variant = -1);

// Head dimensions and tiles the kernel is built for.
bool sparse_prefill_supports(int head_dim, int tile);

}  // namespace tessera::attn::gpu
