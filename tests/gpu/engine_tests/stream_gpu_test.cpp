// The GPU streaming path (runtime/cuda/stream_gpu_kv.h) against the CPU one (runtime/stream/streaming_kv.h).
//
//  - The policy alone, on the same inputs (q, k, v drawn at random and rounded to bf16, so that both paths see the
//    same values): for every method, chunk after chunk (prefill chunks of two query tiles, a short last chunk, decode
//    steps) and layer after layer, the GPU's layout and retrieved blocks must EQUAL the CPU's, and its attention
//    output must be within bf16 rounding of the CPU's f32 one (relative L2 per call <= 2e-2: q and k are rotated in
//    bf16 and the executor's output is bf16, a few roundings of 2^-9 each). Evicted blocks go through the pinned
//    store and back (more blocks evicted than retrieved: the cache misses and hits both run).
//    The map, votes and block scores come from the device (stream_decide.h): the CPU path is given them
//    (StreamingKV::DeviceDecisions) and must then decide EXACTLY as the GPU did, and separately the device's map and
//    votes must be within rounding of the CPU's own (max abs 1e-4 on entries summing to the head count per row), its
//    Ltri block scores within 1e-5 relative of the CPU's on the same index and query vectors, its InfLLM block scores
//    equal, and the CPU's fully own decisions agree in >= 90% of the calls (a near-tie may flip).
//  - The engine: a random-weight model of head dim 64 (the executor's), streaming with a window that covers the
//    prompt equals the dense GPU engine (logits of the last position, relative L2 <= 2e-2, same top-1), prefill and
//    decode; past the window it runs, evicts, and its decisions are the CPU class's (same object).
//  - Gemma-3 shapes (a random model of head dim 64: two sliding-window layers of window 24 per global layer,
//    QK-norm, local and global RoPE bases): the policy alone as above (sliding-window layers: outputs within bf16
//    rounding of the CPU's attend_window(), layout [held | chunk]; global layers: layouts and retrieved blocks EQUAL
//    the CPU's on the device's decisions, outputs within rounding; only global layers evict and pin), and the engine
//    (QK-norm applied before streaming, each layer's RoPE base) equal to the dense GPU engine while nothing is
//    evicted, prefill and decode.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/thread_pool.h"
#include "cuda/device_buffer.h"
#include "model/model_config.h"
#include "runtime/rope.h"
#include "runtime/sampling.h"
#include "runtime/stream/streaming_kv.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/stream_gpu_kv.h"
#include "runtime/cuda/stream_kernels.h"
#include "runtime/cuda/synthetic_config.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

// Llama-3 architecture, head dim 64 (the executor's), 8 query / 2 kv heads, `layers` layers.
ModelConfig small_config(int layers) {
  nlohmann::json j = synthetic_hf_config("llama3-8b");
  j["hidden_size"] = 512;
  j["intermediate_size"] = 1024;
  j["num_attention_heads"] = 8;
  j["num_key_value_heads"] = 2;
  j["num_hidden_layers"] = layers;
  j["vocab_size"] = 1000;
  j["rope_theta"] = 10000.0;
  j.erase("rope_scaling");
  return config_from_hf(j, "synthetic:small");
}

// Gemma-3 architecture (QK-norm, post-norms, local base 10000 / global base 1e6), head dim 64, 8 query / 2 kv
// heads, `layers` layers of which every third is global; the others attend within a sliding window of `window`.
ModelConfig gemma_config(int layers, int window) {
  const nlohmann::json j = {{"architectures", {"Gemma3ForCausalLM"}},
                            {"model_type", "gemma3_text"},
                            {"vocab_size", 1000},
                            {"hidden_size", 256},
                            {"intermediate_size", 512},
                            {"num_hidden_layers", layers},
                            {"num_attention_heads", 8},
                            {"num_key_value_heads", 2},
                            {"head_dim", 64},
                            {"hidden_activation", "gelu_pytorch_tanh"},
                            {"max_position_embeddings", 32768},
                            {"rms_norm_eps", 1e-6},
                            {"rope_theta", 1000000.0},
                            {"rope_local_base_freq", 10000.0},
                            {"sliding_window", window},
                            {"sliding_window_pattern", 3},
                            {"query_pre_attn_scalar", 64},
                            {"attention_bias", false},
                            {"tie_word_embeddings", true},
                            {"torch_dtype", "bfloat16"}};
  return config_from_hf(j, "synthetic:gemma3-small");
}

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

using test::rel_l2;

