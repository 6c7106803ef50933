#include "server/scheduler.h"

#include <malloc.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

#include "core/error.h"
#include "server/stop_matcher.h"

namespace tessera::server {

namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

JobResult cancelled_result() {
  JobResult r;
  r.reason = FinishReason::Cancelled;
  return r;
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Timeout: return "timeout";
    case FinishReason::Error: return "error";
  }
  return "error";
}

std::vector<runtime::TokenLogprobs> SlotEngine::prompt_logprobs(std::span<const int32_t>, int32_t,
                                                                 const attn::AttentionPolicy&,
                                                                 const std::function<bool()>&) {
  throw Error("the prompt's log-probabilities (echo with logprobs) are not available with this engine");
}

Job::Job(PreparedRequest request, std::shared_ptr<const attn::AttentionPolicy> policy, Clock::time_point deadline)
    : request_(std::move(request)), policy_(std::move(policy)), arrival_(Clock::now()), deadline_(deadline) {
  result_.prompt_tokens = static_cast<int64_t>(request_.prompt.size());
}

bool Job::wait(std::string& text, std::vector<runtime::TokenLogprobs>* logprobs, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return done_ || !pending_.empty() || !pending_logprobs_.empty(); });
  text += pending_;
  pending_.clear();
  if (logprobs)
    for (auto& l : pending_logprobs_) logprobs->push_back(std::move(l));
  pending_logprobs_.clear();
  return done_;
}

void Job::emit_logprobs(std::vector<runtime::TokenLogprobs> logprobs) {
  if (logprobs.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& l : logprobs) pending_logprobs_.push_back(std::move(l));
  }
  cv_.notify_all();
}

void Job::emit(const std::string& text) {
  if (text.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ += text;
  }
  cv_.notify_all();
}

void Job::finish(JobResult result) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    result.prompt_tokens = result_.prompt_tokens;
    result.total_seconds = seconds(Clock::now() - arrival_);
    result_ = std::move(result);
    done_ = true;
  }
  cv_.notify_all();
}

Scheduler::Scheduler(SchedulerOptions options, const SlotFactory& factory, const model::Tokenizer& tokenizer,
                     Metrics& metrics)
    : options_(options), tokenizer_(tokenizer), metrics_(metrics) {
  check(options_.slots >= 1, "--parallel must be at least 1, got " + std::to_string(options_.slots));
  check(options_.queue >= 0, "--queue must not be negative, got " + std::to_string(options_.queue));
  for (int i = 0; i < options_.slots; ++i) engines_.push_back(factory(i, options_.slots));
  running_.resize(static_cast<size_t>(options_.slots));
  for (int i = 0; i < options_.slots; ++i) threads_.emplace_back([this, i] { slot_loop(i); });
}

Scheduler::~Scheduler() {
  shutdown();
  for (auto& t : threads_) t.join();
}

void Scheduler::shutdown() {
  std::deque<std::shared_ptr<Job>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
    for (auto& job : running_)
      if (job) job->cancelled_ = true;
    for (auto& job : batch_running_) job->cancelled_ = true;
  }
  cv_.notify_all();
  for (auto& job : dropped) {
    job->cancelled_ = true;
    job->finish(cancelled_result());
  }
}

Admission Scheduler::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Admission::ShuttingDown;
    const auto busy = std::count_if(running_.begin(), running_.end(), [](const auto& j) { return j != nullptr; }) +
                      static_cast<int64_t>(batch_running_.size());
    if (static_cast<int64_t>(queue_.size()) + busy >= options_.slots + options_.queue) return Admission::QueueFull;
    queue_.push_back(job);
  }
  cv_.notify_one();
  return Admission::Accepted;
}

void Scheduler::cancel(const std::shared_ptr<Job>& job) {
  job->cancelled_ = true;
  bool was_queued = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) {
      queue_.erase(it);
      was_queued = true;
    }
  }
  if (was_queued) {
    metrics_.count_cancelled();
    job->finish(cancelled_result());
  }
}

Gauges Scheduler::gauges() const {
  std::lock_guard<std::mutex> lock(mu_);
  // Batched mode starts from the engine's counters after its last step (batch_counters_ sets nothing else).
  Gauges g = batched_.engine ? batch_counters_ : Gauges{};
  g.queued = static_cast<int64_t>(queue_.size());
  g.slots = options_.slots;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]) ++g.running;
    g.kv_tokens += engines_[i]->kv_tokens();
    g.kv_bytes += engines_[i]->kv_bytes();
  }
  if (batched_.engine) {
    g.running = static_cast<int64_t>(batch_running_.size());
    g.kv_tokens = batch_kv_tokens_.load();
    g.kv_bytes = batch_kv_bytes_.load();
    g.batched = true;
  }
  return g;
}

