// tessera/runtime/cuda/gemm.h — the matrix products of the GPU forward pass, through cuBLAS.
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
// with f32 scales on the device (Fp8Matrix), through cuBLASLt (the same TN layout: FP8 tensor cores need it), f32
// accumulation, bf16 or f32 y, beta as above (C = D = y). Weights are quantized once (DeviceFp8Weights in
// device_model.h), activations per call by quantize_activation (dynamic scales, fp8_quant.h), which several products
// of the same input share (Q, K and V). Scales (core/fp8.h Fp8Scaling), both operands alike:
//   - kRow, the default: one per output channel of W and one per token of x, y[r, o] = sx[r] sw[o] (q_x[r] . q_w[o]),
//     through cuBLASLt's outer-vector scaling (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, cuBLAS 12.9+ on Hopper: A
//     = W gets the vector of its M = out rows, B = x^T the vector of its N = m columns). Where the library has no
//     such kernel for a shape (no heuristic result, or every candidate refuses), the product runs per-tensor-scaled
//     with unit scales into an f32 scratch ([m, out], 4 bytes each) and scale_outer_e4m3 applies sx sw and beta (an
//     extra pass over y: 1.6x the outer-vector time on an H200, docs/PERF.md "FP8 with per-row scales");
//   - kTensor: one scale per matrix (scalar scale pointers), the coarser baseline: TESSERA_FP8_SCALING=tensor in the
//     environment selects it for every engine built afterwards (fp8_scaling_from_env).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "core/dtype.h"
#include "core/fp8.h"

namespace tessera::runtime::gpu {

// The precision of the forward pass's GEMMs (the LM head stays bf16 in both).
enum class GemmPrecision {
  kBf16,  // bf16 x bf16 (cuBLAS), the default
  kFp8,   // E4M3 x E4M3 (cuBLASLt): W8A8, weights quantized once, activations per call; per-row scales by default
  // Weight-only 4-bit for the decode step (DeviceW4Weights, w4_gemv.h): products of up to kW4Rows rows read the 4-bit
  // copy (bf16 activations, f32 sums); prefill and larger products stay bf16 x bf16 (cuBLAS), the bf16 weights kept.
  kW4,
};
const char* gemm_precision_name(GemmPrecision p);  // "bf16", "fp8", "w4"
// "bf16", "fp8" or "w4"; throws tessera::Error "<flag> must be bf16, fp8 or w4, got '<name>'" otherwise.
GemmPrecision parse_gemm_precision(const std::string& name, const std::string& flag = "--gemm");
// Throws tessera::Error "<flag> fp8 needs FP8 tensor cores (compute capability 8.9 or newer); this GPU is <name>,
// compute capability X.Y" when the current device has none; nothing for bf16 and w4.
void check_gemm_precision_supported(GemmPrecision p, const std::string& flag = "--gemm");

// The FP8 scale granularity of engines built now: Fp8Scaling::kRow, or kTensor when the environment has
// TESSERA_FP8_SCALING=tensor ("row" or unset: kRow). Throws tessera::Error "TESSERA_FP8_SCALING must be row or
// tensor, got '<value>'" otherwise. Read at every call: a GpuEngine reads it once, when it is made.
Fp8Scaling fp8_scaling_from_env();
const char* fp8_scaling_name(Fp8Scaling s);  // "row", "tensor"

// A row-major E4M3 matrix [rows, cols] (contiguous) on the device and its scales (f32 on the device): one (kTensor)
// or one per row (kRow: `rows` floats, 16-byte aligned); the value of element (r, c) is scale[r or 0] * code.
struct Fp8Matrix {
  const uint8_t* data = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0, cols = 0;
  Fp8Scaling scaling = Fp8Scaling::kTensor;
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

