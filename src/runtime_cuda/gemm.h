// tessera/runtime_cuda/gemm.h — the matrix products of the GPU forward pass, through cuBLAS.
//
// Every product is y[m, out] = x[m, in] · W[out, in]^T (+ beta · y): activations x in bf16 (rows ldx apart),
// weights W in bf16 row-major as the model stores them ([out, in]), accumulation in f32 (CUBLAS_COMPUTE_32F,
// tensor cores), y in bf16 or f32 (rows ldy apart). beta = 1 with an f32 y adds the product to y, which is how
// the residual stream takes the attention output and the MLP output without a separate add.
//
// In cuBLAS's column-major terms the row-major y^T [out, m] = W [out, in] (read transposed from its row-major
// storage) · x^T [in, m]: a "TN" GEMM with lda = in, ldb = ldx, ldc = ldy.
//
// FP8 (opt-in, GemmPrecision::kFp8; Hopper / Ada: compute capability 8.9+): linear_fp8 takes both operands in E4M3
// with one f32 scale each on the device (Fp8Matrix: the value is scale * code), through cuBLASLt (the same TN layout:
// FP8 tensor cores need it), f32 accumulation, bf16 or f32 y, beta as above (C = D = y). Weights are quantized once
// (DeviceFp8Weights in device_model.h), activations per call by quantize_activation (a dynamic per-tensor scale,
// fp8_quant.h), which several products of the same input share (Q, K and V).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// The precision of the forward pass's GEMMs (the LM head stays bf16 in both).
enum class GemmPrecision {
  kBf16,  // bf16 x bf16 (cuBLAS), the default
  kFp8,   // E4M3 x E4M3 with per-tensor scales (cuBLASLt): W8A8, weights quantized once, activations per call
};
const char* gemm_precision_name(GemmPrecision p);  // "bf16", "fp8"
// "bf16" or "fp8"; throws tessera::Error "<flag> must be bf16 or fp8, got '<name>'" otherwise.
GemmPrecision parse_gemm_precision(const std::string& name, const std::string& flag = "--gemm");
// Throws tessera::Error "<flag> fp8 needs FP8 tensor cores (compute capability 8.9 or newer); this GPU is <name>,
// compute capability X.Y" when the current device has none; nothing for bf16.
void check_gemm_precision_supported(GemmPrecision p, const std::string& flag = "--gemm");

// A row-major E4M3 matrix [rows, cols] (contiguous) on the device and its scale (one f32 on the device).
struct Fp8Matrix {
  const uint8_t* data = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0, cols = 0;
};

class Gemm {
 public:
  // A cuBLAS handle bound to `stream`, with its own 32 MiB workspace. Throws tessera::Error when cuBLAS
  // cannot start.
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y_type: DType::BF16 or DType::F32. Asynchronous on the stream. Throws tessera::Error naming the shape
  // when cuBLAS refuses the call.
  void linear(const bf16* x, int64_t ldx, int64_t m, const bf16* w, int64_t out, int64_t in, void* y,
              DType y_type, int64_t ldy, float beta = 0.0f);

  // Quantizes x [m, in] (rows ldx apart; in and ldx multiples of 16) to E4M3 with a dynamic per-tensor scale into
  // this Gemm's activation buffer (grown as needed): the result is valid, in stream order, until the next call.
  Fp8Matrix quantize_activation(const bf16* x, int64_t ldx, int64_t m, int64_t in);
  // y[m, out] = x[m, in] · w[out, in]^T (+ beta · y), x from quantize_activation, w from DeviceFp8Weights.
  void linear_fp8(const Fp8Matrix& x, const Fp8Matrix& w, void* y, DType y_type, int64_t ldy, float beta = 0.0f);

  size_t workspace_bytes() const { return workspace_bytes_ + act_bytes_; }

 private:
  struct LtPlan;  // a cuBLASLt descriptor set and algorithm for one shape (gemm.cpp)
  LtPlan& lt_plan(int64_t m, int64_t out, int64_t in, DType y_type, int64_t ldy, bool accumulate);

  void* handle_ = nullptr;  // cublasHandle_t
  void* lt_handle_ = nullptr;  // cublasLtHandle_t, created on the first FP8 call
  cudaStream_t stream_ = nullptr;
  uint8_t* act_ = nullptr;  // quantize_activation's buffer
  size_t act_bytes_ = 0;
  float* act_work_ = nullptr;  // its amax and scale (fp8_quant.h kFp8WorkFloats)
  void* d_scratch_ = nullptr;  // linear_fp8's out-of-place D, when cuBLASLt refuses C == D
  size_t d_scratch_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int64_t, bool>, LtPlan*> plans_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace tessera::runtime::gpu
