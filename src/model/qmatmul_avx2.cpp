// qmatmul row kernels for AVX2 + FMA + F16C (compiled with those flags; called only when CPUID reports them).
// Integer dot products: _mm256_maddubs_epi16 (unsigned weight x signed int8 activation, pairs summed to int16:
// at most 2 * 63 * 127 for the 6-bit Q6_K values, no saturation) then _mm256_madd_epi16 (to int32, by 1 or by the
// group's scale). Q8_0's signed weights go through the sign trick (|w| x sign(x, w)).
#include "model/qmatmul_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/simd_x86.h"

namespace tessera::model::qmm {

namespace {

using x86::f16_at;
using x86::hsum;

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline __m128i load128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

// sum over pairs of u8 x s8 products, then over pairs of int16 with weights k: int32 x 8
inline __m256i dot_u8s8(__m256i u, __m256i s, __m256i k16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), k16);
}

// for_nx<N>(f): f(0), ..., f(N - 1) unrolled; the lambdas are forced inline (QMM_INLINE) so that the per-row
// accumulator arrays stay in registers.
#define QMM_INLINE __attribute__((always_inline))
template <int NX, class F>
QMM_INLINE inline void for_nx(F&& f) {
  [&]<int... J>(std::integer_sequence<int, J...>) QMM_INLINE { (f(J), ...); }(std::make_integer_sequence<int, NX>{});
}

// Decode (one x row) reads each weight byte once, from DRAM: the kernels ask for the bytes kPrefetchAhead past
// the ones they are about to use (rows are contiguous, so past the row's end is the next row's start; a prefetch
// past the matrix's end is harmless).
constexpr int kPrefetchAhead = 2048;
inline void prefetch(const uint8_t* p, int bytes) {
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + o), _MM_HINT_T0);
}

// ---- f32 / f16 / bf16 ----------------------------------------------------------------------------------------

struct LoadF32 {
  static constexpr int kSize = 4;
  static __m256 load(const uint8_t* w) { return _mm256_loadu_ps(reinterpret_cast<const float*>(w)); }
  static float one(const uint8_t* w) {
    float v;
    std::memcpy(&v, w, 4);
    return v;
  }
};
struct LoadF16 {
  static constexpr int kSize = 2;
  static __m256 load(const uint8_t* w) { return _mm256_cvtph_ps(load128(w)); }
  static float one(const uint8_t* w) { return f16_at(w); }
};
struct LoadBF16 {
  static constexpr int kSize = 2;
  static __m256 load(const uint8_t* w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(w)), 16));
  }
  static float one(const uint8_t* w) {
    uint16_t h;
    std::memcpy(&h, w, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
};

template <class L>
struct FloatKernel {
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    // One accumulator per x row over k ascending, as FloatTile: the same sums whichever of the two runs a row.
    __m256 acc0[NX];
    for_nx<NX>([&](int j) QMM_INLINE { acc0[j] = _mm256_setzero_ps(); });
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
      const __m256 w0 = L::load(w + L::kSize * i);
      for_nx<NX>([&](int j) QMM_INLINE { acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[j].x + i), acc0[j]); });
    }
    for_nx<NX>([&](int j) QMM_INLINE {
      float s = hsum(acc0[j]);
      for (int64_t t = i; t < cols; ++t) s += L::one(w + L::kSize * t) * a[j].x[t];
      out[j] = s;
    });
  }
};

