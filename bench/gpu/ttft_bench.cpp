// ttft_bench — time to first token of the GPU engine on a model of Llama-3-8B shapes with deterministic random
// weights (compute cost does not depend on the values for fixed pattern budgets), for dense attention and
// sparse policies, all from one run: a table with each policy's speedup over the dense row of the same length,
// the GEMM and attention shares of the time (GPU time from CUDA events), the small kernels' GPU time (norms,
// RoPE, activation, the rest; also CUDA events: "other" minus these is launch gaps, copies and the host), and the
// peak device memory.
//
//   ttft_bench [--model llama3-8b] [--seq 8192,32768,131072] [--policies "dense;vs:v=1000,s=6096;..."]
//              [--chunk 0] [--mlp-chunk 16384] [--tile 128] [--reps 1] [--layers N] [--decode 0]
//              [--seed 1] [--weights plain|local] [--gemm bf16|fp8] [--csv FILE] [--max-seconds S]
//              [--no-dense-fallback]
//
// Policies are attention specs (attention/pattern/presets.h) separated by ';'. Defaults: dense, VS(1000, 6096)
// on every head, TriangleMix (dense in layers 0-15, Triangle sink 64 / local 512 / last 64 in 16-31),
// TriangleMix with VS in layers 0-15, A-shape (sink 128, local 4096). --chunk 0 prefills the whole prompt as
// one chunk (the MLP still runs in pieces of --mlp-chunk rows); TTFT is wall time from the token ids on the
// host to the last position's logits on the host. The prompt is pseudo-random token ids. --decode N times N
// decode steps after each dense prefill. Rows are printed as they finish (and appended to the CSV), so a run
// cut short keeps what it measured; --max-seconds skips the rows that would start after that budget.
// --gemm fp8: every row's GEMMs in FP8 E4M3 (GpuEngineOptions::gemm, runtime/cuda/gemm.h); a policy with the suffix
// "-fp8" ("dense-fp8", "vs_adaptive-fp8") runs in FP8 whatever --gemm says, so bf16 and FP8 rows share one table
// (the speedup column is against the length's first dense row).
//
// --weights plain (default): every matrix uniform random (DeviceModel::random, RandomInit::kPlain). Queries and keys
// then carry no positional structure: VS's estimator scatters its 6096 diagonals, each tile's index covers ~44% of
// the keys at 128K and the layers run dense (the dense fallback) — the worst case for the dynamic patterns.
// --weights local: RandomInit::kLocalAttention, a synthetic model shaped to have the attention real LLMs have
// (device_model.h: a massive shared channel direction that Q and K read through columns designed so that, after
// RoPE, scores fall steadily with distance; a sink token, which starts the prompt; noise from the token part), with
// the same shapes, dtypes and GEMM costs. VS then picks (nearly) the diagonals nearest the diagonal, as on real
// models (bench/gpu/local_weights_sim.py simulates the recipe at reduced width through all 32 layers: VS density
// 1.00-1.13 times that of the 6096 nearest diagonals, mean 1.04, in every layer): the policy's cost at a realistic
// index density. The values are still meaningless; only the attention pattern's shape is modelled. A line after the
// weights checks that the device holds the recipe's columns (local_attention_init.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_args.h"
#include "attention/pattern/presets.h"
#include "core/error.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/local_attention_init.h"
#include "runtime/cuda/synthetic_config.h"

