// Host emulation of the CUDA execution model for the device code the tests of this folder include (the real
// headers: lower_kernels.cuh, estimate_kernels.cuh, block_topk.cuh), compiled by the host compiler without a
// CUDA toolkit. Every lane is a fiber of one CPU thread; a block runs to completion before the
// next; warp intrinsics and barriers switch fibers, so a read-modify-write between them is atomic. Dynamic
// shared memory is one arena whose offsets are the shared addresses (cp.async a copy into it, ldmatrix reads
// it: shim_include/attention/cuda/mma_sm80.cuh). It catches logic and indexing errors, not memory-model ones
// (racecheck on the device does those).
//
// Include this first. shim_include/ (first on the include path) holds the stand-ins of the CUDA headers
// (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h, cub/block/block_scan.cuh) and of mma_sm80.cuh's PTX functions.
// TESSERA_EMULATION selects, in the real headers, the few emulated replacements of PTX and dynamic shared
// memory.
#pragma once
#define TESSERA_EMULATION 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct int4 {
  int x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) {
  return {x, y};
}

inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __clz(unsigned x) {
  return x == 0 ? 32 : __builtin_clz(x);
}
inline int __ffs(unsigned x) {
  return x == 0 ? 0 : __builtin_ctz(x) + 1;
}
inline int min(int a, int b) {
  return a < b ? a : b;
}
inline int max(int a, int b) {
  return a > b ? a : b;
}

namespace emu {
// Context switches: on x86-64 by the few instructions below (glibc's swapcontext makes a system call for the
// signal mask at every switch, which took half the run time); elsewhere by ucontext.
#if defined(__x86_64__)
extern "C" void tessera_emu_switch(void** save_sp, void* to_sp);
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack and its stack pointer
// in *save_sp, then restores those of to_sp's stack and returns there.
asm(R"(
  .text
  .weak tessera_emu_switch
  .type tessera_emu_switch, @function
tessera_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tessera_emu_switch, .-tessera_emu_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) {
  tessera_emu_switch(&from.sp, to.sp);
}
// A context that starts entry() (which must never return) on the stack [stack, stack + bytes).
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                  // entry()'s return address (never used): rsp % 16 == 8 there
  *--sp = reinterpret_cast<uint64_t>(entry);  // where tessera_emu_switch returns
  for (int i = 0; i < 6; ++i) *--sp = 0;      // rbp, rbx, r12 .. r15
  uint32_t mxcsr;
  uint16_t fcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fcw));
  *--sp = uint64_t{mxcsr} | uint64_t{fcw} << 32;
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
  Context ctx;
  std::unique_ptr<char[]> stack;  // kept from block to block (allocated, not touched, once)
  dim3 tid;
  bool done = false;
  int warp = 0, lane = 0;
};
constexpr size_t kStackBytes = size_t{1} << 19;
struct Group {
  int active = 0, arrived = 0;
  long gen = 0;
  uint64_t slot[32];
};
inline std::vector<Fiber>& fibers() {
  static std::vector<Fiber> f;
  return f;
}
inline Context& sched() {
  static Context s;
  return s;
}
inline int& cur_index() {
  static int i = 0;
  return i;
}
inline Fiber* cur() {
  return &fibers()[static_cast<size_t>(cur_index())];
}
inline std::vector<Group>& warps() {
  static std::vector<Group> w;
  return w;
}
inline Group& block() {
  static Group b;
  return b;
}
// Named barriers 1..15 (bar.sync id, count): the count of the first arrival of a block sets the group's size.
inline Group* named() {
  static Group n[16];
  return n;
}
inline dim3& gblock() {
  static dim3 b;
  return b;
}
inline dim3& gdim() {
  static dim3 b;
  return b;
}
inline std::function<void()>& body() {
  static std::function<void()> f;
  return f;
}
// Dynamic shared memory of the running block (its shared addresses are offsets from here).
constexpr size_t kArenaBytes = 256 * 1024;
inline unsigned char* dynamic_smem() {
  alignas(1024) static unsigned char a[kArenaBytes];
  return a;
}
inline void yield() {
  switch_context(cur()->ctx, sched());
}
inline void barrier(Group& g) {
  const long gen = g.gen;
  if (++g.arrived == g.active) {
    g.arrived = 0;
    ++g.gen;
    return;
  }
  while (g.gen == gen) yield();
}
inline void named_barrier(int id, int count) {
  Group& g = named()[id];
  if (g.active == 0) g.active = count;
  barrier(g);
}
inline void trampoline() {
  body()();
  Fiber* f = cur();
  f->done = true;
  // leave the groups
  Group& w = warps()[static_cast<size_t>(f->warp)];
  if (--w.active == w.arrived && w.arrived > 0) {
    w.arrived = 0;
    ++w.gen;
  }
  Group& b = block();
  if (--b.active == b.arrived && b.arrived > 0) {
    b.arrived = 0;
    ++b.gen;
  }
  switch_context(f->ctx, sched());
}
// Runs body for every thread of one block.
inline void run_block(dim3 grid_block, dim3 block_dim, std::function<void()> f) {
  gblock() = grid_block;
  gdim() = block_dim;
  body() = std::move(f);
  const int n = int(block_dim.x);
  auto& fs = fibers();
  if (fs.size() < size_t(n)) fs.resize(size_t(n));
  warps().assign(size_t((n + 31) / 32), Group{});
  block() = Group{};
  block().active = n;
  for (int i = 0; i < 16; ++i) named()[i] = Group{};
  for (int t = 0; t < n; ++t) {
    Fiber& fb = fs[size_t(t)];
    fb.tid = dim3{};
    fb.tid.x = unsigned(t);
    fb.done = false;
    fb.warp = t / 32;
    fb.lane = t % 32;
    warps()[size_t(fb.warp)].active++;
    if (!fb.stack) fb.stack.reset(new char[kStackBytes]);
    make_context(fb.ctx, fb.stack.get(), kStackBytes, trampoline);
  }
  long rounds = 0;
  for (;;) {
    bool any = false;
    for (int t = 0; t < n; ++t) {
      if (fs[size_t(t)].done) continue;
      any = true;
      cur_index() = t;
      switch_context(sched(), fs[size_t(t)].ctx);
    }
    if (!any) break;
    if (++rounds > 2000000000L) {
      std::fprintf(stderr, "deadlock?\n");
      std::abort();
    }
  }
}
// Every lane of the warp gives `mine` and gets lane src_lane's.
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

