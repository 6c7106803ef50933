// qmatmul row kernels for AVX-512 (F, BW, VL, DQ) with VNNI (compiled with those flags; called only when CPUID
// reports all of them). The 32-element block types go two blocks per 512-bit register and multiply with
// _mm512_dpbusd_epi32 (unsigned weight x signed int8 activation, four products summed into each int32 lane, no
// intermediate saturation); an odd last block takes the 256-bit VNNI form. Q8_0's signed weights: |w| x (x negated
// where w < 0). The K types keep the maddubs/madd pair (the second multiply applies the group's scale) on 64
// elements (two groups) per register.
#include "model/qmatmul_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

// GCC 12's avx512fintrin.h builds its "undefined" registers by self-initialization (__m512i __Y = __Y), which
// -Wmaybe-uninitialized reports at every inlined _mm512_inserti64x4 / zext; the values are fully written.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
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

inline float hsum512(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

inline __m512i load512(const void* p) {
  return _mm512_loadu_si512(p);
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline __m128i load128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
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
  static __m512 load(const uint8_t* w) { return _mm512_loadu_ps(w); }
  static float one(const uint8_t* w) {
    float v;
    std::memcpy(&v, w, 4);
    return v;
  }
};
struct LoadF16 {
  static constexpr int kSize = 2;
  static __m512 load(const uint8_t* w) { return _mm512_cvtph_ps(load256(w)); }
  static float one(const uint8_t* w) { return f16_at(w); }
};
struct LoadBF16 {
  static constexpr int kSize = 2;
  static __m512 load(const uint8_t* w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(w)), 16));
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
    __m512 acc0[NX];
    for_nx<NX>([&](int j) QMM_INLINE { acc0[j] = _mm512_setzero_ps(); });
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
      const __m512 w0 = L::load(w + L::kSize * i);
      for_nx<NX>([&](int j) QMM_INLINE { acc0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a[j].x + i), acc0[j]); });
    }
    for_nx<NX>([&](int j) QMM_INLINE {
      float s = hsum512(acc0[j]);
      for (int64_t t = i; t < cols; ++t) s += L::one(w + L::kSize * t) * a[j].x[t];
      out[j] = s;
    });
  }
};

// kTileRows weight rows x NX activation rows per pass over k: each weight vector feeds NX products and each
// activation vector kTileRows, from registers.
constexpr int kTileRows = 4;
template <class L>
struct FloatTile {
  template <int NX>
  static void run(const uint8_t* w, size_t rb, int64_t cols, const ActRow* a, float* out) {
    __m512 acc[kTileRows][NX];
    for_nx<kTileRows>([&](int r) QMM_INLINE { for_nx<NX>([&](int j) QMM_INLINE { acc[r][j] = _mm512_setzero_ps(); }); });
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
      __m512 wv[kTileRows];
      for_nx<kTileRows>([&](int r) QMM_INLINE { wv[r] = L::load(w + r * rb + L::kSize * i); });
      for_nx<NX>([&](int j) QMM_INLINE {
        const __m512 xv = _mm512_loadu_ps(a[j].x + i);
        for_nx<kTileRows>([&](int r) QMM_INLINE { acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]); });
      });
    }
    for_nx<kTileRows>([&](int r) QMM_INLINE {
      for_nx<NX>([&](int j) QMM_INLINE {
        float s = hsum512(acc[r][j]);
        for (int64_t t = i; t < cols; ++t) s += L::one(w + r * rb + L::kSize * t) * a[j].x[t];
        out[r * kMaxNx + j] = s;
      });
    });
  }
};

// ---- Q4_0 .. Q8_0 (32-element blocks) ------------------------------------------------------------------------

// (The 16 bytes go to both halves; the upper half shifts right by 4 within each 32-bit lane, and the nibbles that
// shift in from the neighbouring byte are masked off.)
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i v = _mm256_broadcastsi128_si256(load128(qs));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// Bit i of the little-endian uint32 at p -> 0x10 in byte i.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __mmask32 bits = _cvtu32_mask32(qh);
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
}

