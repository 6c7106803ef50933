// tessera/runtime/cuda/stream_decide.h — the heavy parts of Ltri-LLM's / InfLLM's retrieval decisions on the GPU.
//
// The decisions stay the CPU class's (runtime/stream/streaming_kv.h: evictions and their index vectors, spans, NMS,
// vector counts, voting, top-K, the layout); GpuStreamingKV hands it what this class computes, through
// StreamingKV::plan(..., DeviceDecisions):
//  - chunk_map(): the chunk's attention map within itself. q and k (bf16, before RoPE) are rotated in f32 at their
//    true positions (the CPU tables' arithmetic) and rounded to bf16 (as the attention kernels read them; the CPU's
//    map rounds its rotated copies alike), then two tensor-core passes over the causal 64 x 64 tiles, with no
//    [heads, n, n] scores in memory: each row's max and 1 / sum of exps per head (online over the key tiles), then
//    each tile's softmax summed over the heads (mma.sync bf16 x bf16 -> f32, the S tile in registers and the next
//    tiles' copies in flight: the products exact, only the f32 sums' order differs from the CPU's; the heads cut
//    into up to 8 ranges over the CTAs, the ranges added in order)
//    -> the [n, n] map, then the votes (each column's sum: blocks of 32 rows in order, then the blocks). Only the map (ltri: span
//    discovery reads it) and the n votes come back, not q and k. (Before 2026-12-01: f32 rotations and cuBLAS
//    SGEMMs into a [heads, n, n] f32 buffer and a softmax over it: 6.6 s of Ltri's 54 s at 1M.)
//  - Ltri span discovery (launch_chunk(..., candidates)): from the map on the device, its 2-D prefix sums in fixed
//    point (span_math.h: integer adds, so the parallel scans — a warp per row, then strips of rows — give the CPU's
//    sums), theta (the quantile of the causal entries, an exact radix select of the k-th smallest: four histogram passes over the grid, the last block of each picking the digit), the triangle
//    scores and the linear variant's best point per anti-diagonal (one warp per diagonal) (runtime/stream/span_math.h, the CPU's own functions): only the <= 2n - 1 candidates
//    come back, EQUAL to span_candidates() of the same map; NMS and the cover stay on the host, which then asks
//    span_masses() for its spans' masses (the prefix sums stay on the device).
//  - index keys: gather_keys() — the raw K rows of the positions the evictions index, from the layer's device ring
//    (bf16 -> f32, exactly the host's conversion), instead of copying the chunk's K back.
//  - InfLLM: mean_query() — the mean raw query of the chunk, in the CPU's order and rounding (each element summed
//    sequentially over the tokens, q / n each) — and infllm_scores(): the blocks scored on the device against a
//    per-layer mirror of the block means (uploaded as blocks are evicted) with span_math::repr_score's arithmetic
//    (ReprIndex::block_scores's): only the scores come back, EQUAL to the host's.
//  - Ltri: a per-layer mirror of the span index in bf16 (the key vectors of the kv heads the index keeps: gathered
//    from the ring as the host index counts them — the ring's own values, exact, half the bytes of f32 — or, from a
//    host index that holds f32 keys, converted on upload: exact for keys of bf16 values, which all of them are) and
//    ltri_scores(): the query vectors (raw q rows of the tokens the host chose, bf16 as they are) gathered on the
//    device, then sim(t, s) = sum_h w_h mean_{a in t} max_{b in s} q_h(a).k(b) and score(blk) = sum_t max_{s in blk}
//    sim(t, s) in f64 in the CPU's order (SpanIndex::block_scores); only the block scores come back. Two ways to the
//    dot products over the same mirror (TESSERA_LTRI_SCORING, read at construction; kDefaultLtriScoring without it):
//     * gemm (the default): per voting head (one launch for all) and query vector, each stored span's maximum dot
//       product (spanmax_kernel: 64 query vectors against a fused tile's <= 128 vectors on the tensor cores by
//       mma.sync, bf16 in, f32 products, then each (row, span)'s max through shared memory) into a [heads, queries,
//       spans] buffer — one float per span, not per vector — then sim_heads_kernel over those maxima: per query span
//       and 32 stored spans a CTA, a thread row per voting head (32 per round), each head's term w_h * mean max in
//       parallel, summed in head order. gemm-serial (the twin) writes every dot product (dots_kernel: 64 x 64 tiles,
//       the same fragments in the same order, so the same values) into a [heads, queries, vectors] dots buffer per
//       tile of whole spans (~256 MB at most) and sim_kernel takes each span's max there, one thread per (t, s)
//       walking the heads in turn: a max is exact in any order, so both give the same sim bit for bit (one voter's
//       sim takes sim_kernel's CTAs of 256 threads either way). Before 2026-12-02: cuBLAS GEMMs per head into the
//       dots buffer for both (sm_75 align1 kernels on the odd tile sizes, new heuristics for every shape). H200 at
//       128K, one process per scoring on one machine (docs/streaming.md): TTFT 17.00 vs 18.16 s every head voting
//       (decisions 12.30 vs 13.48 s), 12.46 vs 13.46 s with retrieval heads (the cuBLAS gemm against fused).
//     * fused: one kernel, one CTA per tile of whole stored spans (<= 128 vectors and <= 128 spans, or one longer
//       span; the tiles are cut as spans are added, never rebuilt), per voting head in order: the tile's keys in
//       shared memory, 64 query rows at a time against them on the tensor cores (WMMA bf16 x bf16 -> f32), the
//       per-span maxima from shared memory, and sim(t, s) accumulated in the CPU's order over the query vectors and
//       the heads. No dots buffer: the index is read once per head, but each CTA walks its heads and row passes
//       serially, and a 128K index is fewer tiles than the GPU has CTA slots.
//    Measured at 128K, Llama-3-8B shapes, same run on an H200 (docs/streaming.md, "Ltri's two scorings over one bf16
//    mirror"): gemm 19.19 s TTFT against fused 25.24 s with every head voting (decisions 13.6 vs 20.3 s), 12.43 vs
//    13.88 s with Ltri-LLM's retrieval heads; the fused path saves only gemm's dots buffer (stream state 3.32 vs
//    3.78 GB). So gemm is the default and fused stays selectable.
//    Then (either way) each block's score from sim: best_kernel (max over the block's spans, a thread per (t, block))
//    and block_sum_kernel (the sum over t in order, a warp per block) — bit for bit block_kernel's (a warp per block
//    walking t; gemm-serial's twin), 1M at chunk 1,024: block scores 5.97 -> 4.67 s (PERF.md).
//    Either way q and k ARE bf16 values, so each product is exact in f32 and only the f32 summation order differs
//    from the CPU's (OpenBLAS over f32 copies of the same values): the scores are within ~1e-6 relative of the
//    CPU's, not bitwise equal. The blocks' span ranges (block_begin) and the tiles are extended by the spans and
//    blocks added since the last call (O(new) host work and copies per call, not O(index)).
// Every call is asynchronous on `stream` except the results it returns, which synchronise it.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "cuda/device_buffer.h"
#include "runtime/cuda/event_timer.h"
#include "runtime/cuda/pinned_buffer.h"
#include "model/model_config.h"
#include "runtime/stream/span_index.h"

