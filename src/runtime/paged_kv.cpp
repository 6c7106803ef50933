#include "runtime/paged_kv.h"

#include <algorithm>
#include <cmath>
#include <variant>

#include "core/error.h"
#include "runtime/input_checks.h"

namespace tessera::runtime {

DecodeView::Ranges DecodeView::ranges(int64_t len) const {
  const int64_t lo = std::max<int64_t>(0, len - horizon);  // nothing older than the model's window
  Ranges r{};
  r.a0 = lo;
  r.a1 = std::max(lo, std::min<int64_t>(sink, len));
  r.b0 = std::max({r.a1, lo, len - window});
  r.b1 = std::max(r.b0, len);
  return r;
}

std::vector<DecodeView> decode_views(const ModelConfig& config, const attn::AttentionPolicy* policy,
                                     int64_t prompt_len) {
  const bool has_policy = policy != nullptr && !policy->table().empty();
  if (has_policy) check_policy_fits(*policy, config);
  std::vector<DecodeView> views;
  views.reserve(static_cast<size_t>(config.num_layers) * static_cast<size_t>(config.num_q_heads));
  for (int32_t l = 0; l < config.num_layers; ++l) {
    const int32_t sw = config.layers[static_cast<size_t>(l)].sliding_window;
    for (int32_t h = 0; h < config.num_q_heads; ++h) {
      DecodeView v;
      if (sw > 0) v.horizon = sw;
      if (has_policy) {
        if (const auto* moa = std::get_if<attn::ElasticWindowPattern>(&policy->at(l, h))) {
          v.sink = moa->sink;
          // span = alpha + beta * N at the prompt's length, not clipped to N: the cache of a head whose span
          // covers the prompt goes on growing with the generated tokens until it reaches the span.
          const double span = std::floor(moa->alpha + moa->beta * static_cast<double>(prompt_len));
          v.window = span >= 1 ? static_cast<int64_t>(std::min(span, static_cast<double>(kUnbounded))) : 1;
        }
      }
      views.push_back(v);
    }
  }
  return views;
}

std::vector<KVRetention> kv_retention(const ModelConfig& config, std::span<const DecodeView> views) {
  check(views.size() == static_cast<size_t>(config.num_layers) * static_cast<size_t>(config.num_q_heads),
        "kv_retention: expected one decode view per layer and query head");
  const int32_t group = config.num_q_heads / config.num_kv_heads;
  std::vector<KVRetention> out(static_cast<size_t>(config.num_layers) * static_cast<size_t>(config.num_kv_heads));
  for (int32_t l = 0; l < config.num_layers; ++l) {
    for (int32_t kvh = 0; kvh < config.num_kv_heads; ++kvh) {
      KVRetention r{0, 0};
      for (int32_t g = 0; g < group; ++g) {
        const DecodeView& v = views[static_cast<size_t>(l) * static_cast<size_t>(config.num_q_heads) +
                                    static_cast<size_t>(kvh * group + g)];
        // Sink rows older than the horizon are never seen again; they are few, so they are kept anyway.
        r.sink = std::max(r.sink, v.sink);
        r.window = std::max(r.window, std::min(v.window, v.horizon));
      }
      out[static_cast<size_t>(l) * static_cast<size_t>(config.num_kv_heads) + static_cast<size_t>(kvh)] = r;
    }
  }
  return out;
}

BlockPool::BlockPool(int32_t num_blocks) : total_(num_blocks) {
  check(num_blocks >= 0, "block pool: negative block count");
  free_.resize(static_cast<size_t>(num_blocks));
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  kept_.assign(static_cast<size_t>(num_blocks), 0);
  // Handed out lowest id first (the free list is a stack).
  for (int32_t i = 0; i < num_blocks; ++i) free_[static_cast<size_t>(i)] = num_blocks - 1 - i;
}

int32_t BlockPool::take() {
  check(!free_.empty(), "KV block pool: no free block (a sequence grew past what was reserved for it)");
  const int32_t id = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(id)] = 1;
  return id;
}

void BlockPool::share(int32_t id) {
  check(id >= 0 && id < total_ && refs_[static_cast<size_t>(id)] > 0, "KV block pool: sharing a free block");
  recount(id, [&](size_t i) { ++refs_[i]; });
}

