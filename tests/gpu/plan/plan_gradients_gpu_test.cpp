// The planners' reverse mode on the GPU (plan/cuda/gradients_cuda.h) against the CPU's (plan/model_gradients.h) on
// every tiny architecture: the loss, MoA's influence, dL/dtheta and the attention mass per block, TriangleMix's
// region sums and cell counts; with 64 x 64 blocks (the planners' size: one tile per block) and 16 x 16 blocks
// (per-cell sums), with several query chunks (chunk rows 64: chunk boundaries inside sliding windows) and one; the
// gated loss (the finite-difference hook); the registered path through profile_gradients (what `tessera plan
// --device cuda` runs); and the errors. Tolerance: f32 on both sides, different summation orders: every block sum
// within 1e-3 of the array's largest magnitude (the bound the CPU's own f32-vs-f64 test states), region sums within
// 1e-3 of their absolute sums, cells equal. The measured worst errors are printed ([ gpu-vs-cpu ] lines).
// Also MInference's search forward on the GPU (plan/cuda/minference_cuda.h) against the CPU search, on a tiny Llama
// with head_dim 64 (the GPU sparse executors' smallest; written here with random weights): the static candidate's
// errors within bf16 rounding, the dynamic ones' errors and densities within tolerance (their estimates run on bf16
// q/k), the same candidate per head on at least half the heads and elsewhere one within tolerance of the CPU's best
// by the CPU's scores ([ minference ] lines); the errors over each sample's last 128 rows (the query rows) likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention/pattern/pattern.h"
#include "core/error.h"
#include "plan/cuda/gradients_cuda.h"
#include "plan/cuda/minference_cuda.h"
#include "plan/minference_plan.h"
#include "plan/model_gradients.h"
#include "plan/profile.h"
#include "model/model.h"

namespace tessera::plan {
namespace {

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

const runtime::Model& model(const char* name) {
  static std::map<std::string, std::unique_ptr<runtime::Model>> cache;
  auto& m = cache[name];
  if (!m) m = runtime::Model::load(kFixtures + name);
  return *m;
}

std::vector<int32_t> sequence(int32_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 37 + 11) % vocab;
  return t;
}

std::vector<Target> tail_targets(const std::vector<int32_t>& tokens, int32_t count, int32_t vocab) {
  std::vector<Target> out;
  const auto n = static_cast<int32_t>(tokens.size());
  for (int32_t p = n - count; p < n; ++p) out.push_back({p, (tokens[static_cast<size_t>(p)] * 5 + 3) % vocab});
  return out;
}

// max |a - b| / max |b| over an array (0 when b is all zero and a equals it).
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double scale = 0, err = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    scale = std::max(scale, std::abs(b[i]));
    err = std::max(err, std::abs(a[i] - b[i]));
  }
  return scale > 0 ? err / scale : err;
}

void expect_equal_results(const GradientResult& gpu, const GradientResult& cpu, const std::string& what) {
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::abs(cpu.loss)) << what;
  ASSERT_EQ(gpu.num_blocks, cpu.num_blocks) << what;
  ASSERT_EQ(gpu.layers.size(), cpu.layers.size()) << what;
  double worst[4] = {0, 0, 0, 0};
  for (size_t l = 0; l < cpu.layers.size(); ++l) {
    const LayerGradients& g = gpu.layers[l];
    const LayerGradients& c = cpu.layers[l];
    ASSERT_EQ(g.influence.size(), c.influence.size());
    const double e[3] = {relative_error(g.influence, c.influence), relative_error(g.gate_grad, c.gate_grad),
                         relative_error(g.attention, c.attention)};
    EXPECT_LE(e[0], 1e-3) << what << " layer " << l << " influence";
    EXPECT_LE(e[1], 1e-3) << what << " layer " << l << " dL/dtheta";
    EXPECT_LE(e[2], 1e-3) << what << " layer " << l << " attention";
    for (int k = 0; k < 3; ++k) worst[k] = std::max(worst[k], e[k]);
    for (auto [gr, cr] : {std::pair{&g.probe.streaming, &c.probe.streaming}, std::pair{&g.probe.middle, &c.probe.middle},
                          std::pair{&g.probe.last, &c.probe.last}}) {
      EXPECT_EQ(gr->cells, cr->cells) << what << " layer " << l;
      const double scale = std::max(cr->abs_sum, 1e-300);
      EXPECT_LE(std::abs(gr->sum - cr->sum), 1e-3 * scale) << what << " layer " << l;
      EXPECT_LE(std::abs(gr->abs_sum - cr->abs_sum), 1e-3 * scale) << what << " layer " << l;
      if (cr->abs_sum > 0) worst[3] = std::max(worst[3], std::abs(gr->sum - cr->sum) / scale);
    }
  }
  std::printf("[ gpu-vs-cpu ] %-32s loss %.9g / %.9g  influence %.2e  dL/dtheta %.2e  attention %.2e  regions %.2e\n",
              what.c_str(), gpu.loss, cpu.loss, worst[0], worst[1], worst[2], worst[3]);
}

