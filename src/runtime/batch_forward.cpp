#include "runtime/batch_forward.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "attention/attention_args.h"
#include "attention/cpu/layer_attention_cpu.h"
#include "attention/cpu/paged_decode.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "runtime/ops.h"
#include "runtime/recipe.h"

namespace tessera::runtime {

PagedKVStore::PagedKVStore(const PagedKVShape& shape, int32_t num_blocks, KVType type)
    : shape_(shape), num_blocks_(num_blocks), type_(type), elem_(kv_type_size(type)) {
  check(num_blocks >= 0, "paged KV store: negative block count");
  const double bytes = bytes_per_block(shape, type) * num_blocks;
  const std::string what = "paged KV cache of " + std::to_string(num_blocks) + " blocks of " +
                           std::to_string(shape.block_tokens) + " tokens (K and V in " +
                           std::string(kv_type_name(type)) + ")";
  check_host_allocation(what, bytes, "lower the KV budget");
  const size_t n = static_cast<size_t>(num_blocks) * static_cast<size_t>(shape.elements_per_block());
  try {
    k_ = std::make_unique_for_overwrite<std::byte[]>(n * elem_);
    v_ = std::make_unique_for_overwrite<std::byte[]>(n * elem_);
    elements_ = n;
  } catch (const std::bad_alloc&) {
    throw Error(what + ": out of host memory allocating " + format_bytes(bytes) + "; lower the KV budget");
  }
}

void PagedKVStore::release_pages() {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (std::byte* base : {k_.get(), v_.get()}) {
    if (base == nullptr || page == 0) continue;
    // The whole pages inside the allocation (its first and last may share a page with other memory).
    const auto begin = (reinterpret_cast<uintptr_t>(base) + page - 1) / page * page;
    const auto end = (reinterpret_cast<uintptr_t>(base) + elements_ * elem_) / page * page;
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
}

float* PagedKVStore::as_f32(std::byte* base, int32_t block, int64_t row) const {
  check(type_ == KVType::F32, "paged KV store: f32 access to a " + std::string(kv_type_name(type_)) + " store");
  return reinterpret_cast<float*>(base) + offset(block, row);
}

void PagedKVStore::write(int32_t block, int64_t row, int64_t n, const float* k_rows, const float* v_rows) {
  check(block >= 0 && block < num_blocks_ && row >= 0 && n >= 0 && row + n <= shape_.block_tokens,
        "paged KV store: writing rows outside a block");
  const int64_t count = n * shape_.head_dim;
  if (type_ == KVType::F32) {
    std::copy_n(k_rows, count, k(block, row));
    std::copy_n(v_rows, count, v(block, row));
    return;
  }
  f32_to_half(k_rows, reinterpret_cast<uint16_t*>(k_bytes(block, row)), count, type_);
  f32_to_half(v_rows, reinterpret_cast<uint16_t*>(v_bytes(block, row)), count, type_);
}

void PagedKVStore::read(int32_t block, int64_t row, int64_t n, float* k_rows, float* v_rows) const {
  check(block >= 0 && block < num_blocks_ && row >= 0 && n >= 0 && row + n <= shape_.block_tokens,
        "paged KV store: reading rows outside a block");
  const int64_t count = n * shape_.head_dim;
  if (type_ == KVType::F32) {
    std::copy_n(k(block, row), count, k_rows);
    std::copy_n(v(block, row), count, v_rows);
    return;
  }
  half_to_f32(reinterpret_cast<const uint16_t*>(k_bytes(block, row)), k_rows, count, type_);
  half_to_f32(reinterpret_cast<const uint16_t*>(v_bytes(block, row)), v_rows, count, type_);
}

namespace {
// Rows [0, len) of each (layer, kv head) between the contiguous cache and the blocks: f(cache row, block row) per
// kept row.
template <class F>
void for_each_paged_row(const SequenceBlocks& seq, int64_t len, F&& f) {
  const PagedKVShape& s = seq.shape();
  const int64_t B = s.block_tokens, d = s.head_dim;
  for (int32_t l = 0; l < s.num_layers; ++l)
    for (int32_t h = 0; h < s.num_kv_heads; ++h) {
      const std::vector<int32_t>& t = seq.table(l, h);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int32_t blk = t[static_cast<size_t>(pos / B)];
        if (blk < 0) continue;
        f(l, (static_cast<size_t>(pos) * static_cast<size_t>(s.num_kv_heads) + static_cast<size_t>(h)) *
                 static_cast<size_t>(d),
          blk, pos % B);
      }
    }
}
}  // namespace

namespace {
void check_same_type(const KVCache& cache, const PagedKVStore& store) {
  check(cache.type() == store.type(), "paged KV: the staging cache is " + std::string(kv_type_name(cache.type())) +
                                          ", the blocks " + std::string(kv_type_name(store.type())));
}
}  // namespace

void scatter_to_pages(KVCache& cache, const SequenceBlocks& seq, PagedKVStore& store) {
  check_same_type(cache, store);
  const size_t bytes = store.row_bytes(), elem = kv_type_size(store.type());
  for_each_paged_row(seq, seq.length(), [&](int32_t l, size_t row, int32_t blk, int64_t r) {
    std::memcpy(store.k_bytes(blk, r), cache.k_bytes(l, 0) + row * elem, bytes);
    std::memcpy(store.v_bytes(blk, r), cache.v_bytes(l, 0) + row * elem, bytes);
  });
}

void gather_from_pages(const PagedKVStore& store, const SequenceBlocks& seq, int64_t rows, KVCache& cache) {
  check(rows <= seq.length() && rows <= cache.capacity(), "paged KV: gathering rows the sequence or cache lacks");
  check_same_type(cache, store);
  const size_t bytes = store.row_bytes(), elem = kv_type_size(store.type());
  for_each_paged_row(seq, rows, [&](int32_t l, size_t row, int32_t blk, int64_t r) {
    std::memcpy(cache.k_bytes(l, 0) + row * elem, store.k_bytes(blk, r), bytes);
    std::memcpy(cache.v_bytes(l, 0) + row * elem, store.v_bytes(blk, r), bytes);
  });
}

namespace {
// -2: not yet read from TESSERA_DECODE_ORDER; -1: not set (the caller's default); 0 / 1: fast / prefill
std::atomic<int> g_decode_in_prefill_order{-2};
}  // namespace

void set_decode_in_prefill_order(bool on) {
  g_decode_in_prefill_order.store(on ? 1 : 0, std::memory_order_relaxed);
}
bool decode_in_prefill_order(bool by_default) {
  int on = g_decode_in_prefill_order.load(std::memory_order_relaxed);
  if (on == -2) {
    const char* env = std::getenv("TESSERA_DECODE_ORDER");
    const std::string v = env != nullptr ? env : "";
    check(v.empty() || v == "prefill" || v == "fast",
          "TESSERA_DECODE_ORDER: expected prefill or fast, got '" + v + "'");
    on = v.empty() ? -1 : v == "prefill" ? 1 : 0;
    g_decode_in_prefill_order.store(on, std::memory_order_relaxed);
  }
  return on < 0 ? by_default : on == 1;
}

void paged_decode_attention_cpu(const float* q, float* out, std::span<const DecodeRow> rows, int32_t layer,
                                int32_t num_q_heads, const PagedKVStore& store, float scale, ThreadPool& pool,
                                std::optional<bool> prefill_order) {
  if (scale == 0) scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(store.shape().head_dim)));
  const PagedKVShape& s = store.shape();
  const int64_t B = s.block_tokens, d = s.head_dim;
  const int32_t group = num_q_heads / s.num_kv_heads;
  const DType elem = store.type() == KVType::BF16 ? DType::BF16 : store.type() == KVType::F16 ? DType::F16 : DType::F32;
  const attn::PagedIsa isa = attn::paged_decode_isa();
  auto view_of = [&](const DecodeRow& row, int32_t h) -> const DecodeView& {
    return row.views[static_cast<size_t>(layer) * static_cast<size_t>(num_q_heads) + static_cast<size_t>(h)];
  };
  // One item per (row, kv head): the query heads of its GQA group that see the same keys go through the keys
  // together (attention/cpu/paged_decode.h: each key and value read, and converted from a half store, once for all
  // of them); heads of one group that see different keys (MoA's per-head windows) one at a time. An item is cut into
  // parts of consecutive keys (attn::paged_decode_parts) when the items are too few for the pool's threads (Gemma-3:
  // one KV head, so one item per row; the parts depend on the item alone, so a row gives the same bits batched or
  // alone): each part's unnormalised output, running max and sum go to `partial`, merged per item afterwards
  // (log-sum-exp).
  struct Item {
    bool same = true;      // the group's heads share a view
    bool exact = false;    // through attn::paged_decode_in_prefill_order, `parts` chunks of the group's heads
    int32_t parts = 1;     // > 1: split, its parts' results at partial[at]
    int64_t work = 0;      // keys x heads walked x head_dim
    size_t at = 0;
  };
  const int64_t n_items = static_cast<int64_t>(rows.size()) * s.num_kv_heads;
  std::vector<Item> items(static_cast<size_t>(n_items));
  for (int64_t it = 0; it < n_items; ++it) {
    const DecodeRow& row = rows[static_cast<size_t>(it / s.num_kv_heads)];
    const auto h0 = static_cast<int32_t>(it % s.num_kv_heads) * group;
    Item& item = items[static_cast<size_t>(it)];
    for (int32_t g = 1; g < group && item.same; ++g) item.same = view_of(row, h0 + g) == view_of(row, h0);
    if (item.same) {
      item.work = view_of(row, h0).ranges(row.seq->length()).count() * group * d;
    } else {
      for (int32_t g = 0; g < group; ++g) item.work += view_of(row, h0 + g).ranges(row.seq->length()).count() * d;
    }
  }
  // A dense view (every key up to the row, or a model window's last keys) takes the prefill's order
  // (decode_in_prefill_order): the row's output is the same bits as the same row prefilled, so the blocks a decode
  // step wrote hold the rows a prefill would have written (the prefix cache keeps them). Not split across keys (a
  // merge would add in another order): its query heads are cut into chunks instead when the items are too few for the
  // pool (depending on the number of items, not on the row).
  const bool exact_order = prefill_order.value_or(decode_in_prefill_order(true));
  auto exact_view = [](const DecodeView& v) { return v.sink == 0 && v.window == kUnbounded; };
  const int32_t head_chunks =
      std::min<int32_t>(group, std::max<int32_t>((group + 3) / 4, static_cast<int32_t>((pool.size() + n_items - 1) /
                                                                                       std::max<int64_t>(1, n_items))));
  // The work units (item, part); partial holds each split item's [parts][group][d] outputs, then its [parts][group]
  // maxima and sums.
  std::vector<std::pair<int64_t, int32_t>> units;
  units.reserve(items.size());
  size_t partial_size = 0;
  for (int64_t it = 0; it < n_items; ++it) {
    Item& item = items[static_cast<size_t>(it)];
    const DecodeRow& row = rows[static_cast<size_t>(it / s.num_kv_heads)];
    item.exact = exact_order && item.same && exact_view(view_of(row, static_cast<int32_t>(it % s.num_kv_heads) * group));
    if (item.exact) {
      item.parts = head_chunks;
      for (int32_t p = 0; p < item.parts; ++p) units.emplace_back(it, p);
      continue;
    }
    item.parts = attn::paged_decode_parts(item.work, pool.size());
    if (item.parts > 1) {
      item.at = partial_size;
      partial_size += static_cast<size_t>(item.parts) * static_cast<size_t>(group) * static_cast<size_t>(d + 2);
    }
    for (int32_t p = 0; p < item.parts; ++p) units.emplace_back(it, p);
  }
  std::vector<float> partial(partial_size);

  // Rows of zeros for a block below a window that is no longer kept (the prefill order walks whole 64-key blocks; the
  // keys below the window are hidden but read).
  const std::vector<float> zero_rows(static_cast<size_t>(B * d), 0.0f);
  parallel_ranges(pool, static_cast<int64_t>(units.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<attn::KeySpan> spans;
    std::vector<float> scratch;
    std::vector<const void*> k_blocks, v_blocks;
    for (int64_t u = first; u < last; ++u) {
      const int64_t it = units[static_cast<size_t>(u)].first;  // (not a structured binding: clang 14 refuses
      const int32_t part = units[static_cast<size_t>(u)].second;  // their use inside the lambdas below)
      const Item& item = items[static_cast<size_t>(it)];
      const int64_t row_index = it / s.num_kv_heads;
      const DecodeRow& row = rows[static_cast<size_t>(row_index)];
      const auto kvh = static_cast<int32_t>(it % s.num_kv_heads);
      const int32_t h0 = kvh * group;
      const std::vector<int32_t>& table = row.seq->table(layer, kvh);
      if (item.exact) {
        const int64_t len = row.seq->length();
        const DecodeView::Ranges r = view_of(row, h0).ranges(len);
        const int64_t n_blocks = (len - 1) / B + 1;
        k_blocks.assign(static_cast<size_t>(n_blocks), zero_rows.data());
        v_blocks.assign(static_cast<size_t>(n_blocks), zero_rows.data());
        for (int64_t b = r.b0 / attn::kPagedTileKeys * attn::kPagedTileKeys / B; b < n_blocks; ++b) {
          const int32_t blk = table[static_cast<size_t>(b)];
          check(blk >= 0 || (b + 1) * B <= r.b0, "paged decode attention: a visible key's block is not kept (retention bug)");
          if (blk < 0) continue;
          k_blocks[static_cast<size_t>(b)] = store.k_bytes(blk, 0);
          v_blocks[static_cast<size_t>(b)] = store.v_bytes(blk, 0);
        }
        scratch.resize(attn::paged_tile_scratch_floats(static_cast<int32_t>(d)));
        const int32_t per = (group + item.parts - 1) / item.parts, h = h0 + part * per;
        attn::PagedTileJob job;
        job.q = q + (row_index * num_q_heads + h) * d;
        job.out = out + (row_index * num_q_heads + h) * d;
        job.heads = std::min(per, h0 + group - h);
        job.head_dim = static_cast<int32_t>(d);
        job.elem = elem;
        job.scale = scale;
        job.pos = static_cast<int32_t>(len - 1);
        job.key_begin = static_cast<int32_t>(r.b0);
        job.window = r.b0 > 0 ? static_cast<int32_t>(len - r.b0) : 0;
        job.k_blocks = k_blocks.data();
        job.v_blocks = v_blocks.data();
        job.block_tokens = static_cast<int32_t>(B);
        if (job.heads > 0) attn::paged_decode_in_prefill_order(job, scratch.data());
        continue;
      }
      // Heads [h, h + nh) over this unit's part of the keys of ranges r, a span per block (cut where the part is).
      auto walk = [&](int32_t h, int32_t nh, const DecodeView::Ranges& r) {
        spans.clear();
        auto add = [&](int64_t j0, int64_t j1) {
          while (j0 < j1) {
            const int64_t end = std::min(j1, (j0 / B + 1) * B);
            const int32_t blk = table[static_cast<size_t>(j0 / B)];
            check(blk >= 0, "paged decode attention: a visible key's block is not kept (retention bug)");
            spans.push_back({store.k_bytes(blk, j0 % B), store.v_bytes(blk, j0 % B), end - j0});
            j0 = end;
          }
        };
        attn::PagedDecodeJob job;
        job.q = q + (row_index * num_q_heads + h) * d;
        job.heads = nh;
        job.head_dim = static_cast<int32_t>(d);
        job.elem = elem;
        job.scale = scale;
        if (item.parts == 1) {
          add(r.a0, r.a1);
          add(r.b0, r.b1);
          job.out = out + (row_index * num_q_heads + h) * d;
        } else {
          // Keys [c0, c1) of the two ranges one after the other, the cuts on multiples of 16 keys (the AVX-512
          // kernel's width); a part may be empty (its maximum -inf: the merge skips it).
          const int64_t n = r.count(), na = r.a1 - r.a0;
          auto cut = [&](int32_t p) { return p == item.parts ? n : n * p / item.parts / 16 * 16; };
          const int64_t c0 = cut(part), c1 = cut(part + 1);
          add(r.a0 + std::min(c0, na), r.a0 + std::min(c1, na));
          add(r.b0 + std::max(c0, na) - na, r.b0 + std::max(c1, na) - na);
          const size_t slot = static_cast<size_t>(part) * static_cast<size_t>(group) + static_cast<size_t>(h - h0);
          const size_t stats = item.at + static_cast<size_t>(item.parts) * static_cast<size_t>(group * d);
          job.out = partial.data() + item.at + slot * static_cast<size_t>(d);
          job.part_max = partial.data() + stats + slot;
          job.part_sum = job.part_max + static_cast<size_t>(item.parts) * static_cast<size_t>(group);
        }
        job.spans = spans;
        attn::paged_decode(job, isa);
      };
      if (item.same) {
        walk(h0, group, view_of(row, h0).ranges(row.seq->length()));
      } else {
        for (int32_t g = 0; g < group; ++g) walk(h0 + g, 1, view_of(row, h0 + g).ranges(row.seq->length()));
      }
    }
  });
  for (int64_t it = 0; it < n_items; ++it) {
    const Item& item = items[static_cast<size_t>(it)];
    if (item.parts == 1 || item.exact) continue;
    const float* outs = partial.data() + item.at;
    const float* maxes = outs + static_cast<size_t>(item.parts) * static_cast<size_t>(group * d);
    const int64_t row_index = it / s.num_kv_heads, h0 = (it % s.num_kv_heads) * group;
    attn::paged_decode_merge(outs, maxes, maxes + static_cast<size_t>(item.parts) * static_cast<size_t>(group),
                             item.parts, group, static_cast<int32_t>(d), out + (row_index * num_q_heads + h0) * d);
  }
}

