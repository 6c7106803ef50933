// tessera/parallel/tp_batch.h — the batched engine over tensor-parallel ranks (`serve --gpus N --parallel M`).
//
// Rank 0 runs runtime::BatchEngine — the scheduler and its one KV manager: block ids are the scheduler's — over
// TpBatchLeader, a BatchBackend that first sends each call to the other ranks as a command (the channel and wire
// format of parallel/tp_service.h, the mechanism `serve --gpus N` already uses) and then makes the call on its own
// rank's backend. Ranks 1..N-1 run tp_batch_worker, which makes the same call on theirs. Each rank's backend runs the
// layer recipe over its shard of the weights and keeps its KV groups' rows in the blocks the scheduler gave (the
// same ids on every rank); its partial products are all-reduced at the recipe's hooks (NCCL on GPUs,
// HostAllReduce in the CPU twin), so every call runs on every rank, in the same order.
//
//   rank 0: TpBatchLeader                         ranks 1..N-1: tp_batch_worker
//   create_store       -> kStore                   create_store, same shape and counts
//   prefill_chunk(_rows) -> kPrefill               the same chunk under the same policy (its JSON sent when it
//                                                  changes: flag kPolicy)
//   load_prefix        -> kLoadPrefix              the sequence's tables into its mirror, load_prefix
//   finish_prefill     -> kFinish                  the sequence's tables and decode views into its mirror,
//                                                  finish_prefill
//   decode_select      -> kBatchDecode             per row: the table entries that changed since last sent and
//                                                  the length; decode() (rank 0 alone chooses the tokens)
//   release_sequence   -> kRelease                 release_sequence, the mirror dropped
//   abort_prefill      -> kAbort                   abort_prefill
//   quit()             -> kQuit                    return
// A follower's sequence is a mirror (SequenceBlocks::mirror) kept under the id rank 0 gave it; a decode step sends
// only what changed: the new block of each table every block_tokens tokens, and the blocks that fell out of a
// window. Streaming memory is refused (its host-side decisions are per rank; not carried yet).
//
// Arguments (TpCommand::tokens unless said):
//   kStore        pos = blocks, total_len = max_context; {layers, kv_heads, head_dim, block_tokens, max_sequences}
//   kPrefill      pos, total_len; the chunk's tokens; flags kLogits | kRows | kPolicy (policy_json: "" = dense)
//   kLoadPrefix   pos = rows, total_len; {id, length, tables, per table: size, ids...}
//   kFinish       {id, length, tables, per table: size, ids..., views, per view: sink, window, horizon}
//                 (window and horizon as int32, -1 = unbounded)
//   kBatchDecode  {rows, tokens..., per row: id, length, changes, per change: table, block, id}
//   kRelease      pos = id
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "parallel/placement.h"
#include "parallel/tp_service.h"
#include "runtime/batch_engine.h"

namespace tessera::parallel {

inline constexpr int32_t kTpLogits = 1, kTpRows = 2, kTpPolicy = 4;  // kPrefill's flags

class TpBatchLeader final : public runtime::BatchBackend {
 public:
  // `local`: rank 0's own backend (its shard); both must outlive this.
  TpBatchLeader(CommandChannel& channel, runtime::BatchBackend& local);

  const runtime::ModelConfig& config() const override { return local_.config(); }
  const char* device_name() const override { return local_.device_name(); }
  double block_bytes(const runtime::PagedKVShape& shape) const override { return local_.block_bytes(shape); }
  double default_kv_bytes() const override { return local_.default_kv_bytes(); }
  void create_store(const runtime::PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                    int32_t max_context) override;
  std::vector<float> prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                   const attn::AttentionPolicy* policy, bool logits) override;
  bool supports_prompt_logits() const override { return local_.supports_prompt_logits(); }
  std::vector<float> prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                        const attn::AttentionPolicy* policy) override;
  void finish_prefill(const runtime::SequenceBlocks& seq, std::span<const runtime::DecodeView> views) override;
  void release_sequence(const runtime::SequenceBlocks& seq) override;
  void abort_prefill() override;
  bool supports_prefix_cache() const override { return local_.supports_prefix_cache(); }
  void load_prefix(const runtime::SequenceBlocks& seq, int32_t rows, int32_t total_len) override;
  // Refuses: "streaming memory: the tensor-parallel batched backend has none (drop --stream or --gpus)".
  std::unique_ptr<runtime::StreamMemory> new_stream(const runtime::StreamOptions& options) override;
  std::vector<float> decode(std::span<const int32_t> tokens, std::span<const runtime::DecodeRow> rows) override;
  std::vector<int32_t> decode_select(std::span<const int32_t> tokens, std::span<const runtime::DecodeRow> rows,
                                     std::span<const RowChoice> choice) override;
  int64_t step_builds() const override { return local_.step_builds(); }
  runtime::ForwardTimers timers() const override { return local_.timers(); }

  // Tells the other ranks to return (after the last call).
  void quit();
  // Commands sent and int32 sent in their payloads (what a step costs on the wire).
  int64_t commands() const { return commands_; }
  int64_t payload_ints_sent() const { return payload_ints_; }

 private:
  struct Sent {  // what the followers' mirror of a sequence holds
    int32_t id = 0;
    int64_t length = 0;
    std::vector<std::vector<int32_t>> tables;
  };
  void send(const TpCommand& c);
  Sent& full(const runtime::SequenceBlocks& seq, std::vector<int32_t>& out);  // appends the full encoding
  void prefill_command(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                       const attn::AttentionPolicy* policy, int32_t flags);
  // The decode command of `rows` (their mirrors brought up to date).
  void decode_command(std::span<const int32_t> tokens, std::span<const runtime::DecodeRow> rows);

  CommandChannel& channel_;
  runtime::BatchBackend& local_;
  std::map<const runtime::SequenceBlocks*, Sent> sent_;
  int32_t next_id_ = 1;
  std::string policy_json_;  // the policy the followers hold
  bool policy_sent_ = false;
  int64_t commands_ = 0, payload_ints_ = 0;
};

