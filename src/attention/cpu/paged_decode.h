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
  // A part of a split walk (the keys of one (row, KV head) cut across threads, merged by paged_decode_merge):
  // when set (both), out is left unnormalised, sum_j 2^(s_j - m) v_j, and part_max[i] / part_sum[i] get head
  // i's largest score m (base 2: scale * log2(e) * q.k) and sum_j 2^(s_j - m); -inf and 0 (out zeros) when
  // the spans hold no key. Null: out normalised (the single-pass path).
  float* part_max = nullptr;
  float* part_sum = nullptr;
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

// The log-sum-exp merge of `parts` partial results (PagedDecodeJob::part_max) of the same `heads` query heads
// over disjoint key sets: outs [parts][heads][head_dim] (unnormalised), maxes and sums [parts][heads] -> out
// [heads][head_dim] = sum_p 2^(m_p - M) outs_p / sum_p 2^(m_p - M) sums_p (M the largest m_p); zeros for a
// head no part saw a key of.
void paged_decode_merge(const float* outs, const float* maxes, const float* sums, int32_t parts, int32_t heads,
                        int32_t head_dim, float* out);

// How paged_decode_attention_cpu (runtime/batch_forward.h) spreads one layer's decode attention over a pool of
// `threads`: a work item (one row's KV head: its query heads over their keys) of `work` = keys x query heads x
// head_dim is cut into work / paged_split_min_work() parts of consecutive keys (each long enough to pay for its
// merge and its hand-out), at most 2 per thread (so a thread slowed by another process hands work to the other),
// at least 1; 1 when threads is 1 or the minimum is <= 0. It depends on the row alone, not on the rows batched
// with it: a row's result is the same bits alone or in a batch (on a pool of the same size).
int32_t paged_decode_parts(int64_t work, int threads);
// The smallest part's work (default kPagedSplitMinWork); <= 0 turns splitting off. Process-wide (tests and
// benchmarks change it); read on every call.
inline constexpr int64_t kPagedSplitMinWork = int64_t{1} << 17;
void set_paged_split_min_work(int64_t work);
int64_t paged_split_min_work();

// A decode row's attention in the prefill's order: `heads` query heads of one KV head (one row each, at position
// `pos`) over keys kept in blocks, through the query tile's few-row path (flash_tile.h) — per key one chain of fused
// multiply-adds over the head dims, softmax blocks of 64 keys at multiples of 64 from key 0, the weights added key
// after key — so the row's output is the same bits as the same row computed in any prefill chunk (a prefix cache
// keeps rows that decode steps wrote; issue 34). Keys [key_begin, pos] are walked from key_begin rounded down to a
// multiple of 64, keys below key_begin hidden (window > 0: key j hidden when pos - j >= window, as
// AttentionArgs::window; key_begin must then be max(0, pos - window + 1)). k_blocks / v_blocks: the block of key j
// at [j / block_tokens], rows of head_dim elements of `elem` (F32, BF16, F16); a block wholly below key_begin may
// point to zeros. Slower than paged_decode's walk (the keys are transposed per block: the order needs keys in
// lanes).
inline constexpr int32_t kPagedTileKeys = 64;  // the softmax block of paged_decode_in_prefill_order (the tile's)
struct PagedTileJob {
  const float* q = nullptr;  // [heads, head_dim]
  float* out = nullptr;      // [heads, head_dim]
  int32_t heads = 1;
  int32_t head_dim = 0;
  DType elem = DType::F32;
  float scale = 0;  // 0: 1 / sqrt(head_dim), as AttentionArgs::effective_scale
  int32_t pos = 0;
  int32_t key_begin = 0;
  int32_t window = 0;
  const void* const* k_blocks = nullptr;
  const void* const* v_blocks = nullptr;
  int32_t block_tokens = 0;
};
// Scratch floats (64-byte aligned) one call needs at this head_dim.
size_t paged_tile_scratch_floats(int32_t head_dim);
void paged_decode_in_prefill_order(const PagedTileJob& job, float* scratch);

namespace cpu_detail {
// The instruction-set kernels (paged_decode_avx512.cpp, paged_decode_avx2.cpp): built_* say whether the build
// compiled them; the kernels take a validated job whose head_dim is a multiple of their width (16, 8).
bool paged_decode_avx512_built();
bool paged_decode_avx2_built();
void paged_decode_avx512(const PagedDecodeJob& job);
void paged_decode_avx2(const PagedDecodeJob& job);
}  // namespace cpu_detail

}  // namespace tessera::attn
