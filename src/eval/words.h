// tessera/eval/words.h — the made-up content of task cases: needle keys, coded words, variable names, values.
// Every function draws from the Rng it is given, so cases stay deterministic.
#pragma once

#include <cstddef>
#include <string>
#include <unordered_set>
#include <vector>

#include "eval/rng.h"

namespace tessera::eval {

// A needle key: an adjective-noun pair such as "quiet-harbor" (about 1,600 distinct pairs).
std::string random_key(Rng& rng);

// `count` distinct keys.
std::vector<std::string> distinct_keys(Rng& rng, size_t count);

// A pronounceable made-up word of `syllables` consonant-vowel syllables, lower case ("balomi").
std::string pseudo_word(Rng& rng, int syllables);

// A lower-case string of random letters, length uniform in [min_length, max_length] (RULER's coded words).
std::string coded_word(Rng& rng, int min_length, int max_length);

// A variable name of `length` upper-case letters ("QWERT").
std::string variable_name(Rng& rng, int length = 5);

// A decimal number with exactly `digits` digits (no leading zero).
std::string random_number(Rng& rng, int digits);

// A version-4-shaped UUID in lower-case hex, 8-4-4-4-12.
std::string random_uuid(Rng& rng);

[[noreturn]] void throw_too_few_distinct(size_t count);

// `count` distinct values from `draw`; throws tessera::Error after too many collisions.
template <typename Draw>
std::vector<std::string> distinct(size_t count, Draw&& draw, std::unordered_set<std::string> taken = {}) {
  std::vector<std::string> out;
  size_t attempts = 0;
  while (out.size() < count) {
    std::string s = draw();
    if (taken.insert(s).second) {
      out.push_back(std::move(s));
    } else if (++attempts > 1000 + 100 * count) {
      throw_too_few_distinct(count);
    }
  }
  return out;
}

}  // namespace tessera::eval
