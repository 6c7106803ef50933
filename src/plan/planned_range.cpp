#include "plan/planned_range.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/format.h"

namespace tessera::plan {

nlohmann::json planned_range_json(const PlannedRange& r) { return nlohmann::json::array({r.min, r.max}); }

std::optional<PlannedRange> planned_range_of(const nlohmann::json& plan, const std::string& source) {
  if (!plan.is_object() || !plan.contains("planned_lengths")) return std::nullopt;
  const nlohmann::json& v = plan["planned_lengths"];
  const bool ok = v.is_array() && v.size() == 2 && v[0].is_number_integer() && v[1].is_number_integer() &&
                  v[0].get<int64_t>() >= 1 && v[0].get<int64_t>() <= v[1].get<int64_t>() &&
                  v[1].get<int64_t>() <= INT32_MAX;
  check(ok, source + ": 'planned_lengths' must be [min, max] with 1 <= min <= max tokens, got " + v.dump());
  return PlannedRange{v[0].get<int32_t>(), v[1].get<int32_t>()};
}

std::optional<PlannedRange> planned_range_in_file(const std::string& spec) {
  std::error_code ec;
  if (spec.size() < 5 || spec.substr(spec.size() - 5) != ".json" || !std::filesystem::is_regular_file(spec, ec))
    return std::nullopt;
  std::ifstream in(spec);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str(), nullptr, true, /*ignore_comments=*/true);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // the policy loader reports what is wrong with the file
  }
  return planned_range_of(j, spec);
}

std::optional<std::string> range_warning(const PlannedRange& r, int64_t prompt_tokens, const std::string& plan_name) {
  const bool below = static_cast<double>(prompt_tokens) * kFarOutside < r.min;
  const bool above = static_cast<double>(prompt_tokens) > r.max * kFarOutside;
  if (!below && !above) return std::nullopt;
  return "warning: plan " + plan_name + " was made for prompts of " + with_commas(r.min) + "-" + with_commas(r.max) +
         " tokens; this one has " + with_commas(prompt_tokens) +
         (below ? " (under a half of the shortest)" : " (over twice the longest)") +
         ": its patterns were sized for the planned lengths, so density and accuracy may differ from the plan's; "
         "plan again with tessera plan --lengths covering " +
         std::to_string(prompt_tokens);
}

std::optional<std::string> planned_range_warning(const std::string& spec, int64_t prompt_tokens) {
  const auto r = planned_range_in_file(spec);
  if (!r) return std::nullopt;
  return range_warning(*r, prompt_tokens, spec);
}

}  // namespace tessera::plan
