// The real small models (fetched by scripts/fetch_models.sh) against transformers running the same GGUF
// files.
//
// Expected values: tests/data/hf_tiny/real/<model>.json, made by scripts/make_hf_fixtures.py --real. The
// prompt (600 tokens) is prefilled in three pieces that end at the checked positions, so chunk continuation
// over a partly filled cache is exercised too; Gemma-3's local layers (window 512) see a prompt longer than
// their window. A missing model fails the test unless TESSERA_ALLOW_MISSING_MODELS=1 (then it is skipped).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/model.h"

namespace tessera::runtime {
namespace {

std::string models_dir() {
  if (const char* env = std::getenv("TESSERA_MODELS"); env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/tessera/models";
}

bool allow_missing_models() {
  const char* env = std::getenv("TESSERA_ALLOW_MISSING_MODELS");
  return env != nullptr && std::string(env) == "1";
}

void check_real_model(const std::string& file, EngineOptions options, float tol) {
  const std::string path = models_dir() + "/" + file;
  if (!std::filesystem::exists(path)) {
    if (allow_missing_models()) GTEST_SKIP() << path << " is missing (TESSERA_ALLOW_MISSING_MODELS=1)";
    FAIL() << path
           << " is missing: run scripts/fetch_models.sh (or set TESSERA_MODELS to where it put the models; "
           << "TESSERA_ALLOW_MISSING_MODELS=1 skips these tests)";
  }
  const std::string stem = std::filesystem::path(file).stem().string();
  std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/real/" + stem + ".json");
  ASSERT_TRUE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  const auto tokens = j["tokens"].get<std::vector<int32_t>>();
  const auto probes = j["probe_ids"].get<std::vector<int32_t>>();

  const auto model = Model::load(path);
  ASSERT_EQ(model->config().vocab_size, j["vocab_size"].get<int32_t>());
  Engine engine(*model, std::move(options));
  size_t done = 0;
  for (const auto& c : j["checks"]) {
    const auto pos = c["position"].get<size_t>();
    const std::vector<float> logits =
        engine.prefill(std::span<const int32_t>(tokens).subspan(done, pos + 1 - done));
    done = pos + 1;
    const auto top_ids = c["top_ids"].get<std::vector<int32_t>>();
    const auto top = c["top_logits"].get<std::vector<float>>();
    const auto probe = c["probe_logits"].get<std::vector<float>>();
    EXPECT_EQ(argmax(logits), top_ids[0]) << file << " position " << pos;
    for (size_t i = 0; i < top_ids.size(); ++i)
      EXPECT_NEAR(logits[static_cast<size_t>(top_ids[i])], top[i], tol) << file << " position " << pos;
    for (size_t i = 0; i < probes.size(); ++i)
      EXPECT_NEAR(logits[static_cast<size_t>(probes[i])], probe[i], tol) << file << " position " << pos;
  }
}

EngineOptions chunked(int32_t chunk) {
  EngineOptions o;
  o.chunk_size = chunk;
  return o;
}

TEST(RuntimeRealModel, SmolLM2MatchesTransformers) {
  check_real_model("smollm2-135m-instruct-q4_1.gguf", chunked(256), 1e-3f);
}

TEST(RuntimeRealModel, Gemma3MatchesTransformers) {
  check_real_model("gemma-3-270m-q4_k_m.gguf", chunked(256), 1e-3f);
}

}  // namespace
}  // namespace tessera::runtime
