#include "plan/moa_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "core/error.h"
#include "plan/rule_mip.h"

namespace tessera::plan {

std::vector<ElasticRule> moa_rule_space(int32_t beta_steps) {
  check(beta_steps >= 1 && beta_steps <= 64, "moa: beta steps must be in [1, 64], got " + std::to_string(beta_steps));
  std::vector<ElasticRule> rules;
  for (int a = 0; a < 6; ++a)
    for (int b = 0; b <= beta_steps; ++b)
      rules.push_back({-2048.0 + 2048.0 * a, static_cast<double>(b) / static_cast<double>(beta_steps)});
  return rules;
}

namespace {

attn::SparseIndex lower_static(const attn::Pattern& pattern, int32_t length) {
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(length, kProfileBlock);
  attn::SparseIndex index;
  index.tile = kProfileBlock;
  index.q_begin = 0;
  index.q_len = length;
  index.kv_len = length;
  index.range_offsets = {0};
  index.column_offsets = {0};
  attn::lower_head(pattern, std::monostate{}, ctx, index);
  return index;
}

}  // namespace

double pattern_density_exact(const attn::Pattern& pattern, int32_t length) {
  return attn::index_stats(lower_static(pattern, length)).density();
}

BlockCoverage block_coverage(const attn::Pattern& pattern, int32_t length) {
  const int32_t B = kProfileBlock;
  const attn::SparseIndex index = lower_static(pattern, length);
  BlockCoverage c;
  c.num_blocks = (length + B - 1) / B;
  const size_t nb = static_cast<size_t>(c.num_blocks);
  c.kept.assign(nb * nb, 0.0);
  std::vector<double> causal(nb * nb, 0.0);
  for (int32_t t = 0; t < index.num_tiles(); ++t) {
    for (int32_t p = t * B; p < std::min(length, (t + 1) * B); ++p) {
      auto add = [&](int32_t b, int32_t e, std::vector<double>& into) {
        e = std::min(e, p + 1);
        while (b < e) {
          const int32_t kb = b / B, stop = std::min(e, (kb + 1) * B);
          into[static_cast<size_t>(t) * nb + static_cast<size_t>(kb)] += stop - b;
          b = stop;
        }
      };
      for (const attn::KeyRange& r : index.ranges_of(0, t)) add(r.begin, r.end, c.kept);
      for (int32_t col : index.columns_of(0, t))
        if (col <= p) c.kept[static_cast<size_t>(t) * nb + static_cast<size_t>(col / B)] += 1;
      add(0, p + 1, causal);
    }
  }
  for (size_t i = 0; i < c.kept.size(); ++i) c.kept[i] = causal[i] > 0 ? c.kept[i] / causal[i] : 0.0;
  c.density = attn::index_stats(index).density();
  return c;
}

std::vector<std::vector<double>> rule_densities(const std::vector<ElasticRule>& rules, int32_t sink,
                                                const std::vector<int32_t>& lengths) {
  std::vector<std::vector<double>> out;
  for (int32_t n : lengths) {
    std::vector<double> d;
    for (const ElasticRule& r : rules) d.push_back(pattern_density_exact(attn::ElasticWindowPattern{r.alpha, r.beta, sink}, n));
    out.push_back(std::move(d));
  }
  return out;
}

const char* loss_estimate_name(LossEstimate e) { return e == LossEstimate::Fisher ? "fisher" : "first-order"; }

LossEstimate parse_loss_estimate(const std::string& name) {
  if (name == "first-order") return LossEstimate::FirstOrder;
  if (name == "fisher") return LossEstimate::Fisher;
  throw Error("--moa-loss must be first-order or fisher, got '" + name + "'");
}

namespace {

std::string num_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// d = sum over the causal blocks of (1 - kept) * e for one head's [nb][nb] influence.
double masked_sum(const std::vector<double>& kept, const double* e, size_t nb) {
  double s = 0;
  for (size_t qb = 0; qb < nb; ++qb)
    for (size_t kb = 0; kb <= qb; ++kb) s += (1.0 - kept[qb * nb + kb]) * e[qb * nb + kb];
  return s;
}

}  // namespace

std::vector<std::vector<double>> rule_losses(const GradientProfile& profile, const std::vector<ElasticRule>& rules,
                                             int32_t sink, LossEstimate estimate) {
  const size_t R = rules.size();
  const int32_t heads = profile.num_layers * profile.num_q_heads;
  std::vector<std::vector<double>> out;
  for (const LengthProfile& lp : profile.lengths) {
    check(estimate == LossEstimate::FirstOrder || !lp.sample_influence.empty(),
          "moa: the fisher loss needs a profile made with keep_samples");
    std::vector<double> loss(static_cast<size_t>(heads) * R, 0.0);
    const size_t nb = static_cast<size_t>(lp.num_blocks);
    const size_t per_head = nb * nb;
    for (size_t r = 0; r < R; ++r) {
      const BlockCoverage c = block_coverage(attn::ElasticWindowPattern{rules[r].alpha, rules[r].beta, sink}, lp.length);
      for (int32_t hh = 0; hh < heads; ++hh) {
        const size_t at = static_cast<size_t>(hh) * per_head;
        double v = 0;
        if (estimate == LossEstimate::FirstOrder) {
          v = masked_sum(c.kept, lp.influence.data() + at, nb);
        } else {
          for (const std::vector<double>& e : lp.sample_influence) {
            const double d = masked_sum(c.kept, e.data() + at, nb);
            v += 0.5 * d * d;
          }
          v /= static_cast<double>(lp.sample_influence.size());
        }
        loss[static_cast<size_t>(hh) * R + r] = v;
      }
    }
    out.push_back(std::move(loss));
  }
  return out;
}

std::vector<std::vector<double>> head_lost_shares(const GradientProfile& profile, const std::vector<ElasticRule>& rules,
                                                  int32_t sink) {
  const size_t R = rules.size();
  const size_t heads = static_cast<size_t>(profile.num_layers) * static_cast<size_t>(profile.num_q_heads);
  std::vector<std::vector<double>> out;
  for (const LengthProfile& lp : profile.lengths) {
    const size_t nb = static_cast<size_t>(lp.num_blocks);
    const size_t per_head = nb * nb;
    std::vector<double> mass(heads * per_head, 0.0);
    if (lp.sample_influence.empty()) {
      for (size_t i = 0; i < mass.size(); ++i) mass[i] = std::abs(lp.influence[i]);
    } else {
      for (const std::vector<double>& e : lp.sample_influence)
        for (size_t i = 0; i < mass.size(); ++i) mass[i] += std::abs(e[i]);
      for (double& m : mass) m /= static_cast<double>(lp.sample_influence.size());
    }
    std::vector<double> total(heads, 0.0);
    for (size_t h = 0; h < heads; ++h)
      for (size_t qb = 0; qb < nb; ++qb)
        for (size_t kb = 0; kb <= qb; ++kb) total[h] += mass[h * per_head + qb * nb + kb];
    std::vector<double> share(heads * R, 0.0);
    for (size_t r = 0; r < R; ++r) {
      const BlockCoverage c = block_coverage(attn::ElasticWindowPattern{rules[r].alpha, rules[r].beta, sink}, lp.length);
      for (size_t h = 0; h < heads; ++h)
        if (total[h] > 0) share[h * R + r] = masked_sum(c.kept, mass.data() + h * per_head, nb) / total[h];
    }
    out.push_back(std::move(share));
  }
  return out;
}

MoaResult plan_moa(const GradientProfile& profile, int32_t num_kv_heads, const MoaOptions& o,
                   const PlanValidation& validate, const std::function<void(const std::string&)>& progress) {
  check(o.budget > 0 && o.budget <= 1, "moa: budget must be in (0, 1], got " + std::to_string(o.budget));
  check(o.head_loss_cap > 0, "moa: the per-head cap must be > 0, got " + num_text(o.head_loss_cap));
  check(!profile.lengths.empty(), "moa: the profile has no lengths");
  const std::vector<ElasticRule> rules = moa_rule_space(o.beta_steps);
  const auto R = static_cast<int32_t>(rules.size());
  MoaResult result;
  for (const LengthProfile& lp : profile.lengths) result.lengths.push_back(lp.length);
  const auto K = result.lengths.size();
  const auto densities = rule_densities(rules, o.sink, result.lengths);
  const auto losses = rule_losses(profile, rules, o.sink, o.estimate);
  for (size_t k = 0; k < K; ++k) {
    const double sparsest = *std::min_element(densities[k].begin(), densities[k].end());
    check(sparsest <= o.budget, "moa: no plan meets the budget " + std::to_string(o.budget) + " at length " +
                                    std::to_string(result.lengths[k]) + " (the sparsest rule has density " +
                                    std::to_string(sparsest) + ")");
  }

  // Rules that mask the same cells at every profiled length (at 2K, every alpha >= 2048 is dense) are one option
  // to the solver: the first of each class (smallest alpha, then beta) stands for it. This shrinks the programs
  // several times over without changing their optimum.
  std::vector<std::vector<std::vector<double>>> kept(K);  // [length][rule]: block coverage
  for (size_t k = 0; k < K; ++k)
    for (const ElasticRule& r : rules)
      kept[k].push_back(block_coverage(attn::ElasticWindowPattern{r.alpha, r.beta, o.sink}, result.lengths[k]).kept);
  std::vector<int32_t> reps;  // option -> rule
  for (int32_t r = 0; r < R; ++r) {
    const ElasticRule& rule = rules[static_cast<size_t>(r)];
    if (!o.allow_sink_only &&
        std::any_of(result.lengths.begin(), result.lengths.end(), [&](int32_t n) { return rule.alpha + rule.beta * n <= 0; }))
      continue;
    const bool duplicate = std::any_of(reps.begin(), reps.end(), [&](int32_t q) {
      for (size_t k = 0; k < K; ++k)
        if (densities[k][static_cast<size_t>(q)] != densities[k][static_cast<size_t>(r)] ||
            kept[k][static_cast<size_t>(q)] != kept[k][static_cast<size_t>(r)])
          return false;
      return true;
    });
    if (!duplicate) reps.push_back(r);
  }
  const auto O = static_cast<int32_t>(reps.size());
  const size_t heads = static_cast<size_t>(profile.num_layers) * static_cast<size_t>(profile.num_q_heads);
  // Heads of the model's sliding-window layers: left to the model (see MoaOptions::layer_windows).
  std::vector<uint8_t> fixed(heads, 0);
  for (size_t l = 0; l < o.layer_windows.size() && l < static_cast<size_t>(profile.num_layers); ++l)
    if (o.layer_windows[l] > 0)
      std::fill_n(fixed.begin() + static_cast<std::ptrdiff_t>(l * static_cast<size_t>(profile.num_q_heads)),
                  profile.num_q_heads, uint8_t{1});
  const auto num_fixed = static_cast<size_t>(std::count(fixed.begin(), fixed.end(), uint8_t{1}));
  check(num_fixed < heads, "moa: every layer has a sliding window: nothing to plan");
  std::vector<uint8_t> allowed;  // [head * option]: within the per-head cap at every profiled length
  if (o.head_loss_cap < 1) {
    const auto shares = head_lost_shares(profile, rules, o.sink);
    allowed.assign(heads * static_cast<size_t>(O), 1);
    for (size_t h = 0; h < heads; ++h)
      for (int32_t i = 0; i < O; ++i)
        for (size_t k = 0; k < K; ++k)
          if (shares[k][h * static_cast<size_t>(R) + static_cast<size_t>(reps[static_cast<size_t>(i)])] >
              o.head_loss_cap + 1e-12)
            allowed[h * static_cast<size_t>(O) + static_cast<size_t>(i)] = 0;
  }
  std::vector<std::vector<double>> opt_densities(K), opt_losses(K);
  for (size_t k = 0; k < K; ++k) {
    for (int32_t q : reps) opt_densities[k].push_back(densities[k][static_cast<size_t>(q)]);
    opt_losses[k].resize(heads * static_cast<size_t>(O));
    for (size_t h = 0; h < heads; ++h)
      for (int32_t i = 0; i < O; ++i)
        opt_losses[k][h * static_cast<size_t>(O) + static_cast<size_t>(i)] =
            losses[k][h * static_cast<size_t>(R) + static_cast<size_t>(reps[static_cast<size_t>(i)])];
  }
  result.options = O;
  // The densest option (the rule that keeps every key at each length) for the fixed heads, and a limit on the mean
  // over all heads that holds the planned heads to the budget.
  int32_t densest = 0;
  for (int32_t i = 1; i < O; ++i)
    if (opt_densities[K - 1][static_cast<size_t>(i)] > opt_densities[K - 1][static_cast<size_t>(densest)]) densest = i;
  std::vector<double> limits(K, o.budget);
  if (num_fixed > 0) {
    if (allowed.empty()) allowed.assign(heads * static_cast<size_t>(O), 1);
    for (size_t h = 0; h < heads; ++h)
      if (fixed[h])
        for (int32_t i = 0; i < O; ++i) allowed[h * static_cast<size_t>(O) + static_cast<size_t>(i)] = i == densest;
    for (size_t k = 0; k < K; ++k)
      limits[k] = (o.budget * static_cast<double>(heads - num_fixed) +
                   opt_densities[k][static_cast<size_t>(densest)] * static_cast<double>(num_fixed)) /
                  static_cast<double>(heads);
  }

  RuleAssignmentProblem base;
  base.groups = profile.num_layers;
  base.items_per_group = profile.num_q_heads;
  base.options = O;
  base.weights = opt_densities;
  base.weight_limits = limits;
  base.max_options_per_group = o.max_rules_per_layer;
  base.time_limit_seconds = o.time_limit_seconds;
  base.allowed = allowed;

  auto candidate = [&](const RuleAssignment& a) {
    MoaCandidate c;
    for (int32_t i : a.choice) c.rule_of_head.push_back(reps[static_cast<size_t>(i)]);
    c.proven_optimal = a.proven_optimal;
    for (size_t k = 0; k < K; ++k) {
      c.loss.push_back(assignment_sum(losses[k], R, c.rule_of_head));
      double d = 0;
      for (size_t h = 0; h < heads; ++h)
        if (!fixed[h]) d += densities[k][static_cast<size_t>(c.rule_of_head[h])];
      c.density.push_back(d / static_cast<double>(heads - num_fixed));
    }
    return c;
  };
  auto solve = [&](RuleAssignmentProblem p) {
    ++result.mips;
    return solve_rule_assignment(p);
  };

  // The primary objective is the longest length's loss.
  const size_t primary = K - 1;
  RuleAssignmentProblem first = base;
  first.cost = opt_losses[primary];
  if (progress) progress("moa: MIP at length " + std::to_string(result.lengths[primary]));
  const auto a0 = solve(first);
  if (!a0 && o.head_loss_cap < 1)
    throw Error("moa: no plan meets the budget " + num_text(o.budget) + " within the per-head cap " +
                num_text(o.head_loss_cap));
  check(a0.has_value(), "moa: no plan meets the budget (the MIP is infeasible)");
  std::vector<MoaCandidate> all{candidate(*a0)};
  if (K > 1) {
    // Each secondary length's own optimum bounds its range of caps.
    std::vector<double> lo(K), hi(K);
    for (size_t k = 0; k + 1 < K; ++k) {
      RuleAssignmentProblem p = base;
      p.cost = opt_losses[k];
      if (progress) progress("moa: MIP at length " + std::to_string(result.lengths[k]));
      const auto a = solve(p);
      check(a.has_value(), "moa: no plan meets the budget (the MIP is infeasible)");
      all.push_back(candidate(*a));
      lo[k] = a->objective;
      hi[k] = all.front().loss[k];
    }
    // The grid of caps over the secondary lengths.
    const size_t secondaries = K - 1;
    std::vector<int32_t> level(secondaries, 0);
    for (;;) {
      RuleAssignmentProblem p = base;
      p.cost = opt_losses[primary];
      for (size_t k = 0; k < secondaries; ++k) {
        p.cap_costs.push_back(opt_losses[k]);
        p.caps.push_back(lo[k] + (hi[k] - lo[k]) * level[k] / std::max(1, o.intervals));
      }
      if (progress) progress("moa: epsilon-constraint MIP " + std::to_string(result.mips + 1));
      if (const auto a = solve(p)) all.push_back(candidate(*a));
      size_t k = 0;
      while (k < secondaries && ++level[k] > o.intervals) level[k++] = 0;
      if (k == secondaries) break;
    }
  }
  // Distinct, Pareto-optimal plans.
  std::set<std::vector<int32_t>> seen;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!seen.insert(all[i].rule_of_head).second) continue;
    bool dominated = false;
    for (size_t j = 0; j < all.size() && !dominated; ++j) {
      if (all[j].rule_of_head == all[i].rule_of_head) continue;
      bool no_worse = true, better = false;
      for (size_t k = 0; k < K; ++k) {
        if (all[j].loss[k] > all[i].loss[k] + 1e-12 * std::abs(all[i].loss[k])) no_worse = false;
        if (all[j].loss[k] < all[i].loss[k] - 1e-12 * std::abs(all[i].loss[k])) better = true;
      }
      dominated = no_worse && better;
    }
    if (!dominated) result.pareto.push_back(all[i]);
  }
  auto policy_of = [&](const MoaCandidate& c) {
    std::vector<attn::Pattern> table;
    for (size_t h = 0; h < heads; ++h) {
      const ElasticRule& rule = rules[static_cast<size_t>(c.rule_of_head[h])];
      if (fixed[h])
        table.emplace_back(attn::DensePattern{});  // within the model's window
      else
        table.emplace_back(attn::ElasticWindowPattern{rule.alpha, rule.beta, o.sink});
    }
    return attn::AttentionPolicy(profile.num_layers, profile.num_q_heads, num_kv_heads, std::move(table));
  };
  result.chosen = 0;
  if (validate) {
    std::vector<ValidationScore> scores;
    for (size_t i = 0; i < result.pareto.size(); ++i) {
      if (progress) progress("moa: validation of Pareto plan " + std::to_string(i + 1) + " of " +
                             std::to_string(result.pareto.size()));
      scores.push_back(validate(policy_of(result.pareto[i])));
      result.pareto[i].validation_perplexity = scores.back().perplexity;
      result.pareto[i].validation_agreement = scores.back().agreement;
    }
    result.chosen = select_by_validation(scores);
  } else {
    // Without validation: the plan with the least loss at the primary length.
    for (size_t i = 1; i < result.pareto.size(); ++i)
      if (result.pareto[i].loss[primary] < result.pareto[result.chosen].loss[primary]) result.chosen = i;
  }
  result.policy = policy_of(result.pareto[result.chosen]);
  return result;
}