namespace tessera::runtime::gpu {

class StreamDecider {
 public:
  // Throws tessera::Error for a head_dim other than 64, 128 or 256 (the chunk map's and the dots' kernels).
  explicit StreamDecider(const ModelConfig& config);
  ~StreamDecider();
  StreamDecider(const StreamDecider&) = delete;
  StreamDecider& operator=(const StreamDecider&) = delete;

  // The map and votes of the chunk [pos, pos + n): q [n, q_heads, d], k [n, kv_heads, d] bf16 before RoPE; scale 0:
  // 1/sqrt(d). Brings back the votes, and the map when `want_map`; synchronises `stream`.
  void chunk_map(const bf16* q, const bf16* k, int32_t n, int32_t pos, const float* inv_freq, float scale,
                 bool want_map, cudaStream_t stream);
  // chunk_map() without the synchronisation, and with `candidates`, span discovery (theta at `theta_quantile`):
  // the results (map(), votes(), candidates(), theta()) are there after wait() or a call that synchronises.
  // map_head >= 0: the map of that query head alone (StreamingKV::map_head), not the sum over every head.
  void launch_chunk(const bf16* q, const bf16* k, int32_t n, int32_t pos, const float* inv_freq, float scale,
                    bool want_map, bool candidates, double theta_quantile, cudaStream_t stream,
                    int32_t map_head = -1);
  void wait(cudaStream_t stream);  // synchronises `stream` once after launch_chunk()
  // `work` (device work the caller queues on the decisions' stream) runs once, just before the next synchronisation
  // for a result (wait(), span_masses(), ltri_scores(), ...), which then waits for that result's own copies alone
  // (an event recorded before `work`), not for `work`: the device runs it while the host uses the result. nullptr
  // drops a hook that has not run (the caller's work must not run later).
  void before_next_wait(std::function<void()> work) { before_wait_ = std::move(work); }
  std::span<const float> map() const { return {map_host_.data(), static_cast<size_t>(map_n_) * static_cast<size_t>(map_n_)}; }
  std::span<const float> votes() const { return {votes_host_.data(), static_cast<size_t>(map_n_)}; }
  std::span<const stream::Span> candidates() const { return candidates_; }
  double theta() const { return theta_; }
  // The masses (stream::span_masses()) of chunk spans, from the prefix sums of the last launch_chunk(candidates);
  // synchronises `stream`.
  std::vector<stream::SpanMasses> span_masses(std::span<const stream::Span> spans, cudaStream_t stream);
  // Raw K rows [positions, kv_heads * d] (f32 of the bf16 values) of absolute positions held by a ring of
  // `ring_rows` rows whose row of position p is (p - sinks) % ring_rows; synchronises `stream`.
  std::vector<float> gather_keys(const bf16* ring, int32_t ring_rows, int32_t sinks, std::span<const int32_t> positions,
                                 cudaStream_t stream);
  // Ltri: the same rows appended to layer `layer`'s index mirror instead (the host's span index counts them without
  // holding them: SpanIndex::add_counted, in the same order), only the kv heads [head_begin, head_begin + heads) the
  // layer's span index keeps (SpanIndex::kv_head_begin / kv_heads_kept: with retrieval heads, the one its voting
  // head reads, or none); asynchronous.
  void append_index_keys(int32_t layer, const bf16* ring, int32_t ring_rows, int32_t sinks,
                         std::span<const int32_t> positions, int32_t head_begin, int32_t heads, cudaStream_t stream);
  // The mirror's keys of `layer` [vectors, kept kv heads * d] (tests; synchronous).
  std::vector<float> mirror_keys(int32_t layer) const;

