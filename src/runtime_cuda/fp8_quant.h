// tessera/runtime_cuda/fp8_quant.h — bf16 matrices to FP8 E4M3 with one dynamic per-tensor scale, on the device.
//
// quantize_e4m3 computes amax = max |x| over x [m, in] (rows ldx apart; an amax kernel with one atomic per block),
// then writes q [m, in] (contiguous, row-major) = e4m3(x * (448 / amax)) with the hardware's round-to-nearest-even,
// saturating conversion (cvt.rn.satfinite), and scale = amax / 448 to the device, for cuBLASLt's scale pointers. No
// host synchronisation: everything is stream-ordered. The convention and its host twin are core/fp8.h; the codes
// equal the host's bit for bit (tests/gpu/engine_tests/fp8_gemm_test.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// The work area of one quantization: kFp8WorkFloats floats of device memory, 16-byte aligned: amax at work[0], the
// scale at work[kFp8ScaleOffset] (its own 16-byte slot: cuBLASLt reads it through A/B_SCALE_POINTER, and every scale
// the libraries' examples pass is a separate, aligned allocation).
inline constexpr int kFp8WorkFloats = 8;
inline constexpr int kFp8ScaleOffset = 4;

// x: 16-byte aligned, ldx and in multiples of 8 (throws tessera::Error otherwise); work: see above.
void quantize_e4m3(const bf16* x, int64_t ldx, int64_t m, int64_t in, uint8_t* q, float* work, cudaStream_t stream);

// Whether the current device has FP8 tensor cores (compute capability 8.9 or newer); `why` gets the device's name
// and compute capability.
bool fp8_tensor_cores(std::string* why = nullptr);

}  // namespace tessera::runtime::gpu
