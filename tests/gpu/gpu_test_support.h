// tests/gpu/gpu_test_support.h — what the GPU engine tests each wrote for themselves, written once (beside
// tests/test_support.h's fixtures and random_tokens): skipping without a device, the real models' paths, an LCG prompt.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/cuda/gpu_engine.h"  // gpu_available
#include "../test_support.h"

#define REQUIRE_GPU()                                                                     \
  do {                                                                                    \
    if (!::tessera::runtime::gpu::gpu_available()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

namespace tessera::test {

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
