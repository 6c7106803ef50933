// tessera/plan/validation.h — judging a plan on data not used for calibration: does it reproduce the dense model's
// answers?
//
// Held-out samples are calibration-like tasks made with another seed (kHeldOutSeed added to the calibration's), so
// their needles, keys and positions differ from the ones the plan was made on; their targets are the dense model's
// greedy answers (answer_sample). A policy agrees on a sample when, run on the prompt and then fed the dense answer
// token by token, its greedy choice at every answer position is the dense answer's token, i.e. exactly when its
// own greedy answer equals dense's.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/pattern/policy.h"
#include "model/model.h"
#include "plan/calibration.h"

namespace tessera::plan {

inline constexpr uint64_t kHeldOutSeed = 1000003;

struct Agreement {
  int32_t kept = 0;    // samples whose dense answer the policy reproduces
  int32_t total = 0;
  std::vector<bool> per_sample;
  double share() const { return total > 0 ? static_cast<double>(kept) / total : 0.0; }
};

// Prefills each sample's prompt under `policy` (decode is dense, as in the engine) and checks the answer tokens by
// greedy choice. Throws tessera::Error for a sample without targets.
// device: the engine it runs on (null: the CPU engine on `model`), as calibration.h's.
Agreement answer_agreement(const runtime::Model& model, const attn::AttentionPolicy& policy,
                           const std::vector<CalibrationSample>& samples, const runtime::Device* device = nullptr);

}  // namespace tessera::plan
