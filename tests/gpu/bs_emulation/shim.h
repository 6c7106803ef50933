// Host emulation of the CUDA features the BS estimator kernels use (run.sh): lanes are fibers (ucontext) of one
// CPU thread; a block runs to completion before the next; warp intrinsics and barriers switch fibers.
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <type_traits>
#include <vector>
#include <algorithm>
#include <string>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { uint32_t x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct __nv_bfloat16 { unsigned short b; };
struct __half { unsigned short b; };
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return {b}; }
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = uint32_t(h.b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float __half2float(__half h) {
  const uint32_t s = (h.b >> 15) & 1, e = (h.b >> 10) & 31, m = h.b & 1023;
  float v;
  if (e == 0) v = std::ldexp(float(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(float(m | 1024), int(e) - 25);
  return s ? -v : v;
}
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 tid;
  bool done = false;
  int warp = 0, lane = 0;
};
struct Group { int active = 0, arrived = 0; long gen = 0; uint64_t slot[32]; };
inline std::vector<Fiber>& fibers() { static std::vector<Fiber> f; return f; }
inline ucontext_t& sched() { static ucontext_t s; return s; }
inline int& cur_index() { static int i = 0; return i; }
inline Fiber* cur() { return &fibers()[cur_index()]; }
inline std::vector<Group>& warps() { static std::vector<Group> w; return w; }
inline Group& block() { static Group b; return b; }
inline dim3& gblock() { static dim3 b; return b; }
inline dim3& gdim() { static dim3 b; return b; }
inline std::function<void()>& body() { static std::function<void()> f; return f; }
inline void yield() { swapcontext(&cur()->ctx, &sched()); }
inline void barrier(Group& g) {
  const long gen = g.gen;
  if (++g.arrived == g.active) { g.arrived = 0; ++g.gen; return; }
  while (g.gen == gen) yield();
}
inline void trampoline() {
  body()();
  Fiber* f = cur();
  f->done = true;
  // leave the groups
  Group& w = warps()[f->warp];
  if (--w.active == w.arrived && w.arrived > 0) { w.arrived = 0; ++w.gen; }
  Group& b = block();
  if (--b.active == b.arrived && b.arrived > 0) { b.arrived = 0; ++b.gen; }
  swapcontext(&f->ctx, &sched());
}
// Runs body for every thread of one block.
inline void run_block(dim3 grid_block, dim3 block_dim, std::function<void()> f) {
  gblock() = grid_block;
  gdim() = block_dim;
  body() = std::move(f);
  const int n = int(block_dim.x);
  auto& fs = fibers();
  fs.clear();
  fs.resize(size_t(n));
  warps().assign(size_t((n + 31) / 32), Group{});
  block() = Group{};
  block().active = n;
  for (int t = 0; t < n; ++t) {
    Fiber& fb = fs[size_t(t)];
    fb.tid.x = unsigned(t);
    fb.warp = t / 32;
    fb.lane = t % 32;
    warps()[size_t(fb.warp)].active++;
    fb.stack.resize(1 << 19);
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = fb.stack.data();
    fb.ctx.uc_stack.ss_size = fb.stack.size();
    fb.ctx.uc_link = nullptr;
    makecontext(&fb.ctx, trampoline, 0);
  }
  long rounds = 0;
  for (;;) {
    bool any = false;
    for (int t = 0; t < n; ++t) {
      if (fs[size_t(t)].done) continue;
      any = true;
      cur_index() = t;
      swapcontext(&sched(), &fs[size_t(t)].ctx);
    }
    if (!any) break;
    if (++rounds > 2000000000L) { std::fprintf(stderr, "deadlock?\n"); std::abort(); }
  }
}
inline uint64_t exchange(uint64_t mine, int src_lane) {
  Group& w = warps()[size_t(cur()->warp)];
  w.slot[cur()->lane] = mine;
  barrier(w);
  const uint64_t v = w.slot[src_lane];
  barrier(w);
  return v;
}
}  // namespace emu

#define threadIdx (emu::cur()->tid)
#define blockIdx (emu::gblock())
#define blockDim (emu::gdim())

inline void __syncthreads() { emu::barrier(emu::block()); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::barrier(emu::warps()[size_t(emu::cur()->warp)]); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  uint32_t u; std::memcpy(&u, &v, 4);
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = u;
  emu::barrier(w);
  const uint32_t r = uint32_t(w.slot[emu::cur()->lane ^ mask]);
  emu::barrier(w);
  float f; std::memcpy(&f, &r, 4); return f;
}
inline unsigned __ballot_sync(unsigned, bool p) {
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = p;
  emu::barrier(w);
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) if (w.slot[l]) m |= 1u << l;
  emu::barrier(w);
  return m;
}
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = v;
  emu::barrier(w);
  unsigned s = 0;
  for (int l = 0; l < 32; ++l) s += unsigned(w.slot[l]);
  emu::barrier(w);
  return s;
}

inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = v;
  emu::barrier(w);
  unsigned s = 0;
  for (int l = 0; l < 32; ++l) s = std::max(s, unsigned(w.slot[l]));
  emu::barrier(w);
  return s;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = v;
  emu::barrier(w);
  unsigned s = ~0u;
  for (int l = 0; l < 32; ++l) s = std::min(s, unsigned(w.slot[l]));
  emu::barrier(w);
  return s;
}

namespace tessera::attn::gpu::detail {
inline uintptr_t smem_addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
inline void cp_async_16(uintptr_t dst, const void* src, bool valid) {
  if (valid) std::memcpy(reinterpret_cast<void*>(dst), src, 16);
  else std::memset(reinterpret_cast<void*>(dst), 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
}  // namespace tessera::attn::gpu::detail
