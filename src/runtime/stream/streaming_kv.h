// tessera/runtime/stream/streaming_kv.h — streaming memory: a KV-cache policy for prompts of any length.
//
// The engine (runtime/engine.h, EngineOptions::stream) runs a sequence chunk by chunk; before each forward pass it
// calls begin_chunk(), then Forward hands every layer's chunk to attend() (forward.h, KVPolicy). Per layer and
// chunk, attend():
//  1. evicts the blocks that have left the local window into the host store (host_block_store.h), indexing them
//     first: Ltri spans with dynamic index vectors, or InfLLM representative keys (span_index.h);
//  2. for ltri / infllm, forms the chunk's attention map within itself (softmax over the chunk's causal keys, summed
//     over heads): its spans (span_discovery.h), its query vectors and the votes (attention received) of its tokens;
//  3. retrieves top_k evicted blocks (all of them when there are at most top_k; none for streamingllm; at decode,
//     ltri keeps the blocks of the last prefill chunk when persist_decode is set);
//  4. builds the workspace [sinks + retrieved | local window | chunk] and runs the two indexes of
//     stream_layout.h through the CPU sparse executor.
// Until the first block is evicted (pos < sinks + local + block) nothing is global: the chunk attends to every
// earlier token at its true position, which is exactly the dense engine's attention.
//
// Positions and eviction: with E = max(0, (pos - sinks - local) / block) blocks evicted before a chunk at pos,
// block b holds positions [sinks + b*block, sinks + (b+1)*block); the local window is [sinks + E*block, pos)
// (local..local+block-1 tokens).
//
// Memory: the attended keys per chunk are bounded (StreamOptions::attended_tokens()); what grows with the sequence
// is the host store (checked against its budget: check_sequence() before a prefill, HostBlockStore::add() always)
// and the index (bytes in stats()). streamingllm keeps neither: its evicted blocks are dropped (keeps_evicted()).
//
// The GPU path (runtime/cuda/stream_gpu_kv.h) uses this class for its decisions: constructed with
// Storage::Device, it keeps no V and no block rows (K of the recent tokens only where indexing needs it, i.e.
// ltri / infllm), counts the evicted blocks against the budget as bf16, and plan() runs steps 1-3 and the
// bookkeeping of attend() on f32 copies of the device's q and k, returning the layout; the GPU twin moves the rows
// and runs the same two indexes on the device. Same inputs, same code: the same retrieved blocks. The GPU computes
// the heavy parts itself (runtime/cuda/stream_decide.h) and hands them to plan(..., DeviceDecisions).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "runtime/forward.h"
#include "model/model_config.h"
#include "runtime/stream/host_block_store.h"
#include "runtime/stream/span_discovery.h"
#include "runtime/stream/span_index.h"
#include "runtime/stream/stream_layout.h"
#include "runtime/stream/stream_memory.h"
#include "runtime/stream/stream_options.h"

namespace tessera::runtime {

// Models with sliding-window layers (Gemma-3: 5 local layers per global one) stream on the CPU and the GPU: a
// sliding-window layer keeps only its own window (the raw V and the K rotated at their true positions of the last
// window - 1 tokens, all a later query can see: exactly its dense attention, in bounded memory) and never evicts,
// indexes or retrieves; the global layers run the streaming layout. Only global layers count against the host budget.
// With Storage::Device, plan() of a sliding-window layer only keeps the count and returns the layout
// {0, held, chunk} (the GPU path holds the rows: runtime/cuda/stream_gpu_kv.h).
// check_model_streams(config, gpu): the CPU path streams every model; the GPU path (GpuStreamingKV's constructor)
// attends through the CUDA sparse executor, so it needs a head_dim the executor runs; else tessera::Error:
//   "model gemma3 cannot stream on the GPU: its head_dim 16 is not one the CUDA sparse executor runs (64, 128 or
//    256); the CPU path streams it (--device cpu)"
void check_model_streams(const ModelConfig& config, bool gpu);

struct StreamStats {
  int64_t evicted_blocks = 0;   // per layer
  int64_t host_bytes = 0;       // the host store
  int64_t index_vectors = 0;    // all layers: Ltri span vectors or InfLLM representative keys
  int64_t index_bytes = 0;      // those vectors' bytes (f32, the kv heads each index keeps: every one but for
                                // Ltri with retrieval heads, StreamOptions::index_all_heads)
  int64_t index_head_vectors = 0;  // vectors x kv heads kept (one per token and kv head: the paper's unit)
  int64_t index_spans = 0;      // Ltri: spans indexed, all layers
  std::vector<double> lambdas;  // Ltri: each layer's retention slope now (with index_ratio: the searched one;
                                // sliding-window layers: 0)
  int64_t workspace_tokens = 0; // the largest workspace a chunk used (keys attended)
  double retrieval_seconds = 0; // span discovery, indexing and scoring
};

class StreamingKV : public KVPolicy, public StreamMemory {
 public:
  enum class ChunkKind { Prefill, LastPrefill, Decode };

