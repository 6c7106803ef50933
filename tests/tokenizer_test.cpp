// Tokenizers and chat templates: hand-made vocabularies (no files needed), small trained tokenizers with
// reference ids from Hugging Face tokenizers / sentencepiece, and the two real models (SmolLM2-135M-Instruct,
// Gemma-3-270M) against ids made by transformers (tests/data/tokenizer/make_fixtures.py).
//
// The real-model tests read $TESSERA_MODELS (default ~/.cache/tessera/models), filled by
// scripts/fetch_models.sh. A missing model fails the test, unless TESSERA_ALLOW_MISSING_MODELS=1, which skips
// it.
#include "model/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model_file.h"
#include "model/tokenizer/byte_level.h"
#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/pretokenizer.h"
#include "model/tokenizer/sentencepiece.h"
#include "model/tokenizer/unicode_nfc.h"
#include "model/tokenizer/utf8.h"

namespace {

using nlohmann::json;
using tessera::Error;
using namespace tessera::model;

const std::string kDataDir = std::string(TESSERA_SOURCE_DIR) + "/tests/data/tokenizer/";

json load_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return json::parse(in);
}

std::string models_dir() {
  if (const char* env = std::getenv("TESSERA_MODELS"); env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/tessera/models";
}

bool allow_missing_models() {
  const char* env = std::getenv("TESSERA_ALLOW_MISSING_MODELS");
  return env != nullptr && std::string(env) == "1";
}

// Fails (or, with TESSERA_ALLOW_MISSING_MODELS=1, skips) the current test when the model file is absent.
#define REQUIRE_MODEL(path_var, file)                                                                        \
  const std::string path_var = models_dir() + "/" + (file);                                                  \
  if (!std::filesystem::exists(path_var)) {                                                                  \
    if (allow_missing_models()) GTEST_SKIP() << path_var << " is missing (TESSERA_ALLOW_MISSING_MODELS=1)";  \
    FAIL() << path_var << " is missing: run scripts/fetch_models.sh (or set TESSERA_MODELS to where it put " \
           << "the models; TESSERA_ALLOW_MISSING_MODELS=1 skips these tests)";                               \
  }

std::string ids_string(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

// ---------------------------------------------------------------------------------------------------------
// UTF-8 and the byte-level alphabet

TEST(Utf8, SequencesAndCompletePrefixes) {
  EXPECT_EQ(utf8::sequence_length('a'), 1);
  EXPECT_EQ(utf8::sequence_length(0xC3), 2);
  EXPECT_EQ(utf8::sequence_length(0xE4), 3);
  EXPECT_EQ(utf8::sequence_length(0xF0), 4);
  EXPECT_EQ(utf8::sequence_length(0x80), 0);
  EXPECT_EQ(utf8::sequence_length(0xC0), 0);
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600
  EXPECT_EQ(utf8::complete_prefix_length("ab" + emoji.substr(0, 1)), 2u);
  EXPECT_EQ(utf8::complete_prefix_length("ab" + emoji.substr(0, 3)), 2u);
  EXPECT_EQ(utf8::complete_prefix_length("ab" + emoji), 6u);
  EXPECT_EQ(utf8::complete_prefix_length("ab\x80"), 3u);      // a stray continuation byte never completes
  EXPECT_EQ(utf8::complete_prefix_length("ab\xE4\x41"), 4u);  // a broken sequence is not held back
  EXPECT_EQ(utf8::decode_at(emoji, 0), U'\U0001F600');
  EXPECT_EQ(utf8::sanitize("a\xFF"
                           "b\xC3"),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
  EXPECT_TRUE(utf8::is_valid("caf\xC3\xA9"));
  EXPECT_FALSE(utf8::is_valid("\xED\xA0\x80"));  // a surrogate
}

TEST(ByteLevel, AlphabetRoundTrips) {
  EXPECT_EQ(byte_level::spell(" "), "\xC4\xA0");   // "Ġ"
  EXPECT_EQ(byte_level::spell("\n"), "\xC4\x8A");  // "Ċ"
  EXPECT_EQ(byte_level::spell("a"), "a");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(byte_level::unspell(byte_level::spell(all)), all);
  EXPECT_TRUE(byte_level::is_spelled(byte_level::spell(all)));
  EXPECT_FALSE(byte_level::is_spelled("a b"));
}

TEST(Unicode, NfcComposesLikePython) {
  EXPECT_EQ(unicode::nfc("cafe\xCC\x81"), "caf\xC3\xA9");  // e + combining acute -> é
  EXPECT_EQ(unicode::nfc("A\xCC\x8A"), "\xC3\x85");        // A + ring -> Å
  EXPECT_EQ(unicode::nfc("\xE2\x84\xAB"), "\xC3\x85");     // U+212B ANGSTROM SIGN -> Å (singleton)
  EXPECT_EQ(unicode::nfc("\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"), "\xED\x95\x9C");  // Hangul L V T -> 한
  // q + dot below + dot above: reordered, nothing composes with q.
  EXPECT_EQ(unicode::nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");
  // s + dot above + dot below -> U+1E69 (ṩ) whatever the order of the marks.
  EXPECT_EQ(unicode::nfc("s\xCC\x87\xCC\xA3"), "\xE1\xB9\xA9");
  EXPECT_EQ(unicode::nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(unicode::nfc("bad\xFF"
                         "byte"),
            "bad\xFF"
            "byte");
}

// ---------------------------------------------------------------------------------------------------------
// Hand-made byte-level BPE

TokenizerData tiny_bpe_data() {
  TokenizerData d;
  d.kind = TokenizerKind::ByteLevelBPE;
  for (int b = 0; b < 256; ++b) d.tokens.push_back(byte_level::spell(std::string(1, static_cast<char>(b))));
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"l", "l"},
      {"h", "e"},
      {"he", "ll"},
      {"hell", "o"},
      {"\xC4\xA0", "w"},
      {"o", "r"},
      {"\xC4\xA0w", "or"},
      {"\xC4\xA0wor", "ld"},
      {"l", "d"},
      {"a", "a"},
      {byte_level::spell("\xC3"), byte_level::spell("\xA9")}};
  for (const auto& [a, b] : merges) {
    d.merges.emplace_back(a, b);
    d.tokens.push_back(a + b);
  }
  d.tokens.push_back("<|im_start|>");
  d.tokens.push_back("<think>");
  d.types.assign(d.tokens.size(), TokenType::Normal);
  d.types[d.tokens.size() - 2] = TokenType::Control;
  d.types[d.tokens.size() - 1] = TokenType::UserDefined;
  d.pre_tokenizer = named_pre_tokenizer("gpt2");
  d.pre_tokenizer_name = "gpt2";
  d.special.bos = static_cast<int32_t>(d.tokens.size()) - 2;
  complete_special_tokens(d);
  return d;
}

TEST(ByteLevelBpe, MergesByRankLeftmostFirst) {
  const Tokenizer tok(tiny_bpe_data());
  const auto id = [&](const std::string& s) { return *tok.find_token(s); };
  EXPECT_EQ(tok.encode("hello world"), (std::vector<int32_t>{id("hello"), id("\xC4\xA0world")}));
  // "ld" ranks after "\u0120wor"+"ld"... but "l"+"d" must exist first: merges apply in rank order.
  EXPECT_EQ(tok.encode("aaa"), (std::vector<int32_t>{id("aa"), id("a")}));  // leftmost pair first on a tie
  EXPECT_EQ(tok.encode("aaaa"), (std::vector<int32_t>{id("aa"), id("aa")}));
  EXPECT_EQ(tok.decode(tok.encode("hello world")), "hello world");
  EXPECT_EQ(tok.token_to_piece(id("\xC4\xA0world")), " world");
  EXPECT_EQ(tok.encode(""), std::vector<int32_t>{});
}

TEST(ByteLevelBpe, SpecialAndAddedTokens) {
  const Tokenizer tok(tiny_bpe_data());
  const int32_t im_start = *tok.find_token("<|im_start|>");
  const int32_t think = *tok.find_token("<think>");
  const auto with = tok.encode("x<|im_start|>y", {.add_special = false, .parse_special = true});
  EXPECT_EQ(with, (std::vector<int32_t>{'x', im_start, 'y'}));
  const auto without = tok.encode("x<|im_start|>y", {.add_special = false, .parse_special = false});
  EXPECT_EQ(std::count(without.begin(), without.end(), im_start), 0);
  EXPECT_EQ(tok.decode(without), "x<|im_start|>y");
  // User-defined tokens are matched whatever parse_special says.
  EXPECT_EQ(tok.encode("<think>", {.parse_special = false}), std::vector<int32_t>{think});
  EXPECT_EQ(tok.decode(with), "x<|im_start|>y");
  EXPECT_EQ(tok.decode(with, {.skip_special = true}), "xy");
  EXPECT_TRUE(tok.is_special(im_start));
  EXPECT_FALSE(tok.is_special(think));
}

TEST(ByteLevelBpe, InvalidUtf8InputRoundTrips) {
  const Tokenizer tok(tiny_bpe_data());
  const std::string text = "ok \xFF\xC3 caf\xC3\xA9 \xF0\x9F\x98";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(StreamingDecoder, EmitsOnlyCompleteCharacters) {
  const Tokenizer tok(tiny_bpe_data());
  // "é" is one merged token; "😀" is four byte tokens.
  const std::vector<int32_t> ids = tok.encode("h\xC3\xA9\xF0\x9F\x98\x80!");
  ASSERT_EQ(ids.size(), 7u);
  StreamingDecoder stream(tok);
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(stream.push(id));
  EXPECT_EQ(out, (std::vector<std::string>{"h", "\xC3\xA9", "", "", "", "\xF0\x9F\x98\x80", "!"}));
  EXPECT_EQ(stream.flush(), "");
  // A character cut off at the end comes out as U+FFFD on flush; a stray byte at once.
  EXPECT_EQ(stream.push(tok.encode("\xF0")[0]), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.push(tok.encode("\x80")[0]), "\xEF\xBF\xBD");
}

// ---------------------------------------------------------------------------------------------------------
// Hand-made SentencePiece BPE

TokenizerData tiny_spm_data() {
  TokenizerData d;
  d.kind = TokenizerKind::SentencePieceBPE;
  auto add = [&](std::string text, TokenType type, float score) {
    d.tokens.push_back(std::move(text));
    d.types.push_back(type);
    d.scores.push_back(score);
  };
  add("<unk>", TokenType::Unknown, 0);
  add("<s>", TokenType::Control, 0);
  add("</s>", TokenType::Control, 0);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    add(name, TokenType::Byte, 0);
  }
  const std::string sp = "\xE2\x96\x81";  // ▁
  add(sp, TokenType::Normal, -1);
  for (const char* c : {"a", "b", "c", "d"}) add(c, TokenType::Normal, -2);
  add("ab", TokenType::Normal, -5);
  add("bc", TokenType::Normal, -3);  // beats "ab": in "abc", b+c merges first
  add("abc", TokenType::Normal, -6);
  add(sp + "a", TokenType::Normal, -4);
  add(sp + "abc", TokenType::Normal, -7);
  add("cd", TokenType::Normal, -3);  // ties with "bc": the leftmost pair wins
  add("<sep>", TokenType::UserDefined, 0);
  d.special.bos = 1;
  d.special.eos = 2;
  d.special.unk = 0;
  d.special.add_bos = true;
  d.add_space_prefix = true;
  d.byte_fallback = true;
  complete_special_tokens(d);
  return d;
}

TEST(SentencePieceBpe, HighestScoreFirstWithByteFallback) {
  const Tokenizer tok(tiny_spm_data());
  const auto id = [&](const std::string& s) { return *tok.find_token(s); };
  const std::string sp = "\xE2\x96\x81";
  // " abc" -> "▁abc" via ▁ a (b c) -> ▁a+bc? no such piece; a+bc -> abc; ▁+abc -> ▁abc.
  EXPECT_EQ(tok.encode("abc", {.add_special = false}), std::vector<int32_t>{id(sp + "abc")});
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{1, id(sp + "abc")}));  // add_bos
  // "bcd": b+c and c+d tie at -3; the leftmost (bc) merges, leaving d.
  EXPECT_EQ(tok.encode("x bcd", {.add_special = false}),
            (std::vector<int32_t>{id(sp), id("<0x78>"), id(sp), id("bc"), id("d")}));
  // é is not a piece: its two bytes.
  EXPECT_EQ(tok.encode("\xC3\xA9", {.add_special = false}),
            (std::vector<int32_t>{id(sp), id("<0xC3>"), id("<0xA9>")}));
  EXPECT_EQ(tok.decode(tok.encode("a b\xC3\xA9 <sep>c", {.add_special = false})), "a b\xC3\xA9 <sep>c");
  // A user-defined token is part of the text (SentencePiece): the prefix space goes before it, not after it.
  EXPECT_EQ(tok.encode("<sep>a", {.add_special = false}),
            (std::vector<int32_t>{id(sp), id("<sep>"), id("a")}));
  // After a control token the text gets its own prefix space (llama.cpp).
  EXPECT_EQ(tok.encode("<s>a", {.add_special = false, .parse_special = true}),
            (std::vector<int32_t>{1, id(sp + "a")}));
  EXPECT_EQ(tok.token_to_piece(id("<0x41>")), "A");
  EXPECT_EQ(tok.token_to_piece(id(sp + "a")), " a");
  EXPECT_EQ(tok.token_to_piece(1, false), "");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, id(sp + "a")}, {.skip_special = true}), "a");
}

