// Policy files: tessera's JSON format, MInference and MoA import/export, and the error message of every
// malformed input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "attention/index/lower.h"
#include "attention/pattern/config_io.h"
#include "core/error.h"

namespace tessera::attn {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kConfigs = fs::path(TESSERA_SOURCE_DIR) / "tests" / "data" / "configs";
const fs::path kShared = fs::path(TESSERA_SHARED_DATA_DIR);

// The message of the tessera::Error that fn throws, or a marker when it throws nothing.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

VerticalSlashPattern vs(int32_t v, int32_t s) {
  VerticalSlashPattern p;
  p.vertical = v;
  p.slash = s;
  return p;
}

BlockSparsePattern bs(int32_t top_k) {
  BlockSparsePattern p;
  p.top_k = top_k;
  return p;
}

// A scratch directory per test, removed afterwards.
class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("tessera_config_test_" + std::to_string(::getpid()) + "_" + std::string(info->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p;
  }
  // Loads `text` written to a file `name` and returns the error message.
  std::string load_error(const std::string& name, const std::string& text,
                         const std::optional<PolicyShape>& expected = std::nullopt) {
    const fs::path p = write(name, text);
    return error_of([&] { load_policy_file(p, expected); });
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

AttentionPolicy mixed_policy() {
  // 4 layers x 8 query heads, 2 KV heads; every kind of pattern, some with non-default fields.
  std::vector<Pattern> table;
  for (int l = 0; l < 4; ++l)
    for (int h = 0; h < 8; ++h) table.push_back(vs(1000, 6096));
  auto at = [&](int l, int h) -> Pattern& { return table[static_cast<size_t>(l * 8 + h)]; };
  for (int h = 0; h < 8; ++h) at(0, h) = DensePattern{};
  at(0, 5) = AShapePattern{16, 256};
  at(1, 2) = bs(40);
  at(1, 3) = TrianglePattern{4, 128, 32};
  VerticalSlashPattern odd = vs(30, 800);
  odd.last_q = 32;
  odd.forced_columns = 0;
  odd.forced_diagonals = 7;
  at(1, 7) = odd;
  for (int h = 0; h < 8; ++h) at(2, h) = ElasticWindowPattern{0.1, 0.3, 64};
  at(2, 0) = ElasticWindowPattern{-1024.0, 1.0 / 3.0, 0};
  BlockSparsePattern b = bs(7);
  b.block = 128;
  at(3, 1) = b;
  return AttentionPolicy(4, 8, 2, std::move(table));
}

// ---- tessera format --------------------------------------------------------------------------------------

TEST_F(ConfigFiles, TesseraRoundTripMixedPatterns) {
  const AttentionPolicy policy = mixed_policy();
  const json j = save_policy_json(policy);
  EXPECT_EQ(parse_tessera_policy(j, "mem"), policy);
  // Through the formatted text and a file too.
  const fs::path p = dir_ / "mixed.json";
  save_policy_file(policy, p);
  EXPECT_EQ(load_policy_file(p), policy);
  EXPECT_EQ(load_policy_json(json::parse(format_policy_json(j)), "text"), policy);

  // Compact: the common pattern is the default, layer 0 has its own default, only differing heads are listed.
  EXPECT_EQ(j.at("default").at("type"), "vertical_slash");
  const json& layers = j.at("layers");
  ASSERT_EQ(layers.size(), 4u);
  EXPECT_EQ(layers[0].at("default").at("type"), "dense");
  EXPECT_EQ(layers[0].at("heads").size(), 1u);
  EXPECT_EQ(layers[1].at("heads").size(), 3u);
  EXPECT_FALSE(layers[1].contains("default"));
  EXPECT_EQ(layers[2].at("heads").size(), 1u);
  EXPECT_EQ(layers[3].at("heads").size(), 1u);
  EXPECT_FALSE(j.contains("trianglemix"));
}

TEST_F(ConfigFiles, TesseraWriterDetectsTriangleMix) {
  const AttentionPolicy inner = AttentionPolicy::uniform(6, 4, 2, vs(1000, 6096));
  const AttentionPolicy policy = AttentionPolicy::trianglemix(inner, 2, TrianglePattern{8, 256, 64});
  const json j = save_policy_json(policy);
  EXPECT_EQ(j.at("trianglemix").at("start_layer"), 2);
  EXPECT_EQ(j.at("trianglemix").at("triangle").at("local"), 256);
  EXPECT_FALSE(j.contains("layers"));
  EXPECT_EQ(parse_tessera_policy(j, "mem"), policy);

  // The whole model in triangles is just a default.
  const AttentionPolicy all = AttentionPolicy::trianglemix(inner, 0, TrianglePattern{});
  const json ja = save_policy_json(all);
  EXPECT_FALSE(ja.contains("trianglemix"));
  EXPECT_EQ(ja.at("default").at("type"), "triangle");
  EXPECT_EQ(parse_tessera_policy(ja, "mem"), all);

  // Uniform policies need one line.
  const AttentionPolicy dense = AttentionPolicy::uniform(3, 4, 4, DensePattern{});
  EXPECT_EQ(
      format_policy_json(save_policy_json(dense)),
      "{\n  \"tessera_policy\": 1,\n  \"num_layers\": 3,\n  \"num_q_heads\": 4,\n  \"num_kv_heads\": 4,\n"
      "  \"default\": {\"type\": \"dense\"}\n}");
  EXPECT_EQ(parse_tessera_policy(save_policy_json(dense), "mem"), dense);
}

TEST_F(ConfigFiles, TesseraFormattedTextIsReadable) {
  AttentionPolicy policy = AttentionPolicy::uniform(2, 12, 4, AShapePattern{});
  policy.at(1, 10) = DensePattern{};
  policy.at(1, 2) = DensePattern{};
  EXPECT_EQ(format_policy_json(save_policy_json(policy)),
            "{\n"
            "  \"tessera_policy\": 1,\n"
            "  \"num_layers\": 2,\n"
            "  \"num_q_heads\": 12,\n"
            "  \"num_kv_heads\": 4,\n"
            "  \"default\": {\"type\": \"ashape\", \"sink\": 1024, \"local\": 4096},\n"
            "  \"layers\": [\n"
            "    {},\n"
            "    {\"heads\": {\"2\": {\"type\": \"dense\"}, \"10\": {\"type\": \"dense\"}}}\n"
            "  ]\n"
            "}");
}

TEST(PatternConfig, TesseraExampleWithOverrides) {
  const AttentionPolicy p = load_policy_file(kConfigs / "overrides.json", PolicyShape{4, 8, 2});
  for (int h = 0; h < 8; ++h) EXPECT_EQ(p.at(0, h), Pattern(DensePattern{}));
  EXPECT_EQ(p.at(1, 0), Pattern(vs(1000, 6096)));
  EXPECT_EQ(p.at(1, 3), Pattern(AShapePattern{128, 1024}));
  EXPECT_EQ(p.at(1, 7), Pattern(bs(50)));
  EXPECT_EQ(std::get<BlockSparsePattern>(p.at(1, 7)).block, 64);  // omitted field: struct default
  for (int h = 0; h < 8; ++h) EXPECT_EQ(p.at(2, h), Pattern(vs(1000, 6096)));
  EXPECT_EQ(p.at(3, 0), Pattern(DensePattern{}));
  EXPECT_EQ(p.at(3, 5), Pattern(ElasticWindowPattern{1024.0, 0.25, 64}));
  EXPECT_EQ(parse_tessera_policy(save_policy_json(p), "mem"), p);
}

TEST(PatternConfig, TesseraExampleTable) {
  const AttentionPolicy p = load_policy_file(kConfigs / "table.json");
  EXPECT_EQ(p.num_layers(), 2);
  EXPECT_EQ(p.num_q_heads(), 2);
  EXPECT_EQ(p.num_kv_heads(), 1);
  EXPECT_EQ(p.at(0, 0), Pattern(DensePattern{}));
  EXPECT_EQ(p.at(0, 1), Pattern(AShapePattern{4, 64}));
  EXPECT_EQ(p.at(1, 0), Pattern(TrianglePattern{}));
  VerticalSlashPattern v = vs(30, 800);
  v.last_q = 32;
  EXPECT_EQ(p.at(1, 1), Pattern(v));
  EXPECT_EQ(parse_tessera_policy(save_policy_json(p), "mem"), p);
}

TEST(PatternConfig, TesseraExampleTriangleMix) {
  const AttentionPolicy p =
      load_policy_file(kConfigs / "trianglemix_llama31_8b.json", PolicyShape{32, 32, 8});
  const AttentionPolicy want = AttentionPolicy::trianglemix(
      AttentionPolicy::uniform(32, 32, 8, DensePattern{}), 16, TrianglePattern{8, 512, 128});
  EXPECT_EQ(p, want);
  EXPECT_EQ(p.at(15, 31), Pattern(DensePattern{}));
  EXPECT_EQ(p.at(16, 0), Pattern(TrianglePattern{8, 512, 128}));
}

// Files written by tessera leave out vertical_slash's last_q/forced_* when they equal the defaults, and
// hand-written files may leave out any field: the defaults are part of format version 1. This pins them with
// literal values, so that changing a default in pattern.h fails here (and calls for a new format version).
TEST(PatternConfig, OmittedFieldsTakeTheVersion1Defaults) {
  auto parse = [](const char* type) {
    const json j = {{"tessera_policy", 1},
                    {"num_layers", 1},
                    {"num_q_heads", 1},
                    {"num_kv_heads", 1},
                    {"default", {{"type", type}}}};
    return parse_tessera_policy(j, "defaults").at(0, 0);
  };
  EXPECT_EQ(parse("ashape"), Pattern(AShapePattern{1024, 4096}));
  EXPECT_EQ(parse("moa_window"), Pattern(ElasticWindowPattern{0.0, 0.5, 64}));
  EXPECT_EQ(parse("triangle"), Pattern(TrianglePattern{8, 512, 128}));
  EXPECT_EQ(parse("vertical_slash"), Pattern(VerticalSlashPattern{1000, 6096, 64, 30, 100}));
  EXPECT_EQ(parse("block_sparse"), Pattern(BlockSparsePattern{100, 64}));

  EXPECT_EQ(
      format_policy_json(save_policy_json(AttentionPolicy::uniform(1, 1, 1, vs(3500, 100)))),
      "{\n  \"tessera_policy\": 1,\n  \"num_layers\": 1,\n  \"num_q_heads\": 1,\n  \"num_kv_heads\": 1,\n"
      "  \"default\": {\"type\": \"vertical_slash\", \"vertical\": 3500, \"slash\": 100}\n}");
}

TEST(PatternConfig, TriangleMixAppliesOnTopOfLayerOverrides) {
  const json j = json::parse(R"({"tessera_policy": 1, "num_layers": 4, "num_q_heads": 2, "num_kv_heads": 1,
    "default": {"type": "vertical_slash"},
    "layers": [{}, {"heads": {"1": {"type": "block_sparse"}}}, {"default": {"type": "dense"}}, {}],
    "trianglemix": {"start_layer": 2}})");
  const AttentionPolicy p = parse_tessera_policy(j, "tm.json");
  EXPECT_EQ(p.at(1, 0), Pattern(VerticalSlashPattern{}));
  EXPECT_EQ(p.at(1, 1), Pattern(BlockSparsePattern{}));
  for (int l = 2; l < 4; ++l)
    for (int h = 0; h < 2; ++h) EXPECT_EQ(p.at(l, h), Pattern(TrianglePattern{}));  // default triangle fields
  EXPECT_EQ(parse_tessera_policy(save_policy_json(p), "mem"), p);
}

// ---- MInference ------------------------------------------------------------------------------------------

TEST(PatternConfig, MInferenceRoundTrip) {
  std::vector<Pattern> table = {vs(1000, 6096), AShapePattern{100, 800}, bs(100),
                                vs(30, 800),    vs(3500, 100),           vs(500, 700),
                                bs(8),          AShapePattern{0, 1}};
  const AttentionPolicy policy(2, 4, 2, table);
  const json j = export_minference(policy);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0].at("1"), json({"stream_llm", 100, 800, 0}));
  EXPECT_EQ(j[0].at("2"), json({"block_sparse", 100, 0, 0}));
  EXPECT_EQ(import_minference(j, "mem", 2), policy);

