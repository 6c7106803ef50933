// A query row's attention output is the same bytes whatever call computes it (issue 34): the prompt in chunks of any
// size from any first row (a cached prefix's tail), one row alone (a one-token tail, the tile's few-row path), with and
// without a sliding window, f32 and half keys, on the AVX-512 and the baseline kernels, and a decode row over paged
// blocks (paged_decode_in_prefill_order) — against the whole prompt attended in one call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/cpu_kernel.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/paged_decode.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace tessera::attn {
namespace {

struct Shape {
  int32_t n = 300, hq = 6, hkv = 2, d = 64, window = 0;
  DType kv = DType::F32;
};

struct Data {
  std::vector<float> q, k, v;          // [n, h, d]
  std::vector<uint16_t> k16, v16;      // f16 copies
};

Data make(const Shape& s) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  Data x;
  x.q.resize(static_cast<size_t>(s.n * s.hq * s.d));
  x.k.resize(static_cast<size_t>(s.n * s.hkv * s.d));
  x.v.resize(x.k.size());
  for (float& f : x.q) f = 2 * nd(rng);
  for (float& f : x.k) f = nd(rng);
  for (float& f : x.v) f = nd(rng);
  for (size_t i = 0; i < x.k.size(); ++i) {
    x.k16.push_back(f32_to_f16(x.k[i]).bits);
    x.v16.push_back(f32_to_f16(x.v[i]).bits);
  }
  return x;
}

// Rows [a, b) attended over keys [0, b) in one call; [b - a, hq, d].
std::vector<float> rows(const Shape& s, Data& x, int32_t a, int32_t b, ThreadPool& pool) {
  std::vector<float> out(static_cast<size_t>((b - a) * s.hq * s.d));
  AttentionArgs args;
  args.q = TensorView(x.q.data() + static_cast<size_t>(a * s.hq * s.d), DType::F32, {b - a, s.hq, s.d});
  void* kp = s.kv == DType::F32 ? static_cast<void*>(x.k.data()) : static_cast<void*>(x.k16.data());
  void* vp = s.kv == DType::F32 ? static_cast<void*>(x.v.data()) : static_cast<void*>(x.v16.data());
  args.k = TensorView(kp, s.kv, {b, s.hkv, s.d});
  args.v = TensorView(vp, s.kv, {b, s.hkv, s.d});
  args.out = TensorView(out.data(), DType::F32, {b - a, s.hq, s.d});
  args.q_begin = a;
  args.window = s.window > 0 && s.window < b ? s.window : 0;
  dense_attention_cpu(args, pool);
  return out;
}

// The first row whose output differs in any byte, or -1.
int32_t first_difference(const std::vector<float>& got, const std::vector<float>& all, const Shape& s, int32_t a) {
  const size_t row = static_cast<size_t>(s.hq * s.d);
  for (size_t r = 0; r < got.size() / row; ++r)
    if (std::memcmp(got.data() + r * row, all.data() + (static_cast<size_t>(a) + r) * row, row * sizeof(float)) != 0)
      return a + static_cast<int32_t>(r);
  return -1;
}

std::string name(const Shape& s, CpuKernel k) {
  return std::string(cpu_kernel_name(k)) + (s.kv == DType::F32 ? " f32" : " f16") + " window " +
         std::to_string(s.window);
}

std::vector<CpuKernel> kernels() {
  std::vector<CpuKernel> k{CpuKernel::Baseline};
  if (cpu_has_avx512()) k.push_back(CpuKernel::Avx512);
  return k;
}

TEST(AttentionRowsExact, ChunksAndTailsEqualTheWholePrompt) {
  ThreadPool pool(2);
  const std::vector<std::pair<int32_t, int32_t>> pieces = {{0, 64},    {16, 300}, {288, 300}, {288, 289}, {64, 66},
                                                           {32, 35},   {240, 245}, {96, 161}, {160, 161}, {299, 300},
                                                           {100, 104}, {5, 6},    {200, 270}};
  for (CpuKernel kernel : kernels()) {
    set_cpu_kernel(kernel);
    for (int32_t window : {0, 24, 100})
      for (DType kv : {DType::F32, DType::F16}) {
        Shape s;
        s.window = window;
        s.kv = kv;
        Data x = make(s);
        const std::vector<float> all = rows(s, x, 0, s.n, pool);
        for (const auto& [a, b] : pieces)
          EXPECT_EQ(first_difference(rows(s, x, a, b, pool), all, s, a), -1)
              << name(s, kernel) << ": rows [" << a << ", " << b << ") in one call part from the whole prompt's";
      }
  }
  set_cpu_kernel(CpuKernel::Auto);
}

