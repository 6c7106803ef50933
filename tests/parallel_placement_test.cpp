// Head placement (parallel/placement.h): the cost model, uniform / greedy / genetic, JSON and the errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "parallel/placement.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tessera;
using namespace tessera::parallel;

namespace {

using namespace tessera::test;

const fs::path kMinference = fs::path(TESSERA_SHARED_DATA_DIR) / "minference-configs" /
                             "Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json";

attn::AttentionPolicy llama3_262k() {
  return attn::load_policy_file(kMinference, attn::PolicyShape{32, 32, 8});
}

// A hand-made model: 2 layers, 8 query heads in 2 KV groups.
CostModel small_model() {
  CostModel m;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.source = "test";
  m.layers.push_back({{8, 1, 1, 1, 1, 1, 1, 1}, 0.5, 1.0});
  m.layers.push_back({{1, 2, 3, 4, 5, 6, 7, 8}, 0.0, 0.0});
  return m;
}

}  // namespace

TEST(Placement, CostModelChargesKvProjectionOncePerGroupAndGpu) {
  const CostModel m = small_model();
  Placement p = place_uniform(m, 2);
  // Layer 0 uniform: GPU 0 = heads 0-3 (group 0), GPU 1 = heads 4-7 (group 1).
  EXPECT_EQ(p.gpu_of_head[0], (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  auto c = gpu_costs(m, p);
  EXPECT_DOUBLE_EQ(c[0][0], 8 + 1 + 1 + 1 + 4 * 0.5 + 1.0);
  EXPECT_DOUBLE_EQ(c[0][1], 4 + 4 * 0.5 + 1.0);
  // Splitting group 0 over both GPUs pays its K/V projection twice.
  p.gpu_of_head[0] = {0, 1, 1, 1, 1, 1, 1, 1};
  c = gpu_costs(m, p);
  EXPECT_DOUBLE_EQ(c[0][0], 8 + 0.5 + 1.0);
  EXPECT_DOUBLE_EQ(c[0][1], 7 + 7 * 0.5 + 2 * 1.0);
  EXPECT_EQ(p.heads_of(0, 1), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.groups_of(0, 1), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(p.groups_of(0, 0), (std::vector<int32_t>{0}));
  const PlacementSummary s = summarize(m, p);
  EXPECT_DOUBLE_EQ(s.max_imbalance, 26.0 / 10.0);  // layer 1 (uniform): heads 4-7 against heads 0-3
  EXPECT_DOUBLE_EQ(s.mean_imbalance, (12.5 / 9.5 + 26.0 / 10.0) / 2);
  EXPECT_DOUBLE_EQ(s.total, 12.5 + 26.0);
}

TEST(Placement, GreedyPutsLongestHeadsFirstOntoTheLeastLoadedGpu) {
  const CostModel m = small_model();
  const Placement g = place(m, 2, PlacementMethod::kGreedy);
  // Layer 1 (no projection costs): 8 -> 0, 7 -> 1, 6 -> 1, 5 -> 0, 4 -> 0 (13 vs 17?) ... the loads end 18
  // and 18.
  const auto c = gpu_costs(m, g);
  EXPECT_DOUBLE_EQ(c[1][0], 18);
  EXPECT_DOUBLE_EQ(c[1][1], 18);
  EXPECT_EQ(g.gpu_of_head[1][7], 0);  // the longest head goes first, to GPU 0
  EXPECT_EQ(g.gpu_of_head[1][6], 1);
}

TEST(Placement, EveryHeadPlacedOnceAndMethodsOrderedOnMInferenceLlama3) {
  if (!fs::exists(kMinference)) GTEST_SKIP() << "published MInference config not found at " << kMinference;
  const attn::AttentionPolicy policy = llama3_262k();
  for (int64_t length : {int64_t{131072}, int64_t{262144}}) {
    const CostModel m = flop_costs(policy, length, 4096, 128);
    ASSERT_EQ(m.layers.size(), 32u);
    for (int32_t gpus : {2, 4}) {
      GeneticOptions go;
      go.seed = 7;
      const Placement u = place(m, gpus, PlacementMethod::kUniform);
      const Placement g = place(m, gpus, PlacementMethod::kGreedy);
      const Placement ga = place(m, gpus, PlacementMethod::kGenetic, go);
      for (const Placement* p : {&u, &g, &ga}) {
        EXPECT_NO_THROW(validate(*p, 32, 32, 8, p->method));
        for (int32_t l = 0; l < 32; ++l) {
          std::multiset<int32_t> heads;
          for (int32_t d = 0; d < gpus; ++d)
            for (int32_t h : p->heads_of(l, d)) heads.insert(h);
          ASSERT_EQ(heads.size(), 32u);
          for (int32_t h = 0; h < 32; ++h) EXPECT_EQ(heads.count(h), 1u) << p->method << " layer " << l;
        }
      }
      const PlacementSummary su = summarize(m, u), sg = summarize(m, g), sa = summarize(m, ga);
      // Per layer, greedy and genetic are never worse than uniform; genetic never worse than greedy.
      const auto cu = gpu_costs(m, u), cg = gpu_costs(m, g), ca = gpu_costs(m, ga);
      for (size_t l = 0; l < 32; ++l) {
        const double mu = *std::max_element(cu[l].begin(), cu[l].end());
        const double mg = *std::max_element(cg[l].begin(), cg[l].end());
        const double ma = *std::max_element(ca[l].begin(), ca[l].end());
        EXPECT_LE(mg, mu * (1 + 1e-12)) << "layer " << l << ", " << gpus << " GPUs, " << length;
        EXPECT_LE(ma, mg * (1 + 1e-12)) << "layer " << l << ", " << gpus << " GPUs, " << length;
      }
      EXPECT_LT(sg.total, su.total);
      EXPECT_LE(sa.total, sg.total);
      EXPECT_LT(sa.mean_imbalance, su.mean_imbalance);
      EXPECT_GE(sa.total, sa.ideal * (1 - 1e-12));  // no placement beats perfect balance
    }
  }
}

TEST(Placement, GeneticIsDeterministicForASeed) {
  const CostModel m = small_model();
  GeneticOptions a;
  a.seed = 42;
  EXPECT_EQ(place(m, 3, PlacementMethod::kGenetic, a).gpu_of_head,
            place(m, 3, PlacementMethod::kGenetic, a).gpu_of_head);
  if (!fs::exists(kMinference)) return;
  const CostModel big = flop_costs(llama3_262k(), 131072, 4096, 128);
  EXPECT_EQ(place(big, 4, PlacementMethod::kGenetic, a).gpu_of_head,
            place(big, 4, PlacementMethod::kGenetic, a).gpu_of_head);
}

TEST(Placement, ProfileCostsInterpolateAndNameMissingPatterns) {
  attn::AttentionPolicy policy = attn::AttentionPolicy::uniform(1, 4, 2, attn::DensePattern{});
  policy.at(0, 3) = attn::AShapePattern{};
  HeadCostProfile prof;
  prof.entries = {{"dense", 1000, 1.0}, {"dense", 2000, 4.0}};
  prof.projections = {{1000, 0.1, 0.2}};
  EXPECT_EQ(
      error_of([&] { profile_costs(policy, 1500, prof, "prof.json"); }),
      "prof.json: the profile has no timing for ashape(sink=1024, local=4096) (layer 0, head 3); profile it "
      "with tp_bench --profile");
  prof.entries.push_back({"ashape(sink=1024, local=4096)", 1000, 0.5});
  const HeadCostProfile round = HeadCostProfile::from_json(prof.to_json(), "round");
  const CostModel m = profile_costs(policy, 1500, round, "prof.json");
  EXPECT_DOUBLE_EQ(m.layers[0].attn[0], 2.5);              // linear between 1000 and 2000
  EXPECT_DOUBLE_EQ(m.layers[0].attn[3], 0.5 * 1.5 * 1.5);  // beyond the profile: quadratic
  EXPECT_DOUBLE_EQ(m.layers[0].qo, 0.15);                  // projections: linear in length
  EXPECT_DOUBLE_EQ(m.layers[0].kv, 0.3);
}

TEST(Placement, ErrorsForBadInput) {
  const CostModel m = small_model();
  EXPECT_EQ(error_of([&] { place(m, 9, PlacementMethod::kGreedy); }),
            "placement: 9 GPUs but the model has 8 query heads per layer; use at most 8 GPUs");
  EXPECT_EQ(error_of([&] { place(m, 0, PlacementMethod::kUniform); }),
            "placement: the GPU count must be at least 1, got 0");
  EXPECT_EQ(error_of([] { parse_placement_method("random"); }),
            "unknown placement method 'random' (uniform, greedy, genetic)");

  const fs::path dir = fs::temp_directory_path() / ("tessera_placement_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path file = dir / "placement.json";
  Placement g = place(m, 2, PlacementMethod::kGreedy);
  save_placement(g, file);
  const Placement back = load_placement(file, 2, 2, 8, 2);
  EXPECT_EQ(back.gpu_of_head, g.gpu_of_head);
  EXPECT_EQ(back.method, "greedy");
  EXPECT_EQ(error_of([&] { load_placement(file, 4, 2, 8, 2); }),
            file.string() +
                ": the placement was made for 2 GPUs, this run has 4; make one for 4 GPUs (tp_bench "
                "--gpus 4 writes placement_greedy_<length>.json)");
  EXPECT_EQ(error_of([&] { load_placement(file, 2, 3, 8, 2); }),
            file.string() + ": the placement has 2 layers, the model 3");
  // Inside a plan document, under "placement".
  nlohmann::json plan = {{"policy", "whatever"}, {"placement", placement_to_json(g)}};
  EXPECT_EQ(placement_from_json(plan, "plan.json").gpu_of_head, g.gpu_of_head);
  nlohmann::json bad = placement_to_json(g);
  bad["layers"][1][3] = 5;
  EXPECT_EQ(error_of([&] { placement_from_json(bad, "bad.json"); }),
            "bad.json: layer 1 head 3 is on GPU 5, outside [0, 2)");
  fs::remove_all(dir);
}

// `tessera plan --gpus N` saves a placement in the plan; `tessera run --gpus N --attn plan.json` finds it there.
TEST(Placement, SavedInAPlanAndFoundByRun) {
  if (!fs::exists(kMinference)) GTEST_SKIP() << "published MInference config not found at " << kMinference;
  const attn::AttentionPolicy policy = llama3_262k();
  const Placement p = plan_placement(policy, 131072, 4096, 128, 4, PlacementMethod::kGenetic);
  EXPECT_EQ(p.length, 131072);
  EXPECT_EQ(p.cost_source, "flops");
  EXPECT_EQ(p.method, "genetic");
  validate(p, 32, 32, 8, "plan");
  // The same as placing by hand on the same cost model.
  const Placement by_hand = place(flop_costs(policy, 131072, 4096, 128), 4, PlacementMethod::kGenetic);
  EXPECT_EQ(p.gpu_of_head, by_hand.gpu_of_head);

  const fs::path dir = fs::temp_directory_path() / ("tessera_plan_placement_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path plan = dir / "plan.json";
  nlohmann::json doc = attn::save_policy_json(policy);
  doc["placement"] = placement_to_json(p);
  std::ofstream(plan) << doc.dump();
  // The policy loader reads the plan as before (the placement is beside the policy)...
  EXPECT_EQ(attn::load_policy_file(plan, attn::PolicyShape{32, 32, 8}).table(), policy.table());
  // ... and run finds the placement for the same GPU count.
  std::string note;
  const std::optional<Placement> found = placement_in_policy_file(plan, 4, 32, 32, 8, &note);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->gpu_of_head, p.gpu_of_head);
  EXPECT_EQ(note, "");
  // Another GPU count: none, and the note says why.
  EXPECT_FALSE(placement_in_policy_file(plan, 2, 32, 32, 8, &note).has_value());
  EXPECT_EQ(note, plan.string() + " holds a placement for 4 GPUs, this run has 2: placing the heads anew");
  // Another model's shape: the error load_placement gives.
  EXPECT_EQ(error_of([&] { placement_in_policy_file(plan, 4, 30, 32, 8, nullptr); }),
            plan.string() + ": the placement has 32 layers, the model 30");
  // A preset name or a policy without a placement: none, no note.
  note.clear();
  EXPECT_FALSE(placement_in_policy_file("vs", 4, 32, 32, 8, &note).has_value());
  EXPECT_FALSE(placement_in_policy_file(kMinference, 4, 32, 32, 8, &note).has_value());
  EXPECT_EQ(note, "");
  EXPECT_EQ(error_of([&] { plan_placement(policy, 0, 4096, 128, 4, PlacementMethod::kGreedy); }),
            "placement: the prompt length must be positive, got 0");
  fs::remove_all(dir);
}
