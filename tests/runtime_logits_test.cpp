// Model forward passes against Hugging Face transformers, and the engine's invariants (chunking, decode,
// policies).
//
// Fixtures: tests/data/hf_tiny/<name>/ made by scripts/make_hf_fixtures.py — tiny random-weight models of
// each architecture, their GGUF conversions (written as llama.cpp's converter writes them) and transformers'
// logits for every position of a fixed token sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/dense_attention.h"
#include "attention/cpu/reference.h"
#include "attention/pattern/policy.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "runtime/engine.h"
#include "model/model.h"
#include "model/weights.h"

namespace tessera::runtime {
namespace {

const std::string kFixtures = std::string(TESSERA_SOURCE_DIR) + "/tests/data/hf_tiny/";

struct Expected {
  std::vector<int32_t> tokens;
  int32_t vocab = 0;
  std::vector<float> logits;  // [tokens, vocab]
};

std::vector<float> read_f32(const std::string& path, size_t count) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::vector<float> v(count);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(float)));
  EXPECT_EQ(static_cast<size_t>(f.gcount()), count * sizeof(float)) << path;
  return v;
}

Expected expected(const std::string& name, const std::string& logits_key = "logits") {
  std::ifstream f(kFixtures + name + "/expected.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  Expected e;
  e.tokens = j["tokens"].get<std::vector<int32_t>>();
  e.vocab = j["vocab_size"].get<int32_t>();
  e.logits = read_f32(kFixtures + name + "/" + j[logits_key].get<std::string>(), e.tokens.size() * e.vocab);
  return e;
}

// Models are loaded once per path for the whole test program.
const Model& model(const char* rel) {  // (const char*: a std::string temporary trips GCC 13's -Wdangling-reference)
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[rel];
  if (!m) m = Model::load(kFixtures + rel);
  return *m;
}

const Model& model(const std::string& rel) { return model(rel.c_str()); }

// The model with every weight expanded to f32 (WeightOptions::expand_f32): what transformers evaluates for a
// quantized GGUF (its dequantized weights in f32). Loaded as stored, a block type's products round the activations
// to int8 (model/qmatmul.h); that forward is checked against this one in model_stored_weights_test.
const Model& model_f32(const std::string& rel) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[rel];
  if (!m) {
    WeightOptions o;
    o.expand_f32 = true;
    m = Model::load(kFixtures + rel, nullptr, o);
  }
  return *m;
}

float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<float> row(const std::vector<float>& all, int32_t vocab, size_t r) {
  return {all.begin() + static_cast<std::ptrdiff_t>(r * vocab),
          all.begin() + static_cast<std::ptrdiff_t>((r + 1) * vocab)};
}

constexpr float kTol = 1e-4f;

// (Designated initializers that omit class-typed members trip -Wmissing-field-initializers.)
EngineOptions opts(int32_t chunk = 2048, attn::AttentionPolicy policy = {}, int32_t max_context = 0) {
  EngineOptions o;
  o.chunk_size = chunk;
  o.policy = std::move(policy);
  o.max_context = max_context;
  return o;
}

GenerateOptions gen(int32_t max_new, std::vector<int32_t> stop = {}, SamplingOptions sampling = {}) {
  GenerateOptions g;
  g.max_new_tokens = max_new;
  g.stop_tokens = std::move(stop);
  g.sampling = sampling;
  return g;
}

// ---- transformers' logits, every fixture, both formats
// ----------------------------------------------------------

struct Case {
  std::string fixture;
  std::string path;  // relative to kFixtures
  std::string logits_key;
};

class ReferenceLogits : public testing::TestWithParam<Case> {};

