// Host emulation of VsTopK (estimate_cuda.cu) against a direct evaluation of its rule (the k largest order keys,
// -0 = +0, ties to the smaller index, ascending): random rows with many exact ties, zeros of both signs, few
// distinct values, k from 1 to n, begin > 0.
#include <cstdio>
#include <random>

#include "topk_extracted.h"

using namespace tessera::attn::gpu;

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 150;
  std::mt19937 rng(777);
  int bad = 0;
  for (int c = 0; c < cases; ++c) {
    const int n_all = 1 + int(rng() % 6000);
    const int begin = int(rng() % std::min(n_all, 40));
    const int mode = int(rng() % 4);
    std::vector<float> row(static_cast<size_t>(n_all));
    for (float& x : row) {
      if (mode == 0) x = float(rng() % 7) * 0.25f;                       // few values, many ties
      else if (mode == 1) x = (rng() % 2 ? -0.0f : 0.0f) + float(rng() % 3 == 0) * std::ldexp(1.0f, -int(rng() % 30));
      else if (mode == 2) x = std::ldexp(float(rng() % 1000 + 1), -int(rng() % 40));
      else x = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    }
    const int n = n_all - begin;
    int k = int(rng() % (n + 2));
    if (rng() % 5 == 0) k = n - int(rng() % 3);
    std::vector<int32_t> out(static_cast<size_t>(n) + 2, -1);
    dim3 b, d;
    d.x = unsigned(kTopKThreads);
    emu::run_block(b, d, [&] {
      static VsTopK::Storage st;
      VsTopK::select(row.data(), begin, n_all, k, out.data(), st);
    });
    const int kk = std::max(0, std::min(k, n));
    std::vector<int> idx(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) idx[size_t(i)] = begin + i;
    std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) {
      return detail::order_key(row[size_t(x)]) > detail::order_key(row[size_t(y)]);
    });
    std::vector<int> want(idx.begin(), idx.begin() + kk);
    std::sort(want.begin(), want.end());
    bool ok = out[size_t(kk)] == -1;
    for (int i = 0; ok && i < kk; ++i) ok = out[size_t(i)] == want[size_t(i)];
    if (!ok && bad++ < 5) std::printf("case %d: n %d begin %d k %d mode %d differs\n", c, n_all, begin, k, mode);
  }
  std::printf("vs top-k: %d of %d rows differ\n", bad, cases);
  return bad == 0 ? 0 : 1;
}
