// tessera/attention/cuda/hopper/config.cuh — the one configuration of the Hopper prefill kernel (sm_90a) and its
// shared-memory layout (device code; the kernel is composed in hopper/prefill_kernel.cuh).
//
// 384 threads in three warpgroups: warpgroup 0's first warp is the producer (hopper/producer.cuh; its other three
// warps leave at once), warpgroups 1 and 2 the consumers (hopper/consumer.cuh), each owning 64 of the query tile's
// 128 rows. head_dim 128, query tile 128, key tiles of 64 (the plan's unit, work_plan.h) in 6 pipeline stages; a
// consumer step takes two stages at once (128 keys: the "pair" step), so K tiles of stages 2p and 2p + 1 form one
// [2 halves][128 rows] operand. Q is read into registers at an item's start, so one Q buffer suffices.
//
// This is the measured fastest of the 13 variants the kernel had until issue 15 (docs/PERF.md, "CUDA wing
// restructured", "The variants that left the product": the TMA ping-pong pair-step kernel with the row maxima as a
// tree, H200 ninth run).
#pragma once

#include <cstdint>

#include "attention/cuda/hopper/wgmma.cuh"
#include "attention/cuda/mma_sm80.cuh"
#include "attention/cuda/work_plan.h"

namespace tessera::attn::gpu::detail {

struct HopperConfig {
  static constexpr int D = 128;
  static constexpr int BM = 128;
  static constexpr int BN = kPrefillKeyTile;  // 64 keys per stage
  static constexpr int kStages = 6;
  static constexpr int kThreads = 384;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // Registers per thread after setmaxnreg. setmaxnreg moves registers within the CTA's launch allocation
  // (384 x 168 = 64512), not the SM's 65536: 128 x 64 + 256 x 224 = 65536 compiled cleanly and hung in
  // setmaxnreg.inc on an H200 (the consumers waited for registers that never came).
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "setmaxnreg within the launch allocation");
  // Lazy rescaling threshold of the online softmax, log2 units (consumer.cuh).
  static constexpr int kRescaleLog2 = 8;
  // The N-major V descriptor of P V (hopper/wgmma.cuh): the two 64-column halves of a V tile 8192 bytes apart (the
  // leading byte offset), 8-key groups 1024 bytes apart (the stride byte offset); passed to the kernel in
  // PrefillParams::pv_lbo / pv_sbo (see there why).
  static constexpr uint32_t kPvLbo = 8192, kPvSbo = 1024;

  static constexpr uint32_t kQBytes = BM * D * 2;   // 32 KB
  static constexpr uint32_t kKvBytes = BN * D * 2;  // 16 KB per K (or V) stage
  static constexpr uint32_t kKOffset = kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKvBytes;
  static constexpr uint32_t kKeysOffset = kVOffset + kStages * kKvBytes;
  static constexpr uint32_t kMetaOffset = kKeysOffset + kStages * BN * 4;  // int4 per stage
  static constexpr uint32_t kBarOffset = kMetaOffset + kStages * 16;       // full[S], empty[S], qfull, qempty
  static constexpr uint32_t kPinOffset = kBarOffset + (2 * kStages + 2) * 8;
  static constexpr int kPinFloats = 8;  // the consumers' softmax pins, one per consumer warp (consumer.cuh)
  static constexpr size_t kSmemBytes = 1024 + kPinOffset + kPinFloats * 4;  // + alignment slack
  static_assert(kStages % 2 == 0, "pair steps take stages 2p and 2p + 1");

  // Stage descriptor flags (meta[s].z). kFlagCopied: the tile's K/V were written by cp.async (the generic proxy),
  // so the consumers need a proxy fence before their wgmma reads them; TMA-written tiles (the async proxy, like
  // wgmma) do not. kFlagSkip: an empty stage that puts the next item's first tile on an even stage.
  static constexpr int kFlagMasked = 1, kFlagLast = 2, kFlagEnd = 4, kFlagCopied = 8, kFlagSkip = 16;
};

// Shared-memory addresses (HopperConfig offsets from a 1024-aligned base).
struct HopperSmem {
  using Cfg = HopperConfig;
  uint32_t sQ, sK, sV, bar;
  int* keys;   // [kStages][BN]: each K/V row's key position (kAbsentKey for absent rows)
  int4* meta;  // per stage: item, key count, flags, -1
  float* pin;  // [8], one per consumer warp
  __device__ __forceinline__ explicit HopperSmem(unsigned char* smem_raw) {
    const uint32_t raw_addr = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    sQ = smem_addr(smem);
    sK = sQ + Cfg::kKOffset;
    sV = sQ + Cfg::kVOffset;
    bar = sQ + Cfg::kBarOffset;
    keys = reinterpret_cast<int*>(smem + Cfg::kKeysOffset);
    meta = reinterpret_cast<int4*>(smem + Cfg::kMetaOffset);
    pin = reinterpret_cast<float*>(smem + Cfg::kPinOffset);
  }
  // Half h (64 of the 128 columns) of stage s's K tile, in the pair layout [2][128 rows][128 B] per stage pair
  // with stage 2p + 1's rows after stage 2p's.
  __device__ __forceinline__ uint32_t k_half(int s, int h) const {
    return sK + (s / 2) * 2 * Cfg::kKvBytes + h * (2 * Cfg::BN * 128) + (s % 2) * (Cfg::BN * 128);
  }
  __device__ __forceinline__ uint32_t full(int s) const { return bar + 8u * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar + 8u * (Cfg::kStages + s); }
  __device__ __forceinline__ uint32_t qfull() const { return bar + 8u * (2 * Cfg::kStages); }
  __device__ __forceinline__ uint32_t qempty() const { return bar + 8u * (2 * Cfg::kStages + 1); }
};

}  // namespace tessera::attn::gpu::detail
