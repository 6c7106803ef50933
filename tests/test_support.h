// tests/test_support.h — what the engine, tensor-parallel and planner tests each wrote for themselves, written once:
// the tiny HF fixtures (tests/data/hf_tiny/<name>, loaded once per test program), random prompts over a
// vocabulary, and the message of the tessera::Error a call throws. The test's target defines TESSERA_SOURCE_DIR
// (tests/CMakeLists.txt, tests/gpu/CMakeLists.txt).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"

namespace tessera::test {

inline const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

// The fixture model tests/data/hf_tiny/<name> ("llama3", "gemma3", "llama3/model-q8_0.gguf", ...), loaded on first
// use and kept for the program's life.
inline const runtime::Model& fixture(const std::string& name) {
  static std::map<std::string, std::unique_ptr<runtime::Model>> cache;
  auto& m = cache[name];
  if (!m) m = runtime::Model::load(kFixtures + name);
  return *m;
}

// A real model file from TESSERA_MODELS (else ~/.cache/tessera/models), as scripts/fetch_models.sh puts it there. Missing:
// "" — a test failure ("... is missing: run scripts/fetch_models.sh") unless TESSERA_ALLOW_MISSING_MODELS=1, when the
// caller skips (`if (path.empty()) GTEST_SKIP()`: with the failure recorded it still fails).
inline std::string required_model_path(const std::string& file) {
  const char* env = std::getenv("TESSERA_MODELS");
  const char* home = std::getenv("HOME");
  const std::string dir = env && *env ? env : std::string(home ? home : ".") + "/.cache/tessera/models";
  const std::string path = dir + "/" + file;
  if (std::filesystem::exists(path)) return path;
  const char* allow = std::getenv("TESSERA_ALLOW_MISSING_MODELS");
  if (!(allow && std::string(allow) == "1")) ADD_FAILURE() << path << " is missing: run scripts/fetch_models.sh";
  return "";
}

// Token sequences joined (a prompt + its continuation), for tests that build conversations.
inline std::vector<int32_t> operator+(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// n tokens drawn uniformly from [lowest, vocab) by a std::mt19937 seeded with `seed`: the same prompt on every run.
inline std::vector<int32_t> random_tokens(int32_t n, int32_t vocab, uint32_t seed, int32_t lowest = 0) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(lowest, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

// The message of the tessera::Error fn throws; "(no error)" when it returns.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace tessera::test
