#include "runtime/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "core/error.h"
#include "runtime/cuda/fp8_quant.h"

namespace tessera::runtime::gpu {

namespace {

void cublas_check(cublasStatus_t status, const std::string& what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("cuBLAS error " + std::string(cublasGetStatusName(status)) + " (" +
                cublasGetStatusString(status) + ") in " + what);
}

cublasHandle_t as_handle(void* h) { return static_cast<cublasHandle_t>(h); }
cublasLtHandle_t as_lt(void* h) { return static_cast<cublasLtHandle_t>(h); }

// TESSERA_FP8_FAST_ACCUM=1: cuBLASLt's FP8 "fast accumulation" (the tensor cores' own accumulator throughout, no
// periodic promotion to f32): faster, less exact over long inner dimensions. Default off.
bool fp8_fast_accum() {
  static const bool on = [] {
    const char* v = std::getenv("TESSERA_FP8_FAST_ACCUM");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

}  // namespace

const char* gemm_precision_name(GemmPrecision p) {
  return p == GemmPrecision::kFp8 ? "fp8" : p == GemmPrecision::kW4 ? "w4" : "bf16";
}

GemmPrecision parse_gemm_precision(const std::string& name, const std::string& flag) {
  if (name == "bf16") return GemmPrecision::kBf16;
  if (name == "fp8") return GemmPrecision::kFp8;
  if (name == "w4") return GemmPrecision::kW4;
  throw Error(flag + " must be bf16, fp8 or w4, got '" + name + "'");
}

void check_gemm_precision_supported(GemmPrecision p, const std::string& flag) {
  if (p != GemmPrecision::kFp8) return;
  std::string why;
  check(fp8_tensor_cores(&why),
        flag + " fp8 needs FP8 tensor cores (compute capability 8.9 or newer); this GPU is " + why);
}

struct Gemm::LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;  // the heuristic's candidates, best first
  size_t chosen = 0;                        // the first that ran (NOT_SUPPORTED moves on to the next)
  bool out_of_place = false;                // D in Gemm's scratch, then copied to y (see linear_fp8)
  ~LtPlan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm(cudaStream_t stream) {
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  stream_ = stream;
  // The activations' scaling, read now (with the engine's DeviceFp8Weights, built beside this Gemm); a bad value
  // throws at the first FP8 call, never for bf16.
  try {
    fp8_scaling_ = static_cast<int>(fp8_scaling_from_env());
  } catch (const Error&) {
    fp8_scaling_ = -1;
  }
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
  for (auto& [key, plan] : plans_) delete plan;  // null entries: shapes without outer-vector kernels
  if (lt_handle_ != nullptr) cublasLtDestroy(as_lt(lt_handle_));
  if (act_ != nullptr) cudaFree(act_);
  if (act_work_ != nullptr) cudaFree(act_work_);
  if (act_scales_ != nullptr) cudaFree(act_scales_);
  if (one_ != nullptr) cudaFree(one_);
  if (e_scratch_ != nullptr) cudaFree(e_scratch_);
  if (d_scratch_ != nullptr) cudaFree(d_scratch_);
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

Fp8Scaling fp8_scaling_from_env() {
  const char* v = std::getenv("TESSERA_FP8_SCALING");
  if (v == nullptr || std::strcmp(v, "row") == 0) return Fp8Scaling::kRow;
  if (std::strcmp(v, "tensor") == 0) return Fp8Scaling::kTensor;
  throw Error("TESSERA_FP8_SCALING must be row or tensor, got '" + std::string(v) + "'");
}

const char* fp8_scaling_name(Fp8Scaling s) { return s == Fp8Scaling::kRow ? "row" : "tensor"; }

Fp8Scaling Gemm::fp8_scaling() {
  if (fp8_scaling_ < 0) fp8_scaling_ = static_cast<int>(fp8_scaling_from_env());  // throws the error
  return static_cast<Fp8Scaling>(fp8_scaling_);
}

uint8_t* Gemm::grow_bytes(void*& buf, size_t& have, size_t need, size_t floor) {
  if (need > have) {
    if (buf != nullptr) {
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be read
      TESSERA_CUDA_CHECK(cudaFree(buf));
      buf = nullptr;
      have = 0;
    }
    const size_t bytes = std::max(need + need / 4, floor);  // geometric growth
    TESSERA_CUDA_CHECK(cudaMalloc(&buf, bytes));
    have = bytes;
    ++generation_;
  }
  return static_cast<uint8_t*>(buf);
}

Fp8Matrix Gemm::quantize_activation(const bf16* x, int64_t ldx, int64_t m, int64_t in) {
  const Fp8Scaling scaling = fp8_scaling();
  uint8_t* codes = grow_bytes(act_, act_bytes_, static_cast<size_t>(std::max<int64_t>(m, 0) * in), size_t{1} << 20);
  if (scaling == Fp8Scaling::kRow) {
    auto* scales = reinterpret_cast<float*>(
        grow_bytes(act_scales_, act_scales_bytes_, static_cast<size_t>(std::max<int64_t>(m, 1)) * sizeof(float)));
    quantize_e4m3_rows(x, ldx, m, in, codes, scales, stream_);
    return Fp8Matrix{codes, scales, m, in, Fp8Scaling::kRow};
  }
  if (act_work_ == nullptr) TESSERA_CUDA_CHECK(cudaMalloc(&act_work_, kFp8WorkFloats * sizeof(float)));
  quantize_e4m3(x, ldx, m, in, codes, act_work_, stream_);
  return Fp8Matrix{codes, act_work_ + kFp8ScaleOffset, m, in, Fp8Scaling::kTensor};
}

Gemm::LtPlan* Gemm::lt_plan(int64_t m, int64_t out, int64_t in, DType y_type, int64_t ldy, bool accumulate,
                            bool outer) {
  const auto key = std::make_tuple(m, out, in, static_cast<int>(y_type), ldy, accumulate, outer);
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;
  const std::string shape = "FP8 GEMM [" + std::to_string(m) + " x " + std::to_string(in) + "] x [" +
                            std::to_string(out) + " x " + std::to_string(in) + "]^T" +
                            (outer ? " (per-row scales)" : "");
  if (lt_handle_ == nullptr) {
    cublasLtHandle_t h = nullptr;
    cublas_check(cublasLtCreate(&h), "cublasLtCreate");
    lt_handle_ = h;
  }
  auto plan = std::make_unique<LtPlan>();
  cublas_check(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), shape);
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), shape);
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), shape);
  const int8_t fast = fp8_fast_accum() ? 1 : 0;
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast), shape);
  if (outer) {
    // A = W: a vector of its M = out rows; B = x^T: a vector of its N = m columns (cublasLt.h, OUTER_VEC_32F).
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode),
                 shape + " (A scale mode)");
    cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode),
                 shape + " (B scale mode)");
  }
  // The scale pointers must be set before the algorithm search: cuBLASLt may otherwise pick a kernel without scaling,
  // which then refuses the scaled call (NOT_SUPPORTED). Any device float serves here; linear_fp8 sets the real ones.
  if (act_work_ == nullptr) TESSERA_CUDA_CHECK(cudaMalloc(&act_work_, kFp8WorkFloats * sizeof(float)));
  const float* placeholder = act_work_ + kFp8ScaleOffset;
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder,
                                              sizeof placeholder),
               shape + " (A scale)");
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder,
                                              sizeof placeholder),
               shape + " (B scale)");
  const cudaDataType_t yt = y_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  // A: the weights as stored, [in, out] column-major (lda = in), read transposed; B: x^T [in, m] (ldb = in).
  cublas_check(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, static_cast<uint64_t>(in),
                                          static_cast<uint64_t>(out), in),
               shape);
  cublas_check(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, static_cast<uint64_t>(in),
                                          static_cast<uint64_t>(m), in),
               shape);
  cublas_check(cublasLtMatrixLayoutCreate(&plan->c, yt, static_cast<uint64_t>(out), static_cast<uint64_t>(m), ldy),
               shape);
  cublasLtMatmulPreference_t pref = nullptr;
  cublas_check(cublasLtMatmulPreferenceCreate(&pref), shape);
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulHeuristicResult_t results[8] = {};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(as_lt(lt_handle_), plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 8,
                                        results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (outer && (st == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)) {
    plans_.emplace(key, nullptr);  // no outer-vector kernel for this shape: linear_fp8 takes the fallback
    return nullptr;
  }
  cublas_check(st, shape + " (algorithm search)");
  check(found > 0, shape + ": cuBLASLt has no FP8 algorithm for this shape (" +
                       (accumulate ? std::string("beta = 1, ") : std::string()) + "output " +
                       (y_type == DType::F32 ? "f32" : "bf16") + ")");
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->algos.push_back(results[i].algo);
  if (outer && plan->algos.empty()) {
    plans_.emplace(key, nullptr);
    return nullptr;
  }
  check(!plan->algos.empty(), shape + ": cuBLASLt's FP8 algorithms all report a failed state");
  LtPlan* raw = plan.release();
  plans_.emplace(key, raw);
  return raw;
}

