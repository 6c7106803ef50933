#include "plan/compare.h"

#include <cstdio>

#include "core/error.h"
#include "plan/measure.h"

namespace tessera::plan {

std::vector<ComparedPolicy> compare_policies(const runtime::Model& model,
                                             const std::vector<std::pair<std::string, attn::AttentionPolicy>>& policies,
                                             const std::vector<std::vector<int32_t>>& density_prompts,
                                             const std::vector<CalibrationSample>& heldout,
                                             const runtime::Device* device, ThreadPool& pool) {
  std::vector<ComparedPolicy> rows(policies.size());
  std::vector<attn::AttentionPolicy> all;
  for (size_t i = 0; i < policies.size(); ++i) {
    rows[i].name = policies[i].first;
    all.push_back(policies[i].second);
  }
  for (const std::vector<int32_t>& prompt : density_prompts) {
    const std::vector<double> d = executed_density(model, prompt, all, pool);
    for (size_t i = 0; i < rows.size(); ++i) rows[i].density.push_back(d[i]);
  }
  if (!heldout.empty())
    for (size_t i = 0; i < rows.size(); ++i) rows[i].heldout = answer_agreement(model, all[i], heldout, device);
  return rows;
}

std::vector<std::string> compare_lines(const std::vector<ComparedPolicy>& rows, const std::vector<int32_t>& lengths) {
  std::vector<std::string> out;
  for (const ComparedPolicy& r : rows) {
    check(r.density.size() == lengths.size(), "compare: " + std::to_string(r.density.size()) + " densities for " +
                                                  std::to_string(lengths.size()) + " lengths");
    std::string d, l;
    for (size_t i = 0; i < lengths.size(); ++i) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3f", r.density[i]);
      d += (i ? " / " : "") + std::string(buf);
      l += (i ? " / " : "") + std::to_string(lengths[i]);
    }
    out.push_back(r.name + ": kept " + std::to_string(r.heldout.kept) + " of " + std::to_string(r.heldout.total) +
                  " held-out answers, executed density " + d + " at " + l);
  }
  return out;
}

}  // namespace tessera::plan
