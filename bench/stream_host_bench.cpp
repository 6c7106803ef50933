// stream_host_bench — the host's share of Ltri's / InfLLM's decisions on the GPU path, on the CPU alone.
//
// GpuStreamingKV (runtime/cuda/stream_gpu_kv.h) computes the chunk's map, span candidates, masses and block scores on
// the device and hands them to StreamingKV::plan(..., DeviceDecisions), which does the rest on the host: the
// evictions' index bookkeeping, NMS and the span cover, the query vectors, normalisation, collaborative voting, top-K
// and the layout. At 1M tokens that host work is ~12 s of Ltri's TTFT (H200, docs/PERF.md) while the GPU waits.
// This bench runs exactly that code for a long prompt with the device's answers stood in for (one map of random q and
// k computed once: its candidates, masses and votes reused every chunk and layer; block scores from a fixed random
// pool), so the host work can be timed and profiled without a GPU:
//
//   stream_host_bench [--seq 1048576] [--method ltri|infllm] [--retrieval-heads FILE] [--chunk 512] [--layers 32]
//                     [--early-layers score|votes]   (--stream-early-layers: votes is what the 1M runs use)
//
// Llama-3-8B shapes (32 layers, 32 / 8 heads of 128), the paper's sizes (sinks 128, local 4096, blocks of 128,
// top-32). Prints the host seconds of plan() over the prefill and per layer and chunk.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model_config.h"
#include "runtime/stream/span_discovery.h"
#include "runtime/stream/span_math.h"
#include "runtime/stream/streaming_kv.h"

using namespace tessera;
using namespace tessera::runtime;

