// tessera/attention/cpu/flash_tile.h — internal: one query tile of the flash attention executor.
//
// The executors (dense_attention, sparse_attention) cut a call into work items of at most kTileRows query
// rows of one head, each with a list of key ranges and single key columns (already clipped to the item's last
// row), and hand every item to run_tile_*. One code path serves both: dense attention is the item with the
// single range [0, last row + 1).
//
// run_tile_* processes the keys in blocks of at most kKeyBlock: ranges block by block from their start, then
// columns gathered 64 at a time; online softmax across all blocks; the causal mask is applied only to blocks
// holding a key beyond the tile's first row, and a row-exact sliding window (job.window > 0) only to blocks
// holding a key below the tile's last row's window (the executors clip the keys to the first row's window,
// so only the blocks near that lower edge straddle it). Rows in lanes: scores are kept transposed
// (S^T[key][row]) so that the row max, sum and rescale are plain vertical vector ops and K and V are read in
// their natural token-major layout through broadcasts, without transposing them.
//
// Items of at most kFewRows rows (decode: one row per head) take a second path with head dims in lanes
// instead of rows: per key a vectorised dot product with each row's query, per row an online softmax and an
// axpy of the values, so a one-row item does 1/64 of a full tile's lane work.
//
// Not part of the public API: include only from src/attention/cpu.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/index/sparse_index.h"

namespace tessera::attn::cpu_detail {

inline constexpr int kTileRows = 64;  // query rows per work item
inline constexpr int kKeyBlock = 64;  // keys per softmax block
inline constexpr int kFewRows = 4;    // items of at most this many rows take the few-row (decode) path

// The element type of K or V: f32, or a 16-bit type converted to f32 per key block as it is read (a half-precision
// KV cache).
enum class KvElem : uint8_t { F32, BF16, F16 };

struct TileJob {
  // Element (row r, dim c) at q + r * q_rs + c * q_cs, in elements of the dtype (bf16 when q_bf16, else f32).
  const void* q = nullptr;
  int64_t q_rs = 0, q_cs = 0;
  // Key j (absolute position), dim c at k + j * k_rs + c * k_cs; the kv head's offset is already applied.
  const void* k = nullptr;
  int64_t k_rs = 0, k_cs = 0;
  const void* v = nullptr;
  int64_t v_rs = 0, v_cs = 0;
  bool q_bf16 = false;
  KvElem k_elem = KvElem::F32, v_elem = KvElem::F32;
  float* out = nullptr;  // f32, row r dim c at out + r * out_rs + c * out_cs
  int64_t out_rs = 0, out_cs = 0;
  float* lse = nullptr;  // f32, row r at lse + r * lse_rs; nullptr when absent
  int64_t lse_rs = 0;
  int32_t rows = 0;  // 1..kTileRows
  // Query heads of the item (consecutive, all reading this kv head); > 1 only when heads * rows <= kFewRows.
  // Head i's rows are at q + i * q_hs, out + i * out_hs and lse + i * lse_hs: a decode step reads K and V
  // once for its whole GQA group.
  int32_t heads = 1;
  int64_t q_hs = 0, out_hs = 0, lse_hs = 0;
  int32_t head_dim = 0;
  int32_t first_pos = 0;  // absolute position of row 0
  int32_t window = 0;     // > 0: key j is hidden from row r when first_pos + r - j >= window; 0: no window
  float scale = 1;
  // Sorted, disjoint, non-empty ranges within [0, first_pos + rows); ascending columns outside every range,
  // in the same bounds (with a window, within [first_pos - window + 1, first_pos + rows)). The caller
  // guarantees both (they come from a validated index).
  const KeyRange* ranges = nullptr;
  int32_t num_ranges = 0;
  const int32_t* columns = nullptr;
  int32_t num_columns = 0;
  // Paged keys and values (the batched engine's decode rows, few-row path only): when set, key j's row is at
  // k_blocks[j / block_tokens] + (j % block_tokens) * k_rs elements (v likewise), and k / v are unused.
  const void* const* k_blocks = nullptr;
  const void* const* v_blocks = nullptr;
  int32_t block_tokens = 0;
};

// Scratch (in floats, 64-byte aligned) one worker needs for run_tile_* at this head_dim.
constexpr size_t tile_scratch_floats(int head_dim) {
  const size_t d = static_cast<size_t>(head_dim);
  return 2 * d * kTileRows                             // Q^T (scaled), O^T
         + static_cast<size_t>(kKeyBlock) * kTileRows  // S^T / P^T
         + 3 * kTileRows                               // running max, running sum, rescale factors
         + 2 * static_cast<size_t>(kKeyBlock) * ((d + 15) / 16 * 16 + 16)  // packed K and V blocks
         + d * static_cast<size_t>(kKeyBlock) + d  // the few-row path's K^T and a row of zeros
         + 64;                                                             // slack
}

// Both write job.out (and job.lse). run_tile_avx512 requires a CPU with AVX-512F/BW/VL/DQ.
void run_tile_avx512(const TileJob& job, float* scratch);
void run_tile_baseline(const TileJob& job, float* scratch);  // AVX2 + FMA (the build's baseline ISA)

}  // namespace tessera::attn::cpu_detail