// Ranks 1..N-1: runs rank 0's calls on `local` until kQuit. A call that throws tessera::Error (rank 0's throws too,
// and the scheduler ends that request) is reported on stderr and the worker goes on. Returns the commands run.
// `on_call`, when set, sees each command after it ran, with the follower's sequences (tests compare them with rank
// 0's).
struct TpBatchMirror {
  runtime::SequenceBlocks seq;
  std::vector<runtime::DecodeView> views;
};
int64_t tp_batch_worker(CommandChannel& channel, runtime::BatchBackend& local, const attn::PolicyShape& shape,
                        const std::function<void(const TpCommand&, const std::map<int32_t, std::unique_ptr<TpBatchMirror>>&)>&
                            on_call = {});

// A rank's share of the scheduler's requests for a rank backend whose model holds only the rank's heads and MLP
// columns as a model of its own (the GPU ranks: parallel/cuda/tp_batch_gpu.h, a GpuBatchBackend over that model).
// The uniform placement only (Megatron's split): rank r holds query heads [r Hq / N, (r + 1) Hq / N) and KV heads
// [r Hkv / N, (r + 1) Hkv / N) in every layer, so its share is a model of Hq / N query and Hkv / N KV heads. A
// FlexAttn placement gives ranks different KV-group counts per layer, which the paged store and decode step, one
// shape for all layers, do not take: rank_slice refuses it.
struct RankSlice {
  int32_t rank = 0, world = 1;
  int32_t q0 = 0, q_heads = 0;    // query heads [q0, q0 + q_heads)
  int32_t kv0 = 0, kv_heads = 0;  // KV heads [kv0, kv0 + kv_heads)
  int64_t ffn_begin = 0, ffn_end = 0;
};
// The uniform placement of `world` ranks. Throws when Hkv is not a multiple of world:
//   "tensor-parallel batching: the model's 3 KV heads do not split over 2 GPUs; use a GPU count that divides 3"
Placement uniform_rank_placement(const runtime::ModelConfig& config, int32_t world);
// Rank `rank`'s slice of `placement`. Throws for a placement that is not the uniform one:
//   "tensor-parallel batching (--parallel): <source> puts layer 0 head 1 on GPU 1; the batched backend runs the
//    uniform placement only (drop --placement, or serve with --parallel 1)"
RankSlice rank_slice(const runtime::ModelConfig& config, const Placement& placement, int32_t rank,
                     const std::string& source = "the placement");
// The rank's model: the config with its head counts and MLP width; its weights (shard_layer's copies, replicated
// embedding, norms and head).
runtime::ModelConfig rank_config(const runtime::ModelConfig& config, const RankSlice& slice);
runtime::ModelWeights rank_weights(const runtime::ModelConfig& config, const runtime::ModelWeights& weights,
                                   const Placement& placement, int32_t rank);
// The policy (null or empty: dense, returned empty) and decode views (decode_views layout) of the rank's heads.
attn::AttentionPolicy rank_policy(const attn::AttentionPolicy* policy, const RankSlice& slice);
std::vector<runtime::DecodeView> rank_views(std::span<const runtime::DecodeView> views,
                                            const runtime::ModelConfig& config, const RankSlice& slice);

// The rank's copies of the scheduler's sequences: their tables of the rank's KV heads ([layer * kv_heads + j] for
// KV head kv0 + j), brought up to date from the full sequence (all tables when it is new or `whole`, else only the
// columns its growth since the last sync can have changed).
class RankTables {
 public:
  RankTables(const runtime::PagedKVShape& full, const RankSlice& slice);
  const runtime::PagedKVShape& shape() const { return shape_; }
  const runtime::SequenceBlocks& sync(const runtime::SequenceBlocks& full, bool whole);
  void forget(const runtime::SequenceBlocks& full);
  size_t size() const { return seqs_.size(); }

 private:
  runtime::PagedKVShape full_, shape_;
  RankSlice slice_;
  std::map<const runtime::SequenceBlocks*, std::unique_ptr<runtime::SequenceBlocks>> seqs_;
};

}  // namespace tessera::parallel
