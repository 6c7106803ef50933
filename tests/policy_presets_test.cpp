#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "attention/pattern/presets.h"
#include "core/error.h"

namespace tessera::attn {
namespace {

const PolicyShape kShape{4, 6, 2};

std::string error_of(const std::string& spec) {
  try {
    policy_from_spec(spec, kShape);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(PolicyPresets, PresetsWithDefaultsAndParameters) {
  EXPECT_EQ(policy_from_spec("dense", kShape), AttentionPolicy::uniform(4, 6, 2, DensePattern{}));
  EXPECT_EQ(policy_from_spec("ashape", kShape), AttentionPolicy::uniform(4, 6, 2, AShapePattern{1024, 4096}));
  EXPECT_EQ(policy_from_spec("ashape:sink=64,local=256", kShape),
            AttentionPolicy::uniform(4, 6, 2, AShapePattern{64, 256}));
  EXPECT_EQ(policy_from_spec("minference", kShape), AttentionPolicy::uniform(4, 6, 2, VerticalSlashPattern{}));
  VerticalSlashPattern vs;
  vs.vertical = 100;
  vs.slash = 200;
  EXPECT_EQ(policy_from_spec("vs:v=100,s=200", kShape), AttentionPolicy::uniform(4, 6, 2, vs));
  EXPECT_EQ(policy_from_spec("bs:top_k=8", kShape), AttentionPolicy::uniform(4, 6, 2, BlockSparsePattern{8, 64}));
  EXPECT_EQ(policy_from_spec("moa:alpha=128,beta=0.25", kShape),
            AttentionPolicy::uniform(4, 6, 2, ElasticWindowPattern{128.0, 0.25, 64}));
  EXPECT_EQ(policy_from_spec("triangle:last=32", kShape),
            AttentionPolicy::uniform(4, 6, 2, TrianglePattern{8, 512, 32}));
}

TEST(PolicyPresets, TriangleMixSplitsLayers) {
  const AttentionPolicy p = policy_from_spec("trianglemix", kShape);  // start = 4 / 2
  EXPECT_EQ(p.at(1, 5), Pattern(DensePattern{}));
  EXPECT_EQ(p.at(2, 0), Pattern(TrianglePattern{}));
  const AttentionPolicy q = policy_from_spec("trianglemix:start=1,inner=vs,v=10,s=20,local=64", kShape);
  VerticalSlashPattern vs;
  vs.vertical = 10;
  vs.slash = 20;
  EXPECT_EQ(q.at(0, 3), Pattern(vs));
  EXPECT_EQ(q.at(1, 3), Pattern(TrianglePattern{8, 64, 128}));
}

TEST(PolicyPresets, PolicyFilesAreLoadedWithTheModelShape) {
  const std::string path = ::testing::TempDir() + "/preset_moa.json";
  {
    std::ofstream f(path);
    f << R"({"alphas": [[1,2,3,4,5,6],[1,2,3,4,5,6],[1,2,3,4,5,6],[1,2,3,4,5,6]],
             "betas": [[0,0,0,0,0,0.5],[0,0,0,0,0,0],[0,0,0,0,0,0],[0,0,0,0,0,0]]})";
  }
  const AttentionPolicy p = policy_from_spec(path, kShape);
  EXPECT_EQ(p.num_kv_heads(), 2);
  EXPECT_EQ(p.at(0, 5), Pattern(ElasticWindowPattern{6.0, 0.5, 64}));
  std::remove(path.c_str());
}

// Gemma-3-like: layers 1 and 2 are sliding-window layers (a 512-token window), 0 and 3 global. A preset leaves the
// window layers dense (the model's window applies there); a policy file keeps every layer as written.
TEST(PolicyPresets, PresetsLeaveTheModelsWindowLayersDense) {
  PolicyShape windowed = kShape;
  windowed.sliding_windows = {0, 512, 512, 0};
  EXPECT_EQ(windowed, kShape);  // the windows are not part of the shape's identity
  VerticalSlashPattern vs;
  vs.vertical = 64;
  vs.slash = 128;
  const AttentionPolicy p = policy_from_spec("vs:v=64,s=128", windowed);
  for (int h = 0; h < 6; ++h) {
    EXPECT_EQ(p.at(0, h), Pattern(vs));
    EXPECT_EQ(p.at(1, h), Pattern(DensePattern{}));
    EXPECT_EQ(p.at(2, h), Pattern(DensePattern{}));
    EXPECT_EQ(p.at(3, h), Pattern(vs));
  }
  const AttentionPolicy t = policy_from_spec("trianglemix:start=1", windowed);
  EXPECT_EQ(t.at(0, 0), Pattern(DensePattern{}));
  EXPECT_EQ(t.at(2, 0), Pattern(DensePattern{}));
  EXPECT_EQ(t.at(3, 0), Pattern(TrianglePattern{}));
  // Without windows (or all 0) the same preset is uniform, as before.
  EXPECT_EQ(policy_from_spec("vs:v=64,s=128", kShape), AttentionPolicy::uniform(4, 6, 2, vs));
  windowed.sliding_windows = {0, 0, 0, 0};
  EXPECT_EQ(policy_from_spec("vs:v=64,s=128", windowed), AttentionPolicy::uniform(4, 6, 2, vs));
  // A policy file is what its planner chose, window layers included.
  const std::string path = ::testing::TempDir() + "/preset_windows.json";
  {
    std::ofstream f(path);
    f << R"({"alphas": [[1,2,3,4,5,6],[1,2,3,4,5,6],[1,2,3,4,5,6],[1,2,3,4,5,6]],
             "betas": [[0,0,0,0,0,0],[0,0,0,0,0,0.5],[0,0,0,0,0,0],[0,0,0,0,0,0]]})";
  }
  windowed.sliding_windows = {0, 512, 512, 0};
  EXPECT_EQ(policy_from_spec(path, windowed).at(1, 5), Pattern(ElasticWindowPattern{6.0, 0.5, 64}));
  std::remove(path.c_str());
}

