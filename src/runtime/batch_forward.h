// tessera/runtime/batch_forward.h — one decode step of many sequences at once on the CPU, over a paged KV cache.
//
// The CPU twin of the GPU batched decode (runtime/cuda/batch_gpu.h) and the CPU batched engine's decode:
// B sequences, one token each at its own position; every matrix product runs once over the B rows (the point of
// batching: the weights are read once per step, not once per sequence); RoPE per row at the row's position; each
// row's K/V go into its sequence's blocks; attention per (row, query head) over the keys its DecodeView shows
// (paged_kv.h), read through the block tables: paged_decode_attention_cpu (the kernel of
// attention/cpu/paged_decode.h, which the GPU kernel is checked against).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "runtime/cpu_ops.h"
#include "runtime/forward.h"
#include "runtime/kv_cache.h"
#include "model/model.h"
#include "runtime/paged_kv.h"
#include "runtime/stream/stream_memory.h"
#include "runtime/stream/streaming_kv.h"

namespace tessera::runtime {

// K and V of every block, [num_blocks, block_tokens, head_dim] each, in f32, bf16 or f16 (the CPU KV type: --kv-type,
// EngineOptions::kv_type; kv_cache.h). A half store takes the new rows converted (f32_to_half) and the decode
// attention converts each block's keys and values back to f32 as it reaches them, as the contiguous cache's readers
// do: half the bytes kept and read per token.
class PagedKVStore {
 public:
  PagedKVStore() = default;
  // Throws tessera::Error when the blocks exceed the host memory budget or cannot be allocated.
  PagedKVStore(const PagedKVShape& shape, int32_t num_blocks, KVType type = KVType::F32);
  // Row `row` of a block as f32, f32 stores only (throws otherwise).
  float* k(int32_t block, int64_t row) { return as_f32(k_.get(), block, row); }
  float* v(int32_t block, int64_t row) { return as_f32(v_.get(), block, row); }
  const float* k(int32_t block, int64_t row) const { return as_f32(k_.get(), block, row); }
  const float* v(int32_t block, int64_t row) const { return as_f32(v_.get(), block, row); }
  // Row `row` of a block in the store's type (row_bytes() bytes a row), any type.
  std::byte* k_bytes(int32_t block, int64_t row) { return k_.get() + offset(block, row) * elem_; }
  std::byte* v_bytes(int32_t block, int64_t row) { return v_.get() + offset(block, row) * elem_; }
  const std::byte* k_bytes(int32_t block, int64_t row) const { return k_.get() + offset(block, row) * elem_; }
  const std::byte* v_bytes(int32_t block, int64_t row) const { return v_.get() + offset(block, row) * elem_; }
  size_t row_bytes() const { return static_cast<size_t>(shape_.head_dim) * elem_; }
  // Writes n rows [row, row + n) of a block from f32 ([n, head_dim] each), converted to the store's type.
  void write(int32_t block, int64_t row, int64_t n, const float* k_rows, const float* v_rows);
  // Reads n rows [row, row + n) of a block as f32 (exact: the stored values).
  void read(int32_t block, int64_t row, int64_t n, float* k_rows, float* v_rows) const;
  KVType type() const { return type_; }
  const PagedKVShape& shape() const { return shape_; }
  int32_t num_blocks() const { return num_blocks_; }
  size_t bytes() const { return 2 * elements_ * elem_; }
  // Gives the pages of every block back to the system (madvise MADV_DONTNEED: they read as zero when touched
  // again). Only when no block holds rows that will be read: the single-sequence engine between sequences, so that
  // the next prompt's staging cache and its blocks are not both resident (the blocks' pages are touched again as
  // they fill).
  void release_pages();
  static double bytes_per_block(const PagedKVShape& shape, KVType type = KVType::F32) {
    return 2.0 * static_cast<double>(shape.elements_per_block()) * static_cast<double>(kv_type_size(type));
  }