  // Host: this object holds every row (the CPU path). Device: the caller holds the rows (see above).
  enum class Storage { Host, Device };

  StreamingKV(const ModelConfig& config, StreamOptions options, Storage storage = Storage::Host);

  // Whether evicted blocks are kept (host store; the GPU path's pinned memory) for retrieval: ltri and infllm.
  // streamingllm never retrieves one, so it drops them: no host memory, no length limit from the host budget.
  bool keeps_evicted() const { return opt_.method != StreamMethod::StreamingLLM; }
  // Throws tessera::Error when a sequence of `tokens` tokens cannot fit the host store's budget (never for
  // streamingllm, which keeps no evicted block):
  //   "streaming: a sequence of 40,000 tokens evicts 311 blocks of 128 tokens per layer, whose K and V need
  //    1.83 GB of host memory (30 layers), over the budget of 1.00 GB for evicted KV blocks; raise
  //    --stream-host-budget or shorten the prompt"
  void check_sequence(int64_t tokens) const override;

  // Called before the forward pass of the chunk [pos, pos + n) (pos must be the sequence's length).
  void begin_chunk(int32_t pos, int32_t n, ChunkKind kind);
  void attend(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v, std::span<const float> inv_freq,
              float scale, float* out, ThreadPool& pool) override;