  // Scores survive when kept.
  std::vector<double> scores;
  const AttentionPolicy small = import_minference(
      json::parse(std::ifstream(kConfigs / "minference_small.json")), "minference_small.json", 2, &scores);
  ASSERT_EQ(scores.size(), 8u);
  EXPECT_EQ(scores[1], 0.25);
  EXPECT_EQ(scores[2], 3.0);
  EXPECT_EQ(small.at(0, 1), Pattern(AShapePattern{100, 800}));
  EXPECT_EQ(small.at(0, 2), Pattern(bs(100)));
  EXPECT_EQ(small.at(1, 3), Pattern(AShapePattern{64, 4096}));
  EXPECT_EQ(export_minference(small, &scores),
            json::parse(std::ifstream(kConfigs / "minference_small.json")));
  EXPECT_EQ(load_policy_file(kConfigs / "minference_small.json", PolicyShape{2, 4, 2}), small);
}

TEST(PatternConfig, MInferenceExportRefusesWhatItCannotExpress) {
  AttentionPolicy p = AttentionPolicy::uniform(2, 2, 1, VerticalSlashPattern{});
  p.at(1, 1) = DensePattern{};
  EXPECT_EQ(
      error_of([&] { export_minference(p); }),
      "export to minference format: layer 1, head 1 runs dense, which that format cannot express (it has "
      "vertical_and_slash with last_q 64, 30 forced columns and 100 forced diagonals, stream_llm, and "
      "block_sparse with block 64)");
  VerticalSlashPattern v;
  v.last_q = 128;
  p.at(1, 1) = v;
  EXPECT_EQ(
      error_of([&] { export_minference(p); }),
      "export to minference format: layer 1, head 1 runs vertical_slash(v=1000, s=6096), which that format "
      "cannot express (it has vertical_and_slash with last_q 64, 30 forced columns and 100 forced diagonals, "
      "stream_llm, and block_sparse with block 64)");
  const std::vector<double> few(3, 0.0);
  p.at(1, 1) = VerticalSlashPattern{};
  EXPECT_EQ(error_of([&] { export_minference(p, &few); }),
            "export to minference format: 3 scores for 4 heads");
}

