// Reverse mode through the model (plan/model_gradients.h): its loss against the engine's logits, dL/dtheta
// (theta: a multiplicative gate on one attention probability) against central finite differences in f64 on every
// tiny architecture, MoA's influence and TriangleMix's region sums against the same differences, block sums
// against cell sums, f32 against f64, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "plan/model_gradients.h"
#include "runtime/engine.h"
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

// As scripts/make_plan_fixtures.py chooses them.
std::vector<Target> tail_targets(const std::vector<int32_t>& tokens, int32_t count, int32_t vocab) {
  std::vector<Target> out;
  const auto n = static_cast<int32_t>(tokens.size());
  for (int32_t p = n - count; p < n; ++p) out.push_back({p, (tokens[static_cast<size_t>(p)] * 5 + 3) % vocab});
  return out;
}

double loss_with_gate(const runtime::Model& m, const std::vector<int32_t>& tokens, const std::vector<Target>& targets,
                      const AttentionGate& gate) {
  GradientOptions o;
  o.precision = Precision::F64;
  o.loss_only = true;
  o.gate = gate;
  return attention_gradients(m, tokens, targets, o, ThreadPool::global()).loss;
}

class Gradients : public ::testing::TestWithParam<const char*> {};

// The loss of the reverse-mode's own forward pass equals the cross-entropy of the engine's logits.
TEST_P(Gradients, LossMatchesEngine) {
  const runtime::Model& m = model(GetParam());
  const auto tokens = sequence(40, m.config().vocab_size);
  const auto targets = tail_targets(tokens, 5, m.config().vocab_size);
  runtime::Engine engine(m);
  const std::vector<float> logits = engine.forward_all_logits(tokens);
  const int64_t V = m.config().vocab_size;
  double expected = 0;
  for (const Target& t : targets) {
    const float* row = logits.data() + t.position * V;
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
    expected += mx + std::log(sum) - row[t.token];
  }
  expected /= static_cast<double>(targets.size());
  for (Precision p : {Precision::F32, Precision::F64}) {
    GradientOptions o;
    o.precision = p;
    o.loss_only = true;
    const double loss = attention_gradients(m, tokens, targets, o, ThreadPool::global()).loss;
    EXPECT_NEAR(loss, expected, 2e-5 * std::abs(expected)) << (p == Precision::F32 ? "f32" : "f64");
  }
}

