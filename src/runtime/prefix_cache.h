// tessera/runtime/prefix_cache.h — KV blocks found again by their tokens (automatic prefix caching).
//
// Every turn of a conversation over a long document starts with the same thousands of tokens; a prefix cache lets
// the next request prefill only what is new. A full block of a sequence (block_tokens rows) is keyed by a chain
// hash of the tokens up to its end, key[b] = hash(key[b - 1], tokens of block b), so that a block is found again
// only after the same tokens at the same positions. Its entry holds one physical block per (layer, kv head) of the
// paged KV cache (runtime/paged_kv.h; -1 where the sequence had already dropped it: a sliding-window layer's early
// blocks), and the block's tokens, compared on every hit (a hash collision is a miss, never a wrong answer).
//
// The cache is one more holder of each block it keeps (BlockPool::share): sequences that adopt a prefix share its
// blocks read-only and write only past it; a block leaves the pool when neither the cache nor any sequence holds it.
// Entries are dropped least recently used first when the pool needs room (evict). What determines a block's
// contents besides its tokens and positions: the model (one cache per engine) and the attention that computed the
// earlier layers' outputs — only prompts prefilled densely are cached and only dense requests reuse them (a sparse
// prefill's keys depend on the pattern and on the whole prompt's length; streaming memory has no blocks).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "runtime/paged_kv.h"

namespace tessera::runtime {

class PrefixCache {
 public:
  explicit PrefixCache(int32_t block_tokens = 64);

  // The chain keys of the full blocks of `tokens` (tokens.size() / block_tokens of them).
  std::vector<uint64_t> keys(std::span<const int32_t> tokens) const;

  // The longest run of cached blocks at the start of `tokens`, at most max_blocks, that `seq` (empty, with its
  // retention) can adopt: every block it keeps at that length is in the entries. Those entries count as used now.
  // The result points into the cache: valid until the next insert / evict / clear.
  std::vector<const std::vector<int32_t>*> match(std::span<const int32_t> tokens, int64_t max_blocks,
                                                 const SequenceBlocks& seq);

  // Caches seq's first `blocks` full blocks, holding the K/V of tokens[0, blocks * block_tokens): those not cached
  // yet become entries (the cache holds their ids once more: an entry is kept even where every head had dropped
  // its block, as a link of the chain); those cached already count as used and take the ids they lacked.
  void insert(std::span<const int32_t> tokens, const SequenceBlocks& seq, int64_t blocks, BlockPool& pool);

  // Drops entries, least recently used first, until the pool has `available` free blocks or the cache is empty;
  // returns how many entries went.
  int64_t evict(BlockPool& pool, int64_t available);
  void clear(BlockPool& pool);

  int64_t entries() const { return static_cast<int64_t>(map_.size()); }
  int64_t ids_held() const { return ids_held_; }  // block ids the cache holds (some may be shared with sequences)
  int64_t ids_only_here(const BlockPool& pool) const;  // those no sequence holds (what evict can free)
  int32_t block_tokens() const { return block_tokens_; }

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;  // the block's tokens
    std::vector<int32_t> ids;     // [layer * kv_heads + kv_head], -1: not kept
    uint64_t last_use = 0;
  };
  Entry* find(uint64_t key, uint64_t parent, std::span<const int32_t> tokens);
  void drop(std::unordered_map<uint64_t, Entry>::iterator it, BlockPool& pool);

  int32_t block_tokens_;
  std::unordered_map<uint64_t, Entry> map_;
  uint64_t clock_ = 0;
  int64_t ids_held_ = 0;
};

}  // namespace tessera::runtime
