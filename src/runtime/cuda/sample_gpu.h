// tessera/runtime/cuda/sample_gpu.h — drawing tokens on the GPU with the host sampler's rule
// (runtime/sampling.h: sample_token).
//
// One CTA per sampled row, no sort of the vocabulary: the top_k cut is a radix select of the k-th largest logit
// (32 counting passes over the row's order keys) with ties taken in id order by a block scan; the top_p cut a
// bisection of the same keys on the probability mass (double sums) with the tie at the threshold again in id
// order; the draw a block scan of the kept tokens' probabilities in id order against u times their total. The
// result is sample_token's token except where a cumulative sum lies within rounding of top_p or of the draw
// (the GPU sums in tree order, the host sequentially).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/logit_edit.h"

namespace tessera::runtime::gpu {

// A row of the logits to sample, its options (temperature > 0; top_k 0: all; top_p 1: no cut; min_p 0: none)
// and its uniform draw u in [0, 1) (runtime::Sampler::next_uniform). min_p keeps, of the tokens top_k and top_p
// kept, those whose probability is at least min_p times the largest (runtime/sampling.h, step 7).
struct SampleRow {
  int32_t row = 0;
  int32_t top_k = 0;
  float temperature = 1.0f;
  float top_p = 1.0f;
  double u = 0.0;
  float min_p = 0.0f;
};

// One logit edit (penalties, logit_bias: runtime/logit_edit.h) of one row; at most one per (row, token).
struct RowEdit {
  int32_t row = 0;
  LogitEdit edit;
};

// logits[e.row * ld + e.edit.token] = edit_logit(that, e.edit) for each of the `count` edits (a device array), in
// place, asynchronously on `stream` (the host's Sampler::edit, float for float).
void edit_rows(float* logits, int64_t ld, const RowEdit* edits, int32_t count, cudaStream_t stream);

// out[j] = the token drawn for rows[j] (device array of count SampleRow) from logits [*, n] (f32, rows ld apart).
// scratch: device doubles, count * n of them. Launches asynchronously on `stream`.
void sample_rows(const float* logits, int64_t ld, int32_t n, const SampleRow* rows, int32_t count, double* scratch,
                 int32_t* out, cudaStream_t stream);

}  // namespace tessera::runtime::gpu