// kTileRows weight rows x NX activation rows per pass over k: each weight vector feeds NX products and each
// activation vector kTileRows, from registers.
constexpr int kTileRows = 3;
template <class L>
struct FloatTile {
  template <int NX>
  static void run(const uint8_t* w, size_t rb, int64_t cols, const ActRow* a, float* out) {
    __m256 acc[kTileRows][NX];
    for_nx<kTileRows>([&](int r) QMM_INLINE { for_nx<NX>([&](int j) QMM_INLINE { acc[r][j] = _mm256_setzero_ps(); }); });
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
      __m256 wv[kTileRows];
      for_nx<kTileRows>([&](int r) QMM_INLINE { wv[r] = L::load(w + r * rb + L::kSize * i); });
      for_nx<NX>([&](int j) QMM_INLINE {
        const __m256 xv = _mm256_loadu_ps(a[j].x + i);
        for_nx<kTileRows>([&](int r) QMM_INLINE { acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]); });
      });
    }
    for_nx<kTileRows>([&](int r) QMM_INLINE {
      for_nx<NX>([&](int j) QMM_INLINE {
        float s = hsum(acc[r][j]);
        for (int64_t t = i; t < cols; ++t) s += L::one(w + r * rb + L::kSize * t) * a[j].x[t];
        out[r * kMaxNx + j] = s;
      });
    });
  }
};

// ---- Q4_0 .. Q8_0 (32-element blocks) ------------------------------------------------------------------------

// 32 nibbles -> 32 bytes in element order (the low nibbles are elements 0..15, the high ones 16..31).
// (The 16 bytes go to both halves; the upper half shifts right by 4 within each 32-bit lane, and the nibbles that
// shift in from the neighbouring byte are masked off.)
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i v = _mm256_broadcastsi128_si256(load128(qs));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// Bit i of qh -> 0x10 in byte i.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                        3, 3, 3, 3, 3, 3);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

struct Q4_0 : Q4_0Block {
  static __m256i q(const uint8_t* b) { return nibbles(b + 2); }
};
struct Q4_1 : Q4_1Block {
  static __m256i q(const uint8_t* b) { return nibbles(b + 4); }
};
struct Q5_0 : Q5_0Block {
  static __m256i q(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)); }
};
struct Q5_1 : Q5_1Block {
  static __m256i q(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)); }
};

struct Q8_0 : Q8_0Block {
  static __m256i q(const uint8_t* b) { return load256(b + 2); }
};

// The weight operand of maddubs (unsigned) and the activation operand matched to it: Q8_0's signed weights go as
// |w| with x negated where w < 0.
template <class T>
inline __m256i weight_operand(__m256i q) {
  if constexpr (std::is_same_v<T, Q8_0>) return _mm256_sign_epi8(q, q);
  return q;
}
template <class T>
inline __m256i act_operand(__m256i x, __m256i q) {
  if constexpr (std::is_same_v<T, Q8_0>) return _mm256_sign_epi8(x, q);
  return x;
}

// The low 16 bits of each 32-bit lane, packed into 8 x 16 bits.
inline __m128i pack_low16(__m256i v) {
  const __m256i shuf = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                                        12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, shuf), 0x08);  // qwords 0 and 2
  return _mm256_castsi256_si128(p);
}

// The sum of v's 8 int32 lanes (exact).
inline int32_t hsum_epi32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
  return _mm_cvtsi128_si32(t);
}

// Lane k of the result: the sum of p[k]'s 8 lanes (exact), for 8 blocks' dot products p[0..8).
inline __m256i block_sums(const __m256i* p) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// t = I * (dw * dx) [+ mw * ds] of one block b of row a (qmatmul.h), from the block's dot product s32 (8 lanes).
template <class T>
inline float legacy_term(const uint8_t* blk, const ActRow& a, int64_t b, __m256i s32) {
  int32_t isum = hsum_epi32(s32);
  if constexpr (T::kOffset != 0.0f) isum -= static_cast<int32_t>(T::kOffset) * a.xs[b];
  float t = static_cast<float>(isum) * (f16_at(blk) * a.d[b]);
  if constexpr (T::kMin) t = t + f16_at(blk + 2) * a.ds[b];
  return t;
}

