// tests/gpu/gpu_test_support.h — what the GPU engine tests each wrote for themselves, written once (beside
// tests/test_support.h's fixtures and random_tokens): skipping without a device, the real models' paths, an LCG prompt.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "runtime/cuda/gpu_engine.h"  // gpu_available
#include "../test_support.h"

#define REQUIRE_GPU()                                                                     \
  do {                                                                                    \
    if (!::tessera::runtime::gpu::gpu_available()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

namespace tessera::test {

// Whether the environment has var=1 (the switch of the opt-in benchmarks among the tests).
inline bool env_on(const char* var) {
  const char* e = std::getenv(var);
  return e != nullptr && std::string(e) == "1";
}

// Runs product(y) on `stream` into a device y and returns y as floats: with y_f32 an f32 y holding y0 before (what a
// beta reads), else a bf16 y of y0.size() elements.
template <class Product>
std::vector<float> product_into_y(const std::vector<float>& y0, bool y_f32, cudaStream_t stream, Product&& product) {
  std::vector<float> got(y0.size());
  if (y_f32) {
    attn::gpu::DeviceBuffer<float> y;
    y.upload(y0, stream);
    product(static_cast<void*>(y.data()));
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return y.download();
  }
  attn::gpu::DeviceBuffer<bf16> y(y0.size());
  product(static_cast<void*>(y.data()));
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<bf16> h = y.download();
  for (size_t i = 0; i < h.size(); ++i) got[i] = bf16_to_f32(h[i]);
  return got;
}

// The relative L2 error of got against ref: |got - ref| / |ref| (f64 sums; an all-zero ref divides by 1e-30).
inline double rel_l2(const std::vector<float>& ref, const std::vector<float>& got) {
  double d2 = 0, r2 = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    d2 += d * d;
    r2 += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(d2 / std::max(r2, 1e-30));
}

// A real small model (scripts/setup.sh models): TESSERA_MODEL_DIR, else TESSERA_MODELS, else ~/.cache/tessera/models;
// "" when it is in none of them (the GPU machine has no network: the test skips).
inline std::string real_model_path(const std::string& file) {
  for (const char* var : {"TESSERA_MODEL_DIR", "TESSERA_MODELS"}) {
    if (const char* env = std::getenv(var); env != nullptr && *env != '\0') {
      const std::string p = std::string(env) + "/" + file;
      if (std::filesystem::exists(p)) return p;
    }
  }
  const char* home = std::getenv("HOME");
  const std::string p = std::string(home != nullptr ? home : ".") + "/.cache/tessera/models/" + file;
  return std::filesystem::exists(p) ? p : std::string();
}

// n tokens in [0, vocab) from a 64-bit linear congruential generator started at `seed`: the same prompt on every run.
inline std::vector<int32_t> lcg_tokens(int64_t n, int32_t vocab, uint64_t seed = 7) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t s = seed;
  for (auto& x : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}

}  // namespace tessera::test
