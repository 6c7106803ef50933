// The GPU's penalties, logit_bias and min_p (runtime/cuda/sample_gpu.h, issue 34) against the host's
// (runtime/sampling.h): edit_rows = Sampler::edit float for float, sample_rows with min_p = sample_token draw for
// draw. (The host side is checked against transformers' processors in tests/runtime_sampling_test.cpp.)
#include <gtest/gtest.h>

#include <random>
#include <span>
#include <tuple>
#include <vector>

#include "cuda/device_buffer.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/sample_gpu.h"
#include "runtime/sampling.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

using attn::gpu::DeviceBuffer;

std::vector<float> random_rows(int64_t rows, int32_t V, uint32_t seed) {
  std::vector<float> logits(static_cast<size_t>(rows * V));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (auto& x : logits) x = dist(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < 25; ++i) logits[static_cast<size_t>(r * V + rng() % V)] += 9.0f;
  return logits;
}

// Each row with its own history and options: the device's edits equal the host's to the bit.
TEST(SampleGpu, EditRowsEqualsTheHost) {
  REQUIRE_GPU();
  const int32_t V = 50000;
  const int64_t R = 6;
  std::vector<float> logits = random_rows(R, V, 5);
  std::vector<RowEdit> edits;
  std::vector<float> want = logits;
  std::mt19937 rng(9);
  for (int64_t r = 0; r < R; ++r) {
    SamplingOptions o;
    o.repetition_penalty = 1.0f + 0.1f * static_cast<float>(r);
    o.presence_penalty = 0.3f * static_cast<float>(r % 3);
    o.frequency_penalty = -0.2f + 0.15f * static_cast<float>(r);
    o.logit_bias = {{static_cast<int32_t>(rng() % V), 5.0f}, {static_cast<int32_t>(rng() % V), -100.0f}};
    Sampler s(o);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 300; ++i) prompt.push_back(static_cast<int32_t>(rng() % V));
    s.set_prompt(prompt);
    for (int i = 0; i < 40; ++i) s.accept(static_cast<int32_t>(rng() % 200));  // repeats: counts > 1
    for (const LogitEdit& e : s.edits(V)) edits.push_back({static_cast<int32_t>(r), e});
    s.edit(std::span<float>(want).subspan(static_cast<size_t>(r * V), static_cast<size_t>(V)));
  }
  DeviceBuffer<float> dl;
  dl.upload(logits, nullptr);
  DeviceBuffer<RowEdit> de;
  de.upload(edits, nullptr);
  edit_rows(dl.data(), V, de.data(), static_cast<int32_t>(edits.size()), nullptr);
  const std::vector<float> got = dl.download();
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_EQ(differ, 0) << "of " << edits.size() << " edits";
}

// sample_rows with min_p (with and without top_k / top_p) = sample_token, draw for draw.
TEST(SampleGpu, MinPEqualsTheHostRule) {
  REQUIRE_GPU();
  const int32_t V = 50000;
  std::vector<SampleRow> jobs;
  std::vector<SamplingOptions> opts;
  const std::vector<std::tuple<float, int32_t, float, float>> kinds{
      {1.0f, 0, 1.0f, 0.05f}, {0.7f, 40, 1.0f, 0.1f}, {1.3f, 0, 0.9f, 0.02f}, {2.0f, 0, 1.0f, 0.3f}};
  for (const auto& [t, k, pp, mp] : kinds)
    for (double u : {0.0, 0.2, 0.5, 0.9, 0.999999}) {
      jobs.push_back({static_cast<int32_t>(jobs.size()), k, t, pp, u, mp});
      opts.push_back({.temperature = t, .top_k = k, .top_p = pp, .min_p = mp});
    }
  const auto R = static_cast<int64_t>(jobs.size());
  const std::vector<float> logits = random_rows(R, V, 21);
  DeviceBuffer<float> dl;
  dl.upload(logits, nullptr);
  DeviceBuffer<SampleRow> dj;
  dj.upload(jobs, nullptr);
  DeviceBuffer<double> scratch(static_cast<size_t>(R * V));
  DeviceBuffer<int32_t> out(static_cast<size_t>(R));
  sample_rows(dl.data(), V, V, dj.data(), static_cast<int32_t>(R), scratch.data(), out.data(), nullptr);
  const std::vector<int32_t> got = out.download();
  for (int64_t r = 0; r < R; ++r) {
    const std::span<const float> row(logits.data() + r * V, static_cast<size_t>(V));
    EXPECT_EQ(got[static_cast<size_t>(r)], sample_token(row, opts[static_cast<size_t>(r)], jobs[static_cast<size_t>(r)].u))
        << "row " << r << " min_p " << jobs[static_cast<size_t>(r)].min_p;
  }
}

}  // namespace
}  // namespace tessera::runtime::gpu
