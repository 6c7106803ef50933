// tessera/plan/compare.h — a plan beside presets on the data it was not made on (issue 33: "the report shows it beside
// the presets of the same executed density"): per policy, its executed density at each validation length
// (measure.h, one held-out retrieval prompt per length) and the held-out tasks' dense answers it keeps
// (validation.h). `tessera plan --compare-with` prints and saves the table; whether a preset is "of the same cost" is read
// off the density columns.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "plan/calibration.h"
#include "plan/validation.h"
#include "runtime/device.h"

namespace tessera::plan {

struct ComparedPolicy {
  std::string name;             // as given: "plan" or the preset's spec
  std::vector<double> density;  // executed density on density_prompts[i], one per prompt
  Agreement heldout;            // the held-out tasks' dense answers it reproduces
};

// For each named policy, in order: its executed density on each of `density_prompts` (one dense prefill per prompt
// for all policies together, on the CPU model) and its agreement on `heldout` (on `device`, null: the CPU engine).
// Throws tessera::Error as executed_density and answer_agreement do.
std::vector<ComparedPolicy> compare_policies(const runtime::Model& model,
                                             const std::vector<std::pair<std::string, attn::AttentionPolicy>>& policies,
                                             const std::vector<std::vector<int32_t>>& density_prompts,
                                             const std::vector<CalibrationSample>& heldout,
                                             const runtime::Device* device, ThreadPool& pool);

// One line a policy: "NAME: kept K of N held-out answers, executed density D1 / D2 at L1 / L2".
std::vector<std::string> compare_lines(const std::vector<ComparedPolicy>& rows, const std::vector<int32_t>& lengths);

}  // namespace tessera::plan
