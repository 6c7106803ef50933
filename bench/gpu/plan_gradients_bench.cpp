// plan_gradients_bench — the planners' reverse mode on the GPU (src/plan/cuda) at a real model's shapes with random
// weights: the time and peak device memory of one gradient pass (f32, and with TF32 tensor-core products), then the
// planners on its result (TriangleMix's layer split; MoA's programs where CBC was built in), and optionally the CPU
// reverse mode against the GPU at the same shapes with fewer layers (the CPU cannot hold 32 f32 layers and an 8K
// pass in useful time).
//
//   plan_gradients_bench [--model llama3-8b] [--seq 8192] [--targets 16] [--reps 2] [--cpu-layers 1]
//                        [--cpu-seq 8192] [--no-tf32] [--minference]
//
// --minference times MInference's search forward on the GPU (plan/cuda/minference_cuda.h) instead: one sample of
// --seq tokens through the f32 device forward, the six candidates of minference_candidates(0.3, seq) (bound-sized) on
// every head of every layer (estimate, index, sparse attention in bf16, error against dense); with --cpu-layers N
// the CPU search (plan_minference, the same candidates) against the GPU's on the N-layer model: time, choices and
// the worst error difference.
//
// The pass: tokens pseudo-random over the vocabulary, the loss on the last --targets positions, 64 x 64 block sums
// (as `tessera plan` profiles). --cpu-layers N writes an HF folder (config.json with N layers and tied embeddings,
// bf16 random weights in model.safetensors) to $TMPDIR, loads it as the CPU runtime does, and times the CPU pass
// (ThreadPool::global(), every core) and the GPU pass on that same Model, with the GPU's worst block-sum error
// against the CPU. Peak memory: the pass's own device allocations (weights apart), device memory in use at its
// largest (cudaMemGetInfo), and the process's maximum resident set for the CPU.
#include <cuda_runtime.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "plan/cuda/gradients_cuda.h"
#include "plan/cuda/minference_cuda.h"
#include "plan/minference_plan.h"
#include "plan/model_gradients.h"
#include "plan/moa_plan.h"
#include "plan/profile.h"
#include "plan/trianglemix_plan.h"
#include "model/model.h"
#include "runtime/cuda/synthetic_config.h"

using namespace tessera;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double gb(double b) { return b / 1e9; }
double rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