TEST_P(ReferenceLogits, MatchTransformers) {
  const Case& c = GetParam();
  const Expected e = expected(c.fixture, c.logits_key);
  const bool quantized = c.path.find("q8_0") != std::string::npos;
  const Model& m = quantized ? model_f32(c.path) : model(c.path);
  ASSERT_EQ(m.config().vocab_size, e.vocab);
  Engine engine(m);
  const std::vector<float> got = engine.forward_all_logits(e.tokens);
  ASSERT_EQ(got.size(), e.logits.size());
  for (size_t t = 0; t < e.tokens.size(); ++t) {
    const float d = max_abs_diff(got.data() + t * e.vocab, e.logits.data() + t * e.vocab, e.vocab);
    ASSERT_LT(d, kTol) << c.path << " position " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ReferenceLogits,
    testing::Values(Case{"llama3", "llama3", "logits"}, Case{"llama3", "llama3/model.gguf", "logits"},
                    Case{"llama3", "llama3/model.safetensors", "logits"},
                    Case{"smollm2", "smollm2", "logits"}, Case{"smollm2", "smollm2/model.gguf", "logits"},
                    Case{"smollm2", "smollm2/model-q8_0.gguf", "logits_q8_0"},
                    Case{"mistral", "mistral", "logits"}, Case{"qwen2", "qwen2", "logits"},
                    Case{"qwen2", "qwen2/model.gguf", "logits"}, Case{"gemma3", "gemma3", "logits"},
                    Case{"gemma3", "gemma3/model.gguf", "logits"},
                    Case{"gemma3_scaled", "gemma3_scaled", "logits"}),
    [](const testing::TestParamInfo<Case>& param) {
      std::string s = param.param.path;
      for (char& ch : s)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

// ---- configuration read from each format
// ------------------------------------------------------------------------

TEST(RuntimeConfig, ArchitecturesAndLayerTypes) {
  const ModelConfig& g = model("gemma3").config();
  EXPECT_EQ(g.arch, Architecture::Gemma3);
  ASSERT_EQ(g.num_layers, 6);
  for (int l = 0; l < 6; ++l) EXPECT_EQ(g.layers[l].sliding_window, l == 5 ? 0 : 8) << l;
  EXPECT_EQ(g.layers[0].rope.theta, 10000.0);
  EXPECT_EQ(g.layers[5].rope.theta, 1000000.0);
  EXPECT_TRUE(g.tied_embeddings && g.qk_norm && g.post_norms);
  EXPECT_EQ(g.activation, Activation::GeluTanh);

  const ModelConfig& gg = model("gemma3/model.gguf").config();
  EXPECT_EQ(gg.name, "tiny-gemma3");
  for (int l = 0; l < 6; ++l) EXPECT_EQ(gg.layers[l].sliding_window, g.layers[l].sliding_window) << l;
  EXPECT_EQ(gg.attention_scale, g.attention_scale);

  const ModelConfig& s = model("gemma3_scaled").config();
  EXPECT_EQ(s.layers[0].sliding_window, 6);
  EXPECT_EQ(s.layers[1].sliding_window, 0);
  EXPECT_EQ(s.layers[1].rope.scaling, RopeScaling::Linear);
  EXPECT_EQ(s.layers[0].rope.scaling, RopeScaling::None);
  EXPECT_FLOAT_EQ(s.attention_scale, 1.0f / std::sqrt(24.0f));
  EXPECT_EQ(s.final_logit_softcap, 5.0f);

  const ModelConfig& l3 = model("llama3").config();
  EXPECT_EQ(l3.layers[0].rope.scaling, RopeScaling::Llama3);
  EXPECT_EQ(model("llama3/model.gguf").weights().rope_freq_factors.size(), 8u);
  EXPECT_TRUE(model("qwen2").config().qkv_bias);
  EXPECT_TRUE(model("smollm2/model.gguf").config().tied_embeddings);
  EXPECT_EQ(model("mistral").config().layers[1].sliding_window, 12);
}

TEST(RuntimeConfig, ErrorsNameTheFileAndKey) {
  nlohmann::json cfg = {{"architectures", {"Phi3ForCausalLM"}}, {"model_type", "phi3"}};
  try {
    config_from_hf(cfg, "x/config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "x/config.json: architecture Phi3ForCausalLM is not supported (tessera runs Llama, Mistral, SmolLM2, "
        "Qwen2 and Gemma-3 models)");
  }
  cfg = {{"architectures", {"LlamaForCausalLM"}},
         {"vocab_size", 10},
         {"num_hidden_layers", 2},
         {"num_attention_heads", 2},
         {"intermediate_size", 8}};
  try {
    config_from_hf(cfg, "x/config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "x/config.json: missing key hidden_size");
  }
  cfg["hidden_size"] = 8;
  cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THROW(config_from_hf(cfg, "x/config.json"), Error);

  nlohmann::json md = {{"general.architecture", "llama"}, {"llama.block_count", 2}};
  try {
    config_from_gguf(md, "m.gguf", 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "m.gguf: missing metadata key llama.embedding_length");
  }
  md = {{"general.architecture", "phi3"}};
  try {
    config_from_gguf(md, "m.gguf", 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "m.gguf: architecture phi3 is not supported (tessera runs the GGUF architectures llama, qwen2 and "
        "gemma3)");
  }
}

TEST(RuntimeConfig, GgufStringsThatAreNotUtf8AreQuotedNotThrown) {
  // GGUF strings are raw bytes; the message's json::dump() threw type_error 316 (found by fuzz_model_config).
  const nlohmann::json md = {{"general.architecture", "llama"},
                             {"llama.embedding_length", std::string("\xFF")}};
  try {
    config_from_gguf(md, "m.gguf", 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "m.gguf: metadata key llama.embedding_length must be a number, got \"\xEF\xBF\xBD\"");
  }
}

TEST(RuntimeConfig, LayerCountsAreBoundedBeforeTablesAreSized) {
  nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 10},        {"hidden_size", 8},
                        {"num_hidden_layers", 2147483647},       {"num_attention_heads", 2}, {"intermediate_size", 8}};
  auto error = [&](int64_t tensors) {
    try {
      config_from_hf(cfg, "x/config.json", tensors);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error(-1), "x/config.json: key num_hidden_layers is 2147483647, more than tessera's limit of 4096 layers");
  cfg["num_hidden_layers"] = 100;
  EXPECT_EQ(error(20), "x/config.json: key num_hidden_layers is 100, but the weights hold only 20 tensors (each layer "
                       "has several)");
  EXPECT_EQ(error(1000), "no error");
  cfg["num_hidden_layers"] = 2;
  cfg["layer_types"] = nlohmann::json::array({"full_attention", 3});
  EXPECT_EQ(error(-1), "x/config.json: key layer_types entry 1 must be a string, got 3");
  cfg.erase("layer_types");
  cfg["rope_scaling"] = {{"rope_type", 7}};
  EXPECT_EQ(error(-1), "x/config.json: key rope_scaling has rope_type 7, which must be a string");
  cfg["rope_scaling"] = {{"rope_type", "linear"}, {"factor", "2"}};
  EXPECT_EQ(error(-1), "x/config.json: key rope_scaling has factor \"2\", which must be a number");
  cfg.erase("rope_scaling");
  cfg["architectures"] = nlohmann::json::array({1});
  EXPECT_EQ(error(-1), "x/config.json: key architectures must list strings, got [1]");

  nlohmann::json md = {{"general.architecture", "llama"}, {"llama.block_count", 500}, {"llama.embedding_length", 8}};
  try {
    config_from_gguf(md, "m.gguf", 10, 12);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "m.gguf: metadata key llama.block_count is 500, but the weights hold only 12 tensors (each layer has "
              "several)");
  }
}

// Allocations that follow from the input are checked against the host memory budget first (core/memory_budget.h).
TEST(RuntimeEngine, MemoryBudgetIsCheckedBeforeAllocating) {
  const Model& m = model("llama3");  // 2 layers x 2 kv heads x 16 dims: 512 bytes of K and V per token
  struct Budget {
    explicit Budget(int64_t b) { set_host_memory_budget(b, "test budget"); }
    ~Budget() { set_host_memory_budget(0); }
  } budget(1 << 20);  // 1 MiB: 2048 tokens
  try {
    Engine e(m, opts(2048, {}, 100000));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "KV cache for 100,000 tokens (2 layers x 2 kv heads x 16 dims, K and V in f32) needs 51.2 MB, over the "
              "host memory budget of 1.05 MB (test budget); lower the context limit (--max-context) or shorten the "
              "prompt, or change the budget with --memory-budget or TESSERA_MEMORY_BUDGET");
  }
  // Within the budget the cache grows to what the prompt needs (never to the geometric step beyond the budget).
  Engine ok(m, opts(2048, {}, 2000));
  ok.prefill(std::vector<int32_t>(200, 5));
  EXPECT_LE(ok.kv_cache_bytes(), size_t{1} << 20);
  try {
    Model::load(kFixtures + "llama3");
    SUCCEED();
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  set_host_memory_budget(1000, "test budget");
  try {
    Model::load(kFixtures + "llama3");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "loading " + kFixtures + "llama3 (21 weight tensors; copies outside the file mapping) needs 1.28 kB, "
              "over the host memory budget of 1.00 kB (test budget); use a smaller model, or change the budget with "
              "--memory-budget or TESSERA_MEMORY_BUDGET");
  }
}

TEST(RuntimeWeights, UnpermuteUndoesLlamaCppPermutation) {
  // llama.cpp: w.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(...)
  const int heads = 3, d = 8, cols = 5;
  std::vector<float> hf(static_cast<size_t>(heads * d * cols));
  for (size_t i = 0; i < hf.size(); ++i) hf[i] = static_cast<float>(i);
  std::vector<float> gguf(hf.size());
  for (int h = 0; h < heads; ++h)
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < d / 2; ++i)
        for (int c = 0; c < cols; ++c)
          gguf[static_cast<size_t>(((h * d) + 2 * i + s) * cols + c)] =
              hf[static_cast<size_t>(((h * d) + s * (d / 2) + i) * cols + c)];
  unpermute_gguf_rope_rows(gguf.data(), heads, d, cols);
  EXPECT_EQ(gguf, hf);
}

// ---- engine invariants
// -----------------------------------------------------------------------------------------

const char* const kAll[] = {"llama3", "smollm2", "mistral", "qwen2", "gemma3", "gemma3_scaled"};

TEST(RuntimeEngine, ChunkedPrefillMatchesOneChunk) {
  for (const char* name : kAll) {
    const Expected e = expected(name);
    Engine whole(model(name));
    const std::vector<float> ref = whole.prefill(e.tokens);
    for (int chunk : {1, 7, 64}) {
      Engine engine(model(name), opts(chunk));
      int64_t calls = 0, last_done = 0;
      const std::vector<float> got = engine.prefill(e.tokens, [&](int64_t done, int64_t total) {
        ++calls;
        last_done = done;
        EXPECT_EQ(total, static_cast<int64_t>(e.tokens.size()));
      });
      EXPECT_EQ(calls, (static_cast<int64_t>(e.tokens.size()) + chunk - 1) / chunk);
      EXPECT_EQ(last_done, static_cast<int64_t>(e.tokens.size()));
      EXPECT_LT(max_abs_diff(got.data(), ref.data(), ref.size()), kTol) << name << " chunk " << chunk;
      EXPECT_EQ(engine.position(), static_cast<int32_t>(e.tokens.size()));
    }
  }
}

TEST(RuntimeEngine, PrefillThenDecodeMatchesAllLogits) {
  for (const char* name : kAll) {
    const Expected e = expected(name);
    Engine engine(model(name));
    const std::vector<float> all = engine.forward_all_logits(e.tokens);
    engine.reset();
    const size_t k = 25;
    std::vector<float> logits = engine.prefill(std::span(e.tokens).first(k));
    EXPECT_LT(max_abs_diff(logits.data(), row(all, e.vocab, k - 1).data(), e.vocab), kTol) << name;
    for (size_t t = k; t < e.tokens.size(); ++t) {
      logits = engine.decode(e.tokens[t]);
      ASSERT_LT(max_abs_diff(logits.data(), row(all, e.vocab, t).data(), e.vocab), kTol)
          << name << " step " << t;
      // and against transformers directly
      ASSERT_LT(max_abs_diff(logits.data(), row(e.logits, e.vocab, t).data(), e.vocab), kTol)
          << name << " " << t;
    }
    EXPECT_EQ(engine.position(), static_cast<int32_t>(e.tokens.size()));
    EXPECT_EQ(engine.stats().decode_tokens, static_cast<int64_t>(e.tokens.size() - k));
  }
}

attn::AttentionPolicy uniform(const ModelConfig& c, const attn::Pattern& p) {
  return attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, p);
}