void BlockPool::give(int32_t id) {
  check(id >= 0 && id < total_ && refs_[static_cast<size_t>(id)] > 0, "KV block pool: bad block id");
  check(refs_[static_cast<size_t>(id)] > kept_[static_cast<size_t>(id)],
        "KV block pool: giving back the prefix cache's hold (unkeep it)");
  recount(id, [&](size_t i) {
    if (--refs_[i] == 0) free_.push_back(id);
  });
}

void BlockPool::keep(int32_t id) {
  share(id);
  recount(id, [&](size_t i) { ++kept_[i]; });
}

void BlockPool::unkeep(int32_t id) {
  check(id >= 0 && id < total_ && kept_[static_cast<size_t>(id)] > 0, "KV block pool: unkeeping a block not kept");
  recount(id, [&](size_t i) { --kept_[i]; });
  give(id);
}

SequenceBlocks::SequenceBlocks(const PagedKVShape& shape, std::vector<KVRetention> retention)
    : shape_(shape), retention_(std::move(retention)) {
  check(shape.block_tokens > 0 && shape.num_layers > 0 && shape.num_kv_heads > 0,
        "paged KV: block_tokens, layers and kv heads must be positive");
  check(retention_.size() == static_cast<size_t>(shape.num_layers) * static_cast<size_t>(shape.num_kv_heads),
        "paged KV: expected one retention per layer and kv head");
  tables_.resize(retention_.size());
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks [0, sink_blocks) hold sink rows; blocks >= first_window hold rows of the window, at length len.
struct Kept {
  int64_t sink_blocks, first_window, count;
};

Kept kept_blocks(const KVRetention& r, int64_t len, int64_t B) {
  const int64_t nb = ceil_div(len, B);
  const int64_t s = ceil_div(std::min<int64_t>(r.sink, len), B);
  const int64_t w0 = std::max<int64_t>(0, len - r.window) / B;
  return {s, std::max(w0, s), s + std::max<int64_t>(0, nb - std::max(w0, s))};
}

}  // namespace

bool SequenceBlocks::kept(const KVRetention& r, int64_t b, int64_t len) const {
  const Kept k = kept_blocks(r, len, shape_.block_tokens);
  return b < k.sink_blocks || (b >= k.first_window && b < ceil_div(len, shape_.block_tokens));
}

int64_t SequenceBlocks::blocks_at(int64_t len) const {
  int64_t n = 0;
  for (const KVRetention& r : retention_) n += kept_blocks(r, len, shape_.block_tokens).count;
  return n;
}

int64_t SequenceBlocks::max_blocks(int64_t from, int64_t to) const {
  const int64_t B = shape_.block_tokens;
  int64_t n = 0;
  for (const KVRetention& r : retention_) {
    // The window's rows span at most ceil(window / B) + 1 blocks, the sink's ceil(sink / B); never more than a
    // dense cache of `to` rows.
    const int64_t bound = ceil_div(std::min<int64_t>(r.sink, to), B) + ceil_div(std::min(r.window, to), B) + 1;
    n += std::max(kept_blocks(r, from, B).count, std::min(ceil_div(to, B), bound));
  }
  return n;
}

int64_t SequenceBlocks::need(int64_t n) const {
  const int64_t B = shape_.block_tokens;
  const int64_t len = length_ + n, nb = ceil_div(len, B);
  int64_t count = 0;
  for (size_t i = 0; i < retention_.size(); ++i) {
    const std::vector<int32_t>& t = tables_[i];
    for (int64_t b = length_ / B; b < nb; ++b) {
      const bool have = b < static_cast<int64_t>(t.size()) && t[static_cast<size_t>(b)] >= 0;
      if (!have && kept(retention_[i], b, len)) ++count;
    }
  }
  return count;
}

