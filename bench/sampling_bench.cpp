// sampling_bench — the host sampler (runtime/sampling.h) at vocabulary sizes of the models tessera serves: time per
// sampled token, against the obvious implementation that sorts the whole vocabulary at every token (what the
// sampler did before it sorted only the prefix a top_p walk reaches). Logits: normal(0, 2.5) with 30 tokens
// raised by 10 (a peaked head, as language models' are), fixed seed. Prints one markdown table.
//
//   sampling_bench [--reps 50]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/sampling.h"

using namespace tessera::runtime;

namespace {

// The sampler before this change: every candidate sorted by logit (ties by id; a top_k cut by a partial sort),
// softmax in double, the top_p cut, the draw in logit order.
int32_t full_sort_sample(const std::vector<float>& logits, const SamplingOptions& o, double u) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  };
  if (o.top_k > 0 && static_cast<size_t>(o.top_k) < ids.size()) {  // a partial sort, as the old sampler had
    std::partial_sort(ids.begin(), ids.begin() + o.top_k, ids.end(), before);
    ids.resize(static_cast<size_t>(o.top_k));
  } else {
    std::sort(ids.begin(), ids.end(), before);
  }
  const double inv_t = 1.0 / o.temperature, top = logits[static_cast<size_t>(ids[0])] * inv_t;
  std::vector<double> p(ids.size());
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) sum += p[i] = std::exp(logits[static_cast<size_t>(ids[i])] * inv_t - top);
  size_t keep = ids.size();
  if (o.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < ids.size(); ++i)
      if ((cum += p[i] / sum) >= o.top_p) {
        keep = i + 1;
        break;
      }
    sum = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  double acc = 0;
  for (size_t i = 0; i < keep; ++i)
    if (u * sum < (acc += p[i])) return ids[i];
  return ids[keep - 1];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
  std::printf("| vocab | options | sampler ms/token | full sort ms/token | full sort / sampler |\n|---:|---|---:|---:|---:|\n");
  for (const size_t n : {size_t{49152}, size_t{128256}, size_t{262144}}) {  // SmolLM2, Llama-3, Gemma-3
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.0f, 2.5f);
    std::vector<float> logits(n);
    for (auto& x : logits) x = dist(rng);
    for (int i = 0; i < 30; ++i) logits[rng() % n] += 10.0f;
    const std::pair<const char*, SamplingOptions> cases[] = {
        {"temperature 0.8", {.temperature = 0.8f, .seed = 1}},
        {"temperature 0.8, top_p 0.95", {.temperature = 0.8f, .top_p = 0.95f, .seed = 1}},
        {"temperature 0.8, top_k 40", {.temperature = 0.8f, .top_k = 40, .seed = 1}}};
    for (const auto& [name, o] : cases) {
      Sampler s(o);
      long sink = 0;
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) sink += s.sample(logits);
      const double ours = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
      t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) sink += full_sort_sample(logits, o, (r + 0.5) / reps);
      const double full = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
      std::printf("| %zu | %s | %.3f | %.3f | %.1fx |\n", n, name, ours * 1e3, full * 1e3, full / ours);
      if (sink == -1) std::printf("(unreachable)\n");
    }
  }
  return 0;
}
