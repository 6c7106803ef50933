// tp_bench — the tensor-parallel engine (parallel/cuda) on N GPUs with uniform, greedy and genetic head placement
// (FlexAttn): per-layer attention time per GPU (slowest / fastest), TTFT, and the placement search time, for
// a model of Llama-3-8B shapes (random weights) and a per-head policy (MInference's Llama-3-8B-262K config).
//
//   tp_bench --gpus 2 --policy
//   ../shared/data/minference-configs/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json
//            [--lengths 131072,262144] [--placements uniform,greedy,genetic] [--costs profile|flops]
//            [--model llama3-8b] [--seed 1] [--out DIR] [--dense-fallback] [--max-seconds S]
//            [--chunk N] [--no-overlap] [--tag NAME]
//  --chunk N: prefill in chunks of N tokens (each attends to all earlier keys; bounds the activations, as
//  the single-GPU engine's prefill chunks do: what a 1M-token prompt needs); --no-overlap: the all-reduces on
//  the compute stream (tp_gpu_forward.h's baseline); --tag: a label in the CSV's last column.
//
// Steps (the bench process itself never touches CUDA; GPU work runs in forked ranks, parallel/launch.h):
//  1. --costs profile (default): one rank on GPU 0 times each distinct pattern of the policy at each length
//  (a GQA
//     group of 4 heads through CudaLayerAttention: estimate, index and attend, on random q/k/v; per head = /
//     4) and the per-head Q+O and per-group K+V projections (cuBLAS): the runtime profiling report, saved as
//     DIR/head_profile.json. --costs flops: the index FLOP accounting instead (parallel/placement.h flop_costs).
//  2. placements per length and method (search time measured), saved as DIR/placement_<method>_<length>.json,
//  with
//     the cost model's predicted imbalance.
//  3. N ranks (NCCL): per length and placement, the rank's shard with random weights, a warm-up prefill of
//  4096
//     tokens, then the timed prefill of the whole prompt (barrier, run, barrier: TTFT on rank 0), per-layer
//     attention time from CUDA events on every rank.
// Output: a markdown table on stdout and DIR/tp_bench.csv (one row per length x method): TTFT, the sum over
// layers of the slowest and of the fastest GPU's attention, the mean and max per-layer imbalance (slowest /
// fastest), predicted imbalance, search time. --gpus 1 runs the same engine on one GPU (uniform only): the
// baseline. Random weights: queries and keys have no structure, so dynamic patterns (VS) run at their budgets
// with scattered indices; the dense fallback is off unless --dense-fallback (with it, scattered VS heads run
// dense and all heads cost the same).
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_args.h"
#include "attention/cuda/layer_attention_cuda.h"
#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "parallel/cuda/collective.h"
#include "parallel/cuda/tp_device_model.h"
#include "parallel/cuda/tp_gpu_forward.h"
#include "parallel/launch.h"
#include "parallel/placement.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/synthetic_config.h"

namespace fs = std::filesystem;
using namespace tessera;
using namespace tessera::parallel;
using nlohmann::json;

namespace {

struct Options {
  int32_t gpus = 2;
  std::string policy;
  std::vector<int64_t> lengths = {131072, 262144};
  std::vector<std::string> placements = {"uniform", "greedy", "genetic"};
  std::string costs = "profile";
  std::string model = "llama3-8b";
  uint64_t seed = 1;
  std::string out = "tp-bench-out";
  bool dense_fallback = false;
  double max_seconds = 0;
  int64_t chunk = 0;  // 0: the whole prompt in one pass
  bool overlap = true;
  std::string tag;
};

using bench::split_list;

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--gpus")
      o.gpus = std::stoi(value());
    else if (a == "--policy")
      o.policy = value();
    else if (a == "--lengths") {
      o.lengths.clear();
      for (const std::string& s : split_list(value(), ',')) o.lengths.push_back(std::stoll(s));
    } else if (a == "--placements")
      o.placements = split_list(value(), ',');
    else if (a == "--costs")
      o.costs = value();
    else if (a == "--model")
      o.model = value();
    else if (a == "--seed")
      o.seed = std::stoull(value());
    else if (a == "--out")
      o.out = value();
    else if (a == "--dense-fallback")
      o.dense_fallback = true;
    else if (a == "--max-seconds")
      o.max_seconds = std::stod(value());
    else if (a == "--chunk")
      o.chunk = std::stoll(value());
    else if (a == "--no-overlap")
      o.overlap = false;
    else if (a == "--tag")
      o.tag = value();
    else
      throw Error("tp_bench: unknown option " + a + " (see the top of bench/gpu/tp_bench.cpp)");
  }
  if (o.policy.empty())
    throw Error("tp_bench: --policy FILE is required (a MInference, MoA or tessera policy)");
  if (o.costs != "profile" && o.costs != "flops") throw Error("tp_bench: --costs must be profile or flops");
  if (o.chunk < 0) throw Error("tp_bench: --chunk must be positive (0: the whole prompt)");
  if (o.gpus == 1) o.placements = {"uniform"};
  return o;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Step 1: the runtime profiling report on GPU 0.