struct PublishedMInference {
  const char* file;
  PolicyShape shape;
};

TEST(PatternConfig, ImportsPublishedMInferenceConfigs) {
  const fs::path dir = kShared / "minference-configs";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "published MInference configs not found at " << dir;
  const PublishedMInference files[] = {
      {"Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json", {32, 32, 8}},
      {"Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json", {32, 32, 8}},
      {"Phi_3_mini_128k_instruct_kv_out_v32_fit_o_best_pattern.json", {32, 32, 32}},
      {"Qwen2.5_7B_Instruct_128k_instruct_kv_out_v32_fit_o_best_pattern.json", {28, 28, 4}},
  };
  for (const auto& f : files) {
    SCOPED_TRACE(f.file);
    const fs::path p = dir / f.file;
    const AttentionPolicy policy = load_policy_file(p, f.shape);
    EXPECT_EQ(shape_of(policy), f.shape);
    // Export with the kept scores reproduces the published file.
    const json original = json::parse(std::ifstream(p));
    std::vector<double> scores;
    const AttentionPolicy again = import_minference(original, p.string(), f.shape.num_kv_heads, &scores);
    EXPECT_EQ(again, policy);
    EXPECT_EQ(export_minference(again, &scores), original);
    // And through tessera's format.
    EXPECT_EQ(parse_tessera_policy(save_policy_json(policy), "mem"), policy);
  }

  const AttentionPolicy llama3 = load_policy_file(dir / files[0].file, files[0].shape);
  EXPECT_EQ(llama3.at(0, 0), Pattern(vs(1000, 6096)));
  const AttentionPolicy phi3 = load_policy_file(dir / files[2].file, files[2].shape);
  EXPECT_EQ(phi3.at(8, 1), Pattern(AShapePattern{100, 800}));  // ["stream_llm", 100, 800, 0.96484375]
  EXPECT_EQ(phi3.at(9, 0), Pattern(AShapePattern{100, 800}));
  int stream = 0;
  for (const Pattern& q : phi3.table()) stream += std::holds_alternative<AShapePattern>(q);
  EXPECT_EQ(stream, 43);
  const AttentionPolicy qwen = load_policy_file(dir / files[3].file, files[3].shape);
  EXPECT_EQ(qwen.at(0, 0), Pattern(vs(3500, 100)));

  // Without the model's shape the file still loads, one KV head per query head.
  const AttentionPolicy bare = load_policy_file(dir / files[0].file);
  EXPECT_EQ(shape_of(bare), (PolicyShape{32, 32, 32}));
  EXPECT_EQ(bare.table(), llama3.table());
}