  // Quantizes x [m, in] (rows ldx apart; in and ldx multiples of 16) to E4M3 with dynamic scales of fp8_scaling()
  // (per token, or per tensor) into this Gemm's activation buffers (grown as needed): the result is valid, in stream
  // order, until the next call.
  Fp8Matrix quantize_activation(const bf16* x, int64_t ldx, int64_t m, int64_t in);
  // y[m, out] = x[m, in] · w[out, in]^T (+ beta · y), x from quantize_activation, w from DeviceFp8Weights, both with
  // the same scaling (throws tessera::Error otherwise).
  void linear_fp8(const Fp8Matrix& x, const Fp8Matrix& w, void* y, DType y_type, int64_t ldy, float beta = 0.0f);

  // The activations' scale granularity: set_fp8_scaling's, else fp8_scaling_from_env() as it was when this Gemm was
  // made (the engine quantizes its weights at the same time; a bad value throws here, at the first FP8 call).
  Fp8Scaling fp8_scaling();
  void set_fp8_scaling(Fp8Scaling s) { fp8_scaling_ = static_cast<int>(s); }
  // Per-row products through the fallback (unit-scaled GEMM into f32, then scale_outer_e4m3) even where cuBLASLt has
  // outer-vector scaling: for the tests and the benchmark. Default off.
  void set_fp8_row_epilogue(bool on) { force_row_epilogue_ = on; }
  // How the last per-row product ran: "outer-vector" (cuBLASLt) or "epilogue" (the fallback); "" before any.
  const char* last_fp8_row_path() const { return last_row_path_; }

  size_t workspace_bytes() const { return workspace_bytes_ + act_bytes_ + act_scales_bytes_ + e_scratch_bytes_; }
  // Counts the scratch buffers' reallocations (FP8 activations, scales, f32 outputs): a CUDA graph captured before a
  // change holds freed addresses (the batched decode drops its graphs then).
  int64_t buffer_generation() const { return generation_; }

 private:
  struct LtPlan;  // a cuBLASLt descriptor set and algorithm for one shape (gemm.cpp)
  // outer: outer-vector scales (kRow); then null when cuBLASLt offers no algorithm (the caller falls back).
  LtPlan* lt_plan(int64_t m, int64_t out, int64_t in, DType y_type, int64_t ldy, bool accumulate, bool outer);
  // One cuBLASLt call through `plan` (its candidates in order, then out of place); false when every candidate refused
  // and `may_refuse` (else throws).
  bool run_lt(LtPlan& plan, const Fp8Matrix& x, const Fp8Matrix& w, const float* sx, const float* sw, void* y,
              DType y_type, int64_t ldy, float beta, bool may_refuse, const std::string& shape);
  // Stream-ordered regrowth of a scratch buffer: at least `need` bytes (need * 1.25, `floor` at least) when it grows.
  uint8_t* grow_bytes(void*& buf, size_t& have, size_t need, size_t floor = size_t{1} << 16);

  int64_t generation_ = 0;
  void* handle_ = nullptr;  // cublasHandle_t
  void* lt_handle_ = nullptr;  // cublasLtHandle_t, created on the first FP8 call
  cudaStream_t stream_ = nullptr;
  void* act_ = nullptr;  // quantize_activation's buffer (FP8 codes)
  size_t act_bytes_ = 0;
  float* act_work_ = nullptr;  // its amax and scale (fp8_quant.h kFp8WorkFloats)
  float* one_ = nullptr;  // 1.0f on the device: the unit scales of the fallback's GEMM
  void* e_scratch_ = nullptr;  // the fallback's unscaled f32 product [m, out]
  size_t e_scratch_bytes_ = 0;
  void* act_scales_ = nullptr;  // per-row scales of the activation (float)
  size_t act_scales_bytes_ = 0;
  int fp8_scaling_ = -1;  // Fp8Scaling, -1: not chosen yet
  bool force_row_epilogue_ = false;
  const char* last_row_path_ = "";
  void* d_scratch_ = nullptr;  // linear_fp8's out-of-place D, when cuBLASLt refuses C == D
  size_t d_scratch_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int64_t, bool, bool>, LtPlan*> plans_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace tessera::runtime::gpu
