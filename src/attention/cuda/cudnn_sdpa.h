// tessera/attention/cuda/cudnn_sdpa.h — dense causal attention through cuDNN's fused SDPA (flash) engine.
//
// Our own small wrapper over the cuDNN v9 graph ("backend") API: no cudnn-frontend. One operation graph per
// call shape, the one cuDNN's fused flash-attention engines recognise:
//   S = Q K^T (f32) -> S * scale -> causal mask (GEN_INDEX row/col, CMP_GE, BINARY_SELECT with the lowest
//   float) -> softmax as MAX, SUB, EXP, ADD-reduce, DIV, with stats = max + log(sum) -> O = P V,
// with P (the DIV output, matmul 2's A operand) in the I/O type (bf16/f16): the fused engines require it
// (cudnn-frontend sets it so; run 3 had P in f32 and no engine took the graph). If that graph gets no engine,
// a few variants are tried (cudnn_sdpa.cpp kVariants) and every engine's refusal is reported.
// on tensors laid out as AttentionArgs' (token-major [S, H, d], any 16-byte-aligned token/head strides, GQA
// as H_kv < H_q, never materialised). Stats are the natural-log LSE of each row (AttentionArgs::lse); when
// args.lse is absent they go to a scratch buffer (the engines that fuse this graph write them anyway).
//
// Scope: bf16 / f16, head_dim a multiple of 8 up to 256, q_begin = 0, kv_len = q_len (a whole-prompt
// prefill: top-left causal), no sliding window, lse (when present) contiguous [H, q_len]. Anything else:
// cudnn_dense_supports() says why, and the caller runs our kernel instead.
//
// Optional at build time (src/attention/cuda/CMakeLists.txt: found when cuDNN 9 headers and libcudnn are on
// the machine, e.g. the nvidia-cudnn-cu13 pip package; else built without it and cudnn_available() says so)
// and at run time (no device, no handle, or no engine for the graph: an explanation instead of a crash).
//
// Plans are cached per (device, dtype, shape, strides) for the life of the process. The first call of a shape
// builds its plan on the host (heuristics + finalisation: from milliseconds to ~1 s for runtime-compiled
// engines), so a caller that cares times the second call. Calls are asynchronous on `stream` afterwards.
// Thread-safe (one mutex around plan lookup and execution; execution itself is an asynchronous launch).
// Autotuning (off by default; TESSERA_CUDNN_AUTOTUNE=1 switches it on): the plan build also finalises up to 5
// more distinct engine configs (heuristics A, B, fallback; the no-stats graph when the call has no lse), and
// the first execution of the shape times them on the call's buffers (synchronising `stream`; within
// TESSERA_CUDNN_AUTOTUNE_BUDGET_MS, default 1500 ms of GPU time) and keeps the fastest. Any failure keeps the
// first config that finalised (the behaviour without autotuning). cudnn_dense_plan's description says which.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "attention/attention_args.h"

namespace tessera::attn::gpu {

// Whether this build links cuDNN (TESSERA_HAS_CUDNN).
bool cudnn_built();

// Whether cuDNN can run here: built with it, a CUDA device, a handle on the current device. `why` gets the
// reason when not (and the version when it can). Cached per device after the first call.
bool cudnn_available(std::string* why = nullptr);

// cuDNN's version (cudnnGetVersion(), e.g. 92600), 0 when not built with it.
int cudnn_version();

// Whether cudnn_dense_attention takes this call (arguments as validate_cuda_args accepts them); `why` gets
// the reason when not. Does not build a plan (cudnn_dense_plan does).
bool cudnn_dense_supports(const AttentionArgs& args, std::string* why = nullptr);

// Builds (or finds) the plan for this call's shape; false with the reason when cuDNN has no engine for it:
// the library (path, runtime and header versions), then per graph variant the heuristics' answers (mode A,
// fallback) and every engine's finalize status with cuDNN's own message. On success `why` gets the graph
// variant and engine config in use. Synchronous host work on first use of a shape.
bool cudnn_dense_plan(const AttentionArgs& args, std::string* why = nullptr);

// Dense causal attention of `args` (device views, as for sparse_prefill) through cuDNN, asynchronous on
// `stream`. Throws tessera::Error when unsupported, unavailable, or when cuDNN fails (with its message).
void cudnn_dense_attention(const AttentionArgs& args, cudaStream_t stream = nullptr);

}  // namespace tessera::attn::gpu