TEST(RuntimeEngine, SparsePoliciesThatSeeEverythingEqualDense) {
  for (const char* name : {"llama3", "qwen2", "gemma3", "gemma3_scaled"}) {
    const Expected e = expected(name);
    const ModelConfig& c = model(name).config();
    Engine dense(model(name));
    const std::vector<float> ref = dense.forward_all_logits(e.tokens);
    const int32_t S = static_cast<int32_t>(e.tokens.size());
    const std::vector<attn::Pattern> patterns = {
        attn::VerticalSlashPattern{
            .vertical = S, .slash = S, .last_q = 64, .forced_columns = 0, .forced_diagonals = 0},
        attn::AShapePattern{.sink = 4, .local = 1 << 20},
        attn::BlockSparsePattern{.top_k = 1000, .block = 16},
        attn::ElasticWindowPattern{.alpha = 1e6, .beta = 1.0, .sink = 0},
        attn::TrianglePattern{.sink = 1, .local = 1 << 20, .last = 1},
    };
    for (const attn::Pattern& p : patterns) {
      for (int chunk : {2048, 16}) {
        Engine engine(model(name), opts(chunk, uniform(c, p)));
        const std::vector<float> got = engine.forward_all_logits(e.tokens);
        EXPECT_LT(max_abs_diff(got.data(), ref.data(), ref.size()), kTol)
            << name << " " << attn::describe(p) << " chunk " << chunk;
      }
    }
    // A policy mixing dense and sparse heads per layer.
    std::vector<attn::Pattern> table;
    for (int l = 0; l < c.num_layers; ++l)
      for (int h = 0; h < c.num_q_heads; ++h)
        table.push_back(h % 2 ? attn::Pattern(attn::DensePattern{})
                              : attn::Pattern(attn::AShapePattern{1, 1 << 20}));
    Engine mixed(model(name), opts(2048, attn::AttentionPolicy(c.num_layers, c.num_q_heads, c.num_kv_heads,
                                                               std::move(table))));
    const std::vector<float> got = mixed.forward_all_logits(e.tokens);
    EXPECT_LT(max_abs_diff(got.data(), ref.data(), ref.size()), kTol) << name << " mixed";
  }
}

