// tessera/runtime/kv_cache.h — the per-layer key/value cache of one sequence on the CPU, in f32, bf16 or f16.
//
// Layer l holds K and V as [capacity, num_kv_heads, head_dim] row-major (token-major, the layout the attention
// executors read). Rows [0, length) are valid. In f32 the engine's products write a chunk's K/V rows straight into
// the cache (k(), v()); in bf16 or f16 the chunk's f32 rows are converted into it (write()), and the attention
// executors convert each block of 64 keys back to f32 as they read it (attention/cpu/flash_tile.h): half the bytes
// stored and read per token.
//
// Memory: each layer's K and V are anonymous mappings whose pages become resident only when rows are written, and
// which grow in place (mremap: the kernel moves the pages, nothing is copied), so the resident KV memory is the
// rows written, whatever the reserved capacity: a 4K prompt plus 32 decoded tokens holds 4,128 rows, not the 8,192
// that doubling a std::vector reached (with the old 4,096 alive during its copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "runtime/contiguous_kv.h"

namespace tessera::runtime {

// The element type of a CPU KV cache (EngineOptions::kv_type, --kv-type).
enum class KVType : uint8_t { F32, BF16, F16 };

std::string_view kv_type_name(KVType t);  // "f32", "bf16", "f16"
// "f32" | "bf16" | "f16" -> the type; anything else throws tessera::Error:
//   "--kv-type: expected f32, bf16 or f16, got 'fp8'"
KVType parse_kv_type(std::string_view text);
size_t kv_type_size(KVType t);  // bytes per element
// The type EngineOptions::kv_type starts as: set_default_kv_type() (the CLI's --kv-type), else the environment's
// TESSERA_KV_TYPE (f32, bf16, f16; anything else throws as parse_kv_type does), else f16 (half the KV bytes of f32,
// measured as fast or faster and within 0.2% of llama.cpp's perplexity: docs/cpu_kernels.md). The tests that compare
// with f32 references (transformers' logits within 1e-4) run with TESSERA_KV_TYPE=f32 (tests/CMakeLists.txt).
KVType default_kv_type();
void set_default_kv_type(KVType t);
DType kv_dtype(KVType t);

// n f32 values to bf16 (round to nearest even; NaN stays a quiet NaN) or f16 (round to nearest even, saturating:
// finite values and infinities beyond the f16 range become +-65504, so a cache never holds an infinity that the
// softmax would turn into NaN; NaN stays NaN). AVX2 + F16C where the build has them, the scalar twin otherwise;
// both give the same bits (tested over every half bit pattern and random floats).
void f32_to_half(const float* src, uint16_t* dst, int64_t n, KVType t);
void f32_to_half_scalar(const float* src, uint16_t* dst, int64_t n, KVType t);
// n bf16 or f16 values to f32 (exact).
void half_to_f32(const uint16_t* src, float* dst, int64_t n, KVType t);

// One anonymous mapping: zero pages until written, grown in place (mremap) without copying what was written.
class KVRegion {
 public:
  KVRegion() = default;
  ~KVRegion();
  KVRegion(KVRegion&& o) noexcept;
  KVRegion& operator=(KVRegion&& o) noexcept;
  KVRegion(const KVRegion&) = delete;
  KVRegion& operator=(const KVRegion&) = delete;
  // Grows the mapping to `bytes` (rounded up to whole pages), keeping its contents. Returns false when the kernel
  // refuses (out of address space or commit limit); the mapping is then unchanged.
  bool grow(size_t bytes);
  std::byte* bytes() const { return base_; }
  float* data() const { return reinterpret_cast<float*>(base_); }
  size_t size() const { return size_; }

 private:
  std::byte* base_ = nullptr;
  size_t size_ = 0;
};

class KVCache : public ContiguousKVLayers<KVRegion> {
 public:
  KVCache() = default;
  KVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens,
          KVType type = KVType::F32);

  KVType type() const { return type_; }
  // Makes room for `tokens` rows (<= max_tokens), keeping the rows already written. Throws tessera::Error
  // when the memory cannot be had.
  void reserve(int32_t tokens);
  // Throws tessera::Error when `tokens` rows would exceed the host memory budget (core/memory_budget.h):
  //   "KV cache for 131,072 tokens (24 layers x 3 kv heads x 64 dims, K and V in f32) needs 12.9 GB, over ..."
  void check_budget(int64_t tokens) const;
  double bytes_for(int64_t tokens) const;  // K and V of every layer for `tokens` rows
  // Frees everything (capacity 0).
  void release();

  // Where layer l's row `pos` is, f32 caches only (the products write there directly); throws otherwise.
  float* k(int32_t layer, int32_t pos);
  float* v(int32_t layer, int32_t pos);
  // Writes rows [pos, pos + n) of layer l from f32 rows ([n, num_kv_heads * head_dim] each), converted to the
  // cache's type. pos + n <= capacity().
  void write(int32_t layer, int32_t pos, int32_t n, const float* k_rows, const float* v_rows);
  // Reads rows [pos, pos + n) of layer l as f32 (any type).
  void read(int32_t layer, int32_t pos, int32_t n, float* k_rows, float* v_rows) const;

  // Where layer l's row `pos` is, in the cache's type (any type): row_bytes() bytes per row.
  std::byte* k_bytes(int32_t layer, int32_t pos) {
    return k_[static_cast<size_t>(layer)].bytes() + static_cast<size_t>(pos) * row_bytes();
  }
  std::byte* v_bytes(int32_t layer, int32_t pos) {
    return v_[static_cast<size_t>(layer)].bytes() + static_cast<size_t>(pos) * row_bytes();
  }
  size_t row_bytes() const { return static_cast<size_t>(row_) * kv_type_size(type_); }

  // Views of rows [0, len) of one layer: [len, num_kv_heads, head_dim] in the cache's type.
  TensorView k_view(int32_t layer, int32_t len);
  TensorView v_view(int32_t layer, int32_t len);

  size_t bytes() const;  // reserved bytes (capacity rows), K and V of every layer; resident: the rows written

 private:
  std::string describe(int64_t tokens) const;

  KVType type_ = KVType::F32;
  int32_t mapped_ = 0;  // rows every region can hold
};

}  // namespace tessera::runtime
