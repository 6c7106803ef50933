#include "eval/report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "core/format.h"

namespace tessera::eval {

namespace {

size_t index_of(const std::vector<size_t>& v, size_t x) {
  return static_cast<size_t>(std::lower_bound(v.begin(), v.end(), x) - v.begin());
}

// Appends " text |". (Built with append rather than operator+, which trips GCC 12's -Wrestrict false
// positive.)
void cell(std::string& out, std::string_view text) {
  out.append(" ").append(text).append(" |");
}

// The header of a table: "| corner | a | b | all |" and the alignment row.
void markdown_header(std::string& out, std::string_view corner, const std::vector<std::string>& cols) {
  out.append("|");
  cell(out, corner);
  for (const std::string& c : cols) cell(out, c);
  cell(out, "all");
  out.append("\n|:--|");
  for (size_t c = 0; c <= cols.size(); ++c) out.append("--:|");
  out.append("\n");
}

void markdown_grid(std::string& out, const PassGrid& g, std::string_view corner) {
  markdown_header(out, corner, g.col_labels);
  for (size_t r = 0; r < g.rows(); ++r) {
    out.append("|");
    cell(out, g.row_labels[r]);
    for (size_t c = 0; c < g.cols(); ++c) cell(out, format_rate(g.at(r, c)));
    cell(out, format_rate(g.row_total(r)));
    out.append("\n");
  }
  out.append("|");
  cell(out, "**all**");
  for (size_t c = 0; c < g.cols(); ++c) cell(out, format_rate(g.col_total(c)));
  cell(out, format_rate(g.total()));
  out.append("\n");
}

}  // namespace

PassRate PassGrid::row_total(size_t r) const {
  PassRate t;
  for (size_t c = 0; c < cols(); ++c) t.add(at(r, c));
  return t;
}

PassRate PassGrid::col_total(size_t c) const {
  PassRate t;
  for (size_t r = 0; r < rows(); ++r) t.add(at(r, c));
  return t;
}

PassRate PassGrid::total() const {
  PassRate t;
  for (const PassRate& p : cells) t.add(p);
  return t;
}

PassRate pass_rate(const std::vector<CaseResult>& results,
                   const std::function<bool(const CaseResult&)>& keep) {
  PassRate p;
  for (const CaseResult& r : results) {
    if (keep(r)) p.add(r.pass);
  }
  return p;
}

std::vector<std::string> policies_in(const std::vector<CaseResult>& results, std::string_view baseline) {
  std::vector<std::string> out;
  bool has_baseline = false;
  std::set<std::string> seen;
  for (const CaseResult& r : results) {
    if (r.policy == baseline) {
      has_baseline = true;
    } else if (seen.insert(r.policy).second) {
      out.push_back(r.policy);
    }
  }
  if (has_baseline) out.insert(out.begin(), std::string(baseline));
  return out;
}

std::vector<std::string> tasks_in(const std::vector<CaseResult>& results) {
  std::set<std::string> names;
  for (const CaseResult& r : results) names.insert(r.task);
  std::vector<std::string> out;
  for (TaskKind t : all_tasks()) {
    auto it = names.find(std::string(task_name(t)));
    if (it != names.end()) {
      out.push_back(*it);
      names.erase(it);
    }
  }
  out.insert(out.end(), names.begin(), names.end());
  return out;
}

std::vector<size_t> lengths_in(const std::vector<CaseResult>& results) {
  std::set<size_t> s;
  for (const CaseResult& r : results) s.insert(r.length);
  return {s.begin(), s.end()};
}

std::string format_length(size_t tokens) {
  if (tokens > 0 && tokens % (size_t{1} << 20) == 0) return std::to_string(tokens >> 20) + "M";
  if (tokens > 0 && tokens % 1024 == 0) return std::to_string(tokens / 1024) + "K";
  return std::to_string(tokens);
}

std::string format_depth(double depth) {
  return format_g(depth) + "%";
}

std::string format_rate(const PassRate& rate) {
  if (rate.total == 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f%% (%zu/%zu)", 100.0 * rate.rate(), rate.passed, rate.total);
  return buf;
}

PassGrid task_length_grid(const std::vector<CaseResult>& results, const std::string& policy) {
  std::vector<CaseResult> mine;
  for (const CaseResult& r : results) {
    if (r.policy == policy) mine.push_back(r);
  }
  PassGrid g;
  g.row_labels = tasks_in(mine);
  const std::vector<size_t> lengths = lengths_in(mine);
  for (size_t l : lengths) g.col_labels.push_back(format_length(l));
  g.cells.assign(g.rows() * g.cols(), {});
  for (const CaseResult& r : mine) {
    const size_t row = static_cast<size_t>(std::find(g.row_labels.begin(), g.row_labels.end(), r.task) -
                                           g.row_labels.begin());
    g.at(row, index_of(lengths, r.length)).add(r.pass);
  }
  return g;
}

PassGrid depth_length_grid(const std::vector<CaseResult>& results, const std::string& policy,
                           const std::string& task) {
  std::vector<const CaseResult*> mine;
  std::set<double> depths;
  std::set<size_t> length_set;
  for (const CaseResult& r : results) {
    if (r.policy == policy && r.task == task && r.depth) {
      mine.push_back(&r);
      depths.insert(*r.depth);
      length_set.insert(r.length);
    }
  }
  const std::vector<double> depth_list(depths.begin(), depths.end());
  const std::vector<size_t> lengths(length_set.begin(), length_set.end());
  PassGrid g;
  for (double d : depth_list) g.row_labels.push_back(format_depth(d));
  for (size_t l : lengths) g.col_labels.push_back(format_length(l));
  g.cells.assign(g.rows() * g.cols(), {});
  for (const CaseResult* r : mine) {
    const auto row = static_cast<size_t>(std::lower_bound(depth_list.begin(), depth_list.end(), *r->depth) -
                                         depth_list.begin());
    g.at(row, index_of(lengths, r->length)).add(r->pass);
  }
  return g;
}

std::vector<Agreement> agreement_with_baseline(const std::vector<CaseResult>& results,
                                               std::string_view baseline) {
  // policy -> id -> result
  std::map<std::string, std::unordered_map<std::string, const CaseResult*>> by_policy;
  for (const CaseResult& r : results) {
    const bool fresh = by_policy[r.policy].emplace(r.id, &r).second;
    check(fresh, "results: policy '" + r.policy + "' has two results for case '" + r.id + "'");
  }
  const std::vector<size_t> lengths = lengths_in(results);
  std::vector<Agreement> out;
  const auto base = by_policy.find(std::string(baseline));
  for (const std::string& policy : policies_in(results, baseline)) {
    if (policy == baseline) continue;
    Agreement a;
    a.policy = policy;
    a.lengths = lengths;
    a.by_length.assign(lengths.size(), {});
    if (base != by_policy.end()) {
      // Walk the policy's results in input order so that the outcome does not depend on hashing.
      for (const CaseResult& r : results) {
        if (r.policy != policy) continue;
        const auto b = base->second.find(r.id);
        if (b == base->second.end() || !b->second->pass) continue;
        a.by_length[index_of(lengths, r.length)].add(r.pass);
        a.overall.add(r.pass);
      }
    }
    out.push_back(std::move(a));
  }
  return out;
}

std::string markdown_report(const std::vector<CaseResult>& results, std::string_view baseline) {
  std::string out =
      "# Accuracy\n\nPass rate, with passed/total cases, per task and context length (tokens).\n";
  const std::vector<std::string> policies = policies_in(results, baseline);
  for (const std::string& policy : policies) {
    out.append("\n## ").append(policy).append("\n\n");
    markdown_grid(out, task_length_grid(results, policy), "task");
    for (const std::string& task : tasks_in(results)) {
      const PassGrid g = depth_length_grid(results, policy, task);
      if (g.rows() == 0) continue;
      out.append("\n### ").append(policy).append(": ").append(task).append(" by depth\n\n");
      markdown_grid(out, g, "depth");
    }
  }
  if (policies.size() > 1 && policies.front() == baseline) {
    const std::vector<Agreement> agreements = agreement_with_baseline(results, baseline);
    out.append("\n## Agreement with ").append(baseline).append("\n\nOf the cases ").append(baseline);
    out.append(" passes, the share each policy also passes.\n\n");
    std::vector<std::string> cols;
    for (size_t l : agreements.front().lengths) cols.push_back(format_length(l));
    markdown_header(out, "policy", cols);
    for (const Agreement& a : agreements) {
      out.append("|");
      cell(out, a.policy);
      for (const PassRate& p : a.by_length) cell(out, format_rate(p));
      cell(out, format_rate(a.overall));
      out.append("\n");
    }
  }
  return out;
}

}  // namespace tessera::eval