namespace {

using namespace tessera;
using namespace tessera::runtime::gpu;

struct Options {
  std::string model = "llama3-8b";
  std::vector<int> seqs = {8192, 32768, 131072};
  std::vector<std::string> policies = {
      "dense",
      "vs:v=1000,s=6096",
      "trianglemix:start=16,sink=64,local=512,last=64",
      "trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64",
      "ashape:sink=128,local=4096",
  };
  int chunk = 0;
  int mlp_chunk = 16384;
  int tile = 128;
  int reps = 1;
  int layers = 0;
  int decode = 0;
  uint64_t seed = 1;
  std::string weights = "plain";
  bool fp8 = false;  // --gemm fp8
  std::string csv;
  double max_seconds = 0;
  bool dense_fallback = true;
};

using bench::split_list;

Options parse(int argc, char** argv) {
  Options o;
  auto value = [&](int& i) -> std::string {
    check(i + 1 < argc, std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model") {
      o.model = value(i);
    } else if (a == "--seq") {
      o.seqs.clear();
      for (const std::string& s : split_list(value(i), ',')) o.seqs.push_back(std::stoi(s));
    } else if (a == "--policies") {
      o.policies = split_list(value(i), ';');
    } else if (a == "--chunk") {
      o.chunk = std::stoi(value(i));
    } else if (a == "--mlp-chunk") {
      o.mlp_chunk = std::stoi(value(i));
    } else if (a == "--tile") {
      o.tile = std::stoi(value(i));
    } else if (a == "--reps") {
      o.reps = std::max(1, std::stoi(value(i)));
    } else if (a == "--layers") {
      o.layers = std::stoi(value(i));
    } else if (a == "--decode") {
      o.decode = std::stoi(value(i));
    } else if (a == "--seed") {
      o.seed = std::stoull(value(i));
    } else if (a == "--weights") {
      o.weights = value(i);
      check(o.weights == "plain" || o.weights == "local", "--weights must be plain or local");
    } else if (a == "--gemm") {
      const std::string g = value(i);
      check(g == "bf16" || g == "fp8", "--gemm must be bf16 or fp8, got '" + g + "'");
      o.fp8 = g == "fp8";
    } else if (a == "--csv") {
      o.csv = value(i);
    } else if (a == "--max-seconds") {
      o.max_seconds = std::stod(value(i));
    } else if (a == "--no-dense-fallback") {
      o.dense_fallback = false;
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "ttft_bench [--model llama3-8b] [--seq 8192,32768,131072] [--policies \"dense;vs:v=1000,s=6096;...\"]\n"
          "           [--chunk 0] [--mlp-chunk 16384] [--tile 128] [--reps 1] [--layers N] [--decode 0] [--seed 1]\n"
          "           [--weights plain|local] [--gemm bf16|fp8] [--csv FILE] [--max-seconds S] [--no-dense-fallback]\n"
          "  --weights plain  uniform random weights (default): attention has no structure, VS/BS estimates scatter\n"
          "                   and sparse layers fall back to dense (the worst case for dynamic patterns)\n"
          "  --weights local  a synthetic model shaped to have real LLMs' attention (local decay with distance, a\n"
          "                   sink token starting the prompt; RandomInit::kLocalAttention): the same shapes and GEMM\n"
          "                   costs, VS at a realistic index density. Values are meaningless; only the pattern is\n"
          "                   modelled.\n"
          "  --gemm fp8       FP8 E4M3 GEMMs in every row; a policy ending in -fp8 (dense-fp8, vs_adaptive-fp8)\n"
          "                   runs in FP8 whatever --gemm says\n"
          "More in the header of bench/gpu/ttft_bench.cpp.\n");
      std::exit(0);
    } else {
      throw Error("unknown argument " + a);
    }
  }
  check(!o.seqs.empty() && !o.policies.empty(), "--seq and --policies must not be empty");
  return o;
}

