// tessera/attention/index/prefill_route.h — which executor runs a layer's prefill on the GPU: the options of the
// CUDA attention backend and the routing step (host code, no CUDA: the decision is tested on the CPU).
//
// A layer's route is computed once per layer shape, policy, dtype and window (CudaLayerAttention) from:
//   - the options (CudaAttentionOptions): set by the CLI / engine, or the process defaults, which are the struct's
//     defaults with the documented environment overrides applied once, at first use (cuda_attention_defaults):
//       TESSERA_PREFILL_KERNEL=auto|mma|wgmma   the prefill kernel (mma: the Hopper kernel off altogether)
//       TESSERA_DENSE_BACKEND=auto|ours|cudnn   who runs dense attention (ours: dense_backend kOurs; cudnn: auto
//                                               with cudnn_any_length, cuDNN wherever it has a plan)
//       TESSERA_DENSE_FALLBACK=1|0              the dense fallback and the dense shortcut
//     A malformed value is an error naming the variable and the accepted values;
//   - what the layer is (all heads dense or not; the dense shortcut's static rule, attention/index/dense_shortcut.h;
//     whether its plan has split-K units) and the call (q_len, window);
//   - what the device offers: whether the Hopper kernel runs this dtype / head_dim / tile here (and passed its
//     self-check), and whether cuDNN has a plan for the call (asked only where the route would take cuDNN).
// Routes (name(): the path string that CudaLayerAttention::last_path() reports):
//   all heads dense           "dense cudnn" or "dense <kernel>" on the dense backend;
//   shortcut (static rule)    "dense shortcut cudnn|<kernel>": no estimation, no index;
//   sparse                    "sparse <kernel>"; with the fallback check, a call whose index costs more than dense
//                             attention (C_sparse > r * C_dense, r = the dense backend's time per key tile relative
//                             to ours, cudnn_rel_tile_cost) runs "dense fallback cudnn|<kernel>" instead.
// <kernel> is "wgmma" (the Hopper kernel) or "mma.sync". Plans with split-K units run on mma.sync (the Hopper
// kernel runs no units). The dense backend in auto mode takes cuDNN where it has a plan, the call is whole-prompt
// without a window, q_len >= kCudnnMinQLen and cuDNN is the faster at that length (kCudnnRelTime); else ours.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace tessera::attn::gpu {

enum class PrefillKernel {
  kAuto,   // the Hopper kernel where it applies and passed its self-check, else mma.sync
  kMma,    // the mma.sync kernel (sm_80+, every head_dim and tile, split-K units)
  kWgmma,  // the Hopper kernel (wgmma, sm_90a, head_dim 128, tile 128, no split units)
};
const char* prefill_kernel_name(PrefillKernel kernel);  // "auto", "mma.sync", "wgmma"

// Who runs dense attention (all-dense layers, the dense shortcut and the dense fallback).
enum class DenseBackend {
  kAuto,   // cuDNN where it can run the call, q_len >= kCudnnMinQLen and it is the faster (kCudnnRelTime)
  kOurs,   // our prefill kernel on the dense index
  kCudnn,  // cuDNN; a call it cannot run is an error
};
const char* dense_backend_name(DenseBackend b);  // "auto", "ours", "cudnn"

// kAuto sends dense calls shorter than this to our kernel (cuDNN plans are built per shape on first use, which costs
// host time for every new prompt length).
inline constexpr int64_t kCudnnMinQLen = 2048;
// cuDNN's dense time relative to our kernel's (cuDNN / ours, per key tile), by prompt length: H200, the pair-step TMA
// kernel, one sweep of `attention_gpu_bench --patterns dense` (docs/PERF.md, sixth attention run). Neither wins
// everywhere: ours at <= 4K, 16K and 128K, cuDNN by 4-7% at 24K-96K.
struct DenseTimeRatio {
  int64_t q_len;
  double cudnn_over_ours;
};
inline constexpr DenseTimeRatio kCudnnRelTime[] = {
    {1024, 1.054},  {2048, 1.079},  {4096, 1.022},  {8192, 0.993},  {16384, 1.021}, {24576, 0.957},
    {32768, 0.950}, {49152, 0.935}, {65536, 0.965}, {98304, 0.959}, {131072, 1.051}};