// ---- MoA -------------------------------------------------------------------------------------------------

TEST(PatternConfig, MoaRoundTrip) {
  const json j = json::parse(std::ifstream(kConfigs / "moa_small.json"));
  const AttentionPolicy p = import_moa(j, "moa_small.json", 2);
  EXPECT_EQ(shape_of(p), (PolicyShape{2, 4, 2}));
  EXPECT_EQ(p.at(0, 1), Pattern(ElasticWindowPattern{-1024.0, 1.0, 64}));
  EXPECT_EQ(p.at(1, 3), Pattern(ElasticWindowPattern{-1024.0, 0.625, 64}));
  EXPECT_EQ(export_moa(p), j);
  EXPECT_EQ(import_moa(export_moa(p), "mem", 2), p);
  EXPECT_EQ(parse_tessera_policy(save_policy_json(p), "mem"), p);

  AttentionPolicy q = p;
  q.at(1, 2) = ElasticWindowPattern{0.0, 0.5, 32};
  EXPECT_EQ(
      error_of([&] { export_moa(q); }),
      "export to moa format: layer 1, head 2 runs moa_window(alpha=0, beta=0.5, sink=32), which that format "
      "cannot express (it has only moa_window with sink 64 and dense)");
  // A dense head (a MoA plan's head in a model's sliding-window layer) is the window of the whole prompt.
  q.at(1, 2) = DensePattern{};
  const AttentionPolicy back = import_moa(export_moa(q), "mem", 2);
  EXPECT_EQ(back.at(1, 2), Pattern(ElasticWindowPattern{0.0, 1.0, 64}));
  for (const int32_t n : {1, 100, 5000})
    EXPECT_EQ(index_stats(lower_layer({back.at(1, 2)}, {}, LoweringContext::prefill(n, 64))).mask_cells,
              int64_t{n} * (n + 1) / 2);
}

TEST(PatternConfig, ImportsPublishedMoaPlans) {
  const fs::path dir = kShared / "moa-configs";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "published MoA plans not found at " << dir;
  const fs::path small = dir / "Llama-3.2-1B-Instruct_moa_alpha_beta.json";
  const AttentionPolicy p = load_policy_file(small, PolicyShape{16, 32, 8});
  EXPECT_EQ(shape_of(p), (PolicyShape{16, 32, 8}));
  EXPECT_EQ(p.at(0, 0), Pattern(ElasticWindowPattern{0.0, 0.5, 64}));
  EXPECT_EQ(p.at(0, 4),
            Pattern(ElasticWindowPattern{-1024.0, std::get<ElasticWindowPattern>(p.at(0, 4)).beta, 64}));
  EXPECT_EQ(export_moa(p), json::parse(std::ifstream(small)));

  const fs::path big = dir / "Llama-3-8B-Instruct-262k_moa_alpha_beta.json";
  const AttentionPolicy b = load_policy_file(big, PolicyShape{32, 32, 8});
  EXPECT_EQ(b.at(0, 0), Pattern(ElasticWindowPattern{0.0, 0.625, 64}));
  EXPECT_EQ(export_moa(b), json::parse(std::ifstream(big)));
  EXPECT_EQ(parse_tessera_policy(save_policy_json(b), "mem"), b);
}

// ---- detection and summary -------------------------------------------------------------------------------