class GpuGradients : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GpuGradients, EqualCpu) {
  const runtime::Model& m = model(GetParam());
  const cuda::GradientModel dm(m.config(), m.weights());
  const auto tokens = sequence(150, m.config().vocab_size);
  const auto targets = tail_targets(tokens, 6, m.config().vocab_size);
  for (int32_t block : {64, 16}) {
    GradientOptions o;
    o.block = block;
    o.regions = {8, 16, 20};  // small regions, so that all three hold cells at 150 tokens
    const GradientResult cpu = attention_gradients(m, tokens, targets, o, ThreadPool::global());
    for (int64_t chunk : {int64_t{64}, int64_t{0}}) {
      cuda::DeviceStats stats;
      // chunk 64 also splits the 6 target rows' loss into chunks of 4 and 2
      const int64_t loss_rows = chunk == 64 ? 4 : 0;
      const GradientResult gpu =
          dm.run(tokens, targets, o, {.chunk_rows = chunk, .loss_rows = loss_rows, .stats = &stats});
      const std::string what = std::string(GetParam()) + " block " + std::to_string(block) + " chunk " +
                               std::to_string(stats.chunk_rows) + " loss rows " + std::to_string(loss_rows);
      expect_equal_results(gpu, cpu, what);
    }
  }
}

