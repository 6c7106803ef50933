#include "server/stream_serving.h"

#include "core/error.h"
#include "core/memory_budget.h"

namespace tessera::server {

int32_t streaming_context_limit(const runtime::ModelConfig& config, const runtime::StreamOptions& options,
                                runtime::StreamingKV::Storage storage, int32_t cap) {
  check(cap >= 1, "streaming_context_limit: cap must be positive");
  const runtime::StreamingKV probe(config, options, storage);
  const auto fits = [&probe](int64_t tokens) {
    try {
      probe.check_sequence(tokens);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  if (fits(cap)) return cap;
  // The evicted blocks grow with the length, so the tokens that fit are a prefix [1, limit]; 1 always fits (it
  // evicts nothing).
  int64_t lo = 1, hi = cap;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return static_cast<int32_t>(lo);
}

std::string describe_streaming(const runtime::StreamOptions& o, int64_t host_budget) {
  return std::string(runtime::stream_method_name(o.method)) + " (sinks " + std::to_string(o.sinks) + ", local " +
         std::to_string(o.local) + ", chunk " + std::to_string(o.chunk) + ", blocks of " + std::to_string(o.block) +
         (o.method == runtime::StreamMethod::StreamingLLM
              ? "; evicted blocks dropped: no host memory)"  // it never retrieves them (StreamingKV::keeps_evicted)
              : ", top " + std::to_string(o.top_k) + "; host budget " + format_bytes(static_cast<double>(host_budget)) +
                    ")");
}

}  // namespace tessera::server