void Scheduler::slot_loop(int slot) {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      job = std::move(queue_.front());
      queue_.pop_front();
      running_[static_cast<size_t>(slot)] = job;
    }
    run(slot, *job);
    bool idle = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_[static_cast<size_t>(slot)].reset();
      idle = queue_.empty() &&
             std::all_of(running_.begin(), running_.end(), [](const auto& j) { return j == nullptr; });
    }
    // The request's engine and KV cache are gone; give the freed heap back to the system when nothing runs, so
    // the resident size returns to its baseline between bursts (glibc keeps freed arenas otherwise).
    if (idle) malloc_trim(0);
  }
}

// What a running job's tokens turn into: text through the streaming decoder and the stop sequences, TTFT and
// inter-token metrics, and whether to stop (a stop sequence, the client gone, the deadline). Shared by the slots and
// the batched engine.
class JobProgress {
 public:
  JobProgress(Job& job, const model::Tokenizer& tokenizer, Metrics& metrics, int slot)
      : job_(job), metrics_(metrics), decoder_(tokenizer, {.skip_special = true}), stop_(job.request_.stop) {
    r_.slot = slot;
    start_ = last_ = Clock::now();
    r_.queue_seconds = seconds(start_ - job.arrival_);
  }
  Job& job() { return job_; }
  // Before the engine starts: a cancelled or expired job ends here (true).
  bool ended_before_start() {
    if (job_.cancelled()) ended_ = FinishReason::Cancelled;
    else if (start_ >= job_.deadline_) ended_ = FinishReason::Timeout;
    if (!ended_) return false;
    finish();
    return true;
  }
  // A generated token; false: stop the generation (the reason is kept).
  bool on_token(int32_t token) {
    const Clock::time_point now = Clock::now();
    if (r_.completion_tokens == 0) {
      r_.ttft_seconds = seconds(now - job_.arrival_);
      metrics_.observe_ttft(r_.ttft_seconds);
    } else {
      metrics_.observe_inter_token(seconds(now - last_));
    }
    last_ = now;
    ++r_.completion_tokens;
    job_.emit(stop_.push(decoder_.push(token)));
    if (stop_.stopped()) ended_ = FinishReason::Stop;
    else if (job_.cancelled()) ended_ = FinishReason::Cancelled;
    else if (now >= job_.deadline_) ended_ = FinishReason::Timeout;
    return !ended_.has_value();
  }
  // Prompt tokens the engine took from its prefix cache.
  void cached(int64_t tokens) { r_.cached_tokens = tokens; }
  // A generated token's log-probabilities (before its on_token).
  void on_logprobs(const runtime::TokenLogprobs& l) { job_.emit_logprobs({l}); }
  // Echo: the prompt's text, and with logprobs its tokens' (the first with logprob NaN); not stop-matched.
  void echo(const std::vector<runtime::TokenLogprobs>* prompt_logprobs) {
    const PreparedRequest& req = job_.request_;
    if (prompt_logprobs) {
      std::vector<runtime::TokenLogprobs> all;
      all.push_back({req.prompt[0], std::numeric_limits<float>::quiet_NaN(), {}});
      all.insert(all.end(), prompt_logprobs->begin(), prompt_logprobs->end());
      job_.emit_logprobs(std::move(all));
    }
    job_.emit(req.echo_text);
  }
  // Between prefill chunks or steps: true when the client is gone or the deadline passed.
  bool should_abort() {
    if (!ended_) {
      if (job_.cancelled()) ended_ = FinishReason::Cancelled;
      else if (Clock::now() >= job_.deadline_) ended_ = FinishReason::Timeout;
    }
    return ended_.has_value();
  }
  // The engine ended the generation itself after `generated` tokens: the budget, or an end-of-generation token.
  void engine_ended(int64_t generated) {
    if (ended_) return;
    ended_ = generated >= job_.request_.gen.max_new_tokens ? FinishReason::Length : FinishReason::Stop;
    job_.emit(stop_.push(decoder_.flush()));
    job_.emit(stop_.flush());
    if (stop_.stopped()) ended_ = FinishReason::Stop;
  }
  void failed(const std::string& error) {
    ended_ = FinishReason::Error;
    r_.error = error;
  }
  void finish() {
    r_.reason = ended_.value_or(FinishReason::Error);
    if (r_.reason == FinishReason::Cancelled) metrics_.count_cancelled();
    if (r_.reason == FinishReason::Timeout) metrics_.count_timed_out();
    metrics_.add_tokens(r_.prompt_tokens = static_cast<int64_t>(job_.request_.prompt.size()), r_.completion_tokens);
    job_.finish(std::move(r_));
  }

