// Extra emulation for the index build's kernels (on top of ../bs_emulation/shim.h): shuffles (and shuffles up)
// of any 4/8-byte type, __clz, __ffs, atomicAdd / atomicOr on unsigned, __syncthreads_or,
// cub::BlockScan<int, N>::ExclusiveSum.
#pragma once
#include "shim.h"

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  const uint64_t r = emu::exchange(u, src);
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}
template <class T>
inline T __shfl_xor_sync(unsigned m, T v, int mask) {
  return __shfl_sync(m, v, emu::cur()->lane ^ mask);
}
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline bool __syncthreads_or(bool p) {
  static bool flag[1024];
  flag[threadIdx.x] = p;
  __syncthreads();
  bool any = false;
  for (unsigned i = 0; i < blockDim.x; ++i) any = any || flag[i];
  __syncthreads();
  return any;
}
inline unsigned atomicAdd(unsigned* a, unsigned v) { const unsigned o = *a; *a = o + v; return o; }
template <class T>
inline T __shfl_up_sync(unsigned m, T v, int d) {
  const int l = emu::cur()->lane;
  return __shfl_sync(m, v, l >= d ? l - d : l);
}
// Lanes are fibers of one CPU thread switched only at warp intrinsics and barriers: a read-modify-write is atomic.
inline unsigned atomicOr(unsigned* a, unsigned v) { const unsigned o = *a; *a = o | v; return o; }
inline int __ffs(unsigned x) { return x == 0 ? 0 : __builtin_ctz(x) + 1; }
namespace cub {
template <class T, int N>
struct BlockScan {
  struct TempStorage { T v[N]; };
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
