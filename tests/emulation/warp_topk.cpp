// WarpTopK (block_topk.cuh) on random rows against a sort, under the host emulation (shim.h): ties (few
// values, many equal keys at the threshold, more than kCap equal keys), NaN, +-0, infinities, random bit
// patterns, Gaussian-like and shifted rows, one large value, rows from registers (n <= 2048) and from memory,
// k = 1, small, 99, around kHintGroups / kCap, n - 1.
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/block_topk.cuh"

using namespace tessera::attn::gpu;
int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 700;
  std::mt19937 rng(1);
  int fails = 0;
  for (int trial = 0; trial < trials; ++trial) {
    int n = 2 + rng() % (trial < 100 ? 60 : (trial < 200 ? 300 : (trial < 500 ? 2100 : 5000)));
    if (trial % 13 == 0) n = 2048 + int(rng() % 3) - 1;
    int k = 1 + rng() % (n - 1);
    if (trial % 3 == 0) k = std::min(n - 1, 99);
    if (trial % 7 == 0) k = n - 1;
    if (trial % 11 == 0) k = 1;
    if (trial % 17 == 0) k = std::min(n - 1, 127 + int(rng() % 3));
    if (trial % 19 == 0) k = std::min(n - 1, 255 + int(rng() % 3));
    std::vector<float> row(n);
    const int mode = trial % 9;
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    for (auto& x : row) {
      if (mode == 0) x = float(int(rng() % 5)) * 0.01f - 3.f;
      else if (mode == 1) x = float(int(rng() % 100000)) * 0.01f - 3.f;
      else if (mode == 2) { const float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 1.f}; x = sp[rng() % 9]; }
      else if (mode == 3) { uint32_t u = rng(); std::memcpy(&x, &u, 4); }
      else if (mode == 4) x = 1.0f + float(rng() % 3) * 1e-7f;
      else if (mode == 5) x = gauss(rng);
      else if (mode == 6) x = 20.0f + 0.01f * gauss(rng);
      else if (mode == 7) x = rng() % 4 ? 0.5f : gauss(rng);  // > kCap keys equal to the threshold
      else { uint32_t u = 0xffffffffu - rng() % 3; std::memcpy(&x, &u, 4); if (rng() % 2) x = -0.0f; }  // keys 0, 1, 2
    }
    if (trial % 23 == 0) row[rng() % n] = 1e30f;
    std::vector<int32_t> out(k + 1, -1);
    emu::run_block(dim3{0,0,0}, dim3{32,1,1}, [&] {
      static uint32_t buf[detail::WarpTopK<64>::kBufWords];
      if (n <= 2048) detail::WarpTopK<64>::select<true>(row.data(), n, k, out.data(), buf);
      else detail::WarpTopK<64>::select<false>(row.data(), n, k, out.data(), buf);
    });
    std::vector<std::pair<uint32_t,int>> r;
    for (int i = 0; i < n; ++i) r.push_back({detail::order_key(row[i]), i});
    std::sort(r.begin(), r.end(), [](auto& a, auto& b){ return a.first != b.first ? a.first > b.first : a.second < b.second; });
    std::vector<int32_t> want; for (int i = 0; i < k; ++i) want.push_back(r[i].second);
    std::sort(want.begin(), want.end());
    want.push_back(-1);  // nothing written past k
    if (want != out) { ++fails; if (fails < 4) { printf("trial %d mode %d n %d k %d: got", trial, mode, n, k); for (int i = 0; i < std::min(k, 12); ++i) printf(" %d", out[i]); printf(" | want"); for (int i = 0; i < std::min(k,12); ++i) printf(" %d", want[i]); printf("\n"); } }
  }
  printf("WarpTopK: %d of %d random rows wrong\n", fails, trials);
  return fails != 0;
}
