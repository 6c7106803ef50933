// tessera/runtime/cuda/pinned_buffer.h — an owning, typed, uninitialised page-locked host array (cudaHostAlloc),
// the host end of asynchronous copies.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // Exactly `count` elements; the old ones are dropped.
  void reset(size_t count) {
    release();
    TESSERA_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&data_), count * sizeof(T), cudaHostAllocDefault));
    size_ = count;
  }
  // At least `count` elements: when there are fewer, max(count, twice as many) new ones (the old are dropped).
  void grow(size_t count) {
    if (count > size_) reset(std::max(count, 2 * size_));
  }

  T* data() const { return data_; }
  size_t size() const { return size_; }
  T& operator[](size_t i) const { return data_[i]; }

 private:
  void release() {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tessera::runtime::gpu
