#include "runtime/kv_cache.h"

#include <algorithm>
#include <new>
#include <string>

#include "core/error.h"
#include "core/format.h"
#include "core/memory_budget.h"

namespace tessera::runtime {

KVCache::KVCache(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t max_tokens)
    : ContiguousKVLayers(num_layers, num_kv_heads, head_dim, max_tokens) {}

double KVCache::bytes_for(int64_t tokens) const {
  return static_cast<double>(tokens) * static_cast<double>(row_) * sizeof(float) * 2.0 * num_layers_;
}

std::string KVCache::describe(int64_t tokens) const {
  return "KV cache for " + with_commas(tokens) + " tokens (" + std::to_string(num_layers_) + " layers x " +
         std::to_string(num_kv_heads_) + " kv heads x " + std::to_string(head_dim_) + " dims, K and V in f32)";
}

void KVCache::check_budget(int64_t tokens) const {
  check_host_allocation(describe(tokens), bytes_for(tokens), "lower the context limit (--max-context) or shorten the prompt");
}

void KVCache::reserve(int32_t tokens) {
  check(tokens <= max_tokens_,
        "KV cache: " + std::to_string(tokens) + " tokens exceed its limit of " + std::to_string(max_tokens_));
  if (tokens <= capacity_) return;
  check_budget(tokens);  // before anything is allocated: fails with the size the tokens need
  // Geometric growth (decode appends one token at a time), never beyond the limit or the budget.
  const int64_t grown = std::max<int64_t>({tokens, 2 * static_cast<int64_t>(capacity_), 256});
  int32_t cap = static_cast<int32_t>(std::min<int64_t>(grown, max_tokens_));
  if (bytes_for(cap) > static_cast<double>(host_memory_budget().bytes)) cap = tokens;
  try {
    for (int32_t l = 0; l < num_layers_; ++l) {
      k_[static_cast<size_t>(l)].resize(static_cast<size_t>(cap) * static_cast<size_t>(row_));
      v_[static_cast<size_t>(l)].resize(static_cast<size_t>(cap) * static_cast<size_t>(row_));
    }
  } catch (const std::bad_alloc&) {
    throw Error(describe(cap) + ": out of host memory allocating " + format_bytes(bytes_for(cap)) +
                "; lower the context limit (--max-context) or shorten the prompt");
  }
  capacity_ = cap;
}

void KVCache::release() {
  for (auto& x : k_) std::vector<float>().swap(x);
  for (auto& x : v_) std::vector<float>().swap(x);
  capacity_ = 0;
}

TensorView KVCache::k_view(int32_t layer, int32_t len) {
  return TensorView(k_[static_cast<size_t>(layer)].data(), DType::F32, {len, num_kv_heads_, head_dim_});
}

TensorView KVCache::v_view(int32_t layer, int32_t len) {
  return TensorView(v_[static_cast<size_t>(layer)].data(), DType::F32, {len, num_kv_heads_, head_dim_});
}

size_t KVCache::bytes() const {
  size_t b = 0;
  for (const auto& x : k_) b += x.size() * sizeof(float);
  for (const auto& x : v_) b += x.size() * sizeof(float);
  return b;
}

}  // namespace tessera::runtime
