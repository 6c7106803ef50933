// tessera/cuda/device_buffer.h — an owning, typed, uninitialised device allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_check.h"

namespace tessera::attn::gpu {

// "1.23 GB free of 79.6 GB" for the current device (or why it cannot be told), for out-of-memory messages.
inline std::string device_memory_state() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return "free device memory unknown";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GB free of %.1f GB", static_cast<double>(free_bytes) / 1e9,
                static_cast<double>(total_bytes) / 1e9);
  return buf;
}

// cudaMalloc'd array of `size` elements of T (trivially copyable). Move-only. Allocation failure throws
// tessera::Error naming the size.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { resize(count); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }

  // Discards the contents; keeps the allocation when it is already large enough.
  void resize(size_t count) {
    if (count <= capacity_) {
      size_ = count;
      return;
    }
    release();
    if (count == 0) return;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, count * sizeof(T));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("out of device memory: could not allocate " + std::to_string(count * sizeof(T)) + " bytes (" +
                  cudaGetErrorString(err) + "; " + device_memory_state() + ")");
    }
    data_ = static_cast<T*>(p);
    size_ = capacity_ = count;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

  void upload(const T* host, size_t count, cudaStream_t stream = nullptr) {
    resize(count);
    if (count)
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(data_, host, count * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  void upload(const std::vector<T>& host, cudaStream_t stream = nullptr) {
    upload(host.data(), host.size(), stream);
  }
  // Synchronous copy of the first `count` elements (all when count is npos).
  std::vector<T> download(size_t count = static_cast<size_t>(-1)) const {
    if (count == static_cast<size_t>(-1)) count = size_;
    std::vector<T> host(count);
    if (count) TESSERA_CUDA_CHECK(cudaMemcpy(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void release() noexcept {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    size_ = capacity_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace tessera::attn::gpu
