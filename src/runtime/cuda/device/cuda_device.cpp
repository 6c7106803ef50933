// The CUDA device of runtime/device.h: the model's weights uploaded once in bf16 (DeviceModel); its single-sequence
// engine is GpuEngine (runtime::Engine, the scheduler with one held sequence, over GpuBatchBackend) and its batched
// backend GpuBatchBackend, both over those weights. Registered at static initialisation: a program that links this
// object (the tessera_cuda_device object library) gets "--device cuda" / "auto", one that does not gets the CPU alone.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "runtime/device.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"

namespace tessera::runtime::gpu {

namespace {

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const Model& model) {
    const auto t0 = std::chrono::steady_clock::now();
    weights_ = DeviceModel::upload(model);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char buf[160];
    std::snprintf(buf, sizeof buf, "; weights %.2f GB in bf16, uploaded in %.1f s",
                  static_cast<double>(weights_->bytes()) / 1e9, s);
    description_ = gpu_description() + buf;
  }
  bool gpu() const override { return true; }
  std::string description() const override { return description_; }
  int32_t default_chunk() const override { return GpuEngineOptions{}.chunk_size; }

  std::unique_ptr<SequenceEngine> engine(const EngineOptions& options) const override {
    GpuEngineOptions go;
    if (options.chunk_size > 0) go.chunk_size = options.chunk_size;
    go.policy = options.policy;
    go.max_context = options.max_context;
    go.stream = options.stream;
    go.cuda_attention = options.gpu.cuda_attention;
    if (options.gpu.fp8_gemm) go.gemm = GemmPrecision::kFp8;
    if (options.gpu.w4_decode) go.gemm = GemmPrecision::kW4;
    if (options.gpu.fp8_kv) go.kv = KVPrecision::kFp8;
    return std::make_unique<GpuEngine>(*weights_, go);
  }

  std::unique_ptr<BatchBackend> batch_backend(const EngineOptions& options) const override {
    GpuBatchOptions gbo;
    gbo.prefill.cuda_attention = options.gpu.cuda_attention;
    if (options.gpu.fp8_gemm) gbo.gemm = GemmPrecision::kFp8;  // (decode stays bf16: faster at a few rows)
    if (options.gpu.w4_decode) gbo.decode_gemm = GemmPrecision::kW4;
    if (options.gpu.fp8_kv) gbo.kv = KVPrecision::kFp8;
    return std::make_unique<GpuBatchBackend>(*weights_, gbo);
  }

 private:
  std::unique_ptr<DeviceModel> weights_;
  std::string description_;
};

const bool registered = [] {
  register_gpu_device({.available = &gpu_available,
                       .describe = &gpu_description,
                       .open = [](const Model& model) -> std::unique_ptr<Device> {
                         return std::make_unique<CudaDevice>(model);
                       }});
  return true;
}();

}  // namespace

}  // namespace tessera::runtime::gpu