// Two consecutive blocks' 32 nibbles each (the first at qs, the second at qs + stride) -> 64 bytes in element order.
inline __m512i nibbles2(const uint8_t* qs, int stride) {
  __m512i v = _mm512_broadcast_i32x4(load128(qs));
  v = _mm512_mask_broadcast_i32x4(v, 0xff00, load128(qs + stride));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  return _mm512_and_si512(_mm512_srlv_epi32(v, shift), _mm512_set1_epi8(15));
}

// Bits i of the two blocks' little-endian uint32 qh -> 0x10 in byte i (first block) and 32 + i (second).
inline __m512i fifth_bits2(const uint8_t* p, int stride) {
  uint32_t h0, h1;
  std::memcpy(&h0, p, 4);
  std::memcpy(&h1, p + stride, 4);
  const __mmask64 bits = _cvtu64_mask64(h0 | (static_cast<uint64_t>(h1) << 32));
  return _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10));
}

struct Q4_0 : Q4_0Block {
  static __m256i q(const uint8_t* b) { return nibbles(b + 2); }
  static __m512i q2(const uint8_t* b) { return nibbles2(b + 2, kBytes); }
};
struct Q4_1 : Q4_1Block {
  static __m256i q(const uint8_t* b) { return nibbles(b + 4); }
  static __m512i q2(const uint8_t* b) { return nibbles2(b + 4, kBytes); }
};
struct Q5_0 : Q5_0Block {
  static __m256i q(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)); }
  static __m512i q2(const uint8_t* b) { return _mm512_or_si512(nibbles2(b + 6, kBytes), fifth_bits2(b + 2, kBytes)); }
};
struct Q5_1 : Q5_1Block {
  static __m256i q(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)); }
  static __m512i q2(const uint8_t* b) { return _mm512_or_si512(nibbles2(b + 8, kBytes), fifth_bits2(b + 4, kBytes)); }
};

struct Q8_0 : Q8_0Block {
  static __m256i q(const uint8_t* b) { return load256(b + 2); }
  static __m512i q2(const uint8_t* b) { return join(load256(b + 2), load256(b + kBytes + 2)); }
};

// The weight operand of dpbusd (unsigned) and the activation operand matched to it: Q8_0's signed weights go as |w|
// with x negated where w < 0.
template <class T>
inline __m512i weight_operand(__m512i q) {
  if constexpr (std::is_same_v<T, Q8_0>) return _mm512_abs_epi8(q);
  return q;
}
template <class T>
inline __m512i act_operand(__m512i x, __m512i q) {
  if constexpr (std::is_same_v<T, Q8_0>) return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
  return x;
}
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

// Pairs of lanes summed: lanes 0..7 of the result are A's (2k, 2k+1) sums, lanes 8..15 B's. Applied three times to
// dot products of two blocks per register (8 lanes a block) it leaves one lane a block, blocks in order.
inline __m512i pair_sums(__m512i a, __m512i b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
}

// t = I * (dw * dx) [+ mw * ds] of one block b of row a (qmatmul.h), from the block's raw dot product s32 (8 lanes).
template <class T>
inline float legacy_term(const uint8_t* blk, const ActRow& a, int64_t b, __m256i s32) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  int32_t isum = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 1)));
  if constexpr (T::kOffset != 0.0f) isum -= static_cast<int32_t>(T::kOffset) * a.xs[b];
  float t = static_cast<float>(isum) * (f16_at(blk) * a.d[b]);
  if constexpr (T::kMin) t = t + f16_at(blk + 2) * a.ds[b];
  return t;
}

