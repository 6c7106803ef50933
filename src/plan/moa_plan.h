// tessera/plan/moa_plan.h — MoA's optimiser (moa.txt §4): elastic rules per head from the influence profile.
//
//  1. The search space: 6 alpha values uniform in [-2048, 8192] x 9 beta values uniform in [0, 1] = 54 rules
//     S = alpha + beta * N (clipped to [0, N]), each run as ElasticWindowPattern{alpha, beta, sink 64}.
//  2. A rule's loss at length N, per head, from the masked influence of each calibration sample s,
//     d_s = sum over blocks of (1 - kept fraction of the block) * E_s,block (MoA averages influence within 64 x 64
//     blocks; the kept fractions and the rule's density come from lowering the pattern with the index, so they are
//     what the executor runs). LossEstimate::FirstOrder is MoA's own: the mean of d_s (Eq. 4). LossEstimate::Fisher
//     (the default) is the second-order term, 1/2 mean of d_s^2: the targets are the dense model's own answers, so
//     the loss measures how far the masked model moves from the dense one (for answers drawn from the dense model,
//     its expectation is KL(dense || masked), whose first-order term is zero and whose Hessian is the Fisher
//     information, estimated by the per-sample squared first-order changes — the empirical Fisher, as in
//     Kwon et al. 2022's mask search). The first-order mean is what is left of that zero from finitely many greedy
//     answers: on SmolLM2 it is negative for sink-only heads (docs/plans), and the optimiser spent the budget there.
//  3. Per length: a mixed-integer program (rule_mip.h): one rule per head, at most 2 distinct rules per layer, mean
//     density <= budget at every profiled length, minimum total loss.
//  4. Across lengths (when several are profiled): the epsilon-constraint method — minimise the loss at the longest
//     length with the loss at each other length capped at M + 1 levels evenly between its own optimum and its
//     value in the first plan (M = intervals) — then the Pareto-optimal plans among the solutions.
//  5. The pick (select_by_validation): by a caller-given validation on data not used for calibration — the share
//     of held-out tasks whose dense answers the plan reproduces (the most wins), then the perplexity of a text at
//     a length that was not profiled (the lowest wins); without a validation, the least loss at the longest length.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attention/pattern/pattern.h"
#include "attention/pattern/policy.h"
#include "plan/profile.h"