// --weights local: reads back what DeviceModel::random wrote (the embedding's special channels, the designed Q/K
// columns and a zeroed V column of the first and last layers) and compares it with local_attention_init.h, the
// numbers the CPU test and bench/gpu/local_weights_sim.py check. Throws on a mismatch.
std::string check_local_weights(const DeviceModel& dev, uint64_t seed) {
  namespace li = tessera::runtime::gpu::local_init;
  const tessera::runtime::ModelConfig& c = dev.config();
  const int64_t H = c.hidden_size;
  auto column = [&](const bf16* m, int64_t rows, int64_t col) {
    std::vector<bf16> v(static_cast<size_t>(rows));
    check(cudaMemcpy2D(v.data(), sizeof(bf16), m + col, static_cast<size_t>(H) * sizeof(bf16), sizeof(bf16),
                       static_cast<size_t>(rows), cudaMemcpyDeviceToHost) == cudaSuccess,
          "local weights check: cudaMemcpy2D failed");
    return v;
  };
  auto same = [](const std::vector<bf16>& device, const std::vector<float>& want) {
    if (device.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i)
      if (device[i].bits != tessera::f32_to_bf16(want[i]).bits) return false;
    return true;
  };
  const li::Channels ch = li::channels(H);
  const float massive = static_cast<float>(li::massive_value(H));
  const std::vector<bf16> emb_massive = column(dev.embedding(), c.vocab_size, ch.massive[0]);
  const std::vector<bf16> emb_sink = column(dev.embedding(), c.vocab_size, ch.sink[1]);
  std::vector<float> want_massive(static_cast<size_t>(c.vocab_size), massive), want_sink(want_massive.size(), 0.0f);
  want_massive[DeviceModel::kSinkToken] = 0.0f;
  want_sink[DeviceModel::kSinkToken] = massive;
  check(same(emb_massive, want_massive) && same(emb_sink, want_sink),
        "local weights check: the embedding's special channels differ from the recipe");
  const int64_t QD = int64_t{c.num_q_heads} * c.head_dim, KD = int64_t{c.num_kv_heads} * c.head_dim;
  for (int l : {0, c.num_layers - 1}) {
    const li::LayerColumns want = li::layer_columns(c, l, seed);
    const tessera::runtime::gpu::DeviceLayer& L = dev.layer(l);
    check(same(column(L.wq, QD, ch.massive[3]), want.q_massive) && same(column(L.wk, KD, ch.massive[1]), want.k_massive) &&
              same(column(L.wk, KD, ch.sink[0]), want.k_sink) &&
              same(column(L.wq, QD, ch.sink[1]), std::vector<float>(static_cast<size_t>(QD), 0.0f)) &&
              same(column(L.wv, KD, ch.massive[2]), std::vector<float>(static_cast<size_t>(KD), 0.0f)),
          "local weights check: layer " + std::to_string(l) + "'s Q/K/V columns differ from the recipe");
  }
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "local weights check: embedding special channels (massive %.0f) and the Q/K/V columns of layers 0 and "
                "%d match local_attention_init.h",
                static_cast<double>(massive), c.num_layers - 1);
  return buf;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  int seq = 0;
  std::string policy;
  std::string error;
  double ttft = 0, gemm = 0, attention = 0;
  GpuKernelSeconds kernels;
  double speedup = 0;
  double peak_gb = 0, kv_gb = 0;
  double gemm_tflops = 0;
  double decode_ms = 0;
};

// Matrix FLOPs of a prefill of `seq` tokens: every projection of every layer, and the LM head on one row.
double gemm_flops(const tessera::runtime::ModelConfig& c, int seq) {
  const double H = c.hidden_size, D = c.head_dim, F = c.intermediate_size;
  const double QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  const double per_token_layer = 2.0 * (H * QD + 2 * H * KD + QD * H + 3 * H * F);
  return per_token_layer * c.num_layers * seq + 2.0 * H * c.vocab_size;
}

