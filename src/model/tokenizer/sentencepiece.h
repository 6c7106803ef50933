// tessera/model/tokenizer/sentencepiece.h — SentencePiece BPE with scores (Llama-2, Mistral, Gemma-3).
//
// Text arrives with spaces already written as U+2581 "▁". It starts as one symbol per UTF-8 character; the
// adjacent pair whose concatenation is a piece with the highest score merges first (leftmost among equal
// scores), until no adjacent pair forms a piece. A final symbol that is not a piece becomes its bytes as
// <0xXX> tokens (byte fallback), or the unknown token. This is SentencePiece's BPE encoder and llama.cpp's
// SPM tokenizer.
//
// Speed: a merge only ever makes a piece, so a boundary between two characters that no piece holds side by side is a
// boundary of the result, and the text on either side encodes alone to the same ids (the merges of one side never
// meet the other's, and within a side they run in the same order). encode() cuts the text at such boundaries found
// from the vocabulary when it is made: before a "▁" that follows a character no piece holds before a "▁" (Gemma-3:
// every character but ">", for the piece ">▁</"), and at the edges of runs of newlines when no piece mixes a newline
// with another character. A long prompt then runs as words, each with its own small queue (Gemma-3, 110 KB of
// text: ~75-135 ms as one queue on a loaded 2-core machine).
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
  // Whether encode() cuts before a "▁" that follows the character `before` (the rule above).
  bool cuts_before_space(std::string_view before) const;
  // Whether the parts encode() cuts the text into give the same ids encoded one call each (true unless an unknown
  // token without byte fallback could fuse with one across a cut).
  bool parts_independent() const;
  // The same as one merge queue over the whole text (encode's reference, for tests).
  void encode_whole(std::string_view text, std::vector<int32_t>& out) const;

 private:
  void encode_part(std::string_view text, std::vector<int32_t>& out, bool& last_unk) const;

  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> pieces_;  // looked up by string_view
  const std::vector<float>& scores_;
  std::array<int32_t, 256> byte_token_{};
  bool byte_fallback_ = true;
  int32_t unk_ = -1;
  // The characters some piece holds right before a "▁" (encode does not cut there), and whether a piece holds a
  // newline beside another character (then newlines cut nothing).
  std::vector<std::string> before_space_;
  bool newline_joins_ = true;
};

// " " -> "▁" (U+2581).
std::string escape_spaces(std::string_view text);

// The byte a byte-fallback token stands for: "<0x0A>" -> 10 (two hex digits exactly); -1 for any other text.
int byte_token_value(std::string_view text);

}  // namespace tessera::model