  // InfLLM: the chunk's mean raw query [q_heads * d] (the CPU's arithmetic); synchronises `stream`.
  std::vector<float> mean_query(const bf16* q, int32_t n, cudaStream_t stream);
  // InfLLM block scores of the chunk (q [n, q_heads, d]) against layer `layer`'s block means (its device mirror
  // brought up to `index` first); ReprIndex::block_scores's arithmetic, equal; synchronises `stream`.
  std::vector<double> infllm_scores(int32_t layer, const stream::ReprIndex& index, const bf16* q, int32_t n,
                                    const stream::HeadWeights& w, cudaStream_t stream);

  // Ltri block scores (one per block of `index`, layer `layer`'s span index) for the query vectors of `tokens`
  // (chunk-relative rows of q [n, q_heads, d] bf16), span t holding the next counts[t] of them; w: the head weights.
  // First brings the layer's device mirror up to `index` (the vectors and spans added since the last call).
  // Synchronises `stream`.
  std::vector<double> ltri_scores(int32_t layer, const stream::SpanIndex& index, const bf16* q,
                                  std::span<const int32_t> tokens, std::span<const int32_t> counts,
                                  const stream::HeadWeights& w, cudaStream_t stream);

  // TESSERA_STREAM_PROFILE=1 (GpuStreamingKV::profile): the GPU time of the decisions' sections, by CUDA events around
  // each (summed at the synchronisations the results need anyway), and the host's waits for the device.
  struct Profile {
    double map = 0;      // q / k rotated, the map's two tensor-core passes (softmax over heads), votes
    double spans = 0;    // Ltri span discovery: prefix sums, theta, the candidates
    double masses = 0;   // the cover spans' masses
    double keys = 0;     // the evictions' index keys gathered from the ring (into Ltri's mirror / back for InfLLM)
    double scores = 0;   // block scoring: mirror updates, query gather, GEMMs / fused kernel, sim, per-block reduce
    double scores_wide = 0;  // ... of which Ltri's layers whose index keeps several kv heads (every head votes)
    double issue = 0;    // host seconds issuing the sections' work (each call's launches and copies, to its sync)
    int64_t waits = 0;   // host synchronisations with the stream (counted whether profiling or not)
  };
  void profile(bool on);
  // Adds the host time since `t0` to prof_.issue when profiling.
  void issued(std::chrono::steady_clock::time_point t0);
  const Profile& profile_stats() const { return prof_; }

