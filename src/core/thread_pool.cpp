#include "core/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace tessera {

namespace {

std::atomic<int> g_global_threads{0};
std::atomic<bool> g_global_made{false};

// Polls `done` for up to ~50 us: pause instructions first, then yielding the core (another process may want it).
template <class F>
bool spin_until(F&& done) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    if (done()) return true;
    if (i < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    if ((i & 15) == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(50)) return done();
    std::this_thread::yield();
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) {
    if (const char* env = std::getenv("TESSERA_NUM_THREADS")) threads = std::atoi(env);
    if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
    if (threads <= 0) threads = 1;
  }
  for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::set_global_threads(int threads) {
  if (g_global_made.load()) {
    if (threads == global().size() || (threads <= 0)) return;
    throw Error("the thread pool is already running with " + std::to_string(global().size()) +
                " threads; set its size before the first parallel work");
  }
  g_global_threads.store(threads);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    g_global_made.store(true);
    return g_global_threads.load();
  }());
  return pool;
}

void ThreadPool::run_items(int worker) {
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= job_size_) return;
    try {
      (*job_)(i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(job_size_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

// A worker that wakes for loop g enters it only while the loop is open (gate_ holds g, the open bit and how many
// workers entered); the caller closes the loop once every item is handed out and then waits for the workers that
// entered, never for one that was not scheduled in time: on a busy machine the caller does their share itself.
namespace {
constexpr uint64_t kOpen = uint64_t{1} << 31;
constexpr uint64_t kEntered = kOpen - 1;
}  // namespace

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    auto ready = [&] {
      return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
    };
    if (!spin_until(ready)) {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, ready);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    uint64_t g = gate_.load(std::memory_order_acquire);
    bool entered = false;
    while ((g >> 32) == (seen & 0xffffffffu) && (g & kOpen) != 0) {
      if (gate_.compare_exchange_weak(g, g + 1, std::memory_order_acq_rel)) {
        entered = true;
        break;
      }
    }
    if (!entered) continue;  // too late for that loop: its caller has done the items
    run_items(worker);
    finished_.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its wait
    }
    done_cv_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  job_ = &fn;
  job_size_ = n;
  next_.store(0, std::memory_order_relaxed);
  error_ = nullptr;
  finished_.store(0, std::memory_order_relaxed);
  const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
  gate_.store(((g & 0xffffffffu) << 32) | kOpen, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mu_);  // a worker may be between its check and its wait
    generation_.store(g, std::memory_order_release);
  }
  start_cv_.notify_all();
  run_items(0);
  // Every item is handed out: close the loop, then wait for the workers inside it.
  const auto entered = static_cast<int>(gate_.fetch_and(~kOpen, std::memory_order_acq_rel) & kEntered);
  auto done = [&] { return finished_.load(std::memory_order_acquire) >= entered; };
  if (!spin_until(done)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, done);
  }
  job_ = nullptr;
  std::exception_ptr err = error_;
  error_ = nullptr;
  if (err) std::rethrow_exception(err);
}

}  // namespace tessera
