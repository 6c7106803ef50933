// Tests of the CPU KV cache in f32, bf16 and f16 (runtime/kv_cache.h): the conversions (exact round trips, the
// vector path equal to the scalar twin bit for bit), the cache's rows through growth, the attention executors
// reading f16/bf16 keys and values, the paged store of the batched engine in each type (rows, scatter/gather, its
// decode attention), and the engine's logits with a half cache against the f32 cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/cpu_kernel.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/reference.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "runtime/batch_forward.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "decode_reference.h"

namespace tessera::runtime {
namespace {

using test::decode_reference;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// ---- conversions

TEST(KVCacheConvert, EveryHalfValueRoundTripsExactly) {
  for (KVType t : {KVType::BF16, KVType::F16}) {
    std::vector<uint16_t> all(65536), back(65536);
    for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> f(65536);
    half_to_f32(all.data(), f.data(), 65536, t);
    f32_to_half(f.data(), back.data(), 65536, t);
    for (uint32_t i = 0; i < 65536; ++i) {
      const bool nan = std::isnan(f[i]);
      const bool inf = std::isinf(f[i]);
      // the f32 value is the half's: compare with the library's scalar conversion
      const float ref = t == KVType::BF16 ? bf16_to_f32(bf16::from_bits(all[i])) : f16_to_f32(f16::from_bits(all[i]));
      if (nan) {
        EXPECT_TRUE(std::isnan(ref)) << i;
        EXPECT_TRUE(std::isnan(t == KVType::BF16 ? bf16_to_f32(bf16::from_bits(back[i]))
                                                 : f16_to_f32(f16::from_bits(back[i]))))
            << kv_type_name(t) << " NaN " << i;
        continue;
      }
      ASSERT_EQ(bits_of(f[i]), bits_of(ref)) << kv_type_name(t) << " " << i;
      if (inf && t == KVType::F16) {  // f16 saturates: an infinity is stored as the largest finite value
        EXPECT_EQ(back[i], (all[i] & 0x8000u) | 0x7bffu) << i;
        continue;
      }
      ASSERT_EQ(back[i], all[i]) << kv_type_name(t) << " " << i;
    }
  }
}

TEST(KVCacheConvert, VectorPathEqualsScalarTwinAndRoundsToNearest) {
  std::mt19937 rng(7);
  std::vector<float> x;
  // magnitudes across both types' ranges, ties, subnormals, saturation, infinities, NaN, signed zeros
  std::uniform_real_distribution<float> expo(-30.0f, 20.0f);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(unit(rng) * std::exp2(expo(rng)));
  for (float v : {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1.0f + 1.0f / 2048,
                  1.0f + 3.0f / 2048, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 5.96e-8f, 2.98e-8f, 3e-8f, 1e-40f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()})
    x.push_back(v);
  x.push_back(std::bit_cast<float>(0x7f800001u));  // signalling NaN
  const auto n = static_cast<int64_t>(x.size());
  for (KVType t : {KVType::BF16, KVType::F16}) {
    std::vector<uint16_t> vec(x.size()), ref(x.size());
    f32_to_half(x.data(), vec.data(), n, t);
    f32_to_half_scalar(x.data(), ref.data(), n, t);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(vec[i], ref[i]) << kv_type_name(t) << " x = " << x[i] << " (bits " << bits_of(x[i]) << ")";
      if (std::isnan(x[i])) continue;
      // nearest (bf16 rounds past its largest value to infinity, as IEEE rounding does: not checked here): no other half value is closer (checked against both neighbours)
      std::vector<float> back(1);
      half_to_f32(&vec[i], back.data(), 1, t);
      if (std::isinf(back[0])) {
        EXPECT_EQ(t, KVType::BF16) << "f16 saturates, x = " << x[i];
        continue;
      }
      const double lim = t == KVType::F16 ? 65504.0 : 3.4e38;
      const double xv = std::clamp(static_cast<double>(x[i]), -lim, lim);
      const double err = std::fabs(static_cast<double>(back[0]) - xv);
      for (int step : {-1, 1}) {
        const uint16_t nb = static_cast<uint16_t>(vec[i] + step);
        float other;
        half_to_f32(&nb, &other, 1, t);
        if (std::isnan(other) || std::isinf(other) || ((nb ^ vec[i]) & 0x8000u)) continue;
        ASSERT_LE(err, std::fabs(static_cast<double>(other) - xv)) << kv_type_name(t) << " x = " << x[i];
      }
    }
  }
  // saturation and ties to even, spelled out
  const float s[] = {70000.0f, -std::numeric_limits<float>::infinity(), 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048};
  uint16_t h[4];
  f32_to_half(s, h, 4, KVType::F16);
  EXPECT_EQ(h[0], 0x7bffu);
  EXPECT_EQ(h[1], 0xfbffu);
  EXPECT_EQ(h[2], 0x3c00u);  // halfway between 1 and 1 + 2^-10: to the even one
  EXPECT_EQ(h[3], 0x3c02u);
}

TEST(KVCacheConvert, TypeNamesAndErrors) {
  EXPECT_EQ(parse_kv_type("f32"), KVType::F32);
  EXPECT_EQ(parse_kv_type("bf16"), KVType::BF16);
  EXPECT_EQ(parse_kv_type("f16"), KVType::F16);
  try {
    parse_kv_type("fp8");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--kv-type: expected f32, bf16 or f16, got 'fp8'");
  }
}

// ---- the cache

TEST(KVCacheRows, WriteReadThroughGrowthEveryType) {
  for (KVType t : {KVType::F32, KVType::BF16, KVType::F16}) {
    KVCache c(3, 2, 24, 5000, t);
    const int64_t row = 2 * 24;
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> k(5000 * row), v(5000 * row);
    for (auto& x : k) x = dist(rng);
    for (auto& x : v) x = dist(rng);
    // Rows written a few at a time, the cache reserved just ahead: every growth keeps what was written.
    int32_t pos = 0;
    for (int32_t n : {1, 300, 1, 1, 2000, 7, 2690}) {
      c.reserve(pos + n);
      EXPECT_EQ(c.capacity(), pos + n);
      EXPECT_EQ(c.bytes(), static_cast<size_t>(pos + n) * row * 2 * 3 * kv_type_size(t));
      for (int32_t l = 0; l < 3; ++l) c.write(l, pos, n, k.data() + pos * row, v.data() + pos * row);
      pos += n;
    }
    ASSERT_EQ(pos, 5000);
    std::vector<float> kr(5000 * row), vr(5000 * row), expect_k(5000 * row), expect_v(5000 * row);
    if (t == KVType::F32) {
      expect_k = k;
      expect_v = v;
    } else {
      std::vector<uint16_t> h(5000 * row);
      f32_to_half(k.data(), h.data(), 5000 * row, t);
      half_to_f32(h.data(), expect_k.data(), 5000 * row, t);
      f32_to_half(v.data(), h.data(), 5000 * row, t);
      half_to_f32(h.data(), expect_v.data(), 5000 * row, t);
    }
    for (int32_t l = 0; l < 3; ++l) {
      c.read(l, 0, 5000, kr.data(), vr.data());
      ASSERT_EQ(kr, expect_k) << kv_type_name(t) << " layer " << l;
      ASSERT_EQ(vr, expect_v) << kv_type_name(t) << " layer " << l;
      const TensorView kv = c.k_view(l, 5000);
      EXPECT_EQ(kv.dtype, kv_dtype(t));
      EXPECT_EQ(kv.dim(0), 5000);
    }
    if (t != KVType::F32) {
      try {
        c.k(0, 0);
        FAIL();
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "KV cache: k() needs an f32 cache (this one is " +
                                             std::string(kv_type_name(t)) + ")");
      }
    }
    EXPECT_THROW(c.reserve(5001), Error);
    c.release();
    EXPECT_EQ(c.capacity(), 0);
    EXPECT_EQ(c.bytes(), 0u);
  }
}

