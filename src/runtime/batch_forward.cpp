#include "runtime/batch_forward.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <new>

#include "core/error.h"
#include "core/memory_budget.h"
#include "runtime/ops.h"
#include "runtime/rope.h"

namespace tessera::runtime {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

}  // namespace

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

void scatter_to_pages(KVCache& cache, const SequenceBlocks& seq, PagedKVStore& store) {
  const PagedKVShape& s = seq.shape();
  const int64_t len = seq.length();
  const int64_t B = s.block_tokens, d = s.head_dim;
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const float* kc = cache.k(l, 0);
    const float* vc = cache.v(l, 0);
    for (int32_t h = 0; h < s.num_kv_heads; ++h) {
      const std::vector<int32_t>& t = seq.table(l, h);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int32_t blk = t[static_cast<size_t>(pos / B)];
        if (blk < 0) continue;
        const size_t src = (static_cast<size_t>(pos) * static_cast<size_t>(s.num_kv_heads) + static_cast<size_t>(h)) *
                           static_cast<size_t>(d);
        std::copy(kc + src, kc + src + d, store.k(blk, pos % B));
        std::copy(vc + src, vc + src + d, store.v(blk, pos % B));
      }
    }
  }
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

BatchForward::BatchForward(const Model& model, ThreadPool& pool) : model_(model), cfg_(model.config()), pool_(pool) {
  LayerRopes ropes = layer_ropes(cfg_, model.weights().rope_freq_factors);
  inv_freqs_ = std::move(ropes.inv_freqs);
  layer_rope_ = std::move(ropes.layer);
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
}

std::vector<float> BatchForward::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                        PagedKVStore& store, ForwardTimers& timers) {
  const auto n = static_cast<int64_t>(tokens.size());
  check(rows.size() == tokens.size(), "batch decode: one row per token");
  if (n == 0) return {};
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, F = cfg_.intermediate_size;
  const int64_t QD = cfg_.num_q_heads * D, KD = cfg_.num_kv_heads * D;
  const int64_t B = store.shape().block_tokens;
  const ModelWeights& w = model_.weights();
  grow(x_, n * H);
  grow(h_, n * H);
  grow(q_, n * QD);
  grow(k_, n * KD);
  grow(v_, n * KD);
  grow(attn_, n * QD);
  grow(gate_, n * F);
  grow(up_, n * F);
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    grow(cos_[r], n * (D / 2));
    grow(sin_[r], n * (D / 2));
    for (int64_t i = 0; i < n; ++i)
      rope_tables(inv_freqs_[r], rows[static_cast<size_t>(i)].seq->length() - 1, 1, cos_[r].data() + i * (D / 2),
                  sin_[r].data() + i * (D / 2));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t tok = tokens[static_cast<size_t>(i)];
    check(tok >= 0 && tok < cfg_.vocab_size, "batch decode: token id " + std::to_string(tok) + " outside the vocabulary");
    const float* e = w.embedding.ptr() + static_cast<int64_t>(tok) * H;
    float* x = x_.data() + i * H;
    for (int64_t c = 0; c < H; ++c) x[c] = e[c] * cfg_.embedding_scale;
  }
  auto gemm = [&](const float* in, const Weight& wt, const Weight* bias, float* out) {
    const auto t0 = Clock::now();
    linear(in, n, wt, bias, out);
    timers.gemm_seconds += since(t0);
  };
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    rms_norm(x_.data(), h_.data(), n, H, L.attn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    gemm(h_.data(), L.wq, cfg_.qkv_bias ? &L.bq : nullptr, q_.data());
    gemm(h_.data(), L.wk, cfg_.qkv_bias ? &L.bk : nullptr, k_.data());
    gemm(h_.data(), L.wv, cfg_.qkv_bias ? &L.bv : nullptr, v_.data());
    if (cfg_.qk_norm) {
      rms_norm(q_.data(), q_.data(), n * cfg_.num_q_heads, D, L.q_norm.ptr(), cfg_.rms_norm_eps, pool_);
      rms_norm(k_.data(), k_.data(), n * cfg_.num_kv_heads, D, L.k_norm.ptr(), cfg_.rms_norm_eps, pool_);
    }
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    apply_rope(q_.data(), n, QD, cfg_.num_q_heads, D, cos_[r].data(), sin_[r].data());
    apply_rope(k_.data(), n, KD, cfg_.num_kv_heads, D, cos_[r].data(), sin_[r].data());
    for (int64_t i = 0; i < n; ++i) {  // the new rows into their blocks
      const SequenceBlocks& seq = *rows[static_cast<size_t>(i)].seq;
      const int64_t pos = seq.length() - 1;
      for (int32_t h = 0; h < cfg_.num_kv_heads; ++h) {
        const int32_t blk = seq.block(l, h, pos);
        if (blk < 0) continue;  // a head that keeps nothing new (cannot happen: windows are >= 1)
        const float* ks = k_.data() + i * KD + h * D;
        const float* vs = v_.data() + i * KD + h * D;
        std::copy(ks, ks + D, store.k(blk, pos % B));
        std::copy(vs, vs + D, store.v(blk, pos % B));
      }
    }
    const auto t0 = Clock::now();
    paged_decode_attention_cpu(q_.data(), attn_.data(), rows, l, cfg_.num_q_heads, store,
                               cfg_.attention_scale > 0 ? cfg_.attention_scale : 1.0f / std::sqrt(static_cast<float>(D)),
                               pool_);
    timers.attention_seconds += since(t0);
    gemm(attn_.data(), L.wo, nullptr, h_.data());
    if (cfg_.post_norms) rms_norm(h_.data(), h_.data(), n, H, L.post_attn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += h_[static_cast<size_t>(i)];
    rms_norm(x_.data(), h_.data(), n, H, L.ffn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    gemm(h_.data(), L.w_gate, nullptr, gate_.data());
    gemm(h_.data(), L.w_up, nullptr, up_.data());
    gated_activation(gate_.data(), up_.data(), n * F, cfg_.activation, pool_);
    gemm(gate_.data(), L.w_down, nullptr, h_.data());
    if (cfg_.post_norms) rms_norm(h_.data(), h_.data(), n, H, L.post_ffn_norm.ptr(), cfg_.rms_norm_eps, pool_);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += h_[static_cast<size_t>(i)];
  }
  rms_norm(x_.data(), h_.data(), n, H, w.final_norm.ptr(), cfg_.rms_norm_eps, pool_);
  std::vector<float> logits(static_cast<size_t>(n) * static_cast<size_t>(cfg_.vocab_size));
  const auto t0 = Clock::now();
  linear(h_.data(), n, w.output(), nullptr, logits.data());
  timers.gemm_seconds += since(t0);
  if (cfg_.final_logit_softcap > 0) softcap(logits.data(), static_cast<int64_t>(logits.size()), cfg_.final_logit_softcap);
  return logits;
}

}  // namespace tessera::runtime