TEST(PatternConfig, DetectsFormats) {
  EXPECT_EQ(detect_policy_format(json::parse(R"({"tessera_policy": 1})"), "a"), PolicyFormat::tessera);
  EXPECT_EQ(detect_policy_format(json::parse("[]"), "a"), PolicyFormat::minference);
  EXPECT_EQ(detect_policy_format(json::parse(R"({"alphas": []})"), "a"), PolicyFormat::moa);
  EXPECT_EQ(format_name(PolicyFormat::moa), "moa");
}

TEST(PatternConfig, SummarizesPolicy) {
  AttentionPolicy p =
      AttentionPolicy::trianglemix(AttentionPolicy::uniform(6, 4, 2, vs(1000, 6096)), 3, TrianglePattern{});
  p.at(0, 1) = AShapePattern{100, 800};
  p.at(1, 1) = AShapePattern{100, 800};
  p.at(2, 0) = vs(30, 800);
  EXPECT_EQ(summarize_policy(p),
            "policy: 6 layers x 4 query heads (2 KV heads), 24 heads\n"
            "layers 0-1: ashape 2, vertical_slash 6\n"
            "layer 2: vertical_slash 4\n"
            "layers 3-5: triangle 12\n"
            "distinct patterns:\n"
            "  12  triangle(sink=8, local=512, last=128)\n"
            "   9  vertical_slash(v=1000, s=6096)\n"
            "   2  ashape(sink=100, local=800)\n"
            "   1  vertical_slash(v=30, s=800)\n");
}

// ---- malformed files: one case each, exact messages
// --------------------------------------------------------

TEST_F(ConfigFiles, FileNotFound) {
  EXPECT_EQ(error_of([&] { load_policy_file(dir_ / "nope.json"); }), path("nope.json") + ": file not found");
}

TEST_F(ConfigFiles, DirectoryIsNotAFile) {
  EXPECT_EQ(error_of([&] { load_policy_file(dir_); }), dir_.string() + ": is a directory, not a policy file");
}

TEST_F(ConfigFiles, InvalidJsonNamesThePosition) {
  const std::string msg = load_error("bad.json", "{\n  \"tessera_policy\": 1,\n  }\n");
  const std::string want = path("bad.json") + ": invalid JSON at line 3, column 3: syntax error";
  EXPECT_EQ(msg.substr(0, want.size()), want) << msg;
  const std::string empty = load_error("empty.json", "");
  const std::string want_empty = path("empty.json") + ": invalid JSON at line 1, column 1: ";
  EXPECT_EQ(empty.substr(0, want_empty.size()), want_empty) << empty;
}

TEST_F(ConfigFiles, NotAPolicyFile) {
  EXPECT_EQ(
      load_error("x.json", R"({"model": "llama"})"),
      path("x.json") +
          ": not a policy file: expected a tessera policy (an object with \"tessera_policy\"), a MInference "
          "config (a list over layers) or a MoA plan (an object with \"alphas\" and \"betas\"), got an "
          "object "
          "without those keys");
  EXPECT_EQ(
      load_error("n.json", "42").substr(path("n.json").size()),
      ": not a policy file: expected a tessera policy (an object with \"tessera_policy\"), a MInference "
      "config (a list over layers) or a MoA plan (an object with \"alphas\" and \"betas\"), got a number");
}

// MInference ------------------------------------------------------------------------------------------------

const char* kTwoByTwo = R"([{"0": ["vertical_and_slash", 1000, 6096, 1], "1": ["stream_llm", 100, 800, 1]},
                            {"0": ["vertical_and_slash", 30, 800, 1], "1": ["block_sparse", 100, 0, 1]}])";

TEST_F(ConfigFiles, MInferenceWrongLayerCount) {
  EXPECT_EQ(load_error("m.json", kTwoByTwo, PolicyShape{3, 2, 1}),
            path("m.json") + ": the policy has 2 layers, but the model has 3");
}

TEST_F(ConfigFiles, MInferenceWrongHeadCountInALayer) {
  const char* text = R"([{"0": ["vertical_and_slash", 1, 1, 1], "1": ["vertical_and_slash", 1, 1, 1]},
                         {"0": ["vertical_and_slash", 1, 1, 1]}])";
  EXPECT_EQ(load_error("m.json", text), path("m.json") + ": layer 1 has 1 heads, but layer 0 has 2");
  EXPECT_EQ(load_error("m.json", kTwoByTwo, PolicyShape{2, 4, 1}),
            path("m.json") + ": layer 0 has 2 heads, but the model has 4 query heads");
}

TEST_F(ConfigFiles, MInferenceMissingHead) {
  const char* text = R"([{"0": ["vertical_and_slash", 1, 1, 1], "2": ["vertical_and_slash", 1, 1, 1]}])";
  EXPECT_EQ(load_error("m.json", text),
            path("m.json") + ": layer 0, head 1: missing (found key \"2\" instead)");
}

TEST_F(ConfigFiles, MInferenceUnknownPattern) {
  const char* text = R"([{"0": ["vertical_and_slash", 1, 1, 1], "1": ["foo", 1, 1, 1]}])";
  EXPECT_EQ(load_error("m.json", text),
            path("m.json") +
                ": layer 0, head 1: unknown pattern 'foo' (known: vertical_and_slash, stream_llm, "
                "block_sparse)");
}

