// tessera/plan/activation.h — the gated MLP's activation and its derivative, written once for the gradient passes:
// the CPU's (model_gradients.cpp, f32 and f64) and the GPU's kernels (cuda/gradient_kernels.cuh, f32), so that the
// backward differentiates the same formula on both. In the type of the argument throughout (constants rounded to
// T, as the engines' forward rounds them).
#pragma once

#include <cmath>

#include "core/host_device.h"
#include "model/model_config.h"

namespace tessera::plan {

// sqrt(2 / pi), 1 / sqrt(2), sqrt(2 pi): the GELU constants.
inline constexpr double kGeluTanhC = 0.7978845608028654;
inline constexpr double kInvSqrt2 = 0.7071067811865476;
inline constexpr double kSqrt2Pi = 2.5066282746310002;

// act(g): SiLU, GELU with the tanh approximation, or GELU (erf).
template <typename T>
TESSERA_HOST_DEVICE inline T activation(runtime::Activation kind, T g) {
  switch (kind) {
    case runtime::Activation::SiLU:
      return g / (T(1) + std::exp(-g));
    case runtime::Activation::GeluTanh:
      return T(0.5) * g * (T(1) + std::tanh(T(kGeluTanhC) * (g + T(0.044715) * g * g * g)));
    case runtime::Activation::Gelu:
      break;
  }
  return T(0.5) * g * (T(1) + std::erf(g * T(kInvSqrt2)));
}

// d act(g) / dg.
template <typename T>
TESSERA_HOST_DEVICE inline T activation_grad(runtime::Activation kind, T g) {
  switch (kind) {
    case runtime::Activation::SiLU: {
      const T s = T(1) / (T(1) + std::exp(-g));
      return s * (T(1) + g * (T(1) - s));
    }
    case runtime::Activation::GeluTanh: {
      const T c = T(kGeluTanhC);
      const T th = std::tanh(c * (g + T(0.044715) * g * g * g));
      return T(0.5) * (T(1) + th) + T(0.5) * g * (T(1) - th * th) * c * (T(1) + T(3 * 0.044715) * g * g);
    }
    case runtime::Activation::Gelu:
      break;
  }
  const T cdf = T(0.5) * (T(1) + std::erf(g * T(kInvSqrt2)));
  const T pdf = std::exp(-T(0.5) * g * g) / T(kSqrt2Pi);
  return cdf + g * pdf;
}

}  // namespace tessera::plan
