// tessera/runtime/device.h — where a model runs, chosen once: the single-sequence engine and the batched engine's
// backend of any device behind one interface, so that the front doors (cli, server, python) never name a device's
// engine.
//
//   auto device = tessera::runtime::open_device("auto", *model);     // "cpu", "cuda" or "auto"
//   std::printf("device: %s\n", device->description().c_str());
//   tessera::runtime::EngineOptions options;                          // policy, chunk, context, streaming, GPU knobs
//   std::unique_ptr<tessera::runtime::SequenceEngine> engine = device->engine(options);
//   std::vector<float> logits = engine->prefill(prompt_ids);
//
// The CPU device is runtime::Engine / CpuBatchBackend over the host model. The CUDA device (runtime/cuda/
// cuda_device.cpp: the weights uploaded once in bf16, GpuEngine / GpuBatchBackend over them) registers itself when
// the program links it (the tessera_cuda_device object library); without it, "cuda" is refused with how to build it.
#pragma once

#include <memory>
#include <string>

#include "runtime/engine.h"
#include "runtime/sequence_engine.h"

namespace tessera::runtime {

class BatchBackend;

class Device {
 public:
  virtual ~Device() = default;
  virtual bool gpu() const = 0;
  // "cpu", or the GPU and its weights ("NVIDIA H200 (sm_90, 139.8 GB); weights 0.27 GB in bf16, uploaded in 0.3 s").
  virtual std::string description() const = 0;
  // A single-sequence engine (options.chunk_size <= 0: the device's default chunk; options.gpu: the GPU's knobs).
  virtual std::unique_ptr<SequenceEngine> engine(const EngineOptions& options) const = 0;
  // A backend of the batched engine (batch_engine.h) with the options' GPU knobs.
  virtual std::unique_ptr<BatchBackend> batch_backend(const EngineOptions& options) const = 0;
  // The prefill chunk the device's engines use when none is given.
  virtual int32_t default_chunk() const = 0;
};

// Opens "cpu", "cuda" (the current CUDA device; an error when there is none or the program has no CUDA backend) or
// "auto" (cuda when a GPU is usable, else cpu) for `model`, which must outlive the device.
//   "--device cuda: this tessera was built without the CUDA backend (configure with -DTESSERA_CUDA=ON on a machine with nvcc)"
//   "--device must be cpu, cuda or auto, got 'gpu'"
std::unique_ptr<Device> open_device(const std::string& name, const Model& model);
// Whether open_device(name) would pick a GPU, without touching one for "cpu" (the same errors).
bool device_is_gpu(const std::string& name);

// Whether this program has the CUDA device (it links tessera_cuda_device), and whether a GPU is usable now (false
// with the reason in *why: no device, no driver, or no CUDA backend).
bool gpu_device_built();
bool gpu_device_usable(std::string* why = nullptr);

// What the CUDA backend registers (cuda_device.cpp, at static initialisation).
struct GpuDeviceHooks {
  bool (*available)() = nullptr;             // a usable CUDA device
  std::string (*describe)() = nullptr;       // the device, or why none
  std::unique_ptr<Device> (*open)(const Model& model) = nullptr;
};
void register_gpu_device(const GpuDeviceHooks& hooks);

}  // namespace tessera::runtime
