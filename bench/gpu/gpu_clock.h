// bench/gpu/gpu_clock.h — the mean SM clock and board power of one GPU while a timed region runs, so that
// wall times measured on a power-capped GPU (H100 / H200) can be compared across runs: the same kernel
// measured 14.5 ms at ~1.7 GHz in one run and 15.5 ms at ~1.6 GHz in another.
//
//   GpuClockSampler clock(0);            // CUDA device 0
//   std::printf("clock: %s\n", clock.description().c_str());
//   clock.start();                       // a thread samples every ~5 ms ...
//   ... timed work ...
//   const ClockStats s = clock.stop();   // ... until here: means over the samples
//
// NVML is loaded at run time (dlopen("libnvidia-ml.so.1") + dlsym): nothing links against libnvidia-ml and
// nvml.h is not needed. Without the library, a symbol, nvmlInit or a readable SM clock, available() is false,
// description() says why, and stop() returns samples = 0 with both means -1 (not measured); likewise
// mean_power_w is -1 when the board power cannot be read (some virtualized / MIG setups).
// The CUDA device is matched to the NVML device by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA devices,
// not NVML's), falling back to NVML index 0. What the numbers are: the SM clock is NVML's current clock at
// each sample; the first sample is taken as soon as the thread starts, so even a region shorter than the
// period gets one. NVML's board power is, on Ampere (except GA100) and newer (Hopper included), an average
// over the last second, so for regions shorter than about a second it also covers what ran just before (the
// warm-up). The sampler is a host thread making a few NVML calls every 5 ms; it does not touch the GPU's
// work.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace tessera::bench {

struct ClockStats {
  double mean_sm_mhz = -1;   // mean SM clock over the samples, MHz; -1: not measured
  double mean_power_w = -1;  // mean board power over the samples, W; -1: not measured
  int samples = 0;           // samples that read the SM clock
};

// One reading now (GpuClockSampler::now): -1 where NVML could not say. reasons: NVML's clock event ("throttle")
// reason bits, e.g. 0x4 software power cap, 0x20 / 0x40 software / hardware thermal slowdown, 0x8 hardware slowdown.
struct ClockNow {
  int sm_mhz = -1;
  double power_w = -1;
  int temperature_c = -1;
  long long reasons = -1;
};

class GpuClockSampler {
 public:
  explicit GpuClockSampler(int cuda_device = 0,
                           std::chrono::milliseconds period = std::chrono::milliseconds(5))
      : period_(period) {
    open(cuda_device);
  }
  ~GpuClockSampler() {
    (void)stop();
    if (initialized_) nvml_shutdown_();
    if (lib_) dlclose(lib_);
  }
  GpuClockSampler(const GpuClockSampler&) = delete;
  GpuClockSampler& operator=(const GpuClockSampler&) = delete;

  bool available() const { return available_; }
  // "NVML, device <bus id> (...)" when available, else the reason ("libnvidia-ml.so.1: ... not found", ...).
  const std::string& description() const { return description_; }

  // Starts sampling (a no-op when unavailable or already started).
  void start() {
    if (!available_ || thread_.joinable()) return;
    stop_requested_ = false;
    thread_ = std::thread([this] { run(); });
  }

  // The SM clock, board power, GPU temperature and clock event reasons read now (from any thread).
  ClockNow now() const {
    ClockNow n;
    if (!available_) return n;
    unsigned int mhz = 0, mw = 0, temp = 0;
    unsigned long long reasons = 0;
    if (clock_info_(device_, kNvmlClockSm, &mhz) == kNvmlSuccess) n.sm_mhz = static_cast<int>(mhz);
    if (power_usage_(device_, &mw) == kNvmlSuccess) n.power_w = mw / 1000.0;
    if (temperature_ && temperature_(device_, 0, &temp) == kNvmlSuccess) n.temperature_c = static_cast<int>(temp);
    if (reasons_ && reasons_(device_, &reasons) == kNvmlSuccess) n.reasons = static_cast<long long>(reasons);
    return n;
  }