TEST_F(ConfigFiles, MInferenceNegativeSize) {
  std::string text = "[";
  for (int l = 0; l < 4; ++l) {
    text += l ? ", {" : "{";
    for (int h = 0; h < 32; ++h)
      text += (h ? ", \"" : "\"") + std::to_string(h) + "\": [\"vertical_and_slash\", " +
              (l == 3 && h == 17 ? "-5" : "1000") + ", 6096, 0.5]";
    text += "}";
  }
  text += "]";
  EXPECT_EQ(load_error("llama.json", text, PolicyShape{4, 32, 8}),
            path("llama.json") + ": layer 3, head 17: field 'vertical_size' must be >= 0, got -5");
  const char* slash = R"([{"0": ["block_sparse", 10, -1, 0]}])";
  EXPECT_EQ(load_error("s.json", slash),
            path("s.json") + ": layer 0, head 0: field 'slash_size' must be >= 0, got -1");
  const char* window = R"([{"0": ["stream_llm", 10, 0, 0]}])";
  EXPECT_EQ(load_error("w.json", window),
            path("w.json") +
                ": layer 0, head 0: field 'slash_size' must be >= 1 for stream_llm (it is the local "
                "window), got 0");
}

TEST_F(ConfigFiles, MInferenceNonNumericField) {
  EXPECT_EQ(load_error("m.json", R"([{"0": ["vertical_and_slash", 1000, "6096", 0]}])"),
            path("m.json") + ": layer 0, head 0: field 'slash_size' must be an integer, got \"6096\"");
  EXPECT_EQ(load_error("m.json", R"([{"0": ["vertical_and_slash", 10.5, 6096, 0]}])"),
            path("m.json") + ": layer 0, head 0: field 'vertical_size' must be an integer, got 10.5");
  EXPECT_EQ(load_error("m.json", R"([{"0": ["vertical_and_slash", 1, 1, "high"]}])"),
            path("m.json") + ": layer 0, head 0: field 'search_score' must be a number, got \"high\"");
  EXPECT_EQ(load_error("m.json", R"([{"0": [7, 1, 1, 0]}])"),
            path("m.json") + ": layer 0, head 0: field 'pattern_name' must be a string, got 7");
  EXPECT_EQ(load_error("m.json", R"([{"0": ["vertical_and_slash", 1e10, 1, 0]}])"),
            path("m.json") +
                ": layer 0, head 0: field 'vertical_size' must be a 32-bit integer, got 10000000000.0");
}

TEST_F(ConfigFiles, MInferenceMalformedEntryAndLayer) {
  EXPECT_EQ(load_error("m.json", R"([{"0": ["vertical_and_slash", 1]}])"),
            path("m.json") +
                ": layer 0, head 0: expected [pattern_name, vertical_size, slash_size, search_score], "
                "got [\"vertical_and_slash\",1]");
  EXPECT_EQ(load_error("m.json", R"([{"0": ["stream_llm", 1, 1, 0]}, 5])"),
            path("m.json") +
                ": layer 1: expected an object mapping head index to [pattern_name, vertical_size, "
                "slash_size, search_score], got 5");
  EXPECT_EQ(load_error("m.json", "[]"), path("m.json") + ": the MInference config has no layers");
  EXPECT_EQ(load_error("m.json", "[{}]"), path("m.json") + ": layer 0 has no heads");
}

TEST(PatternConfig, MInferenceKvHeadsMustDivideQueryHeads) {
  EXPECT_EQ(error_of([] { import_minference(json::parse(kTwoByTwo), "m.json", 3); }),
            "m.json: 2 query heads are not a multiple of 3 KV heads");
}

// MoA -------------------------------------------------------------------------------------------------------

TEST_F(ConfigFiles, MoaMissingField) {
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0]]})"), path("moa.json") + ": missing field 'betas'");
  EXPECT_EQ(load_error("moa.json", R"({"alphas": 3, "betas": []})"),
            path("moa.json") + ": field 'alphas' must be a list over layers, got 3");
}

TEST_F(ConfigFiles, MoaWrongLayerCount) {
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0], [0.0]], "betas": [[0.5]]})"),
            path("moa.json") + ": 'betas' has 1 layers, but 'alphas' has 2");
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0]], "betas": [[0.5]]})", PolicyShape{16, 1, 1}),
            path("moa.json") + ": the policy has 1 layers, but the model has 16");
}

TEST_F(ConfigFiles, MoaWrongHeadCount) {
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0, 0.0], [0.0]], "betas": [[0.5, 0.5], [0.5]]})"),
            path("moa.json") + ": layer 1 has 1 heads in 'alphas', but layer 0 has 2");
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0, 0.0], [0.0, 0.0]], "betas": [[0.5, 0.5], [0.5]]})"),
            path("moa.json") + ": layer 1 has 1 heads in 'betas', but 2 in 'alphas'");
}

TEST_F(ConfigFiles, MoaBadValues) {
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0, "x"]], "betas": [[0.5, 0.5]]})"),
            path("moa.json") + ": layer 0, head 1: field 'alphas' must be a number, got \"x\"");
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0, 0.0]], "betas": [[0.5, -0.25]]})"),
            path("moa.json") + ": layer 0, head 1: field 'betas' must be >= 0, got -0.25");
  EXPECT_EQ(load_error("moa.json", R"({"alphas": [[0.0], 1], "betas": [[0.5], [0.5]]})"),
            path("moa.json") + ": layer 1: field 'alphas' must be a list over heads, got 1");
}