// ---- the attention executors reading half keys and values

TEST(KVCacheAttention, HalfKeysAndValuesEqualTheirF32Values) {
  ThreadPool pool(2);
  std::vector<attn::CpuKernel> kernels = {attn::CpuKernel::Baseline};
  if (attn::cpu_has_avx512()) kernels.push_back(attn::CpuKernel::Avx512);
  struct Shape {
    int64_t q_len, kv_len, hq, hkv, d;
    int32_t window;
  };
  // decode (1 row, a GQA group), a few rows, a prefill tile, odd head dims, a window
  for (const Shape& s : {Shape{1, 700, 9, 3, 64, 0}, Shape{3, 130, 4, 2, 40, 0}, Shape{150, 300, 2, 1, 64, 0},
                         Shape{70, 70, 2, 2, 33, 0}, Shape{1, 500, 4, 1, 128, 100}, Shape{90, 400, 2, 1, 64, 64}}) {
    for (KVType t : {KVType::BF16, KVType::F16}) {
      std::mt19937 rng(static_cast<uint32_t>(s.kv_len * 31 + s.d));
      std::normal_distribution<float> dist(0.0f, 1.5f);
      Tensor q(DType::F32, {s.q_len, s.hq, s.d});
      for (int64_t i = 0; i < q.numel(); ++i) q.ptr<float>()[i] = dist(rng);
      Tensor kh(kv_dtype(t), {s.kv_len, s.hkv, s.d}), vh(kv_dtype(t), {s.kv_len, s.hkv, s.d});
      Tensor kf(DType::F32, {s.kv_len, s.hkv, s.d}), vf(DType::F32, {s.kv_len, s.hkv, s.d});
      const int64_t n = kf.numel();
      std::vector<float> raw(static_cast<size_t>(n));
      for (auto& x : raw) x = dist(rng);
      f32_to_half(raw.data(), kh.ptr<uint16_t>(), n, t);
      half_to_f32(kh.ptr<uint16_t>(), kf.ptr<float>(), n, t);
      for (auto& x : raw) x = dist(rng);
      f32_to_half(raw.data(), vh.ptr<uint16_t>(), n, t);
      half_to_f32(vh.ptr<uint16_t>(), vf.ptr<float>(), n, t);
      for (attn::CpuKernel kern : kernels) {
        attn::set_cpu_kernel(kern);
        Tensor oh(DType::F32, {s.q_len, s.hq, s.d}), of(DType::F32, {s.q_len, s.hq, s.d});
        attn::AttentionArgs a;
        a.q = q;
        a.k = kh;
        a.v = vh;
        a.out = oh;
        a.q_begin = static_cast<int32_t>(s.kv_len - s.q_len);
        a.window = s.window;
        attn::dense_attention_cpu(a, pool);
        a.k = kf;
        a.v = vf;
        a.out = of;
        attn::dense_attention_cpu(a, pool);
        // Same values, same order of operations: only where an f32 block is read in place rather than packed may
        // the last bit differ.
        for (int64_t i = 0; i < of.numel(); ++i)
          ASSERT_NEAR(oh.ptr<float>()[i], of.ptr<float>()[i], 1e-6f)
              << kv_type_name(t) << " " << attn::cpu_kernel_name(kern) << " q_len " << s.q_len << " d " << s.d
              << " at " << i;
      }
      attn::set_cpu_kernel(attn::CpuKernel::Auto);
    }
  }
}

