// tessera/runtime_cuda/gemm.h — the matrix products of the GPU forward pass, through cuBLAS.
//
// Every product is y[m, out] = x[m, in] · W[out, in]^T (+ beta · y): activations x in bf16 (rows ldx apart),
// weights W in bf16 row-major as the model stores them ([out, in]), accumulation in f32 (CUBLAS_COMPUTE_32F,
// tensor cores), y in bf16 or f32 (rows ldy apart). beta = 1 with an f32 y adds the product to y, which is how
// the residual stream takes the attention output and the MLP output without a separate add.
//
// In cuBLAS's column-major terms the row-major y^T [out, m] = W [out, in] (read transposed from its row-major
// storage) · x^T [in, m]: a "TN" GEMM with lda = in, ldb = ldx, ldc = ldy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

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

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  void* handle_ = nullptr;  // cublasHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace tessera::runtime::gpu