// out = the slot sums of the blocks' terms t_b (qmatmul.h), the last < 16 blocks as a masked chunk. Blocks go 16 at a time: one gather fetches their scales
// (and mins), one multiply forms the 16 factors dw * dx; each pair of blocks (one register) is one dpbusd, three
// rounds of pair_sums leave the 16 blocks' integer sums in one register, turned into the 16 terms by one vector
// multiply and added to the 16 slots (lane k: slot k) by one vector add.
template <class T>
struct LegacyKernel {
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nb = cols / 32;
    const __m512i stride = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(T::kBytes));
    __m512 slots[NX];
    for_nx<NX>([&](int j) QMM_INLINE { slots[j] = _mm512_setzero_ps(); });
    // Blocks b.. b + nt (nt <= 16); a partial chunk (the row's last nt < 16 blocks) reads no byte past them and
    // gives its missing lanes the term +0 (which leaves a slot as it is).
    const auto chunk = [&]<bool Full>(int64_t b, int nt) QMM_INLINE {
      const uint8_t* blk = w + b * T::kBytes;
      if constexpr (NX == 1) prefetch(blk, 16 * T::kBytes);
      const __mmask16 live = Full ? __mmask16{0xffff} : static_cast<__mmask16>((1u << nt) - 1);
      const __m512i dm = Full ? _mm512_i32gather_epi32(stride, blk, 1)  // d | m << 16 per block
                              : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, stride, blk, 1);
      const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      __m512i p4[NX][4];
      for_nx<4>([&](int k4) QMM_INLINE {
        __m512i p2[NX][2];
        for_nx<2>([&](int k2) QMM_INLINE {
          const int k = 2 * k4 + k2;
          if (Full || 2 * k + 1 < nt) {
            const __m512i q = T::q2(blk + 2 * k * T::kBytes);
            const __m512i wq = weight_operand<T>(q);
            for_nx<NX>([&](int j) QMM_INLINE {
              const __m512i x = act_operand<T>(load512(a[j].q + 32 * (b + 2 * k)), q);
              p2[j][k2] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, x);
            });
          } else if (2 * k < nt) {  // the last block alone
            const __m512i q = _mm512_zextsi256_si512(T::q(blk + 2 * k * T::kBytes));
            const __m512i wq = weight_operand<T>(q);
            for_nx<NX>([&](int j) QMM_INLINE {
              const __m512i x = act_operand<T>(_mm512_zextsi256_si512(load256(a[j].q + 32 * (b + 2 * k))), q);
              p2[j][k2] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, x);
            });
          } else {
            for_nx<NX>([&](int j) QMM_INLINE { p2[j][k2] = _mm512_setzero_si512(); });
          }
        });
        for_nx<NX>([&](int j) QMM_INLINE { p4[j][k4] = pair_sums(p2[j][0], p2[j][1]); });
      });
      for_nx<NX>([&](int j) QMM_INLINE {
        __m512i isum = pair_sums(pair_sums(p4[j][0], p4[j][1]), pair_sums(p4[j][2], p4[j][3]));
        if constexpr (T::kOffset != 0.0f) {
          isum = _mm512_sub_epi32(isum, _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int>(T::kOffset)),
                                                          _mm512_maskz_loadu_epi32(live, a[j].xs + b)));
        }
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(live, a[j].d + b)));
        if constexpr (T::kMin) {
          const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
          t = _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_maskz_loadu_ps(live, a[j].ds + b)));
        }
        slots[j] = _mm512_add_ps(slots[j], t);
      });
    };
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) chunk.template operator()<true>(b, 16);
    if (nb - b > 4) {
      chunk.template operator()<false>(b, static_cast<int>(nb - b));
    } else {  // a few blocks left: each term alone, added to its slot's lane
      for (; b < nb; ++b) {
        const uint8_t* blk = w + b * T::kBytes;
        const __m256i q = T::q(blk);
        const __m256i wq = weight_operand<T>(q);
        const auto lane = static_cast<__mmask16>(1u << (b % kSlots));
        for_nx<NX>([&](int j) QMM_INLINE {
          const __m256i x = act_operand<T>(load256(a[j].q + 32 * b), q);
          const float t = legacy_term<T>(blk, a[j], b, _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, x));
          slots[j] = _mm512_mask_add_ps(slots[j], lane, slots[j], _mm512_set1_ps(t));
        });
      }
    }
    float sum[NX];
    for_nx<NX>([&](int j) QMM_INLINE { sum[j] = hsum512(slots[j]); });  // slot_tree's pairing
    // Int8Outliers: the picked blocks' second levels (ActRow::pick), their terms after the blocks', in order.
    for_nx<NX>([&](int j) QMM_INLINE {
      const ActRow* l = a[j].level2;
      for (int64_t p = 0; p < a[j].npick; ++p) {
        const int64_t pb = a[j].pick[p];
        const uint8_t* blk = w + pb * T::kBytes;
        const __m256i q = T::q(blk);
        const __m256i x = act_operand<T>(load256(l->q + 32 * pb), q);
        sum[j] = sum[j] + legacy_term<T>(blk, *l, pb, _mm256_dpbusd_epi32(_mm256_setzero_si256(), weight_operand<T>(q), x));
      }
    });
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = sum[j]; });
  }
};

