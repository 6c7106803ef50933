// tessera/core/buffer.h — aligned host memory.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

#include "core/error.h"

namespace tessera {

inline constexpr size_t kHostAlignment = 64;  // one cache line; enough for AVX-512 loads

struct AlignedFree {
  void operator()(void* p) const noexcept { std::free(p); }
};

// An owning, 64-byte-aligned, uninitialised byte buffer. Allocation failure throws tessera::Error.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    const size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    void* p = std::aligned_alloc(kHostAlignment, rounded);
    if (p == nullptr) throw Error("out of host memory: could not allocate " + std::to_string(bytes) + " bytes");
    data_.reset(p);
  }
  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<void, AlignedFree> data_;
  size_t size_ = 0;
};

}  // namespace tessera
