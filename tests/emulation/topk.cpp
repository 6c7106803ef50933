// Host emulation of VsTopK (estimate_cuda.cu) against a direct evaluation of its rule (the k largest order keys,
// -0 = +0, ties to the smaller index, ascending): random rows with many exact ties, zeros of both signs, few
// distinct values, Gaussian-like scores, k from 0 to n + 1, begin > 0; then rows of 131072 scores (the 128K
// shape: k = 1000 and 6096, and k = 1, n - 1, ties at the threshold).
#include <cstdio>
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/estimate_kernels.cuh"

using namespace tessera::attn::gpu;

namespace {
int g_bad = 0, g_rows = 0;

void check_row(const std::vector<float>& row, int begin, int k, const char* what) {
  const int n_all = int(row.size()), n = n_all - begin;
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
  ++g_rows;
  if (!ok && g_bad++ < 5) std::printf("%s: n %d begin %d k %d differs\n", what, n_all, begin, k);
}
}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 150;
  const int big = argc > 2 ? std::atoi(argv[2]) : 6;
  std::mt19937 rng(777);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (int c = 0; c < cases; ++c) {
    const int n_all = 1 + int(rng() % (c % 3 == 0 ? 40 : 6000));
    const int begin = int(rng() % std::min(n_all, 40));
    const int mode = int(rng() % 5);
    std::vector<float> row(static_cast<size_t>(n_all));
    for (float& x : row) {
      if (mode == 0) x = float(rng() % 7) * 0.25f;                       // few values, many ties
      else if (mode == 1) x = (rng() % 2 ? -0.0f : 0.0f) + float(rng() % 3 == 0) * std::ldexp(1.0f, -int(rng() % 30));
      else if (mode == 2) x = std::ldexp(float(rng() % 1000 + 1), -int(rng() % 40));
      else if (mode == 3) x = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      else x = gauss(rng);
    }
    const int n = n_all - begin;
    int k = int(rng() % (n + 2));
    if (rng() % 5 == 0) k = n - int(rng() % 3);
    if (rng() % 7 == 0) k = int(rng() % 2);
    check_row(row, begin, k, "random row");
  }
  // The 128K shape: 131072 scores (positive column / diagonal sums), k = 1000 / 6096 / 1 / n - 1.
  for (int c = 0; c < big; ++c) {
    std::vector<float> row(131072);
    for (float& x : row) {
      const float g = gauss(rng);
      x = c % 3 == 2 ? (rng() % 8 ? 0.25f : std::fabs(g)) : std::exp(2.0f * g) * 1e-3f;  // c % 3 == 2: ties
    }
    const int ks[] = {1000, 6096, 1, 131071 - c};
    const int begin = c % 2 ? int(rng() % 64) : 0;
    check_row(row, begin, ks[c % 4], "131072 scores");
  }
  std::printf("vs top-k: %d of %d rows differ\n", g_bad, g_rows);
  return g_bad == 0 ? 0 : 1;
}
