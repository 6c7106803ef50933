#include "runtime_cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include <limits>
#include <string>

#include "attention/cuda/cuda_check.h"
#include "core/error.h"

namespace tessera::runtime::gpu {

namespace {

void cublas_check(cublasStatus_t status, const std::string& what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("cuBLAS error " + std::string(cublasGetStatusName(status)) + " (" +
                cublasGetStatusString(status) + ") in " + what);
}

cublasHandle_t as_handle(void* h) { return static_cast<cublasHandle_t>(h); }
cublasLtHandle_t as_lt(void* h) { return static_cast<cublasLtHandle_t>(h); }

bool tuning_from_env() {
  const char* e = std::getenv("TESSERA_GEMM_TUNE");
  return e == nullptr || std::string(e) != "0";
}

}  // namespace

// A tuned shape: its cuBLASLt descriptors (beta = 0 and the accumulating form share them) and the chosen
// algorithm; ok = false means "use cublasGemmEx".
struct Gemm::Tuned {
  bool ok = false;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Tuned() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

Gemm::Gemm(cudaStream_t stream) {
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  stream_ = stream;
  tune_ = tuning_from_env();
  try {
    cublasLtHandle_t lt = nullptr;
    cublas_check(cublasLtCreate(&lt), "cublasLtCreate");
    lt_handle_ = lt;
    cublas_check(cublasSetStream(h, stream), "cublasSetStream");
    workspace_bytes_ = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
    TESSERA_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    cublas_check(cublasSetWorkspace(h, workspace_, workspace_bytes_), "cublasSetWorkspace");
  } catch (...) {
    if (workspace_ != nullptr) cudaFree(workspace_);
    if (lt_handle_ != nullptr) cublasLtDestroy(as_lt(lt_handle_));
    cublasDestroy(h);
    throw;
  }
}

Gemm::~Gemm() {
  tuned_.clear();
  if (lt_handle_ != nullptr) cublasLtDestroy(as_lt(lt_handle_));
  if (handle_ != nullptr) cublasDestroy(as_handle(handle_));
  if (workspace_ != nullptr) cudaFree(workspace_);
}

std::string Gemm::tuning_report() const { return report_; }

// cuBLASLt form of linear(): D = op(A) B with A = W stored [in x out] column-major (ld in) and transposed,
// B = x [in x m] (ld ldx), C = D = y [out x m] (ld ldy) — cublasGemmEx(T, N, out, m, in) in Lt descriptors.
// Returns false when the shape should go through cublasGemmEx.
bool Gemm::run_tuned(const bf16* x, int64_t ldx, int64_t m, const bf16* w, int64_t out, int64_t in, void* y,
                     DType y_type, int64_t ldy, float beta) {
  const std::string key = std::to_string(m) + "/" + std::to_string(out) + "/" + std::to_string(in) + "/" +
                          std::to_string(ldx) + "/" + std::to_string(ldy) + "/" + (y_type == DType::F32 ? "f32" : "bf16");
  auto it = tuned_.find(key);
  if (it == tuned_.end()) {
    if (beta != 0.0f) return false;  // tuning would run the accumulation several times: use cuBLAS's choice
    auto t = std::make_shared<Tuned>();
    it = tuned_.emplace(key, t).first;
    const cudaDataType_t yt = y_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = nullptr;
    try {
      cublas_check(cublasLtMatmulDescCreate(&t->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
      cublas_check(cublasLtMatmulDescSetAttribute(t->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "TRANSA");
      cublas_check(cublasLtMatmulDescSetAttribute(t->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "TRANSB");
      cublas_check(cublasLtMatrixLayoutCreate(&t->a, CUDA_R_16BF, static_cast<uint64_t>(in), static_cast<uint64_t>(out),
                                              in),
                   "layout A");
      cublas_check(cublasLtMatrixLayoutCreate(&t->b, CUDA_R_16BF, static_cast<uint64_t>(in), static_cast<uint64_t>(m),
                                              ldx),
                   "layout B");
      cublas_check(cublasLtMatrixLayoutCreate(&t->c, yt, static_cast<uint64_t>(out), static_cast<uint64_t>(m), ldy),
                   "layout C");
      cublas_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
      const uint64_t ws = workspace_bytes_;
      cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                   "preference workspace");
      constexpr int kWant = 8;
      cublasLtMatmulHeuristicResult_t cand[kWant];
      int found = 0;
      cublas_check(cublasLtMatmulAlgoGetHeuristic(as_lt(lt_handle_), t->op, t->a, t->b, t->c, t->c, pref, kWant,
                                                  cand, &found),
                   "heuristic");
      cublasLtMatmulPreferenceDestroy(pref);
      pref = nullptr;
      if (found <= 0) return false;
      // Time each candidate (one warm-up call, then the median of 3) on the call's buffers: beta = 0, so the
      // output is simply overwritten by the final call.
      const float alpha = 1.0f, zero = 0.0f;
      cudaEvent_t e0 = nullptr, e1 = nullptr;
      TESSERA_CUDA_CHECK(cudaEventCreate(&e0));
      TESSERA_CUDA_CHECK(cudaEventCreate(&e1));
      float best = 0.0f;
      int best_i = -1;
      std::string line = "GEMM " + key + ":";
      for (int i = 0; i < found; ++i) {
        if (cand[i].state != CUBLAS_STATUS_SUCCESS) continue;
        float times[3];
        bool ok = true;
        for (int r = -1; r < 3 && ok; ++r) {
          if (r >= 0) TESSERA_CUDA_CHECK(cudaEventRecord(e0, stream_));
          ok = cublasLtMatmul(as_lt(lt_handle_), t->op, &alpha, w, t->a, x, t->b, &zero, y, t->c, y, t->c,
                              &cand[i].algo, workspace_, workspace_bytes_, stream_) == CUBLAS_STATUS_SUCCESS;
          if (r >= 0 && ok) {
            TESSERA_CUDA_CHECK(cudaEventRecord(e1, stream_));
            TESSERA_CUDA_CHECK(cudaEventSynchronize(e1));
            TESSERA_CUDA_CHECK(cudaEventElapsedTime(&times[r], e0, e1));
          }
        }
        if (!ok) continue;
        std::sort(times, times + 3);
        line += " " + std::to_string(times[1]).substr(0, 6);
        if (best_i < 0 || times[1] < best) {
          best = times[1];
          best_i = i;
        }
      }
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      if (best_i < 0) return false;
      t->algo = cand[best_i].algo;
      t->ok = true;
      report_ += line + " ms -> candidate " + std::to_string(best_i) + "\n";
    } catch (const Error&) {
      if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
      t->ok = false;
      return false;
    }
  }
  const Tuned& t = *it->second;
  if (!t.ok) return false;
  const float alpha = 1.0f;
  return cublasLtMatmul(as_lt(lt_handle_), t.op, &alpha, w, t.a, x, t.b, &beta, y, t.c, y, t.c, &t.algo, workspace_,
                        workspace_bytes_, stream_) == CUBLAS_STATUS_SUCCESS;
}

void Gemm::linear(const bf16* x, int64_t ldx, int64_t m, const bf16* w, int64_t out, int64_t in, void* y,
                  DType y_type, int64_t ldy, float beta) {
  if (m <= 0) return;
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const std::string shape = "GEMM [" + std::to_string(m) + " x " + std::to_string(in) + "] x [" +
                            std::to_string(out) + " x " + std::to_string(in) + "]^T";
  check(m <= kMax && out <= kMax && in <= kMax && ldx <= kMax && ldy <= kMax, shape + ": dimensions exceed int");
  check(y_type == DType::BF16 || y_type == DType::F32, shape + ": output must be bf16 or f32");
  if (tune_ && run_tuned(x, ldx, m, w, out, in, y, y_type, ldy, beta)) return;
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(as_handle(handle_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(m),
                            static_cast<int>(in), &alpha, w, CUDA_R_16BF, static_cast<int>(in), x, CUDA_R_16BF,
                            static_cast<int>(ldx), &beta, y, y_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF,
                            static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               shape);
}

}  // namespace tessera::runtime::gpu
