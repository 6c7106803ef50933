// tessera/runtime/cuda/local_attention_init.h — the numbers of DeviceModel::random(...,
// RandomInit::kLocalAttention) (device_model.h explains the recipe), as host functions: device_model.cpp
// writes them into the device weights, and tests/local_attention_init_test.cpp checks on the CPU that they
// give local attention (RMSNorm, RoPE and the VS estimator of the CPU runtime). Header only, no CUDA.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "model/model_config.h"
#include "runtime/rope.h"
#include "runtime/cuda/local_attention_spectrum.h"

namespace tessera::runtime::gpu::local_init {

inline constexpr double kTokenStd = 3.0;  // the embedding rows' token part (uniform), per element
inline constexpr double kTau = 0.4;       // |token part| / |shared part| of an embedding row
inline constexpr double kDecayLogits =
    32.0;  // the shared q.k part at distance 0, in logits (times the head's gain)
inline constexpr double kSinkLogits = 38.0;  // what the sink token's key adds to every query's score
inline constexpr double kGainMin = 0.8, kGainMax = 1.2;  // per query head

// The special channels of the residual stream: 4 "massive" ones (the shared direction) and 2 that only the
// sink token has, spread over the row. Distinct for hidden >= 64.
struct Channels {
  std::array<int64_t, 4> massive;
  std::array<int64_t, 2> sink;
  std::vector<int64_t> all() const {
    std::vector<int64_t> out(massive.begin(), massive.end());
    out.insert(out.end(), sink.begin(), sink.end());
    return out;
  }
};

inline Channels channels(int64_t hidden) {
  return Channels{{7, hidden / 4 + 7, hidden / 2 + 7, 3 * hidden / 4 + 7},
                  {hidden / 8 + 3, 5 * hidden / 8 + 3}};
}

// The value of every massive channel of every embedding row (and of the sink token's sink channels): the
// token part's norm is kTokenStd * sqrt(hidden), the shared part's 2 * value.
inline double massive_value(int64_t hidden) {
  return kTokenStd * std::sqrt(static_cast<double>(hidden)) / (2.0 * kTau);
}

// What RMSNorm (weights 1) makes of a massive channel of an ordinary token, and of a sink channel of the sink
// token (nothing else is in its row, in any layer).
inline double normed_massive(int64_t hidden) {
  return std::sqrt(static_cast<double>(hidden)) / 2.0 / std::sqrt(1.0 + kTau * kTau);
}
inline double normed_sink(int64_t hidden) {
  return std::sqrt(static_cast<double>(hidden) / 2.0);
}

// Uniform in [0, 1) from (seed, layer, head, pair, stream).
inline double unit_hash(uint64_t seed, int64_t layer, int64_t head, int64_t pair, int64_t stream) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull;
  for (int64_t v : {layer, head, pair, stream}) {
    z += static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
  }
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

inline double head_gain(uint64_t seed, int64_t layer, int64_t q_head) {
  return kGainMin + (kGainMax - kGainMin) * unit_hash(seed, layer, q_head, 0, 3);
}

// One layer's designed columns of Wq [nq * d, hidden] and Wk [nkv * d, hidden]: every massive channel's
// column of Wq is q_massive, of Wk k_massive; every sink channel's column of Wq is 0, of Wk k_sink. Rows
// follow the weights' layout: head-major, pair i of a head in rows i and i + d/2 (RoPE's rotate_half). With
// the normed inputs above, q_h = gain_h (z + s) and k_g = z, k_sink = s * boost on the head's pairs, where
// z_i = A_i e^{j phi_gi} (A_i^2 = w_i kDecayLogits / scale, w from local_attention_weights on this layer's
// RoPE), s_i = e^{j psi_gi} on the sink pairs, boost = kSinkLogits / (scale * number of sink pairs): scale *
// q.k = gain (kDecayLogits sum_i w_i cos((m - n) theta_i)) for ordinary keys and gain * kSinkLogits (times
// cos of the sink pairs' small rotation) for the sink.
struct LayerColumns {
  std::vector<float> q_massive, k_massive, k_sink;
};

inline LayerColumns layer_columns(const ModelConfig& c, int layer, uint64_t seed) {
  const int64_t D = c.head_dim, half = D / 2, H = c.hidden_size;
  const int group = c.num_q_heads / c.num_kv_heads;
  const std::vector<float> inv =
      rope_inv_freq(c.layers[static_cast<size_t>(layer)].rope, static_cast<int>(D), {});
  const std::vector<double> w = local_attention_weights(inv.data(), static_cast<int>(half));
  const std::vector<int> sinks = sink_pairs(inv.data(), static_cast<int>(half));
  const double scale = c.attention_scale > 0 ? c.attention_scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double boost = sinks.empty() ? 0.0 : kSinkLogits / scale / static_cast<double>(sinks.size());
  const double hm = normed_massive(H), hz = normed_sink(H);
  const int n_massive = static_cast<int>(channels(H).massive.size()),
            n_sink = static_cast<int>(channels(H).sink.size());
  LayerColumns out;
  out.q_massive.assign(static_cast<size_t>(c.num_q_heads * D), 0.0f);
  out.k_massive.assign(static_cast<size_t>(c.num_kv_heads * D), 0.0f);
  out.k_sink.assign(static_cast<size_t>(c.num_kv_heads * D), 0.0f);
  for (int g = 0; g < c.num_kv_heads; ++g) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = std::sqrt(w[static_cast<size_t>(i)] * kDecayLogits / scale);
      const double sk = std::find(sinks.begin(), sinks.end(), static_cast<int>(i)) != sinks.end() ? 1.0 : 0.0;
      const double phi = 6.283185307179586 * unit_hash(seed, layer, g, i, 1);
      const double psi = 6.283185307179586 * unit_hash(seed, layer, g, i, 2);
      const size_t kr = static_cast<size_t>(g * D + i), kr2 = kr + static_cast<size_t>(half);
      out.k_massive[kr] = static_cast<float>(a * std::cos(phi) / (n_massive * hm));
      out.k_massive[kr2] = static_cast<float>(a * std::sin(phi) / (n_massive * hm));
      out.k_sink[kr] = static_cast<float>(sk * boost * std::cos(psi) / (n_sink * hz));
      out.k_sink[kr2] = static_cast<float>(sk * boost * std::sin(psi) / (n_sink * hz));
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const double gain = head_gain(seed, layer, h);
        const size_t qr = static_cast<size_t>(h * D + i), qr2 = qr + static_cast<size_t>(half);
        out.q_massive[qr] =
            static_cast<float>(gain * (a * std::cos(phi) + sk * std::cos(psi)) / (n_massive * hm));
        out.q_massive[qr2] =
            static_cast<float>(gain * (a * std::sin(phi) + sk * std::sin(psi)) / (n_massive * hm));
      }
    }
  }
  return out;
}

}  // namespace tessera::runtime::gpu::local_init
