#include "model/tokenizer/utf8.h"

namespace tessera::model::utf8 {

int sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;  // continuation byte or overlong 2-byte lead
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

namespace {

bool is_continuation(uint8_t b) {
  return (b & 0xC0) == 0x80;
}

// Whether the second byte is allowed after `lead` (rules out overlongs, surrogates and values past U+10FFFF).
bool second_byte_ok(uint8_t lead, uint8_t b) {
  if (!is_continuation(b)) return false;
  if (lead == 0xE0) return b >= 0xA0;
  if (lead == 0xED) return b < 0xA0;
  if (lead == 0xF0) return b >= 0x90;
  if (lead == 0xF4) return b < 0x90;
  return true;
}

// Number of bytes of s[pos..] that form a valid prefix of one sequence; `full` tells whether it is complete.
size_t valid_prefix(std::string_view s, size_t pos, bool& full) {
  const auto lead = static_cast<uint8_t>(s[pos]);
  const int n = sequence_length(lead);
  full = false;
  if (n == 0) return 0;
  size_t k = 1;
  for (; k < static_cast<size_t>(n) && pos + k < s.size(); ++k) {
    const auto b = static_cast<uint8_t>(s[pos + k]);
    if (k == 1 ? !second_byte_ok(lead, b) : !is_continuation(b)) return k;
  }
  full = k == static_cast<size_t>(n);
  return k;
}

}  // namespace

size_t char_length(std::string_view s, size_t pos) {
  bool full = false;
  const size_t k = valid_prefix(s, pos, full);
  return full ? k : 1;
}

char32_t decode_at(std::string_view s, size_t pos) {
  const size_t n = char_length(s, pos);
  const auto lead = static_cast<uint8_t>(s[pos]);
  if (n == 1) return lead < 0x80 ? char32_t{lead} : char32_t{0xFFFD};
  char32_t cp = lead & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[pos + k]) & 0x3F);
  return cp;
}

void append(std::string& out, char32_t cp) {
  if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) cp = 0xFFFD;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t complete_prefix_length(std::string_view s) {
  // Only the last (at most 3) bytes can be the start of an unfinished character.
  const size_t from = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t pos = from; pos < s.size(); ++pos) {
    const auto b = static_cast<uint8_t>(s[pos]);
    if (is_continuation(b)) continue;
    bool full = false;
    const size_t k = valid_prefix(s, pos, full);
    if (!full && k > 0 && pos + k == s.size()) return pos;  // a valid, unfinished sequence runs to the end
  }
  return s.size();
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  each_char(s, [&](size_t pos, size_t n, bool valid) {
    if (valid) {
      out.append(s.substr(pos, n));
    } else {
      append(out, 0xFFFD);
    }
    return true;
  });
  return out;
}

bool is_valid(std::string_view s) {
  return each_char(s, [](size_t, size_t, bool valid) { return valid; });
}

}  // namespace tessera::model::utf8
