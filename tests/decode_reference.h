// tests/decode_reference.h — the slow, obvious twin that kv_cache_test and batch_engine_test hold the paged decode
// attention (runtime/batch_forward.h) to: one sequence's decode row by the masked reference
// (attention/cpu/reference.h) over a contiguous cache holding the same values, each query head seeing only the keys
// its DecodeView keeps.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/reference.h"
#include "core/tensor.h"
#include "runtime/kv_cache.h"
#include "runtime/paged_kv.h"

namespace tessera::test {

// q: the sequence's [Hq, d] queries at position len - 1 (the cache's first len rows are its keys and values);
// views[l * Hq + h]: query head h's view at layer l. Returns the [Hq, d] outputs.
inline std::vector<float> decode_reference(float* q, runtime::KVCache& cache, int32_t l, int32_t len,
                                           const std::vector<runtime::DecodeView>& views, int32_t Hq, int32_t d,
                                           float scale) {
  std::vector<float> ref(static_cast<size_t>(Hq * d));
  attn::AttentionArgs args;
  args.q = TensorView(q, DType::F32, {1, Hq, d});
  args.k = cache.k_view(l, len);
  args.v = cache.v_view(l, len);
  args.out = TensorView(ref.data(), DType::F32, {1, Hq, d});
  args.scale = scale;
  args.q_begin = len - 1;
  attn::reference_attention_masked(args, [&](int head, int, int key) {
    const auto r = views[static_cast<size_t>(l * Hq + head)].ranges(len);
    return (key >= r.a0 && key < r.a1) || (key >= r.b0 && key < r.b1);
  });
  return ref;
}

}  // namespace tessera::test