TEST(SentencePieceBpe, UnknownWithoutByteFallback) {
  TokenizerData d = tiny_spm_data();
  d.byte_fallback = false;
  const Tokenizer tok(std::move(d));
  const std::string sp = "\xE2\x96\x81";
  // Consecutive unknown characters fuse into one <unk>.
  EXPECT_EQ(tok.encode("a\xC3\xA9\xC3\xA9", {.add_special = false}),
            (std::vector<int32_t>{*tok.find_token(sp + "a"), 0}));
}

// ---------------------------------------------------------------------------------------------------------
// Pre-tokenizers against Hugging Face tokenizers' Split

TEST(PreTokenizer, NamedRegexesMatchHuggingFace) {
  const json fixture = load_json(kDataDir + "pretokenizer_pieces.json");
  for (const auto& [name, cases] : fixture.items()) {
    const PreTokenizer pre(named_pre_tokenizer(name));
    for (const auto& c : cases) {
      const std::string text = c["text"];
      EXPECT_EQ(pre.split(text), c["pieces"].get<std::vector<std::string>>()) << name << ": " << text;
    }
  }
}

TEST(PreTokenizer, WidensWhitespaceClassesLikeOniguruma) {
  EXPECT_EQ(widen_whitespace_classes(R"(\s+(?!\S))"), R"([\s\x{85}]+(?![^\s\x{85}]))");
  EXPECT_EQ(widen_whitespace_classes(R"([^\s\p{L}])"), R"([^\s\x{85}\p{L}])");
  EXPECT_EQ(widen_whitespace_classes(R"(\Q\s\E\d)"), R"(\Q\s\E\d)");
  EXPECT_THROW(named_pre_tokenizer("no-such-pre"), Error);
  EXPECT_THROW(PreTokenizer({{"(unclosed"}}), Error);
}

