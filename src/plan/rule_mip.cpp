#include "plan/rule_mip.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "core/error.h"

#ifdef TESSERA_WITH_CBC
#include <Cbc_C_Interface.h>
#endif

namespace tessera::plan {

namespace {

void check_problem(const RuleAssignmentProblem& p) {
  const size_t cells = static_cast<size_t>(p.items()) * static_cast<size_t>(p.options);
  check(p.groups > 0 && p.items_per_group > 0 && p.options > 0, "rule assignment: empty problem");
  check(p.cost.size() == cells, "rule assignment: cost table has the wrong size");
  check(p.weights.size() == p.weight_limits.size(), "rule assignment: density constraints without limits");
  for (const auto& w : p.weights)
    check(w.size() == static_cast<size_t>(p.options), "rule assignment: density table has the wrong size");
  check(p.cap_costs.size() == p.caps.size(), "rule assignment: epsilon constraints without caps");
  for (const auto& c : p.cap_costs) check(c.size() == cells, "rule assignment: cap table has the wrong size");
  check(p.max_options_per_group >= 1, "rule assignment: max options per group must be >= 1");
  check(p.allowed.empty() || p.allowed.size() == cells, "rule assignment: allowed table has the wrong size");
}

double scale_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s = std::max(s, std::abs(x));
  return s > 0 ? s : 1.0;
}

bool feasible(const RuleAssignmentProblem& p, const std::vector<int32_t>& choice) {
  const int32_t n = p.items();
  if (!p.allowed.empty())
    for (int32_t i = 0; i < n; ++i)
      if (p.allowed[static_cast<size_t>(i) * static_cast<size_t>(p.options) +
                    static_cast<size_t>(choice[static_cast<size_t>(i)])] == 0)
        return false;
  for (int32_t g = 0; g < p.groups; ++g) {
    std::set<int32_t> used(choice.begin() + g * p.items_per_group, choice.begin() + (g + 1) * p.items_per_group);
    if (static_cast<int32_t>(used.size()) > p.max_options_per_group) return false;
  }
  for (size_t k = 0; k < p.weights.size(); ++k) {
    double sum = 0;
    for (int32_t i = 0; i < n; ++i) sum += p.weights[k][static_cast<size_t>(choice[static_cast<size_t>(i)])];
    if (sum / n > p.weight_limits[k] + 1e-9) return false;
  }
  for (size_t m = 0; m < p.caps.size(); ++m)
    if (assignment_sum(p.cap_costs[m], p.options, choice) > p.caps[m] + 1e-9 * scale_of(p.cap_costs[m])) return false;
  return true;
}

}  // namespace

double assignment_sum(const std::vector<double>& table, int32_t options, const std::vector<int32_t>& choice) {
  double s = 0;
  for (size_t i = 0; i < choice.size(); ++i)
    s += table[i * static_cast<size_t>(options) + static_cast<size_t>(choice[i])];
  return s;
}

bool have_mip_solver() {
#ifdef TESSERA_WITH_CBC
  return true;
#else
  return false;
#endif
}

std::optional<RuleAssignment> solve_rule_assignment_exhaustive(const RuleAssignmentProblem& p) {
  check_problem(p);
  const int32_t n = p.items();
  check(std::pow(static_cast<double>(p.options), n) <= 2e6, "rule assignment: too large to enumerate");
  std::vector<int32_t> choice(static_cast<size_t>(n), 0);
  std::optional<RuleAssignment> best;
  for (;;) {
    if (feasible(p, choice)) {
      const double obj = assignment_sum(p.cost, p.options, choice);
      if (!best || obj < best->objective - 1e-15) best = RuleAssignment{choice, obj, true};
    }
    int32_t i = 0;
    while (i < n && ++choice[static_cast<size_t>(i)] == p.options) choice[static_cast<size_t>(i++)] = 0;
    if (i == n) break;
  }
  return best;
}

