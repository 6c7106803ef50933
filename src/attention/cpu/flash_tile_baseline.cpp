// The query-tile kernel for the build's baseline ISA: AVX2 + FMA on x86-64-v3, portable C++ elsewhere.
#include "attention/cpu/flash_tile.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "attention/cpu/flash_tile_impl.h"
#include "attention/cpu/vector_ops.h"

namespace tessera::attn::cpu_detail {
namespace {

// 16 ymm registers: a micro-kernel covers 16 rows (2 ymm) at a time; QK^T 4 keys x 2 = 8 accumulators,
// PV 4 dims x 2 = 8 accumulators.
using Avx2 = TilePolicy<Avx2Ops, 2, 4, 4>;
using Baseline = Avx2;

}  // namespace
}  // namespace tessera::attn::cpu_detail

#else

#include <cmath>

#include "attention/cpu/flash_tile_impl.h"

namespace tessera::attn::cpu_detail {
namespace {

// Plain C++ lanes for targets without AVX2; the compiler vectorises what it can.
struct Portable {
  struct reg {
    float x[8];
  };
  static constexpr int kWidth = 8;
  static constexpr int kRowVecs = 2;
  static constexpr int kQkKeys = 4;
  static constexpr int kPvDims = 4;
  template <class F>
  static reg map(F f) {
    reg r;
    for (int i = 0; i < 8; ++i) r.x[i] = f(i);
    return r;
  }
  static reg zero() { return set1(0); }
  static reg set1(float v) {
    return map([&](int) { return v; });
  }
  static reg load(const float* p) {
    return map([&](int i) { return p[i]; });
  }
  static void store(float* p, reg a) {
    for (int i = 0; i < 8; ++i) p[i] = a.x[i];
  }
  static reg fmadd(reg a, reg b, reg c) {
    return map([&](int i) { return a.x[i] * b.x[i] + c.x[i]; });
  }
  static reg add(reg a, reg b) {
    return map([&](int i) { return a.x[i] + b.x[i]; });
  }
  static reg sub(reg a, reg b) {
    return map([&](int i) { return a.x[i] - b.x[i]; });
  }
  static reg mul(reg a, reg b) {
    return map([&](int i) { return a.x[i] * b.x[i]; });
  }
  static reg max(reg a, reg b) {
    return map([&](int i) { return a.x[i] > b.x[i] ? a.x[i] : b.x[i]; });
  }
  static float reduce_add(reg a) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += a.x[i];
    return s;
  }
  static reg zero_if_neg_inf(reg a) {
    return map([&](int i) { return a.x[i] == -HUGE_VALF ? 0.0f : a.x[i]; });
  }
  static reg exp2(reg a) {
    return map([&](int i) { return a.x[i] <= -125.0f ? 0.0f : std::exp2(a.x[i]); });
  }
  static reg widen_bf16(const uint16_t* p) {
    return map([&](int i) { return bf16_bits_to_f32(p[i]); });
  }
  static reg widen_f16(const uint16_t* p) {
    return map([&](int i) { return f16_bits_to_f32(p[i]); });
  }
  static void transpose(const reg* x, float* dst, int64_t ld) {
    for (int i = 0; i < 8; ++i)
      for (int c = 0; c < 8; ++c) dst[c * ld + i] = x[i].x[c];
  }
};
using Baseline = Portable;

}  // namespace
}  // namespace tessera::attn::cpu_detail

#endif

namespace tessera::attn::cpu_detail {

void run_tile_baseline(const TileJob& job, float* scratch) {
  run_tile_flushing_denormals<Baseline>(job, scratch);
}

}  // namespace tessera::attn::cpu_detail
