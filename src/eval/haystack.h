// tessera/eval/haystack.h — the filler text that long-context tasks hide their needles in.
//
// A haystack is a non-empty list of sentences (no leading or trailing whitespace), read cyclically: sentence
// i is sentences[i % size], so any length can be filled from any source. Task generators join consecutive
// sentences with one space and insert needles only between sentences.
//
// Sources:
//   kjv     the King James Bible (public domain, Debian package bible-kjv-text): verses without references,
//           joined into running prose and split into sentences;
//   noise   deterministic short sentences from a seed ("The grass is green. The sky is blue."), the filler of
//           RULER's noise haystack and the passkey test;
//   file    any UTF-8 text file, whitespace collapsed, split into sentences.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::eval {

struct Haystack {
  std::string name;  // "kjv", "noise:<seed>", "file:<path>": recorded in reports
  std::vector<std::string> sentences;
  // Its distinct plain words (haystack_vocabulary), filled by the loaders below; the word tasks draw their
  // words from it. May be left empty: generators then compute it.
  std::vector<std::string> vocabulary;

  const std::string& sentence(size_t i) const { return sentences[i % sentences.size()]; }
};

// Splits prose into sentences. A sentence ends at '.', '!' or '?' (followed by any closing quotes or
// brackets) when whitespace or the end of the text follows. Whitespace runs, newlines included, become one
// space. Text after the last terminator becomes a final sentence. Abbreviations ("Mr. Smith") split too: the
// generators only need boundaries where an inserted sentence reads naturally, not a linguistic parse.
std::vector<std::string> split_sentences(std::string_view text);

// Cuts every sentence of more than `max_words` words after a clause (a word ending in ';' or ':', else ','),
// greedily, so that pieces stay within max_words where the punctuation allows. The
// KJV has sentences of up to 469 words, which would make needle depths coarse.
std::vector<std::string> split_long_sentences(const std::vector<std::string>& sentences, size_t max_words);

// The longest sentence the file and KJV haystacks keep (see split_long_sentences).
inline constexpr size_t kMaxSentenceWords = 60;

// The KJV as a haystack. Throws tessera::Error when the data file is missing or malformed.
Haystack kjv_haystack(const std::filesystem::path& path = "/usr/lib/bible.data");

// `count` sentences "The <thing> is <colour>." and a few fixed lines, drawn from `seed`.
Haystack noise_haystack(uint64_t seed = 0, size_t count = 1024);

// The sentences of a text file. Throws tessera::Error when it cannot be read or holds no text.
Haystack text_file_haystack(const std::filesystem::path& path);

// From a command-line spec: "kjv", "kjv:<path to bible.data>", "noise", "noise:<seed>", "file:<path>".
// Throws tessera::Error listing the valid forms otherwise.
Haystack load_haystack(std::string_view spec);

// The distinct lower-case words (ASCII letters only, at least `min_length` of them) of the haystack, sorted.
std::vector<std::string> haystack_vocabulary(const Haystack& haystack, size_t min_length = 3);

}  // namespace tessera::eval
