// tessera/parallel/placement.h — which GPU runs which query head, per layer (FlexAttn's head placement).
//
// With per-head sparse patterns the heads of a layer cost very different times, so splitting them evenly over
// the tensor-parallel GPUs (Megatron's uniform split) leaves GPUs idle at every all-reduce. A placement
// assigns every query head of every layer to one GPU so that the slowest GPU of each layer finishes early.
//
// Cost model (FlexAttn Eq. 11-12, per layer l and GPU d):
//   T_l,d = sum over the heads i on d of (t_attn(l, i) + t_qo)  +  (KV groups held by d) * t_kv
//   T_l   = max_d T_l,d                                 (the layer's attention phase ends at the all-reduce)
// A GPU that holds any query head of a KV group holds that group's K/V projection (and its KV cache): t_kv is
// paid once per group per GPU, so splitting a group's heads over two GPUs pays its K/V projection twice (Eq.
// 12's V_d). t_qo is the Q and O projection of one head; t_attn the head's attention (estimation, index and
// executor). The costs come from a profile measured on the target GPU (HeadCostProfile, time per head per
// pattern and length) or, lacking one, from the index's FLOP accounting (flop_costs: the pattern's covered
// cells, as attention/index/dense_shortcut.h counts them, over an assumed attention rate; projections over a
// GEMM rate).
//
// Methods:
//   uniform  Megatron's split: GPU d gets the contiguous heads [d h / N, (d + 1) h / N) (whole KV groups when
//            N divides the group count). The baseline.
//   greedy   longest head first onto the GPU where it ends soonest (its marginal cost includes t_kv when that
//            GPU does not hold its group yet); ties to the less loaded, then the lower GPU. A layer where
//            that ends behind the uniform split (it may split KV groups for no gain) keeps the uniform split.
//   genetic  the paper's search (Alg. 2), per layer: a population of 30 individuals (a GPU per head), the
//            initial population uniform random plus the uniform and greedy placements (so that elitism keeps
//            the search never worse than greedy), roulette selection on fitness 1 / T_l, single-point
//            crossover with probability 0.8, per-gene mutation 0.02 to another GPU, the 2 best kept each
//            generation (elitism), up to 80 generations (stopping after 30 without improvement).
//            Deterministic for a seed (our own splitmix64 generator, no std:: distribution whose output
//            differs between libraries).
//
// Constraint (decided for the engine's GEMM shapes): none on head counts. A rank runs one Q/K/V GEMM per KV
// group it holds and one O GEMM over all its heads (parallel/shard.h), so any count per GPU gives contiguous
// GEMMs; the cost model charges the extra K/V projections of a split group. Every head is placed exactly
// once; a GPU may hold no head of a layer (it then only runs the layer's MLP share). num_gpus must be <=
// num_q_heads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attention/pattern/policy.h"

namespace tessera::parallel {

// Costs of one layer, in seconds (or any one unit).
struct LayerCosts {
  std::vector<double> attn;  // per query head
  double qo = 0;             // Q and O projection of one head
  double kv = 0;             // K and V projection of one KV group
};

struct CostModel {
  int32_t num_q_heads = 0, num_kv_heads = 0;
  std::vector<LayerCosts> layers;
  std::string source;  // "flops" or the profile's file name
  int32_t group_size() const { return num_q_heads / num_kv_heads; }
};

// Rates of the FLOP cost model (defaults: an H100's sustained bf16 rates for our kernels, roughly; only their
// ratio matters for the placement).
struct FlopRates {
  double attention_flops_per_s = 350e12;
  double gemm_flops_per_s = 600e12;
};

// Cost model from the index's FLOP accounting for a prompt of `length` tokens (one prefill of the whole
// prompt): attention = 4 d x (covered causal cells) per head (+ the estimate of dynamic heads: 2 d x last_q x
// length for VS, 2 d x (length / block)^2 / 2 for BS), projections 2 x length x hidden x d per matrix.
CostModel flop_costs(const attn::AttentionPolicy& policy, int64_t length, int64_t hidden, int64_t head_dim,
                     const FlopRates& rates = {});

// A profile measured on the target GPU (FlexAttn's runtime profiling report):
//   {"tessera_head_profile": 1, "device": "NVIDIA H100 80GB HBM3", "head_dim": 128, "hidden": 4096,
//    "entries": [{"pattern": "vertical_slash(v=1000, s=6096)", "length": 131072, "seconds": 0.0012}, ...],
//    "projections": [{"length": 131072, "qo_seconds": 0.0004, "kv_seconds": 0.0004}, ...]}
// "pattern" is attn::describe() of a pattern; seconds per head for one prefill of `length` tokens.
struct HeadCostProfile {
  std::string device;
  struct Entry {
    std::string pattern;
    int64_t length = 0;
    double seconds = 0;
  };
  struct Projection {
    int64_t length = 0;
    double qo_seconds = 0, kv_seconds = 0;
  };
  std::vector<Entry> entries;
  std::vector<Projection> projections;

