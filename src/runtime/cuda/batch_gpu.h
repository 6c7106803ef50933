// tessera/runtime/cuda/batch_gpu.h — the batched engine's GPU backend (runtime/batch_engine.h).
//
//   auto dev = runtime::gpu::DeviceModel::upload(*model);
//   runtime::gpu::GpuBatchBackend backend(*dev);
//   runtime::BatchEngine engine(backend, options);     // the scheduler is the CPU engine's
//
// Prefill runs the single-sequence GPU forward (gpu_forward.h: the sparse executor, chunked) into a contiguous
// staging cache, whose kept rows are then scattered into the sequence's blocks (paged_decode.h) a layer at a time,
// each layer's staged rows freed once moved. The block pools are reserved address space (reserved_memory.h) backed
// by memory only where blocks are written, so that move holds the prompt's KV about once, not twice (a pool sized
// for a 128K Llama-3-8B context is 17 GB). Decode runs the B
// sequences' tokens as one step of the layer recipe (runtime/recipe.h) over the GPU ops (gpu_ops.h): one QKV GEMM
// and every other GEMM over B rows (cuBLAS, bf16), RoPE at each row's position, and the paged attention step
// (gpu_attention.h): each row's K/V appended to its blocks, paged flash-decoding attention with each head's own view
// (MoA spans, sliding windows); the logits [B, vocab] on the device (decode() copies them back; decode_select
// copies back only the chosen tokens, below). Block tables and views live on the
// device per sequence slot ([slots, layers * kv_heads, max_blocks]); a decode step uploads only the rows' step
// data and the table entries that changed (a new block every block_tokens tokens), then replays the CUDA graph of
// its (batch size, split count): every launch of the step (about 15 per layer) captured once, on first use. So
// that a server, whose batch changes at every request's start and end, reuses a few graphs instead of capturing
// one per batch size and length, the batch is padded to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ...
// rows (padding rows decode token 0 at position 0 into a scratch slot and block of their own; their results are
// dropped) and the split count is rounded down to a power of two. decode_select chooses every row's token on the
// device (row_argmax for greedy rows, sample_rows (sample_gpu.h) with the host's uniform draws for the others) and
// copies back only the tokens.
//
// Shapes the paged decode kernel does not run (head dims other than 64, 128 and 256, GQA groups over 8) and the simple
// attention backend (GpuBatchOptions::prefill.attention == kSimple, the tests' reference) decode each row through the
// prefill forward instead: its blocks staged contiguously (as load_prefix), one token run, its new row moved back into
// its block. That costs a copy of the row's KV per token: for small models and references, not for speed.
//
// The single-sequence GPU engine (gpu_engine.h) is the batched scheduler with one held sequence over this backend:
// timing (GpuBatchOptions::timing: CUDA events around the prefill's GEMMs, attention and small kernels, and the decode
// step's when it runs without graphs), memory() parts and release_memory() are for it.
//
// Not thread-safe; uses the current CUDA device; the DeviceModel must outlive it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <span>
#include <vector>

#include "cuda/device_buffer.h"
#include "runtime/batch_engine.h"
#include "runtime/cuda/device_kv_cache.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/gpu_attention.h"
#include "runtime/cuda/gpu_forward.h"
#include "runtime/cuda/gpu_ops.h"
#include "runtime/cuda/paged_decode.h"
#include "runtime/cuda/reserved_memory.h"
#include "runtime/cuda/sample_gpu.h"