// ---- K types (256-element super-blocks) ----------------------------------------------------------------------

// The 8 six-bit scales (byte g of *sc: group g) and mins of a Q4_K/Q5_K super-block, on whole words (vector loads
// of bytes stored one by one would stall on store forwarding).
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

// Index vectors for _mm512_permutexvar_epi16: lane k (int16 k covers elements 2k, 2k+1 of a 64-element chunk)
// takes scale base + k / per.
inline __m512i scale_index(int base, int per) {
  alignas(64) int16_t idx[32];
  for (int k = 0; k < 32; ++k) idx[k] = static_cast<int16_t>(base + k / per);
  return _mm512_load_si512(idx);
}

// The K types' terms, 16 super-blocks at a time: each super-block's integer sums kept as vectors (I: 16 lanes; M:
// 8), summed lane-wise by pair_sums trees into one register of 16 super-blocks (lane k: super-block sb0 + k), the
// terms t = I * (d * dx) [- M * (dmin * dx)] formed by vector multiplies and added to the slots (lane k: slot k).
template <int NX, bool Mins>
struct KTerms {
  alignas(64) int32_t iv[NX][16][16];
  alignas(64) int32_t mv[NX][16][8];
  alignas(64) float d[16] = {}, dmin[16] = {};
  __m512 slots[NX];

  // The n (1..16) super-blocks from sb0 (a multiple of 16).
  QMM_INLINE void flush(int n, int64_t sb0, const ActRow* a) {
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    for_nx<NX>([&](int j) QMM_INLINE {
      __m512i l1[8];
      for_nx<8>([&](int k) QMM_INLINE {
        const __m512i v0 = 2 * k < n ? _mm512_load_si512(iv[j][2 * k]) : _mm512_setzero_si512();
        const __m512i v1 = 2 * k + 1 < n ? _mm512_load_si512(iv[j][2 * k + 1]) : _mm512_setzero_si512();
        l1[k] = pair_sums(v0, v1);
      });
      const auto tree8 = [](const __m512i* l) QMM_INLINE {
        return pair_sums(pair_sums(pair_sums(l[0], l[1]), pair_sums(l[2], l[3])),
                         pair_sums(pair_sums(l[4], l[5]), pair_sums(l[6], l[7])));
      };
      const __m512 dx = _mm512_maskz_loadu_ps(live, a[j].d + sb0);
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(tree8(l1)), _mm512_mul_ps(_mm512_load_ps(d), dx));
      if constexpr (Mins) {
        __m512i m1[8];
        for_nx<8>([&](int k) QMM_INLINE {
          const __m256i v0 = 2 * k < n ? _mm256_load_si256(reinterpret_cast<const __m256i*>(mv[j][2 * k])) : _mm256_setzero_si256();
          const __m256i v1 =
              2 * k + 1 < n ? _mm256_load_si256(reinterpret_cast<const __m256i*>(mv[j][2 * k + 1])) : _mm256_setzero_si256();
          m1[k] = join(v0, v1);
        });
        t = _mm512_sub_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(tree8(m1)), _mm512_mul_ps(_mm512_load_ps(dmin), dx)));
      }
      slots[j] = _mm512_add_ps(slots[j], t);
    });
  }
};

