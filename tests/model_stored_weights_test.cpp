// Weights kept as stored (model/weights.h): the forward over the stored types against the forward over the same
// file expanded to f32 (WeightOptions::expand_f32, the reference), per type; the Weight accessors; what the loader
// keeps; the exact errors.
//
// The types: every fixture GGUF (tests/data/hf_tiny/*/model.gguf, f32) rewritten with its matrices (linear weights
// and the embedding table) in each type tessera can write (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: quant.h's
// reference quantizers), plus the fixture's own Q8_0 file and, when fetched, the real models (Q4_1, Q8_0, Q5_0,
// Q4_K, Q6_K). Both forwards read the same stored values; they differ only in how the products run: the f32
// expansion multiplies f32 by f32 (OpenBLAS), the stored forward multiplies f16/bf16 weights by f32 activations
// (the same products, another summation order) and block-quantized weights by the activations rounded to int8 per
// block (qmatmul.h), as llama.cpp does.
//
// Tolerances (measured here):
// - float types: max |logit difference| < 1e-4, the tolerance the fixtures' logits tests use against transformers
//   (measured at most 1.8e-5: summation order alone).
// - block types on the tiny fixtures: max |logit difference| <= 15% of the largest |logit| at that position
//   (measured up to 9.0%: smollm2 Q5_0; Q8_0, whose weights are almost exact, 2.7-8.0%, so the activations' int8
//   rounding dominates). Per element that rounding is at most max|x_block| / 254 (0.4% of the block's largest
//   activation); the fixtures' random weights give flat, easily moved logits, and the error compounds through the
//   layers and the attention softmax. This bound catches a wrong block, scale or row (those move logits by their
//   whole size), not the accuracy: the accuracy bar is on the real models below.
// - the real models (when fetched): perplexity of the stored forward over a 600-token text within 0.5% of the f32
//   expansion's (the bar; measured +0.175% SmolLM2 Q4_1, +0.202% Gemma-3 Q4_K_M with the default, one int8
//   level plus the second on the outlier blocks; +0.07% / -0.06% with one level, +0.001% / -0.002% with two levels
//   everywhere: on this low-perplexity text the three move by a few tenths of a percent either way) and the same
//   argmax at >= 95% of the positions (measured 598/600 and 599/600; one level 597 and 599, two levels 600 and 600).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/model.h"
#include "model/model_file.h"
#include "model/quant.h"
#include "model/weights.h"
#include "runtime/engine.h"

namespace tessera::runtime {
namespace {

using model::TensorType;

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("tessera_stored_weights_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
              std::to_string(reinterpret_cast<uintptr_t>(&kFixtures)));
  std::filesystem::create_directories(dir);
  return dir;
}

bool is_matrix(const std::string& name) {
  for (const char* suffix : {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                             "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "token_embd.weight",
                             "output.weight"})
    if (name.size() >= std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::string::npos,
                                                           suffix) == 0)
      return true;
  return false;
}

// `src` (a GGUF) rewritten with every matrix whose rows are whole blocks of `type` in `type`; the rest as is.
std::string requantize(const std::string& src, TensorType type, const std::string& out) {
  auto file = model::ModelFile::open(src);
  model::GGUFWriter w(file->gguf_version());
  for (const auto& [key, value] : file->metadata().items())
    w.add(key, *file->metadata_type(key), value);
  for (const model::TensorInfo& t : file->tensors()) {
    const auto bs = static_cast<int64_t>(model::tensor_type_block_size(type));
    if (is_matrix(t.name) && t.row_length() % bs == 0) {
      std::vector<float> f(static_cast<size_t>(t.numel()));
      model::dequantize(t, f.data());
      std::vector<uint8_t> q(model::tensor_type_bytes(type, t.numel()));
      for (int64_t r = 0; r < t.rows(); ++r)
        model::quantize_row(type, f.data() + r * t.row_length(), t.row_length(),
                            q.data() + static_cast<size_t>(r) * model::tensor_type_bytes(type, t.row_length()));
      w.add_tensor(t.name, type, t.shape, q.data(), q.size());
    } else {
      w.add_tensor(t.name, t.type, t.shape, t.data, t.bytes);
    }
  }
  w.write(out);
  return out;
}

struct Diff {
  float max_abs = 0;  // max |stored - f32| over all logits
  float max_rel = 0;  // max over positions of max |stored - f32| / max |f32 logit|
};

