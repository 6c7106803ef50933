// tessera/runtime/cuda/stream_gpu_kv.h — streaming memory on the GPU: the twin of runtime/stream/streaming_kv.h.
//
// A GpuKVPolicy (gpu_forward.h): GpuForward hands it each layer's chunk (q, k, v in bf16 before RoPE) and it
// attends over InfLLM's layout [sinks + retrieved blocks | local window | chunk] on the device:
//  - decisions: a runtime::StreamingKV with Storage::Device, the CPU path's own code: evictions (and their index
//    vectors), the chunk's attention map, Ltri spans, retrieval, retrieval-head and collaborative voting, the layout.
//    For ltri / infllm the heavy parts run on the device (stream_decide.h: the chunk's map and votes, Ltri's block
//    scores against a device mirror of the span index, InfLLM's mean query) and the class decides on them through
//    StreamingKV::plan(..., DeviceDecisions); the host gets the votes, Ltri's span candidates (<= 2n - 1) and its
//    spans' masses, InfLLM's raw keys of the rows the evictions index (gathered from the ring; Ltri's go from the
//    ring into its index mirror, the host index only counts them) and the block scores
//    (InfLLM's scored on the device against a mirror of the block means) — never the chunk's q, K or map (but for
//    Ltri's non-linear variant, which takes the map) — and waits for the device three times per layer and chunk
//    (ltri: keys and candidates, masses, scores; infllm: keys and votes, scores).
//    With device_decisions(false) / TESSERA_STREAM_DECISIONS=host, the class computes them itself from f32 copies of
//    q and k (the earlier path). streamingllm needs none (the GPU never waits for the host). On the device's results
//    the CPU class decides exactly as the GPU path (tests/gpu/engine_tests/stream_gpu_test.cpp checks it);
//  - device memory per layer: the sinks' raw K/V, a ring of the recent tokens' raw K/V (capacity: local + block +
//    chunk, rounded up to blocks, plus one block; a block never wraps), and a cache of top_k retrieved blocks;
//    one workspace for the chunk being attended ([global | local | chunk], as the CPU's). Bounded whatever the length;
//  - evicted blocks (ltri / infllm; streamingllm never retrieves one and drops them: no pinned memory, no copies,
//    no host budget): pinned host memory (slabs of 256 blocks, bf16 — or FP8 with StreamOptions::host_fp8: quantized
//    on the copy stream, a scale per token and kv head, 0.52x the bytes, dequantized into the workspace —: anonymous huge-page memory first touched by 8
//    threads then cudaHostRegister'ed; TESSERA_STREAM_PIN=alloc: cudaHostAlloc), copied out of the ring on a copy
//    stream (device-to-host, ordered by events before the ring rows are overwritten), within the host budget of the
//    decisions' store (the CPU store's error messages); the slabs a prompt needs are allocated by a host thread ahead
//    of the chunks that fill them (reserve());
//  - retrieved blocks: those not already in the layer's block cache are copied host-to-device on the copy stream as
//    soon as the layer's retrieval is known; the local half of the attention runs meanwhile, the global half waits on
//    the copy's event. The cache holds top_k x 4 blocks (TESSERA_STREAM_CACHE=N: x N), the least recently read
//    replaced first. At decode (blocks persisted from the last prefill chunk) they are all in the cache;
//  - attention: the two SparseIndexes of stream_layout.h (lower_stream_layout, the CPU's) through the CUDA sparse
//    executor (attn::gpu::sparse_prefill) with their log-sum-exps, merged exactly (stream_kernels.h).
// Positions as the CPU path: local window and chunk rotated at their true positions in the workspace, sinks and
// retrieved blocks raw, the global queries rotated to position `local`.
// Models with sliding-window layers (Gemma-3: 5 local layers of window 512 per global one) stream as on the CPU:
// a sliding-window layer keeps a device buffer of its last window - 1 tokens (K rotated at their true positions with
// that layer's RoPE table, V raw; LayerState::win_k / win_v) and attends chunk x (held + chunk) with the model's
// row-exact window through the same executor call as the local pass (attend_sliding()); it never evicts, indexes or
// retrieves: no decisions on the device, no ring, no pinned memory, no host budget (only global layers count, as
// StreamingKV::check_sequence). Each layer rotates with the RoPE table GpuForward hands it (Gemma-3: local and
// global bases), the decisions' map included; QK-norm is applied by GpuForward before q and k reach attend().
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <tuple>
#include <vector>

