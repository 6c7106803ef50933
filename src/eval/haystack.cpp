#include "eval/haystack.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iterator>
#include <set>

#include "core/error.h"
#include "eval/kjv.h"
#include "eval/rng.h"

namespace tessera::eval {

namespace {

bool is_space(char c) {
  return std::isspace(static_cast<unsigned char>(c)) != 0;
}
bool is_terminator(char c) {
  return c == '.' || c == '!' || c == '?';
}
bool is_closer(char c) {
  return c == '"' || c == '\'' || c == ')' || c == ']';
}

}  // namespace

std::vector<std::string> split_sentences(std::string_view text) {
  std::vector<std::string> out;
  std::string cur;
  const size_t n = text.size();
  for (size_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (is_space(c)) {
      if (!cur.empty() && cur.back() != ' ') cur.push_back(' ');
      continue;
    }
    cur.push_back(c);
    if (!is_terminator(c)) continue;
    size_t j = i + 1;
    while (j < n && (is_terminator(text[j]) || is_closer(text[j]))) cur.push_back(text[j++]);
    i = j - 1;
    if (j == n || is_space(text[j])) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  while (!cur.empty() && cur.back() == ' ') cur.pop_back();
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

std::vector<std::string> split_long_sentences(const std::vector<std::string>& sentences, size_t max_words) {
  std::vector<std::string> out;
  out.reserve(sentences.size());
  for (const std::string& s : sentences) {
    // Word start offsets (sentences hold single spaces only).
    std::vector<size_t> starts;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != ' ' && (i == 0 || s[i - 1] == ' ')) starts.push_back(i);
    }
    if (max_words == 0 || starts.size() <= max_words) {
      out.push_back(s);
      continue;
    }
    size_t piece = 0;   // first word of the current piece
    size_t clause = 0;  // a word after a clause end (';' or ':') where the piece may end; 0 when none yet
    size_t comma = 0;   // the same after a ',': the fallback for lists without clauses
    for (size_t w = 0; w < starts.size(); ++w) {
      if (w + 1 - piece > max_words) {
        const size_t cut = clause > piece ? clause : comma > piece ? comma : 0;
        if (cut > piece) {
          out.push_back(s.substr(starts[piece], (starts[cut] - 1) - starts[piece]));
          piece = cut;
        }
      }
      const size_t end = w + 1 < starts.size() ? starts[w + 1] - 1 : s.size();
      const char last = s[end - 1];
      if (w + 1 < starts.size()) {
        if (last == ';' || last == ':') clause = w + 1;
        if (last == ',') comma = w + 1;
      }
    }
    out.push_back(s.substr(starts[piece]));
  }
  return out;
}

Haystack kjv_haystack(const std::filesystem::path& path) {
  const std::vector<KjvVerse> verses = read_kjv_verses(path);
  // Verses often end mid-sentence (with ',' or ':'), so they are joined into running prose first.
  std::string prose;
  for (const KjvVerse& v : verses) {
    if (!prose.empty()) prose.push_back(' ');
    prose += v.text;
  }
  Haystack h;
  h.name = path == kDefaultKjvPath ? "kjv" : "kjv:" + path.string();
  h.sentences = split_long_sentences(split_sentences(prose), kMaxSentenceWords);
  h.vocabulary = haystack_vocabulary(h);
  return h;
}

Haystack noise_haystack(uint64_t seed, size_t count) {
  static const std::vector<std::string> things = {
      "grass", "sky",  "sun",   "sea",   "moon",   "river", "forest", "road",  "sand",     "snow",
      "cloud", "rose", "stone", "field", "garden", "lake",  "leaf",   "apple", "mountain", "meadow"};
  static const std::vector<std::string> colours = {"green", "blue",   "yellow", "white", "grey",  "red",
                                                   "brown", "golden", "silver", "dark",  "bright"};
  static const std::vector<std::string> lines = {"Here we go.", "There and back again.", "The day goes on.",
                                                 "Nothing changes here."};
  check(count > 0, "noise haystack: count must be > 0");
  Rng rng(derive_seed(seed, "noise", 0));
  Haystack h;
  h.name = "noise:" + std::to_string(seed);
  h.sentences.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (rng.below(6) == 0) {
      h.sentences.push_back(rng.pick(lines));
    } else {
      std::string s = "The " + rng.pick(things) + " is " + rng.pick(colours) + ".";
      h.sentences.push_back(std::move(s));
    }
  }
  h.vocabulary = haystack_vocabulary(h);
  return h;
}

Haystack text_file_haystack(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), path.string() + ": cannot open the haystack text file");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Haystack h;
  h.name = "file:" + path.string();
  h.sentences = split_long_sentences(split_sentences(text), kMaxSentenceWords);
  check(!h.sentences.empty(), path.string() + ": the haystack text file holds no text");
  h.vocabulary = haystack_vocabulary(h);
  return h;
}

Haystack load_haystack(std::string_view spec) {
  const size_t colon = spec.find(':');
  const std::string_view kind = spec.substr(0, colon);
  const std::string arg = colon == std::string_view::npos ? "" : std::string(spec.substr(colon + 1));
  if (kind == "kjv")
    return kjv_haystack(arg.empty() ? std::filesystem::path(kDefaultKjvPath) : std::filesystem::path(arg));
  if (kind == "noise") {
    uint64_t seed = 0;
    if (!arg.empty()) {
      check(arg.find_first_not_of("0123456789") == std::string::npos && arg.size() <= 19,
            "haystack '" + std::string(spec) + "': the noise seed must be a decimal number");
      seed = std::stoull(arg);
    }
    return noise_haystack(seed);
  }
  if (kind == "file" && !arg.empty()) return text_file_haystack(arg);
  throw Error("haystack '" + std::string(spec) +
              "' is not one of: kjv, kjv:<path to bible.data>, noise, noise:<seed>, file:<path>");
}

std::vector<std::string> haystack_vocabulary(const Haystack& haystack, size_t min_length) {
  // Words are the whitespace-separated tokens with surrounding punctuation stripped; a token with anything
  // but ASCII letters left ("man's", "twenty-two", digits, accents) is not a plain word and is skipped.
  std::set<std::string> words;
  for (const std::string& s : haystack.sentences) {
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && s[i] == ' ') ++i;
      size_t end = s.find(' ', i);
      if (end == std::string::npos) end = s.size();
      size_t b = i, e = end;
      while (b < e && std::ispunct(static_cast<unsigned char>(s[b]))) ++b;
      while (e > b && std::ispunct(static_cast<unsigned char>(s[e - 1]))) --e;
      bool plain = e - b >= min_length;
      for (size_t k = b; plain && k < e; ++k) {
        const auto u = static_cast<unsigned char>(s[k]);
        plain = u < 128 && std::isalpha(u);
      }
      if (plain) {
        std::string w = s.substr(b, e - b);
        for (char& c : w) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        words.insert(std::move(w));
      }
      i = end;
    }
  }
  return {words.begin(), words.end()};
}

}  // namespace tessera::eval