TEST(StreamGpu, RetrievesTheCpuBlocksAndMatchesItsAttention) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(3);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / d);
  attn::gpu::DeviceBuffer<float> inv_freq_dev;
  inv_freq_dev.upload(inv_freq);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  ThreadPool pool(2);
  // The fourth pass: Ltri with a retrieval head in layer 1 (query head 5: kv head 1): layer 0 keeps every kv head in
  // its index, layer 1 kv head 1 only, layer 2 none (collaborative voting replaces its scores: never scored). The
  // fifth: the same with --stream-early-layers votes (layer 0 takes the previous chunk's vote: no index, no map) and
  // --stream-map-heads retrieval (layer 1's map is head 5's alone, on both sides).
  for (int pass = 0; pass < 5; ++pass) {
    const StreamMethod m = pass == 1 ? StreamMethod::InfLLM : pass == 2 ? StreamMethod::StreamingLLM : StreamMethod::Ltri;
    const bool heads = pass >= 3, narrow = pass == 4;
    SCOPED_TRACE(std::string(stream_method_name(m)) + (heads ? " + retrieval heads" : "") +
                 (narrow ? ", early votes, the retrieval head's map" : ""));
    StreamOptions o;
    o.method = m;
    o.sinks = 16;
    o.local = 128;
    o.block = 32;
    o.chunk = 96;
    o.top_k = 3;
    if (m == StreamMethod::StreamingLLM) o = streamingllm_equal_memory(o);
    if (heads) o.retrieval_heads = {{1, 5, 0.5}};
    o.early_from_votes = o.map_retrieval_head = narrow;
    StreamingKV cpu(cfg, o);
    StreamingKV own(cfg, o, StreamingKV::Storage::Device);  // the CPU's own map, votes and decisions
    GpuStreamingKV gpu(cfg, o);
    gpu.reserve(2000);
    gpu.record(true);
    const bool maps = cpu.needs_qk();
    const stream::HeadWeights w_all(static_cast<size_t>(nq), 1.0 / nq);  // no retrieval head: every head votes
    stream::HeadWeights w_head(static_cast<size_t>(nq), 0.0);
    w_head[5] = 1.0;
    double worst_map = 0, worst_votes = 0, worst_scores = 0;
    int32_t own_agree = 0, own_calls = 0, scored = 0, candidates = 0;
    int64_t keys_gathered = 0;
    std::mt19937 rng(5);
    std::normal_distribution<float> g(0.0f, 1.0f);
    // Chunks of 96 (two query tiles of 64... the executor's 128-row tile) and 40 (one 64-row tile), a last chunk of 7,
    // then decode.
    std::vector<std::pair<int32_t, StreamingKV::ChunkKind>> chunks;
    for (int i = 0; i < 14; ++i) chunks.push_back({i % 3 == 2 ? 40 : 96, StreamingKV::ChunkKind::Prefill});
    chunks.push_back({7, StreamingKV::ChunkKind::LastPrefill});
    for (int i = 0; i < 3; ++i) chunks.push_back({1, StreamingKV::ChunkKind::Decode});
    int32_t pos = 0, choices = 0;
    double worst = 0;
    attn::gpu::DeviceBuffer<bf16> dq, dk, dv, dout;
    for (const auto& [n, kind] : chunks) {
      cpu.begin_chunk(pos, n, kind);
      if (maps) own.begin_chunk(pos, n, kind);  // (own plans only what maps)
      gpu.begin_chunk(pos, n, kind);
      for (int32_t l = 0; l < cfg.num_layers; ++l) {
        std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * nkv * d)), v(k.size());
        for (auto* t : {&q, &k, &v})
          for (float& x : *t) x = round_bf16(g(rng));
        auto to_bf = [](const std::vector<float>& x) {
          std::vector<bf16> b(x.size());
          for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
          return b;
        };
        dq.upload(to_bf(q));
        dk.upload(to_bf(k));
        dv.upload(to_bf(v));
        dout.resize(q.size());
        std::vector<float> out_cpu(q.size());
        std::vector<float> qc = q, kc = k, vc = v;
        gpu.attend(l, pos, n, dq.data(), dk.data(), dv.data(), inv_freq_dev.data(), inv_freq, 0.0f, dout.data(), s);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        if (!maps || cpu.voted_only(l)) {  // (a voted-only layer maps and scores nothing: its blocks are the votes)
          if (maps) {
            EXPECT_TRUE(gpu.recorded().map.empty() && gpu.recorded().tokens.empty());
            own.plan(l, pos, n, q.data(), k.data(), inv_freq, 0.0f, &pool);  // (its bookkeeping: the chunk goes on)
            EXPECT_TRUE(own.last_map().empty());
          }
          cpu.attend(l, pos, n, qc.data(), kc.data(), vc.data(), inv_freq, 0.0f, out_cpu.data(), pool);
        } else {
          // The device's map and votes against the CPU's own (a function of the chunk's q and k alone).
          const GpuDecisionRecord& rec = gpu.recorded();
          own.plan(l, pos, n, q.data(), k.data(), inv_freq, 0.0f, &pool);
          ASSERT_EQ(rec.map.size(), own.last_map().size());
          ASSERT_EQ(rec.votes.size(), own.last_votes().size());
          for (int32_t r = 0; r < n; ++r)
            for (int32_t c = 0; c <= r; ++c) {
              const size_t i = static_cast<size_t>(r * n + c);
              worst_map = std::max(worst_map, static_cast<double>(std::fabs(rec.map[i] - own.last_map()[i])));
            }
          for (size_t i = 0; i < rec.votes.size(); ++i)
            worst_votes = std::max(worst_votes, std::fabs(static_cast<double>(rec.votes[i]) - own.last_votes()[i]) /
                                                    std::max(1.0, static_cast<double>(own.last_votes()[i])));
          // The CPU path on the device's decisions: the same query vectors asked for, block scores within rounding of
          // its own computation (InfLLM: equal), then the same layout and blocks (asserted below).
          StreamingKV::DeviceDecisions given;
          given.map = rec.map;
          given.votes = rec.votes;
          if (m == StreamMethod::Ltri) {
            // The device's span discovery (theta, candidates, the masses of the spans the host asked for) EQUALS the
            // CPU's on the device's map; the CPU class takes the candidates and masses as the GPU path did.
            const double theta = stream::causal_quantile(rec.map, n, o.theta_quantile);
            EXPECT_EQ(rec.theta, theta) << "layer " << l << " at " << pos;
            const stream::TriangleScores ts(rec.map, n, theta);
            EXPECT_EQ(rec.candidates, stream::span_candidates(ts, true)) << "layer " << l << " at " << pos;
            EXPECT_EQ(rec.masses.size(), rec.mass_spans.size());
            for (size_t i = 0; i < std::min(rec.masses.size(), rec.mass_spans.size()); ++i)
              EXPECT_EQ(rec.masses[i], stream::span_masses(ts, rec.mass_spans[i])) << "layer " << l << " at " << pos;
            candidates += static_cast<int32_t>(rec.candidates.size());
            given.has_candidates = true;
            given.candidates = rec.candidates;
            given.span_masses = [&](std::span<const stream::Span> spans) {
              EXPECT_EQ(std::vector<stream::Span>(spans.begin(), spans.end()), rec.mass_spans);
              return rec.masses;
            };
          }
          given.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                   const stream::HeadWeights& weights) {
            const stream::HeadWeights& w = heads && l == 1 ? w_head : w_all;
            EXPECT_EQ(weights, w);
            EXPECT_FALSE(heads && l == 2) << "layer 2 takes its blocks from the votes: never scored";
            EXPECT_EQ(std::vector<int32_t>(tokens.begin(), tokens.end()), rec.tokens);
            EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.end()), rec.counts);
            std::vector<double> mine;
            if (m == StreamMethod::InfLLM) {
              mine = cpu.repr_index(l).block_scores(q, n, w);
              EXPECT_EQ(mine, rec.scores) << "layer " << l << " at " << pos;
            } else {
              std::vector<float> queries;
              for (int32_t t : tokens)
                queries.insert(queries.end(), q.begin() + t * nq * d, q.begin() + (t + 1) * nq * d);
              mine = cpu.span_index(l).block_scores(queries, counts, w);
            }
            EXPECT_EQ(mine.size(), rec.scores.size());
            for (size_t b = 0; b < std::min(mine.size(), rec.scores.size()); ++b)
              worst_scores = std::max(worst_scores, std::fabs(mine[b] - rec.scores[b]) / std::max(1.0, std::fabs(mine[b])));
            ++scored;
            return rec.scores.size() == mine.size() ? rec.scores : mine;
          };
          cpu.attend(l, pos, n, qc.data(), kc.data(), vc.data(), inv_freq, 0.0f, out_cpu.data(), pool, given);
          // The index keys the GPU gathered from its ring are the CPU's own rows.
          if (m == StreamMethod::Ltri) {  // the device's mirror holds them (the host index only counts them)
            EXPECT_TRUE(std::ranges::equal(gpu.device_index_keys(l), cpu.span_index(l).keys()))
                << "layer " << l << " at " << pos;
            EXPECT_EQ(gpu.decisions().span_index(l).num_vectors(), cpu.span_index(l).num_vectors());
          } else {
            ASSERT_EQ(gpu.decisions().repr_index(l).num_blocks(), cpu.repr_index(l).num_blocks());
            for (int32_t b = 0; b < cpu.repr_index(l).num_blocks(); ++b)
              EXPECT_TRUE(std::ranges::equal(gpu.decisions().repr_index(l).mean(b), cpu.repr_index(l).mean(b)));
          }
          keys_gathered += static_cast<int64_t>(rec.key_positions.size());
          ++own_calls;
          own_agree += own.last_layout(l) == gpu.decisions().last_layout(l) && own.retrieved(l) == gpu.decisions().retrieved(l);
        }
        const std::vector<bf16> ob = dout.download(q.size());
        std::vector<float> out_gpu(q.size());
        for (size_t i = 0; i < ob.size(); ++i) out_gpu[i] = bf16_to_f32(ob[i]);
        ASSERT_EQ(gpu.decisions().last_layout(l), cpu.last_layout(l)) << "layer " << l << " at " << pos;
        ASSERT_EQ(gpu.decisions().retrieved(l), cpu.retrieved(l)) << "layer " << l << " at " << pos;
        const double e = rel_l2(out_cpu, out_gpu);
        worst = std::max(worst, e);
        EXPECT_LT(e, 2e-2) << "layer " << l << " at " << pos << " (" << n << " queries)";
        choices += cpu.evicted_blocks() > o.top_k && !cpu.retrieved(l).empty();
      }
      pos += n;
    }
    if (heads) {  // the index keeps the retrieval head's kv head in layer 1, nothing in layer 2
      EXPECT_EQ(cpu.span_index(0).kv_heads_kept(), narrow ? 0 : nkv);
      EXPECT_EQ(cpu.voted_only(0), narrow);
      EXPECT_EQ(cpu.map_head(1), narrow ? 5 : -1);
      EXPECT_EQ(cpu.span_index(1).kv_heads_kept(), 1);
      EXPECT_EQ(cpu.span_index(1).kv_head_begin(), 1);
      EXPECT_EQ(cpu.span_index(2).num_vectors(), 0);
      EXPECT_EQ(gpu.device_index_keys(1).size(), static_cast<size_t>(cpu.span_index(1).num_vectors() * d));
      EXPECT_EQ(gpu.decisions().stats().index_bytes, cpu.stats().index_bytes);
      std::printf("[stream] ltri + retrieval heads: index %lld bytes (layer vectors %lld / %lld / %lld; kv heads kept "
                  "%d / 1 / 0)\n", static_cast<long long>(cpu.stats().index_bytes),
                  static_cast<long long>(cpu.span_index(0).num_vectors()),
                  static_cast<long long>(cpu.span_index(1).num_vectors()),
                  static_cast<long long>(cpu.span_index(2).num_vectors()), cpu.span_index(0).kv_heads_kept());
    }
    if (maps) {
      std::printf("[stream] %s%s: device vs CPU map max abs diff %.3g, votes max rel diff %.3g, block scores max rel "
                  "diff %.3g (%d scored calls); the CPU's own decisions equal the device-fed ones in %d of %d calls\n",
                  stream_method_name(m), narrow ? " + retrieval heads (early votes, the head's map)" : heads ? " + retrieval heads" : "", worst_map, worst_votes, worst_scores, scored, own_agree, own_calls);
      EXPECT_LT(worst_map, 1e-4);
      EXPECT_LT(worst_votes, 1e-4);
      EXPECT_LT(worst_scores, 1e-5);
      EXPECT_GT(scored, narrow ? 5 : 10);
      std::printf("[stream] %s: %d device span candidates equal to the CPU's on the device's map; %lld index keys "
                  "gathered from the ring\n", stream_method_name(m), candidates, static_cast<long long>(keys_gathered));
      EXPECT_GT(keys_gathered, narrow ? 20 : 100);
      if (m == StreamMethod::Ltri) {
        EXPECT_GT(candidates, narrow ? 30 : 100);
      }
      EXPECT_GE(own_agree * 10, own_calls * 9);  // near-ties may flip; with these inputs none is expected
    }
    const GpuStreamStats& st = gpu.gpu_stats();
    std::printf("[stream] %s: worst rel L2 %.3g; blocks evicted %lld per layer, to host %lld, to device %lld, cached "
                "%lld; pinned %.1f MB\n",
                stream_method_name(m), worst, static_cast<long long>(cpu.evicted_blocks()),
                static_cast<long long>(st.blocks_to_host), static_cast<long long>(st.blocks_to_device),
                static_cast<long long>(st.blocks_cached), static_cast<double>(st.pinned_bytes) / 1e6);
    EXPECT_GT(cpu.evicted_blocks(), 3 * o.top_k);
    EXPECT_EQ(gpu.decisions().stats().host_bytes * 2, cpu.stats().host_bytes);  // bf16 against f32
    if (m == StreamMethod::StreamingLLM) {  // never retrieves: keeps nothing, copies nothing, pins nothing
      EXPECT_EQ(st.blocks_to_host, 0);
      EXPECT_EQ(st.pinned_bytes, 0);
      EXPECT_EQ(cpu.stats().host_bytes, 0);
    } else {
      EXPECT_EQ(st.blocks_to_host, static_cast<int64_t>(cpu.evicted_blocks()) * cfg.num_layers);
      EXPECT_GT(choices, 20);
      EXPECT_GT(st.blocks_to_device, 0);
      EXPECT_GT(st.blocks_cached, 0);  // decode's persisted blocks at least
    }
  }
  cudaStreamDestroy(s);
}