namespace tessera::runtime::gpu {

struct GpuBatchOptions {
  ForwardOptions prefill;  // the prefill forward's options (mlp_chunk, tile, attention backend, ...)
  int32_t splits = 0;      // decode attention splits per (row, kv head); 0: chosen per step from the lengths
  bool graphs = true;      // run each decode step as a CUDA graph (one per batch size and split count)
  bool pad_rows = true;    // pad the batch to padded_rows(n) rows (fewer distinct graphs)
  // kFp8: the prefill's GEMMs in E4M3 (the weights quantized once, here: DeviceFp8Weights; activations quantized per
  // product; the LM head stays bf16).
  GemmPrecision gemm = GemmPrecision::kBf16;
  // The decode step's GEMMs (kFp8 needs gemm == kFp8). bf16 by default: W8A8 decode at a few rows is slower than bf16
  // on an H200 (decode_bench --gemm: 8.49 against 6.94 ms a step at 32K, batch 1), and a step of 3+ rows has been
  // measured to differ from the single-sequence FP8 decode by up to 6% (rel L2) on one row (docs/PERF.md).
  // kW4 (with gemm kBf16 or kW4, the prefill then bf16): the decode step's products of up to kW4Rows rows read a 4-bit
  // copy of the layers' weights (DeviceW4Weights, quantized once, here), larger ones the bf16 weights.
  GemmPrecision decode_gemm = GemmPrecision::kBf16;
  // The KV blocks' element type: bf16, or FP8 E4M3 with a scale per stored K and V row (paged_decode.h: half the
  // bytes a decode step reads and holds, twice the tokens a KV budget holds). The prefill still attends over its bf16
  // staging cache; the blocks get the codes at its end (finish_prefill), the decode step (and the mixed step's decode
  // rows) read them, a cached prefix is staged back dequantized. Needs the paged decode kernel (not kSimple, head
  // dims 64/128/256, GQA groups up to 8): the constructor throws otherwise. Streamed sequences keep their own bf16
  // memory.
  KVPrecision kv = KVPrecision::kBf16;
  // CUDA events around every GEMM, attention and small kernel of the prefill (and of eager decode steps: a step
  // replayed as a graph is not timed by category): timers(), kernel_seconds(). Off for the server.
  bool timing = false;
};

// GPU time of the small kernels within prefill and decode (CUDA events around each launch; 0 without timing).
struct GpuKernelSeconds {
  double norm = 0;        // RMSNorms (before attention and MLP, Gemma-3's post-norms, final)
  double rope = 0;        // RoPE tables, QK-norm + RoPE of q and k
  double activation = 0;  // the gated MLP's activation
  double misc = 0;        // embedding, QKV bias, logit softcap
  double total() const { return norm + rope + activation + misc; }
};

class GpuStreamingKV;
// The GPU streaming memory inside a StreamMemory made by GpuBatchBackend::new_stream; null for null. Throws
// tessera::Error for another backend's memory.
GpuStreamingKV* gpu_stream_kv(StreamMemory* memory);
const GpuStreamingKV* gpu_stream_kv(const StreamMemory* memory);

// The decode batch a step of n rows runs: n up to 4, then the next of 6, 8, 12, 16, 24, 32, 48, 64, 96, ...
int64_t padded_rows(int64_t n);
// The largest power of two <= splits (>= 1).
int32_t bucket_splits(int32_t splits);

class GpuBatchBackend final : public BatchBackend {
 public:
  explicit GpuBatchBackend(const DeviceModel& model, GpuBatchOptions options = {});
  ~GpuBatchBackend() override;
  GpuBatchBackend(const GpuBatchBackend&) = delete;
  GpuBatchBackend& operator=(const GpuBatchBackend&) = delete;