std::vector<int32_t> tokens_for(int32_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t s = 12345;
  for (auto& v : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}
std::vector<plan::Target> targets_for(const std::vector<int32_t>& tokens, int32_t count) {
  std::vector<plan::Target> out;
  const auto n = static_cast<int32_t>(tokens.size());
  for (int32_t p = std::max(0, n - count - 1); p < n - 1; ++p) out.push_back({p, tokens[static_cast<size_t>(p + 1)]});
  return out;
}

// One sample's profile, as profile_gradients builds it.
plan::GradientProfile profile_of(const plan::GradientResult& r, int32_t layers, int32_t heads) {
  plan::GradientProfile p;
  p.num_layers = layers;
  p.num_q_heads = heads;
  plan::LengthProfile lp;
  lp.length = r.seq_len;
  lp.num_blocks = r.num_blocks;
  lp.samples = 1;
  for (const auto& l : r.layers) lp.influence.insert(lp.influence.end(), l.influence.begin(), l.influence.end());
  lp.sample_influence = {lp.influence};  // the one sample (MoA's default Fisher loss reads the samples)
  p.lengths.push_back(std::move(lp));
  for (const auto& l : r.layers) p.probe.push_back(l.probe);
  p.loss = r.loss;
  return p;
}

double worst_error(const plan::GradientResult& a, const plan::GradientResult& b) {
  double worst = 0;
  for (size_t l = 0; l < b.layers.size(); ++l) {
    double scale = 0, err = 0;
    for (size_t i = 0; i < b.layers[l].influence.size(); ++i) {
      scale = std::max(scale, std::abs(b.layers[l].influence[i]));
      err = std::max(err, std::abs(a.layers[l].influence[i] - b.layers[l].influence[i]));
    }
    worst = std::max(worst, scale > 0 ? err / scale : err);
  }
  return worst;
}

// An HF folder with `layers` layers of `name`'s shapes, tied embeddings, bf16 weights uniform with standard deviation
// 1/sqrt(in) (norms 1, the embedding standard deviation 1).
std::string write_model(const std::string& name, int32_t layers) {
  nlohmann::json cfg = runtime::gpu::synthetic_hf_config(name);
  cfg["num_hidden_layers"] = layers;
  cfg["tie_word_embeddings"] = true;
  const char* tmp = std::getenv("TMPDIR");
  const std::filesystem::path dir = std::filesystem::path(tmp ? tmp : "/tmp") / ("plan_bench_" + name);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << cfg.dump(2);
  const int64_t H = cfg["hidden_size"], F = cfg["intermediate_size"], V = cfg["vocab_size"];
  const int64_t NQ = cfg["num_attention_heads"], NKV = cfg["num_key_value_heads"];
  const int64_t D = H / NQ;
  struct T {
    std::string name;
    int64_t rows, cols;
    bool norm;
  };
  std::vector<T> ts{{"model.embed_tokens.weight", V, H, false}, {"model.norm.weight", 1, H, true}};
  for (int32_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ts.push_back({p + "input_layernorm.weight", 1, H, true});
    ts.push_back({p + "post_attention_layernorm.weight", 1, H, true});
    ts.push_back({p + "self_attn.q_proj.weight", NQ * D, H, false});
    ts.push_back({p + "self_attn.k_proj.weight", NKV * D, H, false});
    ts.push_back({p + "self_attn.v_proj.weight", NKV * D, H, false});
    ts.push_back({p + "self_attn.o_proj.weight", H, NQ * D, false});
    ts.push_back({p + "mlp.gate_proj.weight", F, H, false});
    ts.push_back({p + "mlp.up_proj.weight", F, H, false});
    ts.push_back({p + "mlp.down_proj.weight", H, F, false});
  }
  nlohmann::json header = nlohmann::json::object();
  uint64_t off = 0;
  for (const T& t : ts) {
    const uint64_t n = static_cast<uint64_t>(t.rows * t.cols) * 2;
    header[t.name] = {{"dtype", "BF16"},
                      {"shape", t.rows == 1 ? nlohmann::json::array({t.cols}) : nlohmann::json::array({t.rows, t.cols})},
                      {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::ofstream f(dir / "model.safetensors", std::ios::binary);
  const uint64_t hl = h.size();
  f.write(reinterpret_cast<const char*>(&hl), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  uint64_t s = 777;
  std::vector<uint16_t> buf;
  for (const T& t : ts) {
    const float amp = t.name.find("embed") != std::string::npos ? std::sqrt(3.0f) : std::sqrt(3.0f / static_cast<float>(t.cols));
    buf.resize(static_cast<size_t>(t.rows * t.cols));
    for (auto& v : buf) {
      float x = 1.0f;
      if (!t.norm) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = (static_cast<float>(s >> 40) / 16777216.0f * 2.0f - 1.0f) * amp;
      }
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v = static_cast<uint16_t>(bits >> 16);
    }
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 2));
  }
  check(static_cast<bool>(f), (dir / "model.safetensors").string() + ": write failed");
  return dir.string();
}

// Choices per candidate (how many heads took each) from errors [heads][C].
std::vector<int> choices(const std::vector<double>& error, size_t C, std::vector<int32_t>* per_head = nullptr) {
  std::vector<int> n(C, 0);
  for (size_t hh = 0; hh * C < error.size(); ++hh) {
    size_t best = 0;
    for (size_t c = 1; c < C; ++c)
      if (error[hh * C + c] < error[hh * C + best]) best = c;
    ++n[best];
    if (per_head) per_head->push_back(static_cast<int32_t>(best));
  }
  return n;
}

int minference_bench(const plan::cuda::GradientModel& gm, const std::string& model, const std::vector<int32_t>& tokens,
                     int reps, int32_t cpu_layers, int32_t cpu_seq) {
  const runtime::ModelConfig& cfg = gm.config();
  const int32_t seq = static_cast<int32_t>(tokens.size());
  const std::vector<attn::Pattern> cands = plan::minference_candidates(0.3, seq);
  const size_t C = cands.size(), heads = static_cast<size_t>(cfg.num_layers) * static_cast<size_t>(cfg.num_q_heads);
  std::printf("MInference search forward on the GPU: %zu candidates (bound-sized for density 0.3 at %d):", C, seq);
  for (const attn::Pattern& p : cands) std::printf(" %s;", attn::describe(p).c_str());
  std::printf("\n| run | seconds | of which candidates (device events) | forward and host round trips |\n|---:|---:|---:|---:|\n");
  std::vector<double> err, den;
  for (int r = 0; r < reps; ++r) {
    err.assign(heads * C, 0.0);
    den.assign(heads * C, 0.0);
    plan::cuda::MInferenceDeviceStats st;
    plan::cuda::minference_errors(gm, tokens, cands, 1.0, err, den, &st);
    std::printf("| %d | %.3f | %.3f | %.3f |\n", r + 1, st.seconds, st.candidate_seconds, st.seconds - st.candidate_seconds);
    std::fflush(stdout);
  }
  const std::vector<int> n = choices(err, C);
  std::printf("heads per candidate (random weights: not a plan):");
  for (size_t c = 0; c < C; ++c) std::printf(" %s %d;", attn::describe(cands[c]).c_str(), n[c]);
  std::printf("\n");
  if (cpu_layers <= 0) return 0;
  double t = now();
  const std::string dir = write_model(model, cpu_layers);
  const auto m = runtime::Model::load(dir);
  std::printf("\nCPU vs GPU search, %d layer(s) of %s shapes, seq %d: model written and loaded in %.1f s (%d threads)\n",
              cpu_layers, model.c_str(), cpu_seq, now() - t, ThreadPool::global().size());
  std::vector<plan::CalibrationSample> samples(1);
  samples[0].name = "random";
  samples[0].tokens = tokens_for(cpu_seq, cfg.vocab_size);
  plan::MInferenceOptions mo;
  mo.size_by_measurement = false;
  plan::cuda::enable();
  mo.device = plan::Device::Cuda;
  plan::plan_minference(*m, samples, mo, ThreadPool::global());  // weights to the device, warm-up
  const plan::MInferenceResult g = plan::plan_minference(*m, samples, mo, ThreadPool::global());
  mo.device = plan::Device::Cpu;
  const double rss0 = rss_bytes();
  const plan::MInferenceResult c = plan::plan_minference(*m, samples, mo, ThreadPool::global());
  int same = 0;
  double worst = 0;
  for (size_t hh = 0; hh < c.choice.size(); ++hh) same += c.choice[hh] == g.choice[hh];
  for (size_t i = 0; i < c.error.size(); ++i) worst = std::max(worst, std::abs(c.error[i] - g.error[i]));
  std::printf("| device | search seconds | peak memory GB |\n|---|---:|---:|\n");
  std::printf("| GPU | %.3f | (device) |\n| CPU | %.3f | %.2f (max RSS; %.2f before) |\n", g.seconds, c.seconds,
              gb(rss_bytes()), gb(rss0));
  std::printf("CPU / GPU time: %.1fx; same choice on %d of %zu heads; worst |error GPU - CPU| %.2e\n",
              c.seconds / g.seconds, same, c.choice.size(), worst);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b";
  int32_t seq = 8192, ntargets = 16, reps = 2, cpu_layers = 0, cpu_seq = 0;
  bool tf32 = true, minference = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") model = next();
    else if (a == "--seq") seq = std::stoi(next());
    else if (a == "--targets") ntargets = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--cpu-layers") cpu_layers = std::stoi(next());
    else if (a == "--cpu-seq") cpu_seq = std::stoi(next());
    else if (a == "--no-tf32") tf32 = false;
    else if (a == "--minference") minference = true;
    else {
      std::fprintf(stderr, "plan_gradients_bench [--model llama3-8b] [--seq 8192] [--targets 16] [--reps 2] "
                           "[--cpu-layers 1] [--cpu-seq 8192] [--no-tf32] [--minference]\n");
      return 2;
    }
  }
  if (cpu_seq == 0) cpu_seq = seq;
  try {
    if (!plan::cuda::gpu_available()) {
      std::printf("no CUDA device\n");
      return 1;
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    const runtime::ModelConfig cfg = runtime::gpu::synthetic_config(model);
    std::printf("device: %s; model %s (random weights): %s; seq %d, %d targets\n", prop.name, model.c_str(),
                cfg.summary().c_str(), seq, ntargets);
    double t = now();
    const auto gm = plan::cuda::GradientModel::random(cfg, 1);
    std::printf("weights on the device: %.2f GB f32 (%.1f s)\n", gb(static_cast<double>(gm->bytes())), now() - t);
    const auto tokens = tokens_for(seq, cfg.vocab_size);
    const auto targets = targets_for(tokens, ntargets);
    if (minference) return minference_bench(*gm, model, tokens, reps, cpu_layers, cpu_seq);
    plan::GradientOptions o;
    o.block = plan::kProfileBlock;
    plan::GradientResult f32_result;
    std::printf("| products | pass | seconds | loss | chunk rows | pass peak GB (weights apart) | device in use peak GB |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (bool t32 : {false, true}) {
      if (t32 && !tf32) continue;
      o.tf32 = t32;
      for (int r = 0; r < reps; ++r) {
        plan::cuda::DeviceStats st;
        plan::GradientResult res = gm->run(tokens, targets, o, {.stats = &st});
        std::printf("| %s | %d | %.3f | %.6f | %lld | %.2f | %.2f |\n", t32 ? "TF32" : "f32", r + 1, st.seconds,
                    res.loss, static_cast<long long>(st.chunk_rows), gb(static_cast<double>(st.peak_pass_bytes)),
                    gb(static_cast<double>(st.peak_used_bytes)));
        std::fflush(stdout);
        if (t32 && r == 0 && !f32_result.layers.empty())
          std::printf("  TF32 against f32: worst influence block-sum error %.2e of the layer's largest\n",
                      worst_error(res, f32_result));
        if (!t32 && r == 0) f32_result = std::move(res);
      }
    }
    // The planners on the pass's result.
    const plan::GradientProfile prof = profile_of(f32_result, cfg.num_layers, cfg.num_q_heads);
    t = now();
    const auto tm = plan::plan_trianglemix(prof, cfg.num_kv_heads, {}, {});
    std::printf("TriangleMix split from the profile: start layer %d (%.3f s)\n", tm.start_layer, now() - t);
    t = now();
    try {
      plan::MoaOptions mo;
      const auto mr = plan::plan_moa(prof, cfg.num_kv_heads, mo);
      std::printf("MoA programs from the profile: %d programs, %zu Pareto plans (%.1f s)\n", mr.mips, mr.pareto.size(),
                  now() - t);
    } catch (const Error& e) {
      std::printf("MoA programs: not run (%s)\n", e.what());
    }

    if (cpu_layers > 0) {
      t = now();
      const std::string dir = write_model(model, cpu_layers);
      const auto m = runtime::Model::load(dir);
      std::printf("\nCPU vs GPU, %d layer(s) of %s shapes, seq %d: model written and loaded in %.1f s (%d threads)\n",
                  cpu_layers, model.c_str(), cpu_seq, now() - t, ThreadPool::global().size());
      const auto ctok = tokens_for(cpu_seq, cfg.vocab_size);
      const auto ctg = targets_for(ctok, ntargets);
      plan::GradientOptions co;
      co.block = plan::kProfileBlock;
      const plan::cuda::GradientModel cm(m->config(), m->weights());
      plan::cuda::DeviceStats st;
      const plan::GradientResult g = cm.run(ctok, ctg, co, {.stats = &st});
      cm.run(ctok, ctg, co, {.stats = &st});  // the second (warm) pass's time
      const double rss0 = rss_bytes();
      t = now();
      const plan::GradientResult c = plan::attention_gradients(*m, ctok, ctg, co, ThreadPool::global());
      const double cpu_s = now() - t;
      std::printf("| device | seconds | peak memory GB | loss |\n|---|---:|---:|---:|\n");
      std::printf("| GPU f32 | %.3f | %.2f (pass) | %.6f |\n", st.seconds, gb(static_cast<double>(st.peak_pass_bytes)),
                  g.loss);
      std::printf("| CPU f32 | %.3f | %.2f (max RSS; %.2f before the pass) | %.6f |\n", cpu_s, gb(rss_bytes()),
                  gb(rss0), c.loss);
      std::printf("CPU / GPU time: %.1fx; GPU's worst influence block-sum error against the CPU: %.2e of the layer's "
                  "largest\n",
                  cpu_s / st.seconds, worst_error(g, c));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