// tessera ---------------------------------------------------------------------------------------------------

std::string tessera_doc(const std::string& body) {
  return R"({"tessera_policy": 1, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, )" + body + "}";
}

TEST_F(ConfigFiles, TesseraUnsupportedVersion) {
  EXPECT_EQ(load_error("t.json", R"({"tessera_policy": 2})"),
            path("t.json") + ": unsupported tessera_policy version 2 (this build reads version 1)");
}

TEST_F(ConfigFiles, TesseraMissingAndBadCounts) {
  EXPECT_EQ(load_error("t.json", R"({"tessera_policy": 1, "num_q_heads": 4, "num_kv_heads": 2})"),
            path("t.json") + ": missing field 'num_layers'");
  EXPECT_EQ(load_error("t.json",
                       R"({"tessera_policy": 1, "num_layers": "2", "num_q_heads": 4, "num_kv_heads": 2})"),
            path("t.json") + ": field 'num_layers' must be an integer, got \"2\"");
  EXPECT_EQ(
      load_error("t.json", R"({"tessera_policy": 1, "num_layers": 2, "num_q_heads": 0, "num_kv_heads": 2})"),
      path("t.json") + ": field 'num_q_heads' must be >= 1, got 0");
  EXPECT_EQ(
      load_error("t.json", R"({"tessera_policy": 1, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 3})"),
      path("t.json") + ": num_q_heads (4) is not a multiple of num_kv_heads (3)");
}

TEST_F(ConfigFiles, NumberOverflowIsAnError) {
  // Found by fuzz_policy_file (scripts/fuzz.sh): nlohmann throws out_of_range, not parse_error, for this.
  EXPECT_EQ(load_error("t.json", R"([{"0": ["vertical_and_slash", 1024.0e51111111111, 10, 0.5]}])"),
            path("t.json") + ": invalid JSON (number overflow parsing '1024.0e51111111111')");
}

TEST_F(ConfigFiles, SizesAreCheckedBeforeAnythingIsAllocated) {
  // Header counts against the model, before the table (num_layers x num_q_heads patterns) is sized from them.
  const std::string huge = R"({"tessera_policy": 1, "num_layers": 2000000000, "num_q_heads": 2000000000,
                               "num_kv_heads": 1, "default": {"type": "dense"}})";
  EXPECT_EQ(load_error("t.json", huge, PolicyShape{2, 4, 2}),
            path("t.json") + ": the policy has 2000000000 layers, but the model has 2");
  EXPECT_EQ(load_error("t.json", huge),
            path("t.json") + ": num_layers x num_q_heads = 4000000000000000000 heads, more than tessera's limit of " +
                std::to_string(kMaxPolicyHeads) + " (a policy holds one pattern per layer and query head)");
  // Only regular files, and of a bounded size.
  EXPECT_EQ(error_of([&] { load_policy_file("/dev/null"); }),
            "/dev/null: not a regular file (a policy is read from a JSON file, not a device or a pipe)");
  const fs::path big = dir_ / "big.json";
  { std::ofstream(big) << "["; }
  fs::resize_file(big, kMaxPolicyFileBytes + 1);  // sparse: no disk used
  EXPECT_EQ(error_of([&] { load_policy_file(big); }),
            big.string() + ": " + std::to_string(kMaxPolicyFileBytes + 1) +
                " bytes, more than a policy file may hold (64 MiB)");
}

TEST_F(ConfigFiles, TesseraUnknownTopLevelField) {
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("defualt": {"type": "dense"})")),
            path("t.json") +
                ": unknown field 'defualt' (known: tessera_policy, comment, num_layers, num_q_heads, "
                "num_kv_heads, default, layers, table, trianglemix, placement, planned_lengths)");
}

TEST_F(ConfigFiles, TesseraUnknownPattern) {
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "foo"})")),
            path("t.json") +
                ": default: unknown pattern 'foo' (known: dense, ashape, moa_window, triangle, "
                "vertical_slash, block_sparse)");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"sink": 4})")),
            path("t.json") + ": default: missing field 'type'");
  EXPECT_EQ(
      load_error("t.json", tessera_doc(R"("default": "dense")")),
      path("t.json") + ": default: a pattern must be an object such as {\"type\": \"dense\"}, got \"dense\"");
}

TEST_F(ConfigFiles, TesseraUnknownPatternField) {
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "vertical_slash", "slsh": 10})")),
            path("t.json") +
                ": default: unknown field 'slsh' for pattern 'vertical_slash' (known: vertical, slash, "
                "last_q, forced_columns, forced_diagonals, gamma, min_vertical, min_slash)");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense", "sink": 10})")),
            path("t.json") + ": default: unknown field 'sink' for pattern 'dense' (it has no fields)");
}

