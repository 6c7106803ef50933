// The planners' reverse mode on the GPU (plan/cuda/gradients_cuda.h) against the CPU's (plan/model_gradients.h) on
// every tiny architecture: the loss, MoA's influence, dL/dtheta and the attention mass per block, TriangleMix's
// region sums and cell counts; with 64 x 64 blocks (the planners' size: one tile per block) and 16 x 16 blocks
// (per-cell sums), with several query chunks (chunk rows 64: chunk boundaries inside sliding windows) and one; the
// gated loss (the finite-difference hook); the registered path through profile_gradients (what `tessera plan
// --device cuda` runs); and the errors. Tolerance: f32 on both sides, different summation orders: every block sum
// within 1e-3 of the array's largest magnitude (the bound the CPU's own f32-vs-f64 test states), region sums within
// 1e-3 of their absolute sums, cells equal. The measured worst errors are printed ([ gpu-vs-cpu ] lines).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "plan/cuda/gradients_cuda.h"
#include "plan/model_gradients.h"
#include "plan/profile.h"
#include "runtime/model.h"

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
      const GradientResult gpu = dm.run(tokens, targets, o, {.chunk_rows = chunk, .stats = &stats});
      const std::string what = std::string(GetParam()) + " block " + std::to_string(block) + " chunk " +
                               std::to_string(stats.chunk_rows);
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

}  // namespace
}  // namespace tessera::plan
