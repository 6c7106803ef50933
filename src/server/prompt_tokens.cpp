#include "server/prompt_tokens.h"

#include <algorithm>
#include <cstring>

namespace tessera::server {

namespace {

size_t common_prefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  constexpr size_t kBlock = 4096;
  size_t i = 0;
  while (i + kBlock <= n && std::memcmp(a.data() + i, b.data() + i, kBlock) == 0) i += kBlock;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

PromptTokenCache::PromptTokenCache(size_t max_bytes, size_t spacing) : max_bytes_(max_bytes), spacing_(spacing) {}

size_t PromptTokenCache::Entry::bytes() const {
  return sizeof(Entry) + text.capacity() + ids.capacity() * sizeof(int32_t) +
         checkpoints.capacity() * sizeof(model::EncodeCheckpoint);
}

std::vector<int32_t> PromptTokenCache::encode(const model::Tokenizer& tokenizer, std::string_view text,
                                              const model::EncodeOptions& options) {
  if (max_bytes_ == 0) return tokenizer.encode(text, options);
  Entry made;
  made.tokenizer = &tokenizer;
  made.add_special = options.add_special;
  made.parse_special = options.parse_special;
  made.text = std::string(text);
  // The kept prompt with the furthest usable checkpoint: its ids up to there, and its checkpoints before it.
  uint64_t base = 0;
  bool base_is_prefix = false;  // the new prompt extends it: it replaces the entry
  model::EncodeCheckpoint from;
  std::vector<int32_t> before;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.lookups;
    auto best = entries_.end();
    size_t best_cut = 0;
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->tokenizer != &tokenizer || it->add_special != options.add_special ||
          it->parse_special != options.parse_special)
        continue;
      const size_t common = common_prefix(it->text, text);
      if (common == text.size() && common == it->text.size()) {  // the same prompt again
        entries_.splice(entries_.begin(), entries_, it);
        ++stats_.hits;
        stats_.bytes_reused += text.size();
        return it->ids;
      }
      for (auto c = it->checkpoints.rbegin(); c != it->checkpoints.rend(); ++c) {
        if (c->needs > common) continue;
        // (on a tie, the prompt this one extends: it is replaced, not kept beside the new one)
        if (c->text_pos > best_cut || (c->text_pos == best_cut && common == it->text.size() && !base_is_prefix)) {
          best = it;
          best_cut = c->text_pos;
          from = *c;
          base_is_prefix = common == it->text.size();
        }
        break;
      }
    }
    if (best != entries_.end()) {
      base = best->serial;
      before.assign(best->ids.begin(), best->ids.begin() + static_cast<std::ptrdiff_t>(from.ids));
      for (const model::EncodeCheckpoint& c : best->checkpoints) {
        if (c.text_pos > from.text_pos) break;
        made.checkpoints.push_back(c);
      }
      ++stats_.hits;
      stats_.bytes_reused += from.text_pos;
    }
  }
  made.ids = base != 0 ? tokenizer.encode_from(text, options, before, from, &made.checkpoints, spacing_)
                       : tokenizer.encode(text, options, &made.checkpoints, spacing_);
  std::vector<int32_t> ids = made.ids;
  made.ids.shrink_to_fit();
  made.checkpoints.shrink_to_fit();
  std::lock_guard<std::mutex> lock(mu_);
  insert(std::move(made), base_is_prefix ? base : 0);
  return ids;
}

void PromptTokenCache::insert(Entry entry, uint64_t replaces) {
  if (replaces != 0) {
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.serial == replaces; });
    if (it != entries_.end()) {
      bytes_ -= it->bytes();
      entries_.erase(it);
    }
  }
  const size_t need = entry.bytes();
  if (need > max_bytes_) return;
  while (!entries_.empty() && bytes_ + need > max_bytes_) {
    bytes_ -= entries_.back().bytes();
    entries_.pop_back();
    ++stats_.evictions;
  }
  entry.serial = next_serial_++;
  bytes_ += need;
  entries_.push_front(std::move(entry));
}

PromptTokenCache::Stats PromptTokenCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  s.entries = entries_.size();
  s.bytes = bytes_;
  return s;
}

}  // namespace tessera::server
