// tessera/plan/cross_entropy.h — the planners' loss on the host, shared by the CPU and GPU gradient passes: the mean
// next-token cross-entropy of a few rows of logits and its gradient with respect to them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "plan/model_gradients.h"

namespace tessera::plan {

// z [targets, V]: the rows' logits before soft-capping, capped in place when cap > 0 (cap * tanh(z / cap), Gemma).
// Returns the mean over the rows of -log softmax(z)[target token] (log-sum-exp in double). With dz non-empty
// ([targets, V]) also the gradient with respect to the uncapped logits: (softmax - onehot) / rows, times the
// soft-capping's derivative 1 - (z / cap)^2.
template <class T>
double cross_entropy(std::span<T> z, int64_t V, std::span<const Target> targets, T cap, std::span<T> dz) {
  const auto NT = static_cast<int64_t>(targets.size());
  if (cap > 0)
    for (T& v : z) v = cap * std::tanh(v / cap);
  double loss = 0;
  for (int64_t t = 0; t < NT; ++t) {
    const T* row = z.data() + t * V;
    const T mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    const double lse = static_cast<double>(mx) + std::log(sum);
    const int32_t tok = targets[static_cast<size_t>(t)].token;
    loss += lse - static_cast<double>(row[tok]);
    if (dz.empty()) continue;
    T* g = dz.data() + t * V;
    for (int64_t j = 0; j < V; ++j) g[j] = static_cast<T>(std::exp(static_cast<double>(row[j]) - lse) / static_cast<double>(NT));
    g[tok] -= static_cast<T>(1.0 / static_cast<double>(NT));
  }
  if (cap > 0 && !dz.empty())
    for (size_t i = 0; i < dz.size(); ++i) dz[i] *= T(1) - (z[i] / cap) * (z[i] / cap);
  return loss / static_cast<double>(NT);
}

}  // namespace tessera::plan
