// The batched engine's token budget per step (BatchEngineOptions::step_tokens) against none: the inter-token gaps of
// decoding requests while a long prompt arrives, and that prompt's time to its first token.
//
//   build/ci/bench/batch_step_bench MODEL.gguf [--decoders 2] [--long 4000] [--budgets 0,256,512] [--chunk 2048]
//                                   [--device cpu|cuda] [--mixed off,on]
//
// Per budget (0: none, a --chunk prefill chunk beside every decode step, as `serve` without --step-tokens): a fresh
// engine (max_batch decoders + 1, no prefix cache), --decoders greedy requests with short prompts decode; once each has
// 4 tokens, a prompt of --long random tokens arrives (one new token). Every step's wall time is a decoder's
// inter-token gap (each decoding row gets one token a step); the figures are the gaps while the long prompt prefills
// (its arrival to its first token) — p50, p99, max — the gap outside that window (the decode step alone), and the
// long prompt's TTFT and steps (the second of two rounds on one engine: the first warms it up); and how the steps during the prefill split (p50 of each step's share, from the
// engine's own prefill / decode seconds; with the mixed step the decode rows ride in the prefill chunk's forward, so
// its time counts as prefill). --mixed: the scheduler's mixed step (BatchEngineOptions::mixed_step) off, on, or both
// (each budget run once per setting, side by side). --device cuda runs the GPU batched backend (runtime/device.h: the bf16
// weights uploaded once; the binary must link the CUDA device, as the CUDA build's does). It measures, asserts
// nothing.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "runtime/batch_engine.h"
#include "runtime/device.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

std::vector<int32_t> tokens(int32_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(100, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: batch_step_bench MODEL [--decoders N] [--long N] [--budgets a,b] [--chunk N] [--device D] "
                 "[--mixed off,on]\n");
    return 2;
  }
  std::string path = argv[1], device_name = "cpu";
  int decoders = 2, long_len = 4000, chunk = 2048;
  std::vector<int> budgets = {0, 256, 512};
  std::vector<bool> mixes = {false, true};
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--decoders") decoders = std::stoi(v);
    else if (k == "--long") long_len = std::stoi(v);
    else if (k == "--chunk") chunk = std::stoi(v);
    else if (k == "--device") device_name = v;
    else if (k == "--mixed") {
      mixes.clear();
      for (size_t p = 0; p <= v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        const std::string m = v.substr(p, q - p);
        if (m != "on" && m != "off") {
          std::fprintf(stderr, "batch_step_bench: --mixed takes off, on or off,on, got %s\n", v.c_str());
          return 2;
        }
        mixes.push_back(m == "on");
        p = q + 1;
      }
    }
    else if (k == "--budgets") {
      budgets.clear();
      for (size_t p = 0; p <= v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        budgets.push_back(std::stoi(v.substr(p, q - p)));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr, "batch_step_bench: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    const auto model = runtime::Model::load(path);
    const int32_t vocab = model->config().vocab_size;
    const auto device = runtime::open_device(device_name, *model);
    std::printf("model %s on %s; %d decoding requests, a prompt of %d tokens arriving; --chunk %d\n", path.c_str(),
                device->description().c_str(), decoders, long_len, chunk);
    std::printf("| step_tokens | mixed step | long prompt TTFT | its steps (mixed) | gap during its prefill p50 / p99 / max "
                "| of which prefill / decode p50 | gap otherwise p50 |\n");
    std::printf("|---|---|---:|---:|---:|---:|---:|\n");
    for (int budget : budgets)
    for (const bool mix : mixes) {
      const auto backend_ptr = device->batch_backend(runtime::EngineOptions{});
      runtime::BatchBackend& backend = *backend_ptr;
      runtime::BatchEngineOptions o;
      o.chunk_size = chunk;
      o.max_batch = decoders + 1;
      o.step_tokens = budget;
      o.prefix_cache = false;
      o.mixed_step = mix;
      runtime::BatchEngine engine(backend, o);
      // Round 0 warms the engine up (the GEMMs' and kernels' first use of these shapes, buffers grown, graphs
      // captured: a server pays that once); the figures are round 1's, the same requests again.
      std::vector<double> during, otherwise, during_prefill, during_decode;
      int steps = 0;
      int64_t mixed_steps = 0;
      double ttft = 0;
      for (int round = 0; round < 2; ++round) {
        during.clear(), otherwise.clear(), during_prefill.clear(), during_decode.clear();
        std::vector<int64_t> ids;
        for (int d = 0; d < decoders; ++d) {
          runtime::BatchRequest r;
          r.prompt = tokens(16, vocab, 10 + static_cast<uint32_t>(d));
          r.options.max_new_tokens = 2000;  // (cancelled below)
          ids.push_back(engine.submit(r));
        }
        int64_t got = 0;
        while (got < 4L * decoders)
          for (const auto& e : engine.step()) got += e.token >= 0 ? 1 : 0;
        runtime::BatchRequest lr;
        lr.prompt = tokens(long_len, vocab, 99);
        lr.options.max_new_tokens = 1;
        const auto t0 = Clock::now();
        const int64_t mixed0 = engine.stats().mixed_steps;
        const int64_t lid = engine.submit(lr);
        bool first = false;
        int after = 0;
        steps = 0;
        while (after < 8) {
          const auto s0 = Clock::now();
          const runtime::BatchEngineStats before = engine.stats();
          const auto events = engine.step();
          const double dt = std::chrono::duration<double>(Clock::now() - s0).count();
          (first ? otherwise : during).push_back(dt);
          if (!first) {
            during_prefill.push_back(engine.stats().prefill_seconds - before.prefill_seconds);
            during_decode.push_back(engine.stats().decode_seconds - before.decode_seconds);
          }
          if (!first) ++steps;
          if (!first) mixed_steps = engine.stats().mixed_steps - mixed0;
          for (const auto& e : events)
            if (e.id == lid && e.token >= 0) {
              first = true;
              ttft = std::chrono::duration<double>(Clock::now() - t0).count();
            }
          if (first) ++after;
        }
        for (int64_t id : ids) engine.cancel(id);
        engine.step();
      }
      std::printf("| %s | %s | %.3f s | %d (%lld) | %.2f / %.2f / %.2f ms | %.2f / %.2f ms | %.2f ms |\n",
                  budget ? std::to_string(budget).c_str() : "none", mix ? "on" : "off", ttft, steps,
                  static_cast<long long>(mixed_steps), pct(during, 0.5) * 1e3,
                  pct(during, 0.99) * 1e3, pct(during, 1.0) * 1e3, pct(during_prefill, 0.5) * 1e3,
                  pct(during_decode, 0.5) * 1e3, pct(otherwise, 0.5) * 1e3);
      std::fflush(stdout);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "batch_step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
