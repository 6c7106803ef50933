#include "runtime/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/dtype.h"
#include "core/error.h"
#include "core/format.h"
#include "core/memory_budget.h"

namespace tessera::runtime {

std::string_view kv_type_name(KVType t) {
  switch (t) {
    case KVType::F32: return "f32";
    case KVType::BF16: return "bf16";
    case KVType::F16: return "f16";
  }
  return "?";
}

KVType parse_kv_type(std::string_view text) {
  if (text == "f32") return KVType::F32;
  if (text == "bf16") return KVType::BF16;
  if (text == "f16") return KVType::F16;
  throw Error("--kv-type: expected f32, bf16 or f16, got '" + std::string(text) + "'");
}

size_t kv_type_size(KVType t) { return t == KVType::F32 ? 4 : 2; }

namespace {
std::atomic<int> g_default_kv_type{-1};  // -1: not set
}  // namespace

KVType default_kv_type() {
  const int set = g_default_kv_type.load(std::memory_order_relaxed);
  if (set >= 0) return static_cast<KVType>(set);
  if (const char* env = std::getenv("TESSERA_KV_TYPE"); env != nullptr && *env != 0) {
    try {
      return parse_kv_type(env);
    } catch (const Error&) {
      throw Error("TESSERA_KV_TYPE: expected f32, bf16 or f16, got '" + std::string(env) + "'");
    }
  }
  return KVType::F16;
}

void set_default_kv_type(KVType t) { g_default_kv_type.store(static_cast<int>(t), std::memory_order_relaxed); }

DType kv_dtype(KVType t) {
  return t == KVType::F32 ? DType::F32 : t == KVType::BF16 ? DType::BF16 : DType::F16;
}

namespace {

constexpr float kF16Max = 65504.0f;

uint16_t to_f16_saturating(float x) {
  if (!(x != x)) x = std::clamp(x, -kF16Max, kF16Max);  // NaN passes through
  return f32_to_f16(x).bits;
}

}  // namespace

void f32_to_half_scalar(const float* src, uint16_t* dst, int64_t n, KVType t) {
  if (t == KVType::BF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]).bits;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f16_saturating(src[i]);
  }
}

void f32_to_half(const float* src, uint16_t* dst, int64_t n, KVType t) {
  check(t != KVType::F32, "f32_to_half: the target type must be bf16 or f16");
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if (t == KVType::BF16) {
    // Round to nearest even on the bits: u + 0x7fff + ((u >> 16) & 1), then the high half; NaN lanes keep their
    // high half with the quiet bit set (what f32_to_bf16 does).
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x400000);
    for (; i + 16 <= n; i += 16) {
      __m256i r[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i + 8 * h));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(bias, lsb));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
        const __m256i x = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan);
        r[h] = _mm256_srli_epi32(x, 16);
      }
      // packus works within 128-bit lanes: put the halves back in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
    }
  } else {
    const __m256 hi = _mm256_set1_ps(kF16Max), lo = _mm256_set1_ps(-kF16Max);
    for (; i + 8 <= n; i += 8) {
      // min/max return their second operand when either is NaN: x second keeps NaN lanes NaN.
      const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  f32_to_half_scalar(src + i, dst + i, n - i, t);
}

void half_to_f32(const uint16_t* src, float* dst, int64_t n, KVType t) {
  if (t == KVType::BF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(bf16::from_bits(src[i]));
  } else {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = f16_to_f32(f16::from_bits(src[i]));
  }
}

// --- KVRegion

namespace {
size_t page_round(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}
}  // namespace

KVRegion::~KVRegion() {
  if (base_ != nullptr) munmap(base_, size_);
}

KVRegion::KVRegion(KVRegion&& o) noexcept : base_(o.base_), size_(o.size_) {
  o.base_ = nullptr;
  o.size_ = 0;
}

KVRegion& KVRegion::operator=(KVRegion&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) munmap(base_, size_);
    base_ = o.base_;
    size_ = o.size_;
    o.base_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

bool KVRegion::grow(size_t bytes) {
  bytes = page_round(bytes);
  if (bytes <= size_) return true;
  void* p = base_ == nullptr
                ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                : mremap(base_, size_, bytes, MREMAP_MAYMOVE);
  if (p == MAP_FAILED) return false;
  base_ = static_cast<std::byte*>(p);
  size_ = bytes;
  return true;
}

// --- KVCache

KVCache::KVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens, KVType type)
    : ContiguousKVLayers(num_layers, num_kv_heads, head_dim, max_tokens), type_(type) {}

double KVCache::bytes_for(int64_t tokens) const {
  return static_cast<double>(tokens) * static_cast<double>(row_bytes()) * 2.0 * num_layers_;
}

std::string KVCache::describe(int64_t tokens) const {
  return "KV cache for " + with_commas(tokens) + " tokens (" + std::to_string(num_layers_) + " layers x " +
         std::to_string(num_kv_heads_) + " kv heads x " + std::to_string(head_dim_) + " dims, K and V in " +
         std::string(kv_type_name(type_)) + ")";
}