  // Storage::Device: steps 1-3 of attend() and its bookkeeping for layer `layer` of the chunk [pos, pos + n): q
  // [n, q_heads, d] and k [n, kv_heads, d], f32, before RoPE (read only; may be null when !needs_qk()). Returns the
  // layout; retrieved(layer) holds the blocks to put after the sinks (ascending), the blocks [evicted_before(),
  // evicted_blocks()) have left the local window of every layer this chunk.
  // pool (optional): the chunk's attention map runs its heads in parallel.
  stream::StreamLayout plan(int32_t layer, int32_t pos, int32_t n, const float* q, const float* k,
                            std::span<const float> inv_freq, float scale, ThreadPool* pool = nullptr);
  // What the GPU computed for one layer's chunk (runtime/cuda/stream_decide.h), taken by plan() / attend() instead of
  // computing it here. Everything else (evictions and their index vectors, spans, NMS, span covers, vector counts,
  // normalisation, collaborative voting, top-K, the layout, the bookkeeping) runs as without it.
  struct DeviceDecisions {
    std::span<const float> map;    // ltri: the chunk's map [n, n] (summed over heads; above the diagonal unread)
    std::span<const float> votes;  // ltri / infllm: attention each chunk token received, [n] (the map's column sums)
    // Ltri without the map: the device's span candidates (span_candidates() of the chunk's map with its theta, in
    // that order; the linear variant's best point per anti-diagonal), then NMS and the cover here, and span_masses:
    // for the chunk's spans (the cover, in order) their triangle and row-neighbour masses (span_masses() of the map).
    bool has_candidates = false;
    std::span<const stream::Span> candidates;
    std::function<std::vector<stream::SpanMasses>(std::span<const stream::Span> spans)> span_masses;
    // The raw keys ([positions, kv_heads * head_dim], f32) of the absolute positions given: the index vectors of the
    // blocks this chunk evicts, from the device's ring, in one call per layer and chunk. When set, plan() keeps no
    // K rows of its own (k may be null); a sequence takes them this way from its first chunk on.
    std::function<std::vector<float>(std::span<const int32_t> positions)> index_keys;
    // ltri: index_keys() keeps the keys on the device (appended to its index mirror in this order) and returns none;
    // the span index then counts its vectors without holding them (SpanIndex::add_counted).
    bool keys_on_device = false;
    // Called once per plan(), after the evictions' index_keys and before votes, map or candidates are read.
    std::function<void()> ready;
    // The block scores, called only when retrieval ranks blocks: ltri passes its query vectors' tokens
    // (chunk-relative, span after span), the vector count per chunk span and the head weights; infllm passes empty
    // tokens and counts. Must return one score per evicted block.
    std::function<std::vector<double>(std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                      const stream::HeadWeights& weights)>
        block_scores;
  };
  // plan() with the device's map, votes and block scores: q is not read (k is, unless index_keys is given: the index
  // takes raw keys). Throws tessera::Error on sizes that do not fit the chunk: "streaming: the device's attention
  // map has 10 entries for a chunk of 4 tokens (16 expected)", "streaming: the device's votes have 3 entries for a
  // chunk of 4 tokens", "streaming: the device's block scores have 2 entries for 5 evicted blocks", "streaming: the
  // device's span candidate [3, 9) lies outside a chunk of 4 tokens", "streaming: the device's span masses have 1
  // entries for 2 spans", "streaming: the device's index keys have 8 values for 3 positions (12 expected)".
  stream::StreamLayout plan(int32_t layer, int32_t pos, int32_t n, const float* k, std::span<const float> inv_freq,
                            const DeviceDecisions& given);
  // attend() (Storage::Host) with the device's decisions (tests: the CPU's attention on the GPU's decisions).
  void attend(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v, std::span<const float> inv_freq,
              float scale, float* out, ThreadPool& pool, const DeviceDecisions& given);
  // The last chunk's map ([n, n]; ltri / infllm) and votes ([n]) as this object used them, and each layer's index.
  const std::vector<float>& last_map() const { return map_; }
  const std::vector<float>& last_votes() const { return chunk_votes_; }
  const stream::SpanIndex& span_index(int32_t layer) const { return layers_[static_cast<size_t>(layer)].span_index; }
  const stream::ReprIndex& repr_index(int32_t layer) const { return layers_[static_cast<size_t>(layer)].repr_index; }
  // Ltri with retrieval heads (and !index_all_heads): a layer without a retrieval head after the first layer with
  // one. Collaborative voting replaces its scores, so it keeps no index and scores nothing (the blocks it retrieves
  // are the full index's: the votes of the earlier layers). Also every early_voted() layer.
  bool voted_only(int32_t layer) const;
  // Ltri with retrieval heads and StreamOptions::early_from_votes: a layer before the first retrieval layer, which
  // takes the top-K of the previous chunk's collaborative vote (no index, no map, no scoring).
  bool early_voted(int32_t layer) const;
  // The one query head `layer`'s chunk map is made of (StreamOptions::map_retrieval_head and a retrieval head in
  // `layer`), or -1: every head. The GPU path maps the same.
  int32_t map_head(int32_t layer) const;
  // Whether plan() / attend() of `layer` maps the chunk (and reads q and k for it): needs_qk() but for a voted-only
  // layer (its map would only choose index and query vectors it does not have). The GPU path asks the same.
  bool maps_chunk(int32_t layer) const { return needs_qk() && !voted_only(layer); }
  // Whether plan() reads q and k (ltri and infllm map the chunk; streamingllm only counts).
  bool needs_qk() const { return opt_.method == StreamMethod::Ltri || opt_.method == StreamMethod::InfLLM; }
  int32_t evicted_before() const { return prev_evicted_; }
  Storage storage() const { return storage_; }

