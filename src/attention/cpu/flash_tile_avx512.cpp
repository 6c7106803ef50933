// The query-tile kernel for AVX-512 (this file is compiled with -mavx512f/bw/vl/dq; callers check the CPU).
// GCC 12's AVX-512 intrinsic headers initialise their "undefined" operands from themselves and then warn
// about it (-Wuninitialized) once inlined; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "attention/cpu/flash_tile.h"

#if defined(__AVX512F__) && defined(__FMA__)

#include <immintrin.h>

#include "attention/cpu/flash_tile_impl.h"
#include "attention/cpu/vector_ops.h"

namespace tessera::attn::cpu_detail {
namespace {

// 64 query rows = 4 zmm. QK^T: 6 keys x 64 rows = 24 accumulators; PV: 6 dims x 64 rows = 24 accumulators.
using Avx512 = TilePolicy<Avx512Ops, 4, 6, 6>;

}  // namespace
}  // namespace tessera::attn::cpu_detail

namespace tessera::attn::cpu_detail {

void run_tile_avx512(const TileJob& job, float* scratch) {
  run_tile_flushing_denormals<Avx512>(job, scratch);
}

}  // namespace tessera::attn::cpu_detail

#else

namespace tessera::attn::cpu_detail {
// Built without AVX-512 support: never selected (see kernel_isa.cpp), kept so the symbol exists.
void run_tile_avx512(const TileJob& job, float* scratch) {
  run_tile_baseline(job, scratch);
}
}  // namespace tessera::attn::cpu_detail

#endif
