// tessera/plan/minference_plan.h — MInference's kernel-aware pattern search (minference.txt Alg. 1), forward only.
//
// Candidates of equal cost: the paper's space (Table 6) — A-shape, the four vertical-slash shapes (30, 2048),
// (100, 1800), (500, 1500), (3000, 200) and block-sparse — each scaled so that its density at the calibration
// length equals the target (the budget): A-shape by its exact index accounting (sink = local / 4), VS first by the
// bound (vertical / 2 + slash) * 2 / N with the shape's ratio kept, BS by top_k = budget x the mean number of
// causal key blocks; then (size_by_measurement) VS and BS re-sized to the A-shape's density as the index measures
// it on calibration q/k. (The paper's target is A-shape (1024, 4096); at 32K that is density ~0.3, the default.)
//
// Search: the dense model runs each calibration sample; at every layer (the engine's AttentionObserver gives the
// layer's q, k, v and dense output) each candidate runs on every head through the same estimators, index and
// sparse executor the engine uses, and the head's relative output error ||O_c - O_dense|| / ||O_dense|| is
// accumulated. Each head takes the candidate with the least mean error; the measured work density of every
// (head, candidate) is kept for the report. On the GPU (MInferenceOptions::device, plan/cuda/minference_cuda.h) the
// forward is the planners' f32 device pass (the dense attention output its reference) and each candidate runs
// through the device's estimators, index build and sparse executor (bf16 q/k/v, 64-row tiles as here).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attention/pattern/pattern.h"
#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "plan/calibration.h"
#include "plan/model_gradients.h"
#include "model/model.h"

namespace tessera::plan {

struct MInferenceOptions {
  double budget = 0.3;  // target density at the calibration length
  // Where the search's forward runs (the model's activations per layer and every candidate's attention output
  // error): Device::Cuda runs it through the function registered with register_cuda_minference (plan/cuda:
  // plan::cuda::enable()); candidate sizing (size_by_measurement) stays on the CPU.
  Device device = Device::Cpu;
  // Re-size the dynamic candidates (VS, BS) by their measured mask density on the longest sample's q/k at a global
  // layer near the middle (bisection), to the A-shape's exact density: their budget bounds undercount (a slash
  // covers a 64-row band per query tile), so bound-sized VS shapes execute about twice the target.
  bool size_by_measurement = true;
  // The per-head choice also weighs the output error over each sample's last `query_rows` rows (the question and
  // the answer: where a retrieval task reads the needle back): score = (1 - query_weight) x the relative error over
  // all rows + query_weight x the relative error over those rows. Averaged over every row, a static A-shape that
  // drops a retrieval head's far keys looks better than a vertical-slash shape (most rows read locally); on the rows
  // that answer, it loses the needle (SmolLM2's 2K-4K plan: 46 A-shape heads, the 2K multikey case at 25% lost, kept
  // with those heads dense; the 2K-8K plan at weight 0.5: 82 A-shape heads, the same case lost; at 0.75: 17, kept).
  // query_rows 0: all rows only (MInference's own criterion). The CPU and the device search alike.
  int32_t query_rows = 128;
  double query_weight = 0.75;
};

struct MInferenceResult {
  int32_t length = 0;                      // the calibration length candidates were sized for
  std::vector<attn::Pattern> candidates;
  std::vector<std::string> dropped;        // the paper's shapes raised to the floors or dropped as repeats, why
  std::vector<double> candidate_density;   // at `length`: measured at the sizing layer (size_by_measurement),
                                           // else predicted (A-shape exact, VS/BS bounds)
  std::vector<double> error;               // [layer * heads + head][candidate]: mean relative output error
  std::vector<double> query_error;         // the same over each sample's last query_rows rows (empty: not measured)
  double query_weight = 0;                 // the query rows' weight in choice_score
  std::vector<double> measured_density;    // [layer * heads + head][candidate]: mean mask density on the samples
  std::vector<int32_t> choice;             // per head (layer-major): the chosen candidate
  std::vector<double> score;               // per head: its choice's score (choice_score; MInference JSON's score)
  std::vector<std::string> repair;         // what repair_by_heldout did, one line a step
  attn::AttentionPolicy policy;
  double seconds = 0;
};

// The search's forward on one calibration sample on the GPU: adds, for every (layer * heads + head, candidate),
// weight x the relative output error of the candidate against dense attention to error[...] and weight x its mask
// density to density[...] (both [layers * heads][candidates], layer-major); with query_error (non-null), weight x
// the error over the sample's last query_rows rows to it. Registered by plan/cuda.
using DeviceMInferenceFn = void (*)(const runtime::Model& model, const std::vector<int32_t>& tokens,
                                    const std::vector<attn::Pattern>& candidates, double weight,
                                    std::vector<double>& error, std::vector<double>& density, int32_t query_rows,
                                    std::vector<double>* query_error);
void register_cuda_minference(DeviceMInferenceFn fn);
bool cuda_minference_registered();

// A vertical-slash candidate below these floors is degenerate (the paper's (30, 2048) shape scaled to a 0.3 budget
// at 1K is vertical_slash(v=2, s=153): two columns, fewer than the sink's 64-key block). minference_candidates
// raises a shape under a floor to it, keeping vertical + 2 slash (the budget); measurement sizing keeps the floors.
inline constexpr int32_t kMinVerticals = 64;
inline constexpr int32_t kMinSlashes = 64;

// Removes the degenerate VS candidates and repeated candidates (keeping the first); returns the positions kept
// (into the input), ascending, so that parallel arrays can be filtered alike.
std::vector<size_t> drop_degenerate(std::vector<attn::Pattern>& candidates);

// The candidates for a target density at `length` tokens (the longest planned length: shorter prompts clip the
// absolute budgets to denser masks), without the degenerate ones.
std::vector<attn::Pattern> minference_candidates(double budget, int32_t length);

// What a head's candidate is chosen by: the error over all rows, or with the query rows' error (1 - w) x error +
// w x query error (w: query_weight).
double choice_score(const MInferenceResult& r, size_t head, size_t candidate);

// Each head's least-score candidate among those not in `excluded` (r.choice, r.score and r.policy set from it).
void choose_candidates(MInferenceResult& r, const runtime::ModelConfig& cfg, const std::vector<bool>& excluded = {});

// The per-head choice judged on held-out tasks (issue 33): while the plan keeps fewer of the held-out answers than
// `target`, each candidate still in use is tried out of the plan (its heads to their next-best candidate by
// score, the others unchanged); the move that keeps the most answers is made when it keeps more than the plan, and
// the search stops when no move does. `kept(policy)` counts the answers a policy keeps (answer_agreement on the
// held-out samples). Returns the number kept by the final plan; r.repair says what was tried.
int32_t repair_by_heldout(MInferenceResult& r, const runtime::ModelConfig& cfg, int32_t target,
                          const std::function<int32_t(const attn::AttentionPolicy&)>& kept);

// Throws tessera::Error for a budget outside (0, 1] or no samples.
MInferenceResult plan_minference(const runtime::Model& model, const std::vector<CalibrationSample>& samples,
                                 const MInferenceOptions& options, ThreadPool& pool,
                                 const std::function<void(int32_t done, int32_t total)>& progress = {});

}  // namespace tessera::plan
