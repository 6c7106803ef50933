// tessera/runtime/batch_forward.h — one decode step of many sequences at once on the CPU, over a paged KV cache.
//
// The CPU twin of the GPU batched decode (runtime/cuda/batch_gpu.h) and the CPU batched engine's decode:
// B sequences, one token each at its own position; every matrix product runs once over the B rows (the point of
// batching: the weights are read once per step, not once per sequence); RoPE per row at the row's position; each
// row's K/V go into its sequence's blocks; attention per (row, query head) over the keys its DecodeView shows
// (paged_kv.h), read through the block tables: paged_decode_attention_cpu, the obvious loop the GPU kernel is
// checked against.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "runtime/cpu_ops.h"
#include "runtime/forward.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "runtime/paged_kv.h"
#include "runtime/stream/stream_memory.h"
#include "runtime/stream/streaming_kv.h"

namespace tessera::runtime {

// K and V of every block, f32: [num_blocks, block_tokens, head_dim] each.
class PagedKVStore {
 public:
  PagedKVStore() = default;
  // Throws tessera::Error when the blocks exceed the host memory budget or cannot be allocated.
  PagedKVStore(const PagedKVShape& shape, int32_t num_blocks);
  float* k(int32_t block, int64_t row) { return k_.get() + offset(block, row); }
  float* v(int32_t block, int64_t row) { return v_.get() + offset(block, row); }
  const float* k(int32_t block, int64_t row) const { return k_.get() + offset(block, row); }
  const float* v(int32_t block, int64_t row) const { return v_.get() + offset(block, row); }
  const PagedKVShape& shape() const { return shape_; }
  int32_t num_blocks() const { return num_blocks_; }
  size_t bytes() const { return 2 * elements_ * sizeof(float); }
  static double bytes_per_block(const PagedKVShape& shape) {
    return 2.0 * static_cast<double>(shape.elements_per_block()) * sizeof(float);
  }

 private:
  size_t offset(int32_t block, int64_t row) const {
    return (static_cast<size_t>(block) * static_cast<size_t>(shape_.block_tokens) + static_cast<size_t>(row)) *
           static_cast<size_t>(shape_.head_dim);
  }
  PagedKVShape shape_;
  int32_t num_blocks_ = 0;
  // Left uninitialised: the pages of blocks never used are never touched, so a large budget costs nothing until
  // sequences fill it.
  size_t elements_ = 0;
  std::unique_ptr<float[]> k_, v_;
};

// Copies the kept rows [0, seq.length()) of a contiguous cache (a sequence's prefill, runtime/kv_cache.h) into its
// blocks (the rows whose block is -1 are dropped: outside the retention).
void scatter_to_pages(KVCache& cache, const SequenceBlocks& seq, PagedKVStore& store);
// The other way: rows [0, rows) of seq's blocks into the cache (a cached prefix staged for the rest of its prompt;
// rows whose block is -1 are left as they are: no query of the prompt reads them).
void gather_from_pages(const PagedKVStore& store, const SequenceBlocks& seq, int64_t rows, KVCache& cache);

// One decode row: the sequence (its blocks already grown to hold the row's position, i.e. length() = pos + 1)
// and the decode views of every (layer, query head) of that sequence.
struct DecodeRow {
  const SequenceBlocks* seq = nullptr;
  std::span<const DecodeView> views;  // [layer * q_heads + q_head]
  // Streaming memory (runtime/stream/stream_memory.h; the backend's own kind: a StreamingKV on the CPU): the row's
  // sequence keeps its keys and values there instead of in blocks (seq and views unused), the row at position
  // stream->sequence_length(). A batch is all streamed or all paged.
  StreamMemory* stream = nullptr;
};

// Attention of one layer for B decode rows: q [B, q_heads, d] -> out [B, q_heads, d] (f32), row i attending over
// the keys of rows[i].seq at positions DecodeView::ranges(length) of its head, softmax in f32 with the scale.
void paged_decode_attention_cpu(const float* q, float* out, std::span<const DecodeRow> rows, int32_t layer,
                                int32_t num_q_heads, const PagedKVStore& store, float scale, ThreadPool& pool);

class BatchForward {
 public:
  // Runs the recipe (recipe.h) through `ops`, the CPU backend a Forward of the same model already holds (the scratch
  // is shared: a prefill chunk and a decode step never run at once on one backend). ops must outlive this.
  explicit BatchForward(CpuOps& ops) : ops_(ops) {}

  // tokens[i] at position rows[i].seq->length() - 1 (the blocks already grown by one row), or, for streamed rows, at
  // rows[i].stream->length() (each row's streaming memory attends to its own keys and takes the new row). Writes
  // each row's K/V, returns logits [B, vocab].
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows, PagedKVStore& store,
                            ForwardTimers& timers);

 private:
  CpuOps& ops_;
  std::vector<int32_t> positions_;
};

}  // namespace tessera::runtime