TEST(RuntimeEngine, RealSparsePolicyGivesFiniteDifferentLogits) {
  const Model& m = model("llama3");
  const ModelConfig& c = m.config();
  std::mt19937 rng(7);
  std::vector<int32_t> tokens(200);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab_size));
  Engine dense(m, opts(64));
  const std::vector<float> ref = dense.prefill(tokens);
  for (const attn::Pattern& p :
       {attn::Pattern(attn::AShapePattern{.sink = 4, .local = 16}),
        attn::Pattern(attn::VerticalSlashPattern{
            .vertical = 8, .slash = 8, .last_q = 16, .forced_columns = 2, .forced_diagonals = 4}),
        attn::Pattern(attn::BlockSparsePattern{.top_k = 2, .block = 16})}) {
    Engine sparse(m, opts(64, uniform(c, p)));
    const std::vector<float> got = sparse.prefill(tokens);
    for (float v : got) ASSERT_TRUE(std::isfinite(v)) << attn::describe(p);
    EXPECT_GT(max_abs_diff(got.data(), ref.data(), ref.size()), 1e-3f) << attn::describe(p);
    EXPECT_GT(sparse.stats().attention_seconds, 0.0);
  }
}

TEST(RuntimeEngine, ContextLimit) {
  const Model& m = model("llama3");  // max_position_embeddings 256
  Engine engine(m);
  EXPECT_EQ(engine.max_context(), 256);
  const std::vector<int32_t> long_prompt(300, 5);
  try {
    engine.prefill(long_prompt);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "prompt of 300 tokens exceeds the context limit of 256 tokens (model llama3); pass a larger max "
        "context (--max-context) or shorten the prompt");
  }
  EXPECT_EQ(engine.position(), 0);

  Engine small(m, opts(2048, {}, 32));
  small.prefill(std::vector<int32_t>(30, 1));
  try {
    small.prefill(std::vector<int32_t>(3, 1));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "prompt of 3 tokens after 30 tokens already in the context exceeds the context limit of 32 tokens "
        "(model llama3); pass a larger max context (--max-context) or shorten the prompt");
  }
  small.decode(1);
  small.decode(1);
  EXPECT_THROW(small.decode(1), Error);

  // A larger limit than the model's is the user's choice; the cache still grows only as needed.
  Engine big(m, opts(2048, {}, 100000));
  big.prefill(std::vector<int32_t>(300, 5));
  const size_t row_bytes = static_cast<size_t>(m.config().num_kv_heads) * m.config().head_dim *
                           sizeof(float) * 2 * static_cast<size_t>(m.config().num_layers);
  EXPECT_LE(big.kv_cache_bytes(), 512 * row_bytes);
}

