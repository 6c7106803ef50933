// Stand-in for the CUDA runtime header (host emulation, ../shim.h): the execution model and vector types come
// from the shim; the runtime API is declared only, for the real headers' host code (cuda/cuda_check.h,
// cuda/device_buffer.h), which the emulation never calls.
#pragma once

#include <cstddef>

#include "shim.h"

enum cudaError_t { cudaSuccess = 0 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
using cudaStream_t = struct CUstream_st*;
const char* cudaGetErrorName(cudaError_t);
const char* cudaGetErrorString(cudaError_t);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDevice(int*);
cudaError_t cudaDeviceGetAttribute(int*, cudaDeviceAttr, int);
cudaError_t cudaMalloc(void**, size_t);
cudaError_t cudaMemGetInfo(size_t*, size_t*);
cudaError_t cudaFree(void*);
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind);
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
