// tessera/attention/cuda/hopper/wgmma.cuh — Hopper (sm_90a) PTX building blocks of the prefill kernel (device
// code): warpgroup MMA, mbarriers, TMA, named barriers, setmaxnreg.
//
// wgmma.mma_async m64nNk16 with f32 accumulation: a warpgroup (4 consecutive warps, the first one's index a
// multiple of 4) computes a 64 x N tile. B (and A for the "ss" form) are read from shared memory through
// 64-bit matrix descriptors; the "rs" form (the only one the kernel uses) takes A from registers in the same per-warp layout as mma.sync's A
// fragment (warp w of the group owns rows 16w..16w+15). Accumulators follow mma.sync's C layout per 8-column
// block: d[4i + 0..1] = (row g, cols 8i + 2c..), d[4i + 2..3] = (row g + 8, same cols), g = lane / 4,
// c = lane % 4. So the f32 scores of Q K^T turn into the A operand of P V without any shuffle.
//
// Shared-memory layout of every tile (the 128-byte swizzle the descriptors name): a [rows][128] tile of
// 2-byte elements is stored as two halves [rows][64] (columns 0..63, then 64..127), each row 128 bytes,
// 16-byte chunk c of row r at chunk position c ^ (r % 8). Tiles start at 1024-byte aligned addresses (the
// swizzle pattern repeats every 8 rows = 1024 bytes and the hardware applies it to address bits).
//   K-major operand (Q as A, K as B of Q K^T): 8-row groups 1024 bytes apart (SBO); a k-step of 16 elements
//   advances the start address by 32 bytes inside the 128-byte row.
//   N-major operand (V as B of P V, transposed): along N, 64-column halves are `lbo` apart; along K, 8-row
//   groups `sbo` apart; a k-step of 16 keys advances the start by 2048 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tessera::attn::gpu::detail {

// Byte offset of (row, 16-byte chunk) in a [ROWS][128] tile in the swizzled two-half layout above.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (bytes), with the leading and stride
// byte offsets `lbo`, `sbo`.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32;
  d |= uint64_t{1} << 62;  // layout type 1: 128-byte swizzle
  return d;
}

// The descriptor of the operand `bytes` further on: only the start-address field (bits 0-13, address / 16)
// moves, and shared addresses stay below 2^18 bytes, so the field never carries into the reserved bits 14-15
// and a 32-bit add on the low word is exact. Building each k-step's descriptor this way costs one add instead
// of sw128_desc's masks, shifts and ORs (H200 profile: ~7 uniform-datapath instructions per wgmma, a quarter
// of the consumer's issued instructions).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (st.shared, cp.async) visible to the async proxy
// (wgmma operand reads); goes before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// mbarrier (shared-memory barrier objects, 8 bytes, 8-byte aligned) and the other pieces of a warp-specialized
// pipeline. A phase completes when `count` arrivals (init) have happened; waiters name the parity of the phase
// they wait for (a fresh barrier is in phase 0, and a wait for parity 1 returns at once: the convention for
// "empty" barriers, which start free).
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrive (release semantics: this thread's earlier shared-memory writes are visible to whoever waits).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrive once all of this thread's earlier cp.async copies have landed (the barrier's count includes it).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits (acquire) until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
// Arrive and add `bytes` to the transaction count the phase waits for (the TMA copies that complete_tx on it).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// TMA: the box of the 3-D tensor map `tmap` (a __grid_constant__ parameter's generic address) at coordinates
// (c0, c1, c2) into shared memory at `dst`, completing `bytes` of transaction count on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tmap, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrive on barrier `id` without waiting (counts toward a bar.sync of `threads` elsewhere).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Per-warpgroup register budget (all warps of the warpgroup execute it).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <class T>
struct Wgmma;

template <>
struct Wgmma<__nv_bfloat16> {
#define TESSERA_WGMMA_TYPE "bf16"
#include "attention/cuda/hopper/wgmma_ops.inc"
#undef TESSERA_WGMMA_TYPE
};

template <>
struct Wgmma<__half> {
#define TESSERA_WGMMA_TYPE "f16"
#include "attention/cuda/hopper/wgmma_ops.inc"
#undef TESSERA_WGMMA_TYPE
};

}  // namespace tessera::attn::gpu::detail