TEST(RuntimeEngine, BadInputs) {
  const Model& m = model("llama3");
  Engine engine(m);
  try {
    engine.prefill(std::vector<int32_t>{1, 2, 256});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "token id 256 at index 2 is outside the vocabulary of 256 tokens (model llama3)");
  }
  try {
    Engine bad(m, opts(2048, attn::AttentionPolicy::uniform(3, 4, 2, attn::DensePattern{})));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "attention policy has 3 layers x 4 query heads (2 kv heads); model llama3 has 2 layers x 4 "
              "query heads "
              "(2 kv heads)");
  }
  EXPECT_THROW(Engine(m, opts(0)), Error);
  EXPECT_THROW(Model::load(kFixtures + "does_not_exist"), Error);
}

TEST(RuntimeEngine, GenerateGreedyMatchesManualLoop) {
  const Model& m = model("qwen2");
  const Expected e = expected("qwen2");
  const std::span<const int32_t> prompt = std::span(e.tokens).first(10);
  Engine a(m);
  std::vector<int32_t> streamed;
  const std::vector<int32_t> out = a.generate(prompt, gen(12), [&](int32_t t) {
    streamed.push_back(t);
    return true;
  });
  ASSERT_EQ(out.size(), 12u);
  EXPECT_EQ(streamed, out);
  EXPECT_EQ(a.position(), 10 + 12);

  Engine b(m);
  std::vector<float> logits = b.prefill(prompt);
  std::vector<int32_t> manual;
  for (int i = 0; i < 12; ++i) {
    manual.push_back(argmax(logits));
    logits = b.decode(manual.back());
  }
  EXPECT_EQ(out, manual);
  // The cache holds every generated token: continuing gives the same logits as the manual loop.
  const std::vector<float> next = a.decode(manual.back() == 0 ? 1 : 0);
  const std::vector<float> next_manual = b.decode(manual.back() == 0 ? 1 : 0);
  EXPECT_LT(max_abs_diff(next.data(), next_manual.data(), next.size()), 1e-5f);

  // Stop tokens end the generation and are not returned; on_token returning false stops too.
  Engine c(m);
  const auto stop_at =
      static_cast<size_t>(std::find(manual.begin(), manual.end(), manual[3]) - manual.begin());
  EXPECT_EQ(c.generate(prompt, gen(12, {manual[3]})),
            std::vector<int32_t>(manual.begin(), manual.begin() + static_cast<std::ptrdiff_t>(stop_at)));
  EXPECT_EQ(c.position(), static_cast<int32_t>(10 + stop_at));
  Engine d(m);
  EXPECT_EQ(d.generate(prompt, gen(12), [](int32_t) { return false; }).size(), 1u);
  EXPECT_EQ(d.position(), 11);

  // Seeded sampling is reproducible.
  const GenerateOptions sampled = gen(16, {}, {.temperature = 1.0f, .top_k = 20, .top_p = 0.9f, .seed = 42});
  Engine e1(m), e2(m);
  EXPECT_EQ(e1.generate(prompt, sampled), e2.generate(prompt, sampled));
}