// Gemma-3 shapes through the policy alone: sliding-window layers keep their own window on the device (outputs within
// rounding of the CPU's), global layers stream with the device's decisions (the CPU path, given them, must decide
// EXACTLY as the GPU did: layouts and blocks equal), each layer with its own RoPE base, past the first evictions.
TEST(StreamGpu, GemmaShapesSlidingWindowLayersAndTwoRopeBasesMatchTheCpu) {
  REQUIRE_GPU();
  const ModelConfig cfg = gemma_config(6, 24);
  ASSERT_TRUE(cfg.qk_norm);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  const LayerRopes ropes = layer_ropes(cfg);
  ASSERT_EQ(ropes.inv_freqs.size(), 2u);  // the local and global bases
  std::vector<attn::gpu::DeviceBuffer<float>> freq_dev(ropes.inv_freqs.size());
  for (size_t r = 0; r < freq_dev.size(); ++r) freq_dev[r].upload(ropes.inv_freqs[r]);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  ThreadPool pool(2);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    StreamOptions o;
    o.method = m;
    o.sinks = 16;
    o.local = 128;
    o.block = 32;
    o.chunk = 96;
    o.top_k = 3;
    if (m == StreamMethod::StreamingLLM) o = streamingllm_equal_memory(o);
    StreamingKV cpu(cfg, o);
    GpuStreamingKV gpu(cfg, o);
    ASSERT_EQ(cpu.global_layers(), 2);
    gpu.reserve(2000);
    gpu.record(true);
    std::mt19937 rng(11);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<std::pair<int32_t, StreamingKV::ChunkKind>> chunks;
    for (int i = 0; i < 12; ++i) chunks.push_back({i % 3 == 2 ? 40 : 96, StreamingKV::ChunkKind::Prefill});
    chunks.push_back({7, StreamingKV::ChunkKind::LastPrefill});
    for (int i = 0; i < 3; ++i) chunks.push_back({1, StreamingKV::ChunkKind::Decode});
    int32_t pos = 0, choices = 0;
    double worst_window = 0, worst_global = 0;
    attn::gpu::DeviceBuffer<bf16> dq, dk, dv, dout;
    for (const auto& [n, kind] : chunks) {
      cpu.begin_chunk(pos, n, kind);
      gpu.begin_chunk(pos, n, kind);
      for (int32_t l = 0; l < cfg.num_layers; ++l) {
        const std::vector<float>& inv_freq = ropes.inv_freqs[ropes.layer[static_cast<size_t>(l)]];
        const float* inv_freq_dev = freq_dev[ropes.layer[static_cast<size_t>(l)]].data();
        std::vector<float> q(static_cast<size_t>(n * nq * d)), k(static_cast<size_t>(n * nkv * d)), v(k.size());
        for (auto* t : {&q, &k, &v})
          for (float& x : *t) x = round_bf16(g(rng));
        auto to_bf = [](const std::vector<float>& x) {
          std::vector<bf16> b(x.size());
          for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
          return b;
        };
        dq.upload(to_bf(q));
        dk.upload(to_bf(k));
        dv.upload(to_bf(v));
        dout.resize(q.size());
        std::vector<float> out_cpu(q.size());
        gpu.attend(l, pos, n, dq.data(), dk.data(), dv.data(), inv_freq_dev, inv_freq, 0.0f, dout.data(), s);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        const GpuDecisionRecord& rec = gpu.recorded();
        if (cpu.windowed(l) || !cpu.needs_qk()) {
          if (cpu.windowed(l)) {
            EXPECT_TRUE(rec.votes.empty() && rec.key_positions.empty());  // no decisions
          }
          cpu.attend(l, pos, n, q.data(), k.data(), v.data(), inv_freq, 0.0f, out_cpu.data(), pool);
        } else {
          // The CPU path on the device's votes, span candidates, masses, index keys' positions and block scores.
          StreamingKV::DeviceDecisions given;
          given.map = rec.map;
          given.votes = rec.votes;
          if (m == StreamMethod::Ltri) {
            given.has_candidates = true;
            given.candidates = rec.candidates;
            given.span_masses = [&](std::span<const stream::Span> spans) {
              EXPECT_EQ(std::vector<stream::Span>(spans.begin(), spans.end()), rec.mass_spans);
              return rec.masses;
            };
          }
          given.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                   const stream::HeadWeights&) {
            EXPECT_EQ(std::vector<int32_t>(tokens.begin(), tokens.end()), rec.tokens);
            EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.end()), rec.counts);
            return rec.scores;
          };
          cpu.attend(l, pos, n, q.data(), k.data(), v.data(), inv_freq, 0.0f, out_cpu.data(), pool, given);
          if (m == StreamMethod::Ltri) {
            EXPECT_TRUE(std::ranges::equal(gpu.device_index_keys(l), cpu.span_index(l).keys()))
                << "layer " << l << " at " << pos;
          }
        }
        const std::vector<bf16> ob = dout.download(q.size());
        std::vector<float> out_gpu(q.size());
        for (size_t i = 0; i < ob.size(); ++i) out_gpu[i] = bf16_to_f32(ob[i]);
        ASSERT_EQ(gpu.decisions().last_layout(l), cpu.last_layout(l)) << "layer " << l << " at " << pos;
        ASSERT_EQ(gpu.decisions().retrieved(l), cpu.retrieved(l)) << "layer " << l << " at " << pos;
        const double e = rel_l2(out_cpu, out_gpu);
        EXPECT_LT(e, 2e-2) << "layer " << l << " at " << pos << " (" << n << " queries)";
        if (cpu.windowed(l)) {
          EXPECT_EQ(cpu.last_layout(l), (stream::StreamLayout{0, std::min(pos, 23), n})) << "layer " << l;
          EXPECT_EQ(gpu.decisions().window_tokens(l), cpu.window_tokens(l));
          EXPECT_TRUE(cpu.retrieved(l).empty());
          worst_window = std::max(worst_window, e);
        } else {
          worst_global = std::max(worst_global, e);
          choices += cpu.evicted_blocks() > o.top_k && !cpu.retrieved(l).empty();
        }
      }
      pos += n;
    }
    const GpuStreamStats& st = gpu.gpu_stats();
    std::printf("[stream] gemma shapes %s: worst rel L2 sliding-window layers %.3g, global layers %.3g; blocks "
                "evicted %lld per global layer, to host %lld, to device %lld; pinned %.1f MB\n",
                stream_method_name(m), worst_window, worst_global, static_cast<long long>(cpu.evicted_blocks()),
                static_cast<long long>(st.blocks_to_host), static_cast<long long>(st.blocks_to_device),
                static_cast<double>(st.pinned_bytes) / 1e6);
    EXPECT_GT(cpu.evicted_blocks(), 3 * o.top_k);
    EXPECT_EQ(gpu.decisions().stats().host_bytes * 2, cpu.stats().host_bytes);  // bf16 against f32
    if (m == StreamMethod::StreamingLLM) {
      EXPECT_EQ(st.blocks_to_host, 0);
      EXPECT_EQ(st.pinned_bytes, 0);
    } else {  // the global layers' blocks only
      EXPECT_EQ(st.blocks_to_host, static_cast<int64_t>(cpu.evicted_blocks()) * cpu.global_layers());
      EXPECT_GT(choices, 10);
      EXPECT_GT(st.blocks_to_device, 0);
    }
  }
  cudaStreamDestroy(s);
}

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