std::optional<RuleAssignment> solve_rule_assignment(const RuleAssignmentProblem& p) {
  check_problem(p);
#ifndef TESSERA_WITH_CBC
  throw Error("MoA's optimiser needs the CBC solver, which this build of tessera lacks: install coinor-libcbc-dev "
              "(scripts/setup.sh does) and rebuild");
#else
  const int32_t n = p.items(), R = p.options, G = p.groups;
  const double cost_scale = scale_of(p.cost);
  Cbc_Model* m = Cbc_newModel();
  struct Guard {
    Cbc_Model* m;
    ~Guard() { Cbc_deleteModel(m); }
  } guard{m};
  Cbc_setLogLevel(m, 0);
  // Columns: x[i][r] (n * R), then y[g][r] (G * R).
  auto x = [&](int32_t i, int32_t r) { return i * R + r; };
  auto y = [&](int32_t g, int32_t r) { return n * R + g * R + r; };
  for (int32_t i = 0; i < n; ++i)
    for (int32_t r = 0; r < R; ++r)
      Cbc_addCol(m, "", 0.0, p.allowed.empty() || p.allowed[static_cast<size_t>(x(i, r))] ? 1.0 : 0.0,
                 p.cost[static_cast<size_t>(x(i, r))] / cost_scale, 1, 0, nullptr, nullptr);
  for (int32_t g = 0; g < G; ++g)
    for (int32_t r = 0; r < R; ++r) Cbc_addCol(m, "", 0.0, 1.0, 0.0, 1, 0, nullptr, nullptr);
  std::vector<int> cols;
  std::vector<double> coefs;
  for (int32_t i = 0; i < n; ++i) {  // one option per item
    cols.clear();
    coefs.clear();
    for (int32_t r = 0; r < R; ++r) {
      cols.push_back(x(i, r));
      coefs.push_back(1.0);
    }
    Cbc_addRow(m, "", R, cols.data(), coefs.data(), 'E', 1.0);
  }
  for (int32_t i = 0; i < n; ++i) {  // x <= y of its group
    const int32_t g = i / p.items_per_group;
    for (int32_t r = 0; r < R; ++r) {
      const int c[2] = {x(i, r), y(g, r)};
      const double v[2] = {1.0, -1.0};
      Cbc_addRow(m, "", 2, c, v, 'L', 0.0);
    }
  }
  for (int32_t g = 0; g < G; ++g) {  // at most max_options_per_group options per group
    cols.clear();
    coefs.clear();
    for (int32_t r = 0; r < R; ++r) {
      cols.push_back(y(g, r));
      coefs.push_back(1.0);
    }
    Cbc_addRow(m, "", R, cols.data(), coefs.data(), 'L', p.max_options_per_group);
  }
  for (size_t k = 0; k < p.weights.size(); ++k) {  // mean weight within its limit
    cols.clear();
    coefs.clear();
    for (int32_t i = 0; i < n; ++i)
      for (int32_t r = 0; r < R; ++r) {
        cols.push_back(x(i, r));
        coefs.push_back(p.weights[k][static_cast<size_t>(r)]);
      }
    Cbc_addRow(m, "", static_cast<int>(cols.size()), cols.data(), coefs.data(), 'L', p.weight_limits[k] * n);
  }
  for (size_t c = 0; c < p.caps.size(); ++c) {  // epsilon constraints
    const double s = scale_of(p.cap_costs[c]);
    cols.clear();
    coefs.clear();
    for (int32_t i = 0; i < n; ++i)
      for (int32_t r = 0; r < R; ++r) {
        cols.push_back(x(i, r));
        coefs.push_back(p.cap_costs[c][static_cast<size_t>(x(i, r))] / s);
      }
    Cbc_addRow(m, "", static_cast<int>(cols.size()), cols.data(), coefs.data(), 'L', p.caps[c] / s + 1e-9);
  }
  // CBC 2.10's coefficient diving heuristic (on by default) can abort the process on an assertion in
  // CbcHeuristicDive::reducedCostFix ("getColumnStatus(iColumn) == ClpSimplex::atLowerBound || ... isFixed"): it
  // did on SmolLM2's every-row profile at 2K + 4K, in an epsilon-constraint program (docs/plans/README.md, "Every
  // row at 2K and 4K"). The heuristic only finds incumbents early; branch and bound proves the same optimum.
  Cbc_setParameter(m, "DivingCoefficient", "off");
  Cbc_setMaximumSeconds(m, p.time_limit_seconds);
  Cbc_setAllowableGap(m, 0.0);
  Cbc_solve(m);
  if (Cbc_isProvenInfeasible(m)) return std::nullopt;
  const double* sol = Cbc_getColSolution(m);
  if (sol == nullptr || Cbc_numberSavedSolutions(m) < 1) return std::nullopt;
  RuleAssignment out;
  out.choice.assign(static_cast<size_t>(n), 0);
  for (int32_t i = 0; i < n; ++i) {
    int32_t best = 0;
    for (int32_t r = 1; r < R; ++r)
      if (sol[x(i, r)] > sol[x(i, best)]) best = r;
    out.choice[static_cast<size_t>(i)] = best;
  }
  out.objective = assignment_sum(p.cost, R, out.choice);
  out.proven_optimal = Cbc_isProvenOptimal(m) != 0;
  if (!feasible(p, out.choice)) return std::nullopt;
  return out;
#endif
}

}  // namespace tessera::plan
