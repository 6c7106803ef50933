#include "eval/words.h"

#include "core/error.h"

namespace tessera::eval {

namespace {

// random_key's words: "<adjective>-<noun>".
struct KeyWords {
  std::vector<std::string> adjectives, nouns;
};

const KeyWords& key_words() {
  static const KeyWords w = {
      {
          "quiet",  "amber",  "brave",  "calm",   "clever", "crimson", "dusty",  "eager",  "faint",  "fierce",
          "gentle", "glassy", "golden", "hollow", "humble", "icy",     "jolly",  "lively", "lonely", "lucky",
          "mellow", "misty",  "narrow", "noble",  "odd",    "pale",    "proud",  "rapid",  "rough",  "rusty",
          "sandy",  "shiny",  "silent", "silver", "sleepy", "smooth",  "steady", "sticky", "stormy", "sunny",
      },
      {
          "harbor",  "anchor", "badger",  "basket",  "beacon",  "bridge",  "candle",  "canyon",
          "castle",  "cedar",  "comet",   "copper",  "desert",  "falcon",  "feather", "garden",
          "glacier", "hammer", "island",  "jacket",  "kettle",  "lantern", "ledger",  "marble",
          "meadow",  "mirror", "orchard", "pebble",  "pepper",  "planet",  "quarry",  "ribbon",
          "saddle",  "shadow", "signal",  "spindle", "thimble", "tunnel",  "violin",  "walnut",
      },
  };
  return w;
}

}  // namespace

void throw_too_few_distinct(size_t count) {
  throw Error("task generator: could not draw " + std::to_string(count) + " distinct values");
}

std::string random_key(Rng& rng) {
  const KeyWords& w = key_words();
  return rng.pick(w.adjectives) + "-" + rng.pick(w.nouns);
}

std::vector<std::string> distinct_keys(Rng& rng, size_t count) {
  return distinct(count, [&] { return random_key(rng); });
}

std::string pseudo_word(Rng& rng, int syllables) {
  static const std::string consonants = "bcdfghklmnprstvz";
  static const std::string vowels = "aeiou";
  std::string w;
  for (int i = 0; i < syllables; ++i) {
    w.push_back(consonants[rng.below(consonants.size())]);
    w.push_back(vowels[rng.below(vowels.size())]);
  }
  return w;
}

std::string coded_word(Rng& rng, int min_length, int max_length) {
  const auto length = static_cast<size_t>(rng.between(min_length, max_length));
  std::string w(length, 'a');
  for (char& c : w) c = static_cast<char>('a' + rng.below(26));
  return w;
}

std::string variable_name(Rng& rng, int length) {
  std::string w(static_cast<size_t>(length), 'A');
  for (char& c : w) c = static_cast<char>('A' + rng.below(26));
  return w;
}

std::string random_number(Rng& rng, int digits) {
  check(digits >= 1 && digits <= 18, "random_number: digits must be in 1..18");
  int64_t lo = 1;
  for (int i = 1; i < digits; ++i) lo *= 10;
  const int64_t hi = lo * 10 - 1;
  return std::to_string(rng.between(digits == 1 ? 0 : lo, hi));
}

std::string random_uuid(Rng& rng) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) s.push_back('-');
    int d = static_cast<int>(rng.below(16));
    if (i == 12) d = 4;            // version 4
    if (i == 16) d = 8 + (d & 3);  // variant 10xx
    s.push_back(hex[d]);
  }
  return s;
}

}  // namespace tessera::eval
