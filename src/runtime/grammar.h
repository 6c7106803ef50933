// tessera/runtime/grammar.h — structured output: a grammar over the tokenizer's vocabulary, applied to the logits
// as a token mask at every step. The grammars are XGrammar's (its C++ core, built by cmake/xgrammar.cmake): JSON
// Schema, any JSON object, and XGrammar's EBNF (the GBNF-like notation llama.cpp's --grammar uses).
//
//   GrammarCompiler compiler(tokenizer);                        // once per vocabulary (bench/grammar_bench:
//                                                               // 25-60 ms for 49K tokens, 0.1-0.4 s for 262K)
//   options.sampling.grammar = compiler.json_schema(schema);    // compiled once per schema (cached), shared
//   Sampler sampler(options.sampling);                          // starts its own GrammarMatcher: each step masks
//                                                               // the logits (edits(): -inf) and accepts the token
//
// The vocabulary is given to XGrammar as each token's decoded bytes (Tokenizer::token_to_piece, control tokens
// empty: never allowed), so byte-level BPE (SmolLM2, Llama-3, Qwen) and byte-fallback SentencePiece (Gemma) are
// the same to it. The end-of-generation tokens (Tokenizer::special().end_of_generation) are the grammar's stop
// tokens: allowed only where the grammar can end, and then the only ones allowed once it must end. Ids at or
// above the tokenizer's vocabulary (a model's padded LM head) are never allowed.
//
// Errors (a schema XGrammar cannot compile, malformed JSON, a token the grammar forbids) are GrammarError with
// XGrammar's message. Built without XGrammar (TESSERA_XGRAMMAR=OFF), GrammarCompiler's constructor throws
// GrammarError saying so, and grammar_available() is false.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace tessera::model {
class Tokenizer;
}

namespace tessera::runtime {

class GrammarError : public Error {
 public:
  using Error::Error;
};

// Whether this build has XGrammar.
bool grammar_available();

// A grammar compiled for one vocabulary: immutable, shared by requests and threads.
class Grammar {
 public:
  struct Impl;
  explicit Grammar(std::shared_ptr<const Impl> impl);
  ~Grammar();
  int32_t vocab_size() const;  // the tokenizer's
  const std::shared_ptr<const Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<const Impl> impl_;
};

// One sequence's position in a grammar.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);
  ~GrammarMatcher();
  GrammarMatcher(const GrammarMatcher&) = delete;
  GrammarMatcher& operator=(const GrammarMatcher&) = delete;

  // The tokens allowed next: bit t % 32 of word t / 32, for t below vocab_size(); computed once per step.
  std::span<const uint32_t> allowed();
  bool allows(int32_t token);
  // logits[t] = -inf for every token not allowed (every t >= vocab_size() too).
  void mask(std::span<float> logits);
  // The token the sequence took. Throws GrammarError when the grammar does not allow it.
  void accept(int32_t token);
  // Whether the text so far is a whole sentence of the grammar (a stop token may come now).
  bool can_end() const;
  // Whether a stop token was accepted: nothing may follow.
  bool ended() const;
  int32_t vocab_size() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Compiles grammars for one tokenizer's vocabulary. Thread-safe; compiled grammars are cached by their source
// (the schema's text and options), so a schema sent again is not compiled again.
class GrammarCompiler {
 public:
  // `threads`: XGrammar's compile threads (the token masks of a grammar are precomputed in parallel).
  explicit GrammarCompiler(const model::Tokenizer& tokenizer, int threads = 2);
  ~GrammarCompiler();
  GrammarCompiler(const GrammarCompiler&) = delete;
  GrammarCompiler& operator=(const GrammarCompiler&) = delete;

  // Any JSON object (OpenAI's response_format {"type": "json_object"}).
  std::shared_ptr<const Grammar> json_object();
  // JSON valid under the JSON Schema `schema` (its text). Objects admit no properties beyond those the schema names
  // (XGrammar's strict mode: the output validates whether or not the schema says additionalProperties false).
  std::shared_ptr<const Grammar> json_schema(const std::string& schema);
  // XGrammar's EBNF (root rule "root"), e.g. root ::= "yes" | "no".
  std::shared_ptr<const Grammar> ebnf(const std::string& grammar);
  int32_t vocab_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::runtime
