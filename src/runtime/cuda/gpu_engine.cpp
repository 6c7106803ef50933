#include "runtime/cuda/gpu_engine.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdio>
#include <string>
#include <utility>

#include "core/error.h"

namespace tessera::runtime::gpu {

bool gpu_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

std::string gpu_description() {
  int device = 0;
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(err) + ")";
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, " (sm_%d%d, %d SMs, %.1f GB)", prop.major, prop.minor, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / 1e9);
  return std::string(prop.name) + buf;
}

GpuBatchOptions batch_options(const GpuEngineOptions& o) {
  GpuBatchOptions b;
  b.prefill.mlp_chunk = o.mlp_chunk;
  b.prefill.tile = o.tile;
  b.prefill.attention = o.attention;
  b.prefill.dense_fallback = o.dense_fallback;
  b.prefill.cuda_attention = o.cuda_attention;
  b.graphs = o.decode_graphs;
  b.gemm = o.gemm;
  b.decode_gemm = o.gemm;  // the single-sequence engine's FP8 runs its decode in FP8 too (as before the scheduler)
  b.timing = o.timing;
  b.kv = o.kv;
  return b;
}

namespace {

EngineOptions engine_options(const GpuEngineOptions& o) {
  check(o.max_context >= 0, "GPU engine: max_context must not be negative");
  EngineOptions e;
  e.chunk_size = o.chunk_size > 0 ? o.chunk_size : INT32_MAX;  // <= 0: the whole prompt in one chunk
  e.policy = o.policy;
  e.max_context = o.max_context;
  e.stream = o.stream;
  return e;
}

// Rows of logits per chunk of forward_all_logits / score: [2,048, vocab] f32 at most on the device and the host.
constexpr int32_t kLogitsChunk = 2048;

}  // namespace

GpuEngine::GpuEngine(const DeviceModel& model, GpuEngineOptions options)
    : GpuEngine(model, options, std::make_unique<GpuBatchBackend>(model, batch_options(options))) {}

GpuEngine::GpuEngine(const DeviceModel& model, GpuEngineOptions options, std::unique_ptr<GpuBatchBackend> backend)
    : Engine(std::move(backend), engine_options(options), kLogitsChunk),
      device_(model),
      gpu_options_(std::move(options)),
      backend_(static_cast<GpuBatchBackend&>(Engine::backend())) {}

GpuEngine::~GpuEngine() = default;

const GpuKernelSeconds& GpuEngine::kernel_seconds() const {
  const GpuKernelSeconds& now = backend_.kernel_seconds();
  kernel_seconds_.norm = now.norm - kernel_base_.norm;
  kernel_seconds_.rope = now.rope - kernel_base_.rope;
  kernel_seconds_.activation = now.activation - kernel_base_.activation;
  kernel_seconds_.misc = now.misc - kernel_base_.misc;
  return kernel_seconds_;
}

void GpuEngine::reset_stats() {
  Engine::reset_stats();
  kernel_base_ = backend_.kernel_seconds();
}

size_t GpuEngine::kv_cache_bytes() const {
  if (const GpuStreamingKV* g = gpu_streaming()) return g->device_bytes();
  return Engine::kv_cache_bytes();
}

const StreamingKV* GpuEngine::streaming() const {
  const GpuStreamingKV* g = gpu_streaming();
  return g != nullptr ? &g->decisions() : nullptr;
}

GpuMemoryStats GpuEngine::memory() const {
  GpuMemoryStats m;
  m.weights_bytes = device_.bytes() + backend_.fp8_weight_bytes() + backend_.w4_weight_bytes();
  m.kv_cache_bytes = kv_cache_bytes();
  m.scratch_bytes = backend_.scratch_bytes() + backend_.staging_bytes();
  m.peak_in_use_bytes = backend_.peak_device_bytes();
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    m.device_total_bytes = total_bytes;
  else
    (void)cudaGetLastError();
  return m;
}

void GpuEngine::reserve_stream(int64_t tokens, bool wait) {
  GpuStreamingKV* g = gpu_streaming();
  if (g == nullptr) return;
  g->check_sequence(tokens);
  g->reserve(tokens);
  if (wait) g->wait_reserved();
}

void GpuEngine::release_memory() {
  reset();
  backend_.release_scratch();
}

}  // namespace tessera::runtime::gpu
