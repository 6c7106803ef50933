// tessera/core/host_device.h — TESSERA_HOST_DEVICE marks a function the host code and CUDA kernels share:
// __host__ __device__ when nvcc compiles, nothing for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif
