// The paged decode attention (runtime/batch_forward.h: paged_decode_attention_cpu) on pools of 1 to 4 threads,
// where a row's keys are cut into parts run on different threads and merged (attention/cpu/paged_decode.h:
// paged_decode_parts, paged_decode_merge): each against the masked reference over the same stored values and
// against the one-thread result (which never splits), and a row alone bit for bit against the same row batched
// (the parts depend on the row alone); then the engine's decode logits with 1 and 3 threads on the
// Gemma-3 fixture (one KV head: every row split).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/paged_decode.h"
#include "core/thread_pool.h"
#include "decode_reference.h"
#include "model/model.h"
#include "runtime/batch_forward.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"

namespace tessera::runtime {
namespace {

using test::decode_reference;

// Restores the process-wide split minimum when a test ends.
struct SplitMinimum {
  int64_t was = attn::paged_split_min_work();
  explicit SplitMinimum(int64_t work) { attn::set_paged_split_min_work(work); }
  ~SplitMinimum() { attn::set_paged_split_min_work(was); }
};

struct Shape {
  int32_t kv_heads, group, d, block;
};

// Views per (layer, q head): layer 0 dense (the group walked together), layer 1 a different MoA sink + window per
// query head (walked one head at a time), layer 2 a sliding window (a Gemma-3 local layer).
std::vector<DecodeView> views_of(int32_t Hq, int32_t group) {
  std::vector<DecodeView> v;
  for (int32_t h = 0; h < Hq; ++h) v.push_back({});
  for (int32_t h = 0; h < Hq; ++h) v.push_back({(h % group) * 3, 40 + 97 * (h % group), kUnbounded});
  for (int32_t h = 0; h < Hq; ++h) v.push_back({0, kUnbounded, 300});
  return v;
}

void check_shape(const Shape& sh, KVType t, uint32_t seed) {
  const int32_t L = 3, Hq = sh.kv_heads * sh.group, d = sh.d;
  const PagedKVShape shape{L, sh.kv_heads, d, sh.block};
  const std::vector<DecodeView> views = views_of(Hq, sh.group);
  ModelConfig cfg;
  cfg.num_layers = L;
  cfg.num_q_heads = Hq;
  cfg.num_kv_heads = sh.kv_heads;
  const std::vector<KVRetention> ret = kv_retention(cfg, views);
  // Rows of different lengths in one batch (a long one among short ones is split alone), lengths off the block.
  const std::vector<int32_t> lengths{1, 37, 700, 1111};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  BlockPool blocks(2000);
  PagedKVStore store(shape, 2000, t);
  std::vector<KVCache> images;
  std::vector<SequenceBlocks> seqs;
  for (int32_t len : lengths) {
    KVCache c(L, sh.kv_heads, d, len, t), img(L, sh.kv_heads, d, len);
    c.reserve(len);
    img.reserve(len);
    std::vector<float> k(static_cast<size_t>(len) * sh.kv_heads * d), v(k.size());
    for (int32_t l = 0; l < L; ++l) {
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      c.write(l, 0, len, k.data(), v.data());
      c.read(l, 0, len, img.k(l, 0), img.v(l, 0));
    }
    SequenceBlocks sq(shape, ret);
    sq.grow(len, blocks);
    scatter_to_pages(c, sq, store);
    images.push_back(std::move(img));
    seqs.push_back(std::move(sq));
  }
  const auto B = static_cast<int64_t>(lengths.size());
  const std::string what = std::string(kv_type_name(t)) + " kv heads " + std::to_string(sh.kv_heads) + " group " +
                           std::to_string(sh.group) + " d " + std::to_string(d) + " block " +
                           std::to_string(sh.block);
  // The whole batch, and the longest row alone (one item per KV head: the split's reason).
  for (const bool alone : {false, true}) {
    std::vector<DecodeRow> rows;
    for (size_t i = alone ? seqs.size() - 1 : 0; i < seqs.size(); ++i) rows.push_back({&seqs[i], views});
    const auto first = static_cast<size_t>(alone ? B - 1 : 0);
    const auto R = static_cast<int64_t>(rows.size());
    std::vector<float> q(static_cast<size_t>(R * Hq * d));
    for (float& x : q) x = nd(rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int32_t l = 0; l < L; ++l) {
      std::vector<float> one(q.size(), NAN);
      ThreadPool single(1);
      paged_decode_attention_cpu(q.data(), one.data(), rows, l, Hq, store, scale, single);
      std::vector<std::vector<float>> refs;
      for (int64_t i = 0; i < R; ++i)
        refs.push_back(decode_reference(q.data() + i * Hq * d, images[first + static_cast<size_t>(i)], l,
                                        lengths[first + static_cast<size_t>(i)], views, Hq, d, scale));
      for (int threads : {2, 3, 4}) {
        ThreadPool pool(threads);
        for (const int64_t min_work : {int64_t{1}, int64_t{2048}, attn::kPagedSplitMinWork}) {
          const SplitMinimum split(min_work);
          std::vector<float> out(q.size(), NAN);
          paged_decode_attention_cpu(q.data(), out.data(), rows, l, Hq, store, scale, pool);
          if (!alone) {  // the long row alone: the same parts, the same bits as in the batch
            const std::vector<DecodeRow> last{rows.back()};
            std::vector<float> own(static_cast<size_t>(Hq * d), NAN);
            paged_decode_attention_cpu(q.data() + (R - 1) * Hq * d, own.data(), last, l, Hq, store, scale, pool);
            ASSERT_TRUE(std::equal(own.begin(), own.end(), out.end() - Hq * d))
                << what << " layer " << l << " threads " << threads << " min work " << min_work
                << ": the long row alone differs from the same row batched";
          }
          for (int64_t i = 0; i < R; ++i) {
            const std::vector<float>& ref = refs[static_cast<size_t>(i)];
            for (int64_t c = 0; c < Hq * d; ++c) {
              const size_t at = static_cast<size_t>(i * Hq * d + c);
              // The same stored values: only the f32 summation order differs.
              ASSERT_NEAR(out[at], ref[static_cast<size_t>(c)], 2e-5)
                  << what << " layer " << l << " threads " << threads << " min work " << min_work << " row " << i
                  << (alone ? " alone" : "") << " element " << c;
              ASSERT_NEAR(out[at], one[at], 2e-6)
                  << what << " layer " << l << " threads " << threads << " min work " << min_work << " row " << i
                  << (alone ? " alone" : "") << " element " << c << " (against one thread)";
            }
          }
        }
      }
    }
  }
}

TEST(PagedDecodeThreads, SplitRowsMatchTheReferenceAndOneThread) {
  uint32_t seed = 1;
  for (KVType t : {KVType::F32, KVType::BF16, KVType::F16}) {
    check_shape({1, 4, 256, 64}, t, seed++);  // Gemma-3-270M's shape
    check_shape({3, 3, 64, 24}, t, seed++);   // SmolLM2's, blocks of 24 (cuts mid-block)
    check_shape({2, 8, 128, 16}, t, seed++);
    check_shape({1, 1, 72, 7}, t, seed++);    // AVX2's dims (not AVX-512's)
  }
}

TEST(PagedDecodeThreads, EngineDecodeLogitsAgreeAcrossThreads) {
  // The Gemma-3 fixture (one KV head, four query heads, a sliding window of 8 on five layers of six): a prompt, then
  // decode steps, on one thread and on three with every row split as far as it goes (and with the default minimum,
  // which does not split rows this short); the logits agree up to the order of the f32 sums.
  const std::unique_ptr<Model> m = Model::load(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/gemma3");
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> tok(1, m->config().vocab_size - 1);
  std::vector<int32_t> prompt(200);
  for (auto& x : prompt) x = tok(rng);
  const std::vector<int32_t> next{5, 77, 3, 200, 9, 41};
  auto run = [&](int threads, int64_t min_work) {
    const SplitMinimum split(min_work);
    ThreadPool pool(threads);
    EngineOptions o;
    o.pool = &pool;
    o.kv_type = KVType::F32;
    Engine e(*m, o);
    std::vector<float> all = e.prefill(prompt);
    for (int32_t t : next) {
      const std::vector<float> step = e.decode(t);
      all.insert(all.end(), step.begin(), step.end());
    }
    return all;
  };
  const std::vector<float> one = run(1, attn::kPagedSplitMinWork);
  float scale = 0;
  for (float x : one) scale = std::max(scale, std::fabs(x));
  ASSERT_GT(scale, 0.0f);
  for (const int64_t min_work : {int64_t{1}, attn::kPagedSplitMinWork}) {
    const std::vector<float> three = run(3, min_work);
    ASSERT_EQ(three.size(), one.size());
    float worst = 0;
    for (size_t i = 0; i < one.size(); ++i) worst = std::max(worst, std::fabs(three[i] - one[i]));
    EXPECT_LE(worst, 1e-4f * scale) << "min work " << min_work << ": logits of up to " << scale;
  }
}

}  // namespace
}  // namespace tessera::runtime
