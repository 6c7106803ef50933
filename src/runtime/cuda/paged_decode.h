// tessera/runtime/cuda/paged_decode.h — the kernels of batched decode over the paged KV cache (bf16).
//
// Storage (runtime/paged_kv.h): K and V pools [num_blocks, block_tokens, head_dim]; block tables on the device as
// [slots, layers * kv_heads, max_blocks] int32 (logical block -> physical id; a sequence occupies one slot);
// decode views [slots, layers * q_heads, 3] int32 (sink, window, horizon; "unbounded" clamped to INT32_MAX).
//
// paged_decode_attention (flash-decoding on tensor cores): the keys a row's GQA group sees (the union of its heads'
// views: [lo, A1) and [B0, len), walked as one compacted index) are cut into `splits` contiguous pieces, one warp
// each; a CTA is four warps (pieces) of one (row, kv head), sharing the group's query heads as the rows of a 16-row
// mma tile (the other rows zero), so K and V are read once per group. A warp walks its piece in 16-key tiles that
// cp.async brings into its own pipeline stages of shared memory (each key looked up in the block table, so tiles may
// cross blocks) while the tile before is multiplied: S = Q K^T and O += P V with mma.sync m16n8k16 (bf16 inputs, f32
// accumulators; P as two bf16 terms, hi + lo, so P V keeps ~16 bits of P), each head's own mask (its sink / window / horizon),
// an online softmax in f32; each warp writes its piece's partial output and log-sum-exp, and a merge kernel combines
// the pieces into bf16. Head dims 64, 128 and 256; GQA groups of up to 8 query heads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

struct PagedDecodeArgs {
  const bf16* q = nullptr;  // [rows, q_heads * head_dim] (row stride q_stride elements)
  int64_t q_stride = 0;
  const bf16* k_pool = nullptr;
  const bf16* v_pool = nullptr;
  const int32_t* tables = nullptr;  // [slots, layers * kv_heads, max_blocks]
  const int32_t* views = nullptr;   // [slots, layers * q_heads, 3]
  const int32_t* row_slot = nullptr;  // [rows]
  const int32_t* row_len = nullptr;   // [rows]: keys of the row (its position + 1)
  int32_t rows = 0, layer = 0, num_layers = 0;
  int32_t q_heads = 0, kv_heads = 0, head_dim = 0, block_tokens = 0, max_blocks = 0;
  float scale = 0;
  int32_t splits = 1;
  float* o_part = nullptr;    // [rows, q_heads, splits, head_dim] scratch
  float* lse_part = nullptr;  // [rows, q_heads, splits] scratch
  bf16* out = nullptr;        // [rows, q_heads * head_dim]
};

// The fewest keys a piece of a row gets (paged_decode_splits; the kernel cuts each row into at most its keys / this).
inline constexpr int64_t kPagedDecodeMinPieceKeys = 64;

// How many splits (pieces, one warp each) for `rows` rows whose longest sees `max_keys` keys, on `sms` multiprocessors.
int32_t paged_decode_splits(int32_t rows, int32_t kv_heads, int64_t max_keys, int32_t sms);

void paged_decode_attention(const PagedDecodeArgs& args, cudaStream_t stream);

// For every row r and kv head h: writes k_new / v_new [rows, kv_heads * head_dim] (rows ld elements apart) into block
// blocks[(r * num_layers + layer) * kv_heads + h] at in-block row pos[r] % block_tokens (blocks < 0: skipped).
void paged_append_kv(const bf16* k_new, const bf16* v_new, int64_t ld, int32_t rows, int32_t kv_heads, int32_t head_dim,
                     const int32_t* blocks, int32_t layer, int32_t num_layers, const int32_t* pos,
                     int32_t block_tokens, bf16* k_pool, bf16* v_pool, cudaStream_t stream);

// Copies rows between the staging cache and blocks: entry e = (layer, kv_head, logical block, physical block) in
// `entries` ([count, 4]); rows [b * block_tokens, min((b + 1) * block_tokens, len)) of that head of the staging
// cache (layer l's K at k_layers[l], rows of row_elements = kv_heads * head_dim), into the blocks (kToPages: a
// prefill's end) or out of them (kFromPages: a cached prefix staged for the rest of its prompt).
enum class PageCopy { kToPages, kFromPages };
void paged_copy(const int32_t* entries, int32_t count, bf16* const* k_layers, bf16* const* v_layers,
                int64_t row_elements, int32_t head_dim, int32_t block_tokens, int32_t len, bf16* k_pool, bf16* v_pool,
                PageCopy direction, cudaStream_t stream);

// RoPE tables at explicit positions: cos/sin [n, half] for positions pos[0..n) (device ints).
void rope_tables_at(const float* inv_freq, int half, const int32_t* pos, int64_t n, float* cos, float* sin,
                    cudaStream_t stream);

}  // namespace tessera::runtime::gpu
