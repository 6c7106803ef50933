#include "runtime/sliding_window.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/cpu/sparse_attention.h"
#include "core/error.h"

namespace tessera::runtime {

namespace {

void check_shape(int32_t q_begin, int32_t q_len, int32_t kv_len, int32_t window, int32_t tile) {
  check(window > 0, "sliding window: window must be positive");
  check(tile > 0, "sliding window: tile must be positive");
  check(q_begin >= 0 && q_len >= 0 && kv_len >= q_begin + q_len,
        "sliding window: kv_len is less than q_begin + q_len");
}

// Start of piece A's keys for the tile holding row r: P1 - window, where P1 is one past the tile's last
// position.
int32_t tile_start(int32_t q_begin, int32_t q_len, int32_t r, int32_t window, int32_t tile) {
  const int32_t p1 = q_begin + std::min(q_len, (r / tile + 1) * tile);
  return std::max(0, p1 - window);
}

}  // namespace

attn::SparseIndex sliding_window_tile_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                            int32_t window, int32_t tile) {
  check_shape(q_begin, q_len, kv_len, window, tile);
  attn::SparseIndex ix;
  ix.num_heads = num_heads;
  ix.tile = tile;
  ix.q_begin = q_begin;
  ix.q_len = q_len;
  ix.kv_len = kv_len;
  const int32_t tiles = ix.num_tiles();
  const size_t cells = static_cast<size_t>(num_heads) * static_cast<size_t>(tiles);
  ix.range_offsets.resize(cells + 1);
  ix.column_offsets.assign(cells + 1, 0);
  for (int32_t h = 0; h < num_heads; ++h) {
    for (int32_t t = 0; t < tiles; ++t) {
      ix.range_offsets[static_cast<size_t>(h) * static_cast<size_t>(tiles) + static_cast<size_t>(t)] =
          static_cast<int32_t>(ix.ranges.size());
      const int32_t end = ix.tile_key_end(t);
      const int32_t begin = tile_start(q_begin, q_len, t * tile, window, tile);
      if (begin < end) ix.ranges.push_back({begin, end});
    }
  }
  ix.range_offsets[cells] = static_cast<int32_t>(ix.ranges.size());
  return ix;
}

attn::SparseIndex sliding_window_rest_index(int32_t num_heads, int32_t q_begin, int32_t q_len, int32_t kv_len,
                                            int32_t window, int32_t tile) {
  check_shape(q_begin, q_len, kv_len, window, tile);
  attn::SparseIndex ix;
  ix.num_heads = num_heads;
  ix.tile = 1;
  ix.q_begin = q_begin;
  ix.q_len = q_len;
  ix.kv_len = kv_len;
  const size_t cells = static_cast<size_t>(num_heads) * static_cast<size_t>(q_len);
  ix.range_offsets.resize(cells + 1);
  ix.column_offsets.assign(cells + 1, 0);
  for (int32_t h = 0; h < num_heads; ++h) {
    for (int32_t r = 0; r < q_len; ++r) {
      ix.range_offsets[static_cast<size_t>(h) * static_cast<size_t>(q_len) + static_cast<size_t>(r)] =
          static_cast<int32_t>(ix.ranges.size());
      const int32_t p = q_begin + r;
      const int32_t begin = std::max(0, p - window + 1);
      const int32_t end = std::min(p + 1, tile_start(q_begin, q_len, r, window, tile));
      if (begin < end) ix.ranges.push_back({begin, end});
    }
  }
  ix.range_offsets[cells] = static_cast<int32_t>(ix.ranges.size());
  return ix;
}

void sliding_window_attention(const attn::AttentionArgs& args, int32_t window, ThreadPool& pool) {
  check(!args.has_lse(), "sliding window attention: lse output is not supported");
  constexpr int32_t kTile = 64;
  const auto heads = static_cast<int32_t>(args.num_q_heads());
  const auto q_len = static_cast<int32_t>(args.q_len());
  const auto kv_len = static_cast<int32_t>(args.kv_len());
  const int64_t d = args.head_dim();
  if (q_len == 0) return;

  // Piece A into args.out, piece B into scratch; both with their log-sum-exps.
  std::vector<float> lse_a(static_cast<size_t>(heads) * static_cast<size_t>(q_len));
  std::vector<float> lse_b(lse_a.size());
  std::vector<float> out_b(static_cast<size_t>(q_len) * static_cast<size_t>(heads) * static_cast<size_t>(d));
  attn::AttentionArgs a = args;
  a.lse = TensorView(lse_a.data(), DType::F32, {heads, q_len});
  attn::sparse_attention_cpu(a, sliding_window_tile_index(heads, args.q_begin, q_len, kv_len, window, kTile),
                             pool);
  attn::AttentionArgs b = args;
  b.out = TensorView(out_b.data(), DType::F32, {q_len, heads, d});
  b.lse = TensorView(lse_b.data(), DType::F32, {heads, q_len});
  attn::sparse_attention_cpu(b, sliding_window_rest_index(heads, args.q_begin, q_len, kv_len, window, kTile),
                             pool);

  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int32_t r = 0; r < q_len; ++r) {
    for (int32_t h = 0; h < heads; ++h) {
      const float la = lse_a[static_cast<size_t>(h) * static_cast<size_t>(q_len) + static_cast<size_t>(r)];
      const float lb = lse_b[static_cast<size_t>(h) * static_cast<size_t>(q_len) + static_cast<size_t>(r)];
      if (lb == kNegInf) continue;  // piece A alone (already in out)
      float* o = args.out.at<float>(r, h);
      const float* ob = out_b.data() + (static_cast<int64_t>(r) * heads + h) * d;
      if (la == kNegInf) {
        for (int64_t i = 0; i < d; ++i) o[i * args.out.stride[2]] = ob[i];
        continue;
      }
      const float m = std::max(la, lb);
      const float wa = std::exp(la - m), wb = std::exp(lb - m);
      const float inv = 1.0f / (wa + wb);
      for (int64_t i = 0; i < d; ++i) {
        float& x = o[i * args.out.stride[2]];
        x = (wa * x + wb * ob[i]) * inv;
      }
    }
  }
}

}  // namespace tessera::runtime
