#include "runtime/cuda/event_timer.h"

#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

EventTimer::~EventTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

cudaEvent_t EventTimer::event(size_t i) {
  while (pool_.size() <= i) {
    cudaEvent_t e = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  return pool_[i];
}

void EventTimer::begin(Kind kind, cudaStream_t stream) {
  if (!enabled_) return;
  if (used_ % 2 != 0) --used_;  // a begin without its end (an error in between): drop it
  TESSERA_CUDA_CHECK(cudaEventRecord(event(used_), stream));
  kinds_.resize(used_ / 2 + 1);
  kinds_[used_ / 2] = kind;
  ++used_;
}

void EventTimer::end(Kind kind, cudaStream_t stream) {
  if (!enabled_ || used_ % 2 == 0) return;  // no open begin
  (void)kind;
  TESSERA_CUDA_CHECK(cudaEventRecord(event(used_), stream));
  ++used_;
}

std::array<double, EventTimer::kKinds> EventTimer::collect() {
  std::array<double, kKinds> seconds{};
  if (used_ % 2 != 0) --used_;
  if (!enabled_ || used_ == 0) return seconds;
  TESSERA_CUDA_CHECK(cudaEventSynchronize(pool_[used_ - 1]));
  for (size_t p = 0; p + 1 < used_; p += 2) {
    float ms = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[p], pool_[p + 1]));
    seconds[static_cast<size_t>(kinds_[p / 2])] += ms / 1000.0;
  }
  used_ = 0;
  return seconds;
}

}  // namespace tessera::runtime::gpu
