// Structured output's token mask (runtime/grammar.h, XGrammar's C++ core) over the real tokenizers of SmolLM2
// (byte-level BPE) and Gemma-3 (byte-fallback SentencePiece). The logits are random (seeded) so that every step
// the grammar, not a model, decides what may come: every sampled continuation must parse as JSON and validate
// against the schema; a token the grammar forbids is masked and refused; the end-of-generation tokens are allowed
// exactly where the grammar can end. A missing model fails the test unless TESSERA_ALLOW_MISSING_MODELS=1.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "model/model_file.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/grammar.h"
#include "runtime/sampling.h"

namespace tessera::runtime {
namespace {

using nlohmann::json;

std::unique_ptr<model::Tokenizer> load_tokenizer(const std::string& file) {
  const char* env = std::getenv("TESSERA_MODELS");
  const char* home = std::getenv("HOME");
  const std::string dir = env != nullptr && *env != '\0' ? std::string(env)
                                                         : std::string(home != nullptr ? home : ".") + "/.cache/tessera/models";
  const std::string path = dir + "/" + file;
  if (!std::filesystem::exists(path)) return nullptr;
  return model::Tokenizer::from_gguf(model::ModelFile::open(path)->metadata());
}

bool allow_missing() {
  const char* env = std::getenv("TESSERA_ALLOW_MISSING_MODELS");
  return env != nullptr && std::string(env) == "1";
}

#define REQUIRE_TOKENIZER(tok, file)                                                         \
  if (!grammar_available()) GTEST_SKIP() << "built without XGrammar (TESSERA_XGRAMMAR=OFF)"; \
  auto tok = load_tokenizer(file);                                                           \
  if (!tok) {                                                                                \
    if (allow_missing()) GTEST_SKIP() << file << " is missing (TESSERA_ALLOW_MISSING_MODELS=1)"; \
    FAIL() << file << " is missing: run scripts/fetch_models.sh";                            \
  }

const char* kPersonSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
  },
  "required": ["name", "age", "color", "tags"]
})";

// Validates what the schema above asks (the keys, their types and bounds).
void expect_person(const json& j, const std::string& text) {
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j.size(), 4u) << text;  // strict: no properties beyond the schema's
  ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
  // maxLength counts characters: the UTF-8 bytes that do not continue a character
  int64_t chars = 0;
  for (unsigned char c : j["name"].get<std::string>()) chars += (c & 0xC0) != 0x80;
  EXPECT_LE(chars, 12) << text;
  ASSERT_TRUE(j.contains("age") && j["age"].is_number_integer()) << text;
  EXPECT_GE(j["age"].get<int64_t>(), 0) << text;
  EXPECT_LE(j["age"].get<int64_t>(), 150) << text;
  ASSERT_TRUE(j.contains("color") && j["color"].is_string()) << text;
  const std::string color = j["color"];
  EXPECT_TRUE(color == "red" || color == "green" || color == "blue") << text;
  ASSERT_TRUE(j.contains("tags") && j["tags"].is_array()) << text;
  EXPECT_LE(j["tags"].size(), 3u) << text;
  for (const json& t : j["tags"]) EXPECT_TRUE(t.is_boolean()) << text;
}

struct Sampled {
  std::vector<int32_t> ids;  // without the stop token
  bool stopped = false;
};

// Samples under `grammar` from random logits (normal, scale `spread`) until a stop token or `max_steps`; at every
// step checks that the stop tokens are allowed exactly when the matcher can end, and that what the Sampler drew is
// allowed.
Sampled sample_random(const model::Tokenizer& tok, const std::shared_ptr<const Grammar>& grammar, uint64_t seed,
                      int32_t vocab, int max_steps, float spread = 3.0f) {
  SamplingOptions o{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = seed};
  o.grammar = grammar;
  Sampler sampler(o);
  GrammarMatcher shadow(grammar);  // follows the same tokens, to look at the mask
  std::mt19937_64 rng(seed * 7919 + 1);
  std::normal_distribution<float> normal(0.0f, spread);
  const std::vector<int32_t>& stops = tok.special().end_of_generation;
  Sampled out;
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (int step = 0; step < max_steps; ++step) {
    for (float& x : logits) x = normal(rng);
    for (int32_t s : stops) EXPECT_EQ(shadow.allows(s), shadow.can_end()) << "step " << step << " stop " << s;
    const int32_t t = sampler.sample(logits);
    EXPECT_TRUE(shadow.allows(t)) << "step " << step << " token " << t;
    shadow.accept(t);
    if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
      out.stopped = true;
      EXPECT_TRUE(shadow.ended());
      break;
    }
    out.ids.push_back(t);
  }
  return out;
}