size_t select_by_validation(const std::vector<ValidationScore>& scores) {
  check(!scores.empty(), "moa: no plans to select from");
  size_t best = 0;
  for (size_t i = 1; i < scores.size(); ++i) {
    const ValidationScore &a = scores[i], &b = scores[best];
    if (a.agreement >= 0 && b.agreement >= 0 && a.agreement != b.agreement) {
      if (a.agreement > b.agreement) best = i;
      continue;
    }
    if (a.perplexity > 0 && b.perplexity > 0 && a.perplexity < b.perplexity) best = i;
  }
  return best;
}

ValidationScore pooled_validation(int32_t kept, int32_t total, const std::vector<double>& perplexities) {
  check(kept >= 0 && kept <= total,
        "moa: held-out answers kept " + std::to_string(kept) + " of " + std::to_string(total));
  ValidationScore v;
  if (total > 0) v.agreement = static_cast<double>(kept) / total;
  double log_sum = 0;
  for (double p : perplexities) {
    check(p > 0 && std::isfinite(p), "moa: validation perplexity must be > 0, got " + num_text(p));
    log_sum += std::log(p);
  }
  if (!perplexities.empty()) v.perplexity = std::exp(log_sum / static_cast<double>(perplexities.size()));
  return v;
}

std::vector<LossComparison> compare_losses(const GradientProfile& profile, const std::vector<attn::Pattern>& plan,
                                           const std::vector<attn::Pattern>& other, LossEstimate estimate) {
  const size_t heads = static_cast<size_t>(profile.num_layers) * static_cast<size_t>(profile.num_q_heads);
  check(plan.size() == heads && other.size() == heads,
        "moa: compare_losses needs one pattern per head (" + std::to_string(heads) + "), got " +
            std::to_string(plan.size()) + " and " + std::to_string(other.size()));
  auto mean_se = [](const std::vector<double>& v, double& mean, double& se) {
    const auto n = static_cast<double>(v.size());
    mean = 0;
    for (double x : v) mean += x;
    mean /= n;
    if (v.size() < 2) {
      se = std::numeric_limits<double>::quiet_NaN();
      return;
    }
    double ss = 0;
    for (double x : v) ss += (x - mean) * (x - mean);
    se = std::sqrt(ss / (n - 1) / n);
  };
  std::vector<LossComparison> out;
  for (const LengthProfile& lp : profile.lengths) {
    check(!lp.sample_influence.empty(), "moa: compare_losses needs a profile made with keep_samples");
    const size_t nb = static_cast<size_t>(lp.num_blocks);
    std::map<std::string, std::vector<double>> coverage;  // by pattern: kept fraction per block
    auto kept_of = [&](const attn::Pattern& p) -> const std::vector<double>& {
      const std::string key = attn::describe(p);
      auto it = coverage.find(key);
      if (it == coverage.end()) it = coverage.emplace(key, block_coverage(p, lp.length).kept).first;
      return it->second;
    };
    std::vector<double> lp_plan, lp_other, lp_diff;
    for (const std::vector<double>& e : lp.sample_influence) {
      double a = 0, b = 0;
      auto term = [&](double d) { return estimate == LossEstimate::Fisher ? 0.5 * d * d : d; };
      for (size_t hh = 0; hh < heads; ++hh) {
        const double* eh = e.data() + hh * nb * nb;
        a += term(masked_sum(kept_of(plan[hh]), eh, nb));
        b += term(masked_sum(kept_of(other[hh]), eh, nb));
      }
      lp_plan.push_back(a);
      lp_other.push_back(b);
      lp_diff.push_back(a - b);
    }
    LossComparison c;
    c.length = lp.length;
    c.samples = static_cast<int32_t>(lp.sample_influence.size());
    mean_se(lp_plan, c.loss, c.loss_se);
    mean_se(lp_other, c.other, c.other_se);
    mean_se(lp_diff, c.diff, c.diff_se);
    out.push_back(c);
  }
  return out;
}