TEST(PolicyPresets, ErrorsNameTheSpecAndTheProblem) {
  EXPECT_EQ(error_of("vs:x=3"), "attention spec 'vs:x=3': unknown parameter 'x' (known: v, s, last_q)");
  EXPECT_EQ(error_of("vs:v=abc"), "attention spec 'vs:v=abc': parameter 'v' must be an integer, got 'abc'");
  EXPECT_EQ(error_of("moa:beta=x"), "attention spec 'moa:beta=x': parameter 'beta' must be a number, got 'x'");
  EXPECT_EQ(error_of("vs:v"), "attention spec 'vs:v': expected key=value, got 'v'");
  EXPECT_EQ(error_of("vs:v=1,v=2"), "attention spec 'vs:v=1,v=2': parameter 'v' given twice");
  EXPECT_EQ(error_of("trianglemix:inner=bs"), "attention spec 'trianglemix:inner=bs': inner must be 'dense' or 'vs', got 'bs'");
  EXPECT_EQ(error_of("sparse"),
            "attention spec 'sparse': not a preset (dense, ashape, triangle, vs, vs_adaptive, minference, bs, "
            "bs_adaptive, moa, trianglemix) "
            "nor an existing policy file");
  // Range errors name the spec and its parameter, not a layer and head as for a file.
  EXPECT_EQ(error_of("ashape:local=0"), "attention spec 'ashape:local=0': parameter 'local' must be >= 1, got 0");
  EXPECT_EQ(error_of("vs:v=-5"), "attention spec 'vs:v=-5': parameter 'v' must be >= 0, got -5");
  EXPECT_EQ(error_of("bs:top_k=0"), "attention spec 'bs:top_k=0': parameter 'top_k' must be >= 1, got 0");
  EXPECT_EQ(error_of("moa:beta=-1"), "attention spec 'moa:beta=-1': parameter 'beta' must be finite and >= 0, got -1");
  EXPECT_EQ(error_of("trianglemix:inner=vs,s=-1"),
            "attention spec 'trianglemix:inner=vs,s=-1': parameter 's' must be >= 0, got -1");
  EXPECT_EQ(error_of("trianglemix:local=0"),
            "attention spec 'trianglemix:local=0': parameter 'local' must be >= 1, got 0");
  EXPECT_EQ(error_of("trianglemix:start=9"),
            "attention spec 'trianglemix:start=9': parameter 'start' must be in [0, 4] (the model's layers), got 9");
}

TEST(PolicyPresets, SpecsAreCheckedWithoutAModel) {
  EXPECT_NO_THROW(check_policy_spec("vs:v=100,s=200"));
  EXPECT_NO_THROW(check_policy_spec("trianglemix:start=30,inner=vs"));
  auto error = [](const std::string& spec) {
    try {
      check_policy_spec(spec);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("vs:v=-5"), "attention spec 'vs:v=-5': parameter 'v' must be >= 0, got -5");
  EXPECT_EQ(error("bs:top_k=0"), "attention spec 'bs:top_k=0': parameter 'top_k' must be >= 1, got 0");
  EXPECT_EQ(error(""), "attention spec is empty");
  EXPECT_EQ(error("nope.json"),
            "attention spec 'nope.json': not a preset (dense, ashape, triangle, vs, vs_adaptive, minference, bs, "
            "bs_adaptive, moa, trianglemix) "
            "nor an existing policy file");
  const std::string path = testing::TempDir() + "/tessera_check_spec.json";
  std::ofstream(path) << R"({"tessera_policy": 1, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2,
                             "default": {"type": "block_sparse", "top_k": 0}})";
  EXPECT_EQ(error(path), path + ": default: field 'top_k' must be >= 1, got 0");
  std::remove(path.c_str());
}

TEST(PolicyPresets, SpecTooLongForAPathIsNoFile) {
  // Found by tests/fuzz/fuzz_attn_spec: std::filesystem::exists threw filesystem_error (ENAMETOOLONG) for a spec
  // longer than a file name may be; tests/data/configs/fuzz/attn-spec-too-long-for-a-path.txt keeps the input.
  std::ifstream in(std::string(TESSERA_SOURCE_DIR) +
                   "/tests/data/configs/fuzz/attn-spec-too-long-for-a-path.txt");
  std::string spec;
  ASSERT_TRUE(std::getline(in, spec));
  ASSERT_EQ(spec.size(), 300u);
  EXPECT_EQ(error_of(spec), "attention spec '" + spec +
                                "': not a preset (dense, ashape, triangle, vs, vs_adaptive, minference, bs, "
            "bs_adaptive, moa, trianglemix) "
                                "nor an existing policy file");
}

}  // namespace
}  // namespace tessera::attn