// ---- the paged store (the batched engine's blocks) in each type

TEST(PagedKVStoreType, RowsScatterGatherAndDecodeAttention) {
  // Head dims 24 (the AVX2 path of attention/cpu/paged_decode.h on any x86-64 CPU) and 64 (AVX-512 where present).
  for (const int32_t d : {24, 64}) {
    const int32_t L = 3, Hq = 4, Hkv = 2;
    const PagedKVShape shape{L, Hkv, d, 8};
    // Views per (layer, q head): dense, MoA sink + window, a horizon (sliding layer), all three; layers 0 and 1 give
    // the two query heads of each GQA group different views (walked one head at a time), layer 2 the same (walked
    // together).
    const std::vector<DecodeView> views{{0, kUnbounded, kUnbounded}, {3, 5, kUnbounded}, {0, kUnbounded, 6}, {2, 9, 7},
                                        {1, 1, kUnbounded},          {0, 20, kUnbounded}, {4, 4, 4},           {0, kUnbounded, kUnbounded},
                                        {2, 9, 7},                   {2, 9, 7},           {0, kUnbounded, kUnbounded}, {0, kUnbounded, kUnbounded}};
    ModelConfig cfg;
    cfg.num_layers = L;
    cfg.num_q_heads = Hq;
    cfg.num_kv_heads = Hkv;
    const std::vector<KVRetention> ret = kv_retention(cfg, views);
    const std::vector<int32_t> lengths{1, 9, 30, 77};
    for (KVType t : {KVType::F32, KVType::BF16, KVType::F16}) {
      const std::string tn(kv_type_name(t));
      std::mt19937 rng(7);
      std::normal_distribution<float> nd;
      BlockPool pool(400);
      PagedKVStore store(shape, 400, t);
      EXPECT_EQ(store.bytes(), static_cast<size_t>(400) * 8 * d * 2 * kv_type_size(t)) << tn;
      EXPECT_EQ(PagedKVStore::bytes_per_block(shape, t), 8.0 * d * 2 * static_cast<double>(kv_type_size(t))) << tn;

      // Rows written in f32 read back as the type's rounding of them (f32: the values themselves).
      {
        std::vector<float> k(3 * d), v(3 * d), kr(3 * d), vr(3 * d), round_k(3 * d), round_v(3 * d);
        for (float& x : k) x = nd(rng) * 100;
        for (float& x : v) x = nd(rng);
        store.write(5, 4, 3, k.data(), v.data());
        store.read(5, 4, 3, kr.data(), vr.data());
        if (t == KVType::F32) {
          round_k = k;
          round_v = v;
        } else {
          std::vector<uint16_t> h(3 * d);
          f32_to_half(k.data(), h.data(), 3 * d, t);
          half_to_f32(h.data(), round_k.data(), 3 * d, t);
          f32_to_half(v.data(), h.data(), 3 * d, t);
          half_to_f32(h.data(), round_v.data(), 3 * d, t);
          EXPECT_NE(round_k, k) << tn << ": nothing was rounded";
        }
        EXPECT_EQ(kr, round_k) << tn;
        EXPECT_EQ(vr, round_v) << tn;
        try {
          store.write(5, 7, 2, k.data(), v.data());
          ADD_FAILURE() << tn << ": a write past the block's end";
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()), "paged KV store: writing rows outside a block");
        }
        if (t != KVType::F32) {
          try {
            (void)store.k(0, 0);
            ADD_FAILURE() << tn << ": f32 access to a half store";
          } catch (const Error& e) {
            EXPECT_EQ(std::string(e.what()), "paged KV store: f32 access to a " + tn + " store");
          }
        }
      }

      // Caches of this type -> blocks -> caches: the kept rows come back bit for bit; the f32 images of the caches
      // (their stored values) are the attention reference's keys.
      std::vector<KVCache> caches, images;
      std::vector<SequenceBlocks> seqs;
      for (int32_t len : lengths) {
        KVCache c(L, Hkv, d, len, t), img(L, Hkv, d, len);
        c.reserve(len);
        img.reserve(len);
        std::vector<float> k(static_cast<size_t>(len) * Hkv * d), v(k.size());
        for (int32_t l = 0; l < L; ++l) {
          for (float& x : k) x = nd(rng);
          for (float& x : v) x = nd(rng);
          c.write(l, 0, len, k.data(), v.data());
          c.read(l, 0, len, img.k(l, 0), img.v(l, 0));
        }
        SequenceBlocks sq(shape, ret);
        sq.grow(len, pool);
        scatter_to_pages(c, sq, store);
        KVCache back(L, Hkv, d, len, t);
        back.reserve(len);
        gather_from_pages(store, sq, len, back);
        for (int32_t l = 0; l < L; ++l)
          for (int32_t h = 0; h < Hkv; ++h)
            for (int64_t pos = 0; pos < len; ++pos) {
              if (sq.block(l, h, pos) < 0) continue;
              const size_t at = static_cast<size_t>(h) * static_cast<size_t>(d) * kv_type_size(t);
              ASSERT_EQ(std::memcmp(back.k_bytes(l, static_cast<int32_t>(pos)) + at,
                                    c.k_bytes(l, static_cast<int32_t>(pos)) + at, store.row_bytes()), 0)
                  << tn << " layer " << l << " head " << h << " row " << pos;
              ASSERT_EQ(std::memcmp(back.v_bytes(l, static_cast<int32_t>(pos)) + at,
                                    c.v_bytes(l, static_cast<int32_t>(pos)) + at, store.row_bytes()), 0);
            }
        caches.push_back(std::move(c));
        images.push_back(std::move(img));
        seqs.push_back(std::move(sq));
      }
      {
        KVCache other(L, Hkv, d, 8, t == KVType::F32 ? KVType::F16 : KVType::F32);
        other.reserve(1);
        try {
          scatter_to_pages(other, seqs[0], store);
          ADD_FAILURE() << tn << ": a staging cache of another type";
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()), "paged KV: the staging cache is " +
                                               std::string(kv_type_name(other.type())) + ", the blocks " + tn);
        }
      }

      std::vector<DecodeRow> rows;
      for (const SequenceBlocks& sq : seqs) rows.push_back({&sq, views});
      const auto B = static_cast<int64_t>(lengths.size());
      std::vector<float> q(static_cast<size_t>(B * Hq * d)), out(q.size());
      for (float& x : q) x = nd(rng);
      const float scale = 0.2f;
      for (int32_t l = 0; l < L; ++l) {
        paged_decode_attention_cpu(q.data(), out.data(), rows, l, Hq, store, scale, ThreadPool::global());
        for (int64_t i = 0; i < B; ++i) {
          const int32_t len = lengths[static_cast<size_t>(i)];
          const std::vector<float> ref =
              decode_reference(q.data() + i * Hq * d, images[static_cast<size_t>(i)], l, len, views, Hq, d, scale);
          // The same stored values on both sides: only the f32 summation order differs (stated bound 2e-5).
          for (int64_t c = 0; c < Hq * d; ++c)
            ASSERT_NEAR(out[static_cast<size_t>(i * Hq * d + c)], ref[static_cast<size_t>(c)], 2e-5)
                << tn << " layer " << l << " sequence " << i << " element " << c;
        }
      }
    }
  }
}

