// tessera/runtime/rope.h — rotary position embeddings in the rotate_half (NeoX / Hugging Face) convention.
//
// For a head vector x of even length d and position p, with half = d/2 and angle_i = p * inv_freq_i:
//   out[i]        = x[i] * cos(angle_i) - x[i + half] * sin(angle_i)
//   out[i + half] = x[i + half] * cos(angle_i) + x[i] * sin(angle_i)        for i in [0, half)
// inv_freq_i = 1 / theta^(2i/d), then scaled: linear divides every frequency by `factor`; llama3 (Llama-3.1)
// divides the low frequencies (wavelength > original_context / low_freq_factor) by `factor`, keeps the high
// ones (wavelength < original_context / high_freq_factor) and interpolates in between, as transformers'
// _compute_llama3_parameters does. GGUF's rope_freqs factors divide inv_freq_i by factor_i (the same numbers,
// precomputed by the converter). Angles are formed in f32 (p * inv_freq_i) as transformers does, so positions
// far into a long context round the same way.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/model_config.h"

namespace tessera::runtime {

// inv_freq for one RoPE configuration (head_dim / 2 values). freq_factors: empty, or head_dim / 2 divisors.
std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim,
                                 std::span<const float> freq_factors = {});

// cos and sin tables for positions [pos0, pos0 + n): cos[t * half + i], sin[t * half + i].
// The distinct RoPE frequency sets of a model's layers (rope_inv_freq of each distinct RopeConfig, in order of first
// use) and, per layer, the index of its set: the forward passes build their cos/sin tables once per set, not per layer.
struct LayerRopes {
  std::vector<std::vector<float>> inv_freqs;
  std::vector<size_t> layer;  // layer -> index into inv_freqs
};
LayerRopes layer_ropes(const ModelConfig& config, std::span<const float> freq_factors = {});

void rope_tables(std::span<const float> inv_freq, int64_t pos0, int64_t n, float* cos, float* sin);

// Rotates `heads` head vectors of length head_dim in each of `rows` rows; row t starts at x + t * row_stride
// and sits at the position of table row t.
void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float* cos,
                const float* sin);

}  // namespace tessera::runtime