TEST(Grammar, JsonSchemaContinuationsParseAndValidateSmolLM2) {
  REQUIRE_TOKENIZER(tok, "smollm2-135m-instruct-q4_1.gguf");
  GrammarCompiler compiler(*tok);
  const auto grammar = compiler.json_schema(kPersonSchema);
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const Sampled s = sample_random(*tok, grammar, seed, tok->vocab_size(), 400);
    ASSERT_TRUE(s.stopped) << "seed " << seed << ": no stop token within 400 steps: " << tok->decode(s.ids);
    const std::string text = tok->decode(s.ids);
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << "seed " << seed << ": not JSON: " << text;
    expect_person(j, text);
  }
}

TEST(Grammar, JsonSchemaContinuationsParseAndValidateGemma3) {
  REQUIRE_TOKENIZER(tok, "gemma-3-270m-q4_k_m.gguf");
  GrammarCompiler compiler(*tok);
  const auto grammar = compiler.json_schema(kPersonSchema);
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const Sampled s = sample_random(*tok, grammar, seed, tok->vocab_size(), 400);
    ASSERT_TRUE(s.stopped) << "seed " << seed << ": " << tok->decode(s.ids);
    const std::string text = tok->decode(s.ids);
    const json j = json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "seed " << seed << ": not JSON: " << text;
    expect_person(j, text);
  }
}

TEST(Grammar, ForbiddenTokenIsMaskedAndRefused) {
  REQUIRE_TOKENIZER(tok, "smollm2-135m-instruct-q4_1.gguf");
  GrammarCompiler compiler(*tok);
  GrammarMatcher m(compiler.json_object());
  const std::vector<int32_t> hello = tok->encode("hello", {.add_special = false});
  const std::vector<int32_t> brace = tok->encode("{", {.add_special = false});
  ASSERT_EQ(hello.size(), 1u);
  ASSERT_EQ(brace.size(), 1u);
  EXPECT_FALSE(m.allows(hello[0]));
  EXPECT_TRUE(m.allows(brace[0]));
  for (int32_t s : tok->special().end_of_generation) EXPECT_FALSE(m.allows(s));
  // The logits: -inf where forbidden, untouched where allowed; ids past the vocabulary (a padded head) forbidden.
  std::vector<float> logits(static_cast<size_t>(tok->vocab_size()) + 5, 1.5f);
  m.mask(logits);
  EXPECT_TRUE(std::isinf(logits[static_cast<size_t>(hello[0])]) && logits[static_cast<size_t>(hello[0])] < 0);
  EXPECT_EQ(logits[static_cast<size_t>(brace[0])], 1.5f);
  for (size_t t = static_cast<size_t>(tok->vocab_size()); t < logits.size(); ++t) EXPECT_TRUE(std::isinf(logits[t]));
  int64_t allowed = 0;
  for (float x : logits) allowed += !std::isinf(x);
  int64_t bits = 0;
  for (int32_t t = 0; t < tok->vocab_size(); ++t) bits += m.allows(t);
  EXPECT_EQ(allowed, bits);
  EXPECT_GT(allowed, 0);
  EXPECT_LT(allowed, tok->vocab_size() / 10);  // an object's start: '{' and its spellings with more after it
  try {
    m.accept(hello[0]);
    FAIL() << "accepted a token the grammar forbids";
  } catch (const GrammarError& e) {
    EXPECT_EQ(std::string(e.what()), "the grammar does not allow token " + std::to_string(hello[0]) + " here");
  }
  m.accept(brace[0]);  // the refusal left the matcher where it was
  EXPECT_FALSE(m.can_end());
}