HeadCostProfile profile_heads(const runtime::ModelConfig& cfg, const attn::AttentionPolicy& policy,
                              const std::vector<int64_t>& lengths, bool dense_fallback) {
  std::map<std::string, attn::Pattern> patterns;
  for (const attn::Pattern& p : policy.table()) patterns.emplace(attn::describe(p), p);
  HeadCostProfile prof;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  prof.device = prop.name;
  const int64_t H = cfg.hidden_size, D = cfg.head_dim;
  constexpr int32_t kHeads = 4;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto elapsed_ms = [&] {
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return static_cast<double>(ms);
  };
  {
    runtime::gpu::Gemm gemm(stream);
    for (int64_t len : lengths) {
      const auto n = static_cast<int32_t>(len);
      attn::gpu::DeviceBuffer<bf16> q(static_cast<size_t>(len * kHeads * D)), k(static_cast<size_t>(len * D)),
          v(static_cast<size_t>(len * D)), out(static_cast<size_t>(len * kHeads * D)),
          h(static_cast<size_t>(len * H)), w(static_cast<size_t>(2 * D * H)),
          y(static_cast<size_t>(len * 2 * D));
      runtime::gpu::fill_uniform_bf16(q.data(), static_cast<int64_t>(q.size()), 11, 1.0f, stream);
      runtime::gpu::fill_uniform_bf16(k.data(), static_cast<int64_t>(k.size()), 12, 1.0f, stream);
      runtime::gpu::fill_uniform_bf16(v.data(), static_cast<int64_t>(v.size()), 13, 1.0f, stream);
      runtime::gpu::fill_uniform_bf16(h.data(), static_cast<int64_t>(h.size()), 14, 1.0f, stream);
      runtime::gpu::fill_uniform_bf16(w.data(), static_cast<int64_t>(w.size()), 15, 0.03f, stream);
      attn::AttentionArgs args;
      args.q = TensorView(q.data(), DType::BF16, {n, kHeads, D});
      args.k = TensorView(k.data(), DType::BF16, {n, 1, D});
      args.v = TensorView(v.data(), DType::BF16, {n, 1, D});
      args.out = TensorView(out.data(), DType::BF16, {n, kHeads, D});
      for (const auto& [name, p] : patterns) {
        attn::gpu::CudaAttentionOptions opt = attn::gpu::cuda_attention_defaults();
        opt.dense_fallback = opt.dense_fallback && dense_fallback;
        attn::gpu::CudaLayerAttention layer(std::vector<attn::Pattern>(kHeads, p),
                                            attn::LoweringContext::prefill(n, 128), 1, static_cast<int>(D),
                                            opt);
        layer.run(args, stream);  // warm-up (route, plans)
        cudaEventRecord(e0, stream);
        layer.run(args, stream);
        cudaEventRecord(e1, stream);
        const double ms = elapsed_ms();
        prof.entries.push_back({name, len, ms / 1e3 / kHeads});
        std::printf("profile %-40s %7lld: %8.3f ms per head\n", name.c_str(), static_cast<long long>(len),
                    ms / kHeads);
      }
      // Projections: Q+O of one head = 2 GEMMs [n, H] x [D, H]^T; K+V of one group the same shapes.
      gemm.linear(h.data(), H, len, w.data(), 2 * D, H, y.data(), DType::BF16, 2 * D, 0.0f);
      cudaEventRecord(e0, stream);
      gemm.linear(h.data(), H, len, w.data(), 2 * D, H, y.data(), DType::BF16, 2 * D, 0.0f);
      cudaEventRecord(e1, stream);
      const double proj = elapsed_ms() / 1e3;
      prof.projections.push_back({len, proj, proj});
      std::printf("profile projections %lld: %.3f ms per head (Q+O) and per group (K+V)\n",
                  static_cast<long long>(len), proj * 1e3);
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  return prof;
}

struct RankResult {
  double ttft_s = 0;
  std::vector<float> layer_ms;
  double gpu_gb = 0;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    fs::create_directories(o.out);
    const runtime::ModelConfig cfg = runtime::gpu::synthetic_config(o.model);
    const attn::AttentionPolicy policy = attn::load_policy_file(
        o.policy, attn::PolicyShape{cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads});
    std::printf("tp_bench: %s, %d GPUs, policy %s, lengths", cfg.summary().c_str(), o.gpus, o.policy.c_str());
    for (int64_t l : o.lengths) std::printf(" %lld", static_cast<long long>(l));
    std::printf(", costs %s, dense fallback %s\n", o.costs.c_str(), o.dense_fallback ? "on" : "off");
    const double t_start = now_s();

    // 1. Costs.
    HeadCostProfile prof;
    if (o.costs == "profile") {
      const fs::path path = fs::path(o.out) / "head_profile.json";
      const int rc = launch_local_ranks(1, (fs::path(o.out) / "rv-profile").string(), [&](const RankEnv&) {
        cudaSetDevice(0);
        std::ofstream(path) << profile_heads(cfg, policy, o.lengths, o.dense_fallback).to_json().dump(1)
                            << "\n";
        return 0;
      });
      if (rc != 0) throw Error("tp_bench: the profiling rank failed");
      prof = HeadCostProfile::from_json(json::parse(std::ifstream(path)), path.string());
    }

    // 2. Placements.
    std::map<std::pair<int64_t, std::string>, Placement> placements;
    std::map<std::pair<int64_t, std::string>, PlacementSummary> predicted;
    for (int64_t len : o.lengths) {
      const CostModel costs = o.costs == "profile" ? profile_costs(policy, len, prof, "head_profile.json")
                                                   : flop_costs(policy, len, cfg.hidden_size, cfg.head_dim);
      for (const std::string& m : o.placements) {
        GeneticOptions go;
        go.seed = o.seed;
        Placement p = place(costs, o.gpus, parse_placement_method(m), go);
        p.length = len;
        save_placement(p, fs::path(o.out) / ("placement_" + m + "_" + std::to_string(len) + ".json"));
        predicted[{len, m}] = summarize(costs, p);
        placements[{len, m}] = std::move(p);
      }
    }

    // 3. The ranks.
    const int rc = launch_local_ranks(o.gpus, (fs::path(o.out) / "rv").string(), [&](const RankEnv& env) {
      setenv("NCCL_NVLS_ENABLE", "0", 0);
      select_rank_device(env);
      std::unique_ptr<Collective> comm = make_nccl_collective(env);
      cudaStream_t stream;
      cudaStreamCreate(&stream);
      {
        runtime::gpu::Gemm gemm(stream);
        for (int64_t len : o.lengths) {
          std::vector<int32_t> tokens(static_cast<size_t>(len));
          uint64_t s = 99;
          for (auto& t : tokens) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            t = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(cfg.vocab_size));
          }
          for (const std::string& m : o.placements) {
            if (o.max_seconds > 0 && now_s() - t_start > o.max_seconds) {
              if (env.rank == 0)
                std::printf("skipping %s at %lld: past --max-seconds\n", m.c_str(),
                            static_cast<long long>(len));
              continue;
            }
            const Placement& p = placements.at({len, m});
            auto model = TpDeviceModel::random(cfg, rank_plan(cfg, p, env.rank), o.seed);
            TpForwardOptions fo;
            fo.time_layers = true;
            fo.dense_fallback = o.dense_fallback;
            fo.overlap_comm = o.overlap;
            TpGpuForward fwd(*model, *comm, fo, stream, gemm);
            fwd.reserve(static_cast<int32_t>(len));
            const int32_t warm = static_cast<int32_t>(std::min<int64_t>(4096, len));
            fwd.run(std::span(tokens).first(static_cast<size_t>(warm)), 0, &policy, warm, true);
            comm->barrier(stream);
            const double t0 = now_s();
            const int64_t chunk = o.chunk > 0 ? o.chunk : len;
            std::vector<float> layer_ms(static_cast<size_t>(cfg.num_layers), 0.0f);
            for (int64_t c0 = 0; c0 < len; c0 += chunk) {
              const int64_t cn = std::min(chunk, len - c0);
              fwd.run(std::span(tokens).subspan(static_cast<size_t>(c0), static_cast<size_t>(cn)),
                      static_cast<int32_t>(c0), &policy, static_cast<int32_t>(len), true);
              for (size_t l = 0; l < layer_ms.size(); ++l) layer_ms[l] += fwd.layer_attention_ms()[l];
            }
            comm->barrier(stream);
            const double ttft = now_s() - t0;
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            json j = {{"rank", env.rank},
                      {"length", len},
                      {"method", m},
                      {"ttft_s", ttft},
                      {"layer_ms", layer_ms},
                      {"gpu_used_bytes", total_b - free_b},
                      {"weights_bytes", model->bytes()},
                      {"kv_bytes", fwd.kv_bytes()}};
            std::ofstream(fs::path(o.out) /
                          ("rank" + std::to_string(env.rank) + "_" + m + "_" + std::to_string(len) + ".json"))
                << j.dump() << "\n";
            if (env.rank == 0)
              std::printf("  %s at %lld: TTFT %.3f s (GPU 0 memory in use %.1f GB)\n", m.c_str(),
                          static_cast<long long>(len), ttft, static_cast<double>(total_b - free_b) / 1e9);
            std::fflush(stdout);
          }
        }
      }
      cudaStreamDestroy(stream);
      return 0;
    });

    // 4. The table.
    std::ofstream csv(fs::path(o.out) / "tp_bench.csv");
    csv << "gpus,length,method,ttft_s,attn_slowest_s,attn_fastest_s,mean_imbalance,max_imbalance,"
           "predicted_mean_imbalance,predicted_max_imbalance,search_s,max_gpu_gb,chunk,overlap,tag\n";
    std::printf(
        "\n| GPUs | length | placement | TTFT (s) | attention, slowest GPU (s) | fastest GPU (s) | "
        "imbalance mean / max | predicted mean / max | search (s) "
        "|\n|---|---|---|---|---|---|---|---|---|\n");
    for (int64_t len : o.lengths)
      for (const std::string& m : o.placements) {
        std::vector<RankResult> ranks;
        for (int32_t r = 0; r < o.gpus; ++r) {
          const fs::path f =
              fs::path(o.out) / ("rank" + std::to_string(r) + "_" + m + "_" + std::to_string(len) + ".json");
          if (!fs::exists(f)) break;
          const json j = json::parse(std::ifstream(f));
          ranks.push_back({j["ttft_s"].get<double>(), j["layer_ms"].get<std::vector<float>>(),
                           j.value("gpu_used_bytes", 0.0) / 1e9});
        }
        if (static_cast<int32_t>(ranks.size()) != o.gpus) continue;
        double slow = 0, fast = 0, mean_imb = 0, max_imb = 0;
        const size_t layers = ranks[0].layer_ms.size();
        for (size_t l = 0; l < layers; ++l) {
          double mx = 0, mn = 1e30;
          for (const RankResult& r : ranks) {
            mx = std::max(mx, static_cast<double>(r.layer_ms[l]));
            mn = std::min(mn, static_cast<double>(r.layer_ms[l]));
          }
          slow += mx / 1e3;
          fast += mn / 1e3;
          const double imb = mn > 0 ? mx / mn : 1.0;
          mean_imb += imb / static_cast<double>(layers);
          max_imb = std::max(max_imb, imb);
        }
        double gpu_gb = 0;
        for (const RankResult& r : ranks) gpu_gb = std::max(gpu_gb, r.gpu_gb);
        const PlacementSummary& ps = predicted.at({len, m});
        const double search = placements.at({len, m}).search_seconds;
        std::printf("| %d | %lld | %s | %.3f | %.3f | %.3f | %.3f / %.3f | %.3f / %.3f | %.3f |\n", o.gpus,
                    static_cast<long long>(len), m.c_str(), ranks[0].ttft_s, slow, fast, mean_imb, max_imb,
                    ps.mean_imbalance, ps.max_imbalance, search);
        csv << o.gpus << "," << len << "," << m << "," << ranks[0].ttft_s << "," << slow << "," << fast << ","
            << mean_imb << "," << max_imb << "," << ps.mean_imbalance << "," << ps.max_imbalance << ","
            << search << "," << gpu_gb << "," << o.chunk << "," << (o.overlap ? 1 : 0) << "," << o.tag << "\n";
      }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_bench: %s\n", e.what());
    return 1;
  }
}
