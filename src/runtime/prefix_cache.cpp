#include "runtime/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace tessera::runtime {

namespace {

// splitmix64's finaliser: a well-mixed 64-bit step of the chain.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int32_t block_tokens) : block_tokens_(block_tokens) {
  check(block_tokens > 0, "prefix cache: block_tokens must be positive");
}

std::vector<uint64_t> PrefixCache::keys(std::span<const int32_t> tokens) const {
  const size_t B = static_cast<size_t>(block_tokens_);
  std::vector<uint64_t> out;
  uint64_t key = mix(0x7465737365726131ull);  // the chain's start
  for (size_t b = 0; (b + 1) * B <= tokens.size(); ++b) {
    for (size_t i = b * B; i < (b + 1) * B; ++i) key = mix(key ^ static_cast<uint32_t>(tokens[i]));
    out.push_back(key);
  }
  return out;
}

PrefixCache::Entry* PrefixCache::find(uint64_t key, uint64_t parent, std::span<const int32_t> tokens) {
  const auto it = map_.find(key);
  if (it == map_.end() || it->second.parent != parent) return nullptr;
  Entry& e = it->second;
  return std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()) ? &e : nullptr;
}

std::vector<const std::vector<int32_t>*> PrefixCache::match(std::span<const int32_t> tokens, int64_t max_blocks,
                                                            const SequenceBlocks& seq) {
  const auto B = static_cast<size_t>(block_tokens_);
  check(seq.length() == 0, "prefix cache: only an empty sequence adopts a prefix");
  check(seq.shape().block_tokens == block_tokens_, "prefix cache: block size differs from the sequence's");
  std::vector<uint64_t> k = keys(tokens);
  if (static_cast<int64_t>(k.size()) > max_blocks) k.resize(static_cast<size_t>(std::max<int64_t>(0, max_blocks)));
  // The cached chain.
  std::vector<Entry*> chain;
  uint64_t parent = 0;
  for (size_t b = 0; b < k.size(); ++b) {
    Entry* e = find(k[b], parent, tokens.subspan(b * B, B));
    if (e == nullptr || e->ids.size() != seq.tables()) break;
    chain.push_back(e);
    parent = k[b];
  }
  // The longest part of it the sequence can adopt: per (layer, kv head), the blocks the chain lacks must all be
  // outside what that head keeps at the adopted length (the sink's blocks and the window's).
  std::vector<std::vector<int64_t>> missing(seq.tables());
  for (size_t b = 0; b < chain.size(); ++b)
    for (size_t i = 0; i < seq.tables(); ++i)
      if (chain[b]->ids[i] < 0) missing[i].push_back(static_cast<int64_t>(b));
  auto adoptable = [&](int64_t n) {
    const int64_t len = n * static_cast<int64_t>(B);
    for (size_t i = 0; i < seq.tables(); ++i) {
      for (int64_t b : missing[i]) {
        if (b >= n) break;
        if (seq.keeps(i, b, len)) return false;
      }
    }
    return true;
  };
  int64_t n = static_cast<int64_t>(chain.size());
  while (n > 0 && !adoptable(n)) --n;
  std::vector<const std::vector<int32_t>*> out;
  ++clock_;
  for (int64_t b = 0; b < n; ++b) {
    chain[static_cast<size_t>(b)]->last_use = clock_;
    out.push_back(&chain[static_cast<size_t>(b)]->ids);
  }
  return out;
}

void PrefixCache::insert(std::span<const int32_t> tokens, const SequenceBlocks& seq, int64_t blocks,
                         BlockPool& pool) {
  const auto B = static_cast<size_t>(block_tokens_);
  check(blocks * static_cast<int64_t>(B) <= seq.length() && blocks * B <= tokens.size(),
        "prefix cache: caching blocks the sequence has not written");
  const std::vector<uint64_t> k = keys(tokens.first(static_cast<size_t>(blocks) * B));
  ++clock_;
  uint64_t parent = 0;
  for (size_t b = 0; b < k.size(); ++b) {
    const auto chunk = tokens.subspan(b * B, B);
    auto it = map_.find(k[b]);
    if (it == map_.end()) {
      Entry e;
      e.parent = parent;
      e.tokens.assign(chunk.begin(), chunk.end());
      e.ids.assign(seq.tables(), -1);
      it = map_.emplace(k[b], std::move(e)).first;
    } else if (it->second.parent != parent ||
               !std::equal(it->second.tokens.begin(), it->second.tokens.end(), chunk.begin(), chunk.end())) {
      parent = k[b];
      continue;  // a collision with another chain's block: the first one stays
    }
    // The entry (kept even where every head had dropped the block: a link of the chain) takes the ids it lacks.
    Entry& e = it->second;
    e.last_use = clock_;
    for (size_t i = 0; i < seq.tables() && i < e.ids.size(); ++i) {
      const std::vector<int32_t>& t = seq.table(i);
      const int32_t id = b < t.size() ? t[b] : -1;
      if (id < 0 || e.ids[i] >= 0) continue;
      pool.keep(id);
      e.ids[i] = id;
      ++ids_held_;
    }
    parent = k[b];
  }
}

void PrefixCache::drop(std::unordered_map<uint64_t, Entry>::iterator it, BlockPool& pool) {
  for (int32_t id : it->second.ids)
    if (id >= 0) {
      pool.unkeep(id);
      --ids_held_;
    }
  map_.erase(it);
}

int64_t PrefixCache::evict(BlockPool& pool, int64_t available) {
  if (pool.available() >= available || map_.empty()) return 0;
  std::vector<std::pair<uint64_t, uint64_t>> order;  // (last use, key)
  order.reserve(map_.size());
  for (const auto& [key, e] : map_) order.emplace_back(e.last_use, key);
  std::sort(order.begin(), order.end());
  int64_t dropped = 0;
  for (const auto& [use, key] : order) {
    if (pool.available() >= available) break;
    drop(map_.find(key), pool);
    ++dropped;
  }
  return dropped;
}

int64_t PrefixCache::ids_only_here(const BlockPool& pool) const { return pool.kept_alone(); }

void PrefixCache::clear(BlockPool& pool) {
  while (!map_.empty()) drop(map_.begin(), pool);
}

}  // namespace tessera::runtime
