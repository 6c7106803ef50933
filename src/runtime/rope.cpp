#include "runtime/rope.h"

#include <algorithm>

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace tessera::runtime {

LayerRopes layer_ropes(const ModelConfig& config, std::span<const float> freq_factors) {
  LayerRopes r;
  std::vector<RopeConfig> seen;
  for (const LayerConfig& l : config.layers) {
    auto it = std::find(seen.begin(), seen.end(), l.rope);
    if (it == seen.end()) {
      seen.push_back(l.rope);
      r.inv_freqs.push_back(rope_inv_freq(l.rope, config.head_dim, freq_factors));
      it = seen.end() - 1;
    }
    r.layer.push_back(static_cast<size_t>(it - seen.begin()));
  }
  return r;
}

std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim, std::span<const float> freq_factors) {
  const int half = head_dim / 2;
  check(freq_factors.empty() || static_cast<int>(freq_factors.size()) == half,
        "rope: " + std::to_string(freq_factors.size()) + " frequency factors for head_dim " +
            std::to_string(head_dim));
  std::vector<float> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in f32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float power = static_cast<float>(std::pow(rope.theta, static_cast<double>(exponent)));
    float f = 1.0f / power;
    switch (rope.scaling) {
      case RopeScaling::None:
        break;
      case RopeScaling::Linear:
        f = f / static_cast<float>(rope.factor);
        break;
      case RopeScaling::Llama3: {
        const double low_wavelen = rope.original_context / rope.low_freq_factor;
        const double high_wavelen = rope.original_context / rope.high_freq_factor;
        const double wavelen = 2.0 * std::numbers::pi / static_cast<double>(f);
        if (wavelen > low_wavelen) {
          f = f / static_cast<float>(rope.factor);
        } else if (wavelen >= high_wavelen) {  // medium band: interpolate
          const double smooth = (rope.original_context / wavelen - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
          f = static_cast<float>((1.0 - smooth) * f / rope.factor + smooth * f);
        }
        break;
      }
    }
    if (!freq_factors.empty()) f = f / freq_factors[static_cast<size_t>(i)];
    inv[static_cast<size_t>(i)] = f;
  }
  return inv;
}

void rope_tables(std::span<const float> inv_freq, int64_t pos0, int64_t n, float* cos, float* sin) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  for (int64_t t = 0; t < n; ++t) {
    const float p = static_cast<float>(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[static_cast<size_t>(i)];
      cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float* cos,
                const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * row_stride + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace tessera::runtime