bool Gemm::run_lt(LtPlan& plan, const Fp8Matrix& x, const Fp8Matrix& w, const float* sx, const float* sw, void* y,
                  DType y_type, int64_t ldy, float beta, bool may_refuse, const std::string& shape) {
  const int64_t m = x.rows, out = w.rows;
  cublas_check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw), shape);
  cublas_check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx), shape);
  const float alpha = 1.0f;
  // D = y in place (C = D), or, when no candidate takes the in-place call, D in a scratch buffer with C = y, copied
  // back to y (plan.out_of_place, remembered for the shape).
  const size_t elem = y_type == DType::F32 ? 4 : 2;
  const size_t d_bytes = static_cast<size_t>(m - 1) * static_cast<size_t>(ldy) * elem + static_cast<size_t>(out) * elem;
  for (;;) {
    void* d = plan.out_of_place ? grow_bytes(d_scratch_, d_scratch_bytes_, d_bytes) : y;
    const cublasStatus_t st =
        cublasLtMatmul(as_lt(lt_handle_), plan.desc, &alpha, w.data, plan.a, x.data, plan.b, &beta, y, plan.c, d,
                       plan.c, &plan.algos[plan.chosen], workspace_, workspace_bytes_, stream_);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED && plan.chosen + 1 < plan.algos.size()) {
      ++plan.chosen;  // the heuristic's next candidate
      continue;
    }
    if (st == CUBLAS_STATUS_NOT_SUPPORTED && !plan.out_of_place) {
      plan.out_of_place = true;  // every candidate refused C == D: try them again out of place
      plan.chosen = 0;
      continue;
    }
    if (st == CUBLAS_STATUS_NOT_SUPPORTED && may_refuse) return false;
    cublas_check(st, shape + " (cublasLtMatmul" + (plan.out_of_place ? ", out of place" : ", in place") +
                         ", candidate " + std::to_string(plan.chosen + 1) + " of " +
                         std::to_string(plan.algos.size()) + ")");
    if (plan.out_of_place)
      TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(y, static_cast<size_t>(ldy) * elem, d, static_cast<size_t>(ldy) * elem,
                                           static_cast<size_t>(out) * elem, static_cast<size_t>(m),
                                           cudaMemcpyDeviceToDevice, stream_));
    return true;
  }
}

