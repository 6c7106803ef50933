// tessera/attention/cuda/estimate_cuda.h — the dynamic-pattern estimators on the GPU.
//
// Computes, for every vertical-slash and block-sparse head of a layer, the same estimate as the CPU
// estimators (attention/index/estimate.h, whose definitions are the contract):
//  - VS: A = softmax(scale * Q[last rows] K^T + causal) over keys [0, q_begin + q_len); column sums and
//  diagonal
//    sums of A; the first forced columns / diagonals, then the top-k of the rest (ties to the smaller index),
//    ascending. Scores come from tensor-core products (f32 accumulation), the softmax in f32.
//  - BS: mean-pooled Q and K blocks (aligned to absolute position 0, partial blocks pool what they have), raw
//    scores scale * Qp . Kp per causal key block; per query block qb the diagonal block qb always (when
//    top_k >= 1) plus the top-(min(top_k, qb + 1) - 1) of blocks [0, qb), ascending.
// Arithmetic order differs from the CPU (which accumulates in f64 and dots with AVX), so estimates are
// identical wherever the k-th and (k+1)-th scores are not within rounding of each other.
// The BS scores are defined exactly (so a test can reproduce them on the host): pooled rows are f32 sums of
// the rows in order divided by the row count (f32); a score is 32 leaves (leaf l = fma over elements l, l +
// 32, ... in order, from +0) added as the binary tree that pairs leaves l and l + 16 first, then l and l + 8,
// ..., then 0 and 1, times scale; ranking by the order key of block_topk.cuh (-0 = +0).
//
// The output lives in device memory in a fixed layout decided on the host from the patterns and the shape
// (no host synchronisation in the run path): per VS head min(vertical, keys) columns and min(slash, keys)
// offsets; per BS head min(top_k, qb + 1) key blocks per query block qb, CSR offsets known in closed form.
// Adaptive VS heads (gamma > 0, pattern.h): the same room (the maxima); the count comes from
// attention/index/estimate.h's coverage_count rule, evaluated on the device's f32 sums with f64 accumulation
// (VsCoverage in vs_select_kernels.cuh), and the room after the kept entries holds kVsUnused. So counts agree with
// the CPU wherever the coverage target does not fall within rounding of a prefix sum. Adaptive BS heads likewise:
// per query block the fixed layout's room min(top_k, qb + 1); the count from coverage_count's rule over the masses
// exp(s - max) of the causal blocks (the diagonal's score computed as the scoring kernel computes the others,
// f64 masses and sums: BsCoverage in bs_select_kernels.cuh), the kept blocks ascending with the diagonal last,
// then kBsUnused up to the room.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "attention/index/estimate.h"
#include "attention/index/lowering_context.h"
#include "attention/pattern/pattern.h"
#include "core/tensor.h"

namespace tessera::attn::gpu {

// Per-head descriptors shared with the kernels (plain data).
struct VsHeadDesc {
  int32_t q_head = 0;
  int32_t kv_head = 0;
  int32_t rows = 0;            // min(last_q, q_len)
  int32_t num_columns = 0;     // min(vertical, keys)
  int32_t num_offsets = 0;     // min(slash, keys)
  int32_t forced_columns = 0;  // min(forced_columns, num_columns)
  int32_t forced_offsets = 0;  // min(forced_diagonals, num_offsets)
  int64_t column_base = 0;     // into DeviceEstimates::vs_columns
  int64_t offset_base = 0;     // into DeviceEstimates::vs_offsets
  // Adaptive budgets (gamma > 0): num_columns / num_offsets are the maxima (the layout's room); the kept
  // counts come from the coverage target, and the room after them holds kVsUnused.
  double gamma = 0.0;
  int32_t min_columns = 0;
  int32_t min_offsets = 0;
};

// Fills the VS layout after an adaptive head's kept columns / offsets: past every key and every causal offset,
// so the index build ignores it (columns >= key_end and offsets >= the tile's end give nothing) and the lists
// stay ascending. download() drops it.
inline constexpr int32_t kVsUnused = 0x7fffffff;
// The same for an adaptive BS head's key blocks (after the diagonal block, which ends each query block's kept
// list): past every key block, so both index builds ignore it (lower_tile clips it, lower_bs_tile_warp's
// bitmap window never holds it).
inline constexpr int32_t kBsUnused = 0x7fffffff;

// Up to four VS heads of one kv head, scored by one CTA per chunk of keys (slot: index into vs_heads(); -1: none).
struct VsGroupDesc {
  int32_t slot[4];
};

struct BsHeadDesc {
  int32_t q_head = 0;
  int32_t kv_head = 0;
  int32_t block = 64;
  int32_t top_k = 0;
  int32_t first_q_block = 0;
  int32_t num_q_blocks = 0;
  int32_t num_key_blocks = 0;  // key blocks pooled: ceil((q_begin + q_len) / block)
  int32_t pool_index = 0;      // which pooled-K array (one per distinct block size)
  int64_t kpool_base = 0;    // into the pooled keys: [num_key_blocks][head_dim] floats of this head's kv head
  int64_t offsets_base = 0;  // into DeviceEstimates::bs_offsets (num_q_blocks + 1 entries)
  int64_t key_base = 0;      // into DeviceEstimates::bs_key_blocks
  // Adaptive budgets (gamma > 0): top_k is the maximum; every query block with qb >= 1 is scored and keeps the
  // coverage count's blocks, the rest of its room kBsUnused.
  double gamma = 0.0;
  int32_t min_top_k = 0;
};

// BS scoring work, laid out on the host (plan_bs_waves in bs_score_kernels.cuh, "BS estimator v2"). A tile is
// up to 64 (32 at head_dim 256) consecutive query blocks of one BS head; its scored rows (those that choose
// among their causal blocks: 2 <= top_k <= qb) are [e_scored, e1), and their scores (qb floats each, row after
// row) start at `scratch` in the score buffer of the tile's wave.
struct BsTileDesc {
  int32_t slot = 0;  // index into the BS heads
  int32_t e0 = 0;    // rows [e0, e1) (query-block entries of the head)
  int32_t e1 = 0;
  int32_t e_scored = 0;  // first scored row, in [e0, e1]
  int64_t scratch = 0;   // offset of row e_scored's scores in the wave's scratch (floats)
};
// One CTA of the scoring kernel: the scores of a tile against key tiles [kt0, kt1).
struct BsWorkDesc {
  int32_t tile = 0;
  int32_t kt0 = 0;
  int32_t kt1 = 0;
};
// Scoring and selection run in waves whose scores fit the scratch: tiles [tile_begin, tile_end) and their
// scoring work [work_begin, work_end) (heaviest first).
struct BsWave {
  int32_t tile_begin = 0, tile_end = 0, work_begin = 0, work_end = 0;
};

class DeviceEstimates {
 public:
  DeviceEstimates() = default;
  // Lays out the estimates of `patterns` (one per query head) for calls of shape `ctx`. Throws for VS heads
  // with last_q > 64 (not built yet) and for an inconsistent head count.
  DeviceEstimates(const std::vector<Pattern>& patterns, const LoweringContext& ctx, int num_kv_heads,
                  int head_dim);