// out = the slot sums of the blocks' terms t_b (qmatmul.h). Blocks go 8 at a time: their 8 weight scales are
// converted together and multiplied by the 8 activation scales in one vector; the 8 blocks' integer sums are
// gathered into one register (block_sums), turned into the 8 terms by one vector multiply and added to slots 0-7
// or 8-15 (two registers) by one vector add.
template <class T>
struct LegacyKernel {
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nb = cols / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i stride = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(T::kBytes));
    __m256 slots[NX][2];
    for_nx<NX>([&](int j) QMM_INLINE { slots[j][0] = slots[j][1] = _mm256_setzero_ps(); });
    int64_t b = 0;
    // 8 blocks from b into slots 0-7 (H = 0) or 8-15 (H = 1).
    const auto step = [&]<int H>(int64_t b0) QMM_INLINE {
      const uint8_t* blk = w + b0 * T::kBytes;
      if constexpr (NX == 1) prefetch(blk, 8 * T::kBytes);
      // One gather of the first 4 bytes of 8 blocks: d in the low half of each lane, m (Q4_1/Q5_1) in the high.
      const __m256i dm = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), stride, 1);
      const __m256 dw = _mm256_cvtph_ps(pack_low16(dm));
      __m256i p[NX][8];
      for_nx<8>([&](int k) QMM_INLINE {
        const __m256i q = T::q(blk + k * T::kBytes);
        const __m256i wq = weight_operand<T>(q);
        for_nx<NX>([&](int j) QMM_INLINE {
          p[j][k] = dot_u8s8(wq, act_operand<T>(load256(a[j].q + 32 * (b0 + k)), q), ones);
        });
      });
      for_nx<NX>([&](int j) QMM_INLINE {
        __m256i isum = block_sums(p[j]);
        if constexpr (T::kOffset != 0.0f) {
          isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(_mm256_set1_epi32(static_cast<int>(T::kOffset)),
                                                          load256(a[j].xs + b0)));
        }
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_loadu_ps(a[j].d + b0)));
        if constexpr (T::kMin) {
          const __m256 mw = _mm256_cvtph_ps(pack_low16(_mm256_srli_epi32(dm, 16)));
          t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_loadu_ps(a[j].ds + b0)));
        }
        slots[j][H] = _mm256_add_ps(slots[j][H], t);
      });
    };
    for (; b + 16 <= nb; b += 16) {
      step.template operator()<0>(b);
      step.template operator()<1>(b + 8);
    }
    if (b + 8 <= nb) {
      step.template operator()<0>(b);
      b += 8;
    }
    // The last blocks one at a time, each term added to its slot's lane alone (+0 in the others leaves them as
    // they are).
    const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; b < nb; ++b) {
      const uint8_t* blk = w + b * T::kBytes;
      const __m256i q = T::q(blk);
      const __m256i wq = weight_operand<T>(q);
      const int h = static_cast<int>((b / 8) % 2);
      const __m256 lane = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane_ids, _mm256_set1_epi32(static_cast<int>(b % 8))));
      for_nx<NX>([&](int j) QMM_INLINE {
        const float t = legacy_term<T>(blk, a[j], b, dot_u8s8(wq, act_operand<T>(load256(a[j].q + 32 * b), q), ones));
        slots[j][h] = _mm256_add_ps(slots[j][h], _mm256_and_ps(_mm256_set1_ps(t), lane));
      });
    }
    float sum[NX];
    for_nx<NX>([&](int j) QMM_INLINE { sum[j] = hsum(_mm256_add_ps(slots[j][0], slots[j][1])); });  // slot_tree
    // Int8Outliers: the picked blocks' second levels (ActRow::pick), their terms after the blocks', in order.
    for_nx<NX>([&](int j) QMM_INLINE {
      const ActRow* l = a[j].level2;
      for (int64_t p = 0; p < a[j].npick; ++p) {
        const int64_t pb = a[j].pick[p];
        const uint8_t* blk = w + pb * T::kBytes;
        const __m256i q = T::q(blk);
        const __m256i s32 = dot_u8s8(weight_operand<T>(q), act_operand<T>(load256(l->q + 32 * pb), q), ones);
        sum[j] = sum[j] + legacy_term<T>(blk, *l, pb, s32);
      }
    });
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = sum[j]; });
  }
};