// out = the slot sums of t_sb = I * (d * dx) - M * (dmin * dx), I = sum_g sc_g * isum_g, M = sum_g m_g * xsum_g
template <bool Five>
struct Q45KKernel {
  static constexpr int64_t kPickBlockBytes = Five ? 176 : 144;  // Int8Outliers: picks taken block by block
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nsb = cols / 256;
    constexpr int kBytes = Five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i one8 = _mm512_set1_epi8(1);
    const __m512i idx[4] = {scale_index(0, 16), scale_index(2, 16), scale_index(4, 16), scale_index(6, 16)};
    KTerms<NX, true> kt;
    for_nx<NX>([&](int j) QMM_INLINE { kt.slots[j] = _mm512_setzero_ps(); });
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kBytes;
      const int k = static_cast<int>(sb % 16);
      kt.d[k] = f16_at(blk);
      kt.dmin[k] = f16_at(blk + 2);
      if constexpr (NX == 1) prefetch(blk, kBytes);
      uint64_t sc, mn;
      k_scales(blk + 4, &sc, &mn);
      const __m128i mn8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // each min twice: 16 groups of 16
      const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const uint8_t* qs = blk + (Five ? 48 : 16);
      __m512i qh = _mm512_setzero_si512();
      if constexpr (Five) {
        const __m256i h = load256(blk + 16);
        qh = join(h, _mm256_srli_epi16(h, 1));
      }
      __m512i sumi[NX];
      for_nx<NX>([&](int j) QMM_INLINE { sumi[j] = _mm512_setzero_si512(); });
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load256(qs + 32 * c);
        __m512i q = join(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        if constexpr (Five) {
          q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(qh, one8), 4));
          qh = _mm512_srli_epi16(qh, 2);
        }
        const __m512i scv = _mm512_permutexvar_epi16(idx[c], sc16);
        for_nx<NX>([&](int j) QMM_INLINE {
          const __m512i x = load512(a[j].q + 256 * sb + 64 * c);
          sumi[j] = _mm512_add_epi32(sumi[j], _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), scv));
        });
      }
      for_nx<NX>([&](int j) QMM_INLINE {
        _mm512_store_si512(kt.iv[j][k], sumi[j]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(kt.mv[j][k]), _mm256_madd_epi16(load256(a[j].bs + 16 * sb), mins));
      });
      if (k == 15 || sb + 1 == nsb) kt.flush(k + 1, sb - k, a);
    }
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = hsum512(kt.slots[j]); });  // slot_tree's pairing
  }
};

// out = the slot sums of t_sb = I * (d * dx), I = sum_g sc_g * (isum_g - 32 * xsum_g), 16 groups of 16
struct Q6KKernel {
  static constexpr int64_t kPickBlockBytes = 210;  // Int8Outliers: picks taken block by block
  template <int NX>
  static void run(const uint8_t* w, int64_t cols, const ActRow* a, float* out) {
    const int64_t nsb = cols / 256;
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    const __m512i idx[4] = {scale_index(0, 8), scale_index(4, 8), scale_index(8, 8), scale_index(12, 8)};
    KTerms<NX, false> kt;
    for_nx<NX>([&](int j) QMM_INLINE { kt.slots[j] = _mm512_setzero_ps(); });
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * 210;
      if constexpr (NX == 1) prefetch(blk, 210);
      const int k = static_cast<int>(sb % 16);
      kt.d[k] = f16_at(blk + 208);
      const __m256i sc16 = _mm256_cvtepi8_epi16(load128(blk + 192));
      const __m512i sc16z = _mm512_zextsi256_si512(sc16);
      __m512i sumi[NX];
      for_nx<NX>([&](int j) QMM_INLINE { sumi[j] = _mm512_setzero_si512(); });
      for (int h = 0; h < 2; ++h) {
        const __m512i l = load512(blk + 64 * h);  // elements 0..31 and 32..63 of the half (low nibbles), then
        const __m256i hb = load256(blk + 128 + 32 * h);  // 64..95 and 96..127 (high nibbles)
        const __m512i hz = join(hb, _mm256_srli_epi16(hb, 2));
        const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(_mm512_and_si512(hz, m2), 4));
        const __m512i q23 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hz, 4), m2), 4));
        const __m512i s01 = _mm512_permutexvar_epi16(idx[2 * h], sc16z);
        const __m512i s23 = _mm512_permutexvar_epi16(idx[2 * h + 1], sc16z);
        for_nx<NX>([&](int j) QMM_INLINE {
          const int8_t* x = a[j].q + 256 * sb + 128 * h;
          sumi[j] = _mm512_add_epi32(sumi[j], _mm512_madd_epi16(_mm512_maddubs_epi16(q01, load512(x)), s01));
          sumi[j] = _mm512_add_epi32(sumi[j], _mm512_madd_epi16(_mm512_maddubs_epi16(q23, load512(x + 64)), s23));
        });
      }
      for_nx<NX>([&](int j) QMM_INLINE {
        const __m256i off = _mm256_madd_epi16(load256(a[j].bs + 16 * sb), sc16);
        _mm512_store_si512(kt.iv[j][k], _mm512_sub_epi32(sumi[j], _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5))));
      });
      if (k == 15 || sb + 1 == nsb) kt.flush(k + 1, sb - k, a);
    }
    for_nx<NX>([&](int j) QMM_INLINE { out[j] = hsum512(kt.slots[j]); });  // slot_tree's pairing
  }
};