void Gemm::linear_fp8(const Fp8Matrix& x, const Fp8Matrix& w, void* y, DType y_type, int64_t ldy, float beta) {
  const int64_t m = x.rows, in = x.cols, out = w.rows;
  if (m <= 0) return;
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const std::string shape = "FP8 GEMM [" + std::to_string(m) + " x " + std::to_string(in) + "] x [" +
                            std::to_string(out) + " x " + std::to_string(w.cols) + "]^T";
  check(w.cols == in, shape + ": inner dimensions differ");
  check(m <= kMax && out <= kMax && in <= kMax && ldy <= kMax, shape + ": dimensions exceed int");
  check(in % 16 == 0, shape + ": the inner dimension must be a multiple of 16 for FP8");
  check(y_type == DType::BF16 || y_type == DType::F32, shape + ": output must be bf16 or f32");
  check(x.scaling == w.scaling, shape + ": the activation's scales are per " + fp8_scaling_name(x.scaling) +
                                    ", the weight's per " + fp8_scaling_name(w.scaling) + " (they must match)");
  if (x.scaling == Fp8Scaling::kTensor) {
    (void)run_lt(*lt_plan(m, out, in, y_type, ldy, beta != 0.0f, false), x, w, x.scale, w.scale, y, y_type, ldy, beta,
                 false, shape);
    return;
  }
  if (!force_row_epilogue_) {
    LtPlan* plan = lt_plan(m, out, in, y_type, ldy, beta != 0.0f, true);
    if (plan != nullptr && run_lt(*plan, x, w, x.scale, w.scale, y, y_type, ldy, beta, true, shape)) {
      last_row_path_ = "outer-vector";
      return;
    }
    if (plan != nullptr) {  // every candidate refused: the fallback from now on
      plans_[std::make_tuple(m, out, in, static_cast<int>(y_type), ldy, beta != 0.0f, true)] = nullptr;
      delete plan;
    }
  }
  // The fallback: the unscaled product (unit scalar scales) into f32 [m, out], then y = sx sw d + beta y.
  if (one_ == nullptr) {
    static const float kOne = 1.0f;
    TESSERA_CUDA_CHECK(cudaMalloc(&one_, sizeof(float)));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(one_, &kOne, sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  auto* d = reinterpret_cast<float*>(
      grow_bytes(e_scratch_, e_scratch_bytes_, static_cast<size_t>(m) * static_cast<size_t>(out) * sizeof(float)));
  (void)run_lt(*lt_plan(m, out, in, DType::F32, out, false, false), x, w, one_, one_, d, DType::F32, out, 0.0f, false,
               shape + " (per-row scales in the epilogue)");
  scale_outer_e4m3(d, m, out, x.scale, w.scale, y, y_type == DType::F32, ldy, beta, stream_);
  last_row_path_ = "epilogue";
}

}  // namespace tessera::runtime::gpu
