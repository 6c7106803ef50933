// tessera/eval/report.h — pass-rate tables over scored results: per policy by task and length, the needle
// grid by depth and length, and agreement with the dense baseline; rendered as markdown.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "eval/metrics.h"
#include "eval/results.h"

namespace tessera::eval {

inline constexpr std::string_view kDenseBaseline = "dense";

// A table of pass rates: cells are row-major, rows x cols.
struct PassGrid {
  std::vector<std::string> row_labels;
  std::vector<std::string> col_labels;
  std::vector<PassRate> cells;

  size_t rows() const { return row_labels.size(); }
  size_t cols() const { return col_labels.size(); }
  PassRate& at(size_t r, size_t c) { return cells[r * cols() + c]; }
  const PassRate& at(size_t r, size_t c) const { return cells[r * cols() + c]; }
  PassRate row_total(size_t r) const;
  PassRate col_total(size_t c) const;
  PassRate total() const;
};

// The pass rate of the results that `keep` accepts.
PassRate pass_rate(const std::vector<CaseResult>& results,
                   const std::function<bool(const CaseResult&)>& keep);

// Policies in the results: `baseline` first when present, then the others in order of first appearance.
std::vector<std::string> policies_in(const std::vector<CaseResult>& results,
                                     std::string_view baseline = kDenseBaseline);
// Tasks in the results: the known ones in all_tasks() order, then unknown names sorted.
std::vector<std::string> tasks_in(const std::vector<CaseResult>& results);
// Distinct lengths, ascending.
std::vector<size_t> lengths_in(const std::vector<CaseResult>& results);

// "4K" for multiples of 1024, "1M" for multiples of 2^20, else the number.
std::string format_length(size_t tokens);
// "50%" (printf %g of the percentage).
std::string format_depth(double depth);
// "97.5% (39/40)"; "-" when total is 0.
std::string format_rate(const PassRate& rate);

// One policy's results: rows = tasks_in, cols = lengths_in (labels from format_length).
PassGrid task_length_grid(const std::vector<CaseResult>& results, const std::string& policy);
// One policy's results of one task that have a depth: rows = depths ascending (format_depth), cols = lengths.
// This is the needle grid of the papers' figures.
PassGrid depth_length_grid(const std::vector<CaseResult>& results, const std::string& policy,
                           const std::string& task);

// For one policy: on the cases (matched by id) that the baseline passes and the policy has results for, how
// many the policy passes too, per length and overall.
struct Agreement {
  std::string policy;
  std::vector<size_t> lengths;      // lengths_in(results)
  std::vector<PassRate> by_length;  // parallel to lengths
  PassRate overall;
};

// One entry per policy other than the baseline, in policies_in order. Throws tessera::Error when a policy has
// two results with the same case id.
std::vector<Agreement> agreement_with_baseline(const std::vector<CaseResult>& results,
                                               std::string_view baseline = kDenseBaseline);

// The markdown report: per policy (baseline first) a task x length table with an "all" row and column, then
// for each task with depths a depth x length table; then the agreement table (when the baseline is present).
std::string markdown_report(const std::vector<CaseResult>& results,
                            std::string_view baseline = kDenseBaseline);

}  // namespace tessera::eval
