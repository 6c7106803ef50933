// tessera/plan/rule_mip.h — MoA's optimisation step as a mixed-integer program, solved by CBC (COIN-OR).
//
// Items (attention heads) come in groups (layers) of equal size; each item takes exactly one option (an elastic
// rule). With x[i][r] in {0, 1} and y[g][r] in {0, 1}:
//   minimise    sum_i sum_r cost[i][r] x[i][r]
//   subject to  sum_r x[i][r] = 1                                  for every item i
//               x[i][r] <= y[group(i)][r],  sum_r y[g][r] <= max_options_per_group     for every group g
//               (1 / items) sum_i sum_r weight_k[r] x[i][r] <= limit_k      (mean density at each length k)
//               sum_i sum_r cap_cost_m[i][r] x[i][r] <= cap_m             (MoA's epsilon constraints)
//               x[i][r] = 0 where allowed[i][r] = 0                        (MoA's per-head loss cap)
// Costs are rescaled internally (the influence sums are tiny numbers); the returned objective is in the caller's
// units.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace tessera::plan {

struct RuleAssignmentProblem {
  int32_t groups = 0;
  int32_t items_per_group = 0;
  int32_t options = 0;
  std::vector<double> cost;                       // [items * options], item-major
  std::vector<std::vector<double>> weights;       // per density constraint: [options]
  std::vector<double> weight_limits;              // per density constraint: the mean's upper bound
  std::vector<std::vector<double>> cap_costs;     // per epsilon constraint: [items * options]
  std::vector<double> caps;                       // per epsilon constraint: the sum's upper bound
  std::vector<uint8_t> allowed;                   // [items * options]: 0 forbids the option to the item; empty: all
  int32_t max_options_per_group = 2;
  double time_limit_seconds = 60;
  int32_t items() const { return groups * items_per_group; }
};

struct RuleAssignment {
  std::vector<int32_t> choice;  // option per item
  double objective = 0;         // sum of cost over the choice
  bool proven_optimal = false;  // false: the time limit stopped the search with a feasible solution
};

// Whether this build has a solver (CBC); without one solve_rule_assignment throws tessera::Error saying how to
// get it.
bool have_mip_solver();

// The optimal (or, at the time limit, best found) assignment; nullopt when the constraints cannot be met.
// Throws tessera::Error for inconsistent sizes.
std::optional<RuleAssignment> solve_rule_assignment(const RuleAssignmentProblem& problem);

// The same by enumeration (options^items assignments): for tests on tiny problems only.
std::optional<RuleAssignment> solve_rule_assignment_exhaustive(const RuleAssignmentProblem& problem);

// Sum of `table` ([items * options]) over a choice.
double assignment_sum(const std::vector<double>& table, int32_t options, const std::vector<int32_t>& choice);

}  // namespace tessera::plan
