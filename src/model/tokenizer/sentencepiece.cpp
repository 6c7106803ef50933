#include "model/tokenizer/sentencepiece.h"

#include <algorithm>
#include <queue>

#include "model/tokenizer/utf8.h"

namespace tessera::model {

std::string escape_spaces(std::string_view text) {
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  for (char c : text) {
    if (c == ' ') {
      out += "\xE2\x96\x81";
    } else {
      out += c;
    }
  }
  return out;
}

int byte_token_value(std::string_view text) {
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (text.size() != 6 || !text.starts_with("<0x") || text.back() != '>') return -1;
  const int hi = hex(text[3]), lo = hex(text[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

SentencePieceBpe::SentencePieceBpe(const std::vector<std::string>& tokens,
                                   const std::vector<TokenType>& types, const std::vector<float>& scores,
                                   bool byte_fallback, int32_t unk)
    : scores_(scores), byte_fallback_(byte_fallback), unk_(unk) {
  byte_token_.fill(-1);
  pieces_.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const TokenType t = types.empty() ? TokenType::Normal : types[i];
    const auto id = static_cast<int32_t>(i);
    if (t == TokenType::Normal || t == TokenType::UserDefined || t == TokenType::Undefined) {
      pieces_.try_emplace(tokens[i], id);
    } else if (t == TokenType::Byte) {
      // (not sscanf's %2X, which reads "<0x-1>" as 0xFFFFFFFF, an index far outside byte_token_)
      if (const int value = byte_token_value(tokens[i]); value >= 0)
        byte_token_[static_cast<size_t>(value)] = id;
    }
  }
  // Where no piece spans a boundary (sentencepiece.h): the characters pieces hold before a "▁", and newlines.
  const std::string_view space = "\xE2\x96\x81";
  newline_joins_ = false;
  for (const auto& [piece, id] : pieces_) {
    const std::string_view p = piece;
    // Characters as encode() cuts them (utf8::char_length from the piece's start, as from a symbol's).
    for (size_t prev = 0, at = 0; at < p.size();) {
      const size_t n = utf8::char_length(p, at);
      if (at > 0 && p.substr(at, n) == space) {
        const std::string before(p.substr(prev, at - prev));
        if (before != space && std::find(before_space_.begin(), before_space_.end(), before) == before_space_.end())
          before_space_.push_back(before);
      }
      prev = at;
      at += n;
    }
    if (p.find('\n') != std::string_view::npos && p.find_first_not_of('\n') != std::string_view::npos)
      newline_joins_ = true;
  }
}

bool SentencePieceBpe::cuts_before_space(std::string_view before) const {
  return before != "\xE2\x96\x81" && std::find(before_space_.begin(), before_space_.end(), before) == before_space_.end();
}

bool SentencePieceBpe::parts_independent() const {
  if (unk_ < 0) return true;
  return byte_fallback_ && std::all_of(byte_token_.begin(), byte_token_.end(), [](int32_t id) { return id >= 0; });
}

void SentencePieceBpe::encode(std::string_view text, std::vector<int32_t>& out) const {
  const std::string_view space = "\xE2\x96\x81";
  bool last_unk = false;
  size_t start = 0, prev = 0;  // the part's first byte; the previous character's
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = utf8::char_length(text, pos);
    if (pos > start) {
      const std::string_view before = text.substr(prev, pos - prev);
      bool cut = text.substr(pos, n) == space && cuts_before_space(before);
      if (!newline_joins_) cut = cut || ((text[pos] == '\n') != (before == "\n"));
      if (cut) {
        encode_part(text.substr(start, pos - start), out, last_unk);
        start = pos;
      }
    }
    prev = pos;
    pos += n;
  }
  encode_part(text.substr(start), out, last_unk);
}

void SentencePieceBpe::encode_whole(std::string_view text, std::vector<int32_t>& out) const {
  bool last_unk = false;
  encode_part(text, out, last_unk);
}

void SentencePieceBpe::encode_part(std::string_view text, std::vector<int32_t>& out, bool& last_unk) const {
  if (text.empty()) return;
  struct Symbol {
    size_t begin, size;  // bytes of `text`; size 0 once merged into its left neighbour
    int32_t prev, next;
  };
  std::vector<Symbol> sym;
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = utf8::char_length(text, pos);
    const auto i = static_cast<int32_t>(sym.size());
    sym.push_back({pos, n, i - 1, -1});
    if (i > 0) sym[i - 1].next = i;
    pos += n;
  }
  struct Bigram {
    float score;
    int32_t left;
    size_t size;  // bytes of the merged piece, to detect stale entries
    bool operator<(const Bigram& o) const { return score != o.score ? score < o.score : left > o.left; }
  };
  std::priority_queue<Bigram> queue;
  auto consider = [&](int32_t left) {
    if (left < 0 || sym[left].next < 0) return;
    const Symbol& a = sym[left];
    const Symbol& b = sym[a.next];
    const auto it = pieces_.find(text.substr(a.begin, a.size + b.size));
    if (it == pieces_.end()) return;
    const float score = scores_.empty() ? 0.0f : scores_[it->second];
    queue.push({score, left, a.size + b.size});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Bigram g = queue.top();
    queue.pop();
    Symbol& a = sym[g.left];
    if (a.size == 0 || a.next < 0) continue;
    Symbol& b = sym[a.next];
    if (a.size + b.size != g.size) continue;  // one side changed since this pair was queued
    a.size += b.size;
    b.size = 0;
    a.next = b.next;
    if (b.next >= 0) sym[b.next].prev = g.left;
    consider(a.prev);
    consider(g.left);
  }
  for (int32_t i = 0; i >= 0 && i < static_cast<int32_t>(sym.size()); i = sym[i].next) {
    const std::string_view piece = text.substr(sym[i].begin, sym[i].size);
    const auto it = pieces_.find(piece);
    if (it != pieces_.end()) {
      out.push_back(it->second);
      last_unk = false;
      continue;
    }
    bool all_bytes = byte_fallback_;
    for (char c : piece) all_bytes = all_bytes && byte_token_[static_cast<unsigned char>(c)] >= 0;
    if (all_bytes) {
      for (char c : piece) out.push_back(byte_token_[static_cast<unsigned char>(c)]);
      last_unk = false;
    } else if (unk_ >= 0 &&
               !last_unk) {  // consecutive unknown characters fuse into one unk, as SentencePiece does
      out.push_back(unk_);
      last_unk = true;
    }
  }
}

}  // namespace tessera::model
