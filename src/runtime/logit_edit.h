// tessera/runtime/logit_edit.h — the per-token logit edits of the penalties and logit_bias, one function for the
// host and the GPU (runtime/cuda/sample_gpu.cu), so both compute the same floats.
//
// For one token of one sequence (sampling.h has the order and the sources):
//   x += bias                                                  (logit_bias; HF SequenceBiasLogitsProcessor)
//   if seen:  x = x < 0 ? x * repetition : x / repetition      (prompt + generated; HF RepetitionPenaltyLogitsProcessor)
//   if count > 0: x = x - count * frequency; x = x - presence  (generated only; OpenAI's formula, vLLM's order)
// every step rounded to f32 (no fused multiply-add), as torch computes it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_EDIT_HD __host__ __device__
#else
#define TESSERA_EDIT_HD
#endif

namespace tessera::runtime {

struct LogitEdit {
  int32_t token = 0;
  int32_t count = 0;        // times generated so far (frequency and presence penalties)
  int32_t seen = 0;         // 1: in the prompt or generated (repetition penalty)
  float bias = 0.0f;        // logit_bias
  float repetition = 1.0f;  // the sequence's penalties (the same in every edit of a sequence)
  float frequency = 0.0f;
  float presence = 0.0f;
};

TESSERA_EDIT_HD inline float edit_logit(float x, const LogitEdit& e) {
#if defined(__CUDA_ARCH__)
  x = __fadd_rn(x, e.bias);
  if (e.seen && e.repetition != 1.0f) x = x < 0.0f ? __fmul_rn(x, e.repetition) : __fdiv_rn(x, e.repetition);
  if (e.count > 0) {
    x = __fsub_rn(x, __fmul_rn(static_cast<float>(e.count), e.frequency));
    x = __fsub_rn(x, e.presence);
  }
#else
  x = x + e.bias;
  if (e.seen && e.repetition != 1.0f) x = x < 0.0f ? x * e.repetition : x / e.repetition;
  if (e.count > 0) {
    volatile float product = static_cast<float>(e.count) * e.frequency;  // no contraction into an fma
    x = x - product;
    x = x - e.presence;
  }
#endif
  return x;
}

}  // namespace tessera::runtime
