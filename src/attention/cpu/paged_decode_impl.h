// tessera/attention/cpu/paged_decode_impl.h — internal: the paged decode kernel (paged_decode.h), generic
// over a SIMD policy. Included by exactly one translation unit per instruction set (paged_decode_avx512.cpp,
// paged_decode_avx2.cpp), after it has defined its policy; everything here has internal linkage.
//
// A policy S provides (vector_ops.h's ops of its ISA, plus the rest): reg; kWidth (W, lanes: 8 or 16); zero,
// set1, loadf (W floats), store, fmadd(a, b, c) = a * b + c, mul, sub, add, max; load<E>(p) (W elements of type E
// from memory, as f32); exp2(x) (0 for x <= -125, -inf included); reduce_max, reduce_add; and the
// transpose-and-add tree that turns W accumulators (one per key, head dims in lanes) into one vector of the W keys'
// dot products:
//   pair(a, b)       two keys' accumulators -> one vector holding W/2 partial sums of each;
//   quad(r01, r23)   two pairs -> one vector holding W/4 partial sums of each of 4 keys;
//   finish(t)        the W/4 quads -> the W dot products, key i in lane i.
//
// The walk: per chunk of at most kChunk keys of one span, the scores of every head 4 keys (a quad) at a time
// (each key's row converted once, FMA'd with each head's query), the chunk's online softmax per head (one
// rescale), then its values, each row converted once, into each head's accumulator (kept in job.out,
// unnormalised, between chunks). A part of a split walk (job.part_max set) ends there: its running max and sum go
// out with the unnormalised output, for paged_decode_merge.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/cpu/paged_decode.h"

