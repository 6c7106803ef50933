// tessera/plan/cuda/gradient_weights.h — what the two halves of the GPU gradient pass share (internal to
// src/plan/cuda): the counted device allocation Buf and the f32 device weights behind GradientModel.
//   gradient_model.cu    the weights (uploaded from a Model or random), the path registered with the planners
//   gradients_cuda.cu    the pass: the forward through the layer recipe (runtime/recipe.h), the backward
//   gradient_kernels.cuh the pass's own kernels (norms with their saved 1/rms, RoPE both ways, the activation and
//                        its derivative, the blockwise attention forward and backward)
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "cuda/device_buffer.h"
#include "plan/cuda/gradients_cuda.h"

namespace tessera::plan::cuda {

// The pass's device allocations, current and at their peak (DeviceStats::peak_pass_bytes).
struct Tracker {
  size_t current = 0, peak = 0;
};

// A device allocation of n T, uninitialised, counted against a Tracker (null: not counted). Out of memory throws
// tessera::Error naming the size and what is free.
template <class T>
class Buf {
 public:
  Buf() = default;
  Buf(size_t n, Tracker* t) { alloc(n, t); }
  ~Buf() { release(); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), t_(o.t_) {}
  Buf& operator=(Buf&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
      t_ = o.t_;
    }
    return *this;
  }
  void alloc(size_t n, Tracker* t) {
    release();
    t_ = t;
    if (n == 0) return;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, n * sizeof(T));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("attention gradients (CUDA): out of device memory: could not allocate " +
                  std::to_string(n * sizeof(T)) + " bytes (" + attn::gpu::device_memory_state() +
                  "); use shorter calibration samples or --device cpu");
    }
    p_ = static_cast<T*>(p);
    n_ = n;
    if (t_) {
      t_->current += n * sizeof(T);
      t_->peak = std::max(t_->peak, t_->current);
    }
  }
  void release() {
    if (p_) {
      cudaFree(p_);
      if (t_) t_->current -= n_ * sizeof(T);
    }
    p_ = nullptr;
    n_ = 0;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
  Tracker* t_ = nullptr;
};

// One weight matrix (or vector: rows 1) in f32 on the device; empty where the model has none.
struct DevWeight {
  Buf<float> buf;
  int64_t rows = 0, cols = 0;
  const float* ptr() const { return buf.get(); }
  bool empty() const { return buf.size() == 0; }
};

struct DevLayer {
  DevWeight attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm, w_gate,
      w_up, w_down;
};

struct GradientModel::Impl {
  runtime::ModelConfig cfg;
  std::vector<float> rope_freq_factors;
  DevWeight embedding, lm_head, final_norm;
  std::vector<DevLayer> layers;
  size_t bytes = 0;
  const DevWeight& output() const { return lm_head.empty() ? embedding : lm_head; }
};

}  // namespace tessera::plan::cuda
