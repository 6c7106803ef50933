// tessera/server/scheduler.h — requests waiting for and running on a fixed set of engine slots.
//
//   Scheduler sched({.slots = 2, .queue = 16}, factory, tokenizer, metrics);
//   auto job = std::make_shared<Job>(std::move(prepared), policy, deadline);
//   if (sched.submit(job) != Admission::Accepted) -> 429 / 503
//   std::string text;
//   while (!job->wait(text, 100ms)) send(text);   // text so far; a disconnected client: sched.cancel(job)
//   job->result();                                 // finish reason, token counts, timings
//
// Each slot is one thread driving one SlotEngine (today: a runtime::Engine, or the GPU engine, made per request
// with the request's attention policy, so its KV cache is freed when the request ends). Jobs wait in a bounded
// FIFO; submit() refuses a job when every slot is busy and the queue is full. Between tokens the slot turns ids
// into text (StreamingDecoder), applies stop sequences (StopMatcher) and checks the job's cancel flag and
// deadline, so a cancelled or timed-out request frees its slot and KV cache after at most one more token, or
// one more prefill chunk while it prefills.
//
// With the batched engine (runtime/batch_engine.h; `tessera serve --parallel N`, N > 1) there are no slots: one
// thread drives one BatchEngine, moving up to `slots` jobs from the queue into it (it admits them by KV memory and
// runs them with continuous batching: one decode token of every running request per step, prefill chunks in
// between); the same per-token work as a slot's, and cancellation / deadlines / stop sequences become
// BatchEngine::cancel, which frees the request's blocks at the next step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "attention/pattern/policy.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/batch_engine.h"
#include "runtime/generation.h"
#include "server/metrics.h"
#include "server/request_prep.h"

namespace tessera::server {

using Clock = std::chrono::steady_clock;

// One sequence at a time. generate() runs on the slot's thread only; kv_tokens() / kv_bytes() may be read from
// any thread.
class SlotEngine {
 public:
  virtual ~SlotEngine() = default;
  // As runtime::Engine::generate on a fresh sequence under `policy`; on_token returning false stops it. `abort`
  // is asked between prefill chunks: true ends the request there (an empty result).
  virtual std::vector<int32_t> generate(std::span<const int32_t> prompt, const runtime::GenerateOptions& options,
                                        const attn::AttentionPolicy& policy,
                                        const std::function<bool(int32_t)>& on_token,
                                        const std::function<bool()>& abort) = 0;
  // For i in [1, prompt.size()): the log-probability of prompt[i] after prompt[0..i) and its `top` most likely
  // alternatives (runtime::token_logprobs), on a fresh sequence under `policy`; `abort` is asked between pieces
  // (true: an empty result). The echo of /v1/completions with logprobs. This default throws tessera::Error ("the
  // prompt's log-probabilities (echo with logprobs) are not available with this engine").
  virtual std::vector<runtime::TokenLogprobs> prompt_logprobs(std::span<const int32_t> prompt, int32_t top,
                                                              const attn::AttentionPolicy& policy,
                                                              const std::function<bool()>& abort);
  int64_t kv_tokens() const { return kv_tokens_.load(std::memory_order_relaxed); }
  int64_t kv_bytes() const { return kv_bytes_.load(std::memory_order_relaxed); }

 protected:
  std::atomic<int64_t> kv_tokens_{0}, kv_bytes_{0};
};

// Slot `index` of `count`: makes that slot's engine (called once per slot, on the constructing thread).
using SlotFactory = std::function<std::unique_ptr<SlotEngine>(int index, int count)>;

// The batched engine behind a scheduler: the engine and the backend it runs on (which must outlive it).
struct BatchedEngine {
  std::unique_ptr<runtime::BatchBackend> backend;
  std::unique_ptr<runtime::BatchEngine> engine;
};

enum class FinishReason { Stop, Length, Cancelled, Timeout, Error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "timeout", "error"

struct JobResult {
  FinishReason reason = FinishReason::Error;
  std::string error;  // FinishReason::Error: the engine's message
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // tokens sampled (a stop sequence's tokens included, the end token not)
  int64_t cached_tokens = 0;      // prompt tokens the batched engine took from its prefix cache (not prefilled)
  double queue_seconds = 0;       // arrival to slot
  double ttft_seconds = -1;       // arrival to first token; -1: none
  double total_seconds = 0;       // arrival to the end
  int slot = -1;
};

class Job {
 public:
  Job(PreparedRequest request, std::shared_ptr<const attn::AttentionPolicy> policy, Clock::time_point deadline);