namespace tessera::attn::cpu_detail {
namespace {

struct ElemF32 {
  using T = float;
};
struct ElemBF16 {
  using T = uint16_t;
};
struct ElemF16 {
  using T = uint16_t;
};

inline constexpr int kPagedChunk = 64;  // keys per softmax chunk
inline constexpr int kPagedMaxHeads = 8;

// Scores of keys [0, nk) (nk <= W) of k against the NH queries, unscaled: s[g * kPagedChunk + i] for i < W
// (lanes past nk repeat the last key; the caller masks them).
template <class S, class E, int NH>
inline void paged_qk(const typename E::T* k, int64_t d, int nk, const float* q, float* s) {
  using reg = typename S::reg;
  constexpr int W = S::kWidth, Q = W / 4;
  reg t[NH][Q];
#pragma GCC unroll 4
  for (int qd = 0; qd < Q; ++qd) {
    reg r[NH][2];
#pragma GCC unroll 2
    for (int pr = 0; pr < 2; ++pr) {
      const int j = qd * 4 + pr * 2;
      const typename E::T* k0 = k + std::min(j, nk - 1) * d;
      const typename E::T* k1 = k + std::min(j + 1, nk - 1) * d;
      reg a0[NH], a1[NH];
#pragma GCC unroll 8
      for (int g = 0; g < NH; ++g) a0[g] = a1[g] = S::zero();
      for (int64_t c = 0; c < d; c += W) {
        const reg x0 = S::template load<E>(k0 + c), x1 = S::template load<E>(k1 + c);
#pragma GCC unroll 8
        for (int g = 0; g < NH; ++g) {
          const reg qg = S::loadf(q + g * d + c);
          a0[g] = S::fmadd(qg, x0, a0[g]);
          a1[g] = S::fmadd(qg, x1, a1[g]);
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < NH; ++g) r[g][pr] = S::pair(a0[g], a1[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < NH; ++g) t[g][qd] = S::quad(r[g][0], r[g][1]);
  }
#pragma GCC unroll 8
  for (int g = 0; g < NH; ++g) S::store(s + g * kPagedChunk, S::finish(t[g]));
}

// out[g][c, c + U * W) = alpha[g] * out[g][..] + sum_j p[g][j] v_j[..] for the chunk's n values.
template <class S, class E, int NH, int U>
inline void paged_pv(const typename E::T* v, int n, int64_t d, int64_t c, const float* p, const float* alpha,
                     float* out) {
  using reg = typename S::reg;
  constexpr int W = S::kWidth;
  reg acc[NH][U];
#pragma GCC unroll 8
  for (int g = 0; g < NH; ++g) {
    const reg a = S::set1(alpha[g]);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[g][u] = S::mul(S::loadf(out + g * d + c + u * W), a);
  }
  for (int j = 0; j < n; ++j) {
    reg x[U];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) x[u] = S::template load<E>(v + j * d + c + u * W);
#pragma GCC unroll 8
    for (int g = 0; g < NH; ++g) {
      const reg pg = S::set1(p[g * kPagedChunk + j]);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[g][u] = S::fmadd(pg, x[u], acc[g][u]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < NH; ++g)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) S::store(out + g * d + c + u * W, acc[g][u]);
}

// NH heads (q, out: [NH, d]) over the job's spans; d a multiple of S::kWidth.
template <class S, class E, int NH>
void paged_attend(const float* q, float* out, int64_t d, float scale, std::span<const KeySpan> spans,
                  float* part_max, float* part_sum) {
  using reg = typename S::reg;
  constexpr int W = S::kWidth;
  // Accumulators per value pass: NH * U of the policy's registers, a few left for the values.
  constexpr int U = S::kRegisters >= 32 ? (NH <= 4 ? 4 : 2) : (NH <= 2 ? 4 : NH <= 4 ? 2 : 1);
  constexpr float kNegInf = -__builtin_inff();
  alignas(64) float s[NH * kPagedChunk];
  float m[NH], l[NH], alpha[NH];
  for (int g = 0; g < NH; ++g) {
    m[g] = kNegInf;
    l[g] = 0;
  }
  std::fill(out, out + NH * d, 0.0f);
  const float sc = scale * 1.44269504088896341f;  // scores in base 2
  for (const KeySpan& span : spans) {
    const auto* kspan = static_cast<const typename E::T*>(span.k);
    const auto* vspan = static_cast<const typename E::T*>(span.v);
    for (int64_t j0 = 0; j0 < span.n; j0 += kPagedChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kPagedChunk, span.n - j0));
      const typename E::T* kc = kspan + j0 * d;
      const typename E::T* vc = vspan + j0 * d;
      for (int i = 0; i < n; i += W) paged_qk<S, E, NH>(kc + i * d, d, std::min(W, n - i), q, s + i);
      const int nv = (n + W - 1) / W * W;
      for (int g = 0; g < NH; ++g) {
        float* sg = s + g * kPagedChunk;
        reg mx = S::set1(kNegInf);
        for (int i = 0; i < nv; i += W) {
          const reg x = S::mul(S::loadf(sg + i), S::set1(sc));
          S::store(sg + i, x);
        }
        for (int i = n; i < nv; ++i) sg[i] = kNegInf;
        for (int i = 0; i < nv; i += W) mx = S::max(mx, S::loadf(sg + i));
        const float m_new = std::max(m[g], S::reduce_max(mx));
        const float mu = m_new == kNegInf ? 0.0f : m_new;  // no key yet (scores of -inf): weights stay 0
        alpha[g] = m[g] - mu <= -125.0f ? 0.0f : std::exp2(m[g] - mu);
        m[g] = m_new;
        reg sum = S::zero();
        for (int i = 0; i < nv; i += W) {
          const reg p = S::exp2(S::sub(S::loadf(sg + i), S::set1(mu)));
          S::store(sg + i, p);
          sum = S::add(sum, p);
        }
        l[g] = l[g] * alpha[g] + S::reduce_add(sum);
      }
      int64_t c = 0;
      for (; c + U * W <= d; c += U * W) paged_pv<S, E, NH, U>(vc, n, d, c, s, alpha, out);
      for (; c < d; c += W) paged_pv<S, E, NH, 1>(vc, n, d, c, s, alpha, out);
    }
  }
  for (int g = 0; g < NH; ++g) {
    if (part_max != nullptr) {  // a part of a split walk: paged_decode_merge normalises
      part_max[g] = m[g];
      part_sum[g] = l[g];
      continue;
    }
    const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;
    for (int64_t c = 0; c < d; ++c) out[g * d + c] *= inv;
  }
}

// paged_attend<S, E, 1..kPagedMaxHeads>, by heads - 1.
template <class S, class E, size_t... I>
constexpr auto paged_attend_table(std::index_sequence<I...>) {
  return std::array{&paged_attend<S, E, static_cast<int>(I) + 1>...};
}

template <class S, class E>
void paged_attend_heads(const PagedDecodeJob& job) {
  static constexpr auto kByHeads = paged_attend_table<S, E>(std::make_index_sequence<kPagedMaxHeads>{});
  const int64_t d = job.head_dim;
  for (int32_t h = 0; h < job.heads; h += kPagedMaxHeads)
    kByHeads[static_cast<size_t>(std::min(kPagedMaxHeads, job.heads - h) - 1)](
        job.q + h * d, job.out + h * d, d, job.scale, job.spans, job.part_max ? job.part_max + h : nullptr,
        job.part_sum ? job.part_sum + h : nullptr);
}

// The job (validated by paged_decode: heads >= 1, head_dim a multiple of S::kWidth, a float element type).
template <class S>
void paged_decode_with(const PagedDecodeJob& job) {
  switch (job.elem) {
    case DType::BF16:
      paged_attend_heads<S, ElemBF16>(job);
      break;
    case DType::F16:
      paged_attend_heads<S, ElemF16>(job);
      break;
    default:
      paged_attend_heads<S, ElemF32>(job);
      break;
  }
}

}  // namespace
}  // namespace tessera::attn::cpu_detail
