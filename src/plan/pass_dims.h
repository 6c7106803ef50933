// tessera/plan/pass_dims.h — the model dimensions the gradient passes work in (model_gradients.cpp's Backprop,
// cuda/gradients_cuda.cu's Pass), read once from the config.
#pragma once

#include <cstdint>

#include "model/model_config.h"

namespace tessera::plan {

// A base of the passes: the members keep the passes' own names (H_, QD_, ...).
struct PassDims {
  explicit PassDims(const runtime::ModelConfig& c)
      : H_(c.hidden_size),
        D_(c.head_dim),
        F_(c.intermediate_size),
        NQ_(c.num_q_heads),
        NKV_(c.num_kv_heads),
        QD_(NQ_ * D_),
        KD_(NKV_ * D_) {}

  int64_t H_;    // hidden size
  int64_t D_;    // head dim
  int64_t F_;    // MLP width
  int64_t NQ_;   // query heads
  int64_t NKV_;  // kv heads
  int64_t QD_;   // NQ_ * D_
  int64_t KD_;   // NKV_ * D_
};

}  // namespace tessera::plan
