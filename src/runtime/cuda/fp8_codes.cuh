// tessera/runtime/cuda/fp8_codes.cuh — the per-element FP8 E4M3 arithmetic of the activations' quantization, shared
// by fp8_quant.cu (bf16 rows in memory -> codes) and the kernels that quantize the rows they make (kernels.cu: the
// RMS norm and the gated activation with their codes in the same pass), so that both give the same codes bit for bit.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace tessera::runtime::gpu::fp8 {

constexpr float kMax = 448.0f;  // core/fp8.h kE4M3Max

// The row's amax -> its scale (written to *scale when non-null) and the inverse scale the codes are made with; a
// zero, NaN-only or infinite amax gives scale 1 (the host's e4m3_inverse_scale).
__device__ __forceinline__ float row_inverse_scale(float amax, float* scale) {
  const bool usable = amax > 0.0f && isfinite(amax);
  if (scale != nullptr) *scale = usable ? __fdiv_rn(amax, kMax) : 1.0f;
  return usable ? __fdiv_rn(kMax, amax) : 1.0f;  // IEEE division, as the host's e4m3_inverse_scale
}

// Two values times `inv`, each rounded to E4M3 (saturating to +-448), as 2 bytes in order.
__device__ __forceinline__ __nv_fp8x2_storage_t encode2(float a, float b, float inv) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv)), __NV_SATFINITE, __NV_E4M3);
}

// Eight values -> 8 bytes in order.
__device__ __forceinline__ uint2 encode8(const float* f, float inv) {
  uint2 out;
  __nv_fp8x2_storage_t* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = encode2(f[2 * i], f[2 * i + 1], inv);
  return out;
}

// Four values -> 4 bytes in order.
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d, float inv) {
  return static_cast<uint32_t>(encode2(a, b, inv)) | (static_cast<uint32_t>(encode2(c, d, inv)) << 16);
}

}  // namespace tessera::runtime::gpu::fp8