namespace {

// The decode rows' new K/V go into their sequences' blocks, then each (row, query head) attends over the keys its
// view shows (paged_decode_attention_cpu).
class PagedDecodeAttention final : public CpuAttentionStep {
 public:
  PagedDecodeAttention(const ModelConfig& cfg, std::span<const DecodeRow> rows, PagedKVStore& store, ThreadPool& pool,
                       bool prefill_order)
      : cfg_(cfg), rows_(rows), store_(store), pool_(pool), prefill_order_(prefill_order) {}

  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    const int64_t D = cfg_.head_dim, KD = cfg_.num_kv_heads * D, B = store_.shape().block_tokens;
    for (size_t i = 0; i < rows_.size(); ++i) {  // the new rows into their blocks
      const SequenceBlocks& seq = *rows_[i].seq;
      const int64_t pos = seq.length() - 1;
      for (int32_t h = 0; h < cfg_.num_kv_heads; ++h) {
        const int32_t blk = seq.block(layer, h, pos);
        if (blk < 0) continue;  // a head that keeps nothing new (cannot happen: windows are >= 1)
        store_.write(blk, pos % B, 1, k + static_cast<int64_t>(i) * KD + h * D,
                     v + static_cast<int64_t>(i) * KD + h * D);
      }
    }
    paged_decode_attention_cpu(q, out, rows_, layer, cfg_.num_q_heads, store_, cfg_.attention_scale, pool_,
                               prefill_order_);
  }

