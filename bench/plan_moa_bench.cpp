// plan_moa_bench — the CPU half of a MoA plan at a large model's shapes: the rule losses and the mixed-integer
// programs (CBC) of plan/moa_plan.h on an influence profile of Llama-3-8B's size (32 layers x 32 query heads, 8 KV
// heads, 64 x 64 blocks), whose gradient passes are the GPU's (bench/gpu/plan_gradients_bench). The profile is
// synthetic (the programs' size depends on the shapes, not on the values): per head a sink weight and a decay length
// (64 .. 8192 tokens, varied over heads and layers) give each block's influence
//   E(qb, kb) = w_h * exp(-64 (qb - kb) / tau_h) + s_h [kb == 0]   (positive: masking costs loss)
//
//   plan_moa_bench [--lengths 8192] [--layers 32] [--heads 32] [--kv-heads 8] [--budget 0.5]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "plan/moa_plan.h"
#include "plan/profile.h"

using namespace tessera;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<int32_t> parse_list(const std::string& s) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = s.find(',', i);
    out.push_back(std::stoi(s.substr(i, j == std::string::npos ? std::string::npos : j - i)));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int32_t> lengths{8192};
  int32_t layers = 32, heads = 32, kv_heads = 8;
  double budget = 0.5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "plan_moa_bench [--lengths 8192] [--layers 32] [--heads 32] [--kv-heads 8] [--budget 0.5]\n");
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--lengths") lengths = parse_list(v);
    else if (a == "--layers") layers = std::stoi(v);
    else if (a == "--heads") heads = std::stoi(v);
    else if (a == "--kv-heads") kv_heads = std::stoi(v);
    else if (a == "--budget") budget = std::stod(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  try {
    plan::GradientProfile p;
    p.num_layers = layers;
    p.num_q_heads = heads;
    p.probe.assign(static_cast<size_t>(layers), {});
    for (int32_t len : lengths) {
      plan::LengthProfile lp;
      lp.length = len;
      lp.num_blocks = (len + plan::kProfileBlock - 1) / plan::kProfileBlock;
      lp.samples = 1;
      const auto nb = static_cast<size_t>(lp.num_blocks);
      lp.influence.assign(static_cast<size_t>(layers) * static_cast<size_t>(heads) * nb * nb, 0.0);
      for (int32_t l = 0; l < layers; ++l)
        for (int32_t h = 0; h < heads; ++h) {
          const int k = (l * 7 + h * 3) % 8;
          const double tau = 64.0 * std::pow(2.0, k), w = 1e-6 * (1 + (h % 5)), s = 1e-5 * (1 + (l % 3));
          for (size_t qb = 0; qb < nb; ++qb)
            for (size_t kb = 0; kb <= qb; ++kb)
              lp.influence[((static_cast<size_t>(l) * static_cast<size_t>(heads) + static_cast<size_t>(h)) * nb + qb) *
                               nb +
                           kb] = w * std::exp(-64.0 * static_cast<double>(qb - kb) / tau) + (kb == 0 ? s : 0.0);
        }
      lp.sample_influence = {lp.influence};  // one sample (MoA's default Fisher loss reads the samples)
      p.lengths.push_back(std::move(lp));
    }
    std::printf("synthetic profile: %d layers x %d heads (%d KV), lengths", layers, heads, kv_heads);
    for (int32_t len : lengths) std::printf(" %d", len);
    std::printf(", budget %.2f\n", budget);
    double t = now();
    const auto rules = plan::moa_rule_space();
    const auto losses = plan::rule_losses(p, rules, 64);
    std::printf("rule losses (%zu rules x %d heads x %zu lengths): %.2f s\n", rules.size(), layers * heads,
                lengths.size(), now() - t);
    t = now();
    plan::MoaOptions mo;
    mo.budget = budget;
    const auto r = plan::plan_moa(p, kv_heads, mo, {}, [&](const std::string& what) {
      std::printf("  %s (%.1f s)\n", what.c_str(), now() - t);
      std::fflush(stdout);
    });
    std::printf("plan_moa: %d programs over %d distinct rules, %zu Pareto plans, %.1f s; chosen density", r.mips,
                r.options, r.pareto.size(), now() - t);
    for (double d : r.pareto[r.chosen].density) std::printf(" %.3f", d);
    std::printf(", proven optimal: %s\n", r.pareto[r.chosen].proven_optimal ? "yes" : "no (time limit)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