void print_row_md(const Row& r) {
  if (!r.error.empty()) {
    std::printf("| %d | %s | error: %s ||||||||\n", r.seq, r.policy.c_str(), r.error.c_str());
  } else {
    const double other = std::max(0.0, r.ttft - r.gemm - r.attention);
    const GpuKernelSeconds& k = r.kernels;
    std::printf("| %d | %s | %.3f | %.2fx | %.3f (%.0f%%) | %.3f (%.0f%%) | %.3f | %.0f | %.1f | "
                "%.3f / %.3f / %.3f / %.3f |",
                r.seq, r.policy.c_str(), r.ttft, r.speedup, r.gemm, 100 * r.gemm / r.ttft, r.attention,
                100 * r.attention / r.ttft, other, r.gemm_tflops, r.peak_gb, k.norm, k.rope, k.activation, k.misc);
    if (r.decode_ms > 0) std::printf(" decode %.2f ms/token |", r.decode_ms);
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    check(gpu_available(), "ttft_bench: no CUDA device");
    tessera::runtime::ModelConfig cfg = synthetic_config(o.model);
    if (o.layers > 0) {
      cfg.num_layers = o.layers;
      cfg.layers.resize(static_cast<size_t>(o.layers));
    }
    const int max_seq = *std::max_element(o.seqs.begin(), o.seqs.end());
    check(max_seq <= cfg.context_length, "--seq " + std::to_string(max_seq) + " exceeds the model's context of " +
                                             std::to_string(cfg.context_length));
    std::printf("device: %s\n", gpu_description().c_str());
    const bool local = o.weights == "local";
    std::printf("model: %s, random weights (seed %llu; %s)\n", cfg.summary().c_str(),
                static_cast<unsigned long long>(o.seed),
                local ? "local: shaped for local attention with a sink, prompt starts with the sink token"
                      : "plain: no attention structure");
    double t0 = now();
    const auto dev =
        DeviceModel::random(cfg, o.seed, local ? RandomInit::kLocalAttention : RandomInit::kPlain);
    std::printf("weights: %.2f GB bf16 on the device, initialised in %.2f s\n",
                static_cast<double>(dev->bytes()) / 1e9, now() - t0);
    if (local) std::printf("%s\n", check_local_weights(*dev, o.seed).c_str());

    std::vector<int32_t> tokens(static_cast<size_t>(max_seq));
    uint64_t s = o.seed;
    for (auto& t : tokens) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      t = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(cfg.vocab_size));
      if (local && t == DeviceModel::kSinkToken) t = DeviceModel::kSinkToken + 1;  // one sink, at the start
    }
    if (local) tokens[0] = DeviceModel::kSinkToken;
    const attn::PolicyShape shape{cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads};
    // "<spec>-fp8": that row's GEMMs in FP8.
    auto fp8_row = [&](const std::string& spec) {
      return o.fp8 || (spec.size() > 4 && spec.compare(spec.size() - 4, 4, "-fp8") == 0);
    };
    auto base_spec = [](const std::string& spec) {
      return spec.size() > 4 && spec.compare(spec.size() - 4, 4, "-fp8") == 0 ? spec.substr(0, spec.size() - 4) : spec;
    };
    std::map<std::string, attn::AttentionPolicy> policies;
    for (const std::string& spec : o.policies) {
      const std::string b = base_spec(spec);
      policies[spec] = b == "dense" ? attn::AttentionPolicy{} : attn::policy_from_spec(b, shape);
    }

    auto options_for = [&](const std::string& spec) {
      GpuEngineOptions eo;
      eo.chunk_size = o.chunk;
      eo.mlp_chunk = o.mlp_chunk;
      eo.tile = o.tile;
      eo.policy = policies[spec];
      eo.max_context = std::max(cfg.context_length, max_seq);
      eo.dense_fallback = o.dense_fallback;
      if (fp8_row(spec)) eo.gemm = GemmPrecision::kFp8;
      return eo;
    };

    // Warm-up: cuBLAS heuristics, the wgmma self-check, the estimators' first launches.
    t0 = now();
    for (const std::string& spec : o.policies) {
      GpuEngine warm(*dev, options_for(spec));
      warm.prefill(std::span<const int32_t>(tokens.data(), static_cast<size_t>(std::min(max_seq, 4096))));
    }
    std::printf("warm-up: %.2f s\n", now() - t0);
    std::printf("chunk %s, MLP pieces of %d rows, index tile %d, best of %d, dense fallback %s\n\n",
                o.chunk > 0 ? std::to_string(o.chunk).c_str() : "whole prompt", o.mlp_chunk, o.tile, o.reps,
                o.dense_fallback ? "on (a sparse layer whose index costs more than dense runs dense)" : "off");
    std::printf("| seq | policy | TTFT s | vs dense | GEMM s (share) | attention s (share) | other s | GEMM TFLOP/s | "
                "peak GB | norm / rope / act / misc s |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::fflush(stdout);

    FILE* csv = nullptr;
    if (!o.csv.empty()) {
      csv = std::fopen(o.csv.c_str(), "w");
      check(csv != nullptr, o.csv + ": cannot write");
      std::fprintf(csv, "device,model,layers,seq,policy,chunk,ttft_s,speedup_vs_dense,gemm_s,attention_s,other_s,"
                        "gemm_share,attention_share,gemm_tflops,peak_gb,kv_gb,decode_ms_per_token,error,weights,"
                        "norm_s,rope_s,activation_s,misc_kernels_s,gemm\n");
      std::fflush(csv);
    }
    const double start = now();
    std::vector<Row> rows;
    for (int seq : o.seqs) {
      double dense_ttft = 0;
      for (const std::string& spec : o.policies) {
        Row r;
        r.seq = seq;
        r.policy = spec;
        if (o.max_seconds > 0 && now() - start > o.max_seconds) {
          r.error = "skipped (--max-seconds)";
        } else {
          try {
            GpuEngine engine(*dev, options_for(spec));
            r.ttft = 1e30;
            for (int rep = 0; rep < o.reps; ++rep) {
              engine.reset();
              engine.reset_stats();
              engine.reset_peak_memory();
              engine.prefill(std::span<const int32_t>(tokens.data(), static_cast<size_t>(seq)));
              const auto& st = engine.stats();
              if (st.prefill_seconds < r.ttft) {
                r.ttft = st.prefill_seconds;
                r.gemm = st.gemm_seconds;
                r.attention = st.attention_seconds;
                r.kernels = engine.kernel_seconds();
                r.peak_gb = static_cast<double>(engine.memory().peak_in_use_bytes) / 1e9;
                r.kv_gb = static_cast<double>(engine.memory().kv_cache_bytes) / 1e9;
              }
            }
            r.gemm_tflops = r.gemm > 0 ? gemm_flops(cfg, seq) / r.gemm / 1e12 : 0;
            if (base_spec(spec) == "dense" && dense_ttft == 0) dense_ttft = r.ttft;
            r.speedup = dense_ttft > 0 ? dense_ttft / r.ttft : 0;
            if (base_spec(spec) == "dense" && o.decode > 0 && seq + o.decode <= engine.max_context()) {
              engine.reset_stats();
              for (int i = 0; i < o.decode; ++i) engine.decode(tokens[static_cast<size_t>(i)]);
              r.decode_ms = 1e3 * engine.stats().decode_seconds / o.decode;
              // The first decode step moves the staged prompt into the KV blocks a layer at a time: the peak through it.
              std::printf("(%s: peak device memory through prefill and %d decode steps %.2f GB; KV blocks %.2f GB)\n",
                          spec.c_str(), o.decode, static_cast<double>(engine.memory().peak_in_use_bytes) / 1e9,
                          static_cast<double>(engine.memory().kv_cache_bytes) / 1e9);
            }
          } catch (const Error& e) {
            r.error = e.what();
          }
        }
        print_row_md(r);
        if (csv != nullptr) {
          std::string err = r.error;
          std::replace(err.begin(), err.end(), ',', ';');
          std::replace(err.begin(), err.end(), '\n', ' ');
          const double other = std::max(0.0, r.ttft - r.gemm - r.attention);
          std::fprintf(csv,
                       "\"%s\",%s,%d,%d,\"%s\",%d,%.4f,%.3f,%.4f,%.4f,%.4f,%.3f,%.3f,%.1f,%.2f,%.2f,%.3f,%s,%s,"
                       "%.4f,%.4f,%.4f,%.4f,%s\n",
                       gpu_description().c_str(), o.model.c_str(), cfg.num_layers, r.seq, r.policy.c_str(), o.chunk,
                       r.ttft, r.speedup, r.gemm, r.attention, other, r.ttft > 0 ? r.gemm / r.ttft : 0,
                       r.ttft > 0 ? r.attention / r.ttft : 0, r.gemm_tflops, r.peak_gb, r.kv_gb, r.decode_ms,
                       err.c_str(), o.weights.c_str(), r.kernels.norm, r.kernels.rope, r.kernels.activation,
                       r.kernels.misc, fp8_row(r.policy) ? "fp8" : "bf16");
          std::fflush(csv);
        }
        rows.push_back(r);
      }
    }
    if (csv != nullptr) std::fclose(csv);
    std::printf("\nGEMM floor: %.3g TFLOP per 128K-token prefill (%.2f s at 780 TFLOP/s)\n",
                gemm_flops(cfg, 131072) / 1e12, gemm_flops(cfg, 131072) / 780e12);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ttft_bench: %s\n", e.what());
    return 1;
  }
}