// ---- K types (256-element super-blocks) ----------------------------------------------------------------------

// The 8 six-bit scales (sc, byte g = group g) and mins (mn) of a Q4_K/Q5_K super-block (quant.cpp describes the
// packing), computed on whole words: vector loads of bytes written one by one would stall on store forwarding.
inline void k_scales(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t s0, s1, s2;
  std::memcpy(&s0, s, 4);
  std::memcpy(&s1, s + 4, 4);
  std::memcpy(&s2, s + 8, 4);
  const uint32_t sc_lo = s0 & 0x3f3f3f3fu, mn_lo = s1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (s2 & 0x0f0f0f0fu) | (((s0 >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((s2 >> 4) & 0x0f0f0f0fu) | (((s1 >> 6) & 0x03030303u) << 4);
  *sc = sc_lo | (static_cast<uint64_t>(sc_hi) << 32);
  *mn = mn_lo | (static_cast<uint64_t>(mn_hi) << 32);
}

// out = the slot sums of t_sb = I * (d * dx) - M * (dmin * dx), I = sum_g sc_g * isum_g, M = sum_g m_g * xsum_g
template <bool Five>
struct Q45KKernel {
  static constexpr int64_t kPickBlockBytes = Five ? 176 : 144;  // Int8Outliers: picks taken block by block
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nsb = cols / 256;
    constexpr int kBytes = Five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(15), one8 = _mm256_set1_epi8(1);
    float acc[NX][kSlots] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kBytes;
      const float d = f16_at(blk), dmin = f16_at(blk + 2);
      if constexpr (NX == 1) prefetch(blk, kBytes);
      uint64_t sc, mn;
      k_scales(blk + 4, &sc, &mn);
      const __m128i mn8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // each min twice: 16 groups of 16
      const uint8_t* qs = blk + (Five ? 48 : 16);
      __m256i qh = Five ? load256(blk + 16) : _mm256_setzero_si256();
      __m256i sumi[NX];
      for_nx<NX>([&](int j) QMM_INLINE { sumi[j] = _mm256_setzero_si256(); });
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load256(qs + 32 * c);
        __m256i lo = _mm256_and_si256(v, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (Five) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one8), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one8), 4));
          qh = _mm256_srli_epi16(qh, 2);
        }
        const __m256i s_lo = _mm256_set1_epi16(static_cast<int16_t>((sc >> (16 * c)) & 0xff));
        const __m256i s_hi = _mm256_set1_epi16(static_cast<int16_t>((sc >> (16 * c + 8)) & 0xff));
        for_nx<NX>([&](int j) QMM_INLINE {
          const int8_t* x = a[j].q + 256 * sb + 64 * c;
          sumi[j] = _mm256_add_epi32(sumi[j], dot_u8s8(lo, load256(x), s_lo));
          sumi[j] = _mm256_add_epi32(sumi[j], dot_u8s8(hi, load256(x + 32), s_hi));
        });
      }
      for_nx<NX>([&](int j) QMM_INLINE {
        const float dx = a[j].d[sb];
        const int32_t isum = hsum_epi32(sumi[j]);
        const int32_t msum = hsum_epi32(_mm256_madd_epi16(load256(a[j].bs + 16 * sb), mins));
        float& slot = acc[j][sb % kSlots];
        slot = slot + (static_cast<float>(isum) * (d * dx) - static_cast<float>(msum) * (dmin * dx));
      });
    }
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = slot_tree(acc[j]); });
  }
};

