// The paged decode kernel's run-time dispatch and its portable scalar twin (paged_decode.h).
#include "attention/cpu/paged_decode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention/cpu/cpu_kernel.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace tessera::attn {

namespace {

std::atomic<int64_t> g_split_min_work{kPagedSplitMinWork};

constexpr int kChunk = 64;  // keys per softmax chunk, as the SIMD kernels

inline float elem_at(const void* p, int64_t i, DType t) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  const uint16_t b = static_cast<const uint16_t*>(p)[i];
  return t == DType::BF16 ? bf16_to_f32(bf16::from_bits(b)) : f16_to_f32(f16::from_bits(b));
}

// The portable twin: the SIMD kernels' walk (chunks of 64 keys, one rescale per chunk), in plain loops: each
// chunk's keys and values converted to f32 once (for all the heads), then per head its scores, softmax and
// values.
void paged_decode_portable(const PagedDecodeJob& job) {
  const int64_t d = job.head_dim;
  const size_t H = static_cast<size_t>(job.heads);
  const float sc = job.scale * 1.44269504088896341f;
  std::vector<float> m(H, -INFINITY), l(H, 0.0f), s(kChunk);
  std::vector<float> kf(static_cast<size_t>(kChunk * d)), vf(kf.size());
  std::fill(job.out, job.out + job.heads * d, 0.0f);
  for (const KeySpan& span : job.spans) {
    for (int64_t j0 = 0; j0 < span.n; j0 += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, span.n - j0);
      for (int64_t i = 0; i < n * d; ++i) {
        kf[static_cast<size_t>(i)] = elem_at(span.k, j0 * d + i, job.elem);
        vf[static_cast<size_t>(i)] = elem_at(span.v, j0 * d + i, job.elem);
      }
      for (size_t g = 0; g < H; ++g) {
        const float* q = job.q + static_cast<int64_t>(g) * d;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const float* k = kf.data() + j * d;
          float dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += q[c] * k[c];
          s[static_cast<size_t>(j)] = dot * sc;
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        const float m_new = std::max(m[g], mx);
        const float mu = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = m[g] - mu <= -125.0f ? 0.0f : std::exp2(m[g] - mu);
        m[g] = m_new;
        float* o = job.out + static_cast<int64_t>(g) * d;
        for (int64_t c = 0; c < d; ++c) o[c] *= alpha;
        float total = 0;
        for (int64_t j = 0; j < n; ++j) {
          const float x = s[static_cast<size_t>(j)] - mu;
          const float p = x <= -125.0f ? 0.0f : std::exp2(x);
          const float* v = vf.data() + j * d;
          for (int64_t c = 0; c < d; ++c) o[c] += p * v[c];
          total += p;
        }
        l[g] = l[g] * alpha + total;
      }
    }
  }
  for (size_t g = 0; g < H; ++g) {
    if (job.part_max != nullptr) {  // a part of a split walk: paged_decode_merge normalises
      job.part_max[g] = m[g];
      job.part_sum[g] = l[g];
      continue;
    }
    const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;
    for (int64_t c = 0; c < d; ++c) job.out[static_cast<int64_t>(g) * d + c] *= inv;
  }
}

PagedIsa isa_from_environment_or_best() {
  if (const char* env = std::getenv("TESSERA_PAGED_DECODE_ISA"); env != nullptr && *env != 0) {
    const std::string name(env);
    for (PagedIsa isa : {PagedIsa::Portable, PagedIsa::Avx2, PagedIsa::Avx512})
      if (name == paged_isa_name(isa)) {
        check(paged_decode_isa_available(isa),
              "TESSERA_PAGED_DECODE_ISA: this CPU or build has no " + name + " path");
        return isa;
      }
    throw Error("TESSERA_PAGED_DECODE_ISA: expected portable, avx2 or avx512, got '" + name + "'");
  }
  return paged_decode_isa_available(PagedIsa::Avx512) ? PagedIsa::Avx512
         : paged_decode_isa_available(PagedIsa::Avx2) ? PagedIsa::Avx2
                                                      : PagedIsa::Portable;
}

}  // namespace