// A windowed layer with a policy runs the intersection of the pattern and the model's window. Gemma-3's local
// layers (window 8) under A-shape local 8 (per tile: every row sees at least its 8 most recent keys) keep
// exactly the window, so with the global layers dense the logits are the dense ones; A-shape with half the
// window hides part of it, so they change.
TEST(RuntimeSlidingWindow, PolicyAndWindowBothApply) {
  for (const char* name : {"gemma3", "mistral"}) {
    const Expected e = expected(name);
    const ModelConfig& c = model(name).config();
    const int32_t window = c.layers[0].sliding_window;
    ASSERT_GT(window, 0) << name;
    Engine dense(model(name));
    const std::vector<float> ref = dense.forward_all_logits(e.tokens);
    auto policy = [&](int32_t local) {
      std::vector<attn::Pattern> table;
      for (int l = 0; l < c.num_layers; ++l)
        for (int h = 0; h < c.num_q_heads; ++h)
          table.push_back(c.layers[static_cast<size_t>(l)].sliding_window > 0
                              ? attn::Pattern(attn::AShapePattern{.sink = 1, .local = local})
                              : attn::Pattern(attn::DensePattern{}));
      return attn::AttentionPolicy(c.num_layers, c.num_q_heads, c.num_kv_heads, std::move(table));
    };
    for (int chunk : {2048, 7, 1}) {
      Engine covering(model(name), opts(chunk, policy(window)));
      const std::vector<float> same = covering.forward_all_logits(e.tokens);
      EXPECT_LT(max_abs_diff(same.data(), ref.data(), ref.size()), kTol) << name << " chunk " << chunk;
      // One chunk of 40 tokens is one query tile starting at 0, which A-shape leaves whole: only smaller
      // chunks put tiles where local/2 cuts into the window.
      if (chunk == 2048) continue;
      Engine narrower(model(name), opts(chunk, policy(window / 2)));
      const std::vector<float> other = narrower.forward_all_logits(e.tokens);
      for (float v : other) ASSERT_TRUE(std::isfinite(v)) << name;
      EXPECT_GT(max_abs_diff(other.data(), ref.data(), ref.size()), 1e-3f) << name << " chunk " << chunk;
    }
  }
}