// out = the slot sums of t_sb = I * (d * dx), I = sum_g sc_g * (isum_g - 32 * xsum_g), 16 groups of 16
struct Q6KKernel {
  static constexpr int64_t kPickBlockBytes = 210;  // Int8Outliers: picks taken block by block
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nsb = cols / 256;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    float acc[NX][kSlots] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * 210;
      if constexpr (NX == 1) prefetch(blk, 210);
      const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = f16_at(blk + 208);
      const __m256i sc16 = _mm256_cvtepi8_epi16(load128(sc));
      __m256i sumi[NX];
      for_nx<NX>([&](int j) QMM_INLINE { sumi[j] = _mm256_setzero_si256(); });
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load256(blk + 64 * h), l1 = load256(blk + 64 * h + 32);
        const __m256i hb = load256(blk + 128 + 32 * h);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
        for (int s = 0; s < 4; ++s) {
          const int g = 8 * h + 2 * s;
          const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
          for_nx<NX>([&](int j) QMM_INLINE {
            sumi[j] = _mm256_add_epi32(sumi[j], dot_u8s8(q[s], load256(a[j].q + 256 * sb + 128 * h + 32 * s), scv));
          });
        }
      }
      for_nx<NX>([&](int j) QMM_INLINE {
        const __m256i off = _mm256_madd_epi16(load256(a[j].bs + 16 * sb), sc16);
        const __m256i isum = _mm256_sub_epi32(sumi[j], _mm256_slli_epi32(off, 5));
        float& slot = acc[j][sb % kSlots];
        slot = slot + static_cast<float>(hsum_epi32(isum)) * (d * a[j].d[sb]);
      });
    }
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = slot_tree(acc[j]); });
  }
};

// ---- prefill: panel GEMM for the quantized types ----------------------------------------------------------
//
// As in qmatmul_avx512.cpp (the decoders and the driver are qmatmul_panel.inc): 16 weight rows decoded once into
// unsigned bytes, 4 consecutive elements of each row per 4-byte lane, each x row's 4 bytes broadcast. Here one
// 64-byte step is two 256-bit halves (rows 0-7, 8-15) multiplied with maddubs; the int16 pair sums of several
// steps are added before widening (madd) while they cannot overflow: UMax is the largest weight code (15, 31 or
// 63), and 2 * UMax * 127 per step. Q8_0 (codes up to 255) would saturate maddubs and keeps the row kernels.
#include "model/qmatmul_panel.inc"

template <int UMax>
struct PanelTile {
  static constexpr int kMr = 2;
  static constexpr int kChunk = 32767 / (2 * UMax * 127);  // steps summed in int16