// The gated loss (finite differences' hook) on the GPU equals the CPU's f32 loss with the same gate.
TEST_P(GpuGradients, GatedLoss) {
  const runtime::Model& m = model(GetParam());
  const cuda::GradientModel dm(m.config(), m.weights());
  const auto tokens = sequence(90, m.config().vocab_size);
  const auto targets = tail_targets(tokens, 4, m.config().vocab_size);
  GradientOptions o;
  o.loss_only = true;
  o.gate = AttentionGate{.layer = 0, .head = 1, .query = 80, .key = 79, .value = 0.25};
  const double cpu = attention_gradients(m, tokens, targets, o, ThreadPool::global()).loss;
  const double gpu = dm.run(tokens, targets, o, {.chunk_rows = 64}).loss;
  EXPECT_NEAR(gpu, cpu, 1e-5 * std::abs(cpu));
  o.gate.reset();
  const double plain = attention_gradients(m, tokens, targets, o, ThreadPool::global()).loss;
  EXPECT_NE(cpu, plain);  // the gate changed the loss (so the comparison above tested it)
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuGradients,
                         ::testing::Values("llama3", "qwen2", "gemma3", "mistral", "smollm2"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

// Soft-capped logits (Gemma-2's final_logit_softcapping; no fixture has one): the tiny Gemma-3 with a cap of 0.5 set
// in a copy of its config, so that the cap bends every logit: the device cross-entropy and its gradient through the
// cap's derivative equal the CPU pass's (plan/cross_entropy.h).
TEST(GpuGradientsSoftcap, EqualCpu) {
  if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "tessera_gpu_softcap_gemma3";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kFixtures + "gemma3/" + f, dir / f);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  config["final_logit_softcapping"] = 0.5;
  std::ofstream(dir / "config.json") << config.dump(2);
  const auto capped = runtime::Model::load(dir.string());
  ASSERT_EQ(capped->config().final_logit_softcap, 0.5f);
  const runtime::Model& plain = model("gemma3");
  const auto tokens = sequence(130, capped->config().vocab_size);
  const auto targets = tail_targets(tokens, 6, capped->config().vocab_size);
  GradientOptions o;
  o.regions = {8, 16, 20};
  const GradientResult cpu = attention_gradients(*capped, tokens, targets, o, ThreadPool::global());
  const cuda::GradientModel dm(capped->config(), capped->weights());
  expect_equal_results(dm.run(tokens, targets, o, {.chunk_rows = 64, .loss_rows = 4}), cpu, "gemma3 softcap 0.5");
  // the cap changed the loss (so the comparison covered it)
  EXPECT_GT(std::abs(cpu.loss - attention_gradients(plain, tokens, targets, o, ThreadPool::global()).loss), 1e-3);
  fs::remove_all(dir);
}

// `tessera plan --device cuda`: profile_gradients through the registered path equals the CPU's profile.
TEST(GpuGradientsRegistered, ProfileEqualsCpu) {
  if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  cuda::enable();
  ASSERT_TRUE(cuda_gradients_registered());
  const runtime::Model& m = model("gemma3");
  std::vector<CalibrationSample> samples;
  for (int32_t n : {100, 130, 200}) {
    CalibrationSample s;
    s.name = "s" + std::to_string(n);
    s.tokens = sequence(n, m.config().vocab_size);
    s.targets = tail_targets(s.tokens, 5, m.config().vocab_size);
    samples.push_back(s);
  }
  const ProbeRegions regions{8, 16, 20};
  const GradientProfile cpu = profile_gradients(m, samples, {128, 256}, regions, ThreadPool::global(), {}, Device::Cpu);
  const int64_t before = cuda::registered_stats().passes;
  const GradientProfile gpu = profile_gradients(m, samples, {128, 256}, regions, ThreadPool::global(), {}, Device::Cuda);
  const cuda::RegisteredStats stats = cuda::registered_stats();
  EXPECT_EQ(stats.passes - before, 3);  // one pass per sample, counted for `tessera plan`'s report
  EXPECT_GT(stats.peak_pass_bytes, 0u);
  EXPECT_GT(stats.weight_bytes, 0u);
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * cpu.loss);
  ASSERT_EQ(gpu.lengths.size(), cpu.lengths.size());
  for (size_t i = 0; i < cpu.lengths.size(); ++i) {
    EXPECT_EQ(gpu.lengths[i].samples, cpu.lengths[i].samples);
    EXPECT_LE(relative_error(gpu.lengths[i].influence, cpu.lengths[i].influence), 1e-3) << "length " << i;
  }
  for (size_t l = 0; l < cpu.probe.size(); ++l) {
    EXPECT_EQ(gpu.probe[l].middle.cells, cpu.probe[l].middle.cells);
    EXPECT_LE(std::abs(gpu.probe[l].middle.abs_sum - cpu.probe[l].middle.abs_sum), 1e-3 * cpu.probe[l].middle.abs_sum);
  }
}

