// tessera/eval/rng.h — the random draws of the task generators, identical on every platform.
//
// std::mt19937_64's output sequence is fixed by the C++ standard, but the standard distributions
// (uniform_int_distribution, shuffle, ...) are not: libstdc++ and libc++ turn the same engine state into
// different numbers. Generated cases must be byte-identical everywhere, so every draw goes through Rng, whose
// distributions are written here.
#pragma once

#include <cstdint>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera::eval {

// SplitMix64 finaliser: a bijective 64-bit mix. Used to derive independent seeds from (seed, labels).
uint64_t mix64(uint64_t x);

// FNV-1a of a string: a stable hash for labels such as task names.
uint64_t fnv1a(std::string_view s);

// Seed of one case stream: depends on the base seed, a label (the task name) and the sample index only.
uint64_t derive_seed(uint64_t seed, std::string_view label, uint64_t index);

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  uint64_t next() { return engine_(); }
  // Uniform in [0, n), unbiased (rejection of the top partial range). n must be > 0.
  uint64_t below(uint64_t n);
  // Uniform in [lo, hi] (inclusive). Requires lo <= hi.
  int64_t between(int64_t lo, int64_t hi);
  // Uniform in [0, 1) with 53 random bits.
  double unit();

  // Fisher-Yates, drawing with below().
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) {
      size_t j = static_cast<size_t>(below(i));
      using std::swap;
      swap(v[i - 1], v[j]);
    }
  }

  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(below(v.size()))];
  }

 private:
  std::mt19937_64 engine_;
};

}  // namespace tessera::eval
