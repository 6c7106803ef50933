// tessera/runtime/stream/stream_layout.h — one chunk's attention under streaming memory, lowered to the flat index.
//
// The attention workspace of a layer holds the chunk's keys in three parts, [global | local | chunk]:
//   global  sinks + retrieved blocks, `global` rows: keys before RoPE; every query sees all of them, through a copy
//           of the chunk's queries rotated to one position (stream_options.h: all at distance n_local)
//   local   the local window before the chunk, `local` rows, and
//   chunk   the chunk's own `chunk` rows: keys rotated at their true positions; query row r sees the whole window
//           and the chunk's rows 0..r (causal), through the queries rotated at their true positions.
// The two query copies cannot share one call, so the layout lowers to two SparseIndexes over the same workspace
// (query row r at workspace position global + local + r): `global` with the one range [0, global) per tile, `local`
// with [global, tile_key_end) per tile (the executor clips it causally). Each runs through the existing sparse
// executor with its log-sum-exp, and the two outputs merge exactly:
//     out = (e^{lse_g} out_g + e^{lse_l} out_l) / (e^{lse_g} + e^{lse_l})
// — the softmax over the union of both key sets. The GPU path runs the same two indexes.
#pragma once

#include <cstdint>

#include "attention/index/sparse_index.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace tessera::runtime::stream {

struct StreamLayout {
  int32_t global = 0;  // sinks + retrieved block rows
  int32_t local = 0;   // local window rows before the chunk
  int32_t chunk = 0;   // the chunk's rows (queries)
  int32_t kv_len() const { return global + local + chunk; }
  bool operator==(const StreamLayout&) const = default;
};

struct StreamIndexes {
  attn::SparseIndex global;  // empty ranges when layout.global == 0
  attn::SparseIndex local;
};

// Both indexes for `q_heads` query heads and query tiles of `tile` rows.
StreamIndexes lower_stream_layout(const StreamLayout& layout, int32_t q_heads, int32_t tile);

// Attention of the chunk over the layout. q_local, q_global: [chunk, q_heads, d] f32 (rotated as above); k, v: the
// workspace [kv_len, kv_heads, d] f32; out: [chunk, q_heads, d] f32, written. scale 0: 1 / sqrt(d). lse, when
// non-null, receives the merged log-sum-exp [q_heads, chunk] (span discovery normalises with it). Throws
// tessera::Error when the shapes do not match the layout.
void streaming_attention_cpu(const StreamLayout& layout, const TensorView& q_local, const TensorView& q_global,
                             const TensorView& k, const TensorView& v, const TensorView& out, float scale,
                             ThreadPool& pool, float* lse = nullptr);

}  // namespace tessera::runtime::stream
