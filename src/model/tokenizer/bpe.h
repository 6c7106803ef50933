// tessera/model/tokenizer/bpe.h — byte-level BPE with ranked merges (GPT-2, Llama-3, Qwen2, SmolLM2).
//
// A pre-token's bytes start as one symbol each (the token spelling that byte in the GPT-2 alphabet); the
// adjacent pair with the best-ranked merge is merged, leftmost first among equal ranks, until no pair has a
// merge. This is the order Hugging Face tokenizers and llama.cpp apply merges in.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tessera::model {

class ByteLevelBpe {
 public:
  // `ids`: vocabulary spelling -> id (the whole vocabulary). `merges`: best first, each a pair of spellings
  // whose concatenation is a token. A merge naming a missing token throws Error.
  ByteLevelBpe(const std::unordered_map<std::string, int32_t>& ids,
               const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges);

  // Appends the ids of one pre-token given as raw bytes. Bytes the vocabulary cannot spell are dropped (the
  // vocabularies tessera reads spell all 256).
  void encode_piece(std::string_view bytes, std::vector<int32_t>& out) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const std::unordered_map<std::string, int32_t>& ids_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_token_{};
  bool ignore_merges_ = false;
};

}  // namespace tessera::model