Diff compare(const Model& stored, const Model& f32, const std::vector<int32_t>& tokens) {
  Engine a(stored), b(f32);
  const std::vector<float> x = a.forward_all_logits(tokens), y = b.forward_all_logits(tokens);
  EXPECT_EQ(x.size(), y.size());
  const auto V = static_cast<size_t>(stored.config().vocab_size);
  Diff d;
  for (size_t t = 0; t * V < y.size(); ++t) {
    float m = 0, scale = 0;
    for (size_t i = t * V; i < (t + 1) * V; ++i) {
      m = std::max(m, std::fabs(x[i] - y[i]));
      scale = std::max(scale, std::fabs(y[i]));
    }
    d.max_abs = std::max(d.max_abs, m);
    d.max_rel = std::max(d.max_rel, m / scale);
  }
  return d;
}

std::vector<int32_t> fixture_tokens(const std::string& fixture) {
  std::ifstream f(kFixtures + fixture + "/expected.json");
  return nlohmann::json::parse(f)["tokens"].get<std::vector<int32_t>>();
}

WeightOptions expanded() {
  WeightOptions o;
  o.expand_f32 = true;
  return o;
}

bool float_type(TensorType t) { return t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16; }

// ---- the stored forward against the f32 expansion, per fixture and type

TEST(StoredWeights, ForwardEqualsTheF32ExpansionPerType) {
  const auto dir = temp_dir();
  for (const char* fixture : {"llama3", "smollm2", "qwen2", "gemma3"}) {
    const std::vector<int32_t> tokens = fixture_tokens(fixture);
    for (TensorType type : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                            TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1}) {
      const std::string path = requantize(kFixtures + fixture + "/model.gguf", type,
                                          (dir / (std::string(fixture) + "_" +
                                                  std::string(model::tensor_type_name(type)) + ".gguf"))
                                              .string());
      const auto stored = Model::load(path), f32 = Model::load(path, nullptr, expanded());
      // The matrices the products read are kept in `type` (gemma3's 48-wide ones stay f32: not whole blocks).
      EXPECT_EQ(stored->weights().layers[0].w_down.type, type) << fixture;
      EXPECT_EQ(f32->weights().layers[0].w_down.type, TensorType::F32) << fixture;
      const Diff d = compare(*stored, *f32, tokens);
      if (float_type(type)) {
        EXPECT_LT(d.max_abs, 1e-4f) << fixture << " " << model::tensor_type_name(type);
      } else {
        EXPECT_LE(d.max_rel, 0.15f) << fixture << " " << model::tensor_type_name(type) << " (max abs "
                                    << d.max_abs << ")";
        EXPECT_GT(d.max_abs, 0.0f) << fixture << ": int8 activations change the logits a little";
      }
      std::printf("%-8s %-5s max |diff| %.3g, relative to the largest logit %.3g\n", fixture,
                  std::string(model::tensor_type_name(type)).c_str(), d.max_abs, d.max_rel);
    }
  }
  std::filesystem::remove_all(dir);
}

// Per-class options: name parts pick the tensors expanded to f32 (WeightOptions::expand_f32_tensors: f32
// activations for that class alone) and those whose products take two-level int8 activations (int8x2_tensors);
// a float weight ignores the latter. Two levels everywhere bring the Q8_0 forward (almost exact weights: the
// activations' rounding is the difference) much closer to the f32 expansion than one level.
TEST(StoredWeights, PerClassExpansionAndTwoLevelActivations) {
  const auto dir = temp_dir();
  const std::string path =
      requantize(kFixtures + "smollm2/model.gguf", TensorType::Q8_0, (dir / "smollm2_q8_0.gguf").string());
  WeightOptions sel;
  sel.expand_f32_tensors = "attn_q.,ffn_down";
  sel.int8x2_tensors = "ffn_up,attn_q.";
  sel.int8_outlier_tensors = "ffn_gate,ffn_up,attn_v";  // two levels win where both name a tensor
  const auto m = Model::load(path, nullptr, sel);
  for (const LayerWeights& l : m->weights().layers) {
    EXPECT_EQ(l.wq.type, TensorType::F32);
    EXPECT_EQ(l.w_down.type, TensorType::F32);
    EXPECT_EQ(l.wk.type, TensorType::Q8_0);
    EXPECT_EQ(l.w_up.type, TensorType::Q8_0);
    EXPECT_EQ(l.w_up.act, model::QAct::Int8x2);
    EXPECT_EQ(l.w_gate.act, model::QAct::Int8Outliers);
    EXPECT_EQ(l.wv.act, model::QAct::Int8Outliers);
    EXPECT_EQ(l.wk.act, model::QAct::Int8);
    EXPECT_EQ(l.wq.act, model::QAct::Int8);  // expanded: its products read f32 activations
  }
  WeightOptions one, two;
  one.int8x2_tensors = "";
  one.int8_outlier_tensors = "";  // one level (the default takes the outliers' second level)
  two.int8x2_tensors = "attn_,ffn_,token_embd,output";
  const auto f32 = Model::load(path, nullptr, expanded());
  const std::vector<int32_t> tokens = fixture_tokens("smollm2");
  const Diff d1 = compare(*Model::load(path, nullptr, one), *f32, tokens);
  const Diff d2 = compare(*Model::load(path, nullptr, two), *f32, tokens);
  std::printf("smollm2 Q8_0: max |diff| relative to the largest logit: int8 %.3g, two-level int8 %.3g\n", d1.max_rel,
              d2.max_rel);
  EXPECT_GT(d2.max_rel, 0.0f);
  EXPECT_LT(d2.max_rel, d1.max_rel / 20) << "int8 " << d1.max_rel << ", two-level " << d2.max_rel;
  std::filesystem::remove_all(dir);
}

