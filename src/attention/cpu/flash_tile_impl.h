// tessera/attention/cpu/flash_tile_impl.h — internal: the query-tile kernel, generic over a SIMD policy.
//
// Included by exactly one translation unit per ISA (flash_tile_avx512.cpp, flash_tile_baseline.cpp), after
// that unit has defined its policy. Everything here has internal linkage (anonymous namespace) and calls no
// inline library function, so code compiled for AVX-512 can never be picked by the linker for a baseline
// caller.
//
// A SIMD policy S provides (vector_ops.h's ops of its ISA, plus this kernel's blocking and masking):
//   reg; kWidth (lanes); kRowVecs (row vectors per micro-kernel pass); kQkKeys (keys per QK^T micro-kernel);
//   kPvDims (head dims per PV micro-kernel); zero, set1, load, store, fmadd(a, b, c) = a * b + c, add, sub,
//   max; exp2(x) (0 for x <= -125, including -inf); zero_if_neg_inf(x); reduce_add(x) (the sum of the lanes);
//   widen_bf16(p), widen_f16(p) (kWidth contiguous 16-bit values from memory, as f32).
//
// Two paths share the block walk, the K/V packing and the masks: tiles of more than kFewRows rows keep rows
// in lanes (S^T, above); tiles of at most kFewRows rows (decode, and the last few rows of a prefill) keep
// head dims in lanes instead: per key a vectorised dot product with each row's query, then per row an online
// softmax over the block and an axpy of the block's values, so the work is proportional to the real rows.
#pragma once

#include <cstdint>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "attention/cpu/flash_tile.h"

namespace tessera::attn::cpu_detail {
namespace {

inline float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16 bits to f32, exact (subnormals, infinities and NaNs included): the scalar twin of the
// policies' widen_f16, for strided dims and row tails.
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | mant << 13;
  } else if (exp != 0) {
    u = sign | (exp + 112) << 23 | mant << 13;
  } else {
    // zero or subnormal: mant * 2^-24, exact in f32
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    uint32_t m;
    __builtin_memcpy(&m, &f, sizeof m);
    u = sign | m;
  }
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// n contiguous bf16 (kBf16) or f16 values to f32: policy S's widening kWidth at a time, the scalar twin for
// the tail.
template <class S, bool kBf16>
void widen_row(const uint16_t* src, float* dst, int n) {
  int i = 0;
  for (; i + S::kWidth <= n; i += S::kWidth)
    S::store(dst + i, kBf16 ? S::widen_bf16(src + i) : S::widen_f16(src + i));
  for (; i < n; ++i) dst[i] = kBf16 ? bf16_bits_to_f32(src[i]) : f16_bits_to_f32(src[i]);
}

// A SIMD policy from an ISA's vector ops (vector_ops.h) and the micro-kernels' blocking for its register file.
template <class Ops, int RowVecs, int QkKeys, int PvDims>
struct TilePolicy : Ops {
  static constexpr int kRowVecs = RowVecs;
  static constexpr int kQkKeys = QkKeys;
  static constexpr int kPvDims = PvDims;
};

template <class S>
class FlashTile {
  using reg = typename S::reg;
  static constexpr int W = S::kWidth;
  static constexpr int NV = kTileRows / W;  // vectors per column of 64 rows
  static constexpr int RC = S::kRowVecs;
  static constexpr int NK = S::kQkKeys;
  static constexpr int ND = S::kPvDims;
  static_assert(kTileRows % W == 0 && NV % RC == 0, "policy does not tile 64 rows");
  static constexpr float kNegInf = -__builtin_inff();

 public:
  static void run(const TileJob& job, float* scratch) {
    FlashTile t(job, scratch);
    t.execute();
  }

 private:
  FlashTile(const TileJob& job, float* scratch) : job_(job), d_(job.head_dim) {
    const int64_t d = d_;
    // Packed rows span an odd number of cache lines, so the 64 rows of a block fall in 64 different L1 sets
    // (the PV kernel reads one line from every row of the block at a time).
    dpad_ = (d + 15) / 16 * 16;
    if ((dpad_ / 16) % 2 == 0) dpad_ += 16;
    qt_ = scratch;
    ot_ = qt_ + d * kTileRows;
    st_ = ot_ + d * kTileRows;
    m_ = st_ + kKeyBlock * kTileRows;
    l_ = m_ + kTileRows;
    alpha_ = l_ + kTileRows;
    kbuf_ = alpha_ + kTileRows;
    vbuf_ = kbuf_ + kKeyBlock * dpad_;
    kt_ = vbuf_ + kKeyBlock * dpad_;
    zrow_ = kt_ + d * kKeyBlock;
    // Only the row vectors that hold real rows are computed (in steps of RC).
    const int row_vecs = (job.rows + W - 1) / W;
    nvu_ = (row_vecs + RC - 1) / RC * RC;
  }

