#include "runtime/batch_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

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

void paged_decode_attention_cpu(const float* q, float* out, std::span<const DecodeRow> rows, int32_t layer,
                                int32_t num_q_heads, const PagedKVStore& store, float scale, ThreadPool& pool) {
  const PagedKVShape& s = store.shape();
  const int64_t B = s.block_tokens, d = s.head_dim;
  const int32_t group = num_q_heads / s.num_kv_heads;
  // One item per (row, kv head): the query heads of its GQA group that see the same keys go through each block
  // together (the block read, and converted from a half store, once for all of them).
  const int64_t items = static_cast<int64_t>(rows.size()) * s.num_kv_heads;
  const bool f32 = store.type() == KVType::F32;
  parallel_ranges(pool, items, 1, [&](int64_t first, int64_t last) {
    const auto G = static_cast<size_t>(group);
    std::vector<float> acc(G * static_cast<size_t>(d)), score(static_cast<size_t>(B)), m(G), sum(G);
    std::vector<float> kbuf(f32 ? 0 : static_cast<size_t>(B * d)), vbuf(kbuf.size());
    std::vector<int32_t> heads(G);
    for (int64_t it = first; it < last; ++it) {
      const DecodeRow& row = rows[static_cast<size_t>(it / s.num_kv_heads)];
      const auto kvh = static_cast<int32_t>(it % s.num_kv_heads);
      const std::vector<int32_t>& table = row.seq->table(layer, kvh);
      const int64_t row_index = it / s.num_kv_heads;
      auto view_of = [&](int32_t h) -> const DecodeView& {
        return row.views[static_cast<size_t>(layer) * static_cast<size_t>(num_q_heads) + static_cast<size_t>(h)];
      };
      // heads[0..nh): query heads walked together over ranges r.
      auto walk = [&](int nh, const DecodeView::Ranges& r) {
        std::fill(acc.begin(), acc.begin() + static_cast<int64_t>(nh) * d, 0.0f);
        std::fill(m.begin(), m.begin() + nh, -INFINITY);
        std::fill(sum.begin(), sum.begin() + nh, 0.0f);
        // Keys [j0, j1) within one block: per head, their scores, one rescale for the block, then the values.
        auto visit_block = [&](int64_t j0, int64_t j1) {
          const int32_t blk = table[static_cast<size_t>(j0 / B)];
          check(blk >= 0, "paged decode attention: a visible key's block is not kept (retention bug)");
          const int64_t n = j1 - j0;
          const float* kr;
          const float* vr;
          if (f32) {
            kr = store.k(blk, j0 % B);
            vr = store.v(blk, j0 % B);
          } else {
            store.read(blk, j0 % B, n, kbuf.data(), vbuf.data());
            kr = kbuf.data();
            vr = vbuf.data();
          }
          const int64_t d8 = d / 8 * 8;
          for (int g = 0; g < nh; ++g) {
            const float* qh = q + (row_index * num_q_heads + heads[static_cast<size_t>(g)]) * d;
            float* ag = acc.data() + static_cast<int64_t>(g) * d;
            float m_blk = -INFINITY;
            for (int64_t j = 0; j < n; ++j) {
              const float* kj = kr + j * d;
              // Eight partial sums (one vector of lanes: the compiler may not reorder a single float sum).
              float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
              for (int64_t c = 0; c < d8; c += 8)
                for (int u = 0; u < 8; ++u) part[u] += qh[c + u] * kj[c + u];
              float dot = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
              for (int64_t c = d8; c < d; ++c) dot += qh[c] * kj[c];
              score[static_cast<size_t>(j)] = dot * scale;
              m_blk = std::max(m_blk, score[static_cast<size_t>(j)]);
            }
            const float m_new = std::max(m[static_cast<size_t>(g)], m_blk);
            const float corr = std::exp(m[static_cast<size_t>(g)] - m_new);
            if (corr != 1.0f) {
              for (int64_t c = 0; c < d; ++c) ag[c] *= corr;
              sum[static_cast<size_t>(g)] *= corr;
            }
            m[static_cast<size_t>(g)] = m_new;
            float total = 0;
            for (int64_t j = 0; j < n; ++j) {
              const float p = std::exp(score[static_cast<size_t>(j)] - m_new);
              const float* vj = vr + j * d;
              for (int64_t c = 0; c < d; ++c) ag[c] += p * vj[c];
              total += p;
            }
            sum[static_cast<size_t>(g)] += total;
          }
        };
        auto visit = [&](int64_t j0, int64_t j1) {
          while (j0 < j1) {
            const int64_t end = std::min(j1, (j0 / B + 1) * B);
            visit_block(j0, end);
            j0 = end;
          }
        };
        visit(r.a0, r.a1);
        visit(r.b0, r.b1);
        for (int g = 0; g < nh; ++g) {
          float* o = out + (row_index * num_q_heads + heads[static_cast<size_t>(g)]) * d;
          const float inv = sum[static_cast<size_t>(g)] > 0 ? 1.0f / sum[static_cast<size_t>(g)] : 0.0f;
          for (int64_t c = 0; c < d; ++c) o[c] = acc[static_cast<size_t>(g * d + c)] * inv;
        }
      };
      const int32_t h0 = kvh * group;
      bool same = true;
      for (int32_t g = 1; g < group && same; ++g) same = view_of(h0 + g) == view_of(h0);
      if (same) {
        for (int32_t g = 0; g < group; ++g) heads[static_cast<size_t>(g)] = h0 + g;
        walk(group, view_of(h0).ranges(row.seq->length()));
      } else {  // heads of one group that see different keys (MoA's per-head windows): one at a time
        for (int32_t g = 0; g < group; ++g) {
          heads[0] = h0 + g;
          walk(1, view_of(h0 + g).ranges(row.seq->length()));
        }
      }
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
        store_.write(blk, pos % B, 1, k + static_cast<int64_t>(i) * KD + h * D,
                     v + static_cast<int64_t>(i) * KD + h * D);
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