 private:
  Job& job_;
  Metrics& metrics_;
  model::StreamingDecoder decoder_;
  StopMatcher stop_;
  JobResult r_;
  Clock::time_point start_, last_;
  std::optional<FinishReason> ended_;
};

void Scheduler::run(int slot, Job& job) {
  JobProgress p(job, tokenizer_, metrics_, slot);
  if (p.ended_before_start()) return;
  const PreparedRequest& req = job.request_;
  SlotEngine& engine = *engines_[static_cast<size_t>(slot)];
  try {
    if (req.echo) {
      if (req.gen.logprobs >= 0) {
        const std::vector<runtime::TokenLogprobs> lp =
            engine.prompt_logprobs(req.prompt, req.gen.logprobs, *job.policy_, [&] { return p.should_abort(); });
        if (p.should_abort()) {
          p.finish();
          return;
        }
        p.echo(&lp);
      } else {
        p.echo(nullptr);
      }
    }
    runtime::GenerateOptions gen = req.gen;
    if (gen.logprobs >= 0) gen.on_logprobs = [&](const runtime::TokenLogprobs& l) { p.on_logprobs(l); };
    std::vector<int32_t> out;
    if (gen.max_new_tokens > 0)
      out = engine.generate(req.prompt, gen, *job.policy_, [&](int32_t token) { return p.on_token(token); },
                            [&] { return p.should_abort(); });
    // (prepare_request keeps the budget within the context, so a full context cannot end it first.)
    p.engine_ended(static_cast<int64_t>(out.size()));
  } catch (const std::exception& e) {
    p.failed(e.what());
  }
  p.finish();
}

Scheduler::Scheduler(SchedulerOptions options, BatchedEngine batched, const model::Tokenizer& tokenizer,
                     Metrics& metrics)
    : options_(options), tokenizer_(tokenizer), metrics_(metrics), batched_(std::move(batched)) {
  check(options_.slots >= 1, "--parallel must be at least 1, got " + std::to_string(options_.slots));
  check(options_.queue >= 0, "--queue must not be negative, got " + std::to_string(options_.queue));
  check(batched_.engine != nullptr, "scheduler: no batched engine");
  threads_.emplace_back([this] { batch_loop(); });
}

