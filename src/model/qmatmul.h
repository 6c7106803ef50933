// tessera/model/qmatmul.h — matrix products over weights kept as stored (GGUF block types), read in place.
//
//   y[m, rows] = x[m, cols] · Wᵀ      W: `rows` rows of `cols` elements, each row tensor_type_bytes(type, cols)
//                                     bytes of consecutive blocks (a GGUF tensor of shape [rows, cols] as mapped)
//
// Weight types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-element blocks), Q4_K, Q5_K, Q6_K (256-element super-blocks),
// and F32, F16, BF16. For the quantized types the activations are quantized once per call to int8 with one f32
// scale per block of the weight's activation block (32 elements for Q4_0..Q8_0, 256 for the K types:
// qmatmul_activation_block), round to nearest, scale = max|x| / 127, and each weight block is multiplied with
// integer dot products (AVX2 maddubs/madd, AVX-512 VNNI dpbusd) and scaled once per block. F32/F16/BF16 weights
// multiply f32 activations with f32 fused multiply-adds. Decode (m < 16): each weight block is read once and
// decoded once per tile of 4 x rows. Prefill (m >= 16) on AVX-512: panels of 16 weight rows decoded once and
// multiplied with every x row; elsewhere the row kernels over x blocks of <= 64 rows. docs/cpu_kernels.md has
// the design, the tests' tolerances and the measured speeds.
//
// The instruction-set path is picked at run time (CPUID): AVX-512 (F, BW, VL, DQ and VNNI) > AVX2 (+FMA, F16C) >
// the portable scalar twin. A caller (a test, a bench) may force one with the QIsa overload.
//
// Batch invariance. Row i of y depends only on x row i and W: not on m, on i's place in the call, on the thread
// count or split, nor on which kernel ran it (row kernel or panel). For the quantized types every kernel of every
// path computes, for weight row r and x row i (activation blocks b of 32, or 256 for the K types; dw, mw the weight
// block's scale and min; d, dmin a K super-block's; dx the activation block's scale; fl() one f32 rounding):
//   I_b = the exact integer sum over the block of (w code - offset) * x code, the offset (Q4_0 8, Q5_0 16) taken in
//         integers; Q8_0 signed codes; Q4_K/Q5_K sum_g sc_g * sum(u x); Q6_K sum_g sc_g * sum((u - 32) x)
//   M_b = (Q4_K/Q5_K) sum_g m_g * sum(x codes of group g), exact
//   t_b = fl(float(I_b) * fl(dw * dx))                               Q4_0, Q5_0, Q8_0
//         fl(fl(float(I_b) * fl(dw * dx)) + fl(mw * fl(dx * sum x)))  Q4_1, Q5_1
//         fl(fl(float(I_b) * fl(d * dx)) - fl(float(M_b) * fl(dmin * dx)))   Q4_K, Q5_K
//         fl(float(I_b) * fl(d * dx))                                Q6_K
//   S_k = (...((+0 + t_k) + t_{k+16}) + t_{k+32}) ...       16 slots k = 0..15, blocks b = k mod 16 ascending
//   T_k = S_k + S_{k+8} (k < 8), U_k = T_k + T_{k+4} (k < 4), V_k = U_k + U_{k+2} (k < 2), y[i, r] = V_0 + V_1
//   then (Int8Outliers) y += the picked blocks' second-level terms (the same formula on their second-level codes),
//   one at a time in ascending block order.
// (A row kernel adds 16 blocks' terms as one vector; a panel, whose lanes are 16 weight rows, runs slot by slot.)
// No fused multiply-adds in it, so the three paths give the same bits for the quantized types (tested). Float
// weight types: one accumulator of vector width per x row (16 lanes on AVX-512, 8 on AVX2, 1 scalar) over k
// ascending, the same in the row and tile kernels, then the path's fixed horizontal sum and the tail.
#pragma once

#include <cstdint>
#include <string_view>

#include "model/model_file.h"

namespace tessera {
class ThreadPool;
}

namespace tessera::model {

enum class QIsa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// How a quantized weight type's activations are rounded to integers. Int8: one int8 code per element (scale per
// activation block = max|x| / 127). Int8x2: two, x ~ d1 q1 + d2 q2, where q2 quantizes the rounding error of the
// first level with its own per-block scale (|error| <= d2 / 2 <= d1 / 508): the products are linear in x, so the
// same kernels run both levels as two x rows of one tile — each weight block is still read and decoded once, the
// integer work doubles. Float weight types ignore it (their activations stay f32).
//
// Int8Outliers: one level, plus the second level only on the blocks of a row whose scale d1 is more than
// kOutlierRatio times the median d1 of that row's blocks (|error| <= d2 / 2 <= d1 / 508 there, d1 / 2 elsewhere). The
// rounding error of a block grows with d1 squared, and on the real models' activations the ~15% of the blocks above
// 2x the median hold ~75-80% of it (docs/cpu_kernels.md, "One default for accuracy and speed"). The picked blocks'
// second levels are multiplied inside the kernels' own pass, so the extra integer work is about the picked share:
// the row kernels (decode, m < 16, and rows outside the panels) take each row's list of picked blocks after its
// blocks (the 32-block types in the same loop and accumulators; the K types one 256-block kernel call per pick), and
// the prefill panels run the picked (row, block) pairs, grouped by block column, as tiles over that column's groups
// of the panel they have already decoded, each pair's 16 outputs added to its row.
enum class QAct : int { Int8 = 0, Int8x2 = 1, Int8Outliers = 2 };
inline constexpr float kOutlierRatio = 2.0f;

// A weight matrix as stored: `data` points at rows * tensor_type_bytes(type, cols) bytes (no alignment needed).
struct QMatrix {
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  TensorType type = TensorType::F32;
  QAct act = QAct::Int8;
};

// True for the weight types above.
bool qmatmul_supported(TensorType t);
// Elements per activation-quantization block for weight type t: 32 (Q4_0..Q8_0), 256 (K types), 0 for the
// float types (activations stay f32).
int64_t qmatmul_activation_block(TensorType t);

bool qmatmul_isa_available(QIsa isa);
QIsa qmatmul_best_isa();  // the fastest path this CPU runs
std::string_view qmatmul_isa_name(QIsa isa);  // "scalar", "avx2", "avx512"

// y[i * w.rows + r] = sum_k x[i * w.cols + k] * W[r, k] for i < m, r < w.rows. Work is split over the weight
// rows (output columns) on `pool` when given (nullptr: the calling thread alone). Throws Error, naming the type,
// for a weight type not listed above, for cols not a multiple of the type's block size, or for an ISA this CPU
// lacks (the explicit overload).
void qmatmul(const QMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool = nullptr);
void qmatmul(const QMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool, QIsa isa);

}  // namespace tessera::model
