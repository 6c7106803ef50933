// tessera/eval/lzw.h — a decoder for the LZW streams of Unix compress(1) (".Z" files).
//
// The Debian package bible-kjv-text stores the King James text as blocks of such streams (see kjv.h), so this
// is what reads our public-domain haystack without any other dependency.
//
// The format: a 3-byte header 1f 9d <flags> (flags & 0x1f = maximum code width, 9..16; flags & 0x80 = block
// mode, in which code 256 clears the dictionary), then codes packed least-significant bit first. Codes start
// 9 bits wide and widen by one bit when the dictionary outgrows the width. compress writes codes in groups of
// eight (one group is `width` bytes) and, when the width changes or the dictionary is cleared, skips to the
// end of the current group; the decoder must skip the same padding. A quirk kept for compatibility: with a
// maximum width of 9, codes still widen to 10 bits once the dictionary is full (compress and gzip do so).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace tessera::eval {

struct LzwParams {
  int max_bits = 16;
  bool block_mode = true;
};

// Parses the 3-byte header. Throws tessera::Error when the magic or the maximum width is wrong.
LzwParams parse_lzw_header(std::span<const uint8_t> header);

// Decodes a whole .Z stream (header included).
std::string lzw_decompress(std::span<const uint8_t> data);

// Decodes a headerless code stream with the given parameters. Throws tessera::Error on an invalid code.
std::string lzw_decode(std::span<const uint8_t> codes, const LzwParams& params);

}  // namespace tessera::eval