#include "attention/cuda/device_index.h"
#include "core/thread_pool.h"
#include "cuda/device_buffer.h"
#include "runtime/stream/streaming_kv.h"
#include "runtime/cuda/gpu_forward.h"
#include "runtime/cuda/pinned_buffer.h"
#include "runtime/cuda/stream_decide.h"

namespace tessera::runtime::gpu {

struct GpuStreamStats {
  int64_t blocks_to_device = 0;   // retrieved blocks copied host-to-device
  int64_t blocks_cached = 0;      // retrieved blocks already in the layer's block cache
  int64_t blocks_to_host = 0;     // evicted blocks copied device-to-host
  int64_t pinned_bytes = 0;       // pinned host memory allocated (slabs)
  double pin_seconds = 0;         // host time spent in cudaHostAlloc (the reserve thread's included)
  double decision_seconds = 0;    // host time in the decisions (copies of q / k, map, spans, retrieval)
  double decision_device_seconds = 0;  // ... of which waiting for the device's map and block scores (stream_decide.h)
  // With profile(true) (TESSERA_STREAM_PROFILE=1), GPU time (events) of attend()'s sections, summed by
  // collect_profile(): the workspace (window and chunk copied and rotated, the queries), the local pass, the global
  // pass with the merge (sinks and retrieved blocks copied in), the chunk stored into the sinks / ring.
  double workspace_gpu_seconds = 0, local_gpu_seconds = 0, global_gpu_seconds = 0, store_gpu_seconds = 0;
  // ... of the global pass's part: the compute stream waiting for the retrieved blocks' copies to the device.
  double copy_wait_gpu_seconds = 0;
  // ... and the decisions' device sections (map, span discovery, masses, index keys, block scores: GPU seconds by
  // events) and waits (the host's synchronisations with the device for the decisions), as the decider sums them.
  StreamDecider::Profile decide;
  // ... and the host's time between a decision's result coming back and the next device work it issues (the GPU has
  // nothing queued then), per mapping layer and chunk: after the candidates (until the masses are asked), after the
  // masses (until the block scores are asked), after the block scores (until the workspace's first launch).
  double host_gap_seconds[3] = {0, 0, 0};
};

// What the device computed for one layer's chunk (GpuStreamingKV::record(true); tests compare it with the CPU's).
struct GpuDecisionRecord {
  std::vector<float> map, votes;         // the chunk's map [n, n] and votes [n]
  std::vector<stream::Span> candidates;  // ltri (linear variant): the device's span candidates, and its theta
  double theta = 0;
  std::vector<stream::Span> mass_spans;  // ltri: the spans the host asked masses for, and the masses
  std::vector<stream::SpanMasses> masses;
  std::vector<int32_t> key_positions;    // the positions whose raw keys the evictions' index took from the ring
  std::vector<float> keys;               // ... and those keys [positions, kv_heads * d] (infllm; ltri keeps them on the device)
  std::vector<int32_t> tokens, counts;   // ltri: the query vectors' tokens and counts the host asked scores for
  std::vector<double> scores;            // the block scores returned (empty: none asked)
};

class GpuStreamingKV : public GpuKVPolicy {
 public:
  // Throws tessera::Error for models that cannot stream (check_model_streams) and options out of range.
  GpuStreamingKV(const ModelConfig& config, StreamOptions options);
  ~GpuStreamingKV() override;
  GpuStreamingKV(const GpuStreamingKV&) = delete;
  GpuStreamingKV& operator=(const GpuStreamingKV&) = delete;

