#include "model/tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <utility>

#include "core/error.h"
#include "model/tokenizer/utf8.h"

namespace tessera::model {

namespace {

// GPT-2's pattern (also what Hugging Face's ByteLevel pre-tokenizer uses with use_regex).
constexpr std::string_view kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

PreTokenizerStep isolated(std::string_view pattern) {
  return PreTokenizerStep{std::string(pattern)};
}

}  // namespace

std::vector<PreTokenizerStep> named_pre_tokenizer(std::string_view name) {
  if (name == "gpt2" || name == "gpt-2" || name == "default") return {isolated(kGpt2)};
  if (name == "llama3" || name == "llama-bpe" || name == "llama-v3") return {isolated(kLlama3)};
  if (name == "qwen2" || name == "deepseek-r1-qwen") return {isolated(kQwen2)};
  // SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)]; llama.cpp's
  // "smollm".
  if (name == "smollm" || name == "starcoder" || name == "refact")
    return {isolated(R"(\p{N})"), isolated(kGpt2)};
  throw Error("tokenizer: pre-tokenizer \"" + std::string(name) +
              "\" is not one tessera knows (gpt2/default, llama3/llama-bpe, qwen2, smollm/starcoder)");
}

std::string widen_whitespace_classes(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      ++i;
      if (e == 's') {
        out += in_class ? R"(\s\x{85})" : R"([\s\x{85}])";
      } else if (e == 'S' && !in_class) {
        out += R"([^\s\x{85}])";
      } else if (e == 'Q') {  // \Q...\E literal run: copy verbatim
        const size_t end = p.find("\\E", i + 1);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out += "\\Q";
        out.append(p.substr(i + 1, stop - (i + 1)));
        i = stop - 1;
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

struct PreTokenizer::Step {
  PreTokenizerStep spec;
  pcre2_code* code = nullptr;

  explicit Step(PreTokenizerStep s) : spec(std::move(s)) {
    if (spec.prefix_space) return;
    const std::string pattern = widen_whitespace_classes(spec.pattern);
    int err = 0;
    PCRE2_SIZE offset = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                         &err, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw Error("tokenizer: pre-tokenizer regex does not compile at offset " + std::to_string(offset) +
                  " (" + reinterpret_cast<const char*>(msg) + "): " + spec.pattern);
    }
    pcre2_jit_compile(code,
                      PCRE2_JIT_COMPLETE);  // best effort: the interpreter is used when JIT is unavailable
  }
  ~Step() {
    if (code != nullptr) pcre2_code_free(code);
  }
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

  // Appends the pieces `text` (valid UTF-8) splits into.
  void split_valid(std::string_view text, std::vector<std::string>& out) const {
    struct MatchData {
      pcre2_match_data* p;
      explicit MatchData(const pcre2_code* c) : p(pcre2_match_data_create_from_pattern(c, nullptr)) {}
      ~MatchData() { pcre2_match_data_free(p); }
    } md(code);
    // Matches (and the gaps between them) in order; each labelled as matched or not.
    std::vector<std::pair<std::string_view, bool>> parts;
    size_t pos = 0, last = 0;
    while (pos <= text.size()) {
      const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md.p, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) throw Error("tokenizer: regex match failed (" + std::to_string(rc) + ")");
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.p);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step over one character
        if (b >= text.size()) break;
        pos = b + utf8::char_length(text, b);
        continue;
      }
      if (b > last) parts.emplace_back(text.substr(last, b - last), false);
      parts.emplace_back(text.substr(b, e - b), true);
      last = pos = e;
    }
    if (last < text.size()) parts.emplace_back(text.substr(last), false);
    if (spec.invert) {
      for (auto& part : parts) part.second = !part.second;
    }
    using B = PreTokenizerStep::Behavior;
    std::string carry;  // MergedWithNext: a match waiting for the text after it
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto [piece, matched] = parts[i];
      switch (spec.behavior) {
        case B::Isolated:
          out.emplace_back(piece);
          break;
        case B::Removed:
          if (!matched) out.emplace_back(piece);
          break;
        case B::MergedWithPrevious:
          if (matched && i > 0 && !parts[i - 1].second) {
            out.back() += piece;
          } else {
            out.emplace_back(piece);
          }
          break;
        case B::MergedWithNext:
          if (matched) {
            if (!carry.empty()) out.push_back(std::move(carry));
            carry = std::string(piece);
          } else {
            out.push_back(carry + std::string(piece));
            carry.clear();
          }
          break;
      }
    }
    if (!carry.empty()) out.push_back(std::move(carry));
  }

  void apply(const std::string& piece, std::vector<std::string>& out) const {
    if (spec.prefix_space) {
      out.push_back(!piece.empty() && piece[0] == ' ' ? piece : " " + piece);
      return;
    }
    // Valid runs go to the regex; each invalid byte stays a piece of its own.
    size_t run = 0, pos = 0;
    while (pos < piece.size()) {
      const size_t n = utf8::char_length(piece, pos);
      if (n == 1 && static_cast<unsigned char>(piece[pos]) >= 0x80) {
        if (pos > run) split_valid(std::string_view(piece).substr(run, pos - run), out);
        out.emplace_back(piece.substr(pos, 1));
        run = pos + 1;
      }
      pos += n;
    }
    if (run < piece.size()) split_valid(std::string_view(piece).substr(run), out);
  }
};

PreTokenizer::PreTokenizer(const std::vector<PreTokenizerStep>& steps) {
  for (const auto& s : steps) steps_.push_back(std::make_unique<Step>(s));
}
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

bool PreTokenizer::empty() const {
  return steps_.empty();
}

std::vector<std::string> PreTokenizer::split(std::string_view text) const {
  std::vector<std::string> pieces;
  if (text.empty()) return pieces;
  pieces.emplace_back(text);
  for (const auto& step : steps_) {
    std::vector<std::string> next;
    next.reserve(pieces.size() * 2);
    for (const auto& piece : pieces) step->apply(piece, next);
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace tessera::model