int main(int argc, char** argv) try {
  int64_t seq = 1 << 20;
  int32_t chunk = 512, layers = 32;
  std::string method = "ltri", heads_file, early = "score";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      check(i + 1 < argc, a + " needs a value");
      return argv[++i];
    };
    if (a == "--seq") seq = std::stoll(value());
    else if (a == "--chunk") chunk = std::stoi(value());
    else if (a == "--layers") layers = std::stoi(value());
    else if (a == "--method") method = value();
    else if (a == "--retrieval-heads") heads_file = value();
    else if (a == "--early-layers") early = value();
    else throw Error("stream_host_bench: unknown argument '" + a + "'");
  }
  const nlohmann::json hf{{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                          {"hidden_size", 4096}, {"intermediate_size", 14336},
                          {"max_position_embeddings", 131072}, {"num_attention_heads", 32},
                          {"num_hidden_layers", layers}, {"num_key_value_heads", 8},
                          {"rms_norm_eps", 1e-5}, {"rope_theta", 500000.0},
                          {"vocab_size", 128256}, {"torch_dtype", "bfloat16"}};
  const ModelConfig cfg = config_from_hf(hf, "llama3-8b shapes");
  StreamOptions o;
  o.method = parse_stream_method(method);
  o.chunk = chunk;
  o.host_budget = int64_t{1} << 50;  // (counted only: Storage::Device keeps no rows)
  check(early == "score" || early == "votes", "stream_host_bench: --early-layers is score or votes, got '" + early + "'");
  o.early_from_votes = early == "votes";
  if (!heads_file.empty())
    for (const RetrievalHead& h : read_retrieval_heads(heads_file))
      if (h.layer < layers) o.retrieval_heads.push_back(h);
  const int32_t nq = cfg.num_q_heads, nkv = cfg.num_kv_heads, d = cfg.head_dim;
  std::vector<float> inv_freq(static_cast<size_t>(d / 2));
  for (int32_t i = 0; i < d / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(500000.0f, -2.0f * i / d);

  // The stand-in for the device: one chunk's map of random q and k (softmax per head, summed over heads).
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> map(static_cast<size_t>(chunk) * chunk, 0.0f), votes(static_cast<size_t>(chunk), 0.0f);
  {
    std::vector<float> q(static_cast<size_t>(chunk) * d), k(q.size()), row(static_cast<size_t>(chunk));
    for (int32_t h = 0; h < nq; ++h) {
      for (float& x : q) x = g(rng);
      for (float& x : k) x = g(rng);
      for (int32_t r = 0; r < chunk; ++r) {
        float mx = -1e30f;
        for (int32_t c = 0; c <= r; ++c) {
          float s = 0;
          for (int32_t i = 0; i < d; ++i) s += q[static_cast<size_t>(r * d + i)] * k[static_cast<size_t>(c * d + i)];
          row[static_cast<size_t>(c)] = s / std::sqrt(static_cast<float>(d));
          mx = std::max(mx, row[static_cast<size_t>(c)]);
        }
        float z = 0;
        for (int32_t c = 0; c <= r; ++c) z += (row[static_cast<size_t>(c)] = std::exp(row[static_cast<size_t>(c)] - mx));
        for (int32_t c = 0; c <= r; ++c) map[static_cast<size_t>(r) * chunk + c] += row[static_cast<size_t>(c)] / z;
      }
    }
    for (int32_t r = 0; r < chunk; ++r)
      for (int32_t c = 0; c <= r; ++c) votes[static_cast<size_t>(c)] += map[static_cast<size_t>(r) * chunk + c];
  }
  const stream::TriangleScores ts(map, chunk, stream::causal_quantile(map, chunk, o.theta_quantile));
  const std::vector<stream::Span> candidates = stream::span_candidates(ts, o.linear_nms);
  std::vector<double> pool(1 << 20);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (double& x : pool) x = u(rng);
  size_t pool_at = 0;

  StreamingKV kv(cfg, o, StreamingKV::Storage::Device);
  using Clock = std::chrono::steady_clock;
  double total = 0;
  int64_t calls = 0, scored = 0;
  for (int64_t c0 = 0; c0 < seq;) {
    const int64_t c1 = stream_chunk_end(o, c0, seq);
    const auto n = static_cast<int32_t>(c1 - c0), pos = static_cast<int32_t>(c0);
    kv.begin_chunk(pos, n, c1 == seq ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill);
    // (A last chunk shorter than `chunk`: the top-left corner of the map, its candidates recomputed.)
    std::vector<float> small_map, small_votes;
    std::vector<stream::Span> small_cands;
    if (n != chunk) {
      small_map.resize(static_cast<size_t>(n) * n);
      small_votes.assign(static_cast<size_t>(n), 0.0f);
      for (int32_t r = 0; r < n; ++r)
        for (int32_t c = 0; c <= r; ++c) {
          small_map[static_cast<size_t>(r) * n + c] = map[static_cast<size_t>(r) * chunk + c];
          small_votes[static_cast<size_t>(c)] += small_map[static_cast<size_t>(r) * n + c];
        }
    }
    std::optional<stream::TriangleScores> small_ts;
    if (n != chunk) {
      small_ts.emplace(small_map, n, stream::causal_quantile(small_map, n, o.theta_quantile));
      small_cands = stream::span_candidates(*small_ts, o.linear_nms);
    }
    const stream::TriangleScores& tsn = n == chunk ? ts : *small_ts;
    for (int32_t l = 0; l < cfg.num_layers; ++l) {
      StreamingKV::DeviceDecisions given;
      given.votes = n == chunk ? std::span<const float>(votes) : std::span<const float>(small_votes);
      given.has_candidates = o.method == StreamMethod::Ltri;
      given.candidates = n == chunk ? std::span<const stream::Span>(candidates) : std::span<const stream::Span>(small_cands);
      given.ready = [] {};
      given.keys_on_device = o.method == StreamMethod::Ltri;
      given.index_keys = [&](std::span<const int32_t> positions) {
        return o.method == StreamMethod::Ltri ? std::vector<float>{}
                                              : std::vector<float>(positions.size() * static_cast<size_t>(nkv * d), 0.5f);
      };
      given.span_masses = [&](std::span<const stream::Span> spans) {
        std::vector<stream::SpanMasses> out;
        for (const stream::Span& sp : spans) out.push_back(stream::span_masses(tsn, sp));
        return out;
      };
      given.block_scores = [&](std::span<const int32_t>, std::span<const int32_t>, const stream::HeadWeights&) {
        ++scored;
        std::vector<double> s(static_cast<size_t>(kv.evicted_blocks()));
        for (double& x : s) {
          x = pool[pool_at];
          pool_at = (pool_at + 1) % pool.size();
        }
        return s;
      };
      const auto t0 = Clock::now();
      kv.plan(l, pos, n, nullptr, inv_freq, given);
      total += std::chrono::duration<double>(Clock::now() - t0).count();
      ++calls;
    }
    c0 = c1;
  }
  std::printf("stream_host_bench: %s, %lld tokens, chunk %d, %d layers%s: plan() %.3f s host over %lld calls "
              "(%.1f us a layer and chunk), %lld scorings, %d evicted blocks a layer\n",
              method.c_str(), static_cast<long long>(seq), chunk, cfg.num_layers,
              heads_file.empty() ? "" : (", retrieval heads " + heads_file).c_str(), total,
              static_cast<long long>(calls), 1e6 * total / static_cast<double>(std::max<int64_t>(calls, 1)),
              static_cast<long long>(scored), kv.evicted_blocks());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "stream_host_bench: %s\n", e.what());
  return 1;
}
