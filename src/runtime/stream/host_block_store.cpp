#include "runtime/stream/host_block_store.h"

#include <algorithm>
#include <new>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"

namespace tessera::runtime::stream {

HostBlockStore::HostBlockStore(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t block_tokens,
                               int64_t budget_bytes, int32_t element_bytes)
    : num_layers_(num_layers),
      block_tokens_(block_tokens),
      element_bytes_(element_bytes),
      counts_(static_cast<size_t>(num_layers), 0),
      row_(static_cast<int64_t>(num_kv_heads) * head_dim),
      budget_(budget_bytes),
      k_(static_cast<size_t>(num_layers)),
      v_(static_cast<size_t>(num_layers)) {
  check(budget_bytes > 0, [&] {
    return "streaming host store: the budget must be positive, got " + std::to_string(budget_bytes);
  });
  check(block_tokens > 0, "streaming host store: block_tokens must be positive");
  check(element_bytes == 4 || element_bytes == 2 || element_bytes == 1,
        "streaming host store: values are 4 (f32), 2 (bf16) or 1 (FP8 E4M3 with a scale per token and head) bytes");
  scale_bytes_ = element_bytes == 1 ? static_cast<int64_t>(num_kv_heads) * 4 : 0;
}

int64_t HostBlockStore::block_bytes() const {
  return 2 * static_cast<int64_t>(block_tokens_) * (row_ * static_cast<int64_t>(element_bytes_) + scale_bytes_);
}

void HostBlockStore::check_room(int32_t layer) const {
  check(layer >= 0 && layer < num_layers_,
        [&] { return "streaming host store: layer " + std::to_string(layer) + " out of range"; });
  const int64_t need = block_bytes();
  if (bytes_ + need > budget_) {
    throw Error("streaming host store is full: block " + std::to_string(blocks(layer)) + " of layer " +
                std::to_string(layer) + " needs " + format_bytes(static_cast<double>(need)) +
                " more, over the budget of " + format_bytes(static_cast<double>(budget_)) +
                " for evicted KV blocks (holding " + std::to_string(held_) + " blocks, " +
                format_bytes(static_cast<double>(bytes_)) +
                "); raise --stream-host-budget or shorten the prompt");
  }
}

void HostBlockStore::account(int32_t layer) {
  check_room(layer);
  bytes_ += block_bytes();
  ++held_;
  ++counts_[static_cast<size_t>(layer)];
}

void HostBlockStore::add(int32_t layer, std::span<const float> k, std::span<const float> v) {
  const auto floats = static_cast<size_t>(block_tokens_ * row_);
  check(element_bytes_ == 4, "streaming host store: add() holds f32 rows; this store only accounts the GPU path's blocks");
  check(k.size() == floats && v.size() == floats, [&] {
    return "streaming host store: a block is " + std::to_string(floats) + " floats of K and of V, got " +
           std::to_string(k.size()) + " and " + std::to_string(v.size());
  });
  check_room(layer);
  const int64_t need = block_bytes();
  try {
    k_[static_cast<size_t>(layer)].emplace_back(k.begin(), k.end());
    v_[static_cast<size_t>(layer)].emplace_back(v.begin(), v.end());
  } catch (const std::bad_alloc&) {
    if (k_[static_cast<size_t>(layer)].size() > v_[static_cast<size_t>(layer)].size()) k_[static_cast<size_t>(layer)].pop_back();
    throw Error("streaming host store: out of host memory allocating block " + std::to_string(blocks(layer)) +
                " of layer " + std::to_string(layer) + " (" + format_bytes(static_cast<double>(need)) +
                "); lower --stream-host-budget or shorten the prompt");
  }
  bytes_ += need;
  ++held_;
  ++counts_[static_cast<size_t>(layer)];
}

void HostBlockStore::clear() {
  for (auto& l : k_) l.clear();
  for (auto& l : v_) l.clear();
  std::fill(counts_.begin(), counts_.end(), 0);
  bytes_ = 0;
  held_ = 0;
}

}  // namespace tessera::runtime::stream