// ---------------------------------------------------------------------------------------------------------
// Small trained tokenizers: tokenizer.json (HF) and SentencePiece (GGUF-style metadata)

TEST(HfTokenizerJson, TinyTrainedTokenizersMatchReference) {
  const json fixture = load_json(kDataDir + "tiny_hf_ids.json");
  for (const auto& [name, cases] : fixture.items()) {
    const auto tok = Tokenizer::from_hf_file(kDataDir + name + "_tokenizer.json");
    EXPECT_EQ(tok->special().bos, *tok->find_token("<|begin|>")) << name;
    EXPECT_TRUE(tok->special().add_bos) << name;
    EXPECT_EQ(tok->special().eot, *tok->find_token("<|im_end|>")) << name;
    for (const auto& c : cases) {
      const std::string text = c["text"];
      const auto ids = tok->encode(text, {.add_special = false, .parse_special = true});
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << name << ": " << text;
      EXPECT_EQ(tok->encode(text, {.add_special = true, .parse_special = true}),
                c["ids_with_bos"].get<std::vector<int32_t>>())
          << name << ": " << text;
      // NFC changes decomposed text, so only the byte-level one is lossless everywhere.
      const std::string lossless = name == "tiny_qwen2" ? unicode::nfc(text) : text;
      EXPECT_EQ(tok->decode(ids), lossless) << name;
    }
  }
}

