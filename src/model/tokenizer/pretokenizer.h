// tessera/model/tokenizer/pretokenizer.h — regex pre-tokenization (PCRE2, UTF + UCP).
//
// A pre-tokenizer cuts text into the pieces BPE merges within. It is a sequence of steps (tokenizer.h,
// PreTokenizerStep); each step splits every piece made so far, the way Hugging Face's Split pre-tokenizer and
// llama.cpp's sequential regexes do. Patterns are written for Oniguruma (what Hugging Face tokenizers uses);
// before compiling, \s and \S are widened to count U+0085 (NEL) as whitespace as Oniguruma does and PCRE2's
// UCP mode does not.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

// The Oniguruma -> PCRE2 adjustment described above (exposed for tests).
std::string widen_whitespace_classes(std::string_view pattern);

class PreTokenizer {
 public:
  // Compiles every pattern; throws Error naming the pattern and PCRE2's message when one does not compile.
  explicit PreTokenizer(const std::vector<PreTokenizerStep>& steps);
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // The pieces of `text`, in order; their concatenation is `text` unless a step removes or adds characters.
  // Invalid UTF-8 bytes never reach the regexes: each one is a piece of its own.
  std::vector<std::string> split(std::string_view text) const;
  bool empty() const;

 private:
  struct Step;
  std::vector<std::unique_ptr<Step>> steps_;
};

}  // namespace tessera::model