 private:
  const ModelConfig& cfg_;
  std::span<const DecodeRow> rows_;
  PagedKVStore& store_;
  ThreadPool& pool_;
  bool prefill_order_;
};

// The CPU's streaming memory of a streamed row (what CpuBatchBackend::new_stream made).
StreamingKV& host_stream(const DecodeRow& row) {
  auto* kv = dynamic_cast<StreamingKV*>(row.stream);
  check(kv != nullptr, "batch decode: a streamed row whose memory is not the CPU's (StreamingKV)");
  return *kv;
}

// Streamed rows: each row's streaming memory rotates its q and k and attends (one token, a decode chunk).
class StreamRowsAttention final : public CpuAttentionStep {
 public:
  StreamRowsAttention(const CpuOps& ops, std::span<const DecodeRow> rows) : ops_(ops), rows_(rows) {}
  bool rotates(int32_t) const override { return true; }
  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    const ModelConfig& cfg = ops_.config();
    const int64_t QD = static_cast<int64_t>(cfg.num_q_heads) * cfg.head_dim;
    const int64_t KD = static_cast<int64_t>(cfg.num_kv_heads) * cfg.head_dim;
    for (size_t i = 0; i < rows_.size(); ++i) {
      StreamingKV& kv = host_stream(rows_[i]);
      const auto r = static_cast<int64_t>(i);
      kv.attend(layer, kv.length(), 1, q + r * QD, k + r * KD, v + r * KD, ops_.inv_freq(layer), cfg.attention_scale,
                out + r * QD, ops_.pool());
    }
  }

 private:
  const CpuOps& ops_;
  std::span<const DecodeRow> rows_;
};

