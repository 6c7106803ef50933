// Ltri's block scores on the device (runtime/cuda/stream_decide.h) against the CPU's (SpanIndex::block_scores) on
// an index built to reach every case of the fused scoring kernel and of the incremental mirror:
//  - tiles of many short spans (up to the 128-span cap: a run of 1-vector spans), tiles of mixed spans, spans longer
//    than one pass of 128 vectors (300 and 129 vectors: their maxima combine across passes);
//  - more query vectors than one pass of 64 rows, query spans straddling the 64-row boundaries;
//  - empty blocks (-inf), and a second call after more spans were added to the last block of the first call and to
//    new blocks (block_begin and the tiles extended, not rebuilt);
//  - every head voting over an index of every kv head, and one retrieval head over an index of its kv head only;
//  - the keys gathered from the ring into the mirror (the engine's way: the host index only counts them), and a host
//    index holding its f32 keys, converted to the bf16 mirror on upload (layers 2 and 3).
// The scorings read the same bf16 mirror: the fused kernel (TESSERA_LTRI_SCORING=fused), the span maxima (gemm) and
// every dot product (gemm-serial) on the tensor cores (q and k are bf16 values, products exact, f32 accumulation
// either way) must be within 1e-5 relative of the CPU's f64 scores of f32 dot products, and the empty blocks exactly
// -inf; the mirror's keys equal the CPU index's. gemm (span maxima, sim in parallel over the heads) equals
// gemm-serial (every dot product, sim_kernel walking the heads in turn) exactly, with one and two rounds of heads. Without the variable the decider takes
// StreamDecider::kDefaultLtriScoring; another value is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/device_buffer.h"
#include "model/model_config.h"
#include "runtime/stream/span_index.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/stream_decide.h"
#include "runtime/cuda/synthetic_config.h"

namespace tessera::runtime::gpu {
namespace {

// Llama-3 architecture, head dim 64, 8 query / 2 kv heads (or nq / nkv).
ModelConfig config(int nq = 8, int nkv = 2) {
  nlohmann::json j = synthetic_hf_config("llama3-8b");
  j["hidden_size"] = 64 * nq;
  j["intermediate_size"] = 1024;
  j["num_attention_heads"] = nq;
  j["num_key_value_heads"] = nkv;
  j["num_hidden_layers"] = 4;
  j["vocab_size"] = 1000;
  j.erase("rope_scaling");
  return config_from_hf(j, "synthetic:small");
}

struct SpanSpec {
  int32_t block, count;
};

// Checks the scores of `scoring` (a TESSERA_LTRI_SCORING value) against the CPU's; returns them all (every call of
// every layer, in order).
// dots_budget > 0: the gemm scoring's tiles of at most that many dot products (many tiles).
std::vector<double> scores_match_the_cpu(const std::string& scoring, const ModelConfig& cfg = config(),
                                         int64_t dots_budget = 0) {
  const bool gemm = scoring != "fused";
  setenv("TESSERA_LTRI_SCORING", scoring.c_str(), 1);
  StreamDecider dec(cfg);
  unsetenv("TESSERA_LTRI_SCORING");
  if (dots_budget > 0) dec.set_dots_budget(dots_budget);
  EXPECT_EQ(dec.fused_scoring(), !gemm);
  EXPECT_EQ(dec.serial_sim(), scoring == "gemm-serial");
  std::vector<double> every;
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  const stream::HeadShape shape{nq, nkv, d};
  const int64_t row = static_cast<int64_t>(nkv) * d, qrow = static_cast<int64_t>(nq) * d;
  // The spans of both calls: (block, vectors).
  std::vector<SpanSpec> first = {{0, 3}, {0, 5}, {0, 2}, {2, 300}, {3, 7}, {3, 1}, {3, 12}, {4, 129}, {5, 4}};
  for (int i = 0; i < 130; ++i) first.push_back({6, 1});  // 130 one-vector spans: a tile of 128, then one more
  first.push_back({7, 6});
  std::vector<SpanSpec> second = {{7, 9}, {7, 128}, {9, 2}, {9, 11}, {10, 1}};  // block 7 gains spans; 8 is empty
  int64_t total = 0;
  for (const auto* list : {&first, &second})
    for (const SpanSpec& sp : *list) total += sp.count;
  // The ring: one row per vector (position p at row p: sinks 0, ring_rows = total), bf16 values.
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16> ring(static_cast<size_t>(total * row));
  for (bf16& x : ring) x = f32_to_bf16(nd(rng));
  attn::gpu::DeviceBuffer<bf16> dring;
  dring.upload(ring);
  // Queries: 160 chunk rows; 150 query vectors in 6 spans (two straddle the 64-row passes).
  const int32_t n = 160;
  std::vector<bf16> q(static_cast<size_t>(n * qrow));
  for (bf16& x : q) x = f32_to_bf16(nd(rng));
  attn::gpu::DeviceBuffer<bf16> dq;
  dq.upload(q);
  const std::vector<int32_t> counts = {1, 70, 5, 40, 30, 4};
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 150; ++i) tokens.push_back((i * 7) % n);  // chunk rows in any order
  std::vector<float> queries;
  for (int32_t t : tokens)
    for (int64_t j = 0; j < qrow; ++j) queries.push_back(bf16_to_f32(q[static_cast<size_t>(t * qrow + j)]));
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  // Layers 0 and 2: every kv head, every head votes; 1 and 3: kv head 1 only, query head 5 (its kv head) votes.
  // Layers 0 and 1: keys from the ring to the mirror; 2 and 3: a host index holding them, uploaded.
  for (int32_t layer = 0; layer < 4; ++layer) {
    const bool all = layer % 2 == 0, host_keys = layer >= 2;
    const int32_t head_begin = all ? 0 : 1, heads = all ? nkv : 1;
    stream::HeadWeights w(static_cast<size_t>(nq), all ? 1.0 / nq : 0.0);
    if (!all) w[5] = 1.0;
    stream::SpanIndex cpu(shape, head_begin, heads), dev(shape, head_begin, heads);
    int32_t next = 0;  // the next ring row
    for (const auto* list : {&first, &second}) {
      for (const SpanSpec& sp : *list) {
        std::vector<float> keys;
        std::vector<int32_t> positions;
        for (int32_t v = 0; v < sp.count; ++v, ++next) {
          positions.push_back(next);
          for (int64_t j = head_begin * d; j < (head_begin + heads) * d; ++j)
            keys.push_back(bf16_to_f32(ring[static_cast<size_t>(next * row + j)]));
        }
        cpu.add(sp.block, keys, sp.count);
        if (host_keys) continue;
        dev.add_counted(sp.block, sp.count);
        dec.append_index_keys(layer, dring.data(), static_cast<int32_t>(total), 0, positions, head_begin, heads, s);
      }
      const std::vector<double> want = cpu.block_scores(queries, counts, w);
      const std::vector<double> got = dec.ltri_scores(layer, host_keys ? cpu : dev, dq.data(), tokens, counts, w, s);
      EXPECT_EQ(got.size(), want.size());
      if (got.size() != want.size()) return every;
      every.insert(every.end(), got.begin(), got.end());
      int32_t empty = 0;
      for (size_t b = 0; b < want.size(); ++b) {
        if (std::isinf(want[b])) {
          EXPECT_EQ(got[b], want[b]) << "layer " << layer << " block " << b;
          ++empty;
          continue;
        }
        EXPECT_LE(std::fabs(got[b] - want[b]) / std::max(1.0, std::fabs(want[b])), 1e-5)
            << scoring << " layer " << layer << " block " << b << ": " << got[b] << " vs " << want[b];
      }
      EXPECT_EQ(empty, list == &first ? 1 : 2);  // block 1, then also block 8
      EXPECT_EQ(dec.mirror_keys(layer), std::vector<float>(cpu.keys().begin(), cpu.keys().end()));
    }
  }
  cudaStreamDestroy(s);
  return every;
}

TEST(StreamDecide, FusedLtriScoresMatchTheCpu) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  scores_match_the_cpu("fused");
}