namespace tessera::plan {

struct ElasticRule {
  double alpha = 0;
  double beta = 0;
  bool operator==(const ElasticRule&) const = default;
};

// The rules, alpha-major: {-2048, 0, 2048, 4096, 6144, 8192} x {0, 1 / beta_steps, ..., 1}; MoA's space is
// beta_steps = 8 (54 rules). A finer beta grid (--moa-beta-steps) lets a plan sit between two of MoA's widths.
std::vector<ElasticRule> moa_rule_space(int32_t beta_steps = 8);

// What a pattern keeps of each 64 x 64 block at a prefill of `length` tokens.
struct BlockCoverage {
  int32_t num_blocks = 0;
  std::vector<double> kept;  // [qb][kb]: kept cells / causal cells of the block (0 above the diagonal)
  double density = 0;        // index_stats(...).density(): kept cells / causal cells
};
BlockCoverage block_coverage(const attn::Pattern& pattern, int32_t length);
// Only the density (index_stats of the lowered static pattern; cheaper than block_coverage).
double pattern_density_exact(const attn::Pattern& pattern, int32_t length);

// How a rule's masked influence becomes its loss (item 2 above).
enum class LossEstimate { FirstOrder, Fisher };
// "first-order" or "fisher"; parse_loss_estimate throws tessera::Error("--moa-loss must be first-order or fisher,
// got 'X'") otherwise.
const char* loss_estimate_name(LossEstimate e);
LossEstimate parse_loss_estimate(const std::string& name);

struct MoaOptions {
  double budget = 0.5;            // mean density (0, 1]
  LossEstimate estimate = LossEstimate::Fisher;  // needs the profile's sample_influence (keep_samples)
  int32_t intervals = 5;          // epsilon-constraint levels per secondary length
  int32_t max_rules_per_layer = 2;
  int32_t sink = 64;
  double time_limit_seconds = 60;  // per MIP
  // false: the rules that keep the sink alone at some profiled length (span alpha + beta N <= 0) are left out of the
  // space, so no head is reduced to the sink (--moa-no-sink-only; on SmolLM2 the sink-only heads carried most of
  // the plans' perplexity loss: docs/plans/README.md, "MoA with long targets").
  bool allow_sink_only = true;
  // The per-head cap (--moa-head-cap): a rule is open to a head only if it masks at most this share of the head's
  // influence mass at every profiled length (head_lost_shares); >= 1: no cap. The summed loss lets the optimiser
  // starve heads whose masked influence cancels or looks small; the cap bounds what any one head loses, in the
  // head's own units.
  double head_loss_cap = 1;
  // The beta grid: 0, 1 / beta_steps, ..., 1 (MoA's: 8). The uniform window at a budget rarely lies on MoA's grid
  // (SmolLM2 at 0.5: beta 0.2466, between 1/8 and 1/4 over budget), so a plan cannot be "the window but for a few
  // heads" there; 16 or 32 steps can.
  int32_t beta_steps = 8;
  // The model's sliding window per layer (ModelConfig::layers[l].sliding_window; 0: a global layer; empty: none).
  // A window layer's heads are left to the model, as the presets leave them: the plan holds DensePattern there (the
  // executors keep the window), they take no part in the budget, and `budget` and MoaCandidate::density are the mean
  // density over the other layers' heads. Without this, a window rule wider than the model's window looks costly but
  // executes nothing more, and a budget over all layers is met by the window layers alone (Gemma-3: 15 of 18 layers,
  // the 3 global ones left dense; docs/plans/gemma3-8k-32k.md).
  std::vector<int32_t> layer_windows;
};

struct MoaCandidate {
  std::vector<int32_t> rule_of_head;   // layer-major, index into moa_rule_space(beta_steps)
  std::vector<double> loss;            // per profiled length: the sum of rule losses
  std::vector<double> density;         // per profiled length: mean density over the planned heads (MoaOptions::layer_windows)
  double validation_perplexity = 0;    // 0: not measured
  double validation_agreement = -1;    // share of held-out answers kept; -1: not measured
  bool proven_optimal = true;
};

struct MoaResult {
  std::vector<int32_t> lengths;            // the profiled lengths
  std::vector<MoaCandidate> pareto;        // the Pareto-optimal plans
  size_t chosen = 0;                       // index into pareto
  attn::AttentionPolicy policy;            // the chosen plan
  int32_t mips = 0;                        // programs solved
  int32_t options = 0;                     // distinct rules at the profiled lengths (the programs' options)
};

// Density of each rule at each length, [length][rule], and the rule losses [length][head * rules] of a profile.
// FirstOrder uses the mean influence; Fisher each sample's (throws tessera::Error "moa: the fisher loss needs a
// profile made with keep_samples" without them).
std::vector<std::vector<double>> rule_losses(const GradientProfile& profile, const std::vector<ElasticRule>& rules,
                                             int32_t sink, LossEstimate estimate = LossEstimate::FirstOrder);
// Per profiled length, [length][head * rules]: the share of a head's influence mass that a rule masks,
// sum over blocks of (1 - kept) m_b / sum over blocks of m_b, with m_b = the mean over the samples of |E_s,b| (each
// sample's block sum; the mean influence's where the profile kept no samples). 0 for a head without influence.
std::vector<std::vector<double>> head_lost_shares(const GradientProfile& profile, const std::vector<ElasticRule>& rules,
                                                  int32_t sink);
std::vector<std::vector<double>> rule_densities(const std::vector<ElasticRule>& rules, int32_t sink,
                                                const std::vector<int32_t>& lengths);

// A plan's validation on data not used for calibration.
struct ValidationScore {
  double agreement = -1;  // share of held-out tasks whose dense answer the plan reproduces; -1: not measured
  double perplexity = 0;  // of a held-out text; 0: not measured
};
using PlanValidation = std::function<ValidationScore(const attn::AttentionPolicy&)>;

// The selection rule: the highest agreement (where measured), ties (equal shares) to the lower perplexity (where
// measured), then to the first. Throws tessera::Error on an empty list.
size_t select_by_validation(const std::vector<ValidationScore>& scores);

// One score from validation at several lengths and texts (--validation-length 2048,4096, --validation-texts N): the
// agreement is kept / total over every held-out task (-1 when total is 0), the perplexity the geometric mean of the
// texts' perplexities, exp(mean log), so each text counts alike whatever its length's scale (0 when none). Throws
// tessera::Error "moa: validation perplexity must be > 0, got X" for a perplexity <= 0 or not finite, and
// "moa: held-out answers kept K of T" when K is outside [0, T].
ValidationScore pooled_validation(int32_t kept, int32_t total, const std::vector<double>& perplexities);

// The calibration noise of the loss estimate, per profiled length (the profile made with keep_samples): per sample
// s, L_s(plan) = sum over heads of the head's d_s (FirstOrder) or d_s^2 / 2 (Fisher), d_s = sum over blocks of
// (1 - kept fraction) x the sample's influence. Reports the mean over the level's samples and its standard error
// sd / sqrt(n) (the jackknife's, for a mean) of `plan`, of `other` (both one pattern per head, layer-major), and of
// their difference; *_se is NaN with one sample.
struct LossComparison {
  int32_t length = 0;
  int32_t samples = 0;
  double loss = 0, loss_se = 0;
  double other = 0, other_se = 0;
  double diff = 0, diff_se = 0;  // loss - other: negative when the plan loses less than `other`
};
std::vector<LossComparison> compare_losses(const GradientProfile& profile, const std::vector<attn::Pattern>& plan,
                                           const std::vector<attn::Pattern>& other,
                                           LossEstimate estimate = LossEstimate::FirstOrder);

// The uniform MoA window (alpha 0, the given sink) whose exact density at `length` is the smallest >= `density`:
// beta by bisection to 1e-6 (the comparison "a uniform window of the same density").
attn::ElasticWindowPattern uniform_window_for(double density, int32_t length, int32_t sink = 64);

// The MoA part of a gradient profile (the shape, the loss and each length's mean and per-sample influence; not
// TriangleMix's probe) as a binary file, so the optimiser can be re-run with other options without the reverse-mode
// passes (--moa-profile-out / --moa-profile-in). Little-endian host doubles; the magic "TSMOAPR1" first.
// load_moa_profile throws tessera::Error naming the file when it cannot be read, has another magic, or is truncated
// or inconsistent (sizes that do not match layers x heads x blocks^2).
void save_moa_profile(const GradientProfile& profile, const std::string& path);
GradientProfile load_moa_profile(const std::string& path);

// MoA's layer repair (issue 33; the optimiser's version of docs/plans/moa_layers_33.py): the plan's rules measured
// layer by layer against the uniform window of the same density by the model's actual loss on held-out text.
// `log_perplexity(policy)` is that loss (the sum of log perplexities over the validation texts). With W the uniform
// window (every head moa_window(0, window_beta, sink)) and H_l = W but layer l as planned, layer l's net change is
//   [lp(H_l) - lp(W)] - slope x [density(H_l) - density(W)],
// slope = the window's own d lp / d density (W at window_beta x 0.8 and x 1.2): what the plan's extra density on
// layer l buys is not counted for its rules. Density: the mean exact density over heads, averaged over `lengths`.
// The layers with a negative net keep the plan's rules, best first; the repaired plans R_k keep the k best of them
// (k in `ks`, and all of them) and give every other layer one window whose beta brings the mean density at
// lengths.front() to W's; the R_k of least lp is the result (none when no layer's net is negative: the window).
// Layers with a model window (layer_windows[l] > 0) stay as the plan has them in W, H_l and R_k.
struct LayerRepair {
  attn::AttentionPolicy policy;       // the repaired plan
  double window_beta = 0;             // W's
  double slope = 0;                   // d lp / d density of the window
  double window_lp = 0, plan_lp = 0;  // lp(W), lp(plan)
  std::vector<double> net;            // per layer (0 for model-window layers)
  std::vector<int32_t> kept_layers;   // layers keeping the plan's rules in the result, ascending
  double free_beta = 0;               // the window of the other layers in the result
  double lp = 0;                      // the result's
  std::vector<std::string> lines;     // what was measured, for the report
};
// Throws tessera::Error for a plan with a head that is not a moa_window or dense, or no lengths.
LayerRepair repair_layers(const attn::AttentionPolicy& plan, double window_beta, const std::vector<int32_t>& lengths,
                          const std::function<double(const attn::AttentionPolicy&)>& log_perplexity,
                          const std::vector<int32_t>& layer_windows = {}, int32_t sink = 64,
                          const std::vector<int32_t>& ks = {2, 4, 6, 8, 12});

// Throws tessera::Error when the budget is outside (0, 1] or no plan meets it (the sparsest rules' density at a
// length exceeds the budget, or no plan within the per-head cap does: "moa: no plan meets the budget B within the
// per-head cap C").
MoaResult plan_moa(const GradientProfile& profile, int32_t num_kv_heads, const MoaOptions& options,
                   const PlanValidation& validate = {},
                   const std::function<void(const std::string&)>& progress = {});

}  // namespace tessera::plan