  template <int MR, class P, bool Add>
  static void run(const uint8_t* panel, const PanelScales& s, int64_t nblk, const ActRow* const* xa,
                  float* const* out) {
    constexpr int kSteps = P::kG / 4;
    static_assert(kChunk >= 1 && kSteps % std::min(kChunk, kSteps) == 0);
    constexpr int kPer = std::min(kChunk, kSteps);
    const __m256i ones = _mm256_set1_epi16(1);
    // Per x row and slot: the 16 weight rows' slot sums, in memory (block b adds to slot b % 16); slots no block
    // reaches stay +0.
    alignas(32) float slots[MR][kSlots][16];
    for (int64_t k = nblk; nblk > 1 && k < kSlots; ++k)
      for (int x = 0; x < MR; ++x) std::fill(slots[x][k], slots[x][k] + 16, 0.0f);
    for (int64_t b = 0; b < nblk; ++b) {
      __m256i isum[MR][2];
      for_nx<MR>([&](int x) QMM_INLINE { isum[x][0] = isum[x][1] = _mm256_setzero_si256(); });
      for (int g = 0; g < P::kGroups; ++g) {
        const int64_t g0 = b * P::kGroups + g;  // the group's index in the row
        const uint8_t* pg = panel + g0 * kSteps * 64;
        __m256i gsum[MR][2];
        for_nx<MR>([&](int x) QMM_INLINE { gsum[x][0] = gsum[x][1] = _mm256_setzero_si256(); });
        for_nx<kSteps / kPer>([&](int c) QMM_INLINE {
          __m256i s16[MR][2];
          for_nx<MR>([&](int x) QMM_INLINE { s16[x][0] = s16[x][1] = _mm256_setzero_si256(); });
          for_nx<kPer>([&](int t0) QMM_INLINE {
            const int t = c * kPer + t0;
            const __m256i w0 = load256(pg + 64 * t), w1 = load256(pg + 64 * t + 32);
            for_nx<MR>([&](int x) QMM_INLINE {
              int32_t x4;
              std::memcpy(&x4, xa[x]->q + g0 * P::kG + 4 * t, 4);
              const __m256i xb = _mm256_set1_epi32(x4);
              s16[x][0] = _mm256_add_epi16(s16[x][0], _mm256_maddubs_epi16(w0, xb));
              s16[x][1] = _mm256_add_epi16(s16[x][1], _mm256_maddubs_epi16(w1, xb));
            });
          });
          for_nx<MR>([&](int x) QMM_INLINE {
            gsum[x][0] = _mm256_add_epi32(gsum[x][0], _mm256_madd_epi16(s16[x][0], ones));
            gsum[x][1] = _mm256_add_epi32(gsum[x][1], _mm256_madd_epi16(s16[x][1], ones));
          });
        });
        for_nx<2>([&](int h) QMM_INLINE {
          if constexpr (P::kKind == PanelKind::Legacy) {
            for_nx<MR>([&](int x) QMM_INLINE { isum[x][h] = gsum[x][h]; });
          } else {
            const __m256i scv = load256(s.sc + 16 * g0 + 8 * h);
            for_nx<MR>([&](int x) QMM_INLINE {
              __m256i v = gsum[x][h];
              if constexpr (P::kKind == PanelKind::Q6K)
                v = _mm256_sub_epi32(v, _mm256_set1_epi32(32 * xa[x]->bs[16 * b + g]));
              isum[x][h] = _mm256_add_epi32(isum[x][h], _mm256_mullo_epi32(v, scv));
            });
          }
        });
      }
      for_nx<2>([&](int h) QMM_INLINE {
        const __m256 dv = _mm256_loadu_ps(s.d + 16 * b + 8 * h);
        for_nx<MR>([&](int x) QMM_INLINE {
          const ActRow& a = *xa[x];
          const __m256 dx = _mm256_set1_ps(a.d[b]);
          __m256i iv = isum[x][h];
          if constexpr (P::kKind == PanelKind::Legacy && P::kOffset != 0)
            iv = _mm256_sub_epi32(iv, _mm256_set1_epi32(P::kOffset * a.xs[b]));
          __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(dv, dx));
          if constexpr (P::kKind == PanelKind::Legacy && P::kMin)
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_loadu_ps(s.m + 16 * b + 8 * h), _mm256_set1_ps(a.ds[b])));
          if constexpr (P::kKind == PanelKind::Q45K) {
            __m256i ms = _mm256_setzero_si256();
            for_nx<4>([&](int p) QMM_INLINE {
              ms = _mm256_add_epi32(ms, _mm256_madd_epi16(load256(s.mn + 16 * (4 * b + p) + 8 * h),
                                                          _mm256_set1_epi32(group_sum_pair(a, b, p))));
            });
            t = _mm256_sub_ps(t, _mm256_mul_ps(_mm256_cvtepi32_ps(ms),
                                               _mm256_mul_ps(_mm256_loadu_ps(s.m + 16 * b + 8 * h), dx)));
          }
          float* slot = slots[x][b % kSlots] + 8 * h;
          _mm256_store_ps(slot, _mm256_add_ps(b < kSlots ? _mm256_setzero_ps() : _mm256_load_ps(slot), t));
        });
      });
    }
    if (nblk == 1) {  // one block (the outlier pairs): the tree of +0 + t and +0s is +0 + t
      for (int x = 0; x < MR; ++x)
        for (int k = 0; k < 16; ++k) out[x][k] = Add ? out[x][k] + slots[x][0][k] : slots[x][0][k];
      return;
    }
    // slot_tree, lane by lane
    for_nx<MR>([&](int x) QMM_INLINE {
      for_nx<2>([&](int h) QMM_INLINE {
        const auto sl = [&](int k) QMM_INLINE { return _mm256_load_ps(slots[x][k] + 8 * h); };
        __m256 t[8];
        for_nx<8>([&](int k) QMM_INLINE { t[k] = _mm256_add_ps(sl(k), sl(k + 8)); });
        __m256 u[4];
        for_nx<4>([&](int k) QMM_INLINE { u[k] = _mm256_add_ps(t[k], t[k + 4]); });
        _mm256_storeu_ps(out[x] + 8 * h, _mm256_add_ps(_mm256_add_ps(u[0], u[2]), _mm256_add_ps(u[1], u[3])));
      });
    });
  }
};


