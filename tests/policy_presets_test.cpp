#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

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

TEST(PolicyPresets, ErrorsNameTheSpecAndTheProblem) {
  EXPECT_EQ(error_of("vs:x=3"), "attention spec 'vs:x=3': unknown parameter 'x' (known: v, s, last_q)");
  EXPECT_EQ(error_of("vs:v=abc"), "attention spec 'vs:v=abc': parameter 'v' must be an integer, got 'abc'");
  EXPECT_EQ(error_of("moa:beta=x"), "attention spec 'moa:beta=x': parameter 'beta' must be a number, got 'x'");
  EXPECT_EQ(error_of("vs:v"), "attention spec 'vs:v': expected key=value, got 'v'");
  EXPECT_EQ(error_of("vs:v=1,v=2"), "attention spec 'vs:v=1,v=2': parameter 'v' given twice");
  EXPECT_EQ(error_of("trianglemix:inner=bs"), "attention spec 'trianglemix:inner=bs': inner must be 'dense' or 'vs', got 'bs'");
  EXPECT_EQ(error_of("sparse"),
            "attention spec 'sparse': not a preset (dense, ashape, triangle, vs, minference, bs, moa, trianglemix) "
            "nor an existing policy file");
  EXPECT_EQ(error_of("ashape:local=0"), "layer 0, head 0: field 'local' must be >= 1, got 0");
  EXPECT_EQ(error_of("trianglemix:start=9"), "trianglemix: start_layer must be in [0, 4], got 9");
}

}  // namespace
}  // namespace tessera::attn