TEST(StreamGpu, EngineEqualsDenseWhileNothingIsEvictedAndRunsPastTheWindow) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 3);
  const std::vector<int32_t> tokens = random_tokens(700, cfg.vocab_size, 9);
  GpuEngineOptions dense;
  dense.chunk_size = 256;
  GpuEngine ref(*model, dense);
  std::vector<float> want = ref.prefill(std::span<const int32_t>(tokens.data(), 600));
  std::vector<float> want_decode = ref.decode(tokens[600]);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    GpuEngineOptions so;
    so.stream.method = m;
    so.stream.sinks = 16;
    so.stream.local = 1024;  // covers the prompt: nothing evicted
    so.stream.block = 64;
    so.stream.chunk = 128;
    so.stream.top_k = 4;
    GpuEngine engine(*model, so);
    const std::vector<float> got = engine.prefill(std::span<const int32_t>(tokens.data(), 600));
    const std::vector<float> got_decode = engine.decode(tokens[600]);
    const double e = rel_l2(want, got), ed = rel_l2(want_decode, got_decode);
    std::printf("[stream] engine %s vs dense, window covering the prompt: rel L2 prefill %.3g, decode %.3g\n",
                stream_method_name(m), e, ed);
    EXPECT_LT(e, 2e-2);
    EXPECT_LT(ed, 2e-2);
    EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
              std::max_element(want.begin(), want.end()) - want.begin());
    EXPECT_EQ(engine.streaming()->evicted_blocks(), 0);

    // Past the window: evicts and retrieves; bounded workspace; the logits are finite.
    GpuEngineOptions past = so;
    past.stream.local = 128;
    GpuEngine small(*model, past);
    const std::vector<float> logits = small.prefill(tokens);
    for (int i = 0; i < 4; ++i) (void)small.decode(tokens[static_cast<size_t>(i)]);
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
    const StreamStats st = small.streaming()->stats();
    EXPECT_EQ(st.evicted_blocks, (704 - 16 - 128) / 64);
    EXPECT_LE(st.workspace_tokens, past.stream.attended_tokens());
    EXPECT_EQ(small.gpu_streaming()->gpu_stats().blocks_to_host,
              m == StreamMethod::StreamingLLM ? 0 : st.evicted_blocks * cfg.num_layers);
  }
}

// Streaming options that evict many blocks in a short prompt: 16 sinks, a 128-token window, 64-token blocks, chunks of
// 96 (the last 40), top_k retrieved blocks.
GpuEngineOptions evicting_stream(StreamMethod m, int32_t top_k) {
  GpuEngineOptions so;
  so.stream.method = m;
  so.stream.sinks = 16;
  so.stream.local = 128;
  so.stream.block = 64;
  so.stream.chunk = 96;
  so.stream.last_chunk = 40;
  so.stream.top_k = top_k;
  return so;
}

// score() of a streamed sequence, evicting and retrieving: the rows reduced on the device equal the host's
// log-softmax of the same options' logits (forward_all_logits through the same decisions).
TEST(StreamGpu, ScoresOnTheDeviceEqualTheHostLogSoftmax) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 3);
  const std::vector<int32_t> tokens = random_tokens(700, cfg.vocab_size, 9);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::StreamingLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    const GpuEngineOptions so = evicting_stream(m, 4);
    GpuEngine rows(*model, so), scorer(*model, so);
    const std::vector<float> all = rows.forward_all_logits(tokens);
    const std::vector<double> lp = scorer.score(tokens);
    const std::vector<double> host = next_token_logprobs(all, cfg.vocab_size, std::span<const int32_t>(tokens).subspan(1));
    ASSERT_EQ(lp.size(), host.size());
    for (size_t i = 0; i < lp.size(); ++i) EXPECT_NEAR(lp[i], host[i], 1e-5) << "row " << i;
    EXPECT_GT(scorer.streaming()->stats().evicted_blocks, 0);
  }
}

// Gemma-3 shapes through the engine: QK-norm before the streaming policy and each layer's RoPE base; with a local
// window covering the prompt, the streaming engine equals the dense GPU engine (which applies QK-norm and RoPE in one
// kernel and the sliding windows in the executor), prefill and decode; past the window it evicts from the global
// layers only.
TEST(StreamGpu, GemmaShapesEngineEqualsDenseWhileNothingIsEvicted) {
  REQUIRE_GPU();
  const ModelConfig cfg = gemma_config(6, 32);
  const auto model = DeviceModel::random(cfg, 6);
  const std::vector<int32_t> tokens = random_tokens(700, cfg.vocab_size, 17);
  GpuEngineOptions dense;
  dense.chunk_size = 256;
  GpuEngine ref(*model, dense);
  const std::vector<float> want = ref.prefill(std::span<const int32_t>(tokens.data(), 600));
  const std::vector<float> want_decode = ref.decode(tokens[600]);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    GpuEngineOptions so;
    so.stream.method = m;
    so.stream.sinks = 16;
    so.stream.local = 1024;  // covers the prompt: nothing evicted
    so.stream.block = 64;
    so.stream.chunk = 128;
    so.stream.top_k = 4;
    GpuEngine engine(*model, so);
    const std::vector<float> got = engine.prefill(std::span<const int32_t>(tokens.data(), 600));
    const std::vector<float> got_decode = engine.decode(tokens[600]);
    const double e = rel_l2(want, got), ed = rel_l2(want_decode, got_decode);
    std::printf("[stream] gemma shapes engine %s vs dense, window covering the prompt: rel L2 prefill %.3g, decode "
                "%.3g\n", stream_method_name(m), e, ed);
    EXPECT_LT(e, 2e-2);
    EXPECT_LT(ed, 2e-2);
    // (Not the same top-1: this random model's logits are nearly flat, and the streaming path rounds q and k to bf16
    // after QK-norm and again after RoPE where the dense kernel rounds once. The dense top-1 is in the top 5.)
    const auto top = std::max_element(want.begin(), want.end()) - want.begin();
    EXPECT_LT(std::count_if(got.begin(), got.end(), [&](float x) { return x > got[static_cast<size_t>(top)]; }), 5);
    EXPECT_EQ(engine.streaming()->evicted_blocks(), 0);
    EXPECT_EQ(engine.streaming()->window_tokens(0), 31);

    GpuEngineOptions past = so;
    past.stream.local = 128;
    GpuEngine small(*model, past);
    const std::vector<float> logits = small.prefill(tokens);
    for (int i = 0; i < 3; ++i) (void)small.decode(tokens[static_cast<size_t>(i)]);
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
    const StreamStats st = small.streaming()->stats();
    EXPECT_EQ(st.evicted_blocks, (702 - 16 - 128) / 64);
    EXPECT_LE(st.workspace_tokens, past.stream.attended_tokens());
    EXPECT_EQ(small.gpu_streaming()->gpu_stats().blocks_to_host,
              m == StreamMethod::StreamingLLM ? 0 : st.evicted_blocks * 2);  // 2 global layers of 6
  }
}

// An engine built with the environment variable `var` set to `value` (the path switches GpuStreamingKV's
// constructor reads), which is unset again before it returns.
std::unique_ptr<GpuEngine> engine_with_env(const DeviceModel& model, const GpuEngineOptions& options, const char* var,
                                           const char* value) {
  setenv(var, value, 1);
  struct Unset {
    const char* var;
    ~Unset() { unsetenv(var); }
  } unset{var};
  return std::make_unique<GpuEngine>(model, options);
}

