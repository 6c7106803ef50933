// tessera/attention/cpu/flash_tile_impl.h — internal: the query-tile kernel, generic over a SIMD policy.
//
// Included by exactly one translation unit per ISA (flash_tile_avx512.cpp, flash_tile_baseline.cpp), after
// that unit has defined its policy. Everything here has internal linkage (anonymous namespace) and calls no
// inline library function, so code compiled for AVX-512 can never be picked by the linker for a baseline
// caller.
//
// A SIMD policy S provides:
//   reg; kWidth (lanes); kRowVecs (row vectors per micro-kernel pass); kQkKeys (keys per QK^T micro-kernel);
//   kPvDims (head dims per PV micro-kernel); zero, set1, load, store, fmadd(a, b, c) = a * b + c, add, sub,
//   max; exp2(x) (0 for x <= -125, including -inf); zero_if_neg_inf(x); cvt_bf16(src, dst, n) (n contiguous
//   values).
#pragma once

#include <cstdint>

#include "attention/cpu/flash_tile.h"

namespace tessera::attn::cpu_detail {
namespace {

inline float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

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
    // Only the row vectors that hold real rows are computed (in steps of RC).
    const int row_vecs = (job.rows + W - 1) / W;
    nvu_ = (row_vecs + RC - 1) / RC * RC;
  }

  void execute() {
    pack_queries();
    for (int i = 0; i < d_ * kTileRows; ++i) ot_[i] = 0;
    for (int r = 0; r < kTileRows; ++r) {
      m_[r] = kNegInf;
      l_[r] = 0;
    }
    // Ranges block by block from their start, then columns 64 at a time.
    for (BlockRef b = first_block(); b.n > 0; b = following(b)) block(b);
    finish();
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
  const float* block_rows(const void* base, int64_t rs, int64_t cs, bool is_bf16, const int32_t* pos,
                          int32_t first, int n, float* buf, int64_t* ld) const {
    if (!is_bf16 && cs == 1 && pos == nullptr && direct_ok(rs)) {
      *ld = rs;
      return static_cast<const float*>(base) + first * rs;
    }
    for (int i = 0; i < n; ++i) {
      const int64_t p = pos != nullptr ? pos[i] : first + i;
      float* dst = buf + i * dpad_;
      if (is_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(base) + p * rs;
        if (cs == 1) {
          S::cvt_bf16(src, dst, d_);
        } else {
          for (int c = 0; c < d_; ++c) dst[c] = bf16_bits_to_f32(src[c * cs]);
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
    for (int c = 0; c < d; ++c) {
      reg q[RC];
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) q[r] = S::load(qt + c * kTileRows + r * W);
#pragma GCC unroll 8
      for (int i = 0; i < NKK; ++i) {
        const reg b = S::set1(kr[i][c]);
#pragma GCC unroll 8
        for (int r = 0; r < RC; ++r) acc[i][r] = S::fmadd(q[r], b, acc[i][r]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NKK; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) S::store(st + i * kTileRows + r * W, acc[i][r]);
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
    for (int j = 0; j < n; ++j) {
      reg p[RC];
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) p[r] = S::load(pt + j * kTileRows + r * W);
      const float* vr = v + j * ldv;
#pragma GCC unroll 8
      for (int i = 0; i < NDD; ++i) {
        const reg b = S::set1(vr[i]);
#pragma GCC unroll 8
        for (int r = 0; r < RC; ++r) acc[i][r] = S::fmadd(p[r], b, acc[i][r]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NDD; ++i)
#pragma GCC unroll 8
      for (int r = 0; r < RC; ++r) S::store(ot + i * kTileRows + r * W, acc[i][r]);
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
    const float* kb = block_rows(job_.k, job_.k_rs, job_.k_cs, job_.k_bf16, pos, first, n, kbuf_, &ldk);
    const float* vb = block_rows(job_.v, job_.v_rs, job_.v_cs, job_.v_bf16, pos, first, n, vbuf_, &ldv);

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

    softmax_dispatch<NV>(n);

    for (int ch = 0; ch < nvu_; ch += RC) {
      int c = 0;
      for (; c + ND <= d_; c += ND)
        pv<ND>(ot_ + c * kTileRows + ch * W, st_ + ch * W, vb + c, ldv, n, alpha_ + ch * W);
      if (c < d_)
        pv_tail<ND - 1>(d_ - c, ot_ + c * kTileRows + ch * W, st_ + ch * W, vb + c, ldv, n, alpha_ + ch * W);
    }
  }

  void finish() {
    for (int r = 0; r < job_.rows; ++r) {
      float* o = job_.out + r * job_.out_rs;
      if (m_[r] == kNegInf) {  // the row saw no key
        for (int c = 0; c < d_; ++c) o[c * job_.out_cs] = 0;
        if (job_.lse != nullptr) job_.lse[r * job_.lse_rs] = kNegInf;
        continue;
      }
      const float inv = 1.0f / l_[r];
      for (int c = 0; c < d_; ++c) o[c * job_.out_cs] = ot_[c * kTileRows + r] * inv;
      if (job_.lse != nullptr)
        job_.lse[r * job_.lse_rs] = (m_[r] + __builtin_log2f(l_[r])) * 0.693147180559945309f;
    }
  }

  const TileJob& job_;
  int d_;
  int64_t dpad_ = 0;
  int nvu_ = 0;
  float* qt_ = nullptr;     // [d][64]  scaled queries, transposed
  float* ot_ = nullptr;     // [d][64]  unnormalised output, transposed
  float* st_ = nullptr;     // [64][64] scores, then probabilities, transposed (key-major)
  float* m_ = nullptr;      // [64] running max of scaled scores (base 2)
  float* l_ = nullptr;      // [64] running sum of exp2(score - max)
  float* alpha_ = nullptr;  // [64] rescale factor of the current block
  float* kbuf_ = nullptr;   // [64][dpad] packed keys (dpad: d rounded up to an odd number of cache lines)
  float* vbuf_ = nullptr;   // [64][dpad] packed values
};

}  // namespace
}  // namespace tessera::attn::cpu_detail
