// tessera/plan/planned_range.h — the prompt lengths a plan was made for, and the warning when a prompt is far
// outside them.
//
// `tessera plan` records in the plan file "planned_lengths": [min, max] (tokens: the calibration lengths, or the
// calibration file's shortest and longest samples). Patterns with absolute budgets (MInference's vertical-slash
// counts, A-shape windows, block-sparse top_k) are sized for those lengths: at shorter prompts they clip to denser
// masks, at longer ones their density falls as 1 / N; MoA's elastic rules (alpha + beta N) scale with the prompt
// but were chosen on profiles at those lengths. `tessera run` (and `serve` for its default policy at startup) calls
// planned_range_warning: a prompt shorter than min / kFarOutside or longer than max * kFarOutside gets a warning.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace tessera::plan {

struct PlannedRange {
  int32_t min = 0;
  int32_t max = 0;
  bool operator==(const PlannedRange&) const = default;
};

// How far outside the range is "far": a factor of 2 either way.
inline constexpr double kFarOutside = 2.0;

nlohmann::json planned_range_json(const PlannedRange& r);  // [min, max]

// The plan's "planned_lengths" (std::nullopt when absent). Throws tessera::Error "<source>: 'planned_lengths' must be
// [min, max] with 1 <= min <= max tokens, got <value>" for anything else.
std::optional<PlannedRange> planned_range_of(const nlohmann::json& plan, const std::string& source);

// The range recorded in the policy file `spec` names (a preset or a file without the field: std::nullopt).
std::optional<PlannedRange> planned_range_in_file(const std::string& spec);

// The warning for a prompt of `prompt_tokens` (std::nullopt inside [min / kFarOutside, max * kFarOutside]), e.g.
// "warning: plan p.json was made for prompts of 2,048-8,192 tokens; this one has 512 (under a half of the
// shortest): its patterns were sized for the planned lengths, so density and accuracy may differ from the
// plan's; plan again with tessera plan --lengths covering 512".
std::optional<std::string> range_warning(const PlannedRange& r, int64_t prompt_tokens, const std::string& plan_name);

// planned_range_in_file + range_warning.
std::optional<std::string> planned_range_warning(const std::string& spec, int64_t prompt_tokens);

}  // namespace tessera::plan
