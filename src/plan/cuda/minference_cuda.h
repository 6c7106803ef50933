// tessera/plan/cuda/minference_cuda.h — the forward of MInference's search (plan/minference_plan.h) on the GPU.
//
// For one calibration sample: the planners' f32 device forward (GradientModel::forward) gives every layer's q, k, v
// and dense attention output; each candidate then runs on every head through the device's estimators, index build
// and sparse executor (attention/cuda/layer_attention_cuda.h) on bf16 copies of q, k, v with 64-row tiles (the CPU
// search's tile, so the masks are the CPU's up to near-ties of the estimates), with the layer's sliding window and
// without the dense fallback or shortcut; per head the relative output error ||O_c - O_dense|| / ||O_dense|| against
// the f32 dense output and the index's mask density are accumulated, as the CPU search does (and, with query rows,
// the error over the sample's last rows). What differs from the
// CPU: the candidate outputs are bf16 (about 4e-3 relative), the reference the f32 pass's.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/pattern/pattern.h"
#include "plan/cuda/gradients_cuda.h"

namespace tessera::plan::cuda {

struct MInferenceDeviceStats {
  double seconds = 0;          // the whole sample: forward, every candidate at every layer, the host round trips
  double candidate_seconds = 0;  // of which the candidates' estimate + index + attention + error (device events)
};

// Adds weight x the error and weight x the density of every (layer * heads + head, candidate) to error / density
// ([layers * heads][candidates]); with query_error, weight x the error over the sample's last query_rows rows too
// (MInferenceOptions::query_rows: the same partial sums over those rows alone, as the CPU search). Throws
// tessera::Error for a head_dim the GPU executors do not run (64, 128, 256).
void minference_errors(const GradientModel& model, const std::vector<int32_t>& tokens,
                       const std::vector<attn::Pattern>& candidates, double weight, std::vector<double>& error,
                       std::vector<double>& density, MInferenceDeviceStats* stats = nullptr, int64_t query_rows = 0,
                       std::vector<double>* query_error = nullptr);

}  // namespace tessera::plan::cuda
