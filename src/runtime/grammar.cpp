#include "runtime/grammar.h"

#include <limits>
#include <utility>

#include "model/tokenizer/tokenizer.h"

#if defined(TESSERA_WITH_XGRAMMAR)
#include <xgrammar/xgrammar.h>
#endif

namespace tessera::runtime {

#if defined(TESSERA_WITH_XGRAMMAR)

bool grammar_available() { return true; }

struct Grammar::Impl {
  xgrammar::CompiledGrammar compiled;
  int32_t vocab = 0;
};

struct GrammarCompiler::Impl {
  xgrammar::GrammarCompiler compiler;
  int32_t vocab = 0;
};

namespace {

// XGrammar's message without the "[12:34:56] /path/to/json_schema_converter.cc:5082: " its LogFatalError puts
// first (the time and the build's source path mean nothing to a client) and the trailing newline.
std::string xgrammar_message(std::string m) {
  if (m.size() > 11 && m[0] == '[' && m[9] == ']' && m[10] == ' ') {
    const size_t colon = m.find(": ", 11);
    if (colon != std::string::npos && m.find(".cc:", 11) < colon) m = m.substr(colon + 2);
  }
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
  return m;
}

// XGrammar reports errors as std::runtime_error (its LogFatalError) or std::invalid_argument.
template <class F>
auto xgrammar_call(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const GrammarError&) {
    throw;
  } catch (const std::exception& e) {
    throw GrammarError(what + ": " + xgrammar_message(e.what()));
  }
}

xgrammar::TokenizerInfo tokenizer_info(const model::Tokenizer& tok) {
  const int32_t n = tok.vocab_size();
  std::vector<std::string> vocab(static_cast<size_t>(n));
  // Each token's bytes; control and unknown tokens decode to "" (XGrammar never allows an empty token), except
  // the end-of-generation tokens, which are the stop tokens.
  for (int32_t i = 0; i < n; ++i) vocab[static_cast<size_t>(i)] = tok.token_to_piece(i, /*render_special=*/false);
  std::vector<int32_t> stops = tok.special().end_of_generation;
  return xgrammar::TokenizerInfo(vocab, xgrammar::VocabType::RAW, n, stops, tok.add_space_prefix());
}

std::shared_ptr<const Grammar> wrap(xgrammar::CompiledGrammar compiled, int32_t vocab) {
  auto impl = std::make_shared<Grammar::Impl>(Grammar::Impl{std::move(compiled), vocab});
  return std::make_shared<const Grammar>(std::move(impl));
}

}  // namespace

GrammarCompiler::GrammarCompiler(const model::Tokenizer& tokenizer, int threads) {
  impl_ = xgrammar_call("the grammar compiler", [&] {
    return std::make_unique<Impl>(Impl{xgrammar::GrammarCompiler(tokenizer_info(tokenizer), std::max(1, threads),
                                                                 /*cache_enabled=*/true),
                                       tokenizer.vocab_size()});
  });
}

std::shared_ptr<const Grammar> GrammarCompiler::json_object() {
  return xgrammar_call("json_object", [&] {
    // Compact JSON (no free whitespace: a small model can otherwise pad with newlines until its budget ends).
    return wrap(impl_->compiler.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false, std::nullopt,
                                                  std::nullopt, /*strict_mode=*/false),
                impl_->vocab);
  });
}

std::shared_ptr<const Grammar> GrammarCompiler::json_schema(const std::string& schema) {
  return xgrammar_call("the JSON schema", [&] {
    return wrap(impl_->compiler.CompileJSONSchema(schema, /*any_whitespace=*/false, std::nullopt, std::nullopt,
                                                  /*strict_mode=*/true),
                impl_->vocab);
  });
}

std::shared_ptr<const Grammar> GrammarCompiler::ebnf(const std::string& grammar) {
  return xgrammar_call("the grammar", [&] { return wrap(impl_->compiler.CompileGrammar(grammar, "root"), impl_->vocab); });
}

struct GrammarMatcher::State {
  std::shared_ptr<const Grammar> grammar;
  xgrammar::GrammarMatcher matcher;
  std::vector<uint32_t> bits;
  bool fresh = false;  // bits hold this step's mask
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) {
  check(grammar != nullptr, "GrammarMatcher: no grammar");
  const Grammar& g = *grammar;
  s_ = xgrammar_call("the grammar matcher", [&] {
    return std::make_unique<State>(State{std::move(grammar), xgrammar::GrammarMatcher(g.impl()->compiled), {}, false});
  });
  s_->bits.assign(static_cast<size_t>(xgrammar::GetBitmaskSize(g.vocab_size())), 0u);
}