// ---- prefill: panel GEMM for the quantized types ----------------------------------------------------------
//
// Each weight row is decoded to unsigned bytes u (element order) and its blocks' scales (qmatmul_panel.inc); 16 rows
// form a panel of 64-byte vectors (4 consecutive elements of each row), multiplied with each x row's 4 bytes
// broadcast: one dpbusd lane per weight row, each lane's integer block sum exact, the block's term (qmatmul.h)
// formed once per block for the 16 rows and added to the lane's accumulator, blocks in order.

#include "model/qmatmul_panel.inc"

// MR x rows x 16 weight rows over nblk activation blocks. panel: [k / 4][16 rows][4 bytes]; s: PanelScales.
struct PanelTile {
  static constexpr int kMr = 8;

  template <int MR, class P, bool Add>
  static void run(const uint8_t* panel, const PanelScales& s, int64_t nblk, const ActRow* const* xa,
                  float* const* out) {
    constexpr int kSteps = P::kG / 4;
    // Per x row and slot: the 16 weight rows' slot sums, in memory (block b adds to slot b % 16: the same slot again
    // 16 blocks later, so no add waits on the previous one); slots no block reaches stay +0.
    alignas(64) float slots[MR][kSlots][16];
    for (int64_t k = nblk; nblk > 1 && k < kSlots; ++k)
      for_nx<MR>([&](int x) QMM_INLINE { _mm512_store_ps(slots[x][k], _mm512_setzero_ps()); });
    for (int64_t b = 0; b < nblk; ++b) {
      __m512i isum[MR];
      for_nx<MR>([&](int x) QMM_INLINE { isum[x] = _mm512_setzero_si512(); });
      for (int g = 0; g < P::kGroups; ++g) {
        const int64_t g0 = b * P::kGroups + g;  // the group's index in the row
        const uint8_t* pg = panel + g0 * kSteps * 64;
        __m512i gsum[MR];
        for_nx<MR>([&](int x) QMM_INLINE { gsum[x] = _mm512_setzero_si512(); });
        for_nx<kSteps>([&](int t) QMM_INLINE {
          const __m512i wv = load512(pg + 64 * t);
          for_nx<MR>([&](int x) QMM_INLINE {
            int32_t x4;
            std::memcpy(&x4, xa[x]->q + g0 * P::kG + 4 * t, 4);
            gsum[x] = _mm512_dpbusd_epi32(gsum[x], wv, _mm512_set1_epi32(x4));
          });
        });
        if constexpr (P::kKind == PanelKind::Legacy) {
          for_nx<MR>([&](int x) QMM_INLINE { isum[x] = gsum[x]; });
        } else {
          const __m512i scv = load512(s.sc + 16 * g0);
          for_nx<MR>([&](int x) QMM_INLINE {
            __m512i v = gsum[x];
            if constexpr (P::kKind == PanelKind::Q6K) v = _mm512_sub_epi32(v, _mm512_set1_epi32(32 * xa[x]->bs[16 * b + g]));
            isum[x] = _mm512_add_epi32(isum[x], _mm512_mullo_epi32(v, scv));
          });
        }
      }
      const __m512 dv = _mm512_loadu_ps(s.d + 16 * b);
      for_nx<MR>([&](int x) QMM_INLINE {
        const ActRow& a = *xa[x];
        const __m512 dx = _mm512_set1_ps(a.d[b]);
        __m512i iv = isum[x];
        if constexpr (P::kKind == PanelKind::Legacy && P::kOffset != 0)
          iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(P::kOffset * a.xs[b]));
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_mul_ps(dv, dx));
        if constexpr (P::kKind == PanelKind::Legacy && P::kMin)
          t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_loadu_ps(s.m + 16 * b), _mm512_set1_ps(a.ds[b])));
        if constexpr (P::kKind == PanelKind::Q45K) {
          __m512i ms = _mm512_setzero_si512();
          for_nx<4>([&](int p) QMM_INLINE {
            ms = _mm512_add_epi32(ms, _mm512_madd_epi16(load512(s.mn + 16 * (4 * b + p)),
                                                        _mm512_set1_epi32(group_sum_pair(a, b, p))));
          });
          t = _mm512_sub_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(_mm512_loadu_ps(s.m + 16 * b), dx)));
        }
        float* slot = slots[x][b % kSlots];
        _mm512_store_ps(slot, _mm512_add_ps(b < kSlots ? _mm512_setzero_ps() : _mm512_load_ps(slot), t));
      });
    }
    if (nblk == 1) {  // one block (the outlier pairs): the tree of +0 + t and +0s is +0 + t
      for_nx<MR>([&](int x) QMM_INLINE {
        const __m512 v = _mm512_load_ps(slots[x][0]);
        _mm512_storeu_ps(out[x], Add ? _mm512_add_ps(_mm512_loadu_ps(out[x]), v) : v);
      });
      return;
    }
    // slot_tree, lane by lane
    for_nx<MR>([&](int x) QMM_INLINE {
      const auto sl = [&](int k) QMM_INLINE { return _mm512_load_ps(slots[x][k]); };
      __m512 t[8];
      for_nx<8>([&](int k) QMM_INLINE { t[k] = _mm512_add_ps(sl(k), sl(k + 8)); });
      __m512 u[4];
      for_nx<4>([&](int k) QMM_INLINE { u[k] = _mm512_add_ps(t[k], t[k + 4]); });
      _mm512_storeu_ps(out[x], _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])));
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

