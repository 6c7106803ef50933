#include "model/quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/dtype.h"
#include "core/error.h"

namespace tessera::model {

namespace {

constexpr int kQK = 32;    // elements per block of the legacy types (Q4_0 .. Q8_0)
constexpr int kQKK = 256;  // elements per super-block of the K-quants

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(f16::from_bits(h));
}

void store_f16(uint8_t* p, float x) {
  const uint16_t h = f32_to_f16(x).bits;
  std::memcpy(p, &h, 2);
}

// ---- one block -> f32
// --------------------------------------------------------------------------------------

// Legacy 4/5-bit types: element j (j < 16) is the low nibble of qs[j], element j + 16 its high nibble. Q5_0
// and Q5_1 (kFifthBit) add a fifth bit: that of element i is bit i of the little-endian uint32 qh, which
// precedes qs. Q4_1 and Q5_1 (kMin) store a min m after d: x = d * q + m; Q4_0 and Q5_0 centre q instead: x =
// d * (q - 8) or d * (q - 16).
template <bool kFifthBit, bool kMin>
void block_legacy(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const float m = kMin ? load_f16(b + 2) : 0.0f;
  const uint8_t* p = kMin ? b + 4 : b + 2;
  uint32_t qh = 0;  // Q4_0, Q4_1: no fifth bits
  if constexpr (kFifthBit) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  const uint8_t* qs = p;
  constexpr int kCentre = kFifthBit ? 16 : 8;
  for (int j = 0; j < kQK / 2; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    if constexpr (kMin) {
      y[j] = d * static_cast<float>(lo) + m;
      y[j + 16] = d * static_cast<float>(hi) + m;
    } else {
      y[j] = d * static_cast<float>(lo - kCentre);
      y[j + 16] = d * static_cast<float>(hi - kCentre);
    }
  }
}

void block_q8_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = d * static_cast<float>(qs[j]);
}

// Q2_K: element e = 128 * half + 32 * s + l (half < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[32 * half + l];
// group e / 16 has scale byte scales[e / 16] (low nibble: scale, high nibble: min). d and dmin follow qs.
void block_q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = load_f16(b + 80);
  const float dmin = load_f16(b + 82);
  for (int half = 0; half < 2; ++half) {
    for (int s = 0; s < 4; ++s) {
      for (int l0 = 0; l0 < 32; l0 += 16) {  // one group of 16 elements: constant scale and min
        const int e0 = 128 * half + 32 * s + l0;
        const uint8_t sc = scales[e0 / 16];
        const float dl = d * static_cast<float>(sc & 15);
        const float ml = dmin * static_cast<float>(sc >> 4);
        const uint8_t* q = qs + 32 * half + l0;
        for (int l = 0; l < 16; ++l) y[e0 + l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
      }
    }
  }
}

// Q3_K: the 2 low bits of element e = 128 * half + 32 * s + l are laid out as in Q2_K; its high bit is bit
// (e / 32) of hmask[l], and a *clear* high bit subtracts 4. The 16 six-bit scales: low 4 bits of scale i are
// the low (i < 8) or high (i >= 8) nibble of scales[i % 8]; its top 2 bits are bits 2 * (i / 4) of scales[8 +
// i % 4].
void block_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = load_f16(b + 108);
  for (int half = 0; half < 2; ++half) {
    for (int s = 0; s < 4; ++s) {
      const int bit = 4 * half + s;  // e / 32
      for (int l0 = 0; l0 < 32; l0 += 16) {
        const int e0 = 128 * half + 32 * s + l0;
        const int i = e0 / 16;
        const int lo = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        const float dl = d * static_cast<float>((lo | (hi << 4)) - 32);
        const uint8_t* q = qs + 32 * half + l0;
        const uint8_t* h = hmask + l0;
        for (int l = 0; l < 16; ++l) {
          const int low = (q[l] >> (2 * s)) & 3;
          const int high = (h[l] >> bit) & 1;
          y[e0 + l] = dl * static_cast<float>(low - 4 + 4 * high);
        }
      }
    }
  }
}

