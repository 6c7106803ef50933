// tessera/runtime/ops.h — the f32 building blocks of the forward pass (everything but attention).
//
// Row-major throughout: a batch of m tokens is an [m, n] matrix. Matrix products over weights kept in a stored type
// (GGUF blocks, f16, bf16) go to model::qmatmul; over f32 weights to OpenBLAS (sgemm; sgemv for a single row) on
// one thread per piece, the pieces split over our pool: OpenBLAS's own pool is set to one thread the first time a
// product runs, so that one pool serves all CPU work. Element-wise kernels are split over the pool by rows when
// the batch is large enough to pay for it.
#pragma once

#include <cstdint>
#include <functional>

#include "core/thread_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tessera::runtime {

// y[m, w.rows] = x[m, w.cols] * w^T (+ bias), x with row stride w.cols, y with row stride w.rows, for w in any
// kept type; the work is split over `pool` (nullptr: the calling thread alone).
void linear(const float* x, int64_t m, const Weight& w, const Weight* bias, float* y, ThreadPool* pool = nullptr);

// Sets OpenBLAS to one thread (once per process; linear() calls it): tessera's pool splits the products instead.
void single_threaded_blas();

// y = x / sqrt(mean(x^2) + eps) * weight, per row of length n (y may alias x). Sums in double.
void rms_norm(const float* x, float* y, int64_t rows, int64_t n, const float* weight, float eps,
              ThreadPool& pool);

// gate[i] = act(gate[i]) * up[i] for i in [0, n).
void gated_activation(float* gate, const float* up, int64_t n, Activation act, ThreadPool& pool);

// x[i] = cap * tanh(x[i] / cap).
void softcap(float* x, int64_t n, float cap);

// Splits [0, n) into pieces of at least `grain` and runs fn(begin, end) over the pool (inline when n <=
// grain).
void parallel_ranges(ThreadPool& pool, int64_t n, int64_t grain,
                     const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tessera::runtime