const Kernels kAvx512 = {
    row_kernel<FloatKernel<LoadF32>>, row_kernel<FloatKernel<LoadF16>>, row_kernel<FloatKernel<LoadBF16>>,
    row_kernel<LegacyKernel<Q4_0>>,   row_kernel<LegacyKernel<Q4_1>>,   row_kernel<LegacyKernel<Q5_0>>,
    row_kernel<LegacyKernel<Q5_1>>,   row_kernel<LegacyKernel<Q8_0>>,           row_kernel<Q45KKernel<false>>,
    row_kernel<Q45KKernel<true>>,     row_kernel<Q6KKernel>,
    tile_kernel<FloatTile<LoadF32>>,  tile_kernel<FloatTile<LoadF16>>,  tile_kernel<FloatTile<LoadBF16>>,
    kTileRows,
    panel_gemm<PanelTile, PanelType<PanelKind::Legacy, 8>, decode_legacy<Q4_0>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Legacy, 0, true>, decode_legacy<Q4_1>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Legacy, 16>, decode_legacy<Q5_0>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Legacy, 0, true>, decode_legacy<Q5_1>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Legacy, 128>, decode_legacy<Q8_0>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Q45K>, decode_q45k<false>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Q45K>, decode_q45k<true>>,
    panel_gemm<PanelTile, PanelType<PanelKind::Q6K>, decode_q6k>,
};

}  // namespace

const Kernels* avx512_kernels() {
  return &kAvx512;
}

}  // namespace tessera::model::qmm

#else

namespace tessera::model::qmm {
const Kernels* avx512_kernels() {
  return nullptr;
}
}  // namespace tessera::model::qmm

#endif
