// tessera/attention/cuda/prefill_instances.h — the table of prefill kernels built into the product.
//
// One line per instantiation; the dispatch (sparse_prefill.cu) and the instantiation files
// (prefill_{mma,hopper}_{bf16,f16}.cu) expand these lists, so adding a head_dim or a query tile is one edit here.
// A new dtype is one line in TESSERA_PREFILL_DTYPES plus its two three-line instantiation files.
//   TESSERA_PREFILL_DTYPES(X)          X(cuda type, DType enumerator, file suffix)
//   TESSERA_MMA_PREFILL_SHAPES(X, T)   X(T, head_dim, query tile): the mma.sync kernel (sm_80+), the portable path
//   TESSERA_HOPPER_PREFILL_SHAPES(X, T) X(T, head_dim, query tile): the Hopper kernel (sm_90a; its one
//                                      configuration, hopper/config.cuh, is head_dim 128 with tile 128)
#pragma once

#define TESSERA_PREFILL_DTYPES(X) \
  X(__nv_bfloat16, BF16, bf16)    \
  X(__half, F16, f16)

#define TESSERA_MMA_PREFILL_SHAPES(X, T) \
  X(T, 64, 64)                           \
  X(T, 64, 128)                          \
  X(T, 128, 64)                          \
  X(T, 128, 128)                         \
  X(T, 256, 64)                          \
  X(T, 256, 128)

#define TESSERA_HOPPER_PREFILL_SHAPES(X, T) X(T, 128, 128)