// ---- the engine: a half cache against the f32 cache on the fixture models

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

TEST(KVCacheEngine, HalfCacheLogitsNearF32Cache) {
  for (const char* name : {"llama3", "smollm2", "qwen2", "gemma3", "mistral"}) {
    const std::unique_ptr<Model> m = Model::load(kFixtures + name);
    std::mt19937 rng(3);
    std::uniform_int_distribution<int32_t> tok(1, m->config().vocab_size - 1);
    std::vector<int32_t> tokens(150);
    for (auto& x : tokens) x = tok(rng);
    auto logits = [&](KVType t, std::vector<float>* decoded, size_t* bytes) {
      EngineOptions o;
      o.kv_type = t;
      o.chunk_size = 64;  // chunks read earlier chunks' keys from the cache
      Engine e(*m, o);
      std::vector<float> all = e.forward_all_logits(tokens);
      *decoded = e.decode(5);  // and a decode step over the whole cache
      // The KV bytes: whole (layer, kv head) rows of K and V in this type, at most the 151 rows' 64-row blocks of
      // every layer (fewer where a sliding window lets blocks go); the half caches hold exactly half the f32
      // cache's bytes (checked below).
      const size_t head_row = static_cast<size_t>(m->config().head_dim) * 2 * kv_type_size(t);
      const size_t row = head_row * static_cast<size_t>(m->config().num_kv_heads) * m->config().num_layers;
      *bytes = e.kv_cache_bytes();
      EXPECT_TRUE(*bytes > 0 && *bytes % head_row == 0 && *bytes <= 192 * row)
          << kv_type_name(t) << ": " << *bytes << " bytes, rows of " << row;
      return all;
    };
    std::vector<float> d32, dh;
    size_t bytes32 = 0, bytes_half = 0;
    const std::vector<float> ref = logits(KVType::F32, &d32, &bytes32);
    float scale = 0;
    for (float x : ref) scale = std::max(scale, std::fabs(x));
    for (KVType t : {KVType::BF16, KVType::F16}) {
      const std::vector<float> got = logits(t, &dh, &bytes_half);
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_EQ(bytes_half * 2, bytes32) << name << " " << kv_type_name(t);
      float worst = 0;
      for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs(got[i] - ref[i]));
      for (size_t i = 0; i < d32.size(); ++i) worst = std::max(worst, std::fabs(dh[i] - d32[i]));
      // Stated tolerance: the K/V rounding (2^-9 relative for bf16, 2^-12 for f16) carried through the layers,
      // relative to the largest logit: 3e-2 (bf16), 5e-3 (f16). Measured on these random-weight fixtures: bf16
      // 6.1e-3..1.7e-2, f16 7.1e-4..1.8e-3 (docs/cpu_kernels.md).
      const float tol = (t == KVType::BF16 ? 3e-2f : 5e-3f) * scale;
      EXPECT_LT(worst, tol) << name << " " << kv_type_name(t) << ": max |diff| " << worst << ", largest |logit| "
                            << scale;
      std::printf("%s %s: max |logit diff| %.3g (largest |logit| %.3g, %.2e relative)\n", name,
                  std::string(kv_type_name(t)).c_str(), worst, scale, worst / scale);
      EXPECT_GT(worst, 0.0f) << name << " " << kv_type_name(t) << ": the half cache changed nothing (not used?)";
    }
  }
}