  // The most dot products one tile of the gemm scoring holds (default 64M, and tiles of at least 1,024 vectors);
  // tests make it small to cut many tiles (then tiles of any size).
  void set_dots_budget(int64_t values) {
    dots_budget_ = values;
    min_tile_vectors_ = 1;
  }

  size_t device_bytes() const;  // the mirrors and the scratch
  // Ltri's scoring without TESSERA_LTRI_SCORING (above: chosen by measurement); fused_scoring(): this decider's.
  static constexpr const char* kDefaultLtriScoring = "gemm";
  bool fused_scoring() const { return fused_; }
  bool serial_sim() const { return serial_sim_; }  // gemm-serial: sim_kernel, the heads walked serially
  void reset();                 // a new sequence: the mirrors empty (their memory kept)

 private:
  struct Mirror {
    attn::gpu::DeviceBuffer<bf16> keys;                   // [capacity, row]: the kept kv heads of each vector
    int64_t row = -1;                                     // kept kv heads * d (-1: not set yet)
    int32_t head_begin = 0;                               // the first kept kv head
    attn::gpu::DeviceBuffer<int32_t> span_first, span_count, block_begin;  // block_begin: [blocks + 1] span ids
    attn::gpu::DeviceBuffer<int32_t> tile_begin;          // the fused scoring's tiles: their first span
    int64_t vectors = 0, vector_capacity = 0, spans = 0, span_capacity = 0, block_capacity = 0, tile_capacity = 0;
    int32_t blocks = 0;                                   // the blocks block_begin covers
    int64_t tile_vectors = 0, tile_spans = 0;             // the last (open) tile's
    int64_t tiles_uploaded = 0;
    std::vector<int32_t> block_begin_host, tile_begin_host;
    std::vector<int32_t> first_host, count_host;  // the spans' vectors (tiles are cut at span boundaries)
    void clear();                                 // a new sequence: no vectors, spans, blocks or tiles
  };
  void mirror(int32_t layer, const stream::SpanIndex& index, cudaStream_t stream);
  void set_mirror_heads(Mirror& M, int32_t head_begin, int32_t heads);
  // The dot products of the query rows in qsel16_ ([m, q_heads * d] bf16) with the mirror's keys -> sim_.
  void fused_scores(Mirror& M, int64_t m, int32_t T, int32_t H, cudaStream_t s);
  void gemm_scores(Mirror& M, int64_t m, int32_t T, int32_t H, cudaStream_t s);
  // dots_ = the voting heads' query rows . the mirror's vectors [v0, v0 + vt) (dots_kernel).
  void tile_dots(Mirror& M, int64_t m, int32_t H, int64_t v0, int64_t vt, cudaStream_t s);
  struct MeansMirror {
    attn::gpu::DeviceBuffer<float> means;  // [capacity, row]
    int64_t blocks = 0, capacity = 0;
  };
  // Waits for the work queued on `s` so far: the stream, or with a before_next_wait() hook, an event before the hook's
  // work (which is queued then).
  void sync(cudaStream_t s);
  std::function<void()> before_wait_;
  cudaEvent_t results_ = nullptr;
  void synced();  // after a synchronisation: launch_chunk()'s candidates compacted (once); the profile's events summed
  enum Section { kMap = 0, kSpans = 1, kMasses = 2, kKeys = 3, kScores = 4, kScoresWide = 5 };
  void begin(Section what, cudaStream_t s);
  void end(Section what, cudaStream_t s);
  std::unique_ptr<EventTimer> timer_;  // profile(true) only
  Profile prof_;
  std::vector<double> download_scores(int32_t blocks, cudaStream_t stream);