TEST(StoredWeights, FixtureQ8_0File) {
  const std::string path = kFixtures + "smollm2/model-q8_0.gguf";
  const auto stored = Model::load(path), f32 = Model::load(path, nullptr, expanded());
  EXPECT_EQ(stored->weights().layers[0].wq.type, TensorType::Q8_0);
  // The default activations: one int8 level plus the second on the outlier blocks (default_int8_outlier_tensors)
  EXPECT_EQ(stored->weights().layers[0].wq.act, model::QAct::Int8Outliers);
  EXPECT_EQ(stored->weights().layers[0].w_down.act, model::QAct::Int8Outliers);
  const Diff d = compare(*stored, *f32, fixture_tokens("smollm2"));
  EXPECT_LE(d.max_rel, 0.15f) << d.max_abs;
}

// ---- safetensors in bf16 / f16 keep that type (no f32 copy)

// The llama3 fixture's safetensors rewritten with its matrices in `type` (names, shapes and order kept).
std::string safetensors_in(TensorType type, const std::string& out) {
  auto file = model::ModelFile::open(kFixtures + "llama3/model.safetensors");
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const model::TensorInfo& t : file->tensors()) {
    std::vector<float> f(static_cast<size_t>(t.numel()));
    model::dequantize(t, f.data());
    const TensorType keep = t.shape.size() == 2 ? type : TensorType::F32;
    std::string bytes(model::tensor_type_bytes(keep, t.numel()), '\0');
    model::quantize_row(keep, f.data(), t.numel(), reinterpret_cast<uint8_t*>(bytes.data()));
    header[t.name] = {{"dtype", std::string(model::tensor_type_name(keep))},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  }
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream f(out, std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << h << data;
  return out;
}

TEST(StoredWeights, SafetensorsBf16AndF16KeepTheirType) {
  const auto dir = temp_dir();
  std::filesystem::copy_file(kFixtures + "llama3/config.json", dir / "config.json");
  for (TensorType type : {TensorType::BF16, TensorType::F16}) {
    const std::string path = safetensors_in(type, (dir / "model.safetensors").string());
    const auto stored = Model::load(dir.string()), f32 = Model::load(dir.string(), nullptr, expanded());
    const Weight& w = stored->weights().layers[0].w_gate;
    EXPECT_EQ(w.type, type);
    EXPECT_TRUE(w.mapped());  // no copy
    EXPECT_EQ(w.bytes, stored->file().get("model.layers.0.mlp.gate_proj.weight").data);
    EXPECT_EQ(stored->weights().embedding.type, type);
    EXPECT_LE(stored->weights().bytes(), f32->weights().bytes() / 2 + 4096);
    const Diff d = compare(*stored, *f32, fixture_tokens("llama3"));
    EXPECT_LT(d.max_abs, 1e-4f) << model::tensor_type_name(type);
    std::filesystem::remove(path);
  }
  std::filesystem::remove_all(dir);
}

// ---- the real models (skipped when not fetched)

std::string real_model(const std::string& file) {
  const char* env = std::getenv("TESSERA_MODELS");
  const char* home = std::getenv("HOME");
  const std::string dir = env != nullptr && *env != '\0' ? std::string(env)
                                                          : std::string(home != nullptr ? home : ".") +
                                                                "/.cache/tessera/models";
  const std::string path = dir + "/" + file;
  return std::filesystem::exists(path) ? path : std::string();
}

// Mean negative log-likelihood of tokens[1..] under the model's logits.
double mean_nll(const std::vector<float>& logits, const std::vector<int32_t>& tokens, size_t V) {
  double total = 0;
  for (size_t t = 0; t + 1 < tokens.size(); ++t) {
    const float* z = logits.data() + t * V;
    double mx = z[0];
    for (size_t i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(z[i]));
    double s = 0;
    for (size_t i = 0; i < V; ++i) s += std::exp(static_cast<double>(z[i]) - mx);
    total += mx + std::log(s) - z[static_cast<size_t>(tokens[t + 1])];
  }
  return total / static_cast<double>(tokens.size() - 1);
}

void check_real(const std::string& file) {
  const std::string path = real_model(file);
  if (path.empty()) GTEST_SKIP() << file << " is not fetched (scripts/fetch_models.sh)";
  const auto stored = Model::load(path), f32 = Model::load(path, nullptr, expanded());
  // A fixed text, tokenized by the model itself.
  const std::string stem = std::filesystem::path(file).stem().string();
  std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/real/" + stem + ".json");
  ASSERT_TRUE(in.good());
  const auto tokens = nlohmann::json::parse(in)["tokens"].get<std::vector<int32_t>>();
  ASSERT_GE(tokens.size(), 32u);
  Engine a(*stored), b(*f32);
  const std::vector<float> x = a.forward_all_logits(tokens), y = b.forward_all_logits(tokens);
  const auto V = static_cast<size_t>(stored->config().vocab_size);
  const double px = std::exp(mean_nll(x, tokens, V)), py = std::exp(mean_nll(y, tokens, V));
  size_t same = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const auto ax = std::max_element(x.begin() + t * V, x.begin() + (t + 1) * V) - x.begin();
    const auto ay = std::max_element(y.begin() + t * V, y.begin() + (t + 1) * V) - y.begin();
    same += ax == ay;
  }
  std::printf("%s: perplexity stored %.4f, f32 expansion %.4f (%+.3f%%); argmax equal at %zu / %zu positions; "
              "weights %s\n",
              file.c_str(), px, py, 100 * (px / py - 1), same, tokens.size(), stored->weights().summary().c_str());
  EXPECT_LT(std::fabs(px / py - 1), 0.005) << file;
  EXPECT_GE(static_cast<double>(same), 0.95 * static_cast<double>(tokens.size())) << file;
  // The weights kept as stored take about the file's size, not 4 bytes a parameter.
  EXPECT_LT(stored->weights().bytes(), f32->weights().bytes() / 3) << file;
}