  nlohmann::json to_json() const;
  // Throws Error("<source>: ...") for a malformed document.
  static HeadCostProfile from_json(const nlohmann::json& j, const std::string& source);
};

// Cost model from a profile at `length`: each head's pattern looked up by describe(); between two profiled
// lengths linear interpolation, outside them the nearest length scaled by (length / profiled)^2 for attention
// and (length / profiled) for projections. Throws Error naming the first pattern the profile lacks.
CostModel profile_costs(const attn::AttentionPolicy& policy, int64_t length, const HeadCostProfile& profile,
                        const std::string& source);

enum class PlacementMethod { kUniform, kGreedy, kGenetic };
const char* placement_method_name(PlacementMethod m);             // "uniform", "greedy", "genetic"
PlacementMethod parse_placement_method(const std::string& name);  // throws Error listing the names

struct GeneticOptions {
  int32_t population = 30;
  int32_t max_generations = 80;
  int32_t stall_generations = 30;  // stop after this many generations without a better best
  double crossover = 0.8;
  double mutation = 0.02;  // per gene
  int32_t elite = 2;
  uint64_t seed = 1;
};

struct Placement {
  int32_t num_gpus = 0;
  int32_t num_q_heads = 0, num_kv_heads = 0;
  std::string method;       // placement_method_name
  uint64_t seed = 0;        // genetic
  int64_t length = 0;       // the prompt length the costs were for (0: unknown)
  std::string cost_source;  // CostModel::source
  double search_seconds = 0;
  std::vector<std::vector<int32_t>> gpu_of_head;  // [layer][query head] -> GPU

  int32_t num_layers() const { return static_cast<int32_t>(gpu_of_head.size()); }
  // Query heads of GPU `gpu` in layer `layer`, ordered by KV group, then head (the shard's order).
  std::vector<int32_t> heads_of(int32_t layer, int32_t gpu) const;
  // KV groups GPU `gpu` holds in layer `layer`, ascending.
  std::vector<int32_t> groups_of(int32_t layer, int32_t gpu) const;
};

// Throws Error("placement: <n> GPUs but the model has <h> query heads per layer; use at most <h> GPUs") when
// num_gpus > num_q_heads, and for num_gpus < 1.
void check_gpu_count(int32_t num_gpus, int32_t num_q_heads);

Placement place(const CostModel& costs, int32_t num_gpus, PlacementMethod method,
                const GeneticOptions& genetic = {});
Placement place_uniform(const CostModel& costs, int32_t num_gpus);

// Per-GPU cost of each layer under the model ([layer][gpu], Eq. 11-12) and the summaries.
std::vector<std::vector<double>> gpu_costs(const CostModel& costs, const Placement& placement);
struct PlacementSummary {
  double total = 0;           // sum over layers of the slowest GPU (Eq. 10)
  double ideal = 0;           // sum over layers of the mean GPU load (perfect balance)
  double max_imbalance = 0;   // max over layers of slowest / fastest
  double mean_imbalance = 0;  // mean over layers of slowest / fastest
};
PlacementSummary summarize(const CostModel& costs, const Placement& placement);

// Throws Error naming the problem: a head without a GPU, a GPU index out of range, the wrong layer/head
// counts.
void validate(const Placement& placement, int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
              const std::string& source);

// JSON: {"tessera_placement": 1, "num_gpus", "num_layers", "num_q_heads", "num_kv_heads", "method", "seed",
// "length", "cost_source", "search_seconds", "layers": [[gpu per head], ...]}. A plan document may hold it
// under the key "placement" (load_placement accepts either).
nlohmann::json placement_to_json(const Placement& placement);
Placement placement_from_json(const nlohmann::json& j, const std::string& source);
void save_placement(const Placement& placement, const std::filesystem::path& path);
// Reads a placement (or a plan with "placement") and checks it against the run: its GPU count must be
// `num_gpus` ("<file>: the placement was made for 4 GPUs, this run has 2; make one for 2 GPUs (tp_bench
// --gpus 2 writes placement_<method>_<length>.json)") and its shape the model's.
Placement load_placement(const std::filesystem::path& path, int32_t num_gpus, int32_t num_layers,
                         int32_t num_q_heads, int32_t num_kv_heads);

// `tessera plan --gpus N`: the placement of `policy`'s heads over `num_gpus` GPUs for a `length`-token prompt by
// `method`, on the FLOP cost model (a plan is made without the target GPUs at hand; tp_bench --costs profile
// measures a profile on them), with `length` recorded; saved in the plan document under "placement".
Placement plan_placement(const attn::AttentionPolicy& policy, int64_t length, int64_t hidden, int64_t head_dim,
                         int32_t num_gpus, PlacementMethod method);

// The placement a policy file carries (a plan document with "placement", written by `tessera plan --gpus N`),
// for `tessera run --gpus N --attn plan.json` without --placement: the placement when the file has one made for
// `num_gpus` GPUs (checked against the model's shape: a wrong one throws as load_placement does); std::nullopt
// when the path is no JSON file with "placement", or when its placement is for another GPU count — then `note`
// says so ("plan.json holds a placement for 4 GPUs, this run has 2: placing the heads anew").
std::optional<Placement> placement_in_policy_file(const std::filesystem::path& path, int32_t num_gpus,
                                                  int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
                                                  std::string* note);

}  // namespace tessera::parallel
