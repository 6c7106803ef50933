#include "model/tokenizer/bpe.h"

#include <queue>

#include "core/error.h"
#include "model/tokenizer/byte_level.h"
#include "model/tokenizer/utf8.h"

namespace tessera::model {

ByteLevelBpe::ByteLevelBpe(const std::unordered_map<std::string, int32_t>& ids,
                           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges)
    : ids_(ids), ignore_merges_(ignore_merges) {
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    utf8::append(spelled, byte_level::byte_to_char(static_cast<unsigned char>(b)));
    const auto it = ids.find(spelled);
    byte_token_[b] = it == ids.end() ? -1 : it->second;
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = ids.find(a), ib = ids.find(b), ir = ids.find(a + b);
    if (ia == ids.end() || ib == ids.end() || ir == ids.end()) {
      throw Error("tokenizer: merge " + std::to_string(rank) + " (\"" + a + "\" \"" + b +
                  "\") names a token that is not in the vocabulary");
    }
    // A pair listed twice keeps its first (best) rank, as Hugging Face does.
    merges_.try_emplace(key(ia->second, ib->second), Merge{static_cast<int32_t>(rank), ir->second});
  }
}

void ByteLevelBpe::encode_piece(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.empty()) return;
  if (ignore_merges_) {
    const auto it = ids_.find(byte_level::spell(bytes));
    if (it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
  };
  std::vector<Symbol> sym;
  sym.reserve(bytes.size());
  for (char c : bytes) {
    const int32_t id = byte_token_[static_cast<unsigned char>(c)];
    if (id < 0) continue;
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, -1});
    if (n > 0) sym[n - 1].next = n;
  }
  if (sym.size() == 1) {
    out.push_back(sym[0].id);
    return;
  }
  struct Candidate {
    int32_t rank, pos, result;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int32_t left) {
    if (left < 0 || sym[left].next < 0) return;
    const auto it = merges_.find(key(sym[left].id, sym[sym[left].next].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.result});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = sym[c.pos];
    if (left.id < 0 || left.next < 0) continue;  // merged away, or nothing to its right any more
    Symbol& right = sym[left.next];
    const auto it = merges_.find(key(left.id, right.id));
    if (it == merges_.end() || it->second.result != c.result) continue;  // stale: a neighbour changed
    left.id = c.result;
    right.id = -1;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.pos;
    consider(left.prev);
    consider(c.pos);
  }
  for (int32_t i = 0; i >= 0 && i < static_cast<int32_t>(sym.size()); i = sym[i].next)
    out.push_back(sym[i].id);
}

}  // namespace tessera::model
