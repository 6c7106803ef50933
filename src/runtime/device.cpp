#include "runtime/device.h"

#include <algorithm>

#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/batch_engine.h"
#include "runtime/sampling.h"

namespace tessera::runtime {

namespace {

GpuDeviceHooks& gpu_hooks() {
  static GpuDeviceHooks hooks;
  return hooks;
}

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const Model& model) : model_(model) {}
  bool gpu() const override { return false; }
  std::string description() const override { return "cpu"; }
  int32_t default_chunk() const override { return EngineOptions{}.chunk_size; }
  std::unique_ptr<SequenceEngine> engine(const EngineOptions& options) const override {
    EngineOptions o = options;
    if (o.chunk_size <= 0) o.chunk_size = default_chunk();
    return std::make_unique<Engine>(model_, std::move(o));
  }
  std::unique_ptr<BatchBackend> batch_backend(const EngineOptions& options) const override {
    return std::make_unique<CpuBatchBackend>(model_, options.pool);
  }

 private:
  const Model& model_;
};

}  // namespace

void register_gpu_device(const GpuDeviceHooks& hooks) { gpu_hooks() = hooks; }

bool gpu_device_built() { return gpu_hooks().available != nullptr; }

bool gpu_device_usable(std::string* why) {
  const GpuDeviceHooks& h = gpu_hooks();
  if (h.available == nullptr) {
    if (why) *why = "this tessera was built without the CUDA backend";
    return false;
  }
  if (h.available()) return true;
  if (why) *why = h.describe();
  return false;
}

bool device_is_gpu(const std::string& name) {
  if (name == "cpu") return false;
  const GpuDeviceHooks& h = gpu_hooks();
  if (name == "auto") return h.available != nullptr && h.available();
  if (name == "cuda") {
    check(h.available != nullptr,
          "--device cuda: this tessera was built without the CUDA backend (configure with -DTESSERA_CUDA=ON on a "
          "machine with nvcc)");
    check(h.available(), "--device cuda: " + h.describe());
    return true;
  }
  throw Error("--device must be cpu, cuda or auto, got '" + name + "'");
}

std::unique_ptr<Device> open_device(const std::string& name, const Model& model) {
  if (device_is_gpu(name)) return gpu_hooks().open(model);
  return std::make_unique<CpuDevice>(model);
}

}  // namespace tessera::runtime