  const ModelConfig& config() const override { return model_.config(); }
  const char* device_name() const override { return "cuda"; }
  double block_bytes(const PagedKVShape& shape) const override {  // K and V rows, FP8's scales included
    return 2.0 * shape.block_tokens * static_cast<double>(kv_row_bytes(options_.kv, shape.head_dim));
  }
  double default_kv_bytes() const override;
  // Checks the pools against free device memory first ("KV cache of N blocks needs X, Y free").
  void create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                    int32_t max_context) override;
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override;
  bool supports_prompt_logits() const override { return true; }
  std::vector<float> prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                        const attn::AttentionPolicy* policy) override;
  std::vector<double> prefill_chunk_logprobs(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                             const attn::AttentionPolicy* policy,
                                             std::span<const int32_t> next) override;
  void finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) override;
  void abort_prefill() override;
  bool supports_prefix_cache() const override { return true; }
  bool mixed_step_by_default() const override { return true; }
  void load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) override;
  void release_sequence(const SequenceBlocks& seq) override;
  // Streaming memory: each streamed sequence its own GpuStreamingKV (stream_gpu_kv.h); its prefill chunks run the
  // prefill forward through it, and a decode step of streamed rows runs the recipe once over all rows (every product
  // over B rows), each row attending through its own memory (not captured: the memories decide on the host).
  std::unique_ptr<StreamMemory> new_stream(const StreamOptions& options) override;
  std::vector<float> prefill_stream_chunk(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                          StreamingKV::ChunkKind kind, bool logits) override;
  std::vector<float> prefill_stream_chunk_rows(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                               StreamingKV::ChunkKind kind) override;
  std::vector<double> prefill_stream_chunk_logprobs(StreamMemory& kv, std::span<const int32_t> tokens, int32_t pos,
                                                    StreamingKV::ChunkKind kind,
                                                    std::span<const int32_t> next) override;
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) override;
  std::vector<int32_t> decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                     std::span<const RowChoice> choice) override;
  // The mixed step (BatchBackend::mixed_step): the prefill chunk and the paged decode rows as one eager step of the
  // prefill forward's ops (GpuForward::run_mixed: every GEMM over n + B rows, the chunk's attention through the
  // contiguous route under its policy, the decode rows' through the paged decode kernel, B rows unpadded, no graph);
  // the decode rows' tokens chosen on the device as decode_select does. Streamed rows, rows the paged kernel does not
  // run and an FP8 prefill beside bf16 decode GEMMs go through the default (two calls).
  bool mixes() const override { return true; }
  std::vector<int32_t> mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                  const attn::AttentionPolicy* policy, bool logits, std::vector<float>* chunk_logits,
                                  std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                  std::span<const RowChoice> choice) override;
  int64_t step_builds() const override { return step_builds_; }
  // GEMM and attention seconds (CUDA events, GpuBatchOptions::timing; else 0), summed since construction.
  ForwardTimers timers() const override { return timers_; }
  const GpuKernelSeconds& kernel_seconds() const { return kernel_seconds_; }
  // Whether decode steps run the paged kernel (else through the prefill forward, see above).
  bool paged_decode() const { return paged_decode_; }

  // Memory, for the single-sequence engine's memory(): the prefill forward's and the decode step's activations and
  // the GEMM workspaces; the most device memory in use (the whole device, sampled inside prefill chunks) since
  // reset_peak(); the staged prefill's contiguous cache (0 between prefills).
  size_t scratch_bytes() const;
  size_t peak_device_bytes() const { return prefill_->peak_device_bytes(); }
  void reset_peak() { prefill_->reset_peak(); }
  size_t staging_bytes() const { return staging_.bytes(); }
  // Frees the scratch buffers and any staged prefill (the next call allocates them again; graphs are captured anew).
  void release_scratch();

  // Tensor parallelism (parallel/cuda/tp_batch_gpu.h): the prefill's and the decode step's output and down
  // projections all-reduce over the ranks (GpuOps::RankReduce). Before the first step.
  void set_rank_reduce(const GpuOps::RankReduce& reduce);
  // A sequence whose blocks already hold its keys (benchmarks: random KV; no prefill): takes a slot and uploads
  // its table and views.
  void adopt(const SequenceBlocks& seq, std::span<const DecodeView> views);
  // Fills every block with pseudo-random bf16 in [-scale, scale] (benchmarks).
  void fill_random(uint64_t seed, float scale);
  // The pools' committed memory (blocks written so far, in chunks) and the tables.
  size_t store_bytes() const { return pool_bytes() + tables_.bytes() + views_.bytes(); }
  size_t pool_bytes() const {
    return k_pool_.committed_bytes() + v_pool_.committed_bytes() + k_scale_.committed_bytes() +
           v_scale_.committed_bytes();
  }
  KVPrecision kv_precision() const { return options_.kv; }
  // With no block in use (the single-sequence engine's reset()): the pools' memory back to the device, except the
  // padding rows' scratch block.
  void release_free_memory() override;
  cudaStream_t stream() const { return stream_; }
  int32_t last_splits() const { return last_splits_; }
  int64_t last_rows() const { return last_rows_; }  // the padded batch of the last step
  int64_t graphs() const { return static_cast<int64_t>(graphs_.size()); }
  // Diagnostics (prefix_cache_gpu_test's probe; synchronous): rows [0, rows) of layer l's staged K and V
  // ([rows, kv_heads * head_dim] each); block `id`'s K and V ([block_tokens, head_dim] each); the device's block table
  // of seq's slot ([layers * kv_heads, max_blocks]) and its views ([layers * q_heads, 3]), as the decode step reads them.
  void download_staged(int32_t layer, int32_t rows, std::vector<bf16>& k, std::vector<bf16>& v);
  void download_block(int32_t id, std::vector<bf16>& k, std::vector<bf16>& v);  // bf16 pools (throws for FP8)
  // FP8 pools: block `id`'s K and V codes ([block_tokens, head_dim] each) and their rows' scales ([block_tokens]).
  void download_block_fp8(int32_t id, std::vector<uint8_t>& k, std::vector<uint8_t>& v, std::vector<float>& k_scale,
                          std::vector<float>& v_scale);
  std::vector<int32_t> download_table(const SequenceBlocks& seq) const;
  std::vector<int32_t> download_views(const SequenceBlocks& seq) const;
  int32_t max_blocks() const { return max_blocks_; }
  // The FP8 copy of the layers' weights (GpuBatchOptions::gemm == kFp8), or 0; whether the decode step reads it.
  size_t fp8_weight_bytes() const { return fp8_ ? fp8_->bytes() : 0; }
  bool decode_fp8() const { return decode_fp8_; }
  // The 4-bit copy of the layers' weights (GpuBatchOptions::decode_gemm == kW4), or 0.
  size_t w4_weight_bytes() const { return w4_ ? w4_->bytes() : 0; }

 private:
  // Rows [0, len) of seq's kept blocks between the staging cache and the pool (paged_copy), synchronously; only the
  // blocks from the one holding row `from` on.
  // Layer by layer, each layer's blocks committed first; after_layer(l) once layer l's copy is launched (on the stream).
  void copy_pages(const SequenceBlocks& seq, int64_t len, PageCopy direction, int64_t from = 0,
                  const std::function<void(int32_t)>& after_layer = {});
  void commit_block(int32_t id);  // backs block id's K and V (and FP8 scales) with memory (ReservedMemory::commit)
  void begin_staging(int32_t total_len);  // a fresh staging cache for a prompt of total_len tokens
  PagedPools pools() const {
    return {options_.kv, k_pool_.data(), v_pool_.data(), static_cast<float*>(k_scale_.data()),
            static_cast<float*>(v_scale_.data())};
  }
  size_t pool_block_bytes() const;  // one block of one pool (K or V): elements or codes
  // op(memory, offset, bytes) for block id's range of each pool: K, V and, with FP8 KV, their scales.
  template <class Op>
  void for_each_pool(int32_t id, const Op& op);
  // Uploads the step data of the rows (padded with scratch rows) and runs the decode step; the logits of the
  // padded batch stay on the device (logits_). Returns the padded row count.
  int64_t run_step(std::span<const int32_t> tokens, std::span<const DecodeRow> rows);
  // Decode rows one at a time through the prefill forward (shapes the paged kernel does not run); logits_host_.
  void run_rows_through_prefill(std::span<const int32_t> tokens, std::span<const DecodeRow> rows);
  void collect_timers();  // the events recorded so far into timers_ / kernel_seconds_ (synchronises)
  // A prefill chunk of a streamed sequence (prefill_stream_chunk, _rows, _logprobs): run(kv) runs the prefill
  // forward through its memory and returns what the chunk gives; `wait`: it gives something (the stream is
  // synchronised and the timers collected; so is the prompt's last chunk).
  template <class Run>
  auto stream_chunk(StreamMemory& memory, std::span<const int32_t> tokens, int32_t pos, StreamingKV::ChunkKind kind,
                    bool wait, const Run& run);
  // The same for streamed rows (no padding, no graph).
  int64_t run_stream_step(std::span<const int32_t> tokens, std::span<const DecodeRow> rows);
  int32_t slot_of(const SequenceBlocks& seq) const;
  bool reserve_step(int64_t n, int32_t splits);  // true when a buffer was reallocated
  void launch_step(int64_t n, int32_t splits);   // every launch of a decode step (captured into a graph)
  // The paged decode's layout (layout_) for `rows` rows whose positions, slots, lengths and new rows' blocks are the
  // given device arrays (the step's data uploaded for it), with the step's scratch.
  void set_layout(const int32_t* pos, const int32_t* slot, const int32_t* len, const int32_t* blocks, int64_t rows,
                  int32_t splits);
  // decode_select's choice on the device over logits [n, vocab] (n = choice.size()), edited in place: the tokens.
  std::vector<int32_t> select_on_device(float* logits, std::span<const RowChoice> choice);
  void drop_graphs() noexcept;
  void upload_table_columns(int32_t slot, const SequenceBlocks& seq, int64_t b0, int64_t b1);

  const DeviceModel& model_;
  GpuBatchOptions options_;
  const ModelConfig& cfg_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<DeviceFp8Weights> fp8_;  // GemmPrecision::kFp8 only
  bool decode_fp8_ = false;                // the decode ops run FP8 GEMMs (GpuBatchOptions::decode_gemm)
  std::unique_ptr<DeviceW4Weights> w4_;    // GpuBatchOptions::decode_gemm == kW4 only
  EventTimer timer_{false};    // the prefill's (and eager decode steps') events: GpuBatchOptions::timing
  EventTimer untimed_{false};  // the decode ops' when their steps are captured into graphs
  bool paged_decode_ = true;
  ForwardTimers timers_;
  GpuKernelSeconds kernel_seconds_;
  std::vector<float> logits_host_;  // run_rows_through_prefill's
  std::unique_ptr<GpuForward> prefill_;
  DeviceKVCache staging_;
  int64_t staged_from_ = 0;  // rows below it were staged from the sequence's own blocks (load_prefix)
  PagedKVShape shape_;
  int32_t max_blocks_ = 0, slots_ = 0, sms_ = 0, last_splits_ = 0;
  int32_t scratch_block_ = 0;  // the padding rows' block (one past the pool's blocks); their slot is slots_
  int64_t last_rows_ = 0, step_builds_ = 0;
  ReservedMemory k_pool_, v_pool_;  // (num_blocks + 1) blocks each, the scratch block last
  ReservedMemory k_scale_, v_scale_;  // FP8: a float per row of each block, [num_blocks + 1, block_tokens]
  attn::gpu::DeviceBuffer<int32_t> tables_, views_;
  std::vector<int32_t> host_tables_;  // mirror of tables_
  std::vector<int32_t> free_slots_;
  std::map<const SequenceBlocks*, int32_t> slot_;
  std::map<std::pair<int64_t, int32_t>, cudaGraphExec_t> graphs_;  // (rows, splits) -> the decode step
  // FP8: the (rows, splits) steps run once eagerly before their capture (cuBLASLt's plans, buffers and algorithm
  // choice are set up outside a capture, as GpuDecode does); the Gemm's buffer generation the graphs were made at.
  std::set<std::pair<int64_t, int32_t>> warmed_;
  int64_t gemm_generation_ = 0;
  // The decode step: the layer recipe over the GPU ops (their scratch: activations, logits) with the paged
  // attention step over the pools.
  std::unique_ptr<GpuOps> ops_;
  PagedLayout layout_;
  std::unique_ptr<PagedDecodeStep> paged_;
  attn::gpu::DeviceBuffer<int32_t> step_;  // tokens, positions, slots, lengths, append blocks
  attn::gpu::DeviceBuffer<int32_t> chosen_;  // the step's tokens: row_argmax of every row, then the sampled rows'
  attn::gpu::DeviceBuffer<SampleRow> sample_rows_;
  attn::gpu::DeviceBuffer<RowEdit> row_edits_;  // the step's penalties and logit biases (edit_rows)
  attn::gpu::DeviceBuffer<double> sample_scratch_;
  attn::gpu::DeviceBuffer<float> o_part_, lse_part_;
  attn::gpu::DeviceBuffer<int32_t> mixed_;  // the mixed step's positions, then its decode rows' slots, lengths, blocks
};

}  // namespace tessera::runtime::gpu
