// qmatmul: activation quantization, the row/thread tiling, run-time ISA dispatch, and the portable scalar twin
// of every row kernel (qmatmul_avx2.cpp and qmatmul_avx512.cpp hold the SIMD ones). Block layouts: quant.h.
#include "model/qmatmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/enum_names.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/qmatmul_kernels.h"

namespace tessera::model {

namespace {

using qmm::ActRow;
using qmm::Kernels;
using qmm::RowKernel;
using qmm::TileKernel;
using qmm::PanelGemm;

float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(f16::from_bits(h));
}

float bf16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return bf16_to_f32(bf16::from_bits(h));
}

float f32_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- the scalar twin ---------------------------------------------------------------------------------------
// Each computes, per weight block, the same integer sums and the same f32 term as the SIMD kernels, added in the
// same order (qmatmul.h, "Batch invariance"): the quantized types give the same bits on every path.

template <float (*Load)(const uint8_t*), int Size>
void scalar_float(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  for (int j = 0; j < nx; ++j) {
    float acc = 0.0f;
    for (int64_t i = 0; i < cols; ++i) acc += Load(w + Size * i) * a[j].x[i];
    out[j] = acc;
  }
}

// Unpacks a 32-block's weights to q[32] (unsigned for Q4/Q5, signed for Q8_0) and its scale and min.
template <class B>
void legacy_unpack(const uint8_t* b, int* q, float* d, float* m) {
  *d = f16_at(b);
  *m = 0.0f;
  if constexpr (std::is_same_v<B, qmm::Q8_0Block>) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
    return;
  } else {
    const bool has_min = B::kMin;
    const bool five = B::kFive;
    if (has_min) *m = f16_at(b + 2);
    const uint8_t* p = b + (has_min ? 4 : 2);
    uint32_t qh = 0;
    if (five) {
      std::memcpy(&qh, p, 4);
      p += 4;
    }
    for (int i = 0; i < 16; ++i) {
      q[i] = p[i] & 15;
      q[i + 16] = p[i] >> 4;
    }
    if (five)
      for (int i = 0; i < 32; ++i) q[i] |= static_cast<int>((qh >> i) & 1u) << 4;
  }
}

// out = the slot sums of t_b = (I_b * (dw * dx)) [+ mw * ds_b], I_b = sum (q - offset) x (qmatmul.h)
template <class B>
void scalar_legacy(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  const int64_t nb = cols / 32;
  constexpr auto offset = static_cast<int32_t>(B::kOffset);
  for (int j = 0; j < nx; ++j) {
    float acc[qmm::kSlots] = {};
    for (int64_t b = 0; b < nb; ++b) {
      int q[32];
      float d, m;
      legacy_unpack<B>(w + b * static_cast<size_t>(B::kBytes), q, &d, &m);
      const int8_t* x = a[j].q + 32 * b;
      int32_t isum = 0;
      for (int i = 0; i < 32; ++i) isum += q[i] * x[i];
      isum -= offset * a[j].xs[b];
      float t = static_cast<float>(isum) * (d * a[j].d[b]);
      if constexpr (B::kMin) t = t + m * a[j].ds[b];
      acc[b % qmm::kSlots] = acc[b % qmm::kSlots] + t;
    }
    out[j] = qmm::slot_tree(acc);
  }
}