TEST_F(ConfigFiles, TesseraOutOfRangeFieldUsesValidate) {
  const std::string text = tessera_doc(
      R"("default": {"type": "dense"}, "layers": [{}, {"heads": {"3": {"type": "ashape", "sink": -5}}}])");
  EXPECT_EQ(load_error("t.json", text),
            path("t.json") + ": layer 1, head 3: field 'sink' must be >= 0, got -5");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "moa_window", "beta": -1})")),
            path("t.json") + ": default: field 'beta' must be finite and >= 0, got -1");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "moa_window", "alpha": "big"})")),
            path("t.json") + ": default: field 'alpha' must be a number, got \"big\"");
}

TEST_F(ConfigFiles, TesseraLayersMalformed) {
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "layers": [{}])")),
            path("t.json") + ": 'layers' has 1 entries, but num_layers is 2");
  EXPECT_EQ(load_error("t.json",
                       tessera_doc(R"("default": {"type": "dense"}, "layers": [{}, {"heads": {"x": {}}}])")),
            path("t.json") + ": layer 1: head key 'x' is not a head index");
  EXPECT_EQ(load_error("t.json",
                       tessera_doc(R"("default": {"type": "dense"}, "layers": [{}, {"heads": {"4": {}}}])")),
            path("t.json") + ": layer 1: head 4 is out of range (num_q_heads is 4)");
  EXPECT_EQ(
      load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "layers": [{}, {"dflt": {}}])")),
      path("t.json") + ": layer 1: unknown field 'dflt' (known: default, heads)");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "layers": [{}, []])")),
            path("t.json") +
                ": layer 1: a layer entry must be an object with optional 'default' and 'heads', got []");
}

TEST_F(ConfigFiles, TesseraHeadWithoutPattern) {
  const std::string text =
      tessera_doc(R"("layers": [{"default": {"type": "dense"}}, {"heads": {"0": {"type": "dense"}}}])");
  EXPECT_EQ(
      load_error("t.json", text),
      path("t.json") +
          ": layer 1, head 1: no pattern (give a top-level 'default', a layer 'default' or a 'heads' entry)");
}

TEST_F(ConfigFiles, TesseraTableMalformed) {
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "table": [])")),
            path("t.json") + ": 'table' lists every head; it cannot be combined with 'default'");
  const std::string d = R"({"type": "dense"})";
  EXPECT_EQ(load_error("t.json",
                       tessera_doc(R"("table": [[)" + d + "," + d + "," + d + "," + d + "], [" + d + "]]")),
            path("t.json") + ": table, layer 1 has 1 heads, but num_q_heads is 4");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("table": [[)" + d + "," + d + "," + d + "," + d + "]]")),
            path("t.json") + ": 'table' has 1 layers, but num_layers is 2");
  EXPECT_EQ(
      load_error("t.json", tessera_doc(R"("table": [[)" + d + "," + d + "," + d + "," + d + R"(], [)" + d +
                                       "," + d + "," + d + R"(, {"type": "triangle", "last": "x"}]])")),
      path("t.json") + ": layer 1, head 3: field 'last' must be an integer, got \"x\"");
}

TEST_F(ConfigFiles, TesseraTriangleMixMalformed) {
  EXPECT_EQ(
      load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "trianglemix": {"start_layer": 3})")),
      path("t.json") + ": trianglemix: field 'start_layer' must be in [0, 2], got 3");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"}, "trianglemix": {})")),
            path("t.json") + ": trianglemix: missing field 'start_layer'");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"},
                                               "trianglemix": {"start_layer": 1, "triangle": {"type": "dense"}})")),
            path("t.json") + ": trianglemix.triangle: must be a triangle pattern, got 'dense'");
  EXPECT_EQ(load_error("t.json", tessera_doc(R"("default": {"type": "dense"},
                                               "trianglemix": {"start_layer": 1, "triangle": {"local": 0}})")),
            path("t.json") + ": trianglemix.triangle: field 'local' must be >= 1, got 0");
}

TEST_F(ConfigFiles, TesseraShapeDiffersFromModel) {
  const std::string text = tessera_doc(R"("default": {"type": "dense"})");
  EXPECT_EQ(load_error("t.json", text, PolicyShape{32, 4, 2}),
            path("t.json") + ": the policy has 2 layers, but the model has 32");
  EXPECT_EQ(load_error("t.json", text, PolicyShape{2, 8, 2}),
            path("t.json") + ": the policy has 4 query heads per layer, but the model has 8");
  EXPECT_EQ(load_error("t.json", text, PolicyShape{2, 4, 4}),
            path("t.json") + ": the policy has 2 KV heads, but the model has 4");
}

TEST_F(ConfigFiles, TesseraAcceptsComments) {
  const AttentionPolicy p = load_policy_file(
      write("c.json", tessera_doc("// a comment\n  \"default\": {\"type\": \"dense\"} /* trailing */")));
  EXPECT_EQ(p, AttentionPolicy::uniform(2, 4, 2, DensePattern{}));
}

TEST_F(ConfigFiles, SaveReportsUnwritablePath) {
  const AttentionPolicy p = AttentionPolicy::uniform(1, 1, 1, DensePattern{});
  const fs::path bad = dir_ / "no_such_dir" / "p.json";
  EXPECT_EQ(error_of([&] { save_policy_file(p, bad); }),
            bad.string() + ": cannot open file for writing: No such file or directory");
}

}  // namespace
}  // namespace tessera::attn
