// tessera/runtime/cuda/reserved_memory.h — device memory whose address range is reserved up front and backed by
// physical memory only where it is used (CUDA's virtual memory management: cuMemAddressReserve, cuMemCreate,
// cuMemMap), so a large buffer keeps one base address for its whole life yet holds only the memory of the parts
// written so far.
//
//   ReservedMemory pool;
//   pool.reserve(17e9);              // address space only
//   pool.commit(offset, bytes);      // backs [offset, offset + bytes) (whole chunks), idempotent
//   kernel<<<...>>>(pool.data());    // reads and writes inside committed ranges only
//   pool.decommit_all(keep_offset, keep_bytes);  // gives the memory back, except the chunks of one range
//
// The paged KV pool of the batched GPU engine (batch_gpu.h) is one: a pool sized for the KV budget costs nothing
// until blocks are written, so a single sequence's prefill, which stages its keys contiguously and moves them into
// the blocks a layer at a time, holds its KV once, not twice (issue 32).
//
// Commits go in chunks (64 MiB or the whole reservation, rounded to the device's allocation granularity, 2 MiB on
// Hopper); an address outside a committed chunk faults in a kernel, so every writer commits first. Where the
// device or driver lacks VMM
// (TESSERA_GPU_VMM=0 forces this), reserve() allocates the whole range with cudaMalloc and commit() does nothing.
// The driver functions come through the runtime's entry point: nothing links against libcuda. Not thread-safe;
// the current device's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::runtime::gpu {

class ReservedMemory {
 public:
  ReservedMemory() = default;
  ~ReservedMemory();
  ReservedMemory(const ReservedMemory&) = delete;
  ReservedMemory& operator=(const ReservedMemory&) = delete;

  // Releases what is held, then reserves `bytes` of address space (rounded up to whole chunks). Throws
  // tessera::Error when the address space (or, without VMM, the memory) cannot be had.
  void reserve(size_t bytes);
  // Backs the chunks that [offset, offset + bytes) touches with device memory. Throws tessera::Error naming the
  // bytes and the free device memory when the device has none left (nothing committed before is lost).
  void commit(size_t offset, size_t bytes);
  // Unmaps and frees every chunk except those [keep_offset, keep_offset + keep_bytes) touches. The caller must know
  // that nothing in flight reads the rest (synchronise first).
  void decommit_all(size_t keep_offset = 0, size_t keep_bytes = 0);
  void release() noexcept;

  // The largest chunk a commit maps (smaller reservations are one chunk).
  static constexpr size_t kMaxChunkBytes = size_t{64} << 20;

  void* data() const { return base_; }
  size_t reserved_bytes() const { return reserved_; }
  size_t committed_bytes() const { return committed_; }
  size_t chunk_bytes() const { return chunk_; }
  // Whether the range is backed lazily (false: the cudaMalloc fallback, everything committed at reserve()).
  bool lazy() const { return vmm_; }

 private:
  void* base_ = nullptr;
  size_t reserved_ = 0, committed_ = 0, chunk_ = 0;
  bool vmm_ = false;
  int device_ = 0;
  std::vector<unsigned long long> handles_;  // per chunk: its physical allocation (CUmemGenericAllocationHandle), 0 if none
};

}  // namespace tessera::runtime::gpu