  void reset() override;  // an empty sequence (keeps nothing)
  int32_t length() const { return length_; }
  int64_t sequence_length() const override { return length_; }
  const StreamOptions& options() const { return opt_; }
  StreamStats stats() const;
  // Blocks the last chunk of `layer` attended (ascending).
  const std::vector<int32_t>& retrieved(int32_t layer) const { return layers_[static_cast<size_t>(layer)].retrieved; }
  // Whether `layer` attends within its own sliding window (it keeps window - 1 tokens; no eviction, no retrieval).
  bool windowed(int32_t layer) const { return cfg_.layers[static_cast<size_t>(layer)].sliding_window > 0; }
  // Tokens a sliding-window layer holds (its window's keys); 0 for a global layer.
  int32_t window_tokens(int32_t layer) const { return layers_[static_cast<size_t>(layer)].win_count; }
  // Layers that stream (global ones): the host store and the index are theirs.
  int32_t global_layers() const { return global_layers_; }
  // Ltri: the retention slope `layer` indexes with now (fixed, or the one index_ratio's search chose last).
  double lambda(int32_t layer) const;
  // The layout the last chunk of `layer` ran.
  const stream::StreamLayout& last_layout(int32_t layer) const { return layers_[static_cast<size_t>(layer)].layout; }
  int32_t evicted_blocks() const { return evicted_; }
  int32_t layers() const { return static_cast<int32_t>(layers_.size()); }
  // Bytes held besides the store and the index: sinks, the local window, the workspace.
  int64_t resident_bytes() const;
  // resident_bytes() + the host store + the index (StreamMemory).
  double memory_bytes() const override;

 private:
  struct PendingSpan {
    int32_t begin = 0, end = 0;  // absolute positions
    double ratio = 1;            // area ratio within its chunk; kUnmeasured: no later row of its chunk (below)
  };
  struct Layer {
    int32_t sink_count = 0, recent_count = 0;  // tokens of [0, min(length, sinks)) and [recent_begin, length)
    std::vector<float> sink_k, sink_v;      // raw K, V of the sinks (Storage::Host)
    std::vector<float> recent_k, recent_v;  // raw K, V of the recent tokens (Device: K only, for ltri / infllm)
    int64_t recent_skip = 0;                // leading rows of recent_k / recent_v already dropped (drop_front())
    std::vector<float> votes;               // per recent token
    std::vector<PendingSpan> spans;         // Ltri spans of the recent tokens
    stream::SpanIndex span_index;
    stream::ReprIndex repr_index;
    std::vector<int32_t> retrieved, persisted;
    std::vector<double> normalized_scores;  // this chunk's block scores in [0, 1] (collaborative voting)
    stream::StreamLayout layout;
    stream::LambdaTable lambda_table;       // Ltri with index_ratio: the spans indexed (lengths, area ratios)
    double lambda = 0;                      // ... and the lambda chosen from them (0: none yet)
    double measured_mass = 0;               // ... sum of length * r over the measured pieces indexed
    int64_t measured_tokens = 0;            // ... and their tokens
    int32_t win_count = 0;                  // sliding-window layer: tokens held
    std::vector<float> win_k, win_v;        // ... their K (rotated at their positions) and V
  };

  // The area ratio of a span no later row of its chunk attends to (the chunk's last span; decoded tokens): no voters
  // measured it. With fixed lambdas it counts as r = 1 (keeps min(length, max)); with index_ratio as the layer's mean
  // r so far (length-weighted; 1 before any), so that these spans do not set a floor under the index.
  static constexpr double kUnmeasured = -1;
  int32_t recent_begin() const { return evicted_ > 0 ? opt_.sinks + evicted_ * opt_.block : std::min(length_, opt_.sinks); }
  // Index vectors waiting for their keys (evict() -> index_keys()): block `block`, `count` vectors (ltri: one span
  // piece; infllm: the block's representative keys), the keys of absolute positions `positions`.
  struct PendingVectors {
    int32_t block = 0, count = 0;
    std::vector<int32_t> positions;
  };
  // Stores block `block`, whose rows start `first` tokens into the recent ones, and chooses its index vectors
  // (appended to `pending`; nothing is removed).
  void evict(int32_t layer, int32_t block, int32_t first, std::vector<PendingVectors>& pending);
  // The pending vectors' keys (the recent rows, or the device's index_keys) into the layer's index, in order.
  void index_keys(int32_t layer, const std::vector<PendingVectors>& pending);
  void drop_front(int32_t layer, int32_t tokens);  // removes the first `tokens` recent tokens
  stream::HeadWeights head_weights(int32_t layer) const;
  // Collaborative voting: the votes of layers [0, end) this chunk (each layer with a retrieval head that scored the
  // `blocks` blocks: its score times its normalised block scores), summed in layer order, into vote_sum_; false when
  // none voted. Kept between a chunk's layers and extended (layers run in order), so a layer adds only the layers
  // since the last call: O(blocks) a layer instead of O(layers x blocks), the same additions in the same order.
  bool collect_votes(int32_t end, size_t blocks);
  // top_blocks(vote_sum_, top_k), computed once per state of the sum (the voted-only layers after one voting layer
  // share it).
  const std::vector<int32_t>& vote_top_blocks();
  // An early_voted() layer's blocks: the top-K of the previous chunk's vote (every voting layer's normalised scores
  // still held from it, weighted by its head's score, summed in layer order; blocks evicted since score 0), computed
  // once a chunk; the most recent top-K blocks when the previous chunk ranked none.
  std::vector<int32_t> previous_vote_blocks();
  std::vector<int32_t> retrieve(int32_t layer, const float* q_raw, int32_t n, std::span<const float> map,
                                std::span<const stream::Span> spans);
  // attend() in three steps: prepare (evictions, rotations, map, spans, retrieval, the layout: steps 1-3), the
  // workspace and the executor (Host only), finish (the chunk appended to the sinks / local window).
  void prepare(int32_t layer, int32_t pos, int32_t n, const float* q, const float* k, std::span<const float> inv_freq,
               float scale, ThreadPool* pool);
  void finish(int32_t layer, int32_t pos, int32_t n, const float* k, const float* v);
  // A sliding-window layer's bookkeeping (Host and Device): the tokens held after the chunk, the layout {0, held, n}.
  stream::StreamLayout plan_window(int32_t layer, int32_t pos, int32_t n);
  // A sliding-window layer's chunk: dense attention within its window, then the window trimmed.
  void attend_window(int32_t layer, int32_t pos, int32_t n, float* q, float* k, float* v,
                     std::span<const float> inv_freq, float scale, float* out, ThreadPool& pool);
  bool keeps_recent_k() const { return storage_ == Storage::Host || needs_qk(); }