GrammarMatcher::~GrammarMatcher() = default;

int32_t GrammarMatcher::vocab_size() const { return s_->grammar->vocab_size(); }

std::span<const uint32_t> GrammarMatcher::allowed() {
  if (!s_->fresh) {
    int64_t shape[1] = {static_cast<int64_t>(s_->bits.size())};
    DLTensor t{};
    t.data = s_->bits.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLInt, 32, 1};
    t.shape = shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    xgrammar_call("the grammar's token mask", [&] { return s_->matcher.FillNextTokenBitmask(&t); });
    s_->fresh = true;
  }
  return s_->bits;
}

bool GrammarMatcher::allows(int32_t token) {
  if (token < 0 || token >= vocab_size()) return false;
  const auto t = static_cast<uint32_t>(token);
  return (allowed()[t / 32] >> (t % 32)) & 1u;
}

void GrammarMatcher::mask(std::span<float> logits) {
  const std::span<const uint32_t> bits = allowed();
  const size_t v = std::min(logits.size(), static_cast<size_t>(vocab_size()));
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  for (size_t w = 0; w * 32 < v; ++w) {
    const uint32_t word = bits[w];
    if (word == 0xffffffffu) continue;
    for (size_t b = 0; b < 32 && w * 32 + b < v; ++b)
      if (!((word >> b) & 1u)) logits[w * 32 + b] = kOff;
  }
  for (size_t t = v; t < logits.size(); ++t) logits[t] = kOff;
}

void GrammarMatcher::accept(int32_t token) {
  if (ended()) throw GrammarError("the grammar has ended (a stop token was accepted); token " + std::to_string(token) +
                                  " cannot follow");
  const bool ok = token >= 0 && token < vocab_size() &&
                  xgrammar_call("the grammar", [&] { return s_->matcher.AcceptToken(token); });
  if (!ok) throw GrammarError("the grammar does not allow token " + std::to_string(token) + " here");
  s_->fresh = false;
}

bool GrammarMatcher::can_end() const { return s_->matcher.IsCompleted(); }
bool GrammarMatcher::ended() const { return s_->matcher.IsTerminated(); }

#else  // built without XGrammar

bool grammar_available() { return false; }

struct Grammar::Impl {
  int32_t vocab = 0;
};
struct GrammarCompiler::Impl {};
struct GrammarMatcher::State {};

namespace {
[[noreturn]] void no_xgrammar() {
  throw GrammarError(
      "structured output needs XGrammar: this tessera was built without it (configure with -DTESSERA_XGRAMMAR=ON "
      "where its sdist can be downloaded, cmake/xgrammar.cmake)");
}
}  // namespace

GrammarCompiler::GrammarCompiler(const model::Tokenizer&, int) { no_xgrammar(); }
std::shared_ptr<const Grammar> GrammarCompiler::json_object() { no_xgrammar(); }
std::shared_ptr<const Grammar> GrammarCompiler::json_schema(const std::string&) { no_xgrammar(); }
std::shared_ptr<const Grammar> GrammarCompiler::ebnf(const std::string&) { no_xgrammar(); }
GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar>) { no_xgrammar(); }
GrammarMatcher::~GrammarMatcher() = default;
int32_t GrammarMatcher::vocab_size() const { return 0; }
std::span<const uint32_t> GrammarMatcher::allowed() { no_xgrammar(); }
bool GrammarMatcher::allows(int32_t) { no_xgrammar(); }
void GrammarMatcher::mask(std::span<float>) { no_xgrammar(); }
void GrammarMatcher::accept(int32_t) { no_xgrammar(); }
bool GrammarMatcher::can_end() const { return false; }
bool GrammarMatcher::ended() const { return false; }

#endif

Grammar::Grammar(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
Grammar::~Grammar() = default;
int32_t Grammar::vocab_size() const { return impl_->vocab; }

GrammarCompiler::~GrammarCompiler() = default;
int32_t GrammarCompiler::vocab_size() const {
#if defined(TESSERA_WITH_XGRAMMAR)
  return impl_->vocab;
#else
  return 0;
#endif
}

}  // namespace tessera::runtime
