// tessera/core/thread_pool.h — a fixed pool of worker threads with a blocking parallel_for.
//
// parallel_for(n, fn) calls fn(i, worker) for every i in [0, n) and returns when all calls are done. Work is
// handed out dynamically one index at a time (callers pass coarse items such as (head, query tile) pairs, ordered
// heaviest first when costs differ), so uneven items balance — also when another process takes part of a core. The
// calling thread works too (worker 0). An exception thrown by fn is rethrown in the caller after the loop drains.
//
// Waiting: a worker that finishes its items polls for the next loop for a short while (~50 us: a decode step issues
// loops back to back, and a futex wake-up costs tens of microseconds), yielding the core to other runnable threads
// while it polls, then sleeps on a condition variable; the caller waits for the last item the same way. A worker
// joins a loop only while items are left: once the caller has handed out every item it waits for the workers that
// joined, never for one the scheduler has not run yet (on a busy machine the caller does that share itself). So an
// idle pool takes no CPU, and a core taken by another process slows a loop down by that core's share, not by a
// scheduler time slice per loop.
//
// This is the one pool for tessera's CPU work: OpenBLAS is set to one thread (runtime/ops.h) and its products are
// split over this pool. Its size: the constructor's argument, else TESSERA_NUM_THREADS, else the hardware's threads
// (the command line's --threads sets the global pool's).
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

  // A process-wide pool, created on first use with set_global_threads()'s count (0 = the default above).
  static ThreadPool& global();
  // The size global() will have; must be called before its first use (else throws tessera::Error).
  static void set_global_threads(int threads);

 private:
  void worker_loop(int worker);
  void run_items(int worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int)>* job_ = nullptr;  // published by generation_
  int64_t job_size_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> gate_{0};    // [loop number: 32 bits][open: 1 bit][workers that entered: 31 bits]
  std::atomic<int> finished_{0};     // workers that entered the current loop and are done with it
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

}  // namespace tessera
