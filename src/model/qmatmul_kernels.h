// tessera/model/qmatmul_kernels.h — internal to qmatmul*.cpp: the per-ISA row kernels and the activation layout.
//
// A row kernel computes, for one weight row w (cols elements, as stored) and nx <= kMaxNx activation rows a[j],
// out[j] = dot(w, a[j]). The activations of a quantized weight type are int8 (q) with, per activation block
// (32 or 256 elements), the f32 scale d; for 32-blocks also xs = sum(q of the block) and ds = d * xs; for
// 256-blocks the int16 sums of q over each group of 16 elements (bs, 16 per block). The float types read x (f32).
//
// Every kernel of a quantized type (row kernel, panel, every ISA) computes the same f32 value for a (weight row,
// x row), in the order qmatmul.h states ("Batch invariance"): per activation block b an exact integer sum I_b (and
// M_b), one f32 term t_b from it, the terms added into slot b % 16 in ascending b from +0, the 16 slots summed by
// slot_tree, then the row's picked second-level blocks' terms added one at a time in ascending order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::model::qmm {

struct ActRow {
  const float* x = nullptr;    // f32 activations (F32/F16/BF16 weights)
  const int8_t* q = nullptr;   // int8 activations, cols of them
  const float* d = nullptr;    // per activation block: the scale
  const float* ds = nullptr;   // per 32-block: d * sum(q)
  const int32_t* xs = nullptr; // per 32-block: sum(q)
  const int16_t* bs = nullptr; // per 256-block: 16 sums of q over 16 elements each
  // QAct::Int8Outliers: the row's picked activation blocks pick[0, npick) (ascending) carry a second level, laid
  // out as this row's own arrays (level2->q + ab b, level2->d + b, ...; only the picked blocks are written). The
  // row kernels add its products over those blocks alone (the panels take it from their PanelPairs instead).
  const ActRow* level2 = nullptr;
  const int32_t* pick = nullptr;
  int64_t npick = 0;
};

// The second levels of QAct::Int8Outliers for the panels, grouped by activation block column: the pairs of column
// b are [first[b], first[b + 1]); pair p is x row xrow[p]'s second level of that block alone (act[p]: q at the
// block's first code, d / ds / bs at the block's entries, as an ActRow of ab columns). A panel adds them after its
// own tiles, on the panel it has already decoded: a tile of up to kMr pairs over the block's groups, each pair's
// 16 outputs added to its x row's.
struct PanelPairs {
  const int64_t* first = nullptr;
  const int64_t* xrow = nullptr;
  const ActRow* act = nullptr;
  int64_t ab = 0;
};

constexpr int kMaxNx = 4;

// The slots of qmatmul.h's order: block b's term goes to slot b % kSlots; the slots are summed by slot_tree, the
// pairing of a 16-lane horizontal sum (lane k + lane k + 8, then k + 4, k + 2, k + 1; a panel's vertical adds make
// the same one).
constexpr int kSlots = 16;
inline float slot_tree(const float* s) {
  float t[8], u[4];
  for (int k = 0; k < 8; ++k) t[k] = s[k] + s[k + 8];
  for (int k = 0; k < 4; ++k) u[k] = t[k] + t[k + 4];
  const float v0 = u[0] + u[2], v1 = u[1] + u[3];
  return v0 + v1;
}

// Int8Outliers on the K types, after a row kernel K over rows a[0, nx): each picked 256-block's second level through
// K on that block alone, added to out[j] (the 32-block kernels take their picks inside their own pass; K types have
// kPickBlockBytes, the bytes of one stored 256-block). Both instruction-set files instantiate it with their kernels.
template <class K>
void add_k_type_picks(const uint8_t* w, const ActRow* a, int nx, float* out) {
  if constexpr (requires { K::kPickBlockBytes; }) {
    for (int j = 0; j < nx; ++j) {
      const ActRow* l = a[j].level2;
      for (int64_t p = 0; p < a[j].npick; ++p) {
        const int64_t b = a[j].pick[p];
        ActRow sub;
        sub.q = l->q + 256 * b;
        sub.d = l->d + b;
        sub.bs = l->bs + 16 * b;
        float o;  // = the block's term t_b (0 + t_b)
        K::template run<1>(w + b * K::kPickBlockBytes, 256, &sub, &o);
        out[j] += o;
      }
    }
  }
}

// The 32-element block types (quant.h) as the row kernels read them, for the scalar twin and the SIMD kernels alike:
// bytes per block; kMin, the block carries a min (Q4_1, Q5_1: w = d * q + m); kOffset, taken off the unsigned codes
// (Q4_0: 8, Q5_0: 16; Q8_0's codes are signed); kFive, a fifth bit per code (Q5_0, Q5_1).
template <int Bytes, bool Min, int Offset, bool Five>
struct LegacyBlock {
  static constexpr int kBytes = Bytes;
  static constexpr bool kMin = Min;
  static constexpr float kOffset = static_cast<float>(Offset);
  static constexpr bool kFive = Five;
};
using Q4_0Block = LegacyBlock<18, false, 8, false>;
using Q4_1Block = LegacyBlock<20, true, 0, false>;
using Q5_0Block = LegacyBlock<22, false, 16, true>;
using Q5_1Block = LegacyBlock<24, true, 0, true>;
using Q8_0Block = LegacyBlock<34, false, 0, false>;

using RowKernel = void (*)(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out);

// A tile kernel multiplies tile_rows weight rows (row r at w + r * row_bytes) with nx activation rows, sharing each
// load of either among the others (register blocking): out[r * kMaxNx + j] = dot(row r, a[j]). The float types
// have one on the SIMD paths (prefill of f32/f16/bf16 weights is otherwise bound by L2 bandwidth).
using TileKernel = void (*)(const uint8_t* w, size_t row_bytes, int64_t cols, const ActRow* a, int nx, float* out);

// A panel GEMM (prefill of the quantized types): kPanelRows consecutive weight rows (row r at w + r * row_bytes)
// times all m activation rows: y[i * y_stride + r] for i < m, r < kPanelRows. The rows are decoded once into an
// interleaved panel of unsigned bytes (4 consecutive elements of each of the 16 rows per 64-byte vector) with a
// float scale and offset per group of 16 or 32 elements; the x rows then multiply it as outer products (each
// int32 lane of a dot-product instruction is one weight row), so the per-group float work is shared by 16 rows.
using PanelGemm = void (*)(const uint8_t* w, size_t row_bytes, int64_t cols, const ActRow* a, int64_t m, float* y,
                           int64_t y_stride, const PanelPairs* pairs);  // pairs: nullptr, none
constexpr int kPanelRows = 16;
constexpr int64_t kPanelMinM = 16;  // fewer x rows: the row kernels (decoding the panel would not pay)

struct Kernels {
  RowKernel f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k;
  TileKernel f32_tile, f16_tile, bf16_tile;  // nullptr: none
  int tile_rows;                             // divides kTileAlign
  PanelGemm q4_0_gemm, q4_1_gemm, q5_0_gemm, q5_1_gemm, q8_0_gemm, q4_k_gemm, q5_k_gemm, q6_k_gemm;  // nullptr: none
};

constexpr int kTileAlign = 48;  // thread ranges start at multiples of this (of tile_rows and kPanelRows), so tiles
                                // and panels fall on the same rows however the rows are split: results do not
                                // depend on the thread count

const Kernels& scalar_kernels();
const Kernels* avx2_kernels();    // nullptr when not compiled for x86-64
const Kernels* avx512_kernels();  // nullptr when not compiled for x86-64

}  // namespace tessera::model::qmm
