#include "server/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <variant>

namespace tessera::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), value);
  ++counts_[static_cast<size_t>(it - bounds_.begin())];
  sum_ += value;
  ++count_;
}

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// A metric with one unlabelled value: its header and its line.
template <class T>
void single(std::string& out, const std::string& name, const char* type, const char* help, T value) {
  header(out, name, type, help);
  out += name + " " + std::to_string(value) + "\n";
}

// A single-valued metric read from Gauges: its name, type, help and member (an integer or seconds).
struct GaugeMetric {
  const char* name;
  const char* type;
  const char* help;
  std::variant<int64_t Gauges::*, double Gauges::*> member;

  void write(std::string& out, const Gauges& g) const {
    std::visit([&](auto m) { single(out, name, type, help, g.*m); }, member);
  }
};

// The server's slots and KV caches, always present.
const GaugeMetric kSlotGauges[] = {
    {"tessera_queue_depth", "gauge", "Requests waiting for a slot.", &Gauges::queued},
    {"tessera_requests_running", "gauge", "Requests being generated.", &Gauges::running},
    {"tessera_slots", "gauge", "Sequences the server runs at once (--parallel).", &Gauges::slots},
    {"tessera_kv_cache_tokens", "gauge", "Tokens held in the KV caches of running requests.",
     &Gauges::kv_tokens},
    {"tessera_kv_cache_bytes", "gauge", "Bytes allocated for the KV caches of running requests.",
     &Gauges::kv_bytes},
    {"tessera_prompt_cache_hits_total", "counter", "Prompts tokenized from a kept prompt's ids (the rest only).",
     &Gauges::prompt_cache_hits},
    {"tessera_prompt_cache_reused_bytes_total", "counter", "Prompt text bytes not tokenized again.",
     &Gauges::prompt_cache_bytes_reused},
    {"tessera_prompt_cache_bytes", "gauge", "Bytes the prompt token cache holds (text, ids, checkpoints).",
     &Gauges::prompt_cache_bytes},
};

// The batched engine's counters and its prefix cache (Gauges::batched only).
const GaugeMetric kEngineGauges[] = {
    {"tessera_engine_steps_total", "counter", "Batched engine steps (a prefill chunk and/or a decode).",
     &Gauges::engine_steps},
    {"tessera_engine_decode_steps_total", "counter", "Batched engine steps that decoded.",
     &Gauges::decode_steps},
    {"tessera_engine_decode_tokens_total", "counter", "Tokens decoded (one per running sequence per step).",
     &Gauges::decode_tokens},
    {"tessera_engine_prefill_seconds_total", "counter", "Seconds spent in prefill chunks.",
     &Gauges::prefill_seconds},
    {"tessera_engine_decode_seconds_total", "counter", "Seconds spent in decode steps.",
     &Gauges::decode_seconds},
    {"tessera_engine_step_builds_total", "counter",
     "Decode step shapes built before running (CUDA graph captures; 0 on the CPU).", &Gauges::step_builds},
    {"tessera_engine_max_decode_batch", "gauge", "The largest decode batch so far.",
     &Gauges::max_decode_batch},
    {"tessera_prefix_cache_hits_total", "counter", "Requests that adopted cached KV blocks.",
     &Gauges::prefix_hits},
    {"tessera_prefix_cache_tokens_total", "counter",
     "Prompt tokens taken from the prefix cache instead of prefilled.", &Gauges::prefix_cached_tokens},
    {"tessera_prefix_cache_evictions_total", "counter", "Cached blocks dropped to make room.",
     &Gauges::prefix_evictions},
    {"tessera_prefix_cache_bytes", "gauge", "KV bytes of the blocks only the prefix cache holds.",
     &Gauges::prefix_cache_bytes},
};

}  // namespace

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string le = "_bucket{" + (labels.empty() ? "" : labels + ",") + "le=\"";
  const std::string own = labels.empty() ? " " : "{" + labels + "} ";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + le + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + le + "+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum" + own + number(sum_) + "\n";
  out += name + "_count" + own + std::to_string(count_) + "\n";
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

namespace {
const std::vector<double> kStepBounds = {0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006,
                                         0.008, 0.01, 0.015, 0.02, 0.04, 0.1, 0.25, 1, 5};
}  // namespace

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}),
      // Fine below 10 ms: a GPU decode step of a small model is 1-2 ms, and the load benches compare the inter-token
      // median with it.
      inter_token_({0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.04,
                    0.06, 0.08, 0.1, 0.25, 0.5, 1}),
      request_({0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}),
      step_decode_(kStepBounds), step_prefill_(kStepBounds), step_scheduler_(kStepBounds) {}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::add_tokens(int64_t prompt, int64_t generated) {
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(prompt);
  generated_tokens_ += static_cast<uint64_t>(generated);
}

void Metrics::count_cancelled() {
  std::lock_guard<std::mutex> lock(mu_);
  ++cancelled_;
}

void Metrics::count_timed_out() {
  std::lock_guard<std::mutex> lock(mu_);
  ++timed_out_;
}

void Metrics::observe_ttft(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(s);
}

void Metrics::observe_inter_token(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  inter_token_.observe(s);
}

void Metrics::observe_step(double engine_seconds, bool prefill, double scheduler_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  (prefill ? step_prefill_ : step_decode_).observe(engine_seconds);
  step_scheduler_.observe(scheduler_seconds);
}

void Metrics::observe_request(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  request_.observe(s);
}

std::string Metrics::prometheus(const Gauges& g) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  header(out, "tessera_requests_total", "counter", "HTTP requests answered, by endpoint and status.");
  for (const auto& [key, n] : requests_)
    out += "tessera_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(n) + "\n";
  single(out, "tessera_prompt_tokens_total", "counter", "Prompt tokens prefilled.", prompt_tokens_);
  single(out, "tessera_generation_tokens_total", "counter", "Tokens generated.", generated_tokens_);
  single(out, "tessera_requests_cancelled_total", "counter",
         "Requests whose client went away before the end.", cancelled_);
  single(out, "tessera_requests_timed_out_total", "counter", "Requests ended by the request timeout.",
         timed_out_);
  header(out, "tessera_time_to_first_token_seconds", "histogram",
         "From arrival to the first generated token.");
  ttft_.render(out, "tessera_time_to_first_token_seconds");
  header(out, "tessera_inter_token_latency_seconds", "histogram", "Between consecutive generated tokens.");
  inter_token_.render(out, "tessera_inter_token_latency_seconds");
  header(out, "tessera_request_duration_seconds", "histogram", "From arrival to the last token.");
  request_.render(out, "tessera_request_duration_seconds");
  if (step_scheduler_.count() > 0) {
    header(out, "tessera_engine_step_seconds", "histogram",
           "The batched engine's steps: kind=\"decode\" decode rows only, kind=\"prefill\" with a prefill chunk.");
    step_decode_.render(out, "tessera_engine_step_seconds", "kind=\"decode\"");
    step_prefill_.render(out, "tessera_engine_step_seconds", "kind=\"prefill\"");
    header(out, "tessera_scheduler_step_seconds", "histogram",
           "The scheduler's own time around each engine step (admission, publishing tokens, counters).");
    step_scheduler_.render(out, "tessera_scheduler_step_seconds");
  }
  for (const GaugeMetric& m : kSlotGauges) m.write(out, g);
  if (g.batched)
    for (const GaugeMetric& m : kEngineGauges) m.write(out, g);
  single(out, "tessera_process_resident_memory_bytes", "gauge", "Resident set size of the server process.",
         resident_bytes());
  return out;
}

}  // namespace tessera::server
