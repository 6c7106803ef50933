#include "runtime_cuda/gemm.h"

#include <cublas_v2.h>

#include <limits>
#include <string>

#include "cuda/cuda_check.h"
#include "core/error.h"

namespace tessera::runtime::gpu {

namespace {

void cublas_check(cublasStatus_t status, const std::string& what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("cuBLAS error " + std::string(cublasGetStatusName(status)) + " (" +
                cublasGetStatusString(status) + ") in " + what);
}

cublasHandle_t as_handle(void* h) { return static_cast<cublasHandle_t>(h); }

}  // namespace

Gemm::Gemm(cudaStream_t stream) {
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  try {
    cublas_check(cublasSetStream(h, stream), "cublasSetStream");
    workspace_bytes_ = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
    TESSERA_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    cublas_check(cublasSetWorkspace(h, workspace_, workspace_bytes_), "cublasSetWorkspace");
  } catch (...) {
    if (workspace_ != nullptr) cudaFree(workspace_);
    cublasDestroy(h);
    throw;
  }
}

Gemm::~Gemm() {
  if (handle_ != nullptr) cublasDestroy(as_handle(handle_));
  if (workspace_ != nullptr) cudaFree(workspace_);
}

void Gemm::linear(const bf16* x, int64_t ldx, int64_t m, const bf16* w, int64_t out, int64_t in, void* y,
                  DType y_type, int64_t ldy, float beta) {
  if (m <= 0) return;
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const std::string shape = "GEMM [" + std::to_string(m) + " x " + std::to_string(in) + "] x [" +
                            std::to_string(out) + " x " + std::to_string(in) + "]^T";
  check(m <= kMax && out <= kMax && in <= kMax && ldx <= kMax && ldy <= kMax, shape + ": dimensions exceed int");
  check(y_type == DType::BF16 || y_type == DType::F32, shape + ": output must be bf16 or f32");
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(as_handle(handle_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(m),
                            static_cast<int>(in), &alpha, w, CUDA_R_16BF, static_cast<int>(in), x, CUDA_R_16BF,
                            static_cast<int>(ldx), &beta, y, y_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF,
                            static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               shape);
}

}  // namespace tessera::runtime::gpu