inline void __syncthreads() {
  emu::barrier(emu::block());
}
inline bool __syncthreads_or(bool p) {
  static bool flag[1024];
  flag[threadIdx.x] = p;
  __syncthreads();
  bool any = false;
  for (unsigned i = 0; i < blockDim.x; ++i) any = any || flag[i];
  __syncthreads();
  return any;
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::barrier(emu::warps()[size_t(emu::cur()->warp)]);
}

// Shuffles of any 4- or 8-byte type.
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) <= 8);
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
template <class T>
inline T __shfl_up_sync(unsigned m, T v, int d) {
  const int l = emu::cur()->lane;
  return __shfl_sync(m, v, l >= d ? l - d : l);
}
inline unsigned __ballot_sync(unsigned, bool p) {
  auto& w = emu::warps()[size_t(emu::cur()->warp)];
  w.slot[emu::cur()->lane] = p;
  emu::barrier(w);
  unsigned m = 0;
  for (int l = 0; l < 32; ++l)
    if (w.slot[l]) m |= 1u << l;
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
// Lanes switch only at warp intrinsics and barriers: a read-modify-write is atomic.
inline unsigned atomicAdd(unsigned* a, unsigned v) {
  const unsigned o = *a;
  *a = o + v;
  return o;
}
inline unsigned atomicOr(unsigned* a, unsigned v) {
  const unsigned o = *a;
  *a = o | v;
  return o;
}
// Shared addresses are offsets into the dynamic shared memory.
inline size_t __cvta_generic_to_shared(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < emu::dynamic_smem() || c > emu::dynamic_smem() + emu::kArenaBytes) {
    std::fprintf(stderr, "emulation: a shared address of memory outside the dynamic shared memory\n");
    std::abort();
  }
  return size_t(c - emu::dynamic_smem());
}
