// tessera/model/tokenizer/utf8.h — the few UTF-8 facts the tokenizers need.
//
// Tokenizers work on bytes: a token may hold part of a character (byte-level BPE, SentencePiece byte
// fallback), so decoded text is reassembled from bytes and only then read as UTF-8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tessera::model::utf8 {

// Length of the sequence that `lead` starts (1..4), or 0 when `lead` cannot start one (a continuation byte or
// 0xF8..0xFF). 0xC0/0xC1 (overlong) and 0xF5..0xF7 (past U+10FFFF) are rejected as well.
int sequence_length(uint8_t lead);

// Number of bytes of the character starting at s[pos]: its sequence length when the sequence is complete and
// valid, else 1 (so an invalid byte is consumed on its own, as SentencePiece and llama.cpp do).
size_t char_length(std::string_view s, size_t pos);

// Walks the characters of `s` in order, char_length(s, pos) bytes each, calling f(pos, n, valid) (valid is
// false for an invalid byte, which is a character of its own) while it returns true. Returns whether the walk
// reached the end.
template <class F>
bool each_char(std::string_view s, F&& f) {
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = char_length(s, pos);
    if (!f(pos, n, !(n == 1 && static_cast<uint8_t>(s[pos]) >= 0x80))) return false;
    pos += n;
  }
  return true;
}

// The code point of the valid sequence at s[pos] (char_length(s, pos) bytes), or U+FFFD for an invalid byte.
char32_t decode_at(std::string_view s, size_t pos);

// Appends the UTF-8 encoding of `cp` (U+FFFD for surrogates and values past U+10FFFF).
void append(std::string& out, char32_t cp);

// Length of the longest prefix of `s` that does not end inside an incomplete (but so far valid) sequence: the
// bytes after it are the start of a character that later bytes may complete. Invalid bytes do not hold back.
size_t complete_prefix_length(std::string_view s);

// `s` with every invalid byte replaced by U+FFFD (a truncated sequence counts as invalid).
std::string sanitize(std::string_view s);

// True when `s` is entirely valid UTF-8.
bool is_valid(std::string_view s);

}  // namespace tessera::model::utf8
