// tessera/attention/cuda/hopper/tensor_map.h — TMA tensor maps of the Hopper prefill kernel's operands (host code).
//
// cuTensorMapEncodeTiled is reached through the runtime's driver entry point, so nothing links against libcuda.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"

namespace tessera::attn::gpu::detail {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows][heads][128] token-major view (strides in elements) as a 3-D tensor map: dims (128, heads, rows),
// box (64, 1, box_rows), 128-byte swizzle, out-of-bounds rows zero-filled.
template <typename T>
CUtensorMap make_head_tensor_map(const void* base, int heads, int rows, int64_t head_stride, int64_t tok_stride,
                                 int box_rows) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) throw Error("sparse prefill (TMA): cuTensorMapEncodeTiled is not available from the driver");
  CUtensorMap m{};
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * sizeof(T),
                                 static_cast<cuuint64_t>(tok_stride) * sizeof(T)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estrides[3] = {1, 1, 1};
  const CUtensorMapDataType dt =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(&m, dt, 3, const_cast<void*>(base), dims, strides, box, estrides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("sparse prefill (TMA): cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(r)) +
                " (heads " + std::to_string(heads) + ", rows " + std::to_string(rows) + ", strides " +
                std::to_string(head_stride) + "/" + std::to_string(tok_stride) + ")");
  }
  return m;
}

}  // namespace tessera::attn::gpu::detail