// The ratio at q_len: linear in log2(q_len) between the measured lengths, the end values beyond them.
double cudnn_rel_tile_cost(int64_t q_len);

struct CudaAttentionOptions {
  PrefillKernel kernel = PrefillKernel::kAuto;
  DenseBackend dense_backend = DenseBackend::kAuto;
  bool dense_fallback = true;  // the per-call fallback and the static shortcut
  bool dense_shortcut = true;  // the shortcut alone (needs dense_fallback)
  bool split = true;           // split-K units for heavy items of static heads (attention/index/split_plan.h)
  bool cudnn_any_length = false;  // dense_backend kAuto: cuDNN wherever it has a plan, at any length and ratio
};
// `base` with the environment overrides above applied; `getenv` is std::getenv in the product (a parameter so that
// tests pass their own). Throws tessera::Error for a malformed value.
CudaAttentionOptions apply_env_overrides(CudaAttentionOptions base,
                                         const std::function<const char*(const char*)>& getenv);
// The process defaults: CudaAttentionOptions{} with the environment overrides, read once at the first call.
const CudaAttentionOptions& cuda_attention_defaults();
// The names the CLI takes (--prefill-kernel, --dense-backend): auto|mma|wgmma, auto|ours|cudnn. Throws tessera::Error
// naming `what` and the accepted values.
PrefillKernel parse_prefill_kernel(const std::string& name, const std::string& what = "prefill kernel");
DenseBackend parse_dense_backend(const std::string& name, const std::string& what = "dense backend");

// What the route is decided from (see the top of this file).
struct RouteInputs {
  int64_t q_len = 0;
  int32_t window = 0;
  bool all_dense = false;
  bool shortcut_ours = false;    // the dense shortcut's static rule at r = 1
  bool shortcut_cudnn = false;   // ... at r = cudnn_rel_tile_cost(q_len)
  bool split_units = false;      // the layer's plan cuts items into split-K units
  bool hopper_applies = false;   // the Hopper kernel runs this dtype, head_dim and tile here and passed its self-check
  bool cudnn_has_plan = false;   // cuDNN has a plan for this call (only read where wants_cudnn says so)
};

enum class RoutePath { kDense, kDenseShortcut, kSparse, kDenseFallback };

struct PrefillRoute {
  RoutePath path = RoutePath::kSparse;  // kDense, kDenseShortcut or kSparse (kDenseFallback is decided per call)
  DenseBackend dense = DenseBackend::kOurs;          // kOurs or kCudnn: the dense paths' backend
  PrefillKernel sparse_kernel = PrefillKernel::kMma;  // kMma or kWgmma: the sparse path's kernel
  PrefillKernel dense_kernel = PrefillKernel::kMma;   // kMma or kWgmma: our kernel on the dense index
  bool fallback_check = false;  // sparse path: compare the built index's cost with dense per call
  double dense_tile_cost = 1.0;  // r: the dense backend's time per key tile relative to our kernel's
  // The path string of `p` (the route's own path, or kDenseFallback after the per-call check).
  std::string name(RoutePath p) const;
  std::string name() const { return name(path); }
};

// Whether the route for these inputs and options would run dense attention on cuDNN if cuDNN had a plan (so that
// the caller builds the plan only then).
bool wants_cudnn(const RouteInputs& in, const CudaAttentionOptions& opt);
// The route. Throws tessera::Error when the options ask for what cannot run (kWgmma where the Hopper kernel does not
// apply or the plan has split units; kCudnn without a cuDNN plan for a dense path).
PrefillRoute plan_prefill_route(const RouteInputs& in, const CudaAttentionOptions& opt);

}  // namespace tessera::attn::gpu