// dL/dtheta, MoA's influence and the probe against central differences of the loss in f64.
TEST_P(Gradients, MatchFiniteDifferences) {
  const runtime::Model& m = model(GetParam());
  const auto& cfg = m.config();
  const int32_t S = 20;
  const auto tokens = sequence(S, cfg.vocab_size);
  const auto targets = tail_targets(tokens, 3, m.config().vocab_size);
  GradientOptions o;
  o.precision = Precision::F64;
  o.block = 1;
  o.regions = {2, 3, 4};
  const GradientResult r = attention_gradients(m, tokens, targets, o, ThreadPool::global());
  ASSERT_EQ(r.num_blocks, S);
  ASSERT_EQ(r.layers.size(), static_cast<size_t>(cfg.num_layers));

  const double eps = 1e-5;
  double worst = 0;
  int checked = 0;
  for (int32_t l = 0; l < cfg.num_layers; ++l) {
    const LayerGradients& g = r.layers[static_cast<size_t>(l)];
    const int32_t h = (l * 3 + 1) % cfg.num_q_heads;
    // Every cell of two rows (a middle row and a target row), so that the influence's row sum is checked too.
    for (const int32_t i : {S / 2 + l % 3, S - 2}) {
      std::vector<double> fd(static_cast<size_t>(i + 1));
      double row_sum = 0;
      for (int32_t j = 0; j <= i; ++j) {
        const double up = loss_with_gate(m, tokens, targets, {l, h, i, j, 1 + eps});
        const double down = loss_with_gate(m, tokens, targets, {l, h, i, j, 1 - eps});
        fd[static_cast<size_t>(j)] = (up - down) / (2 * eps);
        row_sum += fd[static_cast<size_t>(j)];
      }
      double row_scale = 0;
      for (double v : fd) row_scale = std::max(row_scale, std::abs(v));
      for (int32_t j = 0; j <= i; ++j) {
        const double got = r.block_sum(g.gate_grad, h, i, j);
        const double want = fd[static_cast<size_t>(j)];
        const double err = std::abs(got - want) / std::max({std::abs(want), 1e-3 * row_scale, 1e-12});
        worst = std::max(worst, err);
        EXPECT_LE(err, 1e-3) << "layer " << l << " head " << h << " cell (" << i << ", " << j << "): " << got
                             << " vs " << want;
        // E_ij = -(G_ij - A_ij sum_n G_in) / (1 - A_ij) (dL/dA_ij = G_ij / A_ij).
        const double a = r.block_sum(g.attention, h, i, j);
        const double e_want = a > 0 && a < 1 - 1e-12 ? -(want - a * row_sum) / (1 - a) : 0.0;
        const double e_got = r.block_sum(g.influence, h, i, j);
        EXPECT_NEAR(e_got, e_want, 1e-3 * std::max(std::abs(e_want), row_scale) + 1e-12)
            << "influence, layer " << l << " head " << h << " cell (" << i << ", " << j << ")";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);
  RecordProperty("worst_relative_error", std::to_string(worst));
}

// Block sums are sums of the cell values; the probe's regions partition the causal cells and sum dL/dtheta.
TEST_P(Gradients, BlocksAndRegionsSumCells) {
  const runtime::Model& m = model(GetParam());
  const auto& cfg = m.config();
  const int32_t S = 27;
  const auto tokens = sequence(S, cfg.vocab_size);
  const auto targets = tail_targets(tokens, 4, m.config().vocab_size);
  GradientOptions cells;
  cells.precision = Precision::F64;
  cells.block = 1;
  cells.regions = {3, 4, 5};
  GradientOptions blocks = cells;
  blocks.block = 8;
  const GradientResult c = attention_gradients(m, tokens, targets, cells, ThreadPool::global());
  const GradientResult b = attention_gradients(m, tokens, targets, blocks, ThreadPool::global());
  ASSERT_EQ(b.num_blocks, 4);
  EXPECT_DOUBLE_EQ(b.loss, c.loss);
  for (int32_t l = 0; l < cfg.num_layers; ++l) {
    const LayerGradients& gc = c.layers[static_cast<size_t>(l)];
    const LayerGradients& gb = b.layers[static_cast<size_t>(l)];
    const int32_t window = cfg.layers[static_cast<size_t>(l)].sliding_window;
    RegionSums streaming, middle, last;
    for (int32_t h = 0; h < cfg.num_q_heads; ++h) {
      std::vector<double> infl(16, 0.0), gate(16, 0.0), att(16, 0.0);
      for (int32_t i = 0; i < S; ++i) {
        double row_mass = 0;
        for (int32_t j = 0; j <= i; ++j) {
          const size_t k = static_cast<size_t>((i / 8) * 4 + j / 8);
          infl[k] += c.block_sum(gc.influence, h, i, j);
          gate[k] += c.block_sum(gc.gate_grad, h, i, j);
          att[k] += c.block_sum(gc.attention, h, i, j);
          row_mass += c.block_sum(gc.attention, h, i, j);
          if (window > 0 && i - j >= window) {
            EXPECT_EQ(c.block_sum(gc.attention, h, i, j), 0.0) << "outside the sliding window";
            continue;
          }
          const double v = c.block_sum(gc.gate_grad, h, i, j);
          RegionSums& rs = (j < 3 || i - j < 4) ? streaming : (i >= S - 5 ? last : middle);
          rs.sum += v;
          rs.abs_sum += std::abs(v);
          ++rs.cells;
        }
        EXPECT_NEAR(row_mass, 1.0, 1e-12);
      }
      for (int32_t qb = 0; qb < 4; ++qb)
        for (int32_t kb = 0; kb < 4; ++kb) {
          const size_t k = static_cast<size_t>(qb * 4 + kb);
          EXPECT_NEAR(b.block_sum(gb.influence, h, qb, kb), infl[k], 1e-9 * (1 + std::abs(infl[k])));
          EXPECT_NEAR(b.block_sum(gb.gate_grad, h, qb, kb), gate[k], 1e-9 * (1 + std::abs(gate[k])));
          EXPECT_NEAR(b.block_sum(gb.attention, h, qb, kb), att[k], 1e-9 * (1 + att[k]));
          if (kb > qb) {
            EXPECT_EQ(att[k], 0.0);
          }
        }
    }
    for (auto [want, got] : {std::pair{streaming, gc.probe.streaming}, std::pair{middle, gc.probe.middle},
                             std::pair{last, gc.probe.last}}) {
      EXPECT_EQ(got.cells, want.cells) << "layer " << l;
      EXPECT_NEAR(got.sum, want.sum, 1e-9 * (1 + want.abs_sum)) << "layer " << l;
      EXPECT_NEAR(got.abs_sum, want.abs_sum, 1e-9 * (1 + want.abs_sum)) << "layer " << l;
    }
  }
}

// Against PyTorch autograd through transformers (tests/data/plan/<name>.json, scripts/make_plan_fixtures.py).
TEST_P(Gradients, MatchAutograd) {
  const runtime::Model& m = model(GetParam());
  std::ifstream f(std::string(TESSERA_SOURCE_DIR) + "/tests/data/plan/" + GetParam() + ".json");
  ASSERT_TRUE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  const auto tokens = j["tokens"].get<std::vector<int32_t>>();
  std::vector<Target> targets;
  for (const auto& t : j["targets"]) targets.push_back({t[0].get<int32_t>(), t[1].get<int32_t>()});
  EXPECT_EQ(targets, tail_targets(tokens, 6, m.config().vocab_size));
  GradientOptions o;
  o.precision = Precision::F64;
  o.block = j["block"].get<int32_t>();
  o.regions = {j["regions"]["sink"].get<int32_t>(), j["regions"]["local"].get<int32_t>(),
               j["regions"]["last"].get<int32_t>()};
  const GradientResult r = attention_gradients(m, tokens, targets, o, ThreadPool::global());
  const double want_loss = j["loss"].get<double>();
  EXPECT_NEAR(r.loss, want_loss, 1e-6 * want_loss);  // RoPE tables are f32 here (as in the forward pass)
  ASSERT_EQ(r.layers.size(), j["layers"].size());
  double worst = 0;
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const nlohmann::json& jl = j["layers"][l];
    for (const char* key : {"influence", "gate_grad", "attention"}) {
      const std::vector<double>& got = key == std::string("influence") ? r.layers[l].influence
                                       : key == std::string("gate_grad") ? r.layers[l].gate_grad
                                                                          : r.layers[l].attention;
      double scale = 0;
      for (const auto& head : jl[key])
        for (const auto& row : head)
          for (const auto& v : row) scale = std::max(scale, std::abs(v.get<double>()));
      for (int32_t h = 0; h < r.num_q_heads; ++h)
        for (int32_t qb = 0; qb < r.num_blocks; ++qb)
          for (int32_t kb = 0; kb < r.num_blocks; ++kb) {
            const double want = jl[key][h][qb][kb].get<double>();
            const double err = std::abs(r.block_sum(got, h, qb, kb) - want) / (scale + 1e-300);
            worst = std::max(worst, err);
            EXPECT_LE(err, 2e-5) << key << " layer " << l << " head " << h << " block (" << qb << ", " << kb
                                 << "): " << r.block_sum(got, h, qb, kb) << " vs " << want;
          }
    }
    const LayerProbe& p = r.layers[l].probe;
    for (auto [name, got] : {std::pair{"streaming", p.streaming}, std::pair{"middle", p.middle},
                             std::pair{"last", p.last}}) {
      const nlohmann::json& want = jl["probe"][name];
      EXPECT_EQ(got.cells, want["cells"].get<int64_t>()) << name << " layer " << l;
      const double abs_sum = want["abs_sum"].get<double>();
      EXPECT_NEAR(got.sum, want["sum"].get<double>(), 2e-5 * abs_sum + 1e-300) << name << " layer " << l;
      EXPECT_NEAR(got.abs_sum, abs_sum, 2e-5 * abs_sum + 1e-300) << name << " layer " << l;
    }
  }
  RecordProperty("worst_relative_error", std::to_string(worst));
}

// f32 agrees with f64.
TEST_P(Gradients, SinglePrecisionAgrees) {
  const runtime::Model& m = model(GetParam());
  const auto tokens = sequence(70, m.config().vocab_size);
  const auto targets = tail_targets(tokens, 6, m.config().vocab_size);
  GradientOptions o;
  o.block = 16;
  const GradientResult f = attention_gradients(m, tokens, targets, o, ThreadPool::global());
  o.precision = Precision::F64;
  const GradientResult d = attention_gradients(m, tokens, targets, o, ThreadPool::global());
  EXPECT_NEAR(f.loss, d.loss, 1e-5 * d.loss);
  for (size_t l = 0; l < d.layers.size(); ++l) {
    double scale = 0, err = 0;
    for (size_t i = 0; i < d.layers[l].influence.size(); ++i) {
      scale = std::max(scale, std::abs(d.layers[l].influence[i]));
      err = std::max(err, std::abs(d.layers[l].influence[i] - f.layers[l].influence[i]));
    }
    EXPECT_LE(err, 1e-3 * scale + 1e-9) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, Gradients, ::testing::Values("llama3", "qwen2", "gemma3", "mistral", "smollm2"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

TEST(GradientErrors, Messages) {
  const runtime::Model& m = model("llama3");
  const std::vector<int32_t> tokens{1, 2, 3, 4};
  const std::vector<Target> targets{{3, 7}};
  const GradientOptions o;
  auto message = [&](std::vector<int32_t> t, std::vector<Target> tg, GradientOptions opt) {
    try {
      attention_gradients(m, t, tg, opt, ThreadPool::global());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({}, targets, o), "attention gradients: empty token sequence");
  EXPECT_EQ(message(tokens, {}, o), "attention gradients: no target tokens (the loss needs at least one)");
  EXPECT_EQ(message(tokens, {{4, 1}}, o), "attention gradients: target position 4 outside the sequence of 4 tokens");
  EXPECT_EQ(message({1, 999}, targets, o),
            "attention gradients: token 1 has id 999, outside the vocabulary of 256");
  GradientOptions bad = o;
  bad.block = 0;
  EXPECT_EQ(message(tokens, targets, bad), "attention gradients: block must be >= 1, got 0");
  bad = o;
  bad.gate = AttentionGate{};
  EXPECT_EQ(message(tokens, targets, bad), "attention gradients: an attention gate needs loss_only");
  // The device choice (the GPU path is src/plan/cuda, tested in tests/gpu/plan; this CPU test binary never
  // registers it).
  bad = o;
  bad.tf32 = true;
  EXPECT_EQ(message(tokens, targets, bad), "attention gradients: tf32 applies to the CUDA path only");
  bad = o;
  bad.device = Device::Cuda;
  bad.precision = Precision::F64;
  EXPECT_EQ(message(tokens, targets, bad),
            "attention gradients: the CUDA path runs in f32 only (f64 is the CPU's, for finite-difference checks)");
  ASSERT_FALSE(cuda_gradients_registered());
  bad.precision = Precision::F32;
  EXPECT_EQ(message(tokens, targets, bad),
            "attention gradients: this tessera has no CUDA reverse mode (built without the CUDA toolkit, or "
            "src/plan/cuda not linked); use the CPU (--device cpu)");
  // The inputs are checked before the device is chosen.
  EXPECT_EQ(message({}, targets, bad), "attention gradients: empty token sequence");
}

// The registration hook: attention_gradients with Device::Cuda goes to the registered function, with the options
// unchanged and the inputs already checked; unregistering restores the error.
GradientResult fake_device(const runtime::Model&, std::span<const int32_t> tokens, std::span<const Target> targets,
                           const GradientOptions& options) {
  GradientResult r;
  r.seq_len = static_cast<int32_t>(tokens.size());
  r.block = options.block;
  r.loss = static_cast<double>(targets.size()) + (options.tf32 ? 0.5 : 0.0);
  return r;
}

TEST(GradientDevices, RegisteredPathAndNames) {
  const runtime::Model& m = model("llama3");
  const std::vector<int32_t> tokens{1, 2, 3, 4, 5};
  const std::vector<Target> targets{{3, 7}, {4, 9}};
  GradientOptions o;
  o.device = Device::Cuda;
  o.block = 3;
  o.tf32 = true;
  register_cuda_gradients(&fake_device);
  EXPECT_TRUE(cuda_gradients_registered());
  const GradientResult r = attention_gradients(m, tokens, targets, o, ThreadPool::global());
  EXPECT_EQ(r.seq_len, 5);
  EXPECT_EQ(r.block, 3);
  EXPECT_EQ(r.loss, 2.5);
  const std::vector<Target> outside{{5, 1}};
  EXPECT_THROW(attention_gradients(m, tokens, outside, o, ThreadPool::global()), Error);  // checked first
  register_cuda_gradients(nullptr);
  EXPECT_FALSE(cuda_gradients_registered());
  EXPECT_THROW(attention_gradients(m, tokens, targets, o, ThreadPool::global()), Error);
  EXPECT_EQ(parse_device("cpu"), Device::Cpu);
  EXPECT_EQ(parse_device("cuda"), Device::Cuda);
  EXPECT_STREQ(device_name(Device::Cuda), "cuda");
  EXPECT_STREQ(device_name(Device::Cpu), "cpu");
  try {
    parse_device("gpu");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--device must be cpu or cuda, got 'gpu'");
  }
}

}  // namespace
}  // namespace tessera::plan