bool paged_decode_isa_available(PagedIsa isa) {
  switch (isa) {
    case PagedIsa::Portable:
      return true;
    case PagedIsa::Avx2: {
#if defined(__x86_64__) || defined(__i386__)
      static const bool has = cpu_detail::paged_decode_avx2_built() && __builtin_cpu_supports("avx2") &&
                              __builtin_cpu_supports("fma") && cpu_has_f16c();
      return has;
#else
      return false;
#endif
    }
    case PagedIsa::Avx512:
      return cpu_detail::paged_decode_avx512_built() && cpu_has_avx512();
  }
  return false;
}

PagedIsa paged_decode_isa() {
  static const PagedIsa chosen = isa_from_environment_or_best();
  // The attention executors' baseline forced (tests, benchmarks): no AVX-512 here either.
  if (chosen == PagedIsa::Avx512 && active_cpu_kernel() == CpuKernel::Baseline) return PagedIsa::Avx2;
  return chosen;
}

std::string_view paged_isa_name(PagedIsa isa) {
  switch (isa) {
    case PagedIsa::Portable:
      return "portable";
    case PagedIsa::Avx2:
      return "avx2";
    case PagedIsa::Avx512:
      return "avx512";
  }
  return "?";
}

void paged_decode(const PagedDecodeJob& job, PagedIsa isa) {
  check(job.elem == DType::F32 || job.elem == DType::BF16 || job.elem == DType::F16,
        "paged decode attention: keys and values in " + std::string(dtype_name(job.elem)) +
            " (expected f32, bf16 or f16)");
  check(job.heads >= 1 && job.head_dim >= 1, "paged decode attention: " + std::to_string(job.heads) +
                                                 " heads of dimension " + std::to_string(job.head_dim));
  check(paged_decode_isa_available(isa),
        "paged decode attention: this CPU or build has no " + std::string(paged_isa_name(isa)) + " path");
  check((job.part_max == nullptr) == (job.part_sum == nullptr),
        "paged decode attention: a part's running maxima without its sums (or the other way)");
  if (isa == PagedIsa::Avx512 && job.head_dim % 16 == 0) return cpu_detail::paged_decode_avx512(job);
  if (isa != PagedIsa::Portable && job.head_dim % 8 == 0 && paged_decode_isa_available(PagedIsa::Avx2))
    return cpu_detail::paged_decode_avx2(job);
  paged_decode_portable(job);
}

void paged_decode(const PagedDecodeJob& job) {
  paged_decode(job, paged_decode_isa());
}

void paged_decode_merge(const float* outs, const float* maxes, const float* sums, int32_t parts, int32_t heads,
                        int32_t head_dim, float* out) {
  check(parts >= 1 && heads >= 1 && head_dim >= 1, "paged decode merge: " + std::to_string(parts) + " parts of " +
                                                       std::to_string(heads) + " heads of dimension " +
                                                       std::to_string(head_dim));
  const int64_t d = head_dim, stride = static_cast<int64_t>(heads) * d;
  for (int64_t g = 0; g < heads; ++g) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, maxes[p * heads + g]);
    float* o = out + g * d;
    std::fill(o, o + d, 0.0f);
    if (mx == -INFINITY) continue;  // no part saw a key
    float total = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const float m = maxes[p * heads + g];
      if (m == -INFINITY) continue;  // a part without keys (its output is zeros)
      const float w = std::exp2(m - mx);
      total += w * sums[p * heads + g];
      const float* op = outs + p * stride + g * d;
      for (int64_t c = 0; c < d; ++c) o[c] += w * op[c];
    }
    const float inv = 1.0f / total;  // total >= 1: the part holding the maximum has sum >= 2^0
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
  }
}

int32_t paged_decode_parts(int64_t work, int threads) {
  const int64_t min_work = paged_split_min_work();
  if (threads <= 1 || min_work <= 0) return 1;
  return static_cast<int32_t>(std::clamp<int64_t>(work / min_work, 1, 2 * static_cast<int64_t>(threads)));
}

void set_paged_split_min_work(int64_t work) {
  g_split_min_work.store(work, std::memory_order_relaxed);
}

int64_t paged_split_min_work() {
  return g_split_min_work.load(std::memory_order_relaxed);
}

}  // namespace tessera::attn
