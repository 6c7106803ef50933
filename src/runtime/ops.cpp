#include "runtime/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "model/qmatmul.h"

namespace tessera::runtime {

void parallel_ranges(ThreadPool& pool, int64_t n, int64_t grain,
                     const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t pieces = std::min<int64_t>((n + grain - 1) / grain, 4 * static_cast<int64_t>(pool.size()));
  if (pieces <= 1) {
    fn(0, n);
    return;
  }
  const int64_t step = (n + pieces - 1) / pieces;
  pool.parallel_for(pieces, [&](int64_t i, int) {
    const int64_t b = i * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  });
}

void single_threaded_blas() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

void linear(const float* x, int64_t m, const Weight& w, const Weight* bias, float* y, ThreadPool* pool) {
  single_threaded_blas();
  const int64_t N = w.rows, K = w.cols;
  if (w.type != model::TensorType::F32) {
    model::qmatmul(w.matrix(), x, m, y, pool);
  } else {
    const float* W = w.ptr();
    // Output columns [r0, r1): rows r0.. of W, on one thread.
    auto part = [&](int64_t r0, int64_t r1) {
      const auto n = static_cast<blasint>(r1 - r0), k = static_cast<blasint>(K);
      if (m == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, W + r0 * K, k, x, 1, 0.0f, y + r0, 1);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), n, k, 1.0f, x, k, W + r0 * K,
                    k, 0.0f, y + r0, static_cast<blasint>(N));
      }
    };
    // One piece per thread, in multiples of 16 rows; products under ~256K multiply-adds run whole (a wake-up of the
    // pool costs more than they take).
    const int threads = pool != nullptr ? pool->size() : 1;
    const int64_t pieces = std::min<int64_t>(threads, N / 16);
    if (pieces <= 1 || m * N * K < (int64_t{1} << 18)) {
      part(0, N);
    } else {
      const int64_t step = ((N + pieces - 1) / pieces + 15) / 16 * 16;
      pool->parallel_for(pieces, [&](int64_t i, int) {
        const int64_t r0 = i * step, r1 = std::min(N, r0 + step);
        if (r0 < r1) part(r0, r1);
      });
    }
  }
  if (bias != nullptr && !bias->empty()) {
    const float* b = bias->ptr();
    for (int64_t r = 0; r < m; ++r) {
      float* row = y + r * N;
      for (int64_t j = 0; j < N; ++j) row[j] += b[j];
    }
  }
}

void rms_norm(const float* x, float* y, int64_t rows, int64_t n, const float* weight, float eps,
              ThreadPool& pool) {
  parallel_ranges(pool, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                  [&](int64_t b, int64_t e) {
                    for (int64_t r = b; r < e; ++r) {
                      const float* in = x + r * n;
                      float* out = y + r * n;
                      double ss = 0;
                      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(in[i]) * in[i];
                      const float mean = static_cast<float>(ss / static_cast<double>(n));
                      const float inv = 1.0f / std::sqrt(mean + eps);
                      for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (in[i] * inv);
                    }
                  });
}

void gated_activation(float* gate, const float* up, int64_t n, Activation act, ThreadPool& pool) {
  parallel_ranges(pool, n, 32768, [&](int64_t b, int64_t e) {
    switch (act) {
      case Activation::SiLU:
        for (int64_t i = b; i < e; ++i) {
          const float g = gate[i];
          gate[i] = g / (1.0f + std::exp(-g)) * up[i];
        }
        break;
      case Activation::GeluTanh: {
        const float c = static_cast<float>(std::sqrt(2.0 / std::numbers::pi));
        for (int64_t i = b; i < e; ++i) {
          const float g = gate[i];
          gate[i] = 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g))) * up[i];
        }
        break;
      }
      case Activation::Gelu:
        for (int64_t i = b; i < e; ++i) {
          const float g = gate[i];
          gate[i] = 0.5f * g * (1.0f + std::erf(g * static_cast<float>(std::numbers::sqrt2 / 2))) * up[i];
        }
        break;
    }
  });
}

void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

}  // namespace tessera::runtime