TEST(GpuGradientsErrors, Messages) {
  if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  const runtime::Model& m = model("llama3");
  const cuda::GradientModel dm(m.config(), m.weights());
  const std::vector<int32_t> tokens{1, 2, 3, 4};
  const std::vector<Target> targets{{3, 7}};
  auto message = [&](std::vector<int32_t> t, std::vector<Target> tg, GradientOptions opt) {
    try {
      dm.run(t, tg, opt);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  GradientOptions o;
  EXPECT_EQ(message({}, targets, o), "attention gradients: empty token sequence");
  EXPECT_EQ(message(tokens, {{4, 1}}, o), "attention gradients: target position 4 outside the sequence of 4 tokens");
  o.precision = Precision::F64;
  EXPECT_EQ(message(tokens, targets, o),
            "attention gradients: the CUDA path runs in f32 only (f64 is the CPU's, for finite-difference checks)");
  o = {};
  EXPECT_EQ(message(tokens, targets, o), "no error");
  try {
    dm.run(tokens, targets, o, {.chunk_rows = 100});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention gradients (CUDA): chunk rows must be a multiple of 64, got 100");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// MInference's search forward on the GPU against the CPU's.

// An HF folder: a 2-layer Llama, hidden 256, 4 query heads of 64 (2 kv heads), FFN 256, vocab 300, bf16 weights
// uniform with standard deviation 1/sqrt(in) (q and k projections x 4: peaked attention, so that the candidates'
// errors differ), norms 1, tied embeddings. Deterministic.
std::string write_tiny_llama_d64() {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "tessera_minference_tiny_d64";
  std::filesystem::create_directories(dir);
  const int64_t H = 256, F = 256, V = 300, NQ = 4, NKV = 2, D = 64, L = 2;
  nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", V},
                        {"hidden_size", H}, {"intermediate_size", F}, {"num_hidden_layers", L},
                        {"num_attention_heads", NQ}, {"num_key_value_heads", NKV}, {"head_dim", D},
                        {"hidden_act", "silu"}, {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
                        {"rope_theta", 10000.0}, {"tie_word_embeddings", true}, {"torch_dtype", "bfloat16"}};
  std::ofstream(dir / "config.json") << cfg.dump(2);
  struct T {
    std::string name;
    int64_t rows, cols;
    float gain;  // 0: a norm (ones)
  };
  std::vector<T> ts{{"model.embed_tokens.weight", V, H, 1.0f}, {"model.norm.weight", 1, H, 0.0f}};
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ts.push_back({p + "input_layernorm.weight", 1, H, 0.0f});
    ts.push_back({p + "post_attention_layernorm.weight", 1, H, 0.0f});
    ts.push_back({p + "self_attn.q_proj.weight", NQ * D, H, 4.0f});
    ts.push_back({p + "self_attn.k_proj.weight", NKV * D, H, 4.0f});
    ts.push_back({p + "self_attn.v_proj.weight", NKV * D, H, 1.0f});
    ts.push_back({p + "self_attn.o_proj.weight", H, NQ * D, 1.0f});
    ts.push_back({p + "mlp.gate_proj.weight", F, H, 1.0f});
    ts.push_back({p + "mlp.up_proj.weight", F, H, 1.0f});
    ts.push_back({p + "mlp.down_proj.weight", H, F, 1.0f});
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
  uint64_t s = 2026;
  for (const T& t : ts) {
    const float amp = t.gain * std::sqrt(3.0f / static_cast<float>(t.name.find("embed") != std::string::npos ? 1 : t.cols));
    std::vector<uint16_t> buf(static_cast<size_t>(t.rows * t.cols));
    for (auto& v : buf) {
      float x = 1.0f;
      if (t.gain > 0) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = (static_cast<float>(s >> 40) / 16777216.0f * 2.0f - 1.0f) * amp;
      }
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v = static_cast<uint16_t>(bits >> 16);
    }
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 2));
  }
  return dir.string();
}

TEST(GpuMInference, SameChoicesAsTheCpuSearch) {
  if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::unique_ptr<runtime::Model> m = runtime::Model::load(write_tiny_llama_d64());
  ASSERT_EQ(m->config().head_dim, 64);
  std::vector<CalibrationSample> samples(2);
  for (int i = 0; i < 2; ++i) {
    samples[static_cast<size_t>(i)].name = "random-" + std::to_string(i);
    for (int32_t t = 0; t < 1024; ++t) samples[static_cast<size_t>(i)].tokens.push_back((t * (31 + 6 * i) + 7 * i) % 300);
  }
  MInferenceOptions o;
  o.budget = 0.3;
  o.size_by_measurement = false;  // the same (bound-sized) candidates on both sides; sizing is the CPU's anyway
  const MInferenceResult cpu = plan_minference(*m, samples, o, ThreadPool::global());
  cuda::enable();
  o.device = Device::Cuda;
  const MInferenceResult gpu = plan_minference(*m, samples, o, ThreadPool::global());
  ASSERT_EQ(gpu.candidates, cpu.candidates);
  ASSERT_EQ(gpu.error.size(), cpu.error.size());
  // Both score the last 128 rows too (the default query rows): the same error over those rows alone.
  ASSERT_EQ(cpu.query_error.size(), cpu.error.size());
  ASSERT_EQ(gpu.query_error.size(), cpu.query_error.size());
  const size_t C = cpu.candidates.size(), heads = cpu.choice.size();
  // Tolerances. The static candidate (A-shape) has the same mask on both sides: its errors differ by the bf16 copies
  // of q, k, v and the bf16 output alone. The dynamic ones (VS, BS) estimate on bf16 q / k on the GPU, f32 on the
  // CPU: near-ties of the estimates pick other columns / blocks, so their errors and densities move more.
  auto dyn_tol = [](double e) { return 0.05 + 0.2 * e; };
  double worst_err = 0, worst_ashape = 0, worst_density = 0;
  int same = 0;
  for (size_t hh = 0; hh < heads; ++hh) {
    for (size_t c = 0; c < C; ++c) {
      const double e_cpu = cpu.error[hh * C + c], e_gpu = gpu.error[hh * C + c];
      const double d_cpu = cpu.measured_density[hh * C + c], d_gpu = gpu.measured_density[hh * C + c];
      const double q_cpu = cpu.query_error[hh * C + c], q_gpu = gpu.query_error[hh * C + c];
      if (std::holds_alternative<attn::AShapePattern>(cpu.candidates[c])) {
        EXPECT_LE(std::abs(e_gpu - e_cpu), 0.002 + 0.02 * e_cpu) << "head " << hh << " (A-shape)";
        EXPECT_LE(std::abs(q_gpu - q_cpu), 0.002 + 0.02 * q_cpu) << "head " << hh << " (A-shape, query rows)";
        EXPECT_NEAR(d_gpu, d_cpu, 1e-12) << "head " << hh << " (A-shape)";
        worst_ashape = std::max(worst_ashape, std::abs(e_gpu - e_cpu));
      } else {
        EXPECT_LE(std::abs(e_gpu - e_cpu), dyn_tol(e_cpu)) << "head " << hh << " candidate " << c;
        EXPECT_LE(std::abs(q_gpu - q_cpu), dyn_tol(q_cpu)) << "head " << hh << " candidate " << c << " (query rows)";
        EXPECT_NEAR(d_gpu, d_cpu, 0.02) << "head " << hh << " candidate " << c;
      }
      EXPECT_GT(e_gpu, 0.0) << "head " << hh << " candidate " << c;
      worst_err = std::max({worst_err, std::abs(e_gpu - e_cpu), std::abs(q_gpu - q_cpu)});
      worst_density = std::max(worst_density, std::abs(d_gpu - d_cpu));
    }
    // The GPU's choice is the CPU's, or near-optimal by the CPU's own scores (a near-tie between candidates).
    const size_t g = static_cast<size_t>(gpu.choice[hh]), c = static_cast<size_t>(cpu.choice[hh]);
    same += g == c;
    EXPECT_LE(choice_score(cpu, hh, g) - choice_score(cpu, hh, c), dyn_tol(choice_score(cpu, hh, c))) << "head " << hh;
  }
  std::printf("[ minference ] %zu heads, %zu candidates: CPU choices", heads, C);
  for (int32_t x : cpu.choice) std::printf(" %d", x);
  std::printf(", GPU choices");
  for (int32_t x : gpu.choice) std::printf(" %d", x);
  std::printf("; same on %d heads; worst |error GPU - CPU| %.2e (A-shape %.2e), worst density difference %.2e; "
              "CPU %.2f s, GPU %.2f s (errors over all rows and the last 128)\n",
              same, worst_err, worst_ashape, worst_density, cpu.seconds, gpu.seconds);
  EXPECT_GE(2 * same, static_cast<int>(heads)) << "the GPU search agrees with the CPU's on fewer than half the heads";
}

TEST(GpuMInference, HeadDimOutsideTheExecutorsIsAnError) {
  if (!cuda::gpu_available()) GTEST_SKIP() << "no CUDA device";
  const runtime::Model& m = model("llama3");  // head_dim 16
  const cuda::GradientModel dm(m.config(), m.weights());
  const std::vector<attn::Pattern> cands = minference_candidates(0.3, 256);
  std::vector<double> err(static_cast<size_t>(m.config().num_layers * m.config().num_q_heads) * cands.size()), den = err;
  try {
    cuda::minference_errors(dm, std::vector<int32_t>(256, 3), cands, 1.0, err, den);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "minference (CUDA): head_dim 16 is not run by the GPU sparse executors (64, 128, 256); use "
                           "--device cpu");
  }
}

}  // namespace
}  // namespace tessera::plan