attn::ElasticWindowPattern uniform_window_for(double density, int32_t length, int32_t sink) {
  check(density > 0 && density <= 1, "moa: a window density must be in (0, 1], got " + std::to_string(density));
  double lo = 0, hi = 1;
  while (hi - lo > 1e-6) {
    const double mid = (lo + hi) / 2;
    if (pattern_density_exact(attn::ElasticWindowPattern{0, mid, sink}, length) >= density)
      hi = mid;
    else
      lo = mid;
  }
  return attn::ElasticWindowPattern{0, hi, sink};
}

namespace {

constexpr char kProfileMagic[8] = {'T', 'S', 'M', 'O', 'A', 'P', 'R', '1'};

template <typename T>
void put(std::ofstream& f, const T& v) {
  f.write(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_doubles(std::ofstream& f, const std::vector<double>& v) {
  put(f, static_cast<uint64_t>(v.size()));
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(double)));
}

}  // namespace

void save_moa_profile(const GradientProfile& profile, const std::string& path) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  check(f.good(), "moa: cannot write the profile file '" + path + "'");
  f.write(kProfileMagic, sizeof kProfileMagic);
  put(f, profile.num_layers);
  put(f, profile.num_q_heads);
  put(f, static_cast<int32_t>(profile.lengths.size()));
  put(f, profile.loss);
  put(f, profile.seconds);
  for (const LengthProfile& lp : profile.lengths) {
    put(f, lp.length);
    put(f, lp.num_blocks);
    put(f, lp.samples);
    put(f, static_cast<int32_t>(lp.sample_influence.size()));
    put_doubles(f, lp.influence);
    for (const std::vector<double>& e : lp.sample_influence) put_doubles(f, e);
  }
  f.flush();
  check(f.good(), "moa: writing the profile file '" + path + "' failed");
}