TEST(StoredWeights, RealSmolLM2Q4_1) { check_real("smollm2-135m-instruct-q4_1.gguf"); }
TEST(StoredWeights, RealGemma3Q4_K_M) { check_real("gemma-3-270m-q4_k_m.gguf"); }

// ---- what the loader keeps

TEST(StoredWeights, MatricesStayInTheMappingNormsAreF32) {
  const auto m = Model::load(kFixtures + "qwen2/model.gguf");  // f32 file, qwen2: no row permutation
  const ModelWeights& w = m->weights();
  const model::TensorInfo& t = m->file().get("blk.0.ffn_up.weight");
  EXPECT_TRUE(w.layers[0].w_up.mapped());
  EXPECT_EQ(w.layers[0].w_up.bytes, t.data);  // no copy
  EXPECT_EQ(w.layers[0].w_up.name, "blk.0.ffn_up.weight");
  EXPECT_TRUE(w.embedding.mapped());
  EXPECT_FALSE(w.layers[0].attn_norm.mapped());
  EXPECT_EQ(w.layers[0].attn_norm.type, TensorType::F32);
  EXPECT_FALSE(w.layers[0].bq.empty());
  EXPECT_EQ(w.owned_bytes() + m->file().get("token_embd.weight").bytes +
                [&] {
                  size_t b = 0;
                  for (int l = 0; l < m->config().num_layers; ++l)
                    for (const char* n : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})
                      b += m->file().get("blk." + std::to_string(l) + "." + n + ".weight").bytes;
                  return b;
                }() + (m->config().tied_embeddings ? 0 : m->file().get("output.weight").bytes),
            w.bytes());
}