TEST(HfTokenizerJson, RejectsWhatItCannotRead) {
  json tj = load_json(kDataDir + "tiny_llama3_tokenizer.json");
  tj["normalizer"] = {{"type", "NFKC"}};
  EXPECT_THROW(Tokenizer::from_hf_json(tj), Error);
  tj["normalizer"] = nullptr;
  tj["model"]["type"] = "Unigram";
  EXPECT_THROW(Tokenizer::from_hf_json(tj), Error);
}

TEST(SentencePieceGguf, TinyTrainedModelMatchesSentencePiece) {
  const json fixture = load_json(kDataDir + "tiny_sentencepiece.json");
  const auto tok = Tokenizer::from_gguf(fixture["metadata"]);
  EXPECT_EQ(tok->kind(), TokenizerKind::SentencePieceBPE);
  EXPECT_TRUE(tok->add_space_prefix());
  for (const auto& c : fixture["cases"]) {
    const std::string text = c["text"];
    const auto ids = tok->encode(text, {.add_special = false, .parse_special = false});
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok->decode(ids), c["decoded"].get<std::string>()) << text;
    StreamingDecoder stream(*tok);
    std::string streamed;
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    EXPECT_EQ(streamed, c["decoded"].get<std::string>()) << text;
  }
  const auto with_bos = tok->encode("abc");
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos[0], tok->special().bos);
}

TEST(TokenizerGguf, RejectsUnsupportedModels) {
  json md = {{"tokenizer.ggml.model", "bert"}, {"tokenizer.ggml.tokens", {"a"}}};
  EXPECT_THROW(Tokenizer::from_gguf(md), Error);
  md = {{"tokenizer.ggml.model", "gpt2"},
        {"tokenizer.ggml.tokens", {"a"}},
        {"tokenizer.ggml.merges", json::array()},
        {"tokenizer.ggml.pre", "mystery"}};
  EXPECT_THROW(Tokenizer::from_gguf(md), Error);
  EXPECT_THROW(Tokenizer::from_gguf(json::object()), Error);
}

// ---------------------------------------------------------------------------------------------------------
// Hostile tokenizer files (tests/data/tokenizer/fuzz; tests/fuzz): each is a tessera::Error naming the file
// and the key, never a crash or another exception type.

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a tessera::Error: ") + e.what();
  }
  return "no error";
}

const std::string kFuzzDir = kDataDir + "fuzz/";

TEST(HfTokenizerJson, HostileFilesAreErrorsNamingTheKey) {
  // A negative id was used as an index unchecked: a write far outside the vocabulary (SIGSEGV, issue 22).
  const std::map<std::string, std::string> cases = {
      {"hf-vocab-id-negative.json",
       "model.vocab: token \"b\" has id -1, outside [0, 2) (the file lists 2 tokens)"},
      {"hf-vocab-id-past-end.json",
       "model.vocab: token \"b\" has id 70000, outside [0, 2) (the file lists 2 tokens)"},
      {"hf-vocab-id-float.json", "model.vocab: token \"b\" has id 1.5, which is not an integer token id"},
      {"hf-added-token-id-past-end.json",
       "added_tokens[0].id is 4294967295, outside [0, 2) (the file lists 2 tokens)"},
      {"hf-added-token-content-not-string.json", "added_tokens[0].content must be a string, got 5"},
      {"hf-merge-not-strings.json", "model.merges[0] is neither \"a b\" nor [\"a\", \"b\"]: [1,2]"},
      {"hf-pre-tokenizer-flag-not-bool.json",
       "pre_tokenizer.add_prefix_space must be true or false, got \"yes\""},
  };
  for (const auto& [file, message] : cases) {
    const std::string path = kFuzzDir + file;
    EXPECT_EQ(error_of([&] { Tokenizer::from_hf_file(path); }), path + ": " + message);
    EXPECT_EQ(error_of([&] { Tokenizer::from_hf_json(load_json(path)); }), "tokenizer.json: " + message);
  }
  EXPECT_EQ(error_of([] { Tokenizer::from_hf_json(json::array()); }),
            "tokenizer.json: must be a JSON object, got []");
}