void SequenceBlocks::adopt(std::span<const std::vector<int32_t>* const> shared, BlockPool& pool) {
  check(length_ == 0 && held_ == 0, "paged KV: a cached prefix starts an empty sequence");
  const auto nb = static_cast<int64_t>(shared.size());
  const int64_t len = nb * shape_.block_tokens;
  for (const std::vector<int32_t>* ids : shared)
    check(ids->size() == tables_.size(), "paged KV: a cached block has one id per layer and kv head");
  for (size_t i = 0; i < tables_.size(); ++i) {
    std::vector<int32_t>& t = tables_[i];
    t.assign(static_cast<size_t>(nb), -1);
    for (int64_t b = 0; b < nb; ++b) {
      if (!kept(retention_[i], b, len)) continue;
      const int32_t id = (*shared[static_cast<size_t>(b)])[i];
      check(id >= 0, "paged KV: a cached prefix lacks a block the sequence keeps");
      pool.share(id);
      t[static_cast<size_t>(b)] = id;
      ++held_;
    }
  }
  length_ = len;
}

void SequenceBlocks::grow(int64_t n, BlockPool& pool) {
  check(n >= 0, "paged KV: negative growth");
  if (n == 0) return;
  const int64_t B = shape_.block_tokens;
  const int64_t len = length_ + n;
  const int64_t nb_old = ceil_div(length_, B), nb = ceil_div(len, B);
  // Count what is needed first, so that a failure changes nothing.
  const int64_t need = this->need(n);
  if (need > pool.available())
    throw Error("KV cache: " + std::to_string(need) + " more blocks of " + std::to_string(B) +
                " tokens needed, " + std::to_string(pool.available()) + " free of " + std::to_string(pool.total()));
  for (size_t i = 0; i < retention_.size(); ++i) {
    std::vector<int32_t>& t = tables_[i];
    const KVRetention& r = retention_[i];
    t.resize(static_cast<size_t>(nb), -1);
    for (int64_t b = length_ / B; b < nb; ++b) {
      if (t[static_cast<size_t>(b)] < 0 && kept(r, b, len)) {
        t[static_cast<size_t>(b)] = pool.take();
        ++held_;
      }
    }
    // Blocks between the sink and the window's first block have fallen out of the window: back to the pool.
    const Kept k = kept_blocks(r, len, B);
    const int64_t prev_first = length_ > 0 ? kept_blocks(r, length_, B).first_window : 0;
    for (int64_t b = std::max(k.sink_blocks, std::min(prev_first, nb_old)); b < std::min(k.first_window, nb); ++b) {
      if (t[static_cast<size_t>(b)] >= 0) {
        pool.give(t[static_cast<size_t>(b)]);
        t[static_cast<size_t>(b)] = -1;
        --held_;
      }
    }
  }
  length_ = len;
}

void SequenceBlocks::release(BlockPool& pool) {
  for (std::vector<int32_t>& t : tables_) {
    for (int32_t id : t)
      if (id >= 0) pool.give(id);
    t.clear();
  }
  held_ = 0;
  length_ = 0;
}

SequenceBlocks SequenceBlocks::mirror(const PagedKVShape& shape) {
  return SequenceBlocks(shape, std::vector<KVRetention>(static_cast<size_t>(shape.num_layers) *
                                                        static_cast<size_t>(std::max(shape.num_kv_heads, 0))));
}

void SequenceBlocks::set_entry(size_t i, int64_t b, int32_t id) {
  check(i < tables_.size() && b >= 0, "paged KV: table entry (" + std::to_string(i) + ", " + std::to_string(b) +
                                          ") outside the sequence's " + std::to_string(tables_.size()) + " tables");
  std::vector<int32_t>& t = tables_[i];
  if (static_cast<int64_t>(t.size()) <= b) t.resize(static_cast<size_t>(b) + 1, -1);
  held_ += (id >= 0 ? 1 : 0) - (t[static_cast<size_t>(b)] >= 0 ? 1 : 0);
  t[static_cast<size_t>(b)] = id;
}

int32_t SequenceBlocks::block(int32_t layer, int32_t kv_head, int64_t pos) const {
  if (pos < 0 || pos >= length_) return -1;
  const std::vector<int32_t>& t = table(layer, kv_head);
  const int64_t b = pos / shape_.block_tokens;
  return b < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(b)] : -1;
}

}  // namespace tessera::runtime
