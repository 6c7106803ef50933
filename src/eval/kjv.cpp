#include "eval/kjv.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>

#include "core/error.h"
#include "eval/lzw.h"

namespace tessera::eval {

namespace {

constexpr size_t kBlockSizeOffset = 0x54;
constexpr size_t kBlockCountOffset = 0x58;
constexpr size_t kOffsetsOffset = 0x5c;

uint32_t read_u32be(const std::string& data, size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data() + at);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

std::string read_kjv_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), path.string() +
                                   ": cannot open the KJV data file (install it with `apt-get install "
                                   "bible-kjv-text`, or pass the path of bible.data)");
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string name = path.string();
  check(data.size() > kOffsetsOffset && std::memcmp(data.data(), "EC02", 4) == 0,
        name + ": not a bible-kjv data file (expected the magic \"EC02\")");
  const uint32_t block_size = read_u32be(data, kBlockSizeOffset);
  const uint32_t blocks = read_u32be(data, kBlockCountOffset);
  check(blocks > 0 && blocks < (1u << 20), name + ": implausible block count " + std::to_string(blocks));
  check(data.size() >= kOffsetsOffset + 4 * (size_t{blocks} + 1), name + ": truncated block table");
  std::vector<uint32_t> offsets(blocks + 1);
  for (uint32_t i = 0; i <= blocks; ++i) offsets[i] = read_u32be(data, kOffsetsOffset + 4 * size_t{i});
  check(offsets[0] >= kOffsetsOffset + 4 * (size_t{blocks} + 1) + 3,
        name + ": the first block overlaps the block table");
  for (uint32_t i = 0; i < blocks; ++i) {
    check(offsets[i] <= offsets[i + 1] && offsets[i + 1] <= data.size(),
          name + ": block " + std::to_string(i) + " lies outside the file");
  }
  const auto bytes = std::span(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  LzwParams params;
  try {
    params = parse_lzw_header(bytes.subspan(offsets[0] - 3, 3));
  } catch (const Error& e) {
    throw Error(name + ": " + e.what());
  }
  std::string text;
  text.reserve(size_t{block_size} * blocks);
  for (uint32_t i = 0; i < blocks; ++i) {
    try {
      text += lzw_decode(bytes.subspan(offsets[i], offsets[i + 1] - offsets[i]), params);
    } catch (const Error& e) {
      throw Error(name + ": block " + std::to_string(i) + ": " + e.what());
    }
  }
  return text;
}

bool parse_kjv_line(const std::string& line, KjvVerse& verse) {
  // <book><chapter>:<verse> <text>, where a book is an optional digit and letters ("1Sm", "SSol").
  size_t i = 0;
  const size_t n = line.size();
  auto is_digit = [&](size_t k) { return k < n && std::isdigit(static_cast<unsigned char>(line[k])); };
  auto is_alpha = [&](size_t k) { return k < n && std::isalpha(static_cast<unsigned char>(line[k])); };
  if (is_digit(i)) ++i;
  const size_t letters = i;
  while (is_alpha(i)) ++i;
  if (i == letters) return false;
  const size_t book_end = i;
  int chapter = 0;
  if (!is_digit(i)) return false;
  while (is_digit(i) && chapter < 100000) chapter = chapter * 10 + (line[i++] - '0');
  if (i >= n || line[i] != ':') return false;
  ++i;
  int number = 0;
  if (!is_digit(i)) return false;
  while (is_digit(i) && number < 100000) number = number * 10 + (line[i++] - '0');
  if (i >= n || line[i] != ' ') return false;
  verse.book = line.substr(0, book_end);
  verse.chapter = chapter;
  verse.verse = number;
  size_t begin = i + 1, end = n;
  while (begin < end && std::isspace(static_cast<unsigned char>(line[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(line[end - 1]))) --end;
  verse.text = line.substr(begin, end - begin);
  return true;
}

std::vector<KjvVerse> read_kjv_verses(const std::filesystem::path& path) {
  const std::string text = read_kjv_text(path);
  std::vector<KjvVerse> verses;
  verses.reserve(31102);
  size_t begin = 0;
  KjvVerse v;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    if (parse_kjv_line(text.substr(begin, end - begin), v)) verses.push_back(v);
    begin = end + 1;
  }
  check(!verses.empty(), path.string() + ": no verses found in the decompressed text");
  return verses;
}

}  // namespace tessera::eval
