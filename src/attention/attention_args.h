// tessera/attention/attention_args.h — the arguments of one attention call (prefill or a prefill chunk).
//
// Layouts are token-major, as the model produces them; any element strides are accepted (views are read
// through their strides, never assumed contiguous).
//   q   [q_len,  num_q_heads,  head_dim]  f32 or bf16
//   k,v [kv_len, num_kv_heads, head_dim]  f32 or bf16 (k and v may differ)
//   out [q_len,  num_q_heads,  head_dim]  f32, written
//   lse [num_q_heads, q_len]              f32, optional (data == nullptr: absent), written
//
// Positions: query row r sits at absolute position q_begin + r; key j is visible to row r only if
// j <= q_begin + r (causal) and, when window > 0, q_begin + r - j < window (the model's own row-exact sliding
// window: Gemma-3 local layers, Mistral); a sparse index may hide more (the visible set is the intersection).
// Keys at positions >= q_begin + q_len are never visible, so kv_len must be at least q_begin + q_len
// (normally equal; a longer cache is allowed and its tail is ignored).
//
// GQA: query head h reads kv head h / (num_q_heads / num_kv_heads); repeated K/V are never materialised.
//
// Softmax is taken over the visible keys of each row, of scale * q.k. lse is the natural log of the sum of
// exp(scale * q.k) over those keys. A row that sees no key gets output 0 and lse -inf.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tessera::attn {

struct AttentionArgs {
  TensorView q;         // [q_len, num_q_heads, head_dim], f32 or bf16
  TensorView k;         // [kv_len, num_kv_heads, head_dim], f32 or bf16
  TensorView v;         // [kv_len, num_kv_heads, head_dim], f32 or bf16
  TensorView out;       // [q_len, num_q_heads, head_dim], f32
  TensorView lse;       // optional: [num_q_heads, q_len], f32
  float scale = 0;      // 0 means 1 / sqrt(head_dim)
  int32_t q_begin = 0;  // absolute position of query row 0
  int32_t window = 0;   // row-exact sliding window in keys (a row sees its `window` most recent); 0: none

  int64_t q_len() const { return q.dim(0); }
  int64_t kv_len() const { return k.dim(0); }
  int64_t num_q_heads() const { return q.dim(1); }
  int64_t num_kv_heads() const { return k.dim(1); }
  int64_t head_dim() const { return q.dim(2); }
  int64_t group_size() const { return num_q_heads() / num_kv_heads(); }
  int64_t kv_head(int64_t q_head) const { return q_head / group_size(); }
  bool has_lse() const { return lse.data != nullptr; }
  float effective_scale() const;  // scale, or 1 / sqrt(head_dim) when scale == 0
};

// Throws tessera::Error naming the argument for wrong ranks, shapes or dtypes, e.g.
//   "attention k: expected shape [*, *, 64], got [10, 2, 32]"
//   "attention: 8 query heads are not a multiple of 3 kv heads"
//   "attention: kv_len 10 is less than q_begin + q_len = 12 (every query must see its own position)"
//   "attention: window must be >= 0 (0: no window), got -1"
void validate(const AttentionArgs& args);

}  // namespace tessera::attn
