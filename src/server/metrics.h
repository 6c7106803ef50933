// tessera/server/metrics.h — the server's counters and histograms, rendered as Prometheus text (GET /metrics).
//
// Counters: requests by endpoint and HTTP status, prompt and generated tokens, cancelled and timed-out requests.
// Histograms (seconds): time to first token (from arrival, queueing included), inter-token latency, request
// duration; with the batched engine its steps' times (decode-only steps and steps carrying a prefill chunk apart) and
// the scheduler's time around each step. Gauges come from the scheduler at render time: queue depth, running requests, slots, KV cache
// tokens and bytes in use, and the process's resident memory. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tessera::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // "name_bucket{le=...} n" lines (cumulative), name_sum, name_count; `labels` (e.g. `kind="decode"`) go into
  // every line's braces, before le.
  void render(std::string& out, const std::string& name, const std::string& labels = "") const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last one is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct Gauges {
  int64_t queued = 0, running = 0, slots = 0;
  int64_t kv_tokens = 0, kv_bytes = 0;
  // The batched engine's counters (--parallel > 1; absent from /metrics otherwise): scheduler steps, steps that
  // decoded, tokens decoded, seconds in prefill chunks and in decode steps, decode step shapes built (CUDA graph
  // captures), the largest decode batch.
  bool batched = false;
  int64_t engine_steps = 0, decode_steps = 0, decode_tokens = 0, step_builds = 0, max_decode_batch = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  // Its prefix cache (runtime/prefix_cache.h): requests that adopted cached blocks, the prompt tokens they did not
  // prefill, cached blocks dropped for room, and the bytes of the blocks only the cache holds.
  int64_t prefix_hits = 0, prefix_cached_tokens = 0, prefix_evictions = 0, prefix_cache_bytes = 0;
  // The prompt token cache (prompt_tokens.h; any --parallel): prompts tokenized from a kept prompt's checkpoint, the
  // prompt bytes not tokenized again, and the bytes it holds.
  int64_t prompt_cache_hits = 0, prompt_cache_bytes_reused = 0, prompt_cache_bytes = 0;
};

// Resident set size of this process in bytes (from /proc/self/statm; 0 where unavailable).
int64_t resident_bytes();

class Metrics {
 public:
  Metrics();
  void count_request(const std::string& endpoint, int status);
  void add_tokens(int64_t prompt, int64_t generated);
  void count_cancelled();
  void count_timed_out();
  void observe_ttft(double seconds);
  void observe_inter_token(double seconds);
  void observe_request(double seconds);
  // The batched engine's step (--parallel > 1): the engine's wall time for it, whether it ran a prefill chunk (its
  // decode rows, if any, ride in that chunk's forward or follow it), and the scheduler's own time around it
  // (admitting requests, publishing the tokens, the counters) — what a decoding client waits for between tokens
  // besides the engine.
  void observe_step(double engine_seconds, bool prefill, double scheduler_seconds);
  std::string prometheus(const Gauges& gauges) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0, cancelled_ = 0, timed_out_ = 0;
  Histogram ttft_, inter_token_, request_;
  Histogram step_decode_, step_prefill_, step_scheduler_;
};

}  // namespace tessera::server
