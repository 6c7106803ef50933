#include "runtime/stream/stream_layout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/sparse_attention.h"
#include "core/error.h"

namespace tessera::runtime::stream {

namespace {

attn::SparseIndex empty_index(const StreamLayout& l, int32_t q_heads, int32_t tile) {
  attn::SparseIndex ix;
  ix.num_heads = q_heads;
  ix.tile = tile;
  ix.q_begin = l.global + l.local;
  ix.q_len = l.chunk;
  ix.kv_len = l.kv_len();
  return ix;
}

}  // namespace

StreamIndexes lower_stream_layout(const StreamLayout& l, int32_t q_heads, int32_t tile) {
  check(l.global >= 0 && l.local >= 0 && l.chunk > 0 && q_heads > 0 && tile > 0,
        "streaming layout: needs a non-empty chunk and non-negative parts");
  StreamIndexes out{empty_index(l, q_heads, tile), empty_index(l, q_heads, tile)};
  const int32_t tiles = out.local.num_tiles();
  for (attn::SparseIndex* ix : {&out.global, &out.local}) {
    ix->range_offsets.assign(1, 0);
    ix->column_offsets.assign(static_cast<size_t>(q_heads) * static_cast<size_t>(tiles) + 1, 0);
  }
  for (int32_t h = 0; h < q_heads; ++h) {
    for (int32_t t = 0; t < tiles; ++t) {
      if (l.global > 0) out.global.ranges.push_back({0, l.global});
      out.global.range_offsets.push_back(static_cast<int32_t>(out.global.ranges.size()));
      out.local.ranges.push_back({l.global, out.local.tile_key_end(t)});
      out.local.range_offsets.push_back(static_cast<int32_t>(out.local.ranges.size()));
    }
  }
  return out;
}

void streaming_attention_cpu(const StreamLayout& l, const TensorView& q_local, const TensorView& q_global,
                             const TensorView& k, const TensorView& v, const TensorView& out, float scale,
                             ThreadPool& pool, float* lse) {
  const int64_t n = l.chunk, nq = q_local.dim(1), d = q_local.dim(2);
  check(q_local.dim(0) == n && k.dim(0) == l.kv_len(), [&] {
    return "streaming attention: " + std::to_string(q_local.dim(0)) + " queries and " +
           std::to_string(k.dim(0)) + " keys for a layout of " + std::to_string(n) + " and " +
           std::to_string(l.kv_len());
  });
  const StreamIndexes ix = lower_stream_layout(l, static_cast<int32_t>(nq), 64);

  std::vector<float> lse_l(static_cast<size_t>(nq * n));
  attn::AttentionArgs a;
  a.q = q_local;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = TensorView(lse_l.data(), DType::F32, {nq, n});
  a.scale = scale;
  a.q_begin = l.global + l.local;
  attn::sparse_attention_cpu(a, ix.local, pool);
  if (l.global == 0) {
    if (lse) std::copy(lse_l.begin(), lse_l.end(), lse);
    return;
  }
  std::vector<float> out_g(static_cast<size_t>(n * nq * d)), lse_g(static_cast<size_t>(nq * n));
  attn::AttentionArgs g = a;
  g.q = q_global;
  g.out = TensorView(out_g.data(), DType::F32, {n, nq, d});
  g.lse = TensorView(lse_g.data(), DType::F32, {nq, n});
  attn::sparse_attention_cpu(g, ix.global, pool);

  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < nq; ++h) {
      const float ll = lse_l[static_cast<size_t>(h * n + r)], lg = lse_g[static_cast<size_t>(h * n + r)];
      const float m = std::max(ll, lg);
      float wl = 0, wg = 0, total = -std::numeric_limits<float>::infinity();
      if (m != -std::numeric_limits<float>::infinity()) {
        wl = std::exp(ll - m);
        wg = std::exp(lg - m);
        total = m + std::log(wl + wg);
        const float s = wl + wg;
        wl /= s;
        wg /= s;
      }
      float* o = out.ptr<float>() + r * out.stride[0] + h * out.stride[1];
      const float* og = out_g.data() + (r * nq + h) * d;
      for (int64_t i = 0; i < d; ++i) o[i * out.stride[2]] = wl * o[i * out.stride[2]] + wg * og[i];
      if (lse) lse[h * n + r] = total;
    }
  }
}

}  // namespace tessera::runtime::stream