  int32_t nq_ = 0, nkv_ = 0, d_ = 0;
  int64_t qrow_ = 0, row_ = 0;
  bool fused_ = true;       // TESSERA_LTRI_SCORING (fused | gemm | gemm-serial), read at construction
  int64_t dots_budget_ = int64_t{64} << 20, min_tile_vectors_ = 1024;  // gemm_scores()'s tiles
  bool serial_sim_ = false;  // gemm-serial: the gemm path with sim_kernel (one thread per (t, s), heads in turn)
  attn::gpu::DeviceBuffer<bf16> qb_, kb_;  // the chunk map's rotated q and k (bf16, rows padded to its tile)
  attn::gpu::DeviceBuffer<float> stat_max_, stat_inv_;  // [heads, n]: each causal row's max and 1 / sum of exps
  attn::gpu::DeviceBuffer<float> vote_parts_;           // [n / 32, n]: the votes' sums per block of rows
  attn::gpu::DeviceBuffer<float> scores_, map_, votes_, dots_, mean_;  // scores_: the map's per-range partial sums
  int sm_count_ = 0;
  int map_stages_ = 2;  // the chunk map kernels' pipeline depth (2, or 1 where shared memory is short)
  attn::gpu::DeviceBuffer<double> sim_, best_, block_scores_, weights_;  // best_: [T, blocks] (best_kernel)
  // ltri_scores()'s arguments in one buffer (one copy a call), and where each lies in it for this call's kernels.
  attn::gpu::DeviceBuffer<int32_t> score_args_;
  const int32_t* tokens_dev_ = nullptr;   // the query vectors' chunk rows
  const int32_t* offsets_dev_ = nullptr;  // the query spans' first vectors, [T + 1]
  const int32_t* voters_dev_ = nullptr;   // per voter: its query head's offset in a q row, its kv head's in a mirror row
  const double* weights_dev_ = nullptr;   // per voter: its weight
  attn::gpu::DeviceBuffer<bf16> qsel16_;  // Ltri's query rows (bf16; fused: zero rows up to a multiple of 64)
  std::vector<bf16> keys_staging_;        // a host index's f32 keys as bf16, on their way to its mirror
  std::vector<Mirror> mirrors_;
  std::vector<MeansMirror> means_mirrors_;
  attn::gpu::DeviceBuffer<uint64_t> prefix_, strip_sums_;  // span discovery's fixed-point prefix sums (span_math.h)
  attn::gpu::DeviceBuffer<double> theta_dev_, masses_;
  attn::gpu::DeviceBuffer<uint64_t> select_;  // the radix select's state
  attn::gpu::DeviceBuffer<int32_t> cand_begin_, cand_end_, positions_;
  attn::gpu::DeviceBuffer<double> cand_score_;
  attn::gpu::DeviceBuffer<float> keys_, repr_dots_;
  std::vector<stream::Span> candidates_;
  double theta_ = 0;
  bool pending_ = false, pending_candidates_ = false;
  PinnedBuffer<int32_t> cand_host_;       // begin, end per anti-diagonal
  PinnedBuffer<double> cand_score_host_;  // score per anti-diagonal, then theta
  PinnedBuffer<float> keys_host_;
  PinnedBuffer<double> masses_host_;
  std::vector<float> means_staging_;
  PinnedBuffer<float> map_host_, votes_host_;
  int32_t map_n_ = 0;
  PinnedBuffer<int32_t> staging_;  // ltri_scores()'s arguments; span_masses()' spans
  PinnedBuffer<double> scores_host_;
  // Host arrays on their way to the device (put()): pinned, so that the copies do not synchronise the stream.
  void put(void* dst, const void* src, size_t bytes, cudaStream_t s);
  PinnedBuffer<unsigned char> arena_;
  size_t arena_used_ = 0;
  cudaStream_t arena_stream_ = nullptr;
};

}  // namespace tessera::runtime::gpu