  // The host budget check of StreamingKV::check_sequence (bf16 blocks).
  void check_sequence(int64_t tokens) const { host_.check_sequence(tokens); }
  // Starts allocating the pinned slabs a sequence of `tokens` tokens needs, on a host thread.
  void reserve(int64_t tokens);
  void wait_reserved();  // until the reserve thread has made what was asked (or failed)
  void begin_chunk(int32_t pos, int32_t n, StreamingKV::ChunkKind kind) {
    host_.begin_chunk(pos, n, kind);
    chunk_kind_ = kind;
  }
  void attend(int32_t layer, int32_t pos, int32_t n, bf16* q, bf16* k, bf16* v, const float* inv_freq,
              std::span<const float> inv_freq_host, float scale, bf16* out, cudaStream_t stream) override;
  void reset();

  const StreamingKV& decisions() const { return host_; }
  // Where the decisions' map, votes and block scores are computed: on the device (StreamDecider, the default) or,
  // with device_decisions(false) or TESSERA_STREAM_DECISIONS=host, by the CPU class from f32 copies of q and k.
  void device_decisions(bool on) { device_decisions_ = on; }
  bool device_decisions() const { return device_decisions_; }
  // Whether the block copies go in batches (the default): the evicted and retrieved blocks' host <-> device copies of a
  // layer and chunk in one cudaMemcpyBatchAsync, and the workspace's sinks and retrieved blocks in one kernel
  // (stream_copy_rows) rather than two cudaMemcpyAsync calls per block; TESSERA_STREAM_COPIES=each, or
  // batched_copies(false): the calls one by one (the path before; the same bytes).
  void batched_copies(bool on) { batched_copies_ = on; }
  // Whether a prefill chunk's device decisions run on a second stream (highest priority) while the compute stream
  // builds the workspace's local part and runs the local pass (TESSERA_STREAM_OVERLAP=1 or overlap_decisions(true));
  // off by default: one stream, the local pass after the decisions (overlapping the retrieved blocks' copies), which
  // measured faster (H200, 128K, Ltri-LLM's retrieval heads: 8.47 s against 8.83-9.43 s overlapped, same run). The same
  // operations on the same data: the same output, bit for bit.
  void overlap_decisions(bool on) { overlap_ = on; }
  bool overlap_decisions() const { return overlap_; }
  // Where a prefill chunk's local pass (with the workspace's local part) is queued on the one stream, for a layer
  // whose decisions run on the device: after the decisions (LocalAt::After, the default), or just before the host
  // waits for one of their results (candidates, masses, block scores: StreamDecider::before_next_wait), so that the
  // device runs it while the host works on that result instead of idling. The layout's sizes follow from the position
  // alone (as with overlap_decisions()) and are checked against the decisions'. TESSERA_STREAM_LOCAL_AT=after |
  // candidates | masses | scores. The same operations on the same data: the same output, bit for bit.
  enum class LocalAt { After = 0, Candidates = 1, Masses = 2, Scores = 3 };
  void local_at(LocalAt at) { local_at_ = at; }
  LocalAt local_at() const { return local_at_; }
  bool batched_copies() const { return batched_copies_; }
  // Whether the retrieved blocks' copies to the device run on their own stream (the default) or behind the
  // evictions' copies out (TESSERA_STREAM_COPY_IN=0): the same copies, the same output.
  bool split_copies() const { return split_copies_; }
  // streamingllm: whether its window is kept rotated in place (see window_kept_ below; default on).
  bool window_kept() const { return window_kept_; }
  // Keeps a copy of what the device computed for the last layer's chunk (recorded()).
  void record(bool on) { record_ = on; }
  const GpuDecisionRecord& recorded() const { return record_data_; }
  // Ltri with device decisions: the device index mirror's keys of `layer` (the host's span index only counts them).
  std::vector<float> device_index_keys(int32_t layer) const { return decider_ ? decider_->mirror_keys(layer) : std::vector<float>{}; }
  const GpuStreamStats& gpu_stats() const { return stats_; }
  // Times attend()'s sections with CUDA events (GpuStreamStats::*_gpu_seconds); collect_profile() waits for the
  // last event and adds what was recorded since the previous collect.
  void profile(bool on) {
    profile_ = on;
    if (decider_) decider_->profile(on);
  }
  void collect_profile();
  size_t device_bytes() const;  // the per-layer buffers, the block caches, the workspace, the indexes