  void execute() {
    if (job_.rows * job_.heads <= kFewRows) {
      execute_few();
      return;
    }
    pack_queries();
    for (int i = 0; i < d_ * kTileRows; ++i) ot_[i] = 0;
    for (int r = 0; r < kTileRows; ++r) {
      m_[r] = kNegInf;
      l_[r] = 0;
    }
    // Ranges block by block from their start, then columns 64 at a time.
    for (BlockRef b = first_block(); b.n > 0; b = following(b)) block(b);
    finish(1, kTileRows);
  }

  // A block of keys: contiguous positions [first, first + n) when pos is null, else pos[0..n). n == 0: none.
  struct BlockRef {
    const int32_t* pos = nullptr;
    int32_t first = 0;
    int n = 0;
    int32_t index = 0;  // range index (contiguous) or column offset (gathered)
  };

  BlockRef range_block(int32_t ri, int32_t j) const {
    const KeyRange kr = job_.ranges[ri];
    return BlockRef{nullptr, j, kr.end - j < kKeyBlock ? kr.end - j : kKeyBlock, ri};
  }
  BlockRef column_block(int32_t ci) const {
    if (ci >= job_.num_columns) return BlockRef{};
    const int n = job_.num_columns - ci < kKeyBlock ? job_.num_columns - ci : kKeyBlock;
    return BlockRef{job_.columns + ci, 0, n, ci};
  }
  BlockRef first_block() const {
    return job_.num_ranges > 0 ? range_block(0, job_.ranges[0].begin) : column_block(0);
  }
  BlockRef following(const BlockRef& b) const {
    if (b.pos != nullptr) return column_block(b.index + b.n);
    if (b.first + b.n < job_.ranges[b.index].end) return range_block(b.index, b.first + b.n);
    if (b.index + 1 < job_.num_ranges) return range_block(b.index + 1, job_.ranges[b.index + 1].begin);
    return column_block(0);
  }

  // Q^T[c][r] = scale * log2(e) * q[r][c] (scores in base 2, so the softmax needs exp2 only); rows beyond
  // job.rows are zero.
  void pack_queries() {
    const float scale = job_.scale * 1.44269504088896341f;
    for (int r = 0; r < kTileRows; ++r) {
      if (r >= job_.rows) {
        for (int c = 0; c < d_; ++c) qt_[c * kTileRows + r] = 0;
        continue;
      }
      if (job_.q_bf16) {
        const uint16_t* q = static_cast<const uint16_t*>(job_.q) + r * job_.q_rs;
        for (int c = 0; c < d_; ++c) qt_[c * kTileRows + r] = scale * bf16_bits_to_f32(q[c * job_.q_cs]);
      } else {
        const float* q = static_cast<const float*>(job_.q) + r * job_.q_rs;
        for (int c = 0; c < d_; ++c) qt_[c * kTileRows + r] = scale * q[c * job_.q_cs];
      }
    }
  }

  // Can f32 rows at this stride (in floats) be read in place? The 64 rows of a block must spread over the L1
  // sets: with a stride of L cache lines, gcd(L, 64) rows share a set, and the PV kernel walks one line of
  // every row while P^T occupies 4 lines per set (L1: 64 sets x 12 ways). Token-major multi-head layouts
  // (stride heads x d) and d = 128 fail this and are copied.
  static bool direct_ok(int64_t rs) {
    if (rs <= 0) return false;
    if (rs % 16 != 0) return true;  // rows not line-aligned: they drift across sets
    int64_t lines = rs / 16, g = 1;
    while (g < 64 && lines % (2 * g) == 0) g *= 2;  // gcd(lines, 64)
    return g <= 4;
  }

