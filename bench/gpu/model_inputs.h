// bench/gpu/model_inputs.h — synthetic attention inputs shaped like a real model's (attention_gpu_bench
// --inputs model): one definition of every element, called by the bench's fill kernel on the device and by
// its CPU twin in tests/model_inputs_test.cpp (which runs the CPU VS estimator and lowering on the same
// values).
//
// Per token t, query head h (kv head g = h / group) and RoPE pair i (dims i and i + d/2, the rotate_half
// layout of Llama), the pre-rotation pair z = x_i + j x_{i+d/2} is
//     query:       gain_h (A_i e^{j phi_gi} + S_i e^{j psi_gi}) + noise (n1 + j n2)
//     key t >= 4:  A_i e^{j phi_gi} + noise (n1 + j n2)
//     key t < 4:   S_i e^{j psi_gi} * sink_boost + noise (n1 + j n2)              (the sink keys)
// and the stored value is z rotated by t theta_i (Llama-3.1's RoPE: base 500000, llama3 scaling factor 8,
// original context 8192). n1, n2 are fresh N(0, 1) per element; phi, psi random phases per (kv head, pair);
// gain_h in [0.8, 1.2] makes some heads sharper than others. After RoPE, q_m . k_n / sqrt(d) holds:
//   - for ordinary keys gain_h decay_logits h(m - n), h = sum_i w_i cos((m - n) theta_i), A_i^2 = w_i
//     decay_logits sqrt(d), w from runtime/cuda/local_attention_spectrum.h: energy only on the pairs of
//     wavelength 4K-262K tokens, none on the short-wavelength pairs whose oscillation would swamp the decay at
//     long distance. h falls from 1 at distance 0 to 0.74 at 6096 and 0.44 at 16K; for x in [565, 30K] every
//     distance below x beats every distance beyond 1.5 x by >= 1.4% of the peak: with decay_logits = 32, a
//     1.5x step in distance costs >= 0.45 logits, more than the noise left in a diagonal summed over the
//     estimator's 64 query rows;
//   - for the sink keys gain_h sink_logits (38), on the pairs of wavelength >= 2M tokens, which barely rotate
//     within a prompt (>= 0.93 of it at 128K): about what the nearest keys score, at any distance;
//   - noise: each side's noise against the other's shared part, and the two noises against each other: about
//     1.2 logits per cell (standard deviation) with noise 0.5: content the estimator must see through.
// So the VS estimator's best diagonals are the ones nearest the diagonal (and those through the sink keys from
// the last rows), its best columns the sink and the most recent keys, as MInference reports for real models:
// the merged ranges cover about (slash + vertical + tile) keys per 128-row tile, density ~2 (6096 + 1000 +
// 128) / S, about 0.1 at 128K. The earlier rope/local inputs' random shared direction put most of its energy on
// short wavelengths (their chosen diagonals scattered: VS density 0.36 at 128K). Measured on the CPU with
// tests/model_inputs_test.cpp: see there and the history section of docs/PERF.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "runtime/cuda/local_attention_spectrum.h"

#if defined(__CUDACC__)
#define TESSERA_BENCH_HD __host__ __device__ __forceinline__
#else
#define TESSERA_BENCH_HD inline
#endif

namespace tessera::bench {

TESSERA_BENCH_HD uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) (24 bits) from a hash of (seed, i).
TESSERA_BENCH_HD float uniform_at(uint64_t seed, uint64_t i) {
  return static_cast<float>(splitmix(seed * 0x100000001b3ull + i) >> 40) * (1.0f / 16777216.0f);
}