// Last in this program: it sets the process-wide default (back to f32 at the end).
TEST(KVCacheDefault, EnvironmentThenOverride) {
  ASSERT_EQ(unsetenv("TESSERA_KV_TYPE"), 0);  // ctest runs the tests with TESSERA_KV_TYPE=f32
  EXPECT_EQ(default_kv_type(), KVType::F16);   // the default without an environment or --kv-type
  EXPECT_EQ(EngineOptions{}.kv_type, KVType::F16);
  ASSERT_EQ(setenv("TESSERA_KV_TYPE", "bf16", 1), 0);
  EXPECT_EQ(default_kv_type(), KVType::BF16);
  EXPECT_EQ(EngineOptions{}.kv_type, KVType::BF16);
  ASSERT_EQ(setenv("TESSERA_KV_TYPE", "half", 1), 0);
  try {
    default_kv_type();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "TESSERA_KV_TYPE: expected f32, bf16 or f16, got 'half'");
  }
  set_default_kv_type(KVType::F16);  // --kv-type wins over the environment
  EXPECT_EQ(default_kv_type(), KVType::F16);
  ASSERT_EQ(unsetenv("TESSERA_KV_TYPE"), 0);
  set_default_kv_type(KVType::F32);
  EXPECT_EQ(default_kv_type(), KVType::F32);
}

}  // namespace
}  // namespace tessera::runtime