  // Stops sampling and returns the means since start(); {-1, -1, 0} when nothing was sampled.
  ClockStats stop() {
    if (!thread_.joinable()) return {};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_requested_ = true;
    }
    wake_.notify_all();
    thread_.join();
    ClockStats s;
    s.samples = sm_samples_;
    if (sm_samples_ > 0) s.mean_sm_mhz = sm_sum_mhz_ / sm_samples_;
    if (power_samples_ > 0) s.mean_power_w = power_sum_mw_ / power_samples_ / 1000.0;
    return s;
  }

 private:
  // NVML's ABI, declared here instead of including nvml.h (values from nvml.h):
  //   nvmlReturn_t is an enum, NVML_SUCCESS = 0;
  //   nvmlClockType_t is an enum, NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2;
  //   nvmlDevice_t is an opaque pointer (struct nvmlDevice_st*);
  //   nvmlDeviceGetPowerUsage reports milliwatts; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE is 32.
  using NvmlReturn = int;
  using NvmlDevice = void*;
  static constexpr NvmlReturn kNvmlSuccess = 0;
  static constexpr int kNvmlClockSm = 1;
  using InitFn = NvmlReturn (*)();
  using ShutdownFn = NvmlReturn (*)();
  using HandleByIndexFn = NvmlReturn (*)(unsigned int, NvmlDevice*);
  using HandleByPciBusIdFn = NvmlReturn (*)(const char*, NvmlDevice*);
  using ClockInfoFn = NvmlReturn (*)(NvmlDevice, int, unsigned int*);
  using PowerUsageFn = NvmlReturn (*)(NvmlDevice, unsigned int*);
  using ErrorStringFn = const char* (*)(NvmlReturn);
  using TemperatureFn = NvmlReturn (*)(NvmlDevice, int, unsigned int*);  // NVML_TEMPERATURE_GPU = 0
  using ReasonsFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);

  template <typename Fn>
  bool symbol(const char* name, Fn& fn) {
    fn = reinterpret_cast<Fn>(dlsym(lib_, name));
    if (!fn) description_ = std::string("unavailable (libnvidia-ml.so.1 has no ") + name + ")";
    return fn != nullptr;
  }

  std::string error(NvmlReturn r) const {
    const char* s = error_string_ ? error_string_(r) : nullptr;
    return s ? std::string(s) + " (" + std::to_string(r) + ")" : "NVML error " + std::to_string(r);
  }

  void open(int cuda_device) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      const char* e = dlerror();
      description_ = std::string("unavailable (dlopen libnvidia-ml.so.1: ") + (e ? e : "failed") + ")";
      return;
    }
    InitFn init = nullptr;
    HandleByIndexFn by_index = nullptr;
    if (!symbol("nvmlInit_v2", init) || !symbol("nvmlShutdown", nvml_shutdown_) ||
        !symbol("nvmlDeviceGetHandleByIndex_v2", by_index) ||
        !symbol("nvmlDeviceGetClockInfo", clock_info_) || !symbol("nvmlDeviceGetPowerUsage", power_usage_)) {
      return;
    }
    // Optional: better messages, and the bus-id match (else NVML index 0).
    error_string_ = reinterpret_cast<ErrorStringFn>(dlsym(lib_, "nvmlErrorString"));
    temperature_ = reinterpret_cast<TemperatureFn>(dlsym(lib_, "nvmlDeviceGetTemperature"));
    reasons_ = reinterpret_cast<ReasonsFn>(dlsym(lib_, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons_) reasons_ = reinterpret_cast<ReasonsFn>(dlsym(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    const auto by_bus_id =
        reinterpret_cast<HandleByPciBusIdFn>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    if (const NvmlReturn r = init(); r != kNvmlSuccess) {
      description_ = "unavailable (nvmlInit_v2: " + error(r) + ")";
      return;
    }
    initialized_ = true;

    std::string how;
    char bus_id[64] = {};
    const cudaError_t ce = cudaDeviceGetPCIBusId(bus_id, static_cast<int>(sizeof bus_id), cuda_device);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError();
      how = std::string("NVML device index 0 (cudaDeviceGetPCIBusId failed: ") + cudaGetErrorString(ce) + ")";
    } else if (!by_bus_id) {
      how = std::string("NVML device index 0 (no nvmlDeviceGetHandleByPciBusId_v2; CUDA device at ") +
            bus_id + ")";
    } else if (const NvmlReturn r = by_bus_id(bus_id, &device_); r != kNvmlSuccess) {
      device_ = nullptr;
      how = std::string("NVML device index 0 (bus id ") + bus_id + " not found: " + error(r) + ")";
    } else {
      how = std::string("device ") + bus_id + ", matched by PCI bus id";
    }
    if (!device_) {
      if (const NvmlReturn r = by_index(0, &device_); r != kNvmlSuccess) {
        device_ = nullptr;
        description_ = "unavailable (nvmlDeviceGetHandleByIndex_v2(0): " + error(r) + "; " + how + ")";
        return;
      }
    }
    unsigned int mhz = 0, mw = 0;
    if (const NvmlReturn r = clock_info_(device_, kNvmlClockSm, &mhz); r != kNvmlSuccess) {
      description_ = "unavailable (nvmlDeviceGetClockInfo(SM): " + error(r) + "; " + how + ")";
      return;
    }
    const NvmlReturn power = power_usage_(device_, &mw);
    available_ = true;
    description_ = "NVML, " + how + "; SM clock" + (power == kNvmlSuccess ? " and board power" : "") +
                   " sampled every " + std::to_string(period_.count()) +
                   " ms over each row's timed repetitions (now " + std::to_string(mhz) + " MHz" +
                   (power == kNvmlSuccess
                        ? ", " + std::to_string(mw / 1000) + " W)"
                        : "); board power unavailable (nvmlDeviceGetPowerUsage: " + error(power) + ")");
  }

  // The sampling thread: one sample at once, then one per period until stop().
  void run() {
    double sm_sum = 0, power_sum = 0;
    int sm_n = 0, power_n = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    do {
      lock.unlock();
      unsigned int mhz = 0, mw = 0;
      if (clock_info_(device_, kNvmlClockSm, &mhz) == kNvmlSuccess) {
        sm_sum += mhz;
        ++sm_n;
      }
      if (power_usage_(device_, &mw) == kNvmlSuccess) {
        power_sum += mw;
        ++power_n;
      }
      lock.lock();
    } while (!wake_.wait_for(lock, period_, [this] { return stop_requested_; }));
    sm_sum_mhz_ = sm_sum;
    sm_samples_ = sm_n;
    power_sum_mw_ = power_sum;
    power_samples_ = power_n;
  }

  std::chrono::milliseconds period_;
  void* lib_ = nullptr;
  bool initialized_ = false, available_ = false;
  std::string description_ = "unavailable";
  ShutdownFn nvml_shutdown_ = nullptr;
  ClockInfoFn clock_info_ = nullptr;
  PowerUsageFn power_usage_ = nullptr;
  ErrorStringFn error_string_ = nullptr;
  TemperatureFn temperature_ = nullptr;
  ReasonsFn reasons_ = nullptr;
  NvmlDevice device_ = nullptr;

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_requested_ = false;               // guarded by mutex_
  double sm_sum_mhz_ = 0, power_sum_mw_ = 0;  // written by the thread before it ends, read after join()
  int sm_samples_ = 0, power_samples_ = 0;
};

}  // namespace tessera::bench
