// tessera/server/prompt_tokens.h — the ids of a prompt that starts with an earlier prompt's text, without tokenizing
// that text again.
//
// Every turn of a conversation sends the whole conversation; over a long document the server would tokenize the
// document again for each (Gemma-3's tokenizer: ~26-39 ms for a 29K-token prompt on a loaded CPU). The cache keeps
// recent prompts' text, ids and the tokenizer's checkpoints (tokenizer.h, EncodeCheckpoint: control tokens, and word
// starts the pre-tokenizer or SentencePiece's merges never join across, kept `spacing` bytes apart); a prompt whose
// text shares a checkpoint's bytes with a kept one takes that one's ids up to the checkpoint and tokenizes only the
// rest. The ids are exactly Tokenizer::encode's (tokenizer_test, server_test). A conversation that grew replaces its
// earlier entry; entries are dropped least recently used beyond `max_bytes` (text, ids and checkpoints counted).
// Safe to use from several threads (the tokenizing runs outside the lock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/tokenizer.h"

namespace tessera::server {

class PromptTokenCache {
 public:
  static constexpr size_t kDefaultBytes = size_t{64} << 20;
  static constexpr size_t kDefaultSpacing = 256;
  // max_bytes 0: keeps nothing (encode is Tokenizer::encode).
  explicit PromptTokenCache(size_t max_bytes = kDefaultBytes, size_t spacing = kDefaultSpacing);

  std::vector<int32_t> encode(const model::Tokenizer& tokenizer, std::string_view text,
                              const model::EncodeOptions& options);

  struct Stats {
    uint64_t lookups = 0;
    uint64_t hits = 0;           // prompts that started from a kept one
    uint64_t bytes_reused = 0;   // text not tokenized again
    uint64_t evictions = 0;
    size_t entries = 0;
    size_t bytes = 0;            // held now
  };
  Stats stats() const;

 private:
  struct Entry {
    uint64_t serial = 0;
    const model::Tokenizer* tokenizer = nullptr;
    bool add_special = false, parse_special = false;
    std::string text;
    std::vector<int32_t> ids;
    std::vector<model::EncodeCheckpoint> checkpoints;
    size_t bytes() const;
  };
  void insert(Entry entry, uint64_t replaces);  // under mu_

  const size_t max_bytes_, spacing_;
  mutable std::mutex mu_;
  std::list<Entry> entries_;  // most recently used first
  size_t bytes_ = 0;
  uint64_t next_serial_ = 1;
  Stats stats_;
};

}  // namespace tessera::server