// Two engines that must compute the same: a prefill, 3 decode steps and a reset, twice, with EQUAL logits; `after`
// checks their stats before each reset.
void expect_equal_logits(GpuEngine& a, GpuEngine& b, const std::vector<int32_t>& tokens,
                         const std::function<void()>& after) {
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(a.prefill(tokens), b.prefill(tokens)) << "round " << round;
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(a.decode(tokens[static_cast<size_t>(i)]), b.decode(tokens[static_cast<size_t>(i)]))
          << "decode step " << i;
    after();
    a.reset();
    b.reset();
  }
}

// streamingllm keeps its window rotated in a linear buffer that the attention reads in place (moved to the front when
// full) instead of copying it out of the ring and rotating it every chunk: the same rows and rotation, so the logits
// EQUAL the workspace path's (TESSERA_STREAM_WINDOW=copy), through several moves of the window and decode steps.
TEST(StreamGpu, KeptWindowEqualsTheWorkspacePath) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 4);
  const std::vector<int32_t> tokens = random_tokens(1500, cfg.vocab_size, 13);
  GpuEngineOptions so = evicting_stream(StreamMethod::StreamingLLM, 2);
  so.stream = streamingllm_equal_memory(so.stream);
  GpuEngine kept(*model, so);
  const auto copied = engine_with_env(*model, so, "TESSERA_STREAM_WINDOW", "copy");
  ASSERT_TRUE(kept.gpu_streaming()->window_kept());
  ASSERT_FALSE(copied->gpu_streaming()->window_kept());
  for (int round = 0; round < 2; ++round) {  // and again after reset()
    EXPECT_EQ(kept.prefill(tokens), copied->prefill(tokens)) << "round " << round;
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(kept.decode(tokens[static_cast<size_t>(i)]), copied->decode(tokens[static_cast<size_t>(i)]))
          << "decode step " << i;
    EXPECT_GT(kept.streaming()->evicted_blocks(), 10);
    kept.reset();
    copied->reset();
  }
}

// The batched copies (GpuStreamingKV::batched_copies(): a layer's evicted / retrieved blocks in one
// cudaMemcpyBatchAsync each way, the workspace's sinks and retrieved blocks by one stream_copy_rows launch) move the
// same bytes as one cudaMemcpyAsync per block (TESSERA_STREAM_COPIES=each): the logits EQUAL, for both retrieving
// methods, over prefill chunks past many evictions (cache misses and hits), decode steps and a reset.
TEST(StreamGpu, BatchedCopiesEqualOneCopyPerBlock) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 6);
  const std::vector<int32_t> tokens = random_tokens(1500, cfg.vocab_size, 17);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    const GpuEngineOptions so = evicting_stream(m, 3);
    GpuEngine batched(*model, so);
    const auto each = engine_with_env(*model, so, "TESSERA_STREAM_COPIES", "each");
    ASSERT_TRUE(batched.gpu_streaming()->batched_copies());
    ASSERT_FALSE(each->gpu_streaming()->batched_copies());
    expect_equal_logits(batched, *each, tokens, [&] {
      EXPECT_GT(batched.gpu_streaming()->gpu_stats().blocks_to_device, 0);
      EXPECT_EQ(batched.gpu_streaming()->gpu_stats().blocks_to_device, each->gpu_streaming()->gpu_stats().blocks_to_device);
      EXPECT_EQ(batched.gpu_streaming()->gpu_stats().blocks_cached, each->gpu_streaming()->gpu_stats().blocks_cached);
    });
  }
}

// The retrieved blocks' copies to the device on their own stream (the default) against behind the evictions' copies
// out on one stream (TESSERA_STREAM_COPY_IN=0): the same copies, so the logits EQUAL, for both retrieving methods, bf16
// and FP8 blocks (a block retrieved in the chunk that evicts it waits for its copy out), prefill, decode and a reset.
TEST(StreamGpu, RetrievedBlocksCopiedOnTheirOwnStreamEqualOneCopyStream) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 8);
  const std::vector<int32_t> tokens = random_tokens(1500, cfg.vocab_size, 23);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM})
    for (bool fp8 : {false, true}) {
      SCOPED_TRACE(std::string(stream_method_name(m)) + (fp8 ? " fp8 blocks" : " bf16 blocks"));
      GpuEngineOptions so = evicting_stream(m, 3);
      so.stream.host_fp8 = fp8;
      GpuEngine split(*model, so);
      const auto one = engine_with_env(*model, so, "TESSERA_STREAM_COPY_IN", "0");
      ASSERT_TRUE(split.gpu_streaming()->split_copies());
      ASSERT_FALSE(one->gpu_streaming()->split_copies());
      expect_equal_logits(split, *one, tokens, [&] {
        EXPECT_GT(split.gpu_streaming()->gpu_stats().blocks_to_device, 0);
        EXPECT_EQ(split.gpu_streaming()->gpu_stats().blocks_to_device,
                  one->gpu_streaming()->gpu_stats().blocks_to_device);
      });
    }
}

// The decisions on their own stream overlapping the local pass (TESSERA_STREAM_OVERLAP=1) with the block cache of
// top_k x 4 slots (the default, least recently read replaced) against one stream (the default) and a cache of top_k
// slots (TESSERA_STREAM_CACHE=1): the same operations on the same data, so the logits EQUAL, for both retrieving
// methods, prefill past many evictions, decode and a reset; the larger cache copies fewer blocks.
TEST(StreamGpu, OverlappedDecisionsAndLargerCacheEqualTheSerialPath) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(3);
  const auto model = DeviceModel::random(cfg, 7);
  const std::vector<int32_t> tokens = random_tokens(1700, cfg.vocab_size, 19);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    GpuEngineOptions so = evicting_stream(m, 3);
    if (m == StreamMethod::Ltri) so.stream.retrieval_heads = {RetrievalHead{1, 2, 0.5}};  // layer 2: voted only
    const auto fast = engine_with_env(*model, so, "TESSERA_STREAM_OVERLAP", "1");
    const auto serial = engine_with_env(*model, so, "TESSERA_STREAM_CACHE", "1");
    ASSERT_TRUE(fast->gpu_streaming()->overlap_decisions());
    ASSERT_FALSE(serial->gpu_streaming()->overlap_decisions());
    expect_equal_logits(*fast, *serial, tokens, [&] {
      const GpuStreamStats& f = fast->gpu_streaming()->gpu_stats();
      const GpuStreamStats& o = serial->gpu_streaming()->gpu_stats();
      EXPECT_EQ(f.blocks_to_device + f.blocks_cached, o.blocks_to_device + o.blocks_cached);
      EXPECT_LE(f.blocks_to_device, o.blocks_to_device);
      EXPECT_GT(f.blocks_cached, 0);
    });
  }
}

// The local pass queued just before the host waits for each of the decisions' results (TESSERA_STREAM_LOCAL_AT:
// candidates, masses, block scores; StreamDecider::before_next_wait) against the default (after the decisions): the
// same operations on the same data, so the same logits bit for bit and the same blocks moved.
TEST(StreamGpu, LocalPassBeforeEachWaitEqualsTheLocalPassAfter) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(3);
  const auto model = DeviceModel::random(cfg, 7);
  const std::vector<int32_t> tokens = random_tokens(1700, cfg.vocab_size, 19);
  GpuEngineOptions so = evicting_stream(StreamMethod::Ltri, 3);
  so.stream.retrieval_heads = {RetrievalHead{1, 2, 0.5}};  // layer 2: voted only
  const auto after = engine_with_env(*model, so, "TESSERA_STREAM_LOCAL_AT", "after");
  ASSERT_EQ(after->gpu_streaming()->local_at(), GpuStreamingKV::LocalAt::After);
  for (const char* at : {"candidates", "masses", "scores"}) {
    SCOPED_TRACE(at);
    const auto early = engine_with_env(*model, so, "TESSERA_STREAM_LOCAL_AT", at);
    ASSERT_NE(early->gpu_streaming()->local_at(), GpuStreamingKV::LocalAt::After);
    const GpuStreamStats a0 = after->gpu_streaming()->gpu_stats();  // (`after` runs once per `at`: its stats add up)
    expect_equal_logits(*early, *after, tokens, [&] {
      const GpuStreamStats& e = early->gpu_streaming()->gpu_stats();
      const GpuStreamStats& a = after->gpu_streaming()->gpu_stats();
      EXPECT_EQ(e.blocks_to_device, a.blocks_to_device - a0.blocks_to_device);
      EXPECT_EQ(e.blocks_cached, a.blocks_cached - a0.blocks_cached);
      EXPECT_GT(e.blocks_to_host, 0);
    });
  }
  try {
    engine_with_env(*model, so, "TESSERA_STREAM_LOCAL_AT", "never");
    ADD_FAILURE() << "TESSERA_STREAM_LOCAL_AT=never was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "TESSERA_STREAM_LOCAL_AT must be after, candidates, masses or scores, got 'never'");
  }
}