GradientProfile load_moa_profile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  check(f.good(), "moa: cannot read the profile file '" + path + "'");
  auto fail = [&](const std::string& why) { throw Error("moa: the profile file '" + path + "' " + why); };
  auto get = [&](auto& v) {
    f.read(reinterpret_cast<char*>(&v), sizeof v);
    if (!f) fail("is truncated");
  };
  char magic[sizeof kProfileMagic] = {};
  f.read(magic, sizeof magic);
  if (!f || std::memcmp(magic, kProfileMagic, sizeof magic) != 0) fail("is not a MoA profile (no TSMOAPR1 magic)");
  GradientProfile p;
  int32_t count = 0;
  get(p.num_layers);
  get(p.num_q_heads);
  get(count);
  get(p.loss);
  get(p.seconds);
  if (p.num_layers <= 0 || p.num_q_heads <= 0 || count <= 0 || count > 64)
    fail("has a bad shape (" + std::to_string(p.num_layers) + " layers, " + std::to_string(p.num_q_heads) +
         " heads, " + std::to_string(count) + " lengths)");
  for (int32_t k = 0; k < count; ++k) {
    LengthProfile lp;
    int32_t kept = 0;
    get(lp.length);
    get(lp.num_blocks);
    get(lp.samples);
    get(kept);
    if (lp.length <= 0 || lp.num_blocks != (lp.length + kProfileBlock - 1) / kProfileBlock || lp.samples < 0 ||
        kept < 0 || kept > lp.samples)
      fail("has a bad length entry (length " + std::to_string(lp.length) + ", " + std::to_string(lp.num_blocks) +
           " blocks, " + std::to_string(lp.samples) + " samples, " + std::to_string(kept) + " kept)");
    const uint64_t want = static_cast<uint64_t>(p.num_layers) * static_cast<uint64_t>(p.num_q_heads) *
                          static_cast<uint64_t>(lp.num_blocks) * static_cast<uint64_t>(lp.num_blocks);
    auto get_doubles = [&](std::vector<double>& v) {
      uint64_t n = 0;
      get(n);
      if (n != want)
        fail("has " + std::to_string(n) + " influence values at length " + std::to_string(lp.length) + ", expected " +
             std::to_string(want));
      v.resize(n);
      f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(double)));
      if (!f) fail("is truncated");
    };
    get_doubles(lp.influence);
    lp.sample_influence.resize(static_cast<size_t>(kept));
    for (std::vector<double>& e : lp.sample_influence) get_doubles(e);
    if (!p.lengths.empty() && lp.length <= p.lengths.back().length) fail("has lengths out of order");
    p.lengths.push_back(std::move(lp));
  }
  if (f.peek() != std::char_traits<char>::eof()) fail("has data after its last length");
  return p;
}