  // f32 rows of the block's keys (or values): straight from the tensor when it is f32 with unit dim stride,
  // the keys are contiguous and the stride is cache-friendly, else converted or gathered into buf. Returns
  // the base and sets the row stride.
  const float* block_rows(const void* base, int64_t rs, int64_t cs, KvElem elem, const int32_t* pos, int32_t first,
                          int n, float* buf, int64_t* ld) const {
    if (elem == KvElem::F32 && cs == 1 && pos == nullptr && direct_ok(rs)) {
      *ld = rs;
      return static_cast<const float*>(base) + first * rs;
    }
    for (int i = 0; i < n; ++i) {
      const int64_t p = pos != nullptr ? pos[i] : first + i;
      float* dst = buf + i * dpad_;
      if (elem != KvElem::F32) {
        const uint16_t* src = static_cast<const uint16_t*>(base) + p * rs;
        const bool bf = elem == KvElem::BF16;
        if (cs == 1) {
          if (bf)
            widen_row<S, true>(src, dst, d_);
          else
            widen_row<S, false>(src, dst, d_);
        } else {
          for (int c = 0; c < d_; ++c) dst[c] = bf ? bf16_bits_to_f32(src[c * cs]) : f16_bits_to_f32(src[c * cs]);
        }
      } else {
        const float* src = static_cast<const float*>(base) + p * rs;
        if (cs == 1) {
          __builtin_memcpy(dst, src, static_cast<size_t>(d_) * sizeof(float));
        } else {
          for (int c = 0; c < d_; ++c) dst[c] = src[c * cs];
        }
      }
    }
    *ld = dpad_;
    return buf;
  }

  // The micro-kernel that qk and pv share: acc[i][r] += A^T[s][r] * b[i][s * b_step] for the steps s in
  // order (A^T's rows kTileRows floats apart, RC row vectors; per step the N columns i in order), then
  // out^T[i][r] = acc[i][r] for the N columns (rows kTileRows floats apart).
  template <int N>
  [[gnu::always_inline]] static inline void rank1_updates(reg (&acc)[N][RC], const float* at,
                                                         const float* const (&b)[N], int64_t b_step, int steps,
                                                         float* out) {
    for (int s = 0; s < steps; ++s) {
      reg a[RC];
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) a[r] = S::load(at + s * kTileRows + r * W);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) {
        const reg x = S::set1(b[i][s * b_step]);
#pragma GCC unroll 8
        for (int r = 0; r < RC; ++r) acc[i][r] = S::fmadd(a[r], x, acc[i][r]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) S::store(out + i * kTileRows + r * W, acc[i][r]);
  }

  // S^T[i][r] = sum_c K[i][c] * Q^T[c][r] for NKK keys and RC row vectors: NKK * RC accumulators.
  template <int NKK>
  static void qk(const float* qt, const float* k, int64_t ldk, int d, float* st) {
    reg acc[NKK][RC];
#pragma GCC unroll 8
    for (int i = 0; i < NKK; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) acc[i][r] = S::zero();
    const float* kr[NKK];
#pragma GCC unroll 8
    for (int i = 0; i < NKK; ++i) kr[i] = k + i * ldk;
    rank1_updates<NKK>(acc, qt, kr, 1, d, st);
  }

  template <int NKK>
  static void qk_tail(int n, const float* qt, const float* k, int64_t ldk, int d, float* st) {
    if constexpr (NKK > 0) {
      if (n == NKK) {
        qk<NKK>(qt, k, ldk, d, st);
      } else {
        qk_tail<NKK - 1>(n, qt, k, ldk, d, st);
      }
    }
  }

  // O^T[c][r] = alpha[r] * O^T[c][r] + sum_j V[j][c] * P^T[j][r] for NDD dims and RC row vectors.
  template <int NDD>
  static void pv(float* ot, const float* pt, const float* v, int64_t ldv, int n, const float* alpha) {
    reg acc[NDD][RC];
#pragma GCC unroll 8
    for (int r = 0; r < RC; ++r) {
      const reg a = S::load(alpha + r * W);
#pragma GCC unroll 8
      for (int i = 0; i < NDD; ++i) acc[i][r] = S::mul(S::load(ot + i * kTileRows + r * W), a);
    }
    const float* vc[NDD];  // the dims' columns of V
#pragma GCC unroll 8
    for (int i = 0; i < NDD; ++i) vc[i] = v + i;
    rank1_updates<NDD>(acc, pt, vc, ldv, n, ot);
  }