template <class K>
void tile_kernel(const uint8_t* w, size_t rb, int64_t cols, const ActRow* a, int nx, float* out) {
  static_assert(kMaxNx == 4 && kTileAlign % kTileRows == 0);
  switch (nx) {
    case 1:
      K::template run<1>(w, rb, cols, a, out);
      return;
    case 2:
      K::template run<2>(w, rb, cols, a, out);
      return;
    case 3:
      K::template run<3>(w, rb, cols, a, out);
      return;
    default:
      K::template run<4>(w, rb, cols, a, out);
      return;
  }
}

template <class K>
void row_kernel(const uint8_t* w, int64_t cols, const ActRow* a, int nx, float* out) {
  static_assert(kMaxNx == 4);
  switch (nx) {
    case 1:
      K::template run<1>(w, cols, a, out);
      break;
    case 2:
      K::template run<2>(w, cols, a, out);
      break;
    case 3:
      K::template run<3>(w, cols, a, out);
      break;
    default:
      K::template run<4>(w, cols, a, out);
      break;
  }
  add_k_type_picks<K>(w, a, nx, out);  // Int8Outliers' picks on the K types (qmatmul_kernels.h)
}

const Kernels kAvx2 = {
    row_kernel<FloatKernel<LoadF32>>, row_kernel<FloatKernel<LoadF16>>, row_kernel<FloatKernel<LoadBF16>>,
    row_kernel<LegacyKernel<Q4_0>>,   row_kernel<LegacyKernel<Q4_1>>,   row_kernel<LegacyKernel<Q5_0>>,
    row_kernel<LegacyKernel<Q5_1>>,   row_kernel<LegacyKernel<Q8_0>>,           row_kernel<Q45KKernel<false>>,
    row_kernel<Q45KKernel<true>>,     row_kernel<Q6KKernel>,
    tile_kernel<FloatTile<LoadF32>>,  tile_kernel<FloatTile<LoadF16>>,  tile_kernel<FloatTile<LoadBF16>>,
    kTileRows,
    panel_gemm<PanelTile<15>, PanelType<PanelKind::Legacy, 8>, decode_legacy<Q4_0>>,
    panel_gemm<PanelTile<15>, PanelType<PanelKind::Legacy, 0, true>, decode_legacy<Q4_1>>,
    panel_gemm<PanelTile<31>, PanelType<PanelKind::Legacy, 16>, decode_legacy<Q5_0>>,
    panel_gemm<PanelTile<31>, PanelType<PanelKind::Legacy, 0, true>, decode_legacy<Q5_1>>,
    nullptr,  // Q8_0: codes up to 255 would saturate maddubs
    panel_gemm<PanelTile<15>, PanelType<PanelKind::Q45K>, decode_q45k<false>>,
    panel_gemm<PanelTile<31>, PanelType<PanelKind::Q45K>, decode_q45k<true>>,
    panel_gemm<PanelTile<63>, PanelType<PanelKind::Q6K>, decode_q6k>,
};

}  // namespace

const Kernels* avx2_kernels() {
  return &kAvx2;
}

}  // namespace tessera::model::qmm

#else

namespace tessera::model::qmm {
const Kernels* avx2_kernels() {
  return nullptr;
}
}  // namespace tessera::model::qmm

#endif