TEST(TokenizerGguf, HostileMetadataIsAnErrorNamingTheKey) {
  const std::map<std::string, std::string> cases = {
      {"gguf-token-type-not-integer.json",
       "tokenizer: tokenizer.ggml.token_type holds a value that is not an integer"},
      {"gguf-score-not-number.json",
       "tokenizer: tokenizer.ggml.scores holds a value that is not a 32-bit float"},
      {"gguf-bos-id-past-end.json",
       "tokenizer: GGUF metadata tokenizer.ggml.bos_token_id is 300, outside the vocabulary of 4 tokens"},
      {"gguf-tokens-not-strings.json", "tokenizer: tokenizer.ggml.tokens holds a value that is not a string"},
  };
  for (const auto& [file, message] : cases) {
    EXPECT_EQ(error_of([&] { Tokenizer::from_gguf(load_json(kFuzzDir + file)); }), message) << file;
  }
  // ChatTemplate::from_gguf read the vocabulary with get<std::vector<std::string>>(): a json type_error.
  EXPECT_EQ(error_of([] { ChatTemplate::from_gguf(load_json(kFuzzDir + "gguf-tokens-not-strings.json")); }),
            "chat template: GGUF metadata tokenizer.ggml.tokens holds a value that is not a string");
}

TEST(TokenizerGguf, ByteTokensThatAreNotHexAreOrdinaryPieces) {
  // "<0x-1>" was read by sscanf's %2X as 0xFFFFFFFF and used as an index into the 256 byte tokens; "<0xZZ>"
  // made decode() throw std::invalid_argument (std::stoi).
  const auto tok = Tokenizer::from_gguf(load_json(kFuzzDir + "gguf-byte-token-not-hex.json"));
  EXPECT_EQ(tok->token_to_piece(2), "<0x-1>");
  EXPECT_EQ(tok->token_to_piece(3), "<0xZZ>");
  EXPECT_EQ(tok->decode(std::vector<int32_t>{1, 2, 3}), "a<0x-1><0xZZ>");
  // "▁" and 0xFF have no piece and no byte token: each is the unknown token.
  EXPECT_EQ(tok->encode("a\xFF", {.add_special = false}), (std::vector<int32_t>{0, 1, 0}));
}

// ---------------------------------------------------------------------------------------------------------
// Chat templates against jinja2 renderings of each family's own template

TEST(ChatTemplate, MatchesJinjaRenderings) {
  const json fixture = load_json(kDataDir + "chat_templates.json");
  const std::map<std::string, ChatFamily> families = {
      {"smollm2", ChatFamily::ChatML},  {"qwen2", ChatFamily::ChatML}, {"llama3", ChatFamily::Llama3},
      {"llama31", ChatFamily::Llama31}, {"gemma3", ChatFamily::Gemma}, {"mistral", ChatFamily::Mistral}};
  ASSERT_EQ(fixture.size(), families.size());
  for (const auto& [name, f] : fixture.items()) {
    ChatTemplate::Options options;
    options.bos_token = f["bos_token"];
    options.eos_token = f["eos_token"];
    const ChatTemplate chat = ChatTemplate::detect(f["template"].get<std::string>(), "", {}, options);
    EXPECT_EQ(chat.family(), families.at(name)) << name;
    for (const auto& c : f["cases"]) {
      std::vector<ChatMessage> messages;
      for (const auto& m : c["messages"]) messages.push_back({m["role"], m["content"]});
      const bool gen = c["add_generation_prompt"];
      if (c.contains("error")) {
        // The family's template rejects it. tessera accepts a leading system message where Mistral's template
        // does not (documented); everything else must be rejected too.
        const bool mistral_system = name == "mistral" && !messages.empty() && messages[0].role == "system";
        if (!mistral_system) {
          EXPECT_THROW(chat.apply(messages, gen), Error) << name << " " << c.dump();
        }
        continue;
      }
      EXPECT_EQ(chat.apply(messages, gen), c["expected"].get<std::string>()) << name << " " << c.dump();
    }
  }
}

TEST(ChatTemplate, ReadsDefaultSystemPrompts) {
  EXPECT_EQ(ChatTemplate::chatml_default_system_prompt(
                "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"),
            "You are a helpful assistant.");
  EXPECT_EQ(ChatTemplate::chatml_default_system_prompt(
                "{{'<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n'}}"),
            "");
  EXPECT_EQ(python_strip(" \t\xC2\xA0x y\xE3\x80\x80\n"), "x y");
  EXPECT_THROW(ChatTemplate::detect("", "unknown-arch", {}, {}), Error);
}

// ---------------------------------------------------------------------------------------------------------
// Real models