// The executor's row-exact window (what the runtime's windowed layers run) against the f64 reference masked
// by an explicit predicate.
TEST(RuntimeSlidingWindow, ExecutorWindowEqualsMaskedReference) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int32_t window : {1, 5, 64, 65, 150}) {
    for (auto [q_begin, q_len] : {std::pair{0, 1}, std::pair{0, 130}, std::pair{37, 50}, std::pair{200, 1}}) {
      const int32_t kv_len = q_begin + q_len, hq = 4, hk = 2, d = 16;
      std::vector<float> q(static_cast<size_t>(q_len * hq * d)), k(static_cast<size_t>(kv_len * hk * d)),
          v(k.size()), out(q.size()), ref(q.size());
      for (auto* x : {&q, &k, &v})
        for (float& f : *x) f = 2.0f * nd(rng);
      attn::AttentionArgs args;
      args.q = TensorView(q.data(), DType::F32, {q_len, hq, d});
      args.k = TensorView(k.data(), DType::F32, {kv_len, hk, d});
      args.v = TensorView(v.data(), DType::F32, {kv_len, hk, d});
      args.out = TensorView(out.data(), DType::F32, {q_len, hq, d});
      args.q_begin = q_begin;
      attn::AttentionArgs rargs = args;
      args.window = window;
      attn::dense_attention_cpu(args, ThreadPool::global());
      rargs.out = TensorView(ref.data(), DType::F32, {q_len, hq, d});
      attn::reference_attention_masked(rargs,
                                       [&](int, int row, int key) { return q_begin + row - key < window; });
      EXPECT_LT(max_abs_diff(out.data(), ref.data(), out.size()), 1e-5f)
          << "window " << window << " q_begin " << q_begin << " q_len " << q_len;
    }
  }
}

}  // namespace
}  // namespace tessera::runtime
