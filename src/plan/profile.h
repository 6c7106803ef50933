// tessera/plan/profile.h — gradient profiles over calibration samples, shared by the MoA and TriangleMix planners.
//
// For every sample, attention_gradients (model_gradients.h, f32, 64 x 64 blocks) runs once; the profile keeps, per
// length level, the mean over its samples of each head's influence block sums (MoA) and, per layer, the region
// sums of dL/dtheta over all samples (TriangleMix). A sample belongs to the smallest level >= its token count
// (MoA pads items to their level); block (qb, kb) covers the same absolute positions in every sample of a level.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/thread_pool.h"
#include "plan/calibration.h"
#include "plan/model_gradients.h"
#include "model/model.h"

namespace tessera::plan {

inline constexpr int32_t kProfileBlock = 64;

struct LengthProfile {
  int32_t length = 0;      // the level (tokens)
  int32_t num_blocks = 0;  // ceil(length / 64)
  int32_t samples = 0;
  std::vector<double> influence;  // [layers][q_heads][num_blocks][num_blocks], mean over the level's samples
  // With keep_samples: each sample's own influence, same layout (for the calibration noise: compare_losses).
  std::vector<std::vector<double>> sample_influence;
  double block(int32_t layer, int32_t head, int32_t qb, int32_t kb, int32_t q_heads) const {
    return influence[((static_cast<size_t>(layer) * static_cast<size_t>(q_heads) + static_cast<size_t>(head)) *
                          static_cast<size_t>(num_blocks) +
                      static_cast<size_t>(qb)) *
                         static_cast<size_t>(num_blocks) +
                     static_cast<size_t>(kb)];
  }
};

struct GradientProfile {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  std::vector<LengthProfile> lengths;  // ascending
  std::vector<LayerProbe> probe;       // per layer, summed over every sample
  double loss = 0;                     // mean over samples
  double seconds = 0;
};

using ProfileProgress = std::function<void(int32_t done, int32_t total)>;

// `levels`: the length levels (ascending after sorting); a sample longer than the largest is an error. regions:
// TriangleMix's probe regions. device: where the reverse-mode passes run (model_gradients.h). keep_samples: also keep
// every sample's influence (memory: samples x layers x heads x blocks^2 doubles).
GradientProfile profile_gradients(const runtime::Model& model, const std::vector<CalibrationSample>& samples,
                                  std::vector<int32_t> levels, const ProbeRegions& regions, ThreadPool& pool,
                                  const ProfileProgress& progress = {}, Device device = Device::Cpu,
                                  bool keep_samples = false);

}  // namespace tessera::plan