// stream_copy_rows against its host twin (a memcpy per range): ranges of different lengths (0 rows included) into
// a destination, K and V, with rows of 8k values (the 16-byte path) and of 13 (one value at a time), and the error
// past kMax ranges.
TEST(StreamGpu, CopyRowsEqualsAMemcpyPerRange) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const int64_t row : {int64_t{64}, int64_t{13}}) {
    SCOPED_TRACE(row);
    const std::vector<int32_t> lengths = {5, 0, 64, 1, 64, 33, 2};
    std::vector<std::vector<bf16>> hk, hv;
    std::vector<attn::gpu::DeviceBuffer<bf16>> dk, dv;
    StreamRowCopies c;
    int32_t at = 3;  // the destination's first rows stay as they were
    for (size_t i = 0; i < lengths.size(); ++i) {
      const size_t n = static_cast<size_t>(std::max(lengths[i], 1) * row);
      hk.emplace_back(n);
      hv.emplace_back(n);
      for (size_t j = 0; j < n; ++j) {
        hk.back()[j] = f32_to_bf16(u(rng));
        hv.back()[j] = f32_to_bf16(u(rng));
      }
      dk.emplace_back(n);
      dv.emplace_back(n);
      dk.back().upload(hk.back());
      dv.back().upload(hv.back());
      c.src_k[i] = dk.back().data();
      c.src_v[i] = dv.back().data();
      c.dst_row[i] = at;
      c.rows[i] = lengths[i];
      at += lengths[i];
    }
    c.count = static_cast<int32_t>(lengths.size());
    const size_t total = static_cast<size_t>((at + 4) * row);
    std::vector<bf16> want_k(total), want_v(total);
    for (size_t j = 0; j < total; ++j) {
      want_k[j] = f32_to_bf16(static_cast<float>(j % 7));
      want_v[j] = f32_to_bf16(-static_cast<float>(j % 5));
    }
    attn::gpu::DeviceBuffer<bf16> out_k(total), out_v(total);
    out_k.upload(want_k);
    out_v.upload(want_v);
    for (size_t i = 0; i < lengths.size(); ++i) {  // the host twin
      const size_t values = static_cast<size_t>(lengths[i] * row), dst = static_cast<size_t>(c.dst_row[i] * row);
      std::copy(hk[i].begin(), hk[i].begin() + static_cast<std::ptrdiff_t>(values), want_k.begin() + static_cast<std::ptrdiff_t>(dst));
      std::copy(hv[i].begin(), hv[i].begin() + static_cast<std::ptrdiff_t>(values), want_v.begin() + static_cast<std::ptrdiff_t>(dst));
    }
    stream_copy_rows(out_k.data(), out_v.data(), row, c, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<bf16> got_k = out_k.download(), got_v = out_v.download();
    EXPECT_EQ(0, std::memcmp(got_k.data(), want_k.data(), total * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(got_v.data(), want_v.data(), total * sizeof(bf16)));
  }
  StreamRowCopies too_many;
  too_many.count = StreamRowCopies::kMax + 1;
  try {
    stream_copy_rows(nullptr, nullptr, 8, too_many, nullptr);
    FAIL() << "no error past kMax ranges";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "stream_copy_rows: more than 48 ranges in one launch");
  }
}

// stream_rope_copy (and stream_rope_rows, its one in-place job) against runtime/rope.h's tables and a double
// rotation: every value within half a bf16 step of the exact one (plus f32 rounding); the 16-byte path (rows of 8k
// values) equal bit for bit to the one-value path (rows of 8k + 3 values); copies equal to in-place rotations; a
// step-0 job at one position; rows no job names left as they were; four jobs in one launch, the fifth refused.
TEST(StreamGpu, RopeCopyEqualsTheCpuRotation) {
  REQUIRE_GPU();
  const int heads = 3, d = 64, half = d / 2;
  RopeConfig rc;
  rc.theta = 500000.0f;
  const std::vector<float> inv = rope_inv_freq(rc, d);
  attn::gpu::DeviceBuffer<float> dinv(inv.size());
  dinv.upload(inv);
  std::mt19937 rng(41);
  std::normal_distribution<float> g(0.0f, 2.0f);
  // Jobs over one source of `rows` rows: rows [0, 37) copied at positions from 1,000,003; rows [37, 40) copied, all
  // at position 4,096 (step 0); rows [40, 70) rotated in place at positions from 17.
  const int64_t rows = 70;
  std::vector<float> values(static_cast<size_t>(rows * heads * d));  // the same values for both row widths
  for (float& x : values) x = g(rng);
  std::vector<std::vector<bf16>> results;
  for (const int64_t ld : {int64_t{heads * d + 8}, int64_t{heads * d + 3}}) {
    SCOPED_TRACE(ld);
    std::vector<bf16> src(static_cast<size_t>(rows * ld));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < ld; ++c)
        src[static_cast<size_t>(r * ld + c)] =
            f32_to_bf16(c < heads * d ? values[static_cast<size_t>(r * heads * d + c)] : 100.0f + static_cast<float>(c));
    std::vector<bf16> dst0(src.size());
    for (size_t j = 0; j < dst0.size(); ++j) dst0[j] = f32_to_bf16(static_cast<float>(j % 9) - 4.0f);
    attn::gpu::DeviceBuffer<bf16> ds(src.size()), dd(dst0.size());
    ds.upload(src);
    dd.upload(dst0);
    StreamRopeJobs jobs;
    jobs.add(dd.data(), ds.data(), 37, 1000003, 1);
    jobs.add(dd.data() + 37 * ld, ds.data() + 37 * ld, 3, 4096, 0);
    jobs.add(ds.data() + 40 * ld, ds.data() + 40 * ld, 30, 17, 1);
    jobs.add(dd.data() + 40 * ld, ds.data(), 0, 0, 1);  // (no rows: not a job)
    EXPECT_EQ(jobs.count, 3);
    stream_rope_copy(jobs, ld, heads, d, dinv.data(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<bf16> got_d = dd.download(), got_s = ds.download();
    // The reference, and the untouched rows: dst rows [40, 70), src rows [0, 40) (and every row's padding).
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = r < 37 ? 1000003 + r : r < 40 ? 4096 : 17 + (r - 40);
      rope_tables(inv, p, 1, cs.data(), sn.data());
      const std::vector<bf16>& got = r < 40 ? got_d : got_s;
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < half; ++i) {
          const size_t ia = static_cast<size_t>(r * ld + h * d + i), ib = ia + half;
          const double a = bf16_to_f32(src[ia]), b = bf16_to_f32(src[ib]);
          const double want_a = a * cs[static_cast<size_t>(i)] - b * sn[static_cast<size_t>(i)];
          const double want_b = b * cs[static_cast<size_t>(i)] + a * sn[static_cast<size_t>(i)];
          for (const auto& [gv, want] : {std::pair{got[ia], want_a}, std::pair{got[ib], want_b}}) {
            const double err = std::fabs(bf16_to_f32(gv) - want) / (std::fabs(want) * std::ldexp(1.0, -8) + 1e-6 * (std::fabs(a) + std::fabs(b)));
            worst = std::max(worst, err);
          }
        }
      for (int64_t c = heads * d; c < ld; ++c) {  // padding
        const size_t j = static_cast<size_t>(r * ld + c);
        EXPECT_EQ(got_s[j].bits, src[j].bits);
        EXPECT_EQ(got_d[j].bits, dst0[j].bits);
      }
      if (r < 40) {
        for (int64_t c = 0; c < ld; ++c) EXPECT_EQ(got_s[static_cast<size_t>(r * ld + c)].bits, src[static_cast<size_t>(r * ld + c)].bits);
      } else {
        for (int64_t c = 0; c < ld; ++c) EXPECT_EQ(got_d[static_cast<size_t>(r * ld + c)].bits, dst0[static_cast<size_t>(r * ld + c)].bits);
      }
    }
    EXPECT_LE(worst, 1.0) << "a value past half a bf16 step of the exact rotation";
    // stream_rope_rows in place on a copy of src equals the copying job, bit for bit.
    attn::gpu::DeviceBuffer<bf16> inplace(src.size());
    inplace.upload(src);
    stream_rope_rows(inplace.data(), 37, ld, heads, d, dinv.data(), 1000003, 1, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<bf16> got_i = inplace.download();
    for (int64_t r = 0; r < 37; ++r)
      for (int64_t c = 0; c < heads * d; ++c)
        ASSERT_EQ(got_i[static_cast<size_t>(r * ld + c)].bits, got_d[static_cast<size_t>(r * ld + c)].bits) << r << " " << c;
    // Both row widths' values, without padding, for the comparison of the two paths below.
    std::vector<bf16> packed;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < heads * d; ++c) packed.push_back((r < 40 ? got_d : got_s)[static_cast<size_t>(r * ld + c)]);
    results.push_back(std::move(packed));
  }
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(bf16)))
      << "the 16-byte path differs from the one-value path";
  StreamRopeJobs full;
  for (int i = 0; i < StreamRopeJobs::kMax; ++i) full.add(nullptr, nullptr, 1, 0, 1);
  try {
    full.add(nullptr, nullptr, 1, 0, 1);
    FAIL() << "no error past kMax jobs";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "stream_rope_copy: more than 4 rotations in one launch");
  }
}