void check_real_model(const Tokenizer& tok, const json& fixture) {
  EXPECT_EQ(tok.vocab_size(), fixture["vocab_size"].get<int32_t>());
  EXPECT_EQ(tok.special().bos, fixture["bos"].get<int32_t>());
  EXPECT_EQ(tok.special().eos, fixture["eos"].get<int32_t>());
  EXPECT_EQ(tok.special().add_bos, fixture["add_bos"].get<bool>());
  int failures = 0;
  for (const auto& c : fixture["cases"]) {
    const std::string text = c["text"];
    const auto ids = tok.encode(text, {.add_special = false, .parse_special = true});
    const auto expected = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, expected) << "text: " << json(text).dump() << "\n got: " << ids_string(ids)
                             << "\nwant: " << ids_string(expected);
    const auto plain = tok.encode(text, {.add_special = false, .parse_special = false});
    EXPECT_EQ(plain, c["ids_no_parse_special"].get<std::vector<int32_t>>()) << "no parse_special: " << text;
    // Both tokenizers are lossless: decode(encode(x)) == x, with or without special tokens parsed.
    EXPECT_EQ(tok.decode(ids), text);
    EXPECT_EQ(tok.decode(plain), text);
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>());
    // add_special adds exactly BOS when the model asks for it.
    auto with_bos = expected;
    if (tok.special().add_bos) with_bos.insert(with_bos.begin(), tok.special().bos);
    EXPECT_EQ(tok.encode(text, {.add_special = true, .parse_special = true}), with_bos);
    StreamingDecoder stream(tok);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = stream.push(id);
      EXPECT_TRUE(utf8::is_valid(piece));
      streamed += piece;
    }
    EXPECT_EQ(streamed + stream.flush(), text);
    if (::testing::Test::HasFailure() && ++failures > 5) break;  // keep the log readable
  }
  for (const auto& c : fixture["chat"]) {
    const std::string prompt = c["prompt"];
    EXPECT_EQ(tok.encode(prompt, {.add_special = false, .parse_special = true}),
              c["ids"].get<std::vector<int32_t>>())
        << prompt;
  }
}

