// tessera/model/tokenizer/sentencepiece.h — SentencePiece BPE with scores (Llama-2, Mistral, Gemma-3).
//
// Text arrives with spaces already written as U+2581 "▁". It starts as one symbol per UTF-8 character; the
// adjacent pair whose concatenation is a piece with the highest score merges first (leftmost among equal
// scores), until no adjacent pair forms a piece. A final symbol that is not a piece becomes its bytes as
// <0xXX> tokens (byte fallback), or the unknown token. This is SentencePiece's BPE encoder and llama.cpp's
// SPM tokenizer.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

class SentencePieceBpe {
 public:
  // Pieces that merges may produce: Normal and UserDefined tokens. Byte tokens are found by their "<0xXX>"
  // spelling.
  SentencePieceBpe(const std::vector<std::string>& tokens, const std::vector<TokenType>& types,
                   const std::vector<float>& scores, bool byte_fallback, int32_t unk);

  // Appends the ids of `text` (spaces already escaped to "▁").
  void encode(std::string_view text, std::vector<int32_t>& out) const;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> pieces_;  // looked up by string_view
  const std::vector<float>& scores_;
  std::array<int32_t, 256> byte_token_{};
  bool byte_fallback_ = true;
  int32_t unk_ = -1;
};

// " " -> "▁" (U+2581).
std::string escape_spaces(std::string_view text);

// The byte a byte-fallback token stands for: "<0x0A>" -> 10 (two hex digits exactly); -1 for any other text.
int byte_token_value(std::string_view text);

}  // namespace tessera::model