// stream_merge_lse against the softmax over both key sets in double: within bf16 rounding; the 16-byte path (an
// aligned output) equal bit for bit to the one-value path (an output one value off 16-byte alignment); a row whose
// two log-sum-exps are -inf (no key at all) is zeros.
TEST(StreamGpu, MergeLseEqualsTheUnionSoftmax) {
  REQUIRE_GPU();
  const int64_t n = 37;
  const int heads = 4, d = 64;
  const size_t values = static_cast<size_t>(n * heads * d);
  std::mt19937 rng(43);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<bf16> ol(values), og(values);
  for (size_t j = 0; j < values; ++j) {
    ol[j] = f32_to_bf16(g(rng));
    og[j] = f32_to_bf16(g(rng));
  }
  std::vector<float> ll(static_cast<size_t>(heads * n)), lg(ll.size());
  for (size_t j = 0; j < ll.size(); ++j) {
    ll[j] = 5.0f * g(rng);
    lg[j] = j % 11 == 3 ? -INFINITY : 5.0f * g(rng);
  }
  ll[static_cast<size_t>(2 * n + 5)] = -INFINITY;  // (head 2, row 5): neither part has a key
  lg[static_cast<size_t>(2 * n + 5)] = -INFINITY;
  attn::gpu::DeviceBuffer<float> dll(ll.size()), dlg(lg.size());
  dll.upload(ll);
  dlg.upload(lg);
  std::vector<std::vector<bf16>> got;
  for (const int64_t off : {int64_t{0}, int64_t{1}}) {
    attn::gpu::DeviceBuffer<bf16> dl(values + 8), dg(values + 8);
    std::vector<bf16> pl(values + 8), pg(values + 8);
    std::copy(ol.begin(), ol.end(), pl.begin() + off);
    std::copy(og.begin(), og.end(), pg.begin() + off);
    dl.upload(pl);
    dg.upload(pg);
    stream_merge_lse(dl.data() + off, dg.data() + off, dll.data(), dlg.data(), n, heads, d, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<bf16> all = dl.download();
    got.emplace_back(all.begin() + off, all.begin() + off + static_cast<std::ptrdiff_t>(values));
  }
  EXPECT_EQ(0, std::memcmp(got[0].data(), got[1].data(), values * sizeof(bf16))) << "the two paths differ";
  double worst = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int h = 0; h < heads; ++h) {
      const double a = ll[static_cast<size_t>(h * n + r)], b = lg[static_cast<size_t>(h * n + r)];
      const double m = std::max(a, b);
      const double wl = m == -INFINITY ? 0 : std::exp(a - m) / (std::exp(a - m) + std::exp(b - m));
      const double wg = m == -INFINITY ? 0 : 1 - wl;
      for (int i = 0; i < d; ++i) {
        const size_t j = static_cast<size_t>((r * heads + h) * d + i);
        const double want = wl * bf16_to_f32(ol[j]) + wg * bf16_to_f32(og[j]);
        const double v = bf16_to_f32(got[0][j]);
        if (m == -INFINITY) {
          EXPECT_EQ(v, 0.0);
        }
        worst = std::max(worst, std::fabs(v - want) / (std::fabs(want) * std::ldexp(1.0, -8) + 1e-5));
      }
    }
  EXPECT_LE(worst, 1.0) << "a merged value past half a bf16 step";
}

// The FP8 blocks of stream_quantize_blocks (two in one launch) against core/fp8.h (codes and scales bit for bit: per (token, head) vector
// of d values), and stream_dequantize_blocks against the host's bf16(e4m3_to_float(code) * scale), bit for bit,
// two blocks into a workspace whose other rows stay as they were; the outlier head of a token keeps its own scale.
TEST(StreamGpu, Fp8BlocksEqualTheHostTwin) {
  REQUIRE_GPU();
  const int B = 64, heads = 2, d = 64;
  const int64_t row = heads * d, values = B * row;
  std::mt19937 rng(29);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::vector<bf16>> hk(2, std::vector<bf16>(static_cast<size_t>(values))), hv = hk;
  for (int blk = 0; blk < 2; ++blk)
    for (int64_t j = 0; j < values; ++j) {
      hk[static_cast<size_t>(blk)][static_cast<size_t>(j)] = f32_to_bf16(g(rng) * (j % 97 == 0 ? 40.0f : 1.0f));
      hv[static_cast<size_t>(blk)][static_cast<size_t>(j)] = f32_to_bf16(g(rng));
    }
  const int64_t bytes = stream_fp8_block_bytes(B, heads, d);
  ASSERT_EQ(bytes, 2 * B * (row + heads * 4));
  attn::gpu::DeviceBuffer<uint8_t> blocks(static_cast<size_t>(2 * bytes));
  std::vector<attn::gpu::DeviceBuffer<bf16>> dk, dv;
  StreamFp8Evictions e;  // both blocks in one launch, into the blocks in reverse order
  for (int blk = 0; blk < 2; ++blk) {
    dk.emplace_back(static_cast<size_t>(values));
    dv.emplace_back(static_cast<size_t>(values));
    dk.back().upload(hk[static_cast<size_t>(blk)]);
    dv.back().upload(hv[static_cast<size_t>(blk)]);
  }
  for (int blk = 1; blk >= 0; --blk) {
    e.k[e.count] = dk[static_cast<size_t>(blk)].data();
    e.v[e.count] = dv[static_cast<size_t>(blk)].data();
    e.dst[e.count++] = blocks.data() + blk * bytes;
  }
  stream_quantize_blocks(e, B, heads, d, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = blocks.download();
  std::vector<std::vector<float>> want_kv;  // per block: K then V, dequantized as the host does
  for (int blk = 0; blk < 2; ++blk) {
    const uint8_t* block = got.data() + blk * bytes;
    std::vector<float> deq;
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<bf16>& x = (kv == 0 ? hk : hv)[static_cast<size_t>(blk)];
      std::vector<float> xf(x.size());
      for (size_t j = 0; j < x.size(); ++j) xf[j] = bf16_to_f32(x[j]);
      std::vector<uint8_t> codes(static_cast<size_t>(values));
      std::vector<float> scales(static_cast<size_t>(B * heads));
      e4m3_quantize(xf.data(), d, B * heads, d, Fp8Scaling::kRow, codes.data(), scales.data());
      EXPECT_EQ(0, std::memcmp(block + kv * values, codes.data(), codes.size())) << "codes, block " << blk << " kv " << kv;
      EXPECT_EQ(0, std::memcmp(block + 2 * values + kv * B * heads * 4, scales.data(), scales.size() * 4))
          << "scales, block " << blk << " kv " << kv;
      for (int64_t j = 0; j < values; ++j)
        deq.push_back(bf16_to_f32(f32_to_bf16(e4m3_to_float(codes[static_cast<size_t>(j)]) * scales[static_cast<size_t>(j / d)])));
    }
    want_kv.push_back(std::move(deq));
  }
  // Into a workspace of 2B + 7 rows: block 1 at row 3, block 0 at row B + 5; rows 0-2 and B+3, B+4 and the last 2 as
  // they were.
  const int64_t ws_rows = 2 * B + 7;
  std::vector<bf16> ws(static_cast<size_t>(ws_rows * row));
  for (size_t j = 0; j < ws.size(); ++j) ws[j] = f32_to_bf16(static_cast<float>(j % 11));
  std::vector<bf16> want_k = ws, want_v = ws;
  attn::gpu::DeviceBuffer<bf16> wk(ws.size()), wv(ws.size());
  wk.upload(ws);
  wv.upload(ws);
  StreamFp8Blocks c;
  c.src[0] = blocks.data() + bytes;
  c.dst_row[0] = 3;
  c.src[1] = blocks.data();
  c.dst_row[1] = B + 5;
  c.count = 2;
  for (int i = 0; i < 2; ++i) {
    const std::vector<float>& deq = want_kv[static_cast<size_t>(1 - i)];
    for (int64_t j = 0; j < values; ++j) {
      want_k[static_cast<size_t>(c.dst_row[i] * row + j)] = f32_to_bf16(deq[static_cast<size_t>(j)]);
      want_v[static_cast<size_t>(c.dst_row[i] * row + j)] = f32_to_bf16(deq[static_cast<size_t>(values + j)]);
    }
  }
  stream_dequantize_blocks(wk.data(), wv.data(), B, heads, d, c, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<bf16> got_k = wk.download(), got_v = wv.download();
  EXPECT_EQ(0, std::memcmp(got_k.data(), want_k.data(), ws.size() * sizeof(bf16)));
  EXPECT_EQ(0, std::memcmp(got_v.data(), want_v.data(), ws.size() * sizeof(bf16)));
  // The round trip's error: within E4M3's half step (2^-4 relative) of each vector's scale.
  double worst = 0;
  for (int64_t j = 0; j < values; ++j) {
    const float x = bf16_to_f32(hv[0][static_cast<size_t>(j)]);
    worst = std::max(worst, static_cast<double>(std::fabs(want_kv[0][static_cast<size_t>(values + j)] - x)));
  }
  EXPECT_LT(worst, 0.5);  // |v| of N(0, 1) values below ~5: a step of 2^-4 x 4-8, halved, plus bf16's rounding
  StreamFp8Evictions too_many;
  too_many.count = StreamFp8Evictions::kMax + 1;
  try {
    stream_quantize_blocks(too_many, B, heads, d, nullptr);
    FAIL() << "no error past kMax blocks";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "stream_quantize_blocks: more than 32 blocks in one launch");
  }
}

