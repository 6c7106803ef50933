#include "server/scheduler.h"

#include <malloc.h>

#include <algorithm>
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

Job::Job(PreparedRequest request, std::shared_ptr<const attn::AttentionPolicy> policy, Clock::time_point deadline)
    : request_(std::move(request)), policy_(std::move(policy)), arrival_(Clock::now()), deadline_(deadline) {
  result_.prompt_tokens = static_cast<int64_t>(request_.prompt.size());
}

bool Job::wait(std::string& text, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return done_ || !pending_.empty(); });
  text += pending_;
  pending_.clear();
  return done_;
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
    const auto busy = std::count_if(running_.begin(), running_.end(), [](const auto& j) { return j != nullptr; });
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
  Gauges g;
  std::lock_guard<std::mutex> lock(mu_);
  g.queued = static_cast<int64_t>(queue_.size());
  g.slots = options_.slots;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]) ++g.running;
    g.kv_tokens += engines_[i]->kv_tokens();
    g.kv_bytes += engines_[i]->kv_bytes();
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

void Scheduler::run(int slot, Job& job) {
  JobResult r;
  r.slot = slot;
  const Clock::time_point start = Clock::now();
  r.queue_seconds = seconds(start - job.arrival_);
  if (job.cancelled()) {
    metrics_.count_cancelled();
    r.reason = FinishReason::Cancelled;
    job.finish(std::move(r));
    return;
  }
  if (start >= job.deadline_) {
    metrics_.count_timed_out();
    r.reason = FinishReason::Timeout;
    job.finish(std::move(r));
    return;
  }
  const PreparedRequest& req = job.request_;
  model::StreamingDecoder decoder(tokenizer_, {.skip_special = true});
  StopMatcher stop(req.stop);
  Clock::time_point last = start;
  std::optional<FinishReason> ended;  // set when on_token stops the generation
  auto on_token = [&](int32_t token) {
    const Clock::time_point now = Clock::now();
    if (r.completion_tokens == 0) {
      r.ttft_seconds = seconds(now - job.arrival_);
      metrics_.observe_ttft(r.ttft_seconds);
    } else {
      metrics_.observe_inter_token(seconds(now - last));
    }
    last = now;
    ++r.completion_tokens;
    job.emit(stop.push(decoder.push(token)));
    if (stop.stopped()) ended = FinishReason::Stop;
    else if (job.cancelled()) ended = FinishReason::Cancelled;
    else if (now >= job.deadline_) ended = FinishReason::Timeout;
    return !ended.has_value();
  };
  auto abort = [&] {
    if (job.cancelled()) ended = FinishReason::Cancelled;
    else if (Clock::now() >= job.deadline_) ended = FinishReason::Timeout;
    return ended.has_value();
  };
  try {
    const std::vector<int32_t> out =
        engines_[static_cast<size_t>(slot)]->generate(req.prompt, req.gen, *job.policy_, on_token, abort);
    if (ended) {
      r.reason = *ended;
    } else {
      // Not stopped by us: the token budget, or an end-of-generation token. (prepare_request keeps the budget
      // within the context, so a full context cannot end it first.)
      r.reason = static_cast<int32_t>(out.size()) >= req.gen.max_new_tokens ? FinishReason::Length : FinishReason::Stop;
      job.emit(stop.push(decoder.flush()));
      job.emit(stop.flush());
      if (stop.stopped()) r.reason = FinishReason::Stop;
    }
  } catch (const std::exception& e) {
    r.reason = FinishReason::Error;
    r.error = e.what();
  }
  if (r.reason == FinishReason::Cancelled) metrics_.count_cancelled();
  if (r.reason == FinishReason::Timeout) metrics_.count_timed_out();
  metrics_.add_tokens(r.prompt_tokens = static_cast<int64_t>(req.prompt.size()), r.completion_tokens);
  job.finish(std::move(r));
}

}  // namespace tessera::server
