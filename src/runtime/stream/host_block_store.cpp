#include "runtime/stream/host_block_store.h"

#include <new>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"

namespace tessera::runtime::stream {

HostBlockStore::HostBlockStore(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t block_tokens,
                               int64_t budget_bytes)
    : num_layers_(num_layers),
      block_tokens_(block_tokens),
      row_(static_cast<int64_t>(num_kv_heads) * head_dim),
      budget_(budget_bytes),
      k_(static_cast<size_t>(num_layers)),
      v_(static_cast<size_t>(num_layers)) {
  check(budget_bytes > 0, "streaming host store: the budget must be positive, got " + std::to_string(budget_bytes));
  check(block_tokens > 0, "streaming host store: block_tokens must be positive");
}

int64_t HostBlockStore::block_bytes() const {
  return 2 * static_cast<int64_t>(block_tokens_) * row_ * static_cast<int64_t>(sizeof(float));
}

void HostBlockStore::add(int32_t layer, std::span<const float> k, std::span<const float> v) {
  const auto floats = static_cast<size_t>(block_tokens_ * row_);
  check(layer >= 0 && layer < num_layers_, "streaming host store: layer " + std::to_string(layer) + " out of range");
  check(k.size() == floats && v.size() == floats, "streaming host store: a block is " + std::to_string(floats) +
                                                      " floats of K and of V, got " + std::to_string(k.size()) +
                                                      " and " + std::to_string(v.size()));
  const int64_t need = block_bytes();
  if (bytes_ + need > budget_) {
    throw Error("streaming host store is full: block " + std::to_string(blocks(layer)) + " of layer " +
                std::to_string(layer) + " needs " + format_bytes(static_cast<double>(need)) +
                " more, over the budget of " + format_bytes(static_cast<double>(budget_)) +
                " for evicted KV blocks (holding " + std::to_string(held_) + " blocks, " +
                format_bytes(static_cast<double>(bytes_)) +
                "); raise --stream-host-budget or shorten the prompt");
  }
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
}

void HostBlockStore::clear() {
  for (auto& l : k_) l.clear();
  for (auto& l : v_) l.clear();
  bytes_ = 0;
  held_ = 0;
}

}  // namespace tessera::runtime::stream
