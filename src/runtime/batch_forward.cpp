#include "runtime/batch_forward.h"

#include <algorithm>
#include <cmath>
#include <new>

#include "core/error.h"
#include "core/memory_budget.h"
#include "runtime/ops.h"
#include "runtime/recipe.h"

namespace tessera::runtime {

PagedKVStore::PagedKVStore(const PagedKVShape& shape, int32_t num_blocks) : shape_(shape), num_blocks_(num_blocks) {
  check(num_blocks >= 0, "paged KV store: negative block count");
  const double bytes = bytes_per_block(shape) * num_blocks;
  const std::string what = "paged KV cache of " + std::to_string(num_blocks) + " blocks of " +
                           std::to_string(shape.block_tokens) + " tokens (K and V in f32)";
  check_host_allocation(what, bytes, "lower the KV budget");
  const size_t n = static_cast<size_t>(num_blocks) * static_cast<size_t>(shape.elements_per_block());
  try {
    k_ = std::make_unique_for_overwrite<float[]>(n);
    v_ = std::make_unique_for_overwrite<float[]>(n);
    elements_ = n;
  } catch (const std::bad_alloc&) {
    throw Error(what + ": out of host memory allocating " + format_bytes(bytes) + "; lower the KV budget");
  }
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

void scatter_to_pages(KVCache& cache, const SequenceBlocks& seq, PagedKVStore& store) {
  const int64_t d = seq.shape().head_dim;
  for_each_paged_row(seq, seq.length(), [&](int32_t l, size_t row, int32_t blk, int64_t r) {
    std::copy_n(cache.k(l, 0) + row, d, store.k(blk, r));
    std::copy_n(cache.v(l, 0) + row, d, store.v(blk, r));
  });
}

void gather_from_pages(const PagedKVStore& store, const SequenceBlocks& seq, int64_t rows, KVCache& cache) {
  check(rows <= seq.length() && rows <= cache.capacity(), "paged KV: gathering rows the sequence or cache lacks");
  const int64_t d = seq.shape().head_dim;
  for_each_paged_row(seq, rows, [&](int32_t l, size_t row, int32_t blk, int64_t r) {
    std::copy_n(store.k(blk, r), d, cache.k(l, 0) + row);
    std::copy_n(store.v(blk, r), d, cache.v(l, 0) + row);
  });
}

void paged_decode_attention_cpu(const float* q, float* out, std::span<const DecodeRow> rows, int32_t layer,
                                int32_t num_q_heads, const PagedKVStore& store, float scale, ThreadPool& pool) {
  const PagedKVShape& s = store.shape();
  const int64_t B = s.block_tokens, d = s.head_dim;
  const int32_t group = num_q_heads / s.num_kv_heads;
  const int64_t items = static_cast<int64_t>(rows.size()) * num_q_heads;
  parallel_ranges(pool, items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t it = first; it < last; ++it) {
      const DecodeRow& row = rows[static_cast<size_t>(it / num_q_heads)];
      const auto h = static_cast<int32_t>(it % num_q_heads);
      const std::vector<int32_t>& table = row.seq->table(layer, h / group);
      const DecodeView& view = row.views[static_cast<size_t>(layer) * static_cast<size_t>(num_q_heads) +
                                         static_cast<size_t>(h)];
      const DecodeView::Ranges r = view.ranges(row.seq->length());
      const float* qh = q + it * d;
      float* o = out + it * d;
      std::fill(acc.begin(), acc.end(), 0.0f);
      float m = -INFINITY, sum = 0;
      auto visit = [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) {
          const int32_t blk = table[static_cast<size_t>(j / B)];
          check(blk >= 0, "paged decode attention: a visible key's block is not kept (retention bug)");
          const float* kr = store.k(blk, j % B);
          float dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += qh[c] * kr[c];
          const float sc = dot * scale;
          const float m_new = std::max(m, sc);
          const float corr = std::exp(m - m_new), p = std::exp(sc - m_new);
          const float* vr = store.v(blk, j % B);
          for (int64_t c = 0; c < d; ++c) acc[static_cast<size_t>(c)] = acc[static_cast<size_t>(c)] * corr + p * vr[c];
          sum = sum * corr + p;
          m = m_new;
        }
      };
      visit(r.a0, r.a1);
      visit(r.b0, r.b1);
      const float inv = sum > 0 ? 1.0f / sum : 0.0f;
      for (int64_t c = 0; c < d; ++c) o[c] = acc[static_cast<size_t>(c)] * inv;
    }
  });
}

namespace {

// The decode rows' new K/V go into their sequences' blocks, then each (row, query head) attends over the keys its
// view shows (paged_decode_attention_cpu).
class PagedDecodeAttention final : public CpuAttentionStep {
 public:
  PagedDecodeAttention(const ModelConfig& cfg, std::span<const DecodeRow> rows, PagedKVStore& store, ThreadPool& pool)
      : cfg_(cfg), rows_(rows), store_(store), pool_(pool) {}

  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    const int64_t D = cfg_.head_dim, KD = cfg_.num_kv_heads * D, B = store_.shape().block_tokens;
    for (size_t i = 0; i < rows_.size(); ++i) {  // the new rows into their blocks
      const SequenceBlocks& seq = *rows_[i].seq;
      const int64_t pos = seq.length() - 1;
      for (int32_t h = 0; h < cfg_.num_kv_heads; ++h) {
        const int32_t blk = seq.block(layer, h, pos);
        if (blk < 0) continue;  // a head that keeps nothing new (cannot happen: windows are >= 1)
        const float* ks = k + static_cast<int64_t>(i) * KD + h * D;
        const float* vs = v + static_cast<int64_t>(i) * KD + h * D;
        std::copy(ks, ks + D, store_.k(blk, pos % B));
        std::copy(vs, vs + D, store_.v(blk, pos % B));
      }
    }
    paged_decode_attention_cpu(q, out, rows_, layer, cfg_.num_q_heads, store_,
                               cfg_.attention_scale > 0 ? cfg_.attention_scale
                                                        : 1.0f / std::sqrt(static_cast<float>(D)),
                               pool_);
  }

 private:
  const ModelConfig& cfg_;
  std::span<const DecodeRow> rows_;
  PagedKVStore& store_;
  ThreadPool& pool_;
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

}  // namespace

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
  PagedDecodeAttention paged(cfg, rows, store, ops_.pool());
  StreamRowsAttention stream(ops_, rows);
  ops_.begin(tokens, 0, positions_, streamed ? static_cast<CpuAttentionStep&>(stream) : paged, timers);
  run_layers(cfg, ops_);
  return ops_.head(0);
}

}  // namespace tessera::runtime
