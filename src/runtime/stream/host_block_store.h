// tessera/runtime/stream/host_block_store.h — evicted KV blocks in host memory, within a byte budget.
//
// Streaming memory moves each `block`-token block out of the local window into this store once every row of it
// is older than the window; retrieval copies the chosen blocks back into the attention workspace. A block holds,
// for one layer, K (before RoPE: retrieved keys are all seen at one distance, stream_options.h) and V, each
// [block_tokens, num_kv_heads, head_dim] f32. Blocks are appended in order per layer: block b of every layer holds
// the same positions.
//
// This is the CPU twin of the GPU path's pinned host memory (which would copy blocks back asynchronously ahead of
// the layer that needs them); the interface is what that path needs too: append, a block's rows, the byte count.
//
// The budget bounds the store's total size. add() past it throws tessera::Error with what was needed:
//   "streaming host store is full: block 7 of layer 2 needs 98.3 kB more, over the budget of 1.00 MB for evicted
//    KV blocks (holding 10 blocks, 983 kB); raise --stream-host-budget or shorten the prompt"
// and bytes_for_tokens() lets a caller refuse a whole prompt up front (StreamingKV::check_prompt).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tessera::runtime::stream {

class HostBlockStore {
 public:
  HostBlockStore() = default;
  // budget_bytes: the store's limit (> 0). element_bytes: bytes per stored value, 4 (f32, this store's own rows),
  // 2 (bf16: the GPU path's pinned blocks, which only account() here) or 1 (the GPU path's FP8 blocks,
  // StreamOptions::host_fp8: E4M3 codes and an f32 scale per token and kv head, for K and for V).
  HostBlockStore(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t block_tokens,
                 int64_t budget_bytes, int32_t element_bytes = 4);

  // Appends block number blocks(layer) of `layer` from k, v ([block_tokens, kv_heads, head_dim] each, contiguous).
  // Throws tessera::Error (above) when the budget cannot hold it; the store is then unchanged.
  void add(int32_t layer, std::span<const float> k, std::span<const float> v);
  // Counts block number blocks(layer) of `layer` against the budget without holding its rows (the GPU path keeps
  // them in pinned memory: runtime/cuda/stream/pinned_block_store.h). The same error as add() past the budget.
  void account(int32_t layer);

  int32_t blocks(int32_t layer) const { return counts_[static_cast<size_t>(layer)]; }
  // Rows of block b of `layer`: [block_tokens, kv_heads, head_dim].
  std::span<const float> k(int32_t layer, int32_t b) const { return k_[static_cast<size_t>(layer)][static_cast<size_t>(b)]; }
  std::span<const float> v(int32_t layer, int32_t b) const { return v_[static_cast<size_t>(layer)][static_cast<size_t>(b)]; }

  int64_t block_bytes() const;  // one block of one layer, K and V (element_bytes each, and FP8's scales)
  int64_t bytes() const { return bytes_; }
  int64_t budget() const { return budget_; }
  int32_t block_tokens() const { return block_tokens_; }
  void clear();

 private:
  void check_room(int32_t layer) const;  // throws when one more block would pass the budget

  int32_t num_layers_ = 0, block_tokens_ = 0, element_bytes_ = 4;
  std::vector<int32_t> counts_;  // blocks per layer
  int64_t row_ = 0;  // floats per token: kv_heads * head_dim
  int64_t scale_bytes_ = 0;  // per token of K (or V): FP8's scales (kv_heads f32), else 0
  int64_t budget_ = 0, bytes_ = 0, held_ = 0;
  std::vector<std::vector<std::vector<float>>> k_, v_;  // [layer][block]
};

}  // namespace tessera::runtime::stream
