#include "model/tokenizer/special_tokens.h"

#include <algorithm>

namespace tessera::model {

namespace {
bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
}  // namespace

SpecialTokenMatcher::SpecialTokenMatcher(const std::vector<std::string>& tokens,
                                         const std::vector<TokenType>& types,
                                         const std::vector<int32_t>& lstrip,
                                         const std::vector<int32_t>& rstrip) {
  nodes_.emplace_back();
  for (size_t id = 0; id < types.size() && id < tokens.size(); ++id) {
    const TokenType t = types[id];
    if (t != TokenType::Control && t != TokenType::Unknown && t != TokenType::UserDefined) continue;
    const std::string& text = tokens[id];
    if (text.empty()) continue;
    int32_t node = 0;
    for (char ch : text) {
      const auto c = static_cast<unsigned char>(ch);
      auto& kids = nodes_[node].children;
      auto it = std::lower_bound(
          kids.begin(), kids.end(), c,
          [](const std::pair<unsigned char, int32_t>& p, unsigned char v) { return p.first < v; });
      if (it != kids.end() && it->first == c) {
        node = it->second;
      } else {
        const auto next = static_cast<int32_t>(nodes_.size());
        kids.insert(it, {c, next});
        nodes_.emplace_back();
        node = next;
      }
    }
    if (nodes_[node].token < 0) {  // the first id with a given text wins
      nodes_[node].token = static_cast<int32_t>(id);
      nodes_[node].control = t != TokenType::UserDefined;
    }
  }
  lstrip_.assign(tokens.size(), 0);
  rstrip_.assign(tokens.size(), 0);
  for (int32_t id : lstrip) {
    if (id >= 0 && static_cast<size_t>(id) < lstrip_.size()) lstrip_[id] = 1;
  }
  for (int32_t id : rstrip) {
    if (id >= 0 && static_cast<size_t>(id) < rstrip_.size()) rstrip_[id] = 1;
  }
}

int32_t SpecialTokenMatcher::match_at(std::string_view text, size_t pos, bool parse_special,
                                      size_t& end) const {
  int32_t node = 0, best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const auto& kids = nodes_[node].children;
    auto it = std::lower_bound(
        kids.begin(), kids.end(), c,
        [](const std::pair<unsigned char, int32_t>& p, unsigned char v) { return p.first < v; });
    if (it == kids.end() || it->first != c) break;
    node = it->second;
    if (nodes_[node].token >= 0 && (parse_special || !nodes_[node].control)) {
      best = nodes_[node].token;
      end = i + 1;
    }
  }
  return best;
}

std::vector<Fragment> SpecialTokenMatcher::split(std::string_view text, bool parse_special) const {
  std::vector<Fragment> out;
  if (empty()) {
    if (!text.empty()) out.push_back({text, -1, 0, text.size()});
    return out;
  }
  size_t start = 0;  // start of the pending plain text
  for (size_t pos = 0; pos < text.size();) {
    size_t end = 0;
    const int32_t token = match_at(text, pos, parse_special, end);
    if (token < 0) {
      ++pos;
      continue;
    }
    size_t before = pos;
    if (lstrip_[token]) {
      while (before > start && is_space(text[before - 1])) --before;
    }
    if (before > start) out.push_back({text.substr(start, before - start), -1, start, before});
    if (rstrip_[token]) {
      while (end < text.size() && is_space(text[end])) ++end;
    }
    out.push_back({{}, token, pos, end});
    start = pos = end;
  }
  if (start < text.size()) out.push_back({text.substr(start), -1, start, text.size()});
  return out;
}

}  // namespace tessera::model
