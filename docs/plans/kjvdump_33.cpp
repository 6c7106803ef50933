// Issue 33 (docs/plans/moa_layers_33.sh): g++ -std=c++20 -O1 -Isrc docs/plans/kjvdump_33.cpp src/eval/haystack.cpp
//   src/eval/kjv.cpp src/eval/lzw.cpp src/eval/rng.cpp src/eval/words.cpp build/ci/src/libtessera_core.a -o kjvdump
// Writes the kjv haystack's sentences [from, from + count) as one line of prose (for a held-out text file).
#include <cstdio>
#include <cstdlib>
#include "eval/haystack.h"
int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: kjvdump FROM COUNT FILE\n");
    return 2;
  }
  const auto h = tessera::eval::load_haystack("kjv");
  const size_t from = std::strtoul(argv[1], nullptr, 10), count = std::strtoul(argv[2], nullptr, 10);
  std::printf("%zu sentences\n", h.sentences.size());
  FILE* f = std::fopen(argv[3], "w");
  for (size_t i = from; i < from + count; ++i) std::fprintf(f, "%s ", h.sentence(i).c_str());
  std::fclose(f);
}