void KVCache::check_budget(int64_t tokens) const {
  check_host_allocation(describe(tokens), bytes_for(tokens), "lower the context limit (--max-context) or shorten the prompt");
}

void KVCache::reserve(int32_t tokens) {
  check(tokens <= max_tokens_,
        "KV cache: " + std::to_string(tokens) + " tokens exceed its limit of " + std::to_string(max_tokens_));
  if (tokens <= capacity_) return;
  check_budget(tokens);  // before anything is reserved: fails with the size the tokens need
  if (tokens > mapped_) {
    // The address space grows geometrically (decode appends one token at a time; mremap moves no data, and only
    // written pages are resident), never beyond the limit.
    const int64_t grown = std::max<int64_t>({tokens, 2 * static_cast<int64_t>(mapped_), 256});
    int32_t rows = static_cast<int32_t>(std::min<int64_t>(grown, max_tokens_));
    for (int attempt = 0; attempt < 2; ++attempt) {
      bool ok = true;
      for (int32_t l = 0; l < num_layers_ && ok; ++l)
        ok = k_[static_cast<size_t>(l)].grow(static_cast<size_t>(rows) * row_bytes()) &&
             v_[static_cast<size_t>(l)].grow(static_cast<size_t>(rows) * row_bytes());
      if (ok) break;
      if (attempt == 1 || rows == tokens)
        throw Error(describe(rows) + ": out of host address space reserving " + format_bytes(bytes_for(rows)) +
                    "; lower the context limit (--max-context) or shorten the prompt");
      rows = tokens;  // the geometric step did not fit: exactly what is asked
    }
    mapped_ = rows;
  }
  capacity_ = tokens;
}

void KVCache::release() {
  for (auto& x : k_) x = KVRegion();
  for (auto& x : v_) x = KVRegion();
  capacity_ = 0;
  mapped_ = 0;
}

float* KVCache::k(int32_t layer, int32_t pos) {
  check(type_ == KVType::F32, "KV cache: k() needs an f32 cache (this one is " + std::string(kv_type_name(type_)) + ")");
  return ContiguousKVLayers::k(layer, pos);
}

float* KVCache::v(int32_t layer, int32_t pos) {
  check(type_ == KVType::F32, "KV cache: v() needs an f32 cache (this one is " + std::string(kv_type_name(type_)) + ")");
  return ContiguousKVLayers::v(layer, pos);
}

void KVCache::write(int32_t layer, int32_t pos, int32_t n, const float* k_rows, const float* v_rows) {
  check(pos >= 0 && n >= 0 && pos + n <= capacity_, "KV cache: writing rows beyond its capacity");
  const int64_t count = static_cast<int64_t>(n) * row_;
  const size_t at = static_cast<size_t>(pos) * row_bytes();
  std::byte* kd = k_[static_cast<size_t>(layer)].bytes() + at;
  std::byte* vd = v_[static_cast<size_t>(layer)].bytes() + at;
  if (type_ == KVType::F32) {
    if (reinterpret_cast<const std::byte*>(k_rows) != kd)
      std::memcpy(kd, k_rows, static_cast<size_t>(count) * sizeof(float));
    if (reinterpret_cast<const std::byte*>(v_rows) != vd)
      std::memcpy(vd, v_rows, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  f32_to_half(k_rows, reinterpret_cast<uint16_t*>(kd), count, type_);
  f32_to_half(v_rows, reinterpret_cast<uint16_t*>(vd), count, type_);
}

void KVCache::read(int32_t layer, int32_t pos, int32_t n, float* k_rows, float* v_rows) const {
  check(pos >= 0 && n >= 0 && pos + n <= capacity_, "KV cache: reading rows beyond its capacity");
  const int64_t count = static_cast<int64_t>(n) * row_;
  const size_t at = static_cast<size_t>(pos) * row_bytes();
  const std::byte* kd = k_[static_cast<size_t>(layer)].bytes() + at;
  const std::byte* vd = v_[static_cast<size_t>(layer)].bytes() + at;
  if (type_ == KVType::F32) {
    std::memcpy(k_rows, kd, static_cast<size_t>(count) * sizeof(float));
    std::memcpy(v_rows, vd, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  half_to_f32(reinterpret_cast<const uint16_t*>(kd), k_rows, count, type_);
  half_to_f32(reinterpret_cast<const uint16_t*>(vd), v_rows, count, type_);
}

TensorView KVCache::k_view(int32_t layer, int32_t len) {
  return TensorView(k_[static_cast<size_t>(layer)].bytes(), kv_dtype(type_), {len, num_kv_heads_, head_dim_});
}

TensorView KVCache::v_view(int32_t layer, int32_t len) {
  return TensorView(v_[static_cast<size_t>(layer)].bytes(), kv_dtype(type_), {len, num_kv_heads_, head_dim_});
}

size_t KVCache::bytes() const { return static_cast<size_t>(bytes_for(capacity_)); }

}  // namespace tessera::runtime
