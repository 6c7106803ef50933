#include "eval/rng.h"

#include "core/error.h"

namespace tessera::eval {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t derive_seed(uint64_t seed, std::string_view label, uint64_t index) {
  return mix64(mix64(mix64(seed) ^ fnv1a(label)) ^ index);
}

uint64_t Rng::below(uint64_t n) {
  check(n > 0, "Rng::below: empty range");
  // 2^64 mod n: draws below it would make the low residues more likely, so they are redrawn.
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t x = engine_();
    if (x >= threshold) return x % n;
  }
}

int64_t Rng::between(int64_t lo, int64_t hi) {
  check(lo <= hi, "Rng::between: lo > hi");
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  if (span == UINT64_MAX) return static_cast<int64_t>(engine_());
  return static_cast<int64_t>(static_cast<uint64_t>(lo) + below(span + 1));
}

double Rng::unit() {
  return static_cast<double>(engine_() >> 11) * 0x1.0p-53;
}

}  // namespace tessera::eval