// The mixed step's attention: rows [0, n) are a prefill chunk of the staged sequence at [pos, pos + n) (attended as
// runtime::Forward's contiguous step does: K/V into the cache, the executor under the policy, the layer's sliding
// window), rows [n, n + B) paged decode rows (PagedDecodeAttention over the tail of q, k, v and out).
class MixedAttention final : public CpuAttentionStep {
 public:
  MixedAttention(const ModelConfig& cfg, const StagedChunk& chunk, PagedDecodeAttention& decode, ThreadPool& pool)
      : cfg_(cfg), chunk_(chunk), decode_(decode), pool_(pool) {}

  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    const int32_t n = chunk_.n;
    chunk_.cache.write(layer, chunk_.pos, n, k, v);
    attend_staged_chunk(cfg_, chunk_, layer, q, out, pool_);
    const int64_t QD = static_cast<int64_t>(cfg_.num_q_heads) * cfg_.head_dim,
                  KD = static_cast<int64_t>(cfg_.num_kv_heads) * cfg_.head_dim;
    decode_.attend(layer, q + n * QD, k + n * KD, v + n * KD, out + n * QD);
  }

 private:
  const ModelConfig& cfg_;
  StagedChunk chunk_;
  PagedDecodeAttention& decode_;
  ThreadPool& pool_;
};

}  // namespace

