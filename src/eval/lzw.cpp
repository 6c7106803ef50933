#include "eval/lzw.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace tessera::eval {

namespace {

constexpr int kInitialBits = 9;
constexpr uint32_t kClear = 256;

// Reads fixed-width codes LSB first and tracks the group alignment compress uses.
class CodeReader {
 public:
  explicit CodeReader(std::span<const uint8_t> data) : data_(data) {}

  bool has(int width) const { return bit_ + static_cast<uint64_t>(width) <= data_.size() * 8; }

  uint32_t read(int width) {
    uint32_t code = 0;
    for (int got = 0; got < width;) {
      const uint64_t byte = bit_ >> 3;
      const int offset = static_cast<int>(bit_ & 7);
      const int take = std::min(8 - offset, width - got);
      const uint32_t bits = (static_cast<uint32_t>(data_[byte]) >> offset) & ((1u << take) - 1);
      code |= bits << got;
      got += take;
      bit_ += static_cast<uint64_t>(take);
    }
    return code;
  }

  // Skips to the end of the current group of eight `width`-bit codes, counted from where this width began,
  // and starts counting groups anew.
  void end_group(int width) {
    const uint64_t group_bits = static_cast<uint64_t>(width) * 8;
    const uint64_t used = bit_ - group_start_;
    bit_ = group_start_ + (used + group_bits - 1) / group_bits * group_bits;
    group_start_ = bit_;
  }

 private:
  std::span<const uint8_t> data_;
  uint64_t bit_ = 0;
  uint64_t group_start_ = 0;
};

}  // namespace

LzwParams parse_lzw_header(std::span<const uint8_t> header) {
  check(header.size() >= 3 && header[0] == 0x1f && header[1] == 0x9d,
        "not a compress (.Z) stream: the header must start with bytes 1f 9d");
  LzwParams p;
  p.max_bits = header[2] & 0x1f;
  p.block_mode = (header[2] & 0x80) != 0;
  check(p.max_bits >= kInitialBits && p.max_bits <= 16,
        "compress (.Z) stream: maximum code width " + std::to_string(p.max_bits) + " is outside 9..16");
  return p;
}

std::string lzw_decompress(std::span<const uint8_t> data) {
  const LzwParams p = parse_lzw_header(data);
  return lzw_decode(data.subspan(3), p);
}

std::string lzw_decode(std::span<const uint8_t> codes, const LzwParams& params) {
  check(params.max_bits >= kInitialBits && params.max_bits <= 16, "lzw_decode: max_bits must be in 9..16");
  const uint32_t table_size = 1u << params.max_bits;
  const uint32_t first_free = params.block_mode ? 257 : 256;
  // Entry c > 255 is the string of entry prefix[c] followed by the byte suffix[c].
  std::vector<uint32_t> prefix(table_size, 0);
  std::vector<uint8_t> suffix(table_size, 0);
  for (uint32_t c = 0; c < 256; ++c) suffix[c] = static_cast<uint8_t>(c);

  std::string out;
  std::vector<uint8_t> stack;
  CodeReader reader(codes);
  int width = kInitialBits;
  // The code after which the width grows. As in compress (and gzip), it is 511 at the start even when
  // max_bits is 9, so a 9-bit stream switches to 10-bit codes once its dictionary is full.
  uint32_t max_code = (1u << kInitialBits) - 1;
  uint32_t next = first_free;
  int64_t prev = -1;  // previous code, -1 at the start and after a clear
  uint8_t prev_first = 0;

  // Appends the string of `code` and returns its first byte.
  auto emit = [&](uint32_t code) {
    stack.clear();
    while (code >= 256) {
      stack.push_back(suffix[code]);
      code = prefix[code];
    }
    stack.push_back(static_cast<uint8_t>(code));
    out.append(stack.rbegin(), stack.rend());
    return static_cast<uint8_t>(code);
  };

  for (;;) {
    if (next > max_code) {
      reader.end_group(width);
      ++width;
      max_code = width == params.max_bits ? table_size : (1u << width) - 1;
    }
    if (!reader.has(width)) break;
    const uint32_t code = reader.read(width);
    if (params.block_mode && code == kClear) {
      reader.end_group(width);
      width = kInitialBits;
      max_code = (1u << kInitialBits) - 1;
      next = first_free;
      prev = -1;
      continue;
    }
    if (prev < 0) {
      check(code < 256, "compress (.Z) stream: first code " + std::to_string(code) + " is not a literal");
      prev_first = emit(code);
      prev = code;
      continue;
    }
    uint8_t first = 0;
    if (code < next) {
      first = emit(code);
    } else {
      check(code == next, "compress (.Z) stream: code " + std::to_string(code) +
                              " is beyond the dictionary (" + std::to_string(next) + " entries)");
      // The code being defined right now: the previous string plus its own first byte.
      emit(static_cast<uint32_t>(prev));
      out.push_back(static_cast<char>(prev_first));
      first = prev_first;
    }
    if (next < table_size) {
      prefix[next] = static_cast<uint32_t>(prev);
      suffix[next] = first;
      ++next;
    }
    prev = code;
    prev_first = first;
  }
  return out;
}

}  // namespace tessera::eval
