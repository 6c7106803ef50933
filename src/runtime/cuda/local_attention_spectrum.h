// tessera/runtime/cuda/local_attention_spectrum.h — how a synthetic head's queries and keys share a direction
// so that, after RoPE, their scores fall with distance as a real model's local heads do. Header only, no
// CUDA: used by DeviceModel::random(..., RandomInit::kLocalAttention) (the TTFT benchmark's "local" weights),
// by bench/gpu/model_inputs.h (attention_gpu_bench --inputs model) and by the CPU checks of both.
//
// RoPE rotates pair i of a head vector (dims i and i + d/2) by the angle p * theta_i. If the query at
// position m and the key at position n carry the same pre-rotation pair z_i (a shared direction), that part
// of their dot product is
//     q_m . k_n = sum_i |z_i|^2 cos((m - n) theta_i),
// a function of the distance m - n alone. Which function depends on how |z_i|^2 is spread over the pairs: a
// pair whose wavelength 2 pi / theta_i is short keeps oscillating at every distance (a random shared
// direction puts most of its energy there, so the sum is a quasi-random function of the distance and the
// "best" diagonals scatter: this is what the old rope/local inputs did); a pair whose wavelength is long
// falls from 1 at distance 0 to its first minimum at half a wavelength. local_attention_weights() puts the
// energy only on the pairs whose wavelength lies in [kMinWavelength, kMaxWavelength] (Llama-3.1: pairs 30-41
// of 64, wavelengths 4.6K-225K tokens), weighted by sqrt(wavelength). The sum h(distance) then falls steadily
// over 1K-30K tokens; on Llama-3.1's frequencies, for every x in [565, 30K], every distance below x scores
// higher than every distance beyond 1.5 x by at least 1.4% of the peak (h(1K) = 0.96, h(4K) = 0.82, h(6096) =
// 0.74, h(16K) = 0.44, h(32K) = -0.02, minimum -0.46 at 53K; bench/gpu/local_weights_sim.py prints it);
// short-wavelength pairs, whose oscillation would be noise at long distance, carry none. The decay is a
// property of RoPE's frequencies, not of any budget: the best k diagonals are the k nearest for any k in that
// range.
#pragma once

#include <cmath>
#include <vector>

namespace tessera::runtime::gpu {

inline constexpr double kLocalMinWavelength = 4096.0;    // tokens
inline constexpr double kLocalMaxWavelength = 262144.0;  // tokens
// Pairs at least this long (a wavelength of 16x the longest benchmarked prompt) hardly rotate within a
// prompt: they carry the sink (a key every query attends to wherever it stands).
inline constexpr double kSinkMinWavelength = 2097152.0;

// Weights over RoPE pairs (inv_freq: half values, as runtime/rope.h), summing to 1: sqrt(wavelength) on the
// pairs whose wavelength lies in [kLocalMinWavelength, kLocalMaxWavelength], 0 elsewhere. A RoPE with no pair
// in that band (a short-context model) gets its longest-wavelength pair below kSinkMinWavelength, or its
// longest one.
inline std::vector<double> local_attention_weights(const float* inv_freq, int half) {
  const double two_pi = 6.283185307179586;
  std::vector<double> w(static_cast<size_t>(half), 0.0);
  double total = 0;
  for (int i = 0; i < half; ++i) {
    const double wavelength = two_pi / static_cast<double>(inv_freq[i]);
    if (wavelength >= kLocalMinWavelength && wavelength <= kLocalMaxWavelength) {
      w[static_cast<size_t>(i)] = std::sqrt(wavelength);
      total += w[static_cast<size_t>(i)];
    }
  }
  if (total == 0 && half > 0) {
    int best = -1;
    for (int i = 0; i < half; ++i) {
      const double wavelength = two_pi / static_cast<double>(inv_freq[i]);
      if (wavelength < kSinkMinWavelength &&
          (best < 0 || wavelength > two_pi / static_cast<double>(inv_freq[best])))
        best = i;
    }
    if (best < 0) best = half - 1;
    w[static_cast<size_t>(best)] = 1.0;
    total = 1.0;
  }
  for (double& v : w) v /= total;
  return w;
}

// Which pairs carry the sink: wavelength >= kSinkMinWavelength (Llama-3.1: pairs 52-63). Empty when none is.
inline std::vector<int> sink_pairs(const float* inv_freq, int half) {
  std::vector<int> out;
  for (int i = 0; i < half; ++i) {
    if (6.283185307179586 / static_cast<double>(inv_freq[i]) >= kSinkMinWavelength) out.push_back(i);
  }
  return out;
}

}  // namespace tessera::runtime::gpu