std::vector<float> BatchForward::mixed(std::span<const int32_t> chunk, int32_t pos, KVCache& cache,
                                       const attn::AttentionPolicy* policy, int32_t total_len,
                                       const AttentionObserver* observer, bool chunk_logits,
                                       std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                       PagedKVStore& store, ForwardTimers& timers) {
  check(rows.size() == tokens.size(), "mixed step: one decode row per token");
  check(!chunk.empty() && !rows.empty(), "mixed step: needs a prefill chunk and decode rows");
  const ModelConfig& cfg = ops_.config();
  const auto n = static_cast<int32_t>(chunk.size());
  check(pos >= 0 && cache.capacity() >= pos + n, "mixed step: the staging cache has no room for the chunk");
  for (const int32_t tok : tokens)
    check(tok >= 0 && tok < cfg.vocab_size, "batch decode: token id " + std::to_string(tok) + " outside the vocabulary");
  all_tokens_.assign(chunk.begin(), chunk.end());
  all_tokens_.insert(all_tokens_.end(), tokens.begin(), tokens.end());
  positions_.resize(all_tokens_.size());
  for (int32_t i = 0; i < n; ++i) positions_[static_cast<size_t>(i)] = pos + i;
  for (size_t i = 0; i < rows.size(); ++i) {
    check(rows[i].stream == nullptr && rows[i].seq != nullptr, "mixed step: decode rows must be paged");
    positions_[static_cast<size_t>(n) + i] = static_cast<int32_t>(rows[i].seq->length() - 1);
  }
  PagedDecodeAttention paged(cfg, rows, store, ops_.pool(), decode_in_prefill_order(prefill_order_));
  MixedAttention step(cfg, StagedChunk{cache, pos, n, policy, total_len, observer}, paged, ops_.pool());
  ops_.begin(all_tokens_, 0, positions_, step, timers);
  run_layers(cfg, ops_);
  return ops_.head(chunk_logits ? n - 1 : n);
}

