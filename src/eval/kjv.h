// tessera/eval/kjv.h — the King James Bible from the Debian package bible-kjv-text, as verses of clean prose.
//
// The package installs /usr/lib/bible.data: the text as fixed-size blocks, each compressed separately with
// Unix compress's LZW, so that the `bible` program can seek. Layout (integers big-endian):
//   0     magic "EC02" and a NUL-padded description
//   0x54  u32 block size (bytes of text per block, 65536)
//   0x58  u32 block count n
//   0x5c  u32 offsets[n + 1]: block i is the bytes [offsets[i], offsets[i + 1]) of the file
//   offsets[0] - 3: the 3-byte compress header (1f 9d flags), written once; every block is a fresh code
//   stream
// The text is a title line and then one verse a line, "Ge1:1 In the beginning God created ...".
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace tessera::eval {

inline constexpr const char* kDefaultKjvPath = "/usr/lib/bible.data";

struct KjvVerse {
  std::string book;  // the abbreviation the file uses: "Ge", "1Sm", "SSol", "Rev"
  int chapter = 0;
  int verse = 0;
  std::string text;  // the verse without its reference
};

// The whole decompressed text, as the `bible` program would read it. Throws tessera::Error naming the file
// (and suggesting `apt-get install bible-kjv-text` when it is missing) on any malformed input.
std::string read_kjv_text(const std::filesystem::path& path = kDefaultKjvPath);

// Every verse, in order (31,102 for the KJV). Lines that do not start with a reference are skipped.
std::vector<KjvVerse> read_kjv_verses(const std::filesystem::path& path = kDefaultKjvPath);

// Splits one line "1Sm3:10 And the LORD came ..." into a verse; returns false when it has no reference.
bool parse_kjv_line(const std::string& line, KjvVerse& verse);

}  // namespace tessera::eval