// Q4_K/Q5_K scales: 8 groups, each a 6-bit scale and a 6-bit min packed in 12 bytes. Groups 0-3 use the low 6
// bits of bytes 0-3 (scale) and 4-7 (min); groups 4-7 take their low 4 bits from the nibbles of bytes 8-11
// (scale low, min high) and their top 2 bits from the top bits of bytes 0-3 (scale) and 4-7 (min).
void k_scale_min(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K: element e = 64 * c + 32 * half + l (c < 4) is the low (half 0) or high (half 1) nibble of qs[32 * c +
// l] and belongs to group e / 32. Q5_K (kFifthBit): as Q4_K, plus a fifth bit for element e: bit (e / 32) of
// qh[e % 32], which lies between the scales and qs.
template <bool kFifthBit>
void block_q45_k(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const float dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = kFifthBit ? b + 48 : b + 16;
  for (int c = 0; c < 4; ++c) {
    for (int half = 0; half < 2; ++half) {
      const int g = 2 * c + half;
      int sc, m;
      k_scale_min(scales, g, &sc, &m);
      const float d1 = d * static_cast<float>(sc);
      const float m1 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * c + l] >> (4 * half)) & 15;
        if constexpr (kFifthBit) q |= ((qh[l] >> g) & 1) << 4;
        y[32 * g + l] = d1 * static_cast<float>(q) - m1;
      }
    }
  }
}

// Q6_K: element e = 128 * half + 32 * s + l takes its low 4 bits from the low (s < 2) or high (s >= 2) nibble
// of ql[64 * half + 32 * (s & 1) + l] and its top 2 bits from bits 2s..2s+1 of qh[32 * half + l]; group e /
// 16 has the signed scale scales[e / 16].
void block_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_f16(b + 208);
  for (int half = 0; half < 2; ++half) {
    for (int s = 0; s < 4; ++s) {
      for (int l0 = 0; l0 < 32; l0 += 16) {
        const int e0 = 128 * half + 32 * s + l0;
        const float dl = d * static_cast<float>(scales[e0 / 16]);
        const uint8_t* lo = ql + 64 * half + 32 * (s & 1) + l0;
        const uint8_t* hi = qh + 32 * half + l0;
        for (int l = 0; l < 16; ++l) {
          const int q = ((lo[l] >> (4 * (s >> 1))) & 15) | (((hi[l] >> (2 * s)) & 3) << 4);
          y[e0 + l] = dl * static_cast<float>(q - 32);
        }
      }
    }
  }
}

void block_q8_k(const uint8_t* b, float* y) {
  float d;
  std::memcpy(&d, b, 4);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 4);
  for (int j = 0; j < kQKK; ++j) y[j] = d * static_cast<float>(qs[j]);
}

// ---- a row of blocks -> f32 (the F32, F16 and BF16 "blocks" are single elements)

template <void (*Block)(const uint8_t*, float*)>
void blocks(const uint8_t* src, int64_t n_blocks, size_t block_bytes, int block_size, float* dst) {
  for (int64_t i = 0; i < n_blocks; ++i)
    Block(src + static_cast<size_t>(i) * block_bytes, dst + i * block_size);
}

void f32_row(const uint8_t* src, int64_t n, size_t, int, float* dst) {
  std::memcpy(dst, src, static_cast<size_t>(n) * 4);
}

void f16_row(const uint8_t* src, int64_t n, size_t, int, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = load_f16(src + 2 * i);
}