 private:
  size_t offset(int32_t block, int64_t row) const {
    return (static_cast<size_t>(block) * static_cast<size_t>(shape_.block_tokens) + static_cast<size_t>(row)) *
           static_cast<size_t>(shape_.head_dim);
  }
  float* as_f32(std::byte* base, int32_t block, int64_t row) const;
  PagedKVShape shape_;
  int32_t num_blocks_ = 0;
  KVType type_ = KVType::F32;
  size_t elem_ = sizeof(float);
  // Left uninitialised: the pages of blocks never used are never touched, so a large budget costs nothing until
  // sequences fill it.
  size_t elements_ = 0;
  std::unique_ptr<std::byte[]> k_, v_;
};

// Copies the kept rows [0, seq.length()) of a contiguous cache (a sequence's prefill, runtime/kv_cache.h) into its
// blocks (the rows whose block is -1 are dropped: outside the retention). The cache and the store hold one type (a
// byte copy: no rounding on the way).
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
// the keys of rows[i].seq at positions DecodeView::ranges(length) of its head, softmax in f32 with the scale. One
// work item per (row, kv head): the GQA group's query heads that see the same keys go through them together, a
// span per block, in attn::paged_decode (attention/cpu/paged_decode.h: AVX-512 / AVX2 / portable, chosen at run
// time; each key and value read once, converted from a half store in registers); heads with different views (MoA)
// one at a time. When the items are too few for the pool (Gemma-3's one KV head: one item per row) an item's keys are
// cut into parts run on different threads and merged (attn::paged_decode_parts, paged_decode_merge).
// A (row, KV head) whose query heads share a dense view (all keys up to the row, or a model window's last keys: no MoA
// sink or span) goes through attn::paged_decode_in_prefill_order instead when prefill_order (default:
// decode_in_prefill_order(true)):
// the row's output is then the same bits as the same row prefilled in any chunk, so a prefix that holds decoded rows
// gives the next turn the KV its prefill would have computed (issue 34); not split across keys (its heads may be).
// scale: 0 for 1 / sqrt(head_dim) (as AttentionArgs::effective_scale).
void paged_decode_attention_cpu(const float* q, float* out, std::span<const DecodeRow> rows, int32_t layer,
                                int32_t num_q_heads, const PagedKVStore& store, float scale, ThreadPool& pool,
                                std::optional<bool> prefill_order = std::nullopt);
// The decode's order: true takes the prefill's order for dense views (~3x the attention's time of a decode step on
// the CPU), false attn::paged_decode's faster walk for every row (decoded rows then differ from prefilled ones in
// their last bits). The batched engine asks for the prefill's order (BatchEngineOptions::exact_decode: a later turn
// then prefills over decoded rows that equal prefilled ones, so its answers equal the uncached run's), the
// single-sequence engine for the fast walk: `by_default`. TESSERA_DECODE_ORDER (prefill or fast; read once, anything
// else is an error) or set_decode_in_prefill_order overrides it process-wide; benchmarks set it.
void set_decode_in_prefill_order(bool on);
bool decode_in_prefill_order(bool by_default);

class BatchForward {
 public:
  // Runs the recipe (recipe.h) through `ops`, the CPU backend a Forward of the same model already holds (the scratch
  // is shared: a prefill chunk and a decode step never run at once on one backend). ops must outlive this.
  explicit BatchForward(CpuOps& ops) : ops_(ops) {}
  // The decode's order by default (decode_in_prefill_order's `by_default`): false until set (CpuBatchBackend sets it
  // from BatchEngineOptions::exact_decode).
  void set_prefill_order(bool on) { prefill_order_ = on; }

  // tokens[i] at position rows[i].seq->length() - 1 (the blocks already grown by one row), or, for streamed rows, at
  // rows[i].stream->length() (each row's streaming memory attends to its own keys and takes the new row). Writes
  // each row's K/V, returns logits [B, vocab].
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows, PagedKVStore& store,
                            ForwardTimers& timers);

  // The mixed step (vLLM's chunked prefill, SGLang's mixed batches): a prefill chunk of the staged sequence and B
  // paged decode rows as ONE forward over the concatenated rows [chunk rows, decode rows]: the embedding, the norms,
  // every product and the head run once over all of them; the attention splits: the chunk's rows attend as
  // runtime::Forward's prefill does (their K/V into `cache` at [pos, pos + n), the executor under `policy` with
  // total_len, the model's sliding windows; `observer` called with the chunk's arguments), the decode rows as
  // decode() (paged, their views). Each row's result is the one the two forwards give apart up to the products'
  // summation order (every product and norm is per row, but BLAS and qmatmul pick their kernels by the row count:
  // the last bits may differ). Returns the logits of the chunk's last row (when chunk_logits) then of the B decode rows:
  // [(chunk_logits ? 1 : 0) + B, vocab]. Paged rows only (no streamed rows); rows non-empty.
  std::vector<float> mixed(std::span<const int32_t> chunk, int32_t pos, KVCache& cache,
                           const attn::AttentionPolicy* policy, int32_t total_len, const AttentionObserver* observer,
                           bool chunk_logits, std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                           PagedKVStore& store, ForwardTimers& timers);

 private:
  CpuOps& ops_;
  std::vector<int32_t> positions_;
  std::vector<int32_t> all_tokens_;  // the mixed step's rows
  bool prefill_order_ = false;
};

}  // namespace tessera::runtime