  const ModelConfig& cfg_;
  StreamOptions opt_;
  Storage storage_ = Storage::Host;
  stream::HeadShape shape_;
  int64_t row_ = 0;  // kv_heads * head_dim
  std::vector<Layer> layers_;
  stream::HostBlockStore store_;
  std::vector<int32_t> best_head_;    // per layer: its retrieval head (-1: none)
  std::vector<double> best_score_;    // ... and its score
  int32_t first_voter_ = -1;          // the first (global) layer with a retrieval head
  int32_t global_layers_ = 0;
  int32_t length_ = 0;
  int32_t evicted_ = 0;      // blocks evicted (every layer alike) after this chunk's begin_chunk
  int32_t prev_evicted_ = 0; // ... before it
  ChunkKind kind_ = ChunkKind::Prefill;
  int64_t max_workspace_ = 0;
  double retrieval_seconds_ = 0;
  // Scratch.
  std::vector<float> ws_k_, ws_v_, q_local_, q_global_, k_rot_, cos_, sin_, map_, lse_, head_maps_;
  std::vector<float> q_map_, k_map_;  // the map's q and k: q_local_ and k_rot_ rounded to bf16 (the device's values)
  std::vector<float> chunk_votes_;         // prepare() -> finish(): attention each chunk token received
  const DeviceDecisions* given_ = nullptr; // set during plan() / attend() with the device's decisions
  std::vector<stream::Span> chunk_spans_;  // prepare() -> finish(): the chunk's spans and area ratios
  std::vector<double> chunk_ratios_;
  std::vector<double> chunk_area_;         // ... every chunk span's area ratio (the query vectors' counts)
  int32_t local_begin_ = 0, span_len_ = 0;
  int64_t chunk_serial_ = 0;               // begin_chunk() calls: collect_votes()'s sums belong to one chunk
  std::vector<double> vote_sum_;           // collect_votes(): the sum over layers [0, vote_through_)
  int32_t vote_through_ = 0;
  int64_t vote_chunk_ = -1;
  bool vote_any_ = false;
  int64_t vote_version_ = 0;               // bumped whenever vote_sum_ changes
  std::vector<int32_t> vote_top_;          // vote_top_blocks(): top_blocks(vote_sum_) at vote_top_version_
  int64_t vote_top_version_ = -1;
  std::vector<int32_t> prev_vote_blocks_;  // previous_vote_blocks() of chunk prev_vote_chunk_
  int64_t prev_vote_chunk_ = -1;
};

}  // namespace tessera::runtime