// Evicted blocks in FP8 (StreamOptions::host_fp8) against bf16, same engine otherwise, both retrieving methods: the
// same evictions into 0.53x the pinned bytes (the FP8 block with its scales against bf16's), logits close to bf16's
// (the retrieved keys and values rounded to E4M3 per token and head) but not equal (the FP8 path ran), over prefill
// past many evictions, decode steps and a reset.
TEST(StreamGpu, Fp8HostBlocksHalveThePinnedBytesAndStayClose) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 6);
  const std::vector<int32_t> tokens = random_tokens(1500, cfg.vocab_size, 17);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    const GpuEngineOptions so = evicting_stream(m, 3);
    GpuEngineOptions fo = so;
    fo.stream.host_fp8 = true;
    GpuEngine bf(*model, so), f8(*model, fo);
    for (int round = 0; round < 2; ++round) {
      const std::vector<float> a = bf.prefill(tokens), b = f8.prefill(tokens);
      const double e = rel_l2(a, b);
      EXPECT_GT(e, 0.0) << "round " << round;
      EXPECT_LT(e, 0.1) << "round " << round;
      for (int i = 0; i < 3; ++i) {
        const double ed = rel_l2(bf.decode(tokens[static_cast<size_t>(i)]), f8.decode(tokens[static_cast<size_t>(i)]));
        EXPECT_LT(ed, 0.1) << "decode step " << i;
      }
      std::printf("[ fp8 host ] %s round %d: prefill logits rel L2 %.5f from bf16 blocks\n", stream_method_name(m),
                  round, e);
      const GpuStreamStats& sb = bf.gpu_streaming()->gpu_stats();
      const GpuStreamStats& s8 = f8.gpu_streaming()->gpu_stats();
      EXPECT_GT(s8.blocks_to_host, 10);
      EXPECT_EQ(s8.blocks_to_host, sb.blocks_to_host);
      EXPECT_GT(s8.blocks_to_device + s8.blocks_cached, 0);
      const int64_t row = static_cast<int64_t>(cfg.num_kv_heads) * cfg.head_dim;
      const int64_t bf_block = 2 * 64 * row * 2, f8_block = 2 * 64 * (row + cfg.num_kv_heads * 4);
      EXPECT_EQ(s8.pinned_bytes * bf_block, sb.pinned_bytes * f8_block);
      EXPECT_GT(s8.pinned_bytes, 0);
      bf.reset();
      f8.reset();
    }
  }
}

// What `tessera serve --stream` relies on (server/engine_slot.h keeps one engine per slot and resets it between
// requests): after reset() an engine that streamed a longer prompt (evicted blocks in its pinned slabs, its block
// caches and index mirrors filled) answers a new prompt EXACTLY as a fresh engine does, for each method.
TEST(StreamGpu, ResetEngineAnswersAsAFreshOne) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  const auto model = DeviceModel::random(cfg, 5);
  const std::vector<int32_t> first = random_tokens(1400, cfg.vocab_size, 21), second = random_tokens(900, cfg.vocab_size, 22);
  for (StreamMethod m : {StreamMethod::Ltri, StreamMethod::InfLLM, StreamMethod::StreamingLLM}) {
    SCOPED_TRACE(stream_method_name(m));
    const GpuEngineOptions so = evicting_stream(m, 2);
    GpuEngine fresh(*model, so);
    const std::vector<float> want = fresh.prefill(second);
    std::vector<std::vector<float>> want_decode;
    for (int i = 0; i < 3; ++i) want_decode.push_back(fresh.decode(second[static_cast<size_t>(i)]));
    GpuEngine kept(*model, so);
    (void)kept.prefill(first);
    (void)kept.decode(first[0]);
    ASSERT_GT(kept.streaming()->evicted_blocks(), 10);
    kept.reset();
    EXPECT_EQ(kept.prefill(second), want);
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(kept.decode(second[static_cast<size_t>(i)]), want_decode[static_cast<size_t>(i)]) << "decode step " << i;
    EXPECT_EQ(kept.streaming()->evicted_blocks(), fresh.streaming()->evicted_blocks());
  }
}

TEST(StreamGpu, RefusesWhatTheCpuRefuses) {
  REQUIRE_GPU();
  const ModelConfig cfg = small_config(2);
  StreamOptions o;
  o.method = StreamMethod::Ltri;
  o.sinks = 16;
  o.local = 128;
  o.block = 32;
  o.chunk = 64;
  o.host_budget = 100000;
  GpuStreamingKV kv(cfg, o);
  try {
    kv.check_sequence(10000);
    FAIL() << "no error";
  } catch (const Error& e) {
    StreamingKV cpu(cfg, o, StreamingKV::Storage::Device);
    try {
      cpu.check_sequence(10000);
    } catch (const Error& c) {
      EXPECT_STREQ(e.what(), c.what());
    }
    EXPECT_NE(std::string(e.what()).find("over the budget of 100 kB for evicted KV blocks"), std::string::npos)
        << e.what();
  }
  // streamingllm keeps no evicted block: no limit from the budget, nothing pinned.
  o.method = StreamMethod::StreamingLLM;
  GpuStreamingKV sl(cfg, o);
  EXPECT_NO_THROW(sl.check_sequence(10000000));
  sl.reserve(10000000);
  sl.wait_reserved();
  EXPECT_EQ(sl.gpu_stats().pinned_bytes, 0);
  // Sliding-window layers and QK-norm stream (Gemma-3 shapes); a head_dim the CUDA sparse executor does not run
  // is refused up front.
  EXPECT_NO_THROW(GpuStreamingKV(gemma_config(3, 16), o));
  ModelConfig odd = small_config(2);
  odd.head_dim = 32;
  try {
    GpuStreamingKV bad(odd, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "model " + odd.name + " cannot stream on the GPU: its head_dim 32 is not one the "
                                     "CUDA sparse executor runs (64, 128 or 256); the CPU path streams it (--device cpu)");
  }
}

}  // namespace
}  // namespace tessera::runtime::gpu