TEST(StreamDecide, GemmLtriScoresMatchTheCpu) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  scores_match_the_cpu("gemm");
}

// gemm's span maxima (spanmax_kernel, no dots in memory), its sim in parallel over the heads (sim_heads_kernel; one
// voter: sim_kernel's 256-thread CTAs) and its blocks in parallel over the query spans (best_kernel,
// block_sum_kernel) are bit-identical to gemm-serial's dots (dots_kernel), sim_kernel (each span's max over its
// dots, the heads walked in turn by one thread per (t, s)) and block_kernel (a warp per block, the query spans in
// turn): the same products, maxima (exact in any order) and f64 operations in the same order. With 8 query heads (one
// round of heads) and 40 (two rounds: 32, then 8), every head voting and one retrieval head; in one tile, and with a
// budget of 6,000 values a tile (150 query vectors: gemm-serial's tiles of ~40 vectors, whole spans, so a longer span
// is a tile of its own; gemm's runs of one fused tile each).
TEST(StreamDecide, GemmSimEqualsTheSerialSim) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  for (const auto& [nq, nkv] : {std::pair{8, 2}, std::pair{40, 8}}) {
    const ModelConfig cfg = config(nq, nkv);
    const std::vector<double> heads = scores_match_the_cpu("gemm", cfg), serial = scores_match_the_cpu("gemm-serial", cfg);
    EXPECT_FALSE(heads.empty());
    EXPECT_EQ(heads, serial) << nq << " query heads";
    const std::vector<double> small = scores_match_the_cpu("gemm", cfg, 6000);
    EXPECT_EQ(small.size(), serial.size());
    EXPECT_EQ(small, scores_match_the_cpu("gemm-serial", cfg, 6000)) << nq << " query heads, small tiles";
  }
}

TEST(StreamDecide, ScoringDefaultAndBadValue) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  const ModelConfig cfg = config();
  unsetenv("TESSERA_LTRI_SCORING");
  EXPECT_EQ(StreamDecider(cfg).fused_scoring(), std::string(StreamDecider::kDefaultLtriScoring) == "fused");
  setenv("TESSERA_LTRI_SCORING", "sgemm", 1);
  try {
    StreamDecider dec(cfg);
    ADD_FAILURE() << "TESSERA_LTRI_SCORING=sgemm accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "TESSERA_LTRI_SCORING must be fused, gemm or gemm-serial, got 'sgemm'");
  }
  unsetenv("TESSERA_LTRI_SCORING");
}

}  // namespace
}  // namespace tessera::runtime::gpu
