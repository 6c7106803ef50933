// tessera/cuda/cuda_check.h — CUDA runtime errors as tessera::Error.
//
// Every CUDA call of the backend goes through TESSERA_CUDA_CHECK, and every kernel launch is followed by
// check_launch(what), so that a failure names the call and the kernel instead of surfacing later as a wrong
// number.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core/error.h"

namespace tessera::attn::gpu {

inline void cuda_check(cudaError_t err, const char* expr, const char* file, int line) {
  if (err != cudaSuccess) {
    throw Error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                ") in " + expr + " at " + file + ":" + std::to_string(line));
  }
}

// Checks the launch configuration of the kernel just launched (not its completion).
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(std::string("CUDA kernel launch failed: ") + what + ": " + cudaGetErrorName(err) + " (" +
                cudaGetErrorString(err) + ")");
  }
}

// Multiprocessor count and opt-in shared memory per block of the current device (cached per device).
struct DeviceInfo {
  int device = 0;
  int num_sms = 0;
  int max_smem_per_block = 0;  // opt-in limit, bytes
};
inline const DeviceInfo& current_device_info() {
  static thread_local DeviceInfo cached[16];
  static thread_local bool filled[16] = {};
  int dev = 0;
  cuda_check(cudaGetDevice(&dev), "cudaGetDevice(&dev)", __FILE__, __LINE__);
  if (dev < 0 || dev >= 16) throw Error("CUDA device number " + std::to_string(dev) + " is out of range");
  if (!filled[dev]) {
    DeviceInfo& info = cached[dev];
    info.device = dev;
    cuda_check(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(MultiProcessorCount)", __FILE__, __LINE__);
    cuda_check(cudaDeviceGetAttribute(&info.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)", __FILE__, __LINE__);
    filled[dev] = true;
  }
  return cached[dev];
}

}  // namespace tessera::attn::gpu

#define TESSERA_CUDA_CHECK(expr) ::tessera::attn::gpu::cuda_check((expr), #expr, __FILE__, __LINE__)
