#include "model/tokenizer/byte_level.h"

#include <array>

#include "model/tokenizer/utf8.h"

namespace tessera::model::byte_level {

namespace {

bool printable(unsigned b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<int, 324> to_byte{};  // code points 0..323 cover the whole alphabet
  Tables() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      to_char[b] = printable(b) ? char32_t{b} : next++;
      to_byte[to_char[b]] = static_cast<int>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t byte_to_char(unsigned char b) {
  return tables().to_char[b];
}

int char_to_byte(char32_t c) {
  return c < tables().to_byte.size() ? tables().to_byte[c] : -1;
}

std::string spell(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) utf8::append(out, byte_to_char(static_cast<unsigned char>(c)));
  return out;
}

std::string unspell(std::string_view spelled) {
  std::string out;
  out.reserve(spelled.size());
  utf8::each_char(spelled, [&](size_t pos, size_t n, bool valid) {
    const int b = valid ? char_to_byte(utf8::decode_at(spelled, pos)) : -1;
    if (b >= 0) {
      out += static_cast<char>(b);
    } else {
      out.append(spelled.substr(pos, n));
    }
    return true;
  });
  return out;
}

bool is_spelled(std::string_view s) {
  return utf8::each_char(
      s, [&](size_t pos, size_t, bool valid) { return valid && char_to_byte(utf8::decode_at(s, pos)) >= 0; });
}

}  // namespace tessera::model::byte_level
