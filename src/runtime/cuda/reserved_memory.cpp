#include "runtime/cuda/reserved_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"
#include "cuda/device_buffer.h"

namespace tessera::runtime::gpu {

namespace {

// The driver's VMM functions, from the runtime's entry point (null members: not available).
struct Vmm {
  PFN_cuDeviceGetAttribute_v2000 get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  bool complete() const {
    return get_attribute && granularity && address_reserve && address_free && create && release && map && unmap &&
           set_access && error_string;
  }
};

template <class F>
void entry(const char* name, unsigned version, F& fn) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &f, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    f = nullptr;
  }
  fn = reinterpret_cast<F>(f);
}

const Vmm& vmm() {
  static const Vmm v = [] {
    Vmm r;
    entry("cuDeviceGetAttribute", 2000, r.get_attribute);
    entry("cuMemGetAllocationGranularity", 10020, r.granularity);
    entry("cuMemAddressReserve", 10020, r.address_reserve);
    entry("cuMemAddressFree", 10020, r.address_free);
    entry("cuMemCreate", 10020, r.create);
    entry("cuMemRelease", 10020, r.release);
    entry("cuMemMap", 10020, r.map);
    entry("cuMemUnmap", 10020, r.unmap);
    entry("cuMemSetAccess", 10020, r.set_access);
    entry("cuGetErrorString", 6000, r.error_string);
    return r;
  }();
  return v;
}

std::string driver_error(CUresult r) {
  const char* s = nullptr;
  if (vmm().error_string == nullptr || vmm().error_string(r, &s) != CUDA_SUCCESS || s == nullptr)
    return "CUDA driver error " + std::to_string(static_cast<int>(r));
  return s;
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}


}  // namespace

ReservedMemory::~ReservedMemory() { release(); }

void ReservedMemory::reserve(size_t bytes) {
  release();
  if (bytes == 0) return;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device_));
  const Vmm& v = vmm();
  bool use_vmm = v.complete();
  if (const char* e = std::getenv("TESSERA_GPU_VMM"); e != nullptr && std::string(e) == "0") use_vmm = false;
  if (use_vmm) {
    int supported = 0;
    use_vmm = v.get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_) ==
                  CUDA_SUCCESS &&
              supported != 0;
  }
  size_t gran = 0;
  if (use_vmm) {
    const CUmemAllocationProp prop = device_prop(device_);
    use_vmm = v.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS && gran > 0;
  }
  if (!use_vmm) {
    // The fallback: one allocation, committed at once.
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("out of device memory: could not allocate " + format_bytes(static_cast<double>(bytes)) + " (" +
                  cudaGetErrorString(err) + "; " + attn::gpu::device_memory_state() + ")");
    }
    base_ = p;
    reserved_ = committed_ = chunk_ = bytes;
    vmm_ = false;
    return;
  }
  // Chunks of 64 MiB (~270 for a 17 GB pool; on an H200 a commit, cuMemCreate + cuMemMap + cuMemSetAccess, took 0.056
  // ms a chunk), or the whole reservation when it is smaller.
  chunk_ = (std::min(kMaxChunkBytes, bytes) + gran - 1) / gran * gran;
  reserved_ = (bytes + chunk_ - 1) / chunk_ * chunk_;
  CUdeviceptr ptr = 0;
  const CUresult r = v.address_reserve(&ptr, reserved_, gran, 0, 0);  // (an alignment must be a power of two)
  if (r != CUDA_SUCCESS) {
    reserved_ = chunk_ = 0;
    throw Error("device address space: could not reserve " + format_bytes(static_cast<double>(bytes)) + " (" +
                driver_error(r) + ")");
  }
  base_ = reinterpret_cast<void*>(ptr);
  vmm_ = true;
  handles_.assign(reserved_ / chunk_, 0);
}

void ReservedMemory::commit(size_t offset, size_t bytes) {
  if (!vmm_ || bytes == 0) return;
  if (offset > reserved_ || bytes > reserved_ - offset)
    throw Error("reserved device memory: commit of [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                ") past the " + std::to_string(reserved_) + " bytes reserved");
  const Vmm& v = vmm();
  const CUmemAllocationProp prop = device_prop(device_);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const auto base = reinterpret_cast<CUdeviceptr>(base_);
  for (size_t c = offset / chunk_; c <= (offset + bytes - 1) / chunk_; ++c) {
    if (handles_[c] != 0) continue;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = v.create(&h, chunk_, &prop, 0);
    if (r == CUDA_SUCCESS) {
      r = v.map(base + c * chunk_, chunk_, 0, h, 0);
      if (r == CUDA_SUCCESS) {
        r = v.set_access(base + c * chunk_, chunk_, &access, 1);
        if (r != CUDA_SUCCESS) v.unmap(base + c * chunk_, chunk_);
      }
      if (r != CUDA_SUCCESS) v.release(h);
    }
    if (r != CUDA_SUCCESS)
      throw Error("out of device memory: could not commit " + format_bytes(static_cast<double>(chunk_)) +
                  " more of the KV cache (" + format_bytes(static_cast<double>(committed_)) + " of " +
                  format_bytes(static_cast<double>(reserved_)) + " held; " + driver_error(r) + "; " +
                  attn::gpu::device_memory_state() + "); lower the KV budget or the max context");
    handles_[c] = h;
    committed_ += chunk_;
  }
}

void ReservedMemory::decommit_all(size_t keep_offset, size_t keep_bytes) {
  if (!vmm_) return;
  const Vmm& v = vmm();
  const auto base = reinterpret_cast<CUdeviceptr>(base_);
  const size_t k0 = keep_offset / chunk_, k1 = keep_bytes == 0 ? k0 : (keep_offset + keep_bytes - 1) / chunk_ + 1;
  for (size_t c = 0; c < handles_.size(); ++c) {
    if (handles_[c] == 0 || (c >= k0 && c < k1)) continue;
    v.unmap(base + c * chunk_, chunk_);
    v.release(handles_[c]);
    handles_[c] = 0;
    committed_ -= chunk_;
  }
}

void ReservedMemory::release() noexcept {
  if (base_ == nullptr) return;
  if (vmm_) {
    const Vmm& v = vmm();
    const auto base = reinterpret_cast<CUdeviceptr>(base_);
    cudaDeviceSynchronize();  // nothing in flight may read what is unmapped
    for (size_t c = 0; c < handles_.size(); ++c) {
      if (handles_[c] == 0) continue;
      v.unmap(base + c * chunk_, chunk_);
      v.release(handles_[c]);
    }
    v.address_free(base, reserved_);
  } else {
    cudaFree(base_);
  }
  (void)cudaGetLastError();
  base_ = nullptr;
  reserved_ = committed_ = chunk_ = 0;
  vmm_ = false;
  handles_.clear();
}

}  // namespace tessera::runtime::gpu