  bool empty() const { return vs_.empty() && bs_.empty(); }

  // The most BS scores one wave of the BS estimator holds (floats; default 16M = 64 MB; a single tile of
  // query blocks may exceed it). Read when a DeviceEstimates is constructed: tests lower it to run many
  // waves.
  static void set_bs_wave_floats(int64_t floats);
  static int64_t bs_wave_floats();
  // Keys per CTA of the VS scoring passes for estimators built afterwards (tests): a multiple of 64 in
  // [64, 2048], or 0 (default) to choose by the size of the call.
  static void set_vs_chunk_keys(int keys);
  int num_bs_waves() const { return static_cast<int>(bs_waves_.size()); }

  // Runs the estimators on device tensors q [q_len, num_q_heads, d] and k [kv_len, num_kv_heads, d] (bf16 or
  // f16, head_dim 64/128/256, last dimension contiguous). Asynchronous on `stream`.
  void estimate(const TensorView& q, const TensorView& k, float scale, cudaStream_t stream);

  // Synchronous copies between the device layout and the CPU representation (one entry per query head,
  // std::monostate for static heads). upload() throws when an estimate does not fit the layout (the CPU
  // estimators produce exactly the layout's sizes).
  std::vector<HeadEstimate> download() const;
  void upload(const std::vector<HeadEstimate>& estimates);

  const std::vector<VsHeadDesc>& vs_heads() const { return vs_; }
  const std::vector<BsHeadDesc>& bs_heads() const { return bs_; }
  // Index of query head h in vs_heads() / bs_heads(), or -1.
  int vs_slot(int q_head) const { return slot_of_[static_cast<size_t>(q_head)].first; }
  int bs_slot(int q_head) const { return slot_of_[static_cast<size_t>(q_head)].second; }
  const int32_t* vs_columns() const { return vs_columns_.data(); }
  const int32_t* vs_offsets() const { return vs_offsets_.data(); }
  const int32_t* bs_offsets() const { return bs_offsets_.data(); }
  const int32_t* bs_key_blocks() const { return bs_key_blocks_.data(); }
  const LoweringContext& context() const { return ctx_; }

 private:
  LoweringContext ctx_;
  int num_q_heads_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  int32_t keys_ = 0;  // q_begin + q_len: keys a VS estimate ranks
  std::vector<std::pair<int, int>> slot_of_;
  std::vector<VsHeadDesc> vs_;
  std::vector<BsHeadDesc> bs_;
  std::vector<int32_t> bs_block_sizes_;  // distinct BS block sizes (pool_index)
  std::vector<int64_t> bs_pool_base_;    // start of each pool in bs_kpool_
  int32_t bs_max_q_blocks_ = 0;
  std::vector<BsWave> bs_waves_;
  std::vector<int32_t> bs_offsets_host_;  // CSR offsets of every BS head, concatenated
  bool bs_adaptive_ = false;              // some BS head is adaptive (the select kernel with the coverage count)
  DeviceBuffer<int32_t> vs_columns_, vs_offsets_, bs_offsets_, bs_key_blocks_;
  DeviceBuffer<VsHeadDesc> vs_desc_;
  DeviceBuffer<VsGroupDesc> vs_groups_;
  DeviceBuffer<BsHeadDesc> bs_desc_;
  // Scratch.
  DeviceBuffer<float2> vs_partial_stats_, vs_stats_;
  DeviceBuffer<float> vs_colsum_, vs_diag_partial_, vs_diag_;
  DeviceBuffer<float> bs_kpool_, bs_qpool_, bs_scores_;
  DeviceBuffer<BsTileDesc> bs_tiles_;
  DeviceBuffer<BsWorkDesc> bs_work_;
  int vs_chunks_ = 0;
  int vs_chunk_keys_ = 512;
  int vs_num_groups_ = 0;
};

}  // namespace tessera::attn::gpu
