// tessera/runtime/cuda/paged_decode.h — the kernels of batched decode over the paged KV cache (bf16 or FP8 E4M3).
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
//
// FP8 KV (KVPrecision::kFp8, GpuBatchOptions::kv): the pools hold E4M3 codes, [num_blocks, block_tokens, head_dim]
// bytes each, and beside each a scale pool of f32 [num_blocks, block_tokens]: one scale per stored K row and one per
// V row (a block belongs to one layer and kv head, so a row is one (block, kv head, token)). A row is quantized alone
// with core/fp8.h's per-row convention: amax = max |x| over its head_dim values, scale = amax / 448,
// code = e4m3(x * (448 / amax)) (amax 0: scale 1), so its codes never depend on another row's (decode appends one row
// at a time; a cached prefix's blocks are shared read-only). The value of a stored element is code * scale.
// paged_append_kv and paged_copy(kToPages) quantize; paged_copy(kFromPages) dequantizes into the bf16 staging cache
// (code * scale rounded to bf16); paged_decode_attention brings the codes and the tile's scales in by cp.async (half
// the bytes of bf16), widens the codes to f16 in shared memory by integer operations (value * 2^-8, exact, subnormals
// included), multiplies on the tensor cores in f16 (Q converted to f16: exact for |q| <= 65504, saturated beyond), and
// applies the scales (times 2^8) in f32 where they are per key: S = (Q . K_codes) * k_scale and P * v_scale before
// P V (P as two f16 terms, P * v_scale * 2^8 <= 65504: V rows of amax up to ~1e5; the softmax's sum takes P itself). The accumulation and the online softmax are the bf16
// kernel's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace tessera::runtime::gpu {

// The element type of the GPU's KV blocks (GpuBatchOptions::kv; decode_bench --kv).
enum class KVPrecision { kBf16, kFp8 };
const char* kv_precision_name(KVPrecision p);  // "bf16", "fp8"
// "bf16" or "fp8"; anything else throws tessera::Error ("GPU KV type: expected bf16 or fp8, got 'f16'").
KVPrecision parse_kv_precision(const std::string& name);
// Bytes of one stored row of head_dim elements (K or V), its scale included.
inline int64_t kv_row_bytes(KVPrecision p, int64_t head_dim) {
  return p == KVPrecision::kFp8 ? head_dim + static_cast<int64_t>(sizeof(float)) : 2 * head_dim;
}

// The block pools: K and V (bf16 elements, or E4M3 codes) and, for FP8, the rows' scales.
struct PagedPools {
  KVPrecision precision = KVPrecision::kBf16;
  void* k = nullptr;
  void* v = nullptr;
  float* k_scale = nullptr;  // [num_blocks, block_tokens]: FP8 only
  float* v_scale = nullptr;
};

struct PagedDecodeArgs {
  const bf16* q = nullptr;  // [rows, q_heads * head_dim] (row stride q_stride elements)
  int64_t q_stride = 0;
  const void* k_pool = nullptr;  // bf16 elements, or E4M3 codes (kv == kFp8)
  const void* v_pool = nullptr;
  KVPrecision kv = KVPrecision::kBf16;
  const float* k_scale = nullptr;  // FP8: [num_blocks, block_tokens] each
  const float* v_scale = nullptr;
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
// blocks[(r * num_layers + layer) * kv_heads + h] at in-block row pos[r] % block_tokens (blocks < 0: skipped);
// FP8 pools: each row quantized with its own scale (above).
void paged_append_kv(const bf16* k_new, const bf16* v_new, int64_t ld, int32_t rows, int32_t kv_heads, int32_t head_dim,
                     const int32_t* blocks, int32_t layer, int32_t num_layers, const int32_t* pos,
                     int32_t block_tokens, const PagedPools& pools, cudaStream_t stream);

// Copies rows between the staging cache and blocks: entry e = (layer, kv_head, logical block, physical block) in
// `entries` ([count, 4]); rows [b * block_tokens, min((b + 1) * block_tokens, len)) of that head of the staging
// cache (layer l's K at k_layers[l], rows of row_elements = kv_heads * head_dim), into the blocks (kToPages: a
// prefill's end) or out of them (kFromPages: a cached prefix staged for the rest of its prompt). FP8 pools: rows
// quantized on the way in, dequantized (code * scale, rounded to bf16) on the way out.
enum class PageCopy { kToPages, kFromPages };
void paged_copy(const int32_t* entries, int32_t count, bf16* const* k_layers, bf16* const* v_layers,
                int64_t row_elements, int32_t head_dim, int32_t block_tokens, int32_t len, const PagedPools& pools,
                PageCopy direction, cudaStream_t stream);

// Fills `rows` rows of head_dim E4M3 codes (codes [rows, head_dim]) and their scales with pseudo-random values whose
// magnitude is below `scale` (benchmarks: decode_bench's FP8 pools; GpuBatchBackend::fill_random).
void fill_random_fp8(uint8_t* codes, float* scales, int64_t rows, int32_t head_dim, uint64_t seed, float scale,
                     cudaStream_t stream);

// RoPE tables at explicit positions: cos/sin [n, half] for positions pos[0..n) (device ints).
void rope_tables_at(const float* inv_freq, int half, const int32_t* pos, int64_t n, float* cos, float* sin,
                    cudaStream_t stream);

}  // namespace tessera::runtime::gpu