  // Waits up to `timeout` for news. Appends the text produced since the last call to `text` (and, when
  // `logprobs` is given, the tokens' log-probabilities: with echo the prompt's first, whose first token has
  // logprob NaN, nothing predicting it); returns true once the job has ended and all its text was handed out
  // (then result() is final).
  bool wait(std::string& text, std::chrono::milliseconds timeout) { return wait(text, nullptr, timeout); }
  bool wait(std::string& text, std::vector<runtime::TokenLogprobs>* logprobs, std::chrono::milliseconds timeout);
  bool cancelled() const { return cancelled_.load(); }
  const JobResult& result() const { return result_; }
  const PreparedRequest& request() const { return request_; }
  Clock::time_point arrival() const { return arrival_; }

 private:
  friend class Scheduler;
  friend class JobProgress;
  void emit(const std::string& text);
  void emit_logprobs(std::vector<runtime::TokenLogprobs> logprobs);
  void finish(JobResult result);

  PreparedRequest request_;
  std::shared_ptr<const attn::AttentionPolicy> policy_;
  Clock::time_point arrival_, deadline_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::string pending_;
  std::vector<runtime::TokenLogprobs> pending_logprobs_;
  bool done_ = false;
  JobResult result_;
};

struct SchedulerOptions {
  int slots = 1;   // sequences generated at once (--parallel)
  int queue = 16;  // jobs that may wait for a slot beyond those (--queue)
};

enum class Admission { Accepted, QueueFull, ShuttingDown };

class Scheduler {
 public:
  // Makes the slots' engines with `factory` and starts their threads. `tokenizer` and `metrics` must outlive it.
  Scheduler(SchedulerOptions options, const SlotFactory& factory, const model::Tokenizer& tokenizer,
            Metrics& metrics);
  // One batched engine (options.slots: the most requests in it at once) driven by one thread.
  Scheduler(SchedulerOptions options, BatchedEngine batched, const model::Tokenizer& tokenizer, Metrics& metrics);
  ~Scheduler();  // cancels what is queued or running and joins the slots
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  Admission submit(const std::shared_ptr<Job>& job);
  // The client is gone: a queued job ends at once (FinishReason::Cancelled), a running one at its next token.
  void cancel(const std::shared_ptr<Job>& job);
  // Stops accepting jobs and cancels every queued and running one (the destructor does this too).
  void shutdown();

  Gauges gauges() const;
  const SchedulerOptions& options() const { return options_; }
  bool batched() const { return batched_.engine != nullptr; }  // the batched engine
  // Whether echo with logprobs (the prompt's log-probabilities) can be served: the slots' engines, or the batched
  // engine where it gives every prompt row's logits (not with streaming memory).
  bool prompt_logprobs() const { return !batched() || batched_.engine->supports_prompt_logprobs(); }

 private:
  void slot_loop(int slot);
  void run(int slot, Job& job);
  void batch_loop();

  SchedulerOptions options_;
  const model::Tokenizer& tokenizer_;
  Metrics& metrics_;
  std::vector<std::unique_ptr<SlotEngine>> engines_;
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> running_;  // per slot; null when idle
  bool stopping_ = false;
  BatchedEngine batched_;                            // batched mode: the engine (slots_ and engines_ empty)
  std::vector<std::shared_ptr<Job>> batch_running_;  // batched mode: the jobs in the engine
  std::atomic<int64_t> batch_kv_tokens_{0}, batch_kv_bytes_{0};
  Gauges batch_counters_;  // batched mode: the engine's counters after the last step (under mu_)
};

}  // namespace tessera::server