 private:
  struct LayerState {
    attn::gpu::DeviceBuffer<bf16> sink_k, sink_v, ring_k, ring_v, cache_k, cache_v;
    std::vector<int32_t> cache_block;  // block held by each cache slot (-1: none)
    std::vector<int64_t> cache_used;   // when each slot was last read (cache_clock_; -1: never): misses replace the oldest
    std::vector<uint8_t*> host_k, host_v;  // pinned K and V of each evicted block (FP8: both the block's start)
    attn::gpu::DeviceBuffer<uint8_t> cache_fp8;  // FP8 (host_fp8): the block cache's slots, block_bytes_ each
    cudaEvent_t evicted = nullptr;     // the last device-to-host copy out of this layer's ring
    // streamingllm's window (window_kept()): the tokens after the sinks, K rotated at their true positions and V,
    // position p at row p - win_origin; rows [0, sinks) are kept free for a copy of the sinks before the window.
    // A sliding-window layer: its held tokens (the last window - 1) then the chunk, likewise at row p - win_origin
    // (2 (window - 1) + chunk rows; the held ones move to row 0 when the chunk would not fit). It has no sinks, ring,
    // block cache or pinned blocks.
    attn::gpu::DeviceBuffer<bf16> win_k, win_v;
    int64_t win_origin = 0;
  };
  struct Indexes {
    attn::SparseIndex host_global, host_local;  // kept alive while their uploads may run
    attn::gpu::DeviceSparseIndex global, local;
    attn::gpu::DeviceWorkPlan global_plan, local_plan;
  };
  void ensure_device(int32_t max_chunk);
  uint8_t* pinned_block();  // one block: bf16 K then V (block * row values each), or the FP8 block layout
  Indexes& indexes(const stream::StreamLayout& layout, int32_t tile, cudaStream_t stream);
  // (window: the model's row-exact sliding window for the executor, 0: none.)
  attn::AttentionArgs local_pass(const stream::StreamLayout& lay, Indexes& ix, int32_t n, bf16* q_rot, bf16* wk,
                                 bf16* wv, float scale, bf16* out, cudaStream_t stream, int32_t window = 0);
  void global_pass(const attn::AttentionArgs& local, Indexes& ix, int32_t n, bf16* out, cudaStream_t stream);
  // Copies `rows` ring rows starting at absolute position p (>= sinks) to dst (row stride row_), in <= 2 pieces.
  void copy_to_ring(attn::gpu::DeviceBuffer<bf16>& ring, int32_t p, int32_t rows, const bf16* src, cudaStream_t s);