void bf16_row(const uint8_t* src, int64_t n, size_t, int, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

// ---- f32 -> one block (gguf-py's recipes) ----------------------------------------------------------------

// The element of largest magnitude, sign kept (the first one on ties), as numpy's argmax of abs() picks it.
float signed_absmax(const float* x) {
  float best = 0.0f, best_abs = -1.0f;
  for (int j = 0; j < kQK; ++j) {
    if (std::fabs(x[j]) > best_abs) {
      best_abs = std::fabs(x[j]);
      best = x[j];
    }
  }
  return best;
}

float inverse_or_zero(float d) {
  return d == 0.0f ? 0.0f : 1.0f / d;
}

void quant_q8_0(const float* x, uint8_t* b) {
  float amax = 0.0f;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = inverse_or_zero(d);
  store_f16(b, d);
  for (int j = 0; j < kQK; ++j) {
    const float r = std::round(x[j] * id);  // |r| <= 127 for finite inputs
    const auto q = static_cast<int8_t>(r >= -127.0f && r <= 127.0f ? r : 0.0f);
    std::memcpy(b + 2 + j, &q, 1);
  }
}

// q = clamp(trunc(x * id + offset), 0, qmax), the rounding of ggml's reference quantizers (v is never
// negative for finite inputs; NaN maps to 0 rather than to undefined behaviour).
int trunc_clamp(float v, int qmax) {
  if (!(v > 0.0f)) return 0;
  return v >= static_cast<float>(qmax) ? qmax : static_cast<int>(v);
}

// Q4_0, Q4_1 (kBits 4): element j (j < 16) in the low nibble of qs[j], element j + 16 in its high nibble.
// Q5_0, Q5_1 (kBits 5): the same nibbles, after the fifth bits (bit i of the little-endian uint32 qh).
template <int kBits>
void pack(const int* q, uint8_t* out) {
  if constexpr (kBits == 5) {
    uint32_t qh = 0;
    for (int j = 0; j < kQK; ++j) qh |= static_cast<uint32_t>(q[j] >> 4) << j;
    std::memcpy(out, &qh, 4);
    out += 4;
  }
  for (int j = 0; j < kQK / 2; ++j) out[j] = static_cast<uint8_t>((q[j] & 15) | ((q[j + 16] & 15) << 4));
}

// Q4_0, Q5_0: d = -(the signed absmax) / 2^(kBits - 1), q = x / d + 2^(kBits - 1), rounded.
template <int kBits>
void quant_centred(const float* x, uint8_t* b) {
  constexpr int kCentre = 1 << (kBits - 1);
  const float d = signed_absmax(x) / -static_cast<float>(kCentre);
  const float id = inverse_or_zero(d);
  store_f16(b, d);
  int q[kQK];
  for (int j = 0; j < kQK; ++j)
    q[j] = trunc_clamp(x[j] * id + (static_cast<float>(kCentre) + 0.5f), 2 * kCentre - 1);
  pack<kBits>(q, b + 2);
}

// Q4_1, Q5_1: d = (max - min) / (2^kBits - 1) and the min, q = (x - min) / d, rounded.
template <int kBits>
void quant_min(const float* x, uint8_t* b) {
  constexpr int kMax = (1 << kBits) - 1;
  const float mn = *std::min_element(x, x + kQK), mx = *std::max_element(x, x + kQK);
  const float d = (mx - mn) / static_cast<float>(kMax);
  const float id = inverse_or_zero(d);
  store_f16(b, d);
  store_f16(b + 2, mn);
  int q[kQK];
  for (int j = 0; j < kQK; ++j) q[j] = trunc_clamp((x[j] - mn) * id + 0.5f, kMax);
  pack<kBits>(q, b + 4);
}

// ---- f32 -> a row of blocks

template <void (*Block)(const float*, uint8_t*)>
void quant_blocks(const float* src, int64_t n_blocks, size_t block_bytes, int block_size, uint8_t* dst) {
  for (int64_t i = 0; i < n_blocks; ++i)
    Block(src + i * block_size, dst + static_cast<size_t>(i) * block_bytes);
}

void f32_quant(const float* src, int64_t n, size_t, int, uint8_t* dst) {
  std::memcpy(dst, src, static_cast<size_t>(n) * 4);
}

void f16_quant(const float* src, int64_t n, size_t, int, uint8_t* dst) {
  for (int64_t i = 0; i < n; ++i) store_f16(dst + 2 * i, src[i]);
}

void bf16_quant(const float* src, int64_t n, size_t, int, uint8_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = f32_to_bf16(src[i]).bits;
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

// ---- the types

using DequantRow = void (*)(const uint8_t* src, int64_t n_blocks, size_t block_bytes, int block_size,
                            float* dst);
using QuantRow = void (*)(const float* src, int64_t n_blocks, size_t block_bytes, int block_size,
                          uint8_t* dst);

struct TypeTraits {
  const char* name;
  uint32_t block_size;  // 0: not read by tessera
  uint32_t block_bytes;
  DequantRow dequant = nullptr;  // set for every type tessera reads
  QuantRow quant = nullptr;      // set for the types it can write
};

// Indexed by the ggml type number. Names of types tessera does not read are kept for error messages.
constexpr std::array<TypeTraits, 42> kTraits = {{
    {"F32", 1, 4, f32_row, f32_quant},                                                      // 0
    {"F16", 1, 2, f16_row, f16_quant},                                                      // 1
    {"Q4_0", kQK, 18, blocks<block_legacy<false, false>>, quant_blocks<quant_centred<4>>},  // 2
    {"Q4_1", kQK, 20, blocks<block_legacy<false, true>>, quant_blocks<quant_min<4>>},       // 3
    {"Q4_2", 0, 0},  // 4 (removed from ggml)
    {"Q4_3", 0, 0},  // 5 (removed from ggml)
    {"Q5_0", kQK, 22, blocks<block_legacy<true, false>>, quant_blocks<quant_centred<5>>},  // 6
    {"Q5_1", kQK, 24, blocks<block_legacy<true, true>>, quant_blocks<quant_min<5>>},       // 7
    {"Q8_0", kQK, 34, blocks<block_q8_0>, quant_blocks<quant_q8_0>},                       // 8
    {"Q8_1", 0, 0},                                                                        // 9
    {"Q2_K", kQKK, 84, blocks<block_q2_k>},                                                // 10
    {"Q3_K", kQKK, 110, blocks<block_q3_k>},                                               // 11
    {"Q4_K", kQKK, 144, blocks<block_q45_k<false>>},                                       // 12
    {"Q5_K", kQKK, 176, blocks<block_q45_k<true>>},                                        // 13
    {"Q6_K", kQKK, 210, blocks<block_q6_k>},                                               // 14
    {"Q8_K", kQKK, 292, blocks<block_q8_k>},                                               // 15
    {"IQ2_XXS", 0, 0},                                                                     // 16
    {"IQ2_XS", 0, 0},                                                                      // 17
    {"IQ3_XXS", 0, 0},                                                                     // 18
    {"IQ1_S", 0, 0},                                                                       // 19
    {"IQ4_NL", 0, 0},                                                                      // 20
    {"IQ3_S", 0, 0},                                                                       // 21
    {"IQ2_S", 0, 0},                                                                       // 22
    {"IQ4_XS", 0, 0},                                                                      // 23
    {"I8", 0, 0},                                                                          // 24
    {"I16", 0, 0},                                                                         // 25
    {"I32", 0, 0},                                                                         // 26
    {"I64", 0, 0},                                                                         // 27
    {"F64", 0, 0},                                                                         // 28
    {"IQ1_M", 0, 0},                                                                       // 29
    {"BF16", 1, 2, bf16_row, bf16_quant},                                                  // 30
    {"Q4_0_4_4", 0, 0},    // 31 (removed from ggml)
    {"Q4_0_4_8", 0, 0},    // 32 (removed from ggml)
    {"Q4_0_8_8", 0, 0},    // 33 (removed from ggml)
    {"TQ1_0", 0, 0},       // 34
    {"TQ2_0", 0, 0},       // 35
    {"IQ4_NL_4_4", 0, 0},  // 36 (removed from ggml)
    {"IQ4_NL_4_8", 0, 0},  // 37 (removed from ggml)
    {"IQ4_NL_8_8", 0, 0},  // 38 (removed from ggml)
    {"MXFP4", 0, 0},       // 39
    {"NVFP4", 0, 0},       // 40
    {"Q1_0", 0, 0},        // 41
}};

const TypeTraits* traits(TensorType t) {
  const auto i = static_cast<uint32_t>(t);
  return i < kTraits.size() ? &kTraits[i] : nullptr;
}

void check_row(TensorType t, int64_t n, const char* what) {
  if (!tensor_type_supported(t)) {
    throw Error(std::string(what) + ": tensor type " + std::string(tensor_type_name(t)) + " (" +
                std::to_string(static_cast<uint32_t>(t)) + ") is not supported");
  }
  const auto bs = static_cast<int64_t>(tensor_type_block_size(t));
  if (n < 0 || n % bs != 0) {
    throw Error(std::string(what) + ": " + std::to_string(n) + " elements is not a whole number of " +
                std::string(tensor_type_name(t)) + " blocks of " + std::to_string(bs));
  }
}

}  // namespace

// ---- type traits
// --------------------------------------------------------------------------------------------

std::string_view tensor_type_name(TensorType t) {
  const TypeTraits* tr = traits(t);
  return tr != nullptr ? tr->name : "unknown";
}

bool tensor_type_supported(TensorType t) {
  const TypeTraits* tr = traits(t);
  return tr != nullptr && tr->block_size != 0;
}

size_t tensor_type_block_size(TensorType t) {
  const TypeTraits* tr = traits(t);
  return tr != nullptr ? tr->block_size : 0;
}

size_t tensor_type_block_bytes(TensorType t) {
  const TypeTraits* tr = traits(t);
  return tr != nullptr ? tr->block_bytes : 0;
}

size_t tensor_type_bytes(TensorType t, int64_t n) {
  check_row(t, n, "tensor_type_bytes");
  return static_cast<size_t>(n) / tensor_type_block_size(t) * tensor_type_block_bytes(t);
}

// ---- dequantization
// -----------------------------------------------------------------------------------------

void dequantize_row(TensorType t, const uint8_t* src, int64_t n, float* dst) {
  check_row(t, n, "dequantize_row");
  const TypeTraits& tr = *traits(t);
  const auto bs = static_cast<int>(tr.block_size);
  tr.dequant(src, n / bs, tr.block_bytes, bs, dst);
}

void dequantize(const TensorInfo& tensor, float* out) {
  dequantize_rows(tensor, 0, tensor.rows(), out);
}

void dequantize_rows(const TensorInfo& tensor, int64_t row_begin, int64_t row_count, float* out) {
  const int64_t rows = tensor.rows();
  if (row_begin < 0 || row_count < 0 || row_begin > rows || row_count > rows - row_begin) {
    throw Error("tensor " + tensor.name + ": rows [" + std::to_string(row_begin) + ", " +
                std::to_string(row_begin + row_count) + ") are outside [0, " + std::to_string(rows) + ")");
  }
  const int64_t len = tensor.row_length();
  const size_t row_bytes = tensor.row_bytes();
  // One call over the whole range: rows are contiguous and each is a whole number of blocks.
  dequantize_row(tensor.type, tensor.data + static_cast<size_t>(row_begin) * row_bytes, row_count * len, out);
}

// ---- quantization
// -------------------------------------------------------------------------------------------

bool quantize_supported(TensorType t) {
  const TypeTraits* tr = traits(t);
  return tr != nullptr && tr->quant != nullptr;
}

void quantize_row(TensorType t, const float* src, int64_t n, uint8_t* dst) {
  if (!quantize_supported(t)) {
    throw Error("quantize_row: tessera cannot quantize to " + std::string(tensor_type_name(t)) + " yet");
  }
  check_row(t, n, "quantize_row");
  const TypeTraits& tr = *traits(t);
  const auto bs = static_cast<int>(tr.block_size);
  tr.quant(src, n / bs, tr.block_bytes, bs, dst);
}

}  // namespace tessera::model