TEST(StoredWeights, LlamaGgufQkRowsAreCopiedInRotateHalfOrderKeepingTheType) {
  const auto dir = temp_dir();
  const std::string path = requantize(kFixtures + "llama3/model.gguf", TensorType::Q8_0, (dir / "l.gguf").string());
  const auto stored = Model::load(path), f32 = Model::load(path, nullptr, expanded());
  const Weight& wq = stored->weights().layers[0].wq;
  EXPECT_EQ(wq.type, TensorType::Q8_0);
  EXPECT_FALSE(wq.mapped());  // re-ordered: a copy of the stored bytes
  EXPECT_EQ(wq.stored_bytes(), stored->file().get("blk.0.attn_q.weight").bytes);
  EXPECT_EQ(wq.to_f32(), f32->weights().layers[0].wq.to_f32());  // the same rows, dequantized
  EXPECT_TRUE(stored->weights().layers[0].wv.mapped());
  std::filesystem::remove_all(dir);
}

TEST(StoredWeights, RowsDequantizeOnDemand) {
  const auto dir = temp_dir();
  const std::string path = requantize(kFixtures + "smollm2/model.gguf", TensorType::Q4_1, (dir / "s.gguf").string());
  const auto m = Model::load(path);
  const Weight& e = m->weights().embedding;
  ASSERT_EQ(e.type, TensorType::Q4_1);
  const model::TensorInfo& t = m->file().get("token_embd.weight");
  std::vector<float> want(static_cast<size_t>(3 * e.cols)), got(want.size());
  model::dequantize_rows(t, 5, 3, want.data());
  e.rows_f32(5, 3, got.data());
  EXPECT_EQ(got, want);
  EXPECT_EQ(e.to_f32().size(), static_cast<size_t>(e.rows * e.cols));
  try {
    (void)e.ptr();
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "weight token_embd.weight is kept as Q4_1: read it with to_f32()");
  }
  try {
    e.rows_f32(e.rows - 1, 2, got.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_EQ(std::string(err.what()), "weight token_embd.weight: rows [" + std::to_string(e.rows - 1) + ", " +
                                           std::to_string(e.rows + 1) + ") outside [0, " + std::to_string(e.rows) +
                                           ")");
  }
  std::filesystem::remove_all(dir);
}

TEST(StoredWeights, SummaryNamesEachGroupsTypeAndBytes) {
  const auto dir = temp_dir();
  const std::string path = requantize(kFixtures + "qwen2/model.gguf", TensorType::Q8_0, (dir / "q.gguf").string());
  const auto m = Model::load(path);
  const std::vector<ModelWeights::Group> g = m->weights().groups();
  ASSERT_EQ(g.size(), 5u);  // qwen2's fixture has its own LM head
  EXPECT_EQ(g[0].group, "embedding");
  EXPECT_EQ(g[0].type, TensorType::Q8_0);
  EXPECT_EQ(g[0].bytes, m->file().get("token_embd.weight").bytes);
  EXPECT_EQ(g[1].group, "output");
  EXPECT_EQ(g[1].bytes, m->file().get("output.weight").bytes);
  EXPECT_EQ(g[2].group, "norms");  // the final norm comes before the layers
  EXPECT_EQ(g[2].type, TensorType::F32);
  EXPECT_EQ(g[3].group, "attention");
  EXPECT_EQ(g[3].tensors, 4 * m->config().num_layers);
  EXPECT_EQ(g[4].group, "mlp");
  EXPECT_EQ(g[4].type, TensorType::Q8_0);
  const std::string s = m->weights().summary();
  EXPECT_EQ(s.substr(0, 15), "embedding Q8_0 ");
  EXPECT_NE(s.find("attention Q8_0 (8 tensors"), std::string::npos) << s;
  std::filesystem::remove_all(dir);
}

// ---- errors

TEST(StoredWeights, AnUnreadTypeNamesTheTensorTheTypeAndTheFile) {
  // The qwen2 fixture with blk.0.attn_q.weight's type number set to IQ2_XS (17) in the tensor info.
  const auto dir = temp_dir();
  std::ifstream in(kFixtures + "qwen2/model.gguf", std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string name = "blk.0.attn_q.weight";
  auto it = std::search(b.begin(), b.end(), name.begin(), name.end());
  ASSERT_NE(it, b.end());
  size_t at = static_cast<size_t>(it - b.begin()) + name.size();
  uint32_t dims = 0;
  std::memcpy(&dims, b.data() + at, 4);
  at += 4 + 8 * dims;
  const uint32_t iq2_xs = 17;
  std::memcpy(b.data() + at, &iq2_xs, 4);
  const std::string path = (dir / "bad.gguf").string();
  std::ofstream(path, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
  try {
    Model::load(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), path + ": tensor blk.0.attn_q.weight has type IQ2_XS (17), which tessera does "
                                            "not read yet");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera::runtime
