// tessera/attention/cpu/paged_decode.h — decode attention of a GQA group over keys kept in blocks (the paged
// KV store's reader, runtime/batch_forward.h: paged_decode_attention_cpu).
//
// One call: `heads` consecutive query heads (one decode row each) that see the same keys, the keys given as
// spans of consecutive rows (a paged block's part in the view), K and V rows of head_dim elements in f32,
// bf16 or f16. Each key and value is read once for all the heads: converted to f32 in registers as it is
// loaded (F16C / AVX-512's vcvtph2ps, a shift for bf16) and multiplied with every head's query while it is
// there, 16 (AVX-512) or 8 (AVX2) keys at a time with their dot products summed across lanes together (a
// transpose-and-add tree: no horizontal sum per key); online softmax once per chunk of at most 64 keys (one
// rescale of the running sums per chunk), then the chunk's values, each loaded once, into every head's
// accumulator.
//
// Three paths, chosen at run time: AVX-512 (F, BW, VL, DQ; head_dim a multiple of 16), AVX2 + FMA + F16C
// (head_dim a multiple of 8), and the portable scalar twin (any head_dim; the others fall back to it for dims
// they do not take). They agree up to the order of the f32 sums (tests/paged_decode_test.cpp: each against an
// f64 reference).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "core/dtype.h"

namespace tessera::attn {

enum class PagedIsa : uint8_t { Portable, Avx2, Avx512 };

// `n` consecutive rows of K and V (head_dim elements each, the job's element type): key j at k + j *
// head_dim.
struct KeySpan {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t n = 0;
};

struct PagedDecodeJob {
  const float* q = nullptr;  // [heads, head_dim]: head i's query at q + i * head_dim
  float* out = nullptr;      // [heads, head_dim]: softmax(scale * q K^T) V; zeros when the spans hold no key
  int32_t heads = 1;         // >= 1 (groups above 8 heads go 8 at a time)
  int32_t head_dim = 0;
  DType elem = DType::F32;  // of K and V: F32, BF16 or F16
  float scale = 1;
  std::span<const KeySpan> spans;
};

bool paged_decode_isa_available(PagedIsa isa);  // compiled in and supported by this CPU
// The path run by paged_decode(job): TESSERA_PAGED_DECODE_ISA (portable, avx2, avx512; read once) when set,
// else the best this CPU has (AVX2 when set_cpu_kernel(CpuKernel::Baseline) forces the attention executors'
// baseline). Throws tessera::Error for an unknown name or a path this CPU lacks.
PagedIsa paged_decode_isa();
std::string_view paged_isa_name(PagedIsa isa);  // "portable", "avx2", "avx512"

// Throws tessera::Error for a path this CPU lacks, an element type other than F32/BF16/F16, heads < 1 or
// head_dim < 1. A SIMD path given a head_dim it does not take runs the portable twin.
void paged_decode(const PagedDecodeJob& job, PagedIsa isa);
void paged_decode(const PagedDecodeJob& job);  // paged_decode_isa()

namespace cpu_detail {
// The instruction-set kernels (paged_decode_avx512.cpp, paged_decode_avx2.cpp): built_* say whether the build
// compiled them; the kernels take a validated job whose head_dim is a multiple of their width (16, 8).
bool paged_decode_avx512_built();
bool paged_decode_avx2_built();
void paged_decode_avx512(const PagedDecodeJob& job);
void paged_decode_avx2(const PagedDecodeJob& job);
}  // namespace cpu_detail

}  // namespace tessera::attn