// Q4_K / Q5_K scale and min of group g (6 bits each), the packing described in quant.cpp.
void k_scale_min(const uint8_t* s, int g, int* scale, int* min) {
  if (g < 4) {
    *scale = s[g] & 63;
    *min = s[g + 4] & 63;
  } else {
    *scale = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
    *min = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// out = the slot sums of t_sb = I * (d * dx) - M * (dmin * dx), I = sum_g sc_g * isum_g, M = sum_g m_g * xsum_g
template <bool Five>
void scalar_q45k(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  const int64_t nsb = cols / 256;
  const size_t bytes = Five ? 176 : 144;
  for (int j = 0; j < nx; ++j) {
    float acc[qmm::kSlots] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * bytes;
      const float d = f16_at(b), dmin = f16_at(b + 2);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (Five ? 48 : 16);
      const int8_t* x = a[j].q + 256 * sb;
      const int16_t* bs = a[j].bs + 16 * sb;
      int32_t isum = 0, msum = 0;
      for (int g = 0; g < 8; ++g) {
        int sc, mn;
        k_scale_min(b + 4, g, &sc, &mn);
        const int c = g / 2, shift = 4 * (g % 2);
        int32_t gs = 0;
        for (int l = 0; l < 32; ++l) {
          int q = (qs[32 * c + l] >> shift) & 15;
          if (Five) q |= ((qh[l] >> g) & 1) << 4;
          gs += q * x[32 * g + l];
        }
        isum += sc * gs;
        msum += mn * (bs[2 * g] + bs[2 * g + 1]);
      }
      const float dx = a[j].d[sb];
      acc[sb % qmm::kSlots] =
          acc[sb % qmm::kSlots] + (static_cast<float>(isum) * (d * dx) - static_cast<float>(msum) * (dmin * dx));
    }
    out[j] = qmm::slot_tree(acc);
  }
}

// out = the slot sums of t_sb = I * (d * dx), I = sum_g sc_g * (isum_g - 32 * xsum_g), groups of 16
void scalar_q6k(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  const int64_t nsb = cols / 256;
  for (int j = 0; j < nx; ++j) {
    float acc[qmm::kSlots] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + sb * 210;
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16_at(b + 208);
      const int8_t* x = a[j].q + 256 * sb;
      const int16_t* bs = a[j].bs + 16 * sb;
      int32_t isum = 0;
      for (int e0 = 0; e0 < 256; e0 += 16) {
        const int half = e0 / 128, s = (e0 % 128) / 32, l0 = e0 % 32;
        int32_t gs = 0;
        for (int l = l0; l < l0 + 16; ++l) {
          const int q = ((ql[64 * half + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 15) |
                        (((qh[32 * half + l] >> (2 * s)) & 3) << 4);
          gs += q * x[128 * half + 32 * s + l];
        }
        isum += sc[e0 / 16] * (gs - 32 * bs[e0 / 16]);
      }
      acc[sb % qmm::kSlots] = acc[sb % qmm::kSlots] + static_cast<float>(isum) * (d * a[j].d[sb]);
    }
    out[j] = qmm::slot_tree(acc);
  }
}

// QAct::Int8Outliers in the scalar twin: the row's picked blocks' second levels (ActRow::pick), each through the
// kernel on that block alone, added to its output.
template <RowKernel F, int64_t Ab, int64_t Bytes>
void scalar_picked(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  F(w, cols, a, nx, out);
  for (int j = 0; j < nx; ++j) {
    const ActRow* l = a[j].level2;
    for (int64_t p = 0; p < a[j].npick; ++p) {
      const int64_t b = a[j].pick[p];
      ActRow sub;
      sub.q = l->q + Ab * b;
      sub.d = l->d + b;
      sub.ds = Ab == 32 ? l->ds + b : nullptr;
      sub.xs = Ab == 32 ? l->xs + b : nullptr;
      sub.bs = Ab == 256 ? l->bs + 16 * b : nullptr;
      float o;
      F(w + b * Bytes, Ab, &sub, 1, &o);
      out[j] += o;
    }
  }
}
template <class B>
constexpr RowKernel kScalarLegacy = scalar_picked<scalar_legacy<B>, 32, B::kBytes>;

const Kernels kScalar = {
    scalar_float<f32_at, 4>,       scalar_float<f16_at, 2>,       scalar_float<bf16_at, 2>,
    kScalarLegacy<qmm::Q4_0Block>, kScalarLegacy<qmm::Q4_1Block>, kScalarLegacy<qmm::Q5_0Block>,
    kScalarLegacy<qmm::Q5_1Block>, kScalarLegacy<qmm::Q8_0Block>, scalar_picked<scalar_q45k<false>, 256, 144>,
    scalar_picked<scalar_q45k<true>, 256, 176>, scalar_picked<scalar_q6k, 256, 210>,
    nullptr,                       nullptr,                       nullptr,
    0,
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
};

// What each supported weight type runs, as members of a Kernels table (the row kernel; the float types' tile
// kernel, the quantized types' panel GEMM, nullptr where the type has none) and the block of its int8 activations
// (0: the float types read f32): the one place that maps a type to its kernels.
struct TypeKernels {
  TensorType type;
  RowKernel Kernels::*row;
  TileKernel Kernels::*tile;
  PanelGemm Kernels::*gemm;
  int64_t act_block;
};
constexpr TypeKernels kTypeKernels[] = {
    {TensorType::F32, &Kernels::f32, &Kernels::f32_tile, nullptr, 0},
    {TensorType::F16, &Kernels::f16, &Kernels::f16_tile, nullptr, 0},
    {TensorType::BF16, &Kernels::bf16, &Kernels::bf16_tile, nullptr, 0},
    {TensorType::Q4_0, &Kernels::q4_0, nullptr, &Kernels::q4_0_gemm, 32},
    {TensorType::Q4_1, &Kernels::q4_1, nullptr, &Kernels::q4_1_gemm, 32},
    {TensorType::Q5_0, &Kernels::q5_0, nullptr, &Kernels::q5_0_gemm, 32},
    {TensorType::Q5_1, &Kernels::q5_1, nullptr, &Kernels::q5_1_gemm, 32},
    {TensorType::Q8_0, &Kernels::q8_0, nullptr, &Kernels::q8_0_gemm, 32},
    {TensorType::Q4_K, &Kernels::q4_k, nullptr, &Kernels::q4_k_gemm, 256},
    {TensorType::Q5_K, &Kernels::q5_k, nullptr, &Kernels::q5_k_gemm, 256},
    {TensorType::Q6_K, &Kernels::q6_k, nullptr, &Kernels::q6_k_gemm, 256},
};

// nullptr for a type qmatmul does not run.
const TypeKernels* type_kernels(TensorType t) {
  for (const TypeKernels& e : kTypeKernels) {
    if (e.type == t) return &e;
  }
  return nullptr;
}

// ---- activations -------------------------------------------------------------------------------------------

// Round to nearest (ties to even) for |v| < 2^22, branch-free so that the loop vectorizes.
inline float round_nearest(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// One block of AB (32 or 256) elements: d = max|x| / 127 and q = round(x / d) in [-127, 127]; for 32-blocks
// *xs = sum(q) and *ds = d * sum(q), for 256-blocks bs[0, 16) the sums of q over each 16 elements. Fixed-size loops, so that the
// compiler vectorizes them (the maximum in 8 lanes: the same value in any order).
template <int AB>
void quantize_block(const float* xb, int8_t* qb, float* d, float* ds, int32_t* xs, int16_t* bs) {
  float lane[8] = {};
  for (int i = 0; i < AB; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] = std::max(lane[k], std::fabs(xb[i + k]));
  float amax = 0.0f;
  for (const float v : lane) amax = std::max(amax, v);
  const float dd = amax / 127.0f;
  const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
  // The sums from the rounded values in registers (exact: integers below 2^24), not from the bytes just stored
  // (a wide load of narrower stores waits for them).
  int32_t gs[AB / 16] = {};
  for (int g = 0; g < AB / 16; ++g) {
    for (int i = 16 * g; i < 16 * g + 16; ++i) {
      float r = round_nearest(xb[i] * id);
      r = r >= -127.0f && r <= 127.0f ? r : 0.0f;  // also NaN (and inf * 0) -> 0
      const auto v = static_cast<int32_t>(r);
      qb[i] = static_cast<int8_t>(v);
      gs[g] += v;
    }
  }
  if constexpr (AB == 32) {
    *xs = gs[0] + gs[1];
    *ds = dd * static_cast<float>(gs[0] + gs[1]);
  } else {
    for (int g = 0; g < 16; ++g) bs[g] = static_cast<int16_t>(gs[g]);
  }
  *d = dd;
}

// One row: per block of `ab` elements (32 or 256), quantize_block.
void quantize_row_act(const float* x, int64_t cols, int64_t ab, int8_t* q, float* d, float* ds, int32_t* xs,
                      int16_t* bs) {
  const int64_t nb = cols / ab;
  for (int64_t b = 0; b < nb; ++b) {
    if (ab == 32) quantize_block<32>(x + 32 * b, q + 32 * b, d + b, ds + b, xs + b, nullptr);
    else quantize_block<256>(x + 256 * b, q + 256 * b, d + b, nullptr, nullptr, bs + 16 * b);
  }
}

// The second level of one block: its first level's rounding error e = x - d1 q1 (NaN, inf: 0), quantized as above.
template <int AB>
void quantize_error_block(const float* xb, const int8_t* q1, float d1, int8_t* q2, float* d2, float* ds2, int32_t* xs2,
                          int16_t* bs2) {
  float e[AB];
  for (int k = 0; k < AB; ++k) {
    const float v = xb[k] - d1 * static_cast<float>(q1[k]);
    e[k] = std::fabs(v) <= std::numeric_limits<float>::max() ? v : 0.0f;
  }
  quantize_block<AB>(e, q2, d2, ds2, xs2, bs2);
}

// Splits [0, n) into at most 4 * pool size pieces of at least `grain` (the runtime's parallel_ranges), each
// starting at a multiple of `align`.
template <class Fn>
void parallel_ranges(ThreadPool* pool, int64_t n, int64_t grain, const Fn& fn, int64_t align = 1) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t pieces = pool == nullptr ? 1 : std::min<int64_t>((n + grain - 1) / grain, 4 * int64_t{pool->size()});
  if (pieces <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t step = ((n + pieces - 1) / pieces + align - 1) / align * align;
  pool->parallel_for(pieces, [&](int64_t i, int) {
    const int64_t b = i * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  });
}

constexpr int64_t kMinParallelBytes = 256 << 10;  // weight bytes x rows of x below which one thread does it all

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> xs;
  std::vector<int16_t> bs;
  std::vector<ActRow> rows;
  std::vector<float> y;  // Int8x2: the two levels' products, 2 m rows
  // Int8Outliers: row i's picked blocks pick[i nb, i nb + npick) and their second levels, laid out as the first
  // level's arrays (q2[i cols + ab b], d2[i nb + b], ds2[i nb + b] or bs2[16 (i nb + b)]; only picked blocks
  // written), level2[i] their ActRow. For the panels the same pairs (row, block) grouped by block column:
  // pair_first[b], pair_row[p], pair_act[p] (qmm::PanelPairs), their codes and scales copied in pair order
  // (pair_q, pair_d, pair_ds / pair_bs): the panels then read them in sequence, not one line per pair from m rows.
  std::vector<int8_t> q2, pair_q;
  std::vector<float> d2, ds2, pair_d, pair_ds;
  std::vector<int32_t> xs2, pair_xs;
  std::vector<int16_t> bs2, pair_bs;
  std::vector<int32_t> pick;
  std::vector<ActRow> level2;
  std::vector<int64_t> pair_first, pair_row;
  std::vector<ActRow> pair_act;
};

// Runs the kernels of w's type over m activation rows `acts` (quantized, or f32 for the float types) into
// y[m, rows]: the tiling below. pairs (Int8Outliers, nullptr: none) go to the panels; the row kernels read the
// rows' own picks.
void qmatmul_rows(const QMatrix& w, const Kernels* kernels, const ActRow* acts, int64_t m, float* y, ThreadPool* pool,
                  const qmm::PanelPairs* pairs);

// Int8Outliers, for x row i (its first level in s at row i): picks the blocks whose scale exceeds kOutlierRatio x
// the row's median (the upper median for an even count) and quantizes their rounding error x - d q as the second
// level (s.q2 ...); sorted: scratch of cols / ab floats.
void pick_outliers(const float* xr, int64_t i, int64_t cols, int64_t ab, Scratch& s, float* sorted);

const Kernels* kernels_for(QIsa isa) {
  switch (isa) {
    case QIsa::Scalar:
      return &kScalar;
    case QIsa::Avx2:
      return qmatmul_isa_available(QIsa::Avx2) ? qmm::avx2_kernels() : nullptr;
    case QIsa::Avx512:
      return qmatmul_isa_available(QIsa::Avx512) ? qmm::avx512_kernels() : nullptr;
  }
  return nullptr;
}

}  // namespace

const Kernels& qmm::scalar_kernels() {
  return kScalar;
}

bool qmatmul_supported(TensorType t) {
  return type_kernels(t) != nullptr;
}

int64_t qmatmul_activation_block(TensorType t) {
  const TypeKernels* e = type_kernels(t);
  return e != nullptr ? e->act_block : 0;
}

bool qmatmul_isa_available(QIsa isa) {
  switch (isa) {
    case QIsa::Scalar:
      return true;
    case QIsa::Avx2: {
#if defined(__x86_64__) || defined(_M_X64)
      static const bool has = qmm::avx2_kernels() != nullptr && __builtin_cpu_supports("avx2") &&
                              __builtin_cpu_supports("fma") && cpu_has_f16c();
      return has;
#else
      return false;
#endif
    }
    case QIsa::Avx512: {
#if defined(__x86_64__) || defined(_M_X64)
      static const bool has = qmm::avx512_kernels() != nullptr && qmatmul_isa_available(QIsa::Avx2) &&
                              __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                              __builtin_cpu_supports("avx512vnni");
      return has;
#else
      return false;
#endif
    }
  }
  return false;
}

QIsa qmatmul_best_isa() {
  static const QIsa best = qmatmul_isa_available(QIsa::Avx512) ? QIsa::Avx512
                           : qmatmul_isa_available(QIsa::Avx2) ? QIsa::Avx2
                                                               : QIsa::Scalar;
  return best;
}

std::string_view qmatmul_isa_name(QIsa isa) {
  static constexpr std::string_view kNames[] = {"scalar", "avx2", "avx512"};  // in QIsa's order (core/enum_names.h)
  return enum_name(kNames, isa);
}

void qmatmul(const QMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool) {
  qmatmul(w, x, m, y, pool, qmatmul_best_isa());
}

void qmatmul(const QMatrix& w, const float* x, int64_t m, float* y, ThreadPool* pool, QIsa isa) {
  if (!qmatmul_supported(w.type)) {
    throw Error("qmatmul: weight type " + std::string(tensor_type_name(w.type)) + " (" +
                std::to_string(static_cast<uint32_t>(w.type)) +
                ") is not supported (supported: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K)");
  }
  const auto bsize = static_cast<int64_t>(tensor_type_block_size(w.type));
  if (w.rows < 0 || w.cols < 0 || m < 0 || w.cols % bsize != 0) {
    throw Error("qmatmul: a " + std::string(tensor_type_name(w.type)) + " matrix of " + std::to_string(w.rows) +
                " x " + std::to_string(w.cols) + " (m = " + std::to_string(m) +
                "): cols must be a whole number of blocks of " + std::to_string(bsize));
  }
  const Kernels* kernels = kernels_for(isa);
  if (kernels == nullptr) {
    throw Error("qmatmul: the " + std::string(qmatmul_isa_name(isa)) + " path is not available on this CPU");
  }
  if (m == 0 || w.rows == 0) return;
  const int64_t cols = w.cols, rows = w.rows;
  if (cols == 0) {
    std::fill(y, y + m * rows, 0.0f);
    return;
  }
  // Activations: quantized once per call (the float types read x as is). Int8x2 gives each x row two int8 rows
  // (the value, then its rounding error), adjacent so that one tile holds both: the kernels run over
  // mq = 2 m rows into a scratch output, and the two levels' products are added at the end.
  thread_local Scratch tls;
  Scratch& s = tls;  // the workers below see the caller's buffers, not their own thread_local ones
  const int64_t ab = qmatmul_activation_block(w.type);
  const bool outliers = ab > 0 && w.act == QAct::Int8Outliers;
  const int levels = ab > 0 && w.act == QAct::Int8x2 ? 2 : 1;
  const int64_t mq = m * levels;
  s.rows.assign(static_cast<size_t>(mq), ActRow{});
  const PanelGemm gemm = m >= qmm::kPanelMinM && type_kernels(w.type)->gemm != nullptr
                             ? kernels->*(type_kernels(w.type)->gemm)
                             : nullptr;
  const bool panel_pairs = outliers && gemm != nullptr;
  qmm::PanelPairs pairs;
  if (ab == 0) {
    for (int64_t i = 0; i < m; ++i) s.rows[static_cast<size_t>(i)].x = x + i * cols;
  } else {
    const int64_t nb = cols / ab;
    s.q.resize(static_cast<size_t>(mq * cols));
    s.d.resize(static_cast<size_t>(mq * nb));
    s.ds.resize(ab == 32 ? static_cast<size_t>(mq * nb) : 0);
    s.xs.resize(ab == 32 ? static_cast<size_t>(mq * nb) : 0);
    s.bs.resize(ab == 256 ? static_cast<size_t>(mq * nb * 16) : 0);
    if (outliers) {
      s.q2.resize(static_cast<size_t>(m * cols));
      s.d2.resize(static_cast<size_t>(m * nb));
      s.ds2.resize(ab == 32 ? static_cast<size_t>(m * nb) : 0);
      s.xs2.resize(ab == 32 ? static_cast<size_t>(m * nb) : 0);
      s.bs2.resize(ab == 256 ? static_cast<size_t>(m * nb * 16) : 0);
      s.pick.resize(static_cast<size_t>(m * nb));
      s.level2.assign(static_cast<size_t>(m), ActRow{});
    }
    for (int64_t i = 0; i < mq; ++i) {
      ActRow& r = s.rows[static_cast<size_t>(i)];
      r.q = s.q.data() + i * cols;
      r.d = s.d.data() + i * nb;
      r.ds = ab == 32 ? s.ds.data() + i * nb : nullptr;
      r.xs = ab == 32 ? s.xs.data() + i * nb : nullptr;
      r.bs = ab == 256 ? s.bs.data() + i * nb * 16 : nullptr;
      if (outliers) {
        ActRow& l = s.level2[static_cast<size_t>(i)];
        l.q = s.q2.data() + i * cols;
        l.d = s.d2.data() + i * nb;
        l.ds = ab == 32 ? s.ds2.data() + i * nb : nullptr;
        l.xs = ab == 32 ? s.xs2.data() + i * nb : nullptr;
        l.bs = ab == 256 ? s.bs2.data() + i * nb * 16 : nullptr;
        r.level2 = &l;
        r.pick = s.pick.data() + i * nb;
      }
    }
    const auto quantize = [&](const float* xr, int64_t i) {
      quantize_row_act(xr, cols, ab, s.q.data() + i * cols, s.d.data() + i * nb,
                       ab == 32 ? s.ds.data() + i * nb : nullptr, ab == 32 ? s.xs.data() + i * nb : nullptr,
                       ab == 256 ? s.bs.data() + i * nb * 16 : nullptr);
    };
    parallel_ranges(pool, m, std::max<int64_t>(1, 65536 / cols), [&](int64_t b, int64_t e) {
      std::vector<float> err(levels == 2 ? static_cast<size_t>(cols) : 0);
      std::vector<float> sorted(outliers ? static_cast<size_t>(nb) : 0);
      for (int64_t i = b; i < e; ++i) {
        const float* xr = x + i * cols;
        quantize(xr, i * levels);
        if (outliers) pick_outliers(xr, i, cols, ab, s, sorted.data());
        if (levels == 2) {  // the first level's rounding error x - d q, quantized as the second level
          const int8_t* q = s.q.data() + i * levels * cols;
          const float* d = s.d.data() + i * levels * nb;
          for (int64_t b0 = 0; b0 < nb; ++b0) {
            const float db = d[b0];
            for (int64_t k = b0 * ab; k < (b0 + 1) * ab; ++k) {
              const float v = xr[k] - db * static_cast<float>(q[k]);
              err[static_cast<size_t>(k)] = std::fabs(v) <= std::numeric_limits<float>::max() ? v : 0.0f;  // NaN, inf: 0
            }
          }
          quantize(err.data(), i * levels + 1);
        }
      }
    });
    if (panel_pairs) {  // the pairs grouped by block column, rows ascending within a column
      s.pair_first.assign(static_cast<size_t>(nb + 1), 0);
      for (int64_t i = 0; i < m; ++i) {
        const ActRow& r = s.rows[static_cast<size_t>(i)];
        for (int64_t p = 0; p < r.npick; ++p) ++s.pair_first[static_cast<size_t>(r.pick[p] + 1)];
      }
      for (int64_t b = 0; b < nb; ++b) s.pair_first[static_cast<size_t>(b + 1)] += s.pair_first[static_cast<size_t>(b)];
      const int64_t np = s.pair_first[static_cast<size_t>(nb)];
      s.pair_row.resize(static_cast<size_t>(np));
      s.pair_act.assign(static_cast<size_t>(np), ActRow{});
      s.pair_q.resize(static_cast<size_t>(np * ab));
      s.pair_d.resize(static_cast<size_t>(np));
      s.pair_ds.resize(ab == 32 ? static_cast<size_t>(np) : 0);
      s.pair_xs.resize(ab == 32 ? static_cast<size_t>(np) : 0);
      s.pair_bs.resize(ab == 256 ? static_cast<size_t>(np * 16) : 0);
      std::vector<int64_t> next(s.pair_first.begin(), s.pair_first.end() - 1);
      for (int64_t i = 0; i < m; ++i) {
        const ActRow& r = s.rows[static_cast<size_t>(i)];
        for (int64_t p = 0; p < r.npick; ++p) {
          const int64_t b = r.pick[p], at = next[static_cast<size_t>(b)]++;
          s.pair_row[static_cast<size_t>(at)] = i;
          int8_t* pq = s.pair_q.data() + at * ab;
          std::memcpy(pq, r.level2->q + b * ab, static_cast<size_t>(ab));
          s.pair_d[static_cast<size_t>(at)] = r.level2->d[b];
          ActRow& pa = s.pair_act[static_cast<size_t>(at)];
          pa.q = pq;
          pa.d = s.pair_d.data() + at;
          if (ab == 32) {
            s.pair_ds[static_cast<size_t>(at)] = r.level2->ds[b];
            pa.ds = s.pair_ds.data() + at;
            s.pair_xs[static_cast<size_t>(at)] = r.level2->xs[b];
            pa.xs = s.pair_xs.data() + at;
          } else {
            std::memcpy(s.pair_bs.data() + 16 * at, r.level2->bs + 16 * b, 16 * sizeof(int16_t));
            pa.bs = s.pair_bs.data() + 16 * at;
          }
        }
      }
      pairs.first = s.pair_first.data();
      pairs.xrow = s.pair_row.data();
      pairs.act = s.pair_act.data();
      pairs.ab = ab;
    }
  }
  if (levels == 2) {
    s.y.resize(static_cast<size_t>(mq * w.rows));
    qmatmul_rows(w, kernels, s.rows.data(), mq, s.y.data(), pool, nullptr);
    const float* y2 = s.y.data();
    for (int64_t i = 0; i < m; ++i) {
      const float* a = y2 + 2 * i * w.rows;
      const float* b = a + w.rows;
      float* yi = y + i * w.rows;
      for (int64_t r = 0; r < w.rows; ++r) yi[r] = a[r] + b[r];
    }
    return;
  }
  qmatmul_rows(w, kernels, s.rows.data(), m, y, pool, panel_pairs ? &pairs : nullptr);
}

namespace {

void qmatmul_rows(const QMatrix& w, const Kernels* kernels, const ActRow* acts, int64_t m, float* y, ThreadPool* pool,
                  const qmm::PanelPairs* pairs) {
  const int64_t cols = w.cols, rows = w.rows;
  const TypeKernels& tk = *type_kernels(w.type);
  const RowKernel kernel = kernels->*tk.row;
  const int64_t ab = qmatmul_activation_block(w.type);
  // Tiling: a thread owns a range of weight rows; within it, x rows go in blocks of about 1 MiB of activations
  // (at most 64 rows: the weights are read from memory once per block) and, inside a block, in tiles of kMaxNx
  // that share each decoded weight block (or tile of weight rows). The quantized types' AVX-512 prefill instead
  // takes panels of 16 weight rows against all x rows (qmatmul_avx512.cpp).
  const size_t row_bytes = tensor_type_bytes(w.type, cols);
  const int64_t act_bytes = ab == 0 ? 4 * cols : cols;
  const int64_t xblock = std::clamp<int64_t>((1048576 / std::max<int64_t>(act_bytes, 1)) / qmm::kMaxNx * qmm::kMaxNx,
                                             qmm::kMaxNx, 64);
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(32768 / row_bytes));
  // A small product runs on the calling thread alone: waking the pool costs more than it saves (576 x 576 in Q4_0,
  // 0.2 MB, took longer on 2 threads than on 1 on both machines of docs/cpu_kernels.md; 0.5 MB was faster on 2).
  ThreadPool* const work_pool = static_cast<double>(rows) * static_cast<double>(row_bytes) * static_cast<double>(m) <
                                        static_cast<double>(kMinParallelBytes)
                                    ? nullptr
                                    : pool;
  const TileKernel tile = m > 1 && tk.tile != nullptr ? kernels->*tk.tile : nullptr;  // a row: the same bits in either
  const int64_t tr = tile != nullptr ? kernels->tile_rows : 1;
  const PanelGemm gemm = m >= qmm::kPanelMinM && tk.gemm != nullptr ? kernels->*tk.gemm : nullptr;
  parallel_ranges(
      work_pool, rows, grain,
      [&](int64_t r0, int64_t r1) {
        float out[qmm::kTileAlign * qmm::kMaxNx];
        if (gemm != nullptr) {  // panels of 16 rows against all x rows, then the rows left over
          for (; r0 + qmm::kPanelRows <= r1; r0 += qmm::kPanelRows)
            gemm(w.data + static_cast<size_t>(r0) * row_bytes, row_bytes, cols, acts, m, y + r0, rows, pairs);
        }
        for (int64_t xb = 0; xb < m; xb += xblock) {
          const int64_t xe = std::min(m, xb + xblock);
          int64_t r = r0;
          for (; tile != nullptr && r + tr <= r1; r += tr) {
            const uint8_t* wr = w.data + static_cast<size_t>(r) * row_bytes;
            for (int64_t xt = xb; xt < xe; xt += qmm::kMaxNx) {
              const int nx = static_cast<int>(std::min<int64_t>(qmm::kMaxNx, xe - xt));
              tile(wr, row_bytes, cols, acts + xt, nx, out);
              for (int64_t k = 0; k < tr; ++k)
                for (int j = 0; j < nx; ++j) y[(xt + j) * rows + r + k] = out[k * qmm::kMaxNx + j];
            }
          }
          for (; r < r1; ++r) {
            const uint8_t* wr = w.data + static_cast<size_t>(r) * row_bytes;
            for (int64_t xt = xb; xt < xe; xt += qmm::kMaxNx) {
              const int nx = static_cast<int>(std::min<int64_t>(qmm::kMaxNx, xe - xt));
              kernel(wr, cols, acts + xt, nx, out);
              for (int j = 0; j < nx; ++j) y[(xt + j) * rows + r] = out[j];
            }
          }
        }
      },
      qmm::kTileAlign);
}

void pick_outliers(const float* xr, int64_t i, int64_t cols, int64_t ab, Scratch& s, float* sorted) {
  const int64_t nb = cols / ab;
  const float* d = s.d.data() + i * nb;
  std::copy(d, d + nb, sorted);
  std::nth_element(sorted, sorted + nb / 2, sorted + nb);
  const float lim = kOutlierRatio * sorted[nb / 2];
  ActRow& row = s.rows[static_cast<size_t>(i)];
  int32_t* pick = s.pick.data() + i * nb;
  int64_t n = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (!(d[b] > lim)) continue;
    pick[n++] = static_cast<int32_t>(b);
    const int64_t at = i * nb + b;
    const float* xb = xr + b * ab;
    const int8_t* q1 = s.q.data() + i * cols + b * ab;
    int8_t* q2 = s.q2.data() + i * cols + b * ab;
    if (ab == 32) {
      quantize_error_block<32>(xb, q1, d[b], q2, s.d2.data() + at, s.ds2.data() + at, s.xs2.data() + at, nullptr);
    } else {
      quantize_error_block<256>(xb, q1, d[b], q2, s.d2.data() + at, nullptr, nullptr, s.bs2.data() + 16 * at);
    }
  }
  row.npick = n;
}

}  // namespace

}  // namespace tessera::model
