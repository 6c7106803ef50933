// Stand-in for CUB's BlockScan (host emulation, ../../../shim.h): ExclusiveSum with the block total, in
// order.
#pragma once

#include "shim.h"

namespace cub {
template <class T, int N>
struct BlockScan {
  struct TempStorage {
    T v[N];
  };
  TempStorage& s;
  explicit BlockScan(TempStorage& st) : s(st) {}
  void ExclusiveSum(T in, T& out, T& total) {
    const int t = int(threadIdx.x);
    s.v[t] = in;
    __syncthreads();
    T acc = 0, all = 0;
    for (int i = 0; i < N; ++i) {
      if (i == t) acc = all;
      all += s.v[i];
    }
    out = acc;
    total = all;
    __syncthreads();
  }
};
}  // namespace cub