// A decode row over keys in paged blocks of 16 (some blocks below a window absent: zeros) = the same row in the whole
// prompt's call.
TEST(AttentionRowsExact, PagedDecodeRowEqualsThePromptsRow) {
  ThreadPool pool(2);
  for (CpuKernel kernel : kernels()) {
    set_cpu_kernel(kernel);
    for (int32_t window : {0, 24, 100})
      for (DType kv : {DType::F32, DType::F16}) {
        Shape s;
        s.window = window;
        s.kv = kv;
        Data x = make(s);
        const std::vector<float> all = rows(s, x, 0, s.n, pool);
        const int32_t B = 16, group = s.hq / s.hkv;
        const size_t es = kv == DType::F32 ? 4 : 2;
        // Blocks per kv head: [n / B + 1][B][d] in the element type.
        std::vector<std::vector<char>> kb(static_cast<size_t>(s.hkv)), vb(kb.size());
        for (int32_t h = 0; h < s.hkv; ++h) {
          kb[static_cast<size_t>(h)].assign(static_cast<size_t>((s.n / B + 1) * B * s.d) * es, 0);
          vb[static_cast<size_t>(h)].assign(kb[static_cast<size_t>(h)].size(), 0);
          for (int32_t j = 0; j < s.n; ++j) {
            const size_t src = static_cast<size_t>((j * s.hkv + h) * s.d), dst = static_cast<size_t>(j * s.d) * es;
            const void* ks = kv == DType::F32 ? static_cast<const void*>(&x.k[src]) : &x.k16[src];
            const void* vs = kv == DType::F32 ? static_cast<const void*>(&x.v[src]) : &x.v16[src];
            std::memcpy(&kb[static_cast<size_t>(h)][dst], ks, static_cast<size_t>(s.d) * es);
            std::memcpy(&vb[static_cast<size_t>(h)][dst], vs, static_cast<size_t>(s.d) * es);
          }
        }
        std::vector<float> scratch(paged_tile_scratch_floats(s.d));
        for (int32_t pos : {0, 1, 15, 16, 63, 64, 65, 130, 255, 299}) {
          const int32_t key_begin = window > 0 ? std::max(0, pos - window + 1) : 0;
          std::vector<const void*> kp, vp;
          std::vector<float> zeros(static_cast<size_t>(B * s.d), 0.0f);
          std::vector<float> out(static_cast<size_t>(s.hq * s.d));
          for (int32_t h = 0; h < s.hkv; ++h) {
            kp.clear();
            vp.clear();
            for (int32_t b = 0; b <= pos / B; ++b) {  // blocks wholly below the window: absent (zeros)
              const bool gone = (b + 1) * B <= key_begin;
              kp.push_back(gone ? static_cast<const void*>(zeros.data()) : &kb[static_cast<size_t>(h)][static_cast<size_t>(b * B * s.d) * es]);
              vp.push_back(gone ? static_cast<const void*>(zeros.data()) : &vb[static_cast<size_t>(h)][static_cast<size_t>(b * B * s.d) * es]);
            }
            PagedTileJob job;
            job.q = x.q.data() + static_cast<size_t>((pos * s.hq + h * group) * s.d);
            job.out = out.data() + static_cast<size_t>(h * group * s.d);
            job.heads = group;
            job.head_dim = s.d;
            job.elem = kv;
            job.pos = pos;
            job.key_begin = key_begin;
            job.window = key_begin > 0 ? window : 0;
            job.k_blocks = kp.data();
            job.v_blocks = vp.data();
            job.block_tokens = B;
            paged_decode_in_prefill_order(job, scratch.data());
          }
          EXPECT_EQ(first_difference(out, all, s, pos), -1) << name(s, kernel) << ": the decode row at " << pos;
        }
      }
  }
  set_cpu_kernel(CpuKernel::Auto);
}

}  // namespace
}  // namespace tessera::attn