TEST(RealModel, SmolLM2MatchesTransformers) {
  REQUIRE_MODEL(path, "smollm2-135m-instruct-q4_1.gguf");
  const auto file = ModelFile::open(path);
  const auto tok = Tokenizer::from_gguf(file->metadata());
  EXPECT_EQ(tok->kind(), TokenizerKind::ByteLevelBPE);
  EXPECT_EQ(tok->pre_tokenizer_name(), "smollm");
  EXPECT_EQ(tok->special().eot, 2);           // <|im_end|>
  EXPECT_TRUE(tok->is_end_of_generation(0));  // <|endoftext|>
  EXPECT_TRUE(tok->is_end_of_generation(2));
  EXPECT_FALSE(tok->is_end_of_generation(1));
  check_real_model(*tok, load_json(kDataDir + "smollm2_ids.json"));

  const ChatTemplate chat = ChatTemplate::from_gguf(file->metadata());
  EXPECT_EQ(chat.family(), ChatFamily::ChatML);
  EXPECT_EQ(chat.options().default_system_prompt,
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_FALSE(chat.renders_bos());
  const json fixture = load_json(kDataDir + "chat_templates.json");
  EXPECT_EQ(fixture["smollm2"]["template"].get<std::string>(),
            file->metadata()["tokenizer.chat_template"].get<std::string>());
}

// encode() cuts the text where no piece spans the boundary (sentencepiece.h); the ids are those of one merge queue
// over the whole text: Gemma-3's vocabulary (its one piece across a space, ">▁</", and newline runs), on a long
// document with the conversation's shapes and on edge cases.
TEST(RealModel, Gemma3WordCutsEqualOneQueue) {
  REQUIRE_MODEL(path, "gemma-3-270m-q4_k_m.gguf");
  const auto file = ModelFile::open(path);
  const TokenizerData d = Tokenizer::gguf_data(file->metadata());
  const SentencePieceBpe spm(d.tokens, d.types, d.scores, d.byte_fallback, d.special.unk);
  std::string doc = "Read the records below, then answer questions about them.\n\n";
  for (int i = 1; i <= 120; ++i)
    doc += "Record " + std::to_string(i) + ". The town of Alder Creek was founded in the year " +
           std::to_string(1100 + 7 * i) + " on the banks of the Sable.  Its people trade in wool,\tsalt and " +
           "<b>copper</b> > </td> \u00e9t\u00e9 \u4e2d\u6587 \xF0\x9F\x99\x82\n\nQuestion: How long?\nAnswer: " +
           std::to_string(i * 13) + " meters\n";
  const std::vector<std::string> texts = {doc, "a>  </b", "x\n\n\ny", "  lead and trail  ", "\n", " ", "",
                                          "<table> </td>\n </tr>", "a\xFF\xFE b\x80 c", "\xE2\x96 \xE2"};
  for (const std::string& t : texts) {
    const std::string escaped = escape_spaces(t);
    std::vector<int32_t> cut, whole;
    spm.encode(escaped, cut);
    spm.encode_whole(escaped, whole);
    EXPECT_EQ(cut, whole) << t.substr(0, 60);
  }
}

TEST(RealModel, Gemma3MatchesTransformers) {
  REQUIRE_MODEL(path, "gemma-3-270m-q4_k_m.gguf");
  const auto file = ModelFile::open(path);
  const auto tok = Tokenizer::from_gguf(file->metadata());
  EXPECT_EQ(tok->kind(), TokenizerKind::SentencePieceBPE);
  EXPECT_FALSE(tok->add_space_prefix());
  EXPECT_EQ(tok->special().eot, *tok->find_token("<end_of_turn>"));
  EXPECT_EQ(tok->special().eot, 106);
  EXPECT_TRUE(tok->is_end_of_generation(1));    // <eos>
  EXPECT_TRUE(tok->is_end_of_generation(106));  // <end_of_turn>
  EXPECT_EQ(tok->token_to_piece(*tok->find_token("<0x0A>")), "\n");
  check_real_model(*tok, load_json(kDataDir + "gemma3_ids.json"));

  // The GGUF carries no chat template: the family comes from the architecture.
  const ChatTemplate chat = ChatTemplate::from_gguf(file->metadata());
  EXPECT_EQ(chat.family(), ChatFamily::Gemma);
  EXPECT_EQ(chat.options().bos_token, "<bos>");
  EXPECT_TRUE(chat.renders_bos());
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(chat.apply(messages),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
}

// ---------------------------------------------------------------------------------------------------------
// Resuming at checkpoints (encode_from): what the server's prompt cache does for each turn of a conversation

// A random piece of text with the shapes tokenizers split at: words, spaces (runs of them), digits, punctuation,
// apostrophes, tabs, newlines, CRLF, accented and CJK letters, an emoji, markup, and the model's special tokens'
// spellings (`specials`).
std::string random_text(std::mt19937& rng, size_t words, const std::vector<std::string>& specials) {
  static const std::vector<std::string> pool = {
      "the",  "records", "Alder",  "Creek's", "1127", "3.14",  "wool,", "salt", "(copper)", "don't", "\u00e9t\u00e9",
      "\u4e2d\u6587", "\xF0\x9F\x99\x82", "<b>", "</td>", ">", "--", "\"quoted\"", "x", "I'll", "a.b", "#", "\u00a0nb"};
  static const std::vector<std::string> gaps = {" ", " ", " ", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "",
                                                ". ", ", ", "\n  "};
  std::string out;
  for (size_t i = 0; i < words; ++i) {
    const uint32_t r = rng() % 100;
    if (r < 3 && !specials.empty()) out += specials[rng() % specials.size()];
    else out += pool[rng() % pool.size()];
    out += gaps[rng() % gaps.size()];
  }
  return out;
}

// Every usable checkpoint of a text (spacing 0: all of them), resumed on a second text that shares a prefix with it
// (a later turn: the text plus more; or a branch: cut anywhere, inside a special token or a run of spaces, then
// different text), gives encode()'s ids for the second text, and the checkpoints a whole encode() finds after it.
void check_resumes(const Tokenizer& tok, const std::vector<std::string>& specials, const EncodeOptions& options,
                   uint32_t seed, int cases, int words, bool expect_plain = true) {
  std::mt19937 rng(seed);
  size_t resumed = 0, plain = 0;
  for (int k = 0; k < cases; ++k) {
    const std::string first = random_text(rng, static_cast<size_t>(words), specials);
    std::string second;
    if (k % 3 == 0) {
      second = first.substr(0, rng() % (first.size() + 1)) + random_text(rng, 20, specials);
    } else {
      second = first + random_text(rng, 30, specials);
    }
    std::vector<EncodeCheckpoint> cps, whole_cps;
    const auto first_ids = tok.encode(first, options, &cps);
    EXPECT_EQ(first_ids, tok.encode(first, options)) << "checkpoints change encode()";
    const auto want = tok.encode(second, options, &whole_cps);
    size_t common = 0;
    while (common < first.size() && common < second.size() && first[common] == second[common]) ++common;
    for (size_t i = 0; i < cps.size(); ++i) {
      const EncodeCheckpoint& c = cps[i];
      ASSERT_LE(c.ids, first_ids.size());
      if (c.needs > common) continue;
      if (!c.prefix_pending) ++plain;
      ++resumed;
      std::vector<EncodeCheckpoint> got_cps(cps.begin(), cps.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      const auto got = tok.encode_from(second, options, first_ids, c, &got_cps);
      ASSERT_EQ(got, want) << "resumed at byte " << c.text_pos << " (" << c.ids << " ids) of "
                           << json(first).dump() << "\nsecond: " << json(second).dump();
      // The checkpoints up to the resumed one are the first text's, after it encode_from's: a whole encode() of
      // the second text finds the same ones (so a resumed prompt can be resumed again).
      ASSERT_EQ(got_cps.size(), whole_cps.size()) << "at byte " << c.text_pos;
      for (size_t j = 0; j < got_cps.size(); ++j) {
        EXPECT_EQ(got_cps[j].text_pos, whole_cps[j].text_pos) << j;
        EXPECT_EQ(got_cps[j].ids, whole_cps[j].ids) << j;
        EXPECT_EQ(got_cps[j].needs, whole_cps[j].needs) << j;
        EXPECT_EQ(got_cps[j].prefix_pending, whole_cps[j].prefix_pending) << j;
      }
    }
  }
  // The cases do resume, inside plain text too (not only at special tokens) where the tokenizer allows it.
  EXPECT_GT(resumed, static_cast<size_t>(cases) * (expect_plain ? 10 : 1));
  if (expect_plain) {
    EXPECT_GT(plain, static_cast<size_t>(cases) * 5);
  }
}

// The small trained tokenizers: SentencePiece with add_space_prefix (its prefix space goes only before the first
// part, and again after a control token), and the tokenizer.json ones (an NFC normalizer or a pre-tokenizer that is
// not a named one: control-token checkpoints only).
TEST(Resume, TinyTokenizersResumeAsEncode) {
  const json spm_fixture = load_json(kDataDir + "tiny_sentencepiece.json");
  const auto spm = Tokenizer::from_gguf(spm_fixture["metadata"]);
  ASSERT_TRUE(spm->add_space_prefix());
  check_resumes(*spm, {"<s>", "</s>"}, {.add_special = true, .parse_special = true}, 21, 20, 40);
  check_resumes(*spm, {"<s>", "</s>"}, {.add_special = false, .parse_special = false}, 22, 20, 40);
  const json hf_fixture = load_json(kDataDir + "tiny_hf_ids.json");
  for (const auto& [name, cases] : hf_fixture.items()) {
    SCOPED_TRACE(name);
    const auto tok = Tokenizer::from_hf_file(kDataDir + name + "_tokenizer.json");
    check_resumes(*tok, {"<|im_end|>", "<|begin|>", "<|im_start|>"}, {.add_special = true, .parse_special = true}, 23,
                  20, 40, /*expect_plain=*/false);
  }
}

TEST(RealModel, SmolLM2ResumedEncodeEqualsEncode) {
  REQUIRE_MODEL(path, "smollm2-135m-instruct-q4_1.gguf");
  const auto file = ModelFile::open(path);
  const auto tok = Tokenizer::from_gguf(file->metadata());
  const std::vector<std::string> specials = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n"};
  check_resumes(*tok, specials, {.add_special = true, .parse_special = true}, 1, 30, 60);
  check_resumes(*tok, specials, {.add_special = true, .parse_special = false}, 2, 30, 60);
}

TEST(RealModel, Gemma3ResumedEncodeEqualsEncode) {
  REQUIRE_MODEL(path, "gemma-3-270m-q4_k_m.gguf");
  const auto file = ModelFile::open(path);
  const auto tok = Tokenizer::from_gguf(file->metadata());
  const std::vector<std::string> specials = {"<start_of_turn>", "<end_of_turn>", "<bos>", "<start_of_turn>model\n",
                                             "<start_of_image>"};
  check_resumes(*tok, specials, {.add_special = true, .parse_special = true}, 3, 30, 60);
  check_resumes(*tok, specials, {.add_special = true, .parse_special = false}, 4, 30, 60);
}

// A conversation of one long document and turns after it, as the multi-turn benchmark sends it: each turn resumed
// from the previous turn's last usable checkpoint (spacing 256, the server's) equals encode(), for both families, as
// chat (the template's control tokens) and as one growing completion text.
TEST(RealModel, ConversationTurnsResumeFromTheLastTurn) {
  for (const char* name : {"smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"}) {
    REQUIRE_MODEL(path, name);
    const auto file = ModelFile::open(path);
    const auto tok = Tokenizer::from_gguf(file->metadata());
    const ChatTemplate chat = ChatTemplate::from_gguf(file->metadata());
    std::mt19937 rng(7);
    const std::string doc = random_text(rng, 3000, {});
    for (const bool as_chat : {true, false}) {
      const EncodeOptions options{.add_special = !as_chat || !chat.renders_bos(), .parse_special = as_chat};
      std::vector<ChatMessage> messages = {{"user", doc + "\n\nQuestion: how many records?"}};
      std::string text = doc + "\n\nQuestion: how many records?\nAnswer:";
      std::vector<int32_t> prev_ids;
      std::vector<EncodeCheckpoint> prev_cps;
      std::string prev;
      for (int turn = 0; turn < 4; ++turn) {
        const std::string prompt = as_chat ? chat.apply(messages, true) : text;
        std::vector<EncodeCheckpoint> cps;
        std::vector<int32_t> ids;
        if (turn == 0) {
          ids = tok->encode(prompt, options, &cps, 256);
        } else {
          ASSERT_TRUE(prompt.starts_with(prev)) << name << " turn " << turn;
          auto c = prev_cps.rbegin();
          while (c != prev_cps.rend() && c->needs > prev.size()) ++c;
          ASSERT_NE(c, prev_cps.rend()) << name << " turn " << turn;
          EXPECT_GT(c->text_pos + 300, prev.size()) << name << " turn " << turn << ": resumed far back";
          cps.assign(prev_cps.begin(), c.base());
          ids = tok->encode_from(prompt, options, prev_ids, *c, &cps, 256);
        }
        ASSERT_EQ(ids, tok->encode(prompt, options)) << name << " chat " << as_chat << " turn " << turn;
        const std::string answer = " " + std::to_string(rng() % 1000) + " records, " + random_text(rng, 8, {});
        messages.push_back({"assistant", answer});
        messages.push_back({"user", "And question " + std::to_string(turn + 2) + "?"});
        text += answer + "\n\nQuestion: and question " + std::to_string(turn + 2) + "?\nAnswer:";
        prev = prompt;
        prev_ids = std::move(ids);
        prev_cps = std::move(cps);
      }
    }
  }
}

}  // namespace
