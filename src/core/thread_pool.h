// tessera/core/thread_pool.h — a fixed pool of worker threads with a blocking parallel_for.
//
// parallel_for(n, fn) calls fn(i, worker) for every i in [0, n) and returns when all calls are done. Work is
// handed out dynamically one index at a time (callers pass coarse items such as (head, query tile) pairs, ordered
// heaviest first when costs differ), so uneven items balance. The calling thread works too (worker 0). An
// exception thrown by fn is rethrown in the caller after the loop drains.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera {

class ThreadPool {
 public:
  // threads = 0 picks std::thread::hardware_concurrency() (or TESSERA_NUM_THREADS when set).
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  void parallel_for(int64_t n, const std::function<void(int64_t index, int worker)>& fn);

  // A process-wide pool, created on first use.
  static ThreadPool& global();

 private:
  void worker_loop(int worker);
  void run_items(int worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t job_size_ = 0;
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

}  // namespace tessera
