// The GPU engine out of device memory (ctest runs this program alone: RUN_SERIAL, as it fills the device).
//
// A ballast allocation leaves too little device memory free; then loading weights, staging a prompt's KV and a
// layer's forward pass each fail with a tessera::Error naming what was being allocated (and how much is free), and
// the engine gives the same logits once the memory is back (after reset()).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/device_buffer.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/synthetic_config.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

// Out of device memory (forced by a ballast allocation that leaves too little free): at load, at KV growth and
// inside a layer's forward pass, each a tessera::Error naming what was being allocated; the engine gives the same
// logits once memory is back (after reset()).
TEST(GpuEngineErrors, OutOfDeviceMemoryIsAClearErrorAndTheEngineRecovers) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  ModelConfig cfg = synthetic_config("llama3-8b");
  cfg.num_layers = 2;
  cfg.layers.resize(2);
  const auto dev = DeviceModel::random(cfg, 3);
  const std::vector<int32_t> tokens = test::lcg_tokens(16384, cfg.vocab_size);
  GpuEngineOptions eo;
  eo.chunk_size = 4096;
  eo.max_context = 32768;
  GpuEngine engine(*dev, eo);
  const std::vector<float> want = engine.prefill(tokens);
  // The KV blocks the prompt holds (as many bytes as the staging cache the next prefill allocates again, with the
  // scratch: release_memory() empties the sequence and frees both; the blocks' pool stays).
  const size_t kv_bytes = engine.memory().kv_cache_bytes;
  EXPECT_EQ(kv_bytes, size_t{16384} * 2 * 8 * 128 * 2 * 2);
  engine.release_memory();

  auto fill_to = [](size_t leave) {  // ballast: all free device memory but `leave` bytes
    size_t free_bytes = 0, total_bytes = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
    return attn::gpu::DeviceBuffer<char>(free_bytes > leave ? free_bytes - leave : 1);
  };
  auto error_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {
    auto ballast = fill_to(size_t{16} << 20);
    const std::string load = error_of([&] { (void)DeviceModel::random(cfg, 3); });
    EXPECT_EQ(load.rfind("device model " + cfg.name + ": the weights need ", 0), 0u) << load;
    EXPECT_NE(load.find("GB are free; free device memory or run on the CPU (--device cpu)"), std::string::npos) << load;
    const std::string kv = error_of([&] { engine.prefill(tokens); });
    // (The staged prefill's contiguous cache, allocated inside the first chunk: the scheduler names the chunk.)
    EXPECT_EQ(kv.rfind("prefill of 16384 tokens, chunk [0, 4096) at position 0: KV cache: cannot grow to 16384 tokens (",
                       0),
              0u)
        << kv;
    EXPECT_NE(kv.find("out of device memory: could not allocate "), std::string::npos) << kv;
    EXPECT_NE(kv.find("GB free of "), std::string::npos) << kv;
  }
  engine.reset();
  {
    // Room for the KV cache but not for the layers' activations: the error names the chunk and what failed.
    auto ballast = fill_to(kv_bytes + (size_t{8} << 20));
    const std::string fwd = error_of([&] { engine.prefill(tokens); });
    EXPECT_EQ(fwd.rfind("prefill of 16384 tokens, chunk [0, 4096) at position 0: ", 0), 0u) << fwd;
    EXPECT_NE(fwd.find("out of device memory"), std::string::npos) << fwd;
    std::printf("[oom] %s\n", fwd.c_str());
  }
  engine.reset();
  const std::vector<float> again = engine.prefill(tokens);
  EXPECT_EQ(again, want) << "the same prefill after the out-of-memory errors";
}

}  // namespace
}  // namespace tessera::runtime::gpu