// N(0, 1) from a hash of (seed, i) (Box-Muller). The device and the host agree up to the last bit of
// logf/cospif.
TESSERA_BENCH_HD float normal_at(uint64_t seed, uint64_t i) {
  const uint64_t h = splitmix(seed * 0x100000001b3ull + i);
  const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);
  const float u2 = static_cast<float>((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
#if defined(__CUDA_ARCH__)
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
#else
  return std::sqrt(-2.0f * std::log(u1)) *
         static_cast<float>(std::cos(6.283185307179586 * static_cast<double>(u2)));
#endif
}

struct ModelInputs {
  static constexpr int kMaxHalf = 64;  // head_dim <= 128
  int half = 64;                       // head_dim / 2
  float inv_freq[kMaxHalf] = {};       // RoPE frequencies (Llama-3.1)
  float amp[kMaxHalf] = {};            // A_i: the shared, distance-decaying part
  float sink[kMaxHalf] = {};           // S_i: the sink part (long-wavelength pairs only)
  float sink_boost = 1.0f;             // sink keys carry S_i * sink_boost (queries S_i), not A_i
  float noise = 0.5f;                  // standard deviation of the per-element noise
  int sink_keys = 4;
};

// Llama-3.1-8B's RoPE frequencies (runtime/rope.h with theta 500000 and llama3 scaling: factor 8, low/high
// frequency factors 1/4, original context 8192), f32 as transformers computes them.
inline std::vector<float> llama31_inv_freq(int head_dim) {
  const int half = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    float f = 1.0f / static_cast<float>(std::pow(500000.0, static_cast<double>(exponent)));
    const double wavelen = 6.283185307179586 / static_cast<double>(f);
    if (wavelen > 8192.0) {
      f = f / 8.0f;
    } else if (wavelen >= 2048.0) {
      const double smooth = (8192.0 / wavelen - 1.0) / 3.0;
      f = static_cast<float>((1.0 - smooth) * f / 8.0 + smooth * f);
    }
    inv[static_cast<size_t>(i)] = f;
  }
  return inv;
}

// decay_logits: the shared part's score at distance 0 (times gain_h); sink_logits: the sink keys' score
inline ModelInputs make_model_inputs(int head_dim, float decay_logits = 32.0f, float sink_logits = 38.0f,
                                     float noise = 0.5f, int sink_keys = 4) {
  ModelInputs m;
  m.half = head_dim / 2;
  m.noise = noise;
  m.sink_keys = sink_keys;
  const std::vector<float> inv = llama31_inv_freq(head_dim);
  const std::vector<double> w = runtime::gpu::local_attention_weights(inv.data(), m.half);
  const std::vector<int> sinks = runtime::gpu::sink_pairs(inv.data(), m.half);
  const double sqrt_d = std::sqrt(static_cast<double>(head_dim));
  for (int i = 0; i < m.half && i < ModelInputs::kMaxHalf; ++i) {
    m.inv_freq[i] = inv[static_cast<size_t>(i)];
    m.amp[i] = static_cast<float>(std::sqrt(w[static_cast<size_t>(i)] * decay_logits * sqrt_d));
  }
  // Queries carry S_i = 1 on the sink pairs; sink keys S_i * boost, so that the sink adds sink_logits.
  for (int i : sinks) m.sink[i] = 1.0f;
  m.sink_boost =
      sinks.empty() ? 0.0f : static_cast<float>(sink_logits * sqrt_d / static_cast<double>(sinks.size()));
  return m;
}

// Pair i of head `head` at position t, after RoPE: out[0] goes to dim i, out[1] to dim i + half. Queries:
// head is the query head and kv_head = head / group; keys: head = kv_head. seed: the noise stream (queries
// and keys differ).
TESSERA_BENCH_HD void model_input_pair(const ModelInputs& m, bool key, int64_t t, int heads, int head,
                                       int kv_head, int i, uint64_t seed, float out[2]) {
  constexpr float kTwoPi = 6.283185307179586f;
  const float phi = kTwoPi * uniform_at(1001, static_cast<uint64_t>(kv_head) * ModelInputs::kMaxHalf + i);
  const float psi = kTwoPi * uniform_at(1002, static_cast<uint64_t>(kv_head) * ModelInputs::kMaxHalf + i);
  const float gain = key ? 1.0f : 0.8f + 0.4f * uniform_at(1003, static_cast<uint64_t>(head));
  const bool sink_key = key && t < m.sink_keys;
  const float a = sink_key ? 0.0f : m.amp[i];
  const float s = key ? (sink_key ? m.sink[i] * m.sink_boost : 0.0f) : m.sink[i];
  const uint64_t e = 2 * ((static_cast<uint64_t>(t) * heads + head) * m.half + i);
  const float re = gain * (a * cosf(phi) + s * cosf(psi)) + m.noise * normal_at(seed, e);
  const float im = gain * (a * sinf(phi) + s * sinf(psi)) + m.noise * normal_at(seed, e + 1);
  const double angle = static_cast<double>(t) * static_cast<double>(m.inv_freq[i]);
  const float c = static_cast<float>(cos(angle)), sn = static_cast<float>(sin(angle));
  out[0] = re * c - im * sn;
  out[1] = im * c + re * sn;
}

}  // namespace tessera::bench