void Scheduler::batch_loop() {
  runtime::BatchEngine& engine = *batched_.engine;
  struct Active {
    std::shared_ptr<Job> job;
    std::unique_ptr<JobProgress> progress;
    int64_t generated = 0;
    bool cancel_sent = false;
    bool prompt_only = false;  // echo with logprobs and max_tokens 0: one token asked of the engine, not reported
  };
  std::map<int64_t, Active> active;
  Clock::time_point iteration_start;
  Clock::duration previous_tail{};  // the last iteration's time after its step
  for (;;) {
    std::vector<std::shared_ptr<Job>> incoming;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !active.empty(); });
      iteration_start = Clock::now();
      stopping = stopping_;
      if (stopping && active.empty() && queue_.empty()) return;
      while (!queue_.empty() && static_cast<int>(active.size() + incoming.size()) < options_.slots) {
        incoming.push_back(std::move(queue_.front()));
        queue_.pop_front();
        batch_running_.push_back(incoming.back());
      }
    }
    auto done = [&](const std::shared_ptr<Job>& job) {
      std::lock_guard<std::mutex> lock(mu_);
      std::erase(batch_running_, job);
    };
    for (auto& job : incoming) {
      auto progress = std::make_unique<JobProgress>(*job, tokenizer_, metrics_, 0);
      if (progress->ended_before_start()) {
        done(job);
        continue;
      }
      // Echo with logprobs: the prompt's log-probabilities come from the engine's prefill (an event before the first
      // token's); the echo waits for them.
      const bool prompt_logprobs = job->request_.echo && job->request_.gen.logprobs >= 0;
      if (job->request_.echo && !prompt_logprobs) progress->echo(nullptr);
      if (job->request_.gen.max_new_tokens == 0 && !prompt_logprobs) {  // echo alone
        progress->engine_ended(0);
        progress->finish();
        done(job);
        continue;
      }
      runtime::BatchRequest br;
      br.prompt = job->request_.prompt;
      br.options = job->request_.gen;
      if (!job->policy_->table().empty()) br.policy = *job->policy_;
      const bool prompt_only = prompt_logprobs && br.options.max_new_tokens == 0;
      if (prompt_logprobs) br.prompt_logprobs = br.options.logprobs;
      if (prompt_only) br.options.max_new_tokens = 1;  // the engine samples at least one token; it is dropped
      try {
        const int64_t id = engine.submit(std::move(br));
        active.emplace(id, Active{job, std::move(progress), 0, false, prompt_only});
      } catch (const std::exception& e) {
        progress->failed(e.what());
        progress->finish();
        done(job);
      }
    }
    // The client gone, the deadline, a stop sequence, shutting down: the engine drops the request at its next step.
    for (auto& [id, a] : active) {
      if (stopping) a.job->cancelled_ = true;
      if (!a.cancel_sent && a.progress->should_abort()) {
        engine.cancel(id);
        a.cancel_sent = true;
      }
    }
    // The step's events to the requests' progress. A request the server stops (a stop sequence) is cancelled after
    // the step (the engine cannot be called from inside it, where a prompt's first token is published early) and
    // takes no more tokens meanwhile.
    std::vector<int64_t> cancel_after;
    const auto publish = [&](std::vector<runtime::BatchEvent>& events) {
      for (const runtime::BatchEvent& e : events) {
        const auto it = active.find(e.id);
        if (it == active.end()) continue;
        Active& a = it->second;
        if (e.cached_tokens >= 0) a.progress->cached(e.cached_tokens);
        if (e.prompt_logprobs) a.progress->echo(&*e.prompt_logprobs);
        if (e.token >= 0 && !a.prompt_only && !a.cancel_sent) {
          ++a.generated;
          if (e.logprobs) a.progress->on_logprobs(*e.logprobs);
          if (!a.progress->on_token(e.token)) {
            cancel_after.push_back(e.id);
            a.cancel_sent = true;
          }
        }
        if (!e.finished) continue;
        switch (e.reason) {
          case runtime::FinishReason::kError: a.progress->failed(e.error); break;
          case runtime::FinishReason::kCancelled: a.progress->should_abort(); break;  // the reason we cancelled for
          default: a.progress->engine_ended(a.generated); break;
        }
        a.progress->finish();
        done(a.job);
        active.erase(it);
      }
    };
    std::vector<runtime::BatchEvent> events;
    const int64_t chunks_before = engine.stats().prefill_chunks;
    const Clock::time_point step_start = Clock::now();
    Clock::time_point step_end;
    try {
      events = engine.step(publish);  // a prompt's first token before a decode step of its own
      step_end = Clock::now();
    } catch (const std::exception& e) {  // a bug check in the engine: every request in it ends with the error
      for (auto& [id, a] : active) {
        a.progress->failed(e.what());
        a.progress->finish();
        done(a.job);
      }
      active.clear();
      continue;
    }
    // The step's time beside the scheduler's own around it (/metrics: what a decoding client waits for): before
    // the step in this iteration, after the step in the last one. Observed before the events are published, so that
    // a request seen finished has its steps counted.
    metrics_.observe_step(seconds(step_end - step_start), engine.stats().prefill_chunks > chunks_before,
                          seconds((step_start - iteration_start) + previous_tail));
    publish(events);
    for (const int64_t id : cancel_after) engine.cancel(id);
    int64_t kv_tokens = 0;
    for (const auto& [id, a] : active) kv_tokens += a.job->request_.prompt.size() + a.generated;
    batch_kv_tokens_.store(active.empty() ? 0 : kv_tokens);
    batch_kv_bytes_.store(static_cast<int64_t>(engine.kv_bytes_in_use()));
    {
      const runtime::BatchEngineStats& st = engine.stats();
      std::lock_guard<std::mutex> lock(mu_);
      batch_counters_.engine_steps = st.steps;
      batch_counters_.decode_steps = st.decode_steps;
      batch_counters_.decode_tokens = st.decode_tokens;
      batch_counters_.prefill_seconds = st.prefill_seconds;
      batch_counters_.decode_seconds = st.decode_seconds;
      batch_counters_.step_builds = engine.step_builds();
      batch_counters_.max_decode_batch = st.max_decode_batch;
      batch_counters_.prefix_hits = st.prefix_hits;
      batch_counters_.prefix_cached_tokens = st.cached_tokens;
      batch_counters_.prefix_evictions = st.prefix_evictions;
      batch_counters_.prefix_cache_bytes = static_cast<int64_t>(engine.prefix_cache_bytes());
    }
    previous_tail = Clock::now() - step_end;
    if (active.empty()) {
      bool idle = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        idle = queue_.empty();
      }
      if (idle) malloc_trim(0);
    }
  }
}

}  // namespace tessera::server