std::vector<float> BatchForward::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                        PagedKVStore& store, ForwardTimers& timers) {
  check(rows.size() == tokens.size(), "batch decode: one row per token");
  if (tokens.empty()) return {};
  const ModelConfig& cfg = ops_.config();
  for (const int32_t tok : tokens)
    check(tok >= 0 && tok < cfg.vocab_size, "batch decode: token id " + std::to_string(tok) + " outside the vocabulary");
  const bool streamed = rows.front().stream != nullptr;
  positions_.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    check((rows[i].stream != nullptr) == streamed, "batch decode: a batch mixes streamed and paged rows");
    if (streamed) {
      StreamingKV& kv = host_stream(rows[i]);
      positions_[i] = kv.length();
      kv.begin_chunk(positions_[i], 1, StreamingKV::ChunkKind::Decode);
    } else {
      positions_[i] = static_cast<int32_t>(rows[i].seq->length() - 1);
    }
  }
  PagedDecodeAttention paged(cfg, rows, store, ops_.pool(), decode_in_prefill_order(prefill_order_));
  StreamRowsAttention stream(ops_, rows);
  ops_.begin(tokens, 0, positions_, streamed ? static_cast<CpuAttentionStep&>(stream) : paged, timers);
  run_layers(cfg, ops_);
  return ops_.head(0);
}

}  // namespace tessera::runtime
