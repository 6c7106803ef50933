// tessera/attention/cpu/reference.h — dense attention with an explicit mask, in double precision.
//
// The slow, obvious twin of every attention executor: for each (head, row) it forms all scores in f64,
// applies the mask, and takes the softmax-weighted sum of V. Executors are tested against it; it is not meant
// to be fast (O(heads * q_len * kv_len * head_dim), one thread per head through the global pool).
#pragma once

#include <functional>
#include <vector>

#include "attention/attention_args.h"
#include "attention/index/sparse_index.h"

namespace tessera::attn {

// Key `key` is visible to row `row` of query head `head` iff visible(head, row, key) and key <= q_begin + row
// (causality is always applied on top of the given mask, and so is the window: q_begin + row - key <
// args.window when args.window > 0). Writes args.out (f32) and args.lse when present; when out_f64 is not
// null it receives the same output in f64, laid out [q_len][num_q_heads][head_dim] contiguously. Throws what
// validate(args) throws.
void reference_attention_masked(const AttentionArgs& args,
                                const std::function<bool(int head, int row, int key)>& visible,
                                std::vector<double>* out_f64 = nullptr);

// Mask = index.visible, intersected with args.window (the index must describe this call: same heads, q_begin,
// q_len, kv_len).
void reference_attention_sparse(const AttentionArgs& args, const SparseIndex& index,
                                std::vector<double>* out_f64 = nullptr);

// Dense causal attention (within args.window when it is > 0).
void reference_attention_causal(const AttentionArgs& args, std::vector<double>* out_f64 = nullptr);

}  // namespace tessera::attn