TEST(Grammar, StopTokensOnlyWhereTheGrammarCanEnd) {
  REQUIRE_TOKENIZER(tok, "smollm2-135m-instruct-q4_1.gguf");
  GrammarCompiler compiler(*tok);
  GrammarMatcher m(compiler.json_object());
  // {"a": 1} token by token: the stop tokens appear only after the closing brace.
  const std::vector<int32_t> ids = tok->encode(R"({"a": 1})", {.add_special = false});
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int32_t s : tok->special().end_of_generation) EXPECT_FALSE(m.allows(s)) << "before token " << i;
    m.accept(ids[i]);
  }
  EXPECT_TRUE(m.can_end());
  for (int32_t s : tok->special().end_of_generation) EXPECT_TRUE(m.allows(s));
  // compact JSON: after the object only a stop token may come
  int64_t allowed = 0;
  for (int32_t t = 0; t < tok->vocab_size(); ++t) allowed += m.allows(t);
  EXPECT_EQ(allowed, static_cast<int64_t>(tok->special().end_of_generation.size()));
  m.accept(tok->special().end_of_generation[0]);
  EXPECT_TRUE(m.ended());
  EXPECT_THROW(m.accept(ids[0]), GrammarError);
}

TEST(Grammar, EditsEqualTheMaskAndTheBatchedRuleDrawsTheSameToken) {
  REQUIRE_TOKENIZER(tok, "smollm2-135m-instruct-q4_1.gguf");
  GrammarCompiler compiler(*tok);
  const auto grammar = compiler.ebnf(R"(root ::= "yes" | "no" | "maybe")");
  const int32_t vocab = tok->vocab_size();
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SamplingOptions o{.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .seed = seed};
    o.grammar = grammar;
    o.presence_penalty = 0.5f;  // the penalties' edits merge with the mask's
    Sampler direct(o), batched(o);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<int32_t> ids;
    for (int step = 0; step < 16; ++step) {
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (float& x : logits) x = normal(rng);
      // The batched engine's way: edits() (penalties + mask as -inf biases), then sample_token, then accept.
      std::vector<float> edited = logits;
      for (const LogitEdit& e : batched.edits(vocab)) edited[static_cast<size_t>(e.token)] = edit_logit(edited[static_cast<size_t>(e.token)], e);
      const int32_t b = sample_token(edited, batched.options(), batched.next_uniform());
      batched.accept(b);
      const int32_t d = direct.sample(logits);
      ASSERT_EQ(b, d) << "seed " << seed << " step " << step;
      if (tok->is_end_of_generation(d)) break;
      ids.push_back(d);
    }
    const std::string text = tok->decode(ids);
    EXPECT_TRUE(text == "yes" || text == "no" || text == "maybe") << text;
  }
}

TEST(Grammar, BadSchemaAndGrammarAreClearErrors) {
  REQUIRE_TOKENIZER(tok, "smollm2-135m-instruct-q4_1.gguf");
  GrammarCompiler compiler(*tok);
  EXPECT_THROW(compiler.json_schema("{\"type\": \"object\""), GrammarError);  // not JSON
  try {
    compiler.json_schema(R"({"type": "objekt"})");
    FAIL() << "compiled a schema with an unknown type";
  } catch (const GrammarError& e) {
    EXPECT_EQ(std::string(e.what()), "the JSON schema: Unsupported type \"objekt\"");
  }
  EXPECT_THROW(compiler.ebnf("root ::= undefined_rule"), GrammarError);
  // The same schema twice: one compiled grammar (the cache), equal masks.
  const auto a = compiler.json_schema(kPersonSchema);
  const auto b = compiler.json_schema(kPersonSchema);
  GrammarMatcher ma(a), mb(b);
  const auto wa = ma.allowed();
  const auto wb = mb.allowed();
  EXPECT_TRUE(std::equal(wa.begin(), wa.end(), wb.begin(), wb.end()));
}

}  // namespace
}  // namespace tessera::runtime
