// tessera/model/tokenizer/special_tokens.h — finding special and added tokens in text before tokenization.
//
// Text is cut into fragments: runs of plain text and whole special tokens. Control and unknown tokens are
// candidates only when parse_special is set; user-defined tokens always are. At each position the longest
// candidate wins, and the leftmost position wins first (Hugging Face's added-token matching).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

struct Fragment {
  std::string_view text;  // plain text (when token < 0)
  int32_t token = -1;     // a matched special token
  size_t at = 0;          // where it starts in the split text (a token: its first byte, after any lstrip space)
  size_t next = 0;        // where the text after it starts (a token: past any rstrip space)
};

class SpecialTokenMatcher {
 public:
  SpecialTokenMatcher(const std::vector<std::string>& tokens, const std::vector<TokenType>& types,
                      const std::vector<int32_t>& lstrip, const std::vector<int32_t>& rstrip);
  std::vector<Fragment> split(std::string_view text, bool parse_special) const;
  bool empty() const { return nodes_.size() <= 1; }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t token = -1;
    bool control = false;  // needs parse_special
  };
  // The longest enabled candidate starting at text[pos]: its end, or 0 with token -1 when none matches.
  int32_t match_at(std::string_view text, size_t pos, bool parse_special, size_t& end) const;
  std::vector<Node> nodes_;
  std::vector<uint8_t> lstrip_, rstrip_;  // by token id
};

}  // namespace tessera::model
