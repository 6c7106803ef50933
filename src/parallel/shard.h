// tessera/parallel/shard.h — what one tensor-parallel rank holds, and its weights reorganised once (FlexAttn's
// WPR).
//
// Per layer, rank r of N holds the query heads the placement gives it (parallel/placement.h) and the KV groups of
// those heads; the MLP is split by columns of gate/up and rows of down, [r F / N, (r + 1) F / N) (Megatron).
// Each rank's weights are copied out of the full model once, contiguous in the rank's own order, so that the
// forward pass never indexes or slices at run time:
//   wq    [m d, hidden]      the rank's m heads, ordered by KV group then head (RankLayer::heads); bq
//   likewise wk wv [g d, hidden]      the rank's g groups, ascending (RankLayer::groups); bk bv likewise wo
//   [hidden, m d]      the columns of those heads, in the same order w_gate w_up [F_r, hidden], w_down
//   [hidden, F_r]
// Norms (and Gemma-3's per-head QK-norm weights, shared by all heads) are replicated; so are the embeddings
// and the LM head (every rank computes the residual stream in full). Then per layer:
//   attention partial o_r = a_r wo_r^T   (a_r: attention of the rank's heads)     sum over ranks = a Wo^T
//   MLP partial       m_r = act(h wg_r^T) * (h wu_r^T) wd_r^T                        sum over ranks = the MLP
// and one all-reduce (sum) after each: the residual update is the sum, exactly as in the single-rank forward
// up to the order of the f32 (or bf16) additions.
//
// A rank with heads of a KV group runs that group's heads as one GQA call on its group's K/V (the query heads
// of a group are contiguous in the rank's order): RankLayer::group_heads gives, per held group, the local
// heads.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/placement.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tessera::parallel {

struct RankLayer {
  std::vector<int32_t> heads;   // global query heads, ordered by group then head
  std::vector<int32_t> groups;  // global KV groups held, ascending
  // Per held group (same order as groups): [first, end) local head indices of that group's heads.
  std::vector<std::pair<int32_t, int32_t>> group_heads;
};

struct RankPlan {
  int32_t rank = 0, world = 1;
  int64_t ffn_begin = 0, ffn_end = 0;  // this rank's MLP columns
  std::vector<RankLayer> layers;
};

// Throws Error when the placement does not fit the model (validate()) or rank is outside [0, num_gpus).
RankPlan rank_plan(const runtime::ModelConfig& config, const Placement& placement, int32_t rank);

// The rank's layer weights, copied out of the full layer (see the table above).
runtime::LayerWeights shard_layer(const runtime::LayerWeights& full, const runtime::ModelConfig& config,
                                  const RankLayer& layer, int64_t ffn_begin, int64_t ffn_end);

// Rows [r0, r1) of row blocks (`blocks` lists block indices of `block_rows` rows each) of a [rows, cols]
// matrix.
runtime::Weight gather_rows(const runtime::Weight& w, const std::vector<int32_t>& blocks, int64_t block_rows);
// Columns of column blocks of a [rows, cols] matrix.
runtime::Weight gather_cols(const runtime::Weight& w, const std::vector<int32_t>& blocks, int64_t block_cols);

}  // namespace tessera::parallel