LayerRepair repair_layers(const attn::AttentionPolicy& plan, double window_beta, const std::vector<int32_t>& lengths,
                          const std::function<double(const attn::AttentionPolicy&)>& log_perplexity,
                          const std::vector<int32_t>& layer_windows, int32_t sink, const std::vector<int32_t>& ks) {
  check(!lengths.empty(), "moa repair: no lengths");
  const int L = plan.num_layers(), H = plan.num_q_heads();
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      check(std::holds_alternative<attn::ElasticWindowPattern>(plan.at(l, h)) ||
                std::holds_alternative<attn::DensePattern>(plan.at(l, h)),
            "moa repair: layer " + std::to_string(l) + " head " + std::to_string(h) + " is " +
                attn::describe(plan.at(l, h)) + ", not a moa_window");
  auto model_window = [&](int l) {
    return static_cast<size_t>(l) < layer_windows.size() && layer_windows[static_cast<size_t>(l)] > 0;
  };
  auto win = [&](double beta) { return attn::Pattern(attn::ElasticWindowPattern{0.0, beta, sink}); };
  std::map<std::pair<std::string, int32_t>, double> memo;
  auto density_of = [&](const attn::Pattern& p, int32_t n) {
    std::string name = attn::describe(p);  // describe rounds beta: the exact values in the key
    if (const auto* e = std::get_if<attn::ElasticWindowPattern>(&p)) {
      char exact[96];
      std::snprintf(exact, sizeof exact, " %a %a", e->alpha, e->beta);
      name += exact;
    }
    const auto key = std::make_pair(name, n);
    auto it = memo.find(key);
    if (it == memo.end()) it = memo.emplace(key, pattern_density_exact(p, n)).first;
    return it->second;
  };
  using Table = std::vector<attn::Pattern>;  // layer-major
  auto at_length = [&](const Table& t, int32_t n) {
    double sum = 0;
    for (const attn::Pattern& p : t) sum += density_of(p, n);
    return sum / static_cast<double>(t.size());
  };
  auto density = [&](const Table& t) {
    double sum = 0;
    for (int32_t n : lengths) sum += at_length(t, n);
    return sum / static_cast<double>(lengths.size());
  };
  const Table planned = plan.table();
  // keep[l]: layer l as planned; the other layers (but the model's window layers) the window of `beta`.
  auto hybrid = [&](const std::vector<bool>& keep, double beta) {
    Table t = planned;
    for (int l = 0; l < L; ++l)
      if (!keep[static_cast<size_t>(l)] && !model_window(l))
        for (int h = 0; h < H; ++h) t[static_cast<size_t>(l * H + h)] = win(beta);
    return t;
  };
  auto policy_of = [&](Table t) { return attn::AttentionPolicy(L, H, plan.num_kv_heads(), std::move(t)); };
  auto lp_of = [&](const Table& t) { return log_perplexity(policy_of(t)); };
  char buf[256];
  LayerRepair r;
  r.window_beta = window_beta;
  const std::vector<bool> none(static_cast<size_t>(L), false);
  const Table W = hybrid(none, window_beta);
  r.window_lp = lp_of(W);
  r.plan_lp = log_perplexity(plan);
  const Table lo = hybrid(none, window_beta * 0.8), hi = hybrid(none, window_beta * 1.2);
  const double lp_lo = lp_of(lo), lp_hi = lp_of(hi), d_lo = density(lo), d_hi = density(hi), d_w = density(W);
  r.slope = (lp_hi - lp_lo) / (d_hi - d_lo);
  std::snprintf(buf, sizeof buf,
                "window beta %.6f: log perplexity %.5f, density %.4f; the plan %.5f, density %.4f; slope %.4f per unit "
                "density (beta x0.8: %.5f at %.4f, x1.2: %.5f at %.4f)",
                window_beta, r.window_lp, d_w, r.plan_lp, density(planned), r.slope, lp_lo, d_lo, lp_hi, d_hi);
  r.lines.push_back(buf);
  std::vector<std::pair<double, int>> order;
  r.net.assign(static_cast<size_t>(L), 0.0);
  for (int l = 0; l < L; ++l) {
    if (model_window(l)) continue;
    std::vector<bool> keep = none;
    keep[static_cast<size_t>(l)] = true;
    const Table t = hybrid(keep, window_beta);
    const double delta = lp_of(t) - r.window_lp, dd = density(t) - d_w;
    r.net[static_cast<size_t>(l)] = delta - r.slope * dd;
    std::snprintf(buf, sizeof buf, "layer %d: change %+.5f, of which density %+.5f, net %+.5f", l, delta, r.slope * dd,
                  r.net[static_cast<size_t>(l)]);
    r.lines.push_back(buf);
    if (r.net[static_cast<size_t>(l)] < 0) order.emplace_back(r.net[static_cast<size_t>(l)], l);
  }
  std::sort(order.begin(), order.end());
  r.policy = policy_of(W);
  r.lp = r.window_lp;
  r.free_beta = window_beta;
  const double target = at_length(W, lengths.front());
  std::vector<int32_t> tried = ks;
  tried.push_back(static_cast<int32_t>(order.size()));
  std::sort(tried.begin(), tried.end());
  tried.erase(std::unique(tried.begin(), tried.end()), tried.end());
  bool first = true;
  for (int32_t k : tried) {
    if (k <= 0 || k > static_cast<int32_t>(order.size())) continue;
    std::vector<bool> keep = none;
    for (int32_t i = 0; i < k; ++i) keep[static_cast<size_t>(order[static_cast<size_t>(i)].second)] = true;
    double b_lo = 0, b_hi = 1;  // the free layers' beta: mean density at lengths.front() reaches W's
    for (int it = 0; it < 40; ++it) {
      const double mid = (b_lo + b_hi) / 2;
      (at_length(hybrid(keep, mid), lengths.front()) < target ? b_lo : b_hi) = mid;
    }
    const Table t = hybrid(keep, b_hi);
    const double lp = lp_of(t);
    std::snprintf(buf, sizeof buf, "the plan on its %d best layers, window beta %.6f elsewhere: log perplexity %.5f, "
                  "density at %d %.4f", k, b_hi, lp, lengths.front(), at_length(t, lengths.front()));
    r.lines.push_back(buf);
    if (first || lp < r.lp) {
      first = false;
      r.lp = lp;
      r.policy = policy_of(t);
      r.free_beta = b_hi;
      r.kept_layers.clear();
      for (int l = 0; l < L; ++l)
        if (keep[static_cast<size_t>(l)]) r.kept_layers.push_back(l);
    }
  }
  std::snprintf(buf, sizeof buf, "repaired: the plan's rules on %zu layers, window beta %.6f on the others: log "
                "perplexity %.5f (the window %.5f, the plan %.5f)", r.kept_layers.size(), r.free_beta, r.lp,
                r.window_lp, r.plan_lp);
  r.lines.push_back(buf);
  return r;
}

}  // namespace tessera::plan
