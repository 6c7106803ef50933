// perplexity_bench: the perplexity of a given token sequence on the CPU engine, for comparisons on exactly the
// same tokens (bench/llama_cpp_side_by_side.py --perplexity feeds it llama.cpp's tokenization of a text and compares
// with llama.cpp's own logits).
//
//   perplexity_bench MODEL IDS_FILE [--kv-type f32|bf16|f16] [--threads N] [--chunk N]
//
// IDS_FILE holds token ids separated by white space. Prints one JSON line: {"tokens", "scored", "nll" (mean negative
// log-likelihood, nats), "perplexity", "kv_type", "seconds"}. TESSERA_WEIGHTS=f32 loads the f32 expansion.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"

int main(int argc, char** argv) {
  using namespace tessera;
  try {
    if (argc < 3) {
      std::fprintf(stderr, "usage: %s MODEL IDS_FILE [--kv-type f32|bf16|f16] [--threads N] [--chunk N]\n", argv[0]);
      return 2;
    }
    runtime::EngineOptions eo;
    for (int i = 3; i + 1 < argc; i += 2) {
      const std::string k = argv[i], v = argv[i + 1];
      if (k == "--kv-type") {
        eo.kv_type = runtime::parse_kv_type(v);
      } else if (k == "--threads") {
        ThreadPool::set_global_threads(std::stoi(v));
      } else if (k == "--chunk") {
        eo.chunk_size = std::stoi(v);
      } else {
        throw Error("perplexity_bench: unknown option " + k);
      }
    }
    std::ifstream in(argv[2]);
    check(static_cast<bool>(in), std::string("perplexity_bench: cannot read ") + argv[2]);
    std::vector<int32_t> ids;
    for (int64_t x; in >> x;) ids.push_back(static_cast<int32_t>(x));
    check(ids.size() >= 2, "perplexity_bench: fewer than 2 token ids");
    const auto model = runtime::Model::load(argv[1]);
    eo.max_context = static_cast<int32_t>(ids.size());
    runtime::Engine engine(*model, eo);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<double> lp = engine.score(ids);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double nll = 0;
    for (double x : lp) nll -= x;
    nll /= static_cast<double>(lp.size());
    std::printf("{\"tokens\": %zu, \"scored\": %zu, \"nll\": %.9f, \"perplexity\": %.6f, \"kv_type\": \"%s\", "
                "\"seconds\": %.2f}\n",
                ids.size(), lp.size(), nll, std::exp(nll), std::string(runtime::kv_type_name(eo.kv_type)).c_str(),
                secs);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "perplexity_bench: %s\n", e.what());
    return 1;
  }
}
