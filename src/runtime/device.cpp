#include "runtime/device.h"

#include <algorithm>

#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/batch_engine.h"
#include "runtime/sampling.h"

namespace tessera::runtime {

void append_next_token_logprobs(std::span<const float> logits, int64_t rows, int64_t vocab, int64_t first,
                                std::span<const int32_t> tokens, std::vector<double>& out) {
  // Rows that predict a token of `tokens` (the last row of the text predicts none).
  const int64_t scored = std::clamp<int64_t>(static_cast<int64_t>(tokens.size()) - first - 1, 0, rows);
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(scored));
  // A log-softmax over the whole vocabulary a row (262,144 exponentials for Gemma-3): rows split over the pool in
  // blocks of 16 (each row's sum in double, in vocabulary order, whatever the split).
  constexpr int64_t kRowsPerItem = 16;
  ThreadPool::global().parallel_for((scored + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item, int) {
    for (int64_t r = item * kRowsPerItem; r < std::min(scored, (item + 1) * kRowsPerItem); ++r) {
      const std::span<const float> row = logits.subspan(static_cast<size_t>(r * vocab), static_cast<size_t>(vocab));
      out[base + static_cast<size_t>(r)] =
          static_cast<double>(row[static_cast<size_t>(tokens[static_cast<size_t>(first + r + 1)])]) - log_sum_exp(row);
    }
  });
}

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
