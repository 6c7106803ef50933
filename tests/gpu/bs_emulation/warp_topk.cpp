// WarpTopK (block_topk.cuh) on random rows against a sort, under the host emulation (run.sh).
#include "bs_extracted.h"
#include <random>
using namespace tessera::attn::gpu;
int main() {
  std::mt19937 rng(1);
  int fails = 0;
  for (int trial = 0; trial < 400; ++trial) {
    int n = 2 + rng() % (trial < 100 ? 60 : (trial < 300 ? 2100 : 5000));
    int k = 1 + rng() % (n - 1);
    std::vector<float> row(n);
    const int mode = trial % 5;
    for (auto& x : row) {
      if (mode == 0) x = float(int(rng() % 5)) * 0.01f - 3.f;
      else if (mode == 1) x = float(int(rng() % 100000)) * 0.01f - 3.f;
      else if (mode == 2) { const float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 1.f}; x = sp[rng() % 9]; }
      else if (mode == 3) { uint32_t u = rng(); std::memcpy(&x, &u, 4); }
      else x = 1.0f + float(rng() % 3) * 1e-7f;
    }
    if (trial % 7 == 0) k = n - 1;
    if (trial % 11 == 0) k = 1;
    std::vector<int32_t> out(k, -1);
    emu::run_block(dim3{0,0,0}, dim3{32,1,1}, [&] {
      static uint32_t buf[32];
      if (n <= 2048) detail::WarpTopK<64>::select<true>(row.data(), n, k, out.data(), buf);
      else detail::WarpTopK<64>::select<false>(row.data(), n, k, out.data(), buf);
    });
    std::vector<std::pair<uint32_t,int>> r;
    for (int i = 0; i < n; ++i) r.push_back({detail::order_key(row[i]), i});
    std::sort(r.begin(), r.end(), [](auto& a, auto& b){ return a.first != b.first ? a.first > b.first : a.second < b.second; });
    std::vector<int32_t> want; for (int i = 0; i < k; ++i) want.push_back(r[i].second);
    std::sort(want.begin(), want.end());
    if (want != out) { ++fails; if (fails < 4) { printf("n %d k %d: got", n, k); for (int i = 0; i < std::min(k, 12); ++i) printf(" %d", out[i]); printf(" | want"); for (int i = 0; i < std::min(k,12); ++i) printf(" %d", want[i]); printf("\n"); } }
  }
  printf("WarpTopK: %d of 400 random rows wrong\n", fails);
  return fails != 0;
}