  template <int NDD>
  static void pv_tail(int nd, float* ot, const float* pt, const float* v, int64_t ldv, int n,
                      const float* alpha) {
    if constexpr (NDD > 0) {
      if (nd == NDD) {
        pv<NDD>(ot, pt, v, ldv, n, alpha);
      } else {
        pv_tail<NDD - 1>(nd, ot, pt, v, ldv, n, alpha);
      }
    }
  }

  // Online softmax over the block's n scores per row (NVU row vectors): new running max, rescale factors,
  // P^T = exp2(S^T - max) in place, running sums.
  template <int NVU>
  void softmax(int n) {
    reg mx[NVU];
#pragma GCC unroll 8
    for (int v = 0; v < NVU; ++v) mx[v] = S::set1(kNegInf);
    for (int i = 0; i < n; ++i) {
#pragma GCC unroll 8
      for (int v = 0; v < NVU; ++v) mx[v] = S::max(mx[v], S::load(st_ + i * kTileRows + v * W));
    }
    reg mu[NVU], sum[NVU];
#pragma GCC unroll 8
    for (int v = 0; v < NVU; ++v) {
      const reg m_old = S::load(m_ + v * W);
      const reg m_new = S::max(m_old, mx[v]);
      mu[v] = S::zero_if_neg_inf(m_new);  // a row with no key so far: exponents stay -inf, weights 0
      S::store(alpha_ + v * W, S::exp2(S::sub(m_old, mu[v])));
      S::store(m_ + v * W, m_new);
      sum[v] = S::zero();
    }
    for (int i = 0; i < n; ++i) {
#pragma GCC unroll 8
      for (int v = 0; v < NVU; ++v) {
        float* s = st_ + i * kTileRows + v * W;
        const reg p = S::exp2(S::sub(S::load(s), mu[v]));
        S::store(s, p);
        sum[v] = S::add(sum[v], p);
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NVU; ++v) {
      S::store(l_ + v * W, S::fmadd(S::load(l_ + v * W), S::load(alpha_ + v * W), sum[v]));
    }
  }

  template <int NVU>
  void softmax_dispatch(int n) {
    if constexpr (NVU > 0) {
      if (nvu_ == NVU) {
        softmax<NVU>(n);
      } else {
        softmax_dispatch<NVU - RC>(n);
      }
    }
  }

  // One block of n keys: contiguous positions [first, first + n) when pos is null, else pos[0..n).
  // One block of keys.
  void block(const BlockRef& b) {
    const int32_t* pos = b.pos;
    const int32_t first = b.first;
    const int n = b.n;
    int64_t ldk = 0, ldv = 0;
    const float* kb = block_rows(job_.k, job_.k_rs, job_.k_cs, job_.k_elem, pos, first, n, kbuf_, &ldk);
    const float* vb = block_rows(job_.v, job_.v_rs, job_.v_cs, job_.v_elem, pos, first, n, vbuf_, &ldv);

    for (int ch = 0; ch < nvu_; ch += RC) {
      int i = 0;
      for (; i + NK <= n; i += NK) qk<NK>(qt_ + ch * W, kb + i * ldk, ldk, d_, st_ + i * kTileRows + ch * W);
      if (i < n) qk_tail<NK - 1>(n - i, qt_ + ch * W, kb + i * ldk, ldk, d_, st_ + i * kTileRows + ch * W);
    }

    // Causal mask, only where some key lies beyond the tile's first row: key p is hidden from rows r < p -
    // first_pos.
    const int32_t last = pos != nullptr ? pos[n - 1] : first + n - 1;
    if (last > job_.first_pos) {
      for (int i = 0; i < n; ++i) {
        const int32_t p = pos != nullptr ? pos[i] : first + i;
        int32_t hidden = p - job_.first_pos;
        if (hidden <= 0) continue;
        if (hidden > kTileRows) hidden = kTileRows;
        for (int r = 0; r < hidden; ++r) st_[i * kTileRows + r] = kNegInf;
      }
    }

    // Window mask, only where some key lies below the last row's window: key p is hidden from rows
    // r >= p - first_pos + window. Keys ascend, so the first key that no row hides ends the loop.
    if (job_.window > 0) {
      const int32_t rows_end = nvu_ * W;
      for (int i = 0; i < n; ++i) {
        const int32_t p = pos != nullptr ? pos[i] : first + i;
        int32_t from = p - job_.first_pos + job_.window;
        if (from >= rows_end) break;
        if (from < 0) from = 0;
        for (int r = from; r < rows_end; ++r) st_[i * kTileRows + r] = kNegInf;
      }
    }

    softmax_dispatch<NV>(n);

    for (int ch = 0; ch < nvu_; ch += RC) {
      int c = 0;
      for (; c + ND <= d_; c += ND)
        pv<ND>(ot_ + c * kTileRows + ch * W, st_ + ch * W, vb + c, ldv, n, alpha_ + ch * W);
      if (c < d_)
        pv_tail<ND - 1>(d_ - c, ot_ + c * kTileRows + ch * W, st_ + ch * W, vb + c, ldv, n, alpha_ + ch * W);
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // Few rows (rows <= kFewRows): qt_ holds the scaled queries row-major [R][d], ot_ the output [R][d], st_
  // the scores of the block [R][kKeyBlock].

  // Rows of the few-row path are (head i, row r) pairs, i * job.rows + r: the item's heads share K and V.
  void execute_few() {
    switch (job_.rows * job_.heads) {
      case 1:
        few<1>();
        break;
      case 2:
        few<2>();
        break;
      case 3:
        few<3>();
        break;
      default:
        few<4>();
        break;
    }
  }

  template <int R>
  void few() {
    static_assert(R <= kFewRows, "few-row path: too many rows");
    const float scale = job_.scale * 1.44269504088896341f;
    for (int r = 0; r < R; ++r) {
      float* qr = qt_ + r * d_;
      const int64_t at = (r / job_.rows) * job_.q_hs + (r % job_.rows) * job_.q_rs;
      if (job_.q_bf16) {
        const uint16_t* q = static_cast<const uint16_t*>(job_.q) + at;
        for (int c = 0; c < d_; ++c) qr[c] = scale * bf16_bits_to_f32(q[c * job_.q_cs]);
      } else {
        const float* q = static_cast<const float*>(job_.q) + at;
        for (int c = 0; c < d_; ++c) qr[c] = scale * q[c * job_.q_cs];
      }
      m_[r] = kNegInf;
      l_[r] = 0;
    }
    for (int i = 0; i < R * d_; ++i) ot_[i] = 0;
    for (int c = 0; c < d_; ++c) zrow_[c] = 0;
    for (BlockRef b = first_block(); b.n > 0; b = following(b)) few_block<R>(b);
    finish(d_, 1);
  }

  // The few-row path reads key and value rows in their element type: kF32, kBf16, kF16 (converted in registers as
  // they are loaded).
  static constexpr int kF32 = 0, kBf16 = 1, kF16 = 2;
  template <int E>
  static reg load_elems(const void* row, int c) {
    if constexpr (E == kF32) {
      return S::load(static_cast<const float*>(row) + c);
    } else if constexpr (E == kBf16) {
      return S::widen_bf16(static_cast<const uint16_t*>(row) + c);
    } else {
      return S::widen_f16(static_cast<const uint16_t*>(row) + c);
    }
  }
  template <int E>
  static float elem_at(const void* row, int c) {
    if constexpr (E == kF32) {
      return static_cast<const float*>(row)[c];
    } else if constexpr (E == kBf16) {
      return bf16_bits_to_f32(static_cast<const uint16_t*>(row)[c]);
    } else {
      return f16_bits_to_f32(static_cast<const uint16_t*>(row)[c]);
    }
  }

  // The rows of the block's keys (or values): in place (paged blocks or the tensor, unit dim stride: any element
  // type), else converted to f32 into buf. Returns the element type of the rows handed out.
  int few_rows_of(const void* base, const void* const* blocks, int64_t rs, int64_t cs, KvElem elem, const BlockRef& b,
                  float* buf, const void** rows) const {
    const int code = elem == KvElem::F32 ? kF32 : elem == KvElem::BF16 ? kBf16 : kF16;
    const int64_t es = elem == KvElem::F32 ? 4 : 2;
    if (blocks != nullptr) {  // paged (contiguous keys only): the rows' addresses a block at a time
      const int64_t B = job_.block_tokens;
      int64_t blk = b.first / B, off = b.first % B;
      for (int i = 0; i < b.n; ++i) {
        rows[i] = static_cast<const char*>(blocks[blk]) + off * rs * es;
        if (++off == B) {
          off = 0;
          ++blk;
        }
      }
      return code;
    }
    if (cs == 1) {
      for (int i = 0; i < b.n; ++i)
        rows[i] = static_cast<const char*>(base) + (b.pos != nullptr ? b.pos[i] : b.first + i) * rs * es;
      return code;
    }
    int64_t ld = 0;
    const float* packed = block_rows(base, rs, cs, elem, b.pos, b.first, b.n, buf, &ld);
    for (int i = 0; i < b.n; ++i) rows[i] = packed + i * ld;
    return kF32;
  }

  // st_[r][0 .. n) = q_r . k_j for the block's keys, in the wide path's order (a query tile's lanes): per key one
  // chain of fused multiply-adds over the head dims in ascending order from +0, so a row's scores are the same
  // bits here as in a tile of 64 rows. Keys in lanes: the block's keys transposed into kt_ (zero past n), then per
  // dim one broadcast of each row's query times a vector of keys; KV vectors of keys at a time.
  template <int R, int E>
  void few_qk(const void* const* krow, int n) {
    constexpr int KV = 4;
    const int nv = (n + W - 1) / W * W;
    const int dv = d_ / W * W;
    const int64_t row_bytes = static_cast<int64_t>(d_) * (E == kF32 ? 4 : 2);
    for (int j0 = 0; j0 < nv; j0 += W) {
      const char* first = static_cast<const char*>(krow[j0]);
      if (j0 + W <= n && static_cast<const char*>(krow[j0 + W - 1]) == first + (W - 1) * row_bytes) {
        // W consecutive rows of one block (or tensor): one base pointer.
        for (int c = 0; c < dv; c += W) {
          reg x[W];
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) x[i] = load_elems<E>(first + i * row_bytes, c);
          S::transpose(x, kt_ + c * kKeyBlock + j0, kKeyBlock);
        }
        for (int c = dv; c < d_; ++c)
          for (int i = 0; i < W; ++i) kt_[c * kKeyBlock + j0 + i] = elem_at<E>(first + i * row_bytes, c);
        continue;
      }
      const void* src[W];
      for (int i = 0; i < W; ++i) src[i] = j0 + i < n ? krow[j0 + i] : zrow_;  // zero bits: 0 in every type
      for (int c = 0; c < dv; c += W) {
        reg x[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) x[i] = load_elems<E>(src[i], c);
        S::transpose(x, kt_ + c * kKeyBlock + j0, kKeyBlock);
      }
      for (int c = dv; c < d_; ++c)
        for (int i = 0; i < W; ++i) kt_[c * kKeyBlock + j0 + i] = elem_at<E>(src[i], c);
    }
    for (int j0 = 0; j0 < nv; j0 += KV * W) {
      const int nk = (nv - j0) / W < KV ? (nv - j0) / W : KV;
      reg acc[R][KV];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int x = 0; x < KV; ++x) acc[r][x] = S::zero();
      const float* kt = kt_ + j0;
      if (nk == KV) {
        for (int c = 0; c < d_; ++c) {
          reg kv[KV];
#pragma GCC unroll 4
          for (int x = 0; x < KV; ++x) kv[x] = S::load(kt + c * kKeyBlock + x * W);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const reg q = S::set1(qt_[r * d_ + c]);
#pragma GCC unroll 4
            for (int x = 0; x < KV; ++x) acc[r][x] = S::fmadd(q, kv[x], acc[r][x]);
          }
        }
      } else {
        for (int c = 0; c < d_; ++c) {
          for (int x = 0; x < nk; ++x) {
            const reg kv = S::load(kt + c * kKeyBlock + x * W);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[r][x] = S::fmadd(S::set1(qt_[r * d_ + c]), kv, acc[r][x]);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < nk; ++x) S::store(st_ + r * kKeyBlock + j0 + x * W, acc[r][x]);
    }
  }

  // ot_[r][c .. c + NDV * W) = alpha_r * ot_[r][..] + sum_j P[r][j] v_j[..].
  template <int R, int NDV, int E>
  void few_pv(const void* const* vrow, int n, int c) {
    reg acc[R][NDV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const reg a = S::set1(alpha_[r]);
#pragma GCC unroll 8
      for (int x = 0; x < NDV; ++x) acc[r][x] = S::mul(S::load(ot_ + r * d_ + c + x * W), a);
    }
    for (int j = 0; j < n; ++j) {
      reg v[NDV];
#pragma GCC unroll 8
      for (int x = 0; x < NDV; ++x) v[x] = load_elems<E>(vrow[j], c + x * W);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const reg p = S::set1(st_[r * kKeyBlock + j]);
#pragma GCC unroll 8
        for (int x = 0; x < NDV; ++x) acc[r][x] = S::fmadd(p, v[x], acc[r][x]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int x = 0; x < NDV; ++x) S::store(ot_ + r * d_ + c + x * W, acc[r][x]);
  }

  template <int R>
  void few_block(const BlockRef& b) {
    const void* krow[kKeyBlock];
    const void* vrow[kKeyBlock];
    const int ek = few_rows_of(job_.k, job_.k_blocks, job_.k_rs, job_.k_cs, job_.k_elem, b, kbuf_, krow);
    const int ev = few_rows_of(job_.v, job_.v_blocks, job_.v_rs, job_.v_cs, job_.v_elem, b, vbuf_, vrow);
    if (ek == kF32 && ev == kF32) return few_block_as<R, kF32, kF32>(b, krow, vrow);
    if (ek == kF16 && ev == kF16) return few_block_as<R, kF16, kF16>(b, krow, vrow);
    if (ek == kBf16 && ev == kBf16) return few_block_as<R, kBf16, kBf16>(b, krow, vrow);
    // Mixed element types (the engine makes none): both as f32 rows.
    to_f32(ek, kbuf_, krow, b.n);
    to_f32(ev, vbuf_, vrow, b.n);
    few_block_as<R, kF32, kF32>(b, krow, vrow);
  }

  // Rows of element type e converted to f32 into buf (rows repointed there).
  void to_f32(int e, float* buf, const void** rows, int n) const {
    if (e == kF32) return;
    for (int i = 0; i < n; ++i) {
      float* dst = buf + i * dpad_;
      for (int c = 0; c < d_; ++c) dst[c] = e == kBf16 ? elem_at<kBf16>(rows[i], c) : elem_at<kF16>(rows[i], c);
      rows[i] = dst;
    }
  }

  template <int R, int EK, int EV>
  void few_block_as(const BlockRef& b, const void* const* krow, const void* const* vrow) {
    const int n = b.n;
    few_qk<R, EK>(krow, n);

    // Causal and window masks, only when the block holds a key some row does not see: key p is visible to
    // row r iff p - window < first_pos + r (window > 0) and p <= first_pos + r.
    const int32_t lo_key = b.pos != nullptr ? b.pos[0] : b.first;
    const int32_t hi_key = b.pos != nullptr ? b.pos[n - 1] : b.first + n - 1;
    if (hi_key > job_.first_pos ||
        (job_.window > 0 && lo_key <= job_.first_pos + job_.rows - 1 - job_.window)) {
      int32_t row_pos[R];
      for (int r = 0; r < R; ++r) row_pos[r] = job_.first_pos + r % job_.rows;
      for (int k = 0; k < n; ++k) {
        const int32_t p = b.pos != nullptr ? b.pos[k] : b.first + k;
        for (int r = 0; r < R; ++r) {
          if (p > row_pos[r] || (job_.window > 0 && row_pos[r] - p >= job_.window))
            st_[r * kKeyBlock + k] = kNegInf;
        }
      }
    }

    // Online softmax per row over the block (padded with -inf to whole vectors).
    const int nv = (n + W - 1) / W * W;
    alignas(64) float lane[W];
    for (int r = 0; r < R; ++r) {
      float* sr = st_ + r * kKeyBlock;
      for (int k = n; k < nv; ++k) sr[k] = kNegInf;
      reg mx = S::set1(kNegInf);
      for (int k = 0; k < nv; k += W) mx = S::max(mx, S::load(sr + k));
      S::store(lane, mx);
      float m_new = m_[r];
      for (int x = 0; x < W; ++x) m_new = lane[x] > m_new ? lane[x] : m_new;
      const float mu = m_new == kNegInf ? 0.0f : m_new;  // a row with no key so far: weights stay 0
      S::store(lane, S::exp2(S::set1(m_[r] - mu)));
      alpha_[r] = lane[0];
      m_[r] = m_new;
      const reg muv = S::set1(mu);
      for (int k = 0; k < nv; k += W) S::store(sr + k, S::exp2(S::sub(S::load(sr + k), muv)));
    }
    // The wide path's order: each row's block weights added one key after the other from +0 (the rows' chains side
    // by side), then one fused multiply-add into the running sum.
    float sum[R];
    for (int r = 0; r < R; ++r) sum[r] = 0;
    for (int k = 0; k < n; ++k)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sum[r] += st_[r * kKeyBlock + k];
    for (int r = 0; r < R; ++r) l_[r] = __builtin_fmaf(l_[r], alpha_[r], sum[r]);

    constexpr int kChunk = 4;  // vectors of head dims per PV pass: R * kChunk accumulators
    const int dv = d_ / W * W;
    int c = 0;
    for (; c + kChunk * W <= dv; c += kChunk * W) few_pv<R, kChunk, EV>(vrow, n, c);
    for (; c < dv; c += W) few_pv<R, 1, EV>(vrow, n, c);
    for (; c < d_; ++c) {
      for (int r = 0; r < R; ++r) {
        float x = ot_[r * d_ + c] * alpha_[r];
        for (int j = 0; j < n; ++j) x = __builtin_fmaf(st_[r * kKeyBlock + j], elem_at<EV>(vrow[j], c), x);
        ot_[r * d_ + c] = x;
      }
    }
  }

  // Normalises and writes the rows; the unnormalised output of row r, dim c is at ot_[r * ot_rs + c * ot_cs].
  // Rows are (head, row) pairs as in the few-row path (one head on the other).
  void finish(int64_t ot_rs, int64_t ot_cs) {
    for (int r = 0; r < job_.rows * job_.heads; ++r) {
      const int64_t hh = r / job_.rows, rr = r % job_.rows;
      float* o = job_.out + hh * job_.out_hs + rr * job_.out_rs;
      float* lse = job_.lse != nullptr ? job_.lse + hh * job_.lse_hs + rr * job_.lse_rs : nullptr;
      if (m_[r] == kNegInf) {  // the row saw no key
        for (int c = 0; c < d_; ++c) o[c * job_.out_cs] = 0;
        if (lse != nullptr) *lse = kNegInf;
        continue;
      }
      const float inv = 1.0f / l_[r];
      for (int c = 0; c < d_; ++c) o[c * job_.out_cs] = ot_[r * ot_rs + c * ot_cs] * inv;
      if (lse != nullptr) *lse = (m_[r] + __builtin_log2f(l_[r])) * 0.693147180559945309f;
    }
  }

  const TileJob& job_;
  int d_;
  int64_t dpad_ = 0;
  int nvu_ = 0;
  float* qt_ = nullptr;     // [d][64]  scaled queries, transposed (few rows: [R][d])
  float* ot_ = nullptr;     // [d][64]  unnormalised output, transposed (few rows: [R][d])
  float* st_ = nullptr;     // [64][64] scores, then probabilities, transposed (key-major; few rows: [R][64])
  float* m_ = nullptr;      // [64] running max of scaled scores (base 2)
  float* l_ = nullptr;      // [64] running sum of exp2(score - max)
  float* alpha_ = nullptr;  // [64] rescale factor of the current block
  float* kbuf_ = nullptr;   // [64][dpad] packed keys (dpad: d rounded up to an odd number of cache lines)
  float* vbuf_ = nullptr;   // [64][dpad] packed values
  float* kt_ = nullptr;     // [d][64] the few-row path's keys, transposed (key j of the block in lane j)
  float* zrow_ = nullptr;   // [d] zeros (the few-row path's keys past the block's end)
};

// FlashTile<S>::run with flush-to-zero / denormals-are-zero where the target has SSE's control register: tiny
// products must not take microcode assists.
template <class S>
void run_tile_flushing_denormals(const TileJob& job, float* scratch) {
#if defined(__SSE__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  FlashTile<S>::run(job, scratch);
  _mm_setcsr(csr);
#else
  FlashTile<S>::run(job, scratch);
#endif
}

}  // namespace
}  // namespace tessera::attn::cpu_detail