  const ModelConfig& cfg_;
  StreamOptions opt_;
  StreamingKV host_;
  int64_t row_ = 0, qrow_ = 0;  // kv_heads * d, q_heads * d
  int32_t ring_rows_ = 0, max_chunk_ = 0;
  // The block cache per layer: cache_slots_ = top_k x TESSERA_STREAM_CACHE (default kCacheFactor) slots, least
  // recently used replaced first, so that blocks retrieved again a few chunks later are still on the device.
  static constexpr int64_t kCacheFactor = 4;
  int64_t cache_slots_ = 0, cache_clock_ = 0;
  // streamingllm (retrieves nothing, so its workspace is [sinks | window | chunk] every chunk): the window is kept
  // rotated in a linear buffer per layer (LayerState::win_k) that the attention reads in place, instead of being
  // copied out of the ring and rotated again every chunk; the sinks are copied in front of it (128 rows) and the
  // window moved to the front when the buffer is full (capacity sinks + 2 (local + block) + chunk rows: once per
  // ~local / chunk chunks). Same rows, same rotation: the same attention. TESSERA_STREAM_WINDOW=copy: the
  // workspace path for every method (the baseline).
  bool window_kept_ = false;
  int64_t win_rows_ = 0;
  void store_window(LayerState& L, int32_t pos, int32_t n, const bf16* k, const bf16* v, const float* inv_freq,
                    cudaStream_t s);
  void attend_window(int32_t layer, int32_t pos, int32_t n, const stream::StreamLayout& lay, bf16* q, const bf16* k,
                     const bf16* v, const float* inv_freq, float scale, bf16* out, cudaStream_t s);
  // A sliding-window layer (StreamingKV::windowed()): its held tokens and the chunk in LayerState::win_k / win_v.
  void attend_sliding(int32_t layer, int32_t pos, int32_t n, const stream::StreamLayout& lay, bf16* q, const bf16* k,
                      const bf16* v, const float* inv_freq, float scale, bf16* out, cudaStream_t s);
  std::vector<LayerState> layers_;
  attn::gpu::DeviceBuffer<bf16> ws_k_, ws_v_, q_local_, q_global_, out_global_;
  attn::gpu::DeviceBuffer<float> lse_local_, lse_global_;
  PinnedBuffer<bf16> stage_;  // the chunk's q and k for the decisions
  std::vector<float> qf_, kf_;
  ThreadPool pool_;  // the decisions' attention map, heads in parallel
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, Indexes> index_cache_;
  cudaStream_t copy_ = nullptr;
  // The retrieved blocks' copies to the device on their own stream (split_copies_, the default), waiting for this
  // chunk's evictions only when they retrieve a block just evicted; TESSERA_STREAM_COPY_IN=0: on copy_ behind the
  // evictions' copies out (quantized first with FP8 blocks), the path before. H200, 1M / 128K tokens, Ltri-LLM's
  // retrieval heads, FP8 blocks and GEMMs, one call (docs/PERF.md): 95.55 / 8.36 s against 96.28 / 9.45 s.
  cudaStream_t copy_in_ = nullptr;
  bool split_copies_ = true;
  cudaStream_t decide_ = nullptr;    // the decisions' stream (overlap_)
  cudaEvent_t decided_ = nullptr;    // ... its work of the current layer done
  bool overlap_ = false;
  LocalAt local_at_ = LocalAt::After;
  StreamingKV::ChunkKind chunk_kind_ = StreamingKV::ChunkKind::Prefill;
  cudaEvent_t ready_ = nullptr, blocks_in_ = nullptr;
  // Pinned slabs: 256 blocks each; next_ the first free block of the last slab.
  std::vector<uint8_t*> slabs_;
  int64_t slab_used_ = 0;
  int64_t block_bytes_ = 0;  // one block's K and V: bf16, or FP8 codes and scales (stream_kernels.h)
  // StreamOptions::host_fp8: evicted blocks quantized into evict_stage_ on the copy stream before their copy out,
  // kept FP8 in pinned memory and in the block cache, dequantized into the workspace (stream_kernels.h).
  bool fp8_ = false;
  attn::gpu::DeviceBuffer<uint8_t> evict_stage_;
  // The reserve thread: allocates slabs up to want_slabs_ into ready_slabs_.
  std::thread reserver_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t*> ready_slabs_;
  int64_t want_slabs_ = 0, made_slabs_ = 0;
  bool stop_ = false;
  std::string reserve_error_;
  GpuStreamStats stats_;
  std::unique_ptr<StreamDecider> decider_;
  bool device_decisions_ = true, record_ = false, batched_copies_ = true;
  std::vector<void*> batch_dst_;  // copy_batch()'s lists, kept between calls
  std::vector<const void*> batch_src_;
  std::vector<size_t> batch_bytes_;
  bool profile_ = false;
  std::vector<cudaEvent_t>
      prof_events_;  // 6 per attend(): the bounds of sections 4, 5 (local), the copies' wait, 5 (global), 6
  size_t prof_used_ = 0;
  void prof_mark(cudaStream_t s);
  GpuDecisionRecord record_data_;
};

}  // namespace tessera::runtime::gpu
