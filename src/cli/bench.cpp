// `tessera bench`: prefill rates at several depths, dense and each sparse policy from the same run, and decode
// rates at each depth, as one table (markdown, csv or json).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#include "eval/haystack.h"
#include "runtime/device.h"

namespace tessera::cli {

namespace {

struct Row {
  int depth = 0;
  std::string policy;
  double prefill_s = 0, attention_s = 0, gemm_s = 0;
  double decode_tok_s = 0;
  double speedup = 0;
  double peak_gb = -1;  // GPU: peak device memory in use
};

}  // namespace

int bench_command(const BenchOptions& o) {
  check_bench_options(o);
  const Session s = Session::open(o.model);
  const auto& c = s.model->config();
  const int max_depth = *std::max_element(o.depths.begin(), o.depths.end());
  // Streaming rows read past the model's context; the other rows run only at depths within it.
  check(max_depth <= c.context_length || !o.stream.methods.empty(),
        "bench: depth " + std::to_string(max_depth) + " exceeds the model's context of " +
            std::to_string(c.context_length));
  check(o.decode_tokens < c.context_length, "bench: --decode must be smaller than the model's context");
  const std::vector<int32_t> tokens = bench_tokens(s, max_depth + o.decode_tokens);
  std::vector<std::string> policies = {"dense"};
  policies.insert(policies.end(), o.attn.begin(), o.attn.end());
  for (const std::string& m : o.stream.methods) policies.push_back(stream_label(m));
  const bool gpu = use_gpu_device_for(o.device, o.stream);
  const attn::gpu::CudaAttentionOptions cuda_options = cuda_attention_options(o.cuda, gpu);
  const bool fp8 = gpu && gemm_fp8(o.cuda);
  const bool w4 = gpu && gemm_w4(o.cuda);
  const bool fp8_kv = kv_fp8(gpu);
  const std::unique_ptr<runtime::Device> device = runtime::open_device(gpu ? "cuda" : "cpu", *s.model);
  std::vector<Row> rows;
  for (int depth : o.depths) {
    double dense_s = 0;
    for (const std::string& spec : policies) {
      const std::string method = stream_method_of(spec);
      if (method.empty() && depth > c.context_length) continue;  // past the context: streaming rows only
      Row r;
      r.depth = depth;
      r.policy = spec;
      r.prefill_s = 1e30;
      runtime::EngineOptions eo;
      eo.chunk_size = o.chunk;
      if (method.empty())
        eo.policy = s.policy(spec);
      else
        eo.stream = stream_options(o.stream, method, gpu);
      eo.gpu.cuda_attention = cuda_options;
      eo.gpu.fp8_gemm = fp8;
      eo.gpu.w4_decode = w4;
      eo.gpu.fp8_kv = fp8_kv;
      const std::unique_ptr<runtime::SequenceEngine> engine_ptr = device->engine(eo);
      runtime::SequenceEngine& engine = *engine_ptr;
      for (int rep = 0; rep < std::max(1, o.reps); ++rep) {  // best of reps
        engine.reset();
        engine.reset_stats();
        engine.reset_peak_memory();
        engine.prefill(std::span<const int32_t>(tokens.data(), static_cast<size_t>(depth)));
        if (engine.stats().prefill_seconds < r.prefill_s) {
          r.prefill_s = engine.stats().prefill_seconds;
          r.attention_s = engine.stats().attention_seconds;
          r.gemm_s = engine.stats().gemm_seconds;
          if (engine.peak_device_bytes() >= 0) r.peak_gb = engine.peak_device_bytes() / 1e9;
        }
      }
      if (!method.empty()) {  // streaming: decode continues past the depth (no context to stay within)
        engine.reset_stats();
        for (int i = 0; i < o.decode_tokens; ++i) engine.decode(tokens[static_cast<size_t>(engine.position())]);
        r.decode_tok_s = engine.stats().decode_tokens_per_second();
      }
      if (spec == "dense") {
        dense_s = r.prefill_s;
        // Decode at this depth: the last decode_tokens positions of the context when the depth reaches its end.
        const int start = std::min(depth, c.context_length - o.decode_tokens);
        if (start < depth) {
          engine.reset();
          engine.prefill(std::span<const int32_t>(tokens.data(), static_cast<size_t>(start)));
        }
        engine.reset_stats();
        for (int i = 0; i < o.decode_tokens; ++i) engine.decode(tokens[static_cast<size_t>(engine.position())]);
        r.decode_tok_s = engine.stats().decode_tokens_per_second();
      }
      r.speedup = dense_s > 0 ? dense_s / r.prefill_s : 0;
      rows.push_back(r);
      std::fprintf(stderr, "bench: depth %d %s: prefill %.2f s\n", depth, spec.c_str(), r.prefill_s);
    }
  }
  if (o.format == "json") {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : rows) {
      j.push_back({{"model", c.name}, {"depth", r.depth}, {"policy", r.policy}, {"prefill_s", r.prefill_s},
                   {"prefill_tok_s", r.depth / r.prefill_s}, {"attention_s", r.attention_s}, {"gemm_s", r.gemm_s},
                   {"speedup_vs_dense", r.speedup}, {"decode_tok_s", r.decode_tok_s},
                   {"device", gpu ? "cuda" : "cpu"}});
      if (r.peak_gb >= 0) j.back()["peak_device_gb"] = r.peak_gb;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  const bool csv = o.format == "csv";
  if (csv) {
    std::printf("model,depth,policy,prefill_s,prefill_tok_s,attention_s,gemm_s,speedup_vs_dense,decode_tok_s%s\n",
                gpu ? ",peak_device_gb" : "");
  } else {
    std::printf("model: %s, %d layers, %d/%d heads, head dim %d; chunk %d; best of %d; device %s\n\n", c.name.c_str(),
                c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim, o.chunk, std::max(1, o.reps),
                gpu ? "cuda (bf16; attention and GEMM s are GPU time)" : "cpu");
    std::printf("| depth | policy | prefill s | prefill tok/s | attention s | GEMM s | vs dense | decode tok/s |%s\n",
                gpu ? " peak GB |" : "");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|%s\n", gpu ? "---:|" : "");
  }
  for (const Row& r : rows) {
    const std::string decode = r.decode_tok_s > 0 ? std::to_string(r.decode_tok_s).substr(0, 5) : (csv ? "" : "-");
    if (csv) {
      std::printf("%s,%d,%s,%.3f,%.1f,%.3f,%.3f,%.2f,%s", c.name.c_str(), r.depth, r.policy.c_str(), r.prefill_s,
                  r.depth / r.prefill_s, r.attention_s, r.gemm_s, r.speedup, decode.c_str());
      if (gpu) std::printf(",%.2f", r.peak_gb);
      std::printf("\n");
    } else {
      const std::string vs = r.speedup > 0 ? std::to_string(r.speedup).substr(0, 4) + "x" : "-";
      std::printf("| %d | %s | %.2f | %.0f | %.2f | %.2f | %s | %s |", r.depth, r.policy.c_str(), r.prefill_s,
                  r.depth / r.prefill_s, r.attention_s, r.gemm_s, vs.c_str(), decode.c_str());
      if (gpu) std::printf(" %.2f |", r.peak_gb);
      std::printf("\n");
    }
  }
  return 0;
}

}  // namespace tessera::cli
