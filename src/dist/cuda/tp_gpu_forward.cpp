#include "dist/cuda/tp_gpu_forward.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <variant>

#include "attention/cuda/layer_attention_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/rope.h"
#include "runtime_cuda/kernels.h"

namespace tessera::dist {

namespace gpu = runtime::gpu;

namespace {

template <class T>
void grow(attn::gpu::DeviceBuffer<T>& b, int64_t count) {
  if (static_cast<int64_t>(b.size()) < count) b.resize(static_cast<size_t>(count));
}

bool all_dense(const std::vector<attn::Pattern>& patterns) {
  return std::all_of(patterns.begin(), patterns.end(),
                     [](const attn::Pattern& p) { return std::holds_alternative<attn::DensePattern>(p); });
}

}  // namespace

// The executors of one run, one per distinct (patterns, window): static patterns build their index once.
struct TpGpuForward::AttentionSet {
  struct Entry {
    std::vector<attn::Pattern> patterns;
    int32_t window = 0;
    std::unique_ptr<attn::gpu::CudaLayerAttention> layer;
    bool index_built = false;
  };
  std::vector<std::unique_ptr<Entry>> entries;
  Entry& find(const std::vector<attn::Pattern>& patterns, int32_t window) {
    for (auto& e : entries)
      if (e->window == window && e->patterns == patterns) return *e;
    entries.push_back(std::make_unique<Entry>(Entry{patterns, window, nullptr, false}));
    return *entries.back();
  }
};

TpGpuForward::TpGpuForward(const TpDeviceModel& model, Collective& comm, const TpForwardOptions& options,
                           cudaStream_t stream, gpu::Gemm& gemm)
    : model_(model), cfg_(model.config()), comm_(comm), options_(options), stream_(stream), gemm_(gemm) {
  check(options_.mlp_chunk > 0, "tensor-parallel forward: mlp_chunk must be positive");
  scale_ =
      cfg_.attention_scale > 0 ? cfg_.attention_scale : 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  const runtime::LayerRopes ropes = runtime::layer_ropes(cfg_, model.rope_freq_factors());
  for (const std::vector<float>& f : ropes.inv_freqs) {
    inv_freqs_.emplace_back();
    inv_freqs_.back().upload(f);
  }
  layer_rope_ = ropes.layer;
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
  events_.resize(static_cast<size_t>(2 * cfg_.num_layers));
  for (cudaEvent_t& e : events_) TESSERA_CUDA_CHECK(cudaEventCreate(&e));
  layer_ms_.assign(static_cast<size_t>(cfg_.num_layers), 0.0f);
  if (options_.overlap_comm) TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
}

TpGpuForward::~TpGpuForward() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (cudaEvent_t e : written_) cudaEventDestroy(e);
  for (cudaEvent_t e : reduced_) cudaEventDestroy(e);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
}

void TpGpuForward::piece_events(size_t pieces) {
  while (written_.size() < pieces) {
    cudaEvent_t w, r;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&w, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&r, cudaEventDisableTiming));
    written_.push_back(w);
    reduced_.push_back(r);
  }
}

void TpGpuForward::reserve(int32_t tokens) {
  capacity_ = tokens;
  k_.clear();
  v_.clear();
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const size_t n =
        model_.layer(l).groups.size() * static_cast<size_t>(tokens) * static_cast<size_t>(cfg_.head_dim);
    k_.emplace_back(n);
    v_.emplace_back(n);
  }
}

size_t TpGpuForward::kv_bytes() const {
  size_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].bytes() + v_[l].bytes();
  return b;
}

void TpGpuForward::layer_attention(int32_t l, int32_t pos, int32_t n, const attn::AttentionPolicy* policy,
                                   int32_t total_len, AttentionSet& set) {
  const TpLayerWeights& L = model_.layer(l);
  const int32_t d = cfg_.head_dim, kv_len = pos + n;
  const int32_t model_window = cfg_.layers[static_cast<size_t>(l)].sliding_window;
  const int32_t window = model_window > 0 && model_window < kv_len ? model_window : 0;
  const int32_t tile = n <= 64 ? 64 : options_.tile;
  const bool executor = attn::gpu::sparse_prefill_supports(d, tile);
  const bool sparse = policy != nullptr && !policy->table().empty();
  const std::vector<int32_t>& heads = model_.plan().layers[static_cast<size_t>(l)].heads;
  for (size_t gi = 0; gi < L.groups.size(); ++gi) {
    const TpGroupWeights& g = L.groups[gi];
    const int64_t ld = static_cast<int64_t>(g.heads) * d;
    bf16* q = q_.data() + static_cast<int64_t>(n) * g.first_head * d;
    bf16* a = a_.data() + static_cast<int64_t>(n) * g.first_head * d;
    const bf16* kc = k_[static_cast<size_t>(l)].data() + static_cast<int64_t>(gi) * capacity_ * d;
    const bf16* vc = v_[static_cast<size_t>(l)].data() + static_cast<int64_t>(gi) * capacity_ * d;
    std::vector<attn::Pattern> patterns;
    for (int32_t h = g.first_head; h < g.first_head + g.heads; ++h)
      patterns.push_back(sparse ? policy->at(l, heads[static_cast<size_t>(h)])
                                : attn::Pattern{attn::DensePattern{}});
    const std::string where =
        "layer " + std::to_string(l) + " attention (KV group " + std::to_string(g.group) + ")";
    if (!executor) {
      if (!all_dense(patterns))
        throw Error(where + ": the CUDA sparse executor does not support head_dim " + std::to_string(d) +
                    "; run sparse policies on a model with head_dim 64, 128 or 256");
      gpu::simple_attention(q, ld, kc, vc, d, a, ld, n, g.heads, 1, d, pos, window, scale_, stream_);
      continue;
    }
    attn::AttentionArgs args;
    args.q = TensorView(q, DType::BF16, {n, g.heads, d});
    args.k = TensorView(const_cast<bf16*>(kc), DType::BF16, {kv_len, 1, d});
    args.v = TensorView(const_cast<bf16*>(vc), DType::BF16, {kv_len, 1, d});
    args.out = TensorView(a, DType::BF16, {n, g.heads, d});
    args.scale = scale_;
    args.q_begin = pos;
    args.window = window;
    try {
      AttentionSet::Entry& e = set.find(patterns, window);
      if (!e.layer) {
        const attn::LoweringContext ctx{pos, n, kv_len, std::max(total_len, kv_len), tile};
        attn::gpu::CudaAttentionOptions opt = options_.cuda_attention;
        opt.dense_fallback = opt.dense_fallback && options_.dense_fallback;
        e.layer = std::make_unique<attn::gpu::CudaLayerAttention>(patterns, ctx, 1, d, opt);
      }
      if (e.layer->has_dynamic_heads()) {
        // Dynamic heads estimate and index afresh on every call: nothing to keep, and keeping every group's
        // estimates and index (up to layers x groups of them, each sized for the prompt) would fill the GPU.
        e.layer->run(args, stream_);
        e.layer.reset();
      } else if (!e.index_built) {
        e.layer->run(args, stream_);
        e.index_built = true;
      } else {
        e.layer->attend(args, stream_);
      }
    } catch (const Error& err) {
      throw Error(where + ": " + err.what());
    }
  }
}

std::vector<float> TpGpuForward::run(std::span<const int32_t> tokens, int32_t pos,
                                     const attn::AttentionPolicy* policy, int32_t total_len, bool last_only) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(pos + n <= capacity_, "tensor-parallel forward: the KV cache has room for " +
                                  std::to_string(capacity_) + " tokens, the chunk ends at " +
                                  std::to_string(pos + n) + " (reserve more)");
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, V = cfg_.vocab_size;
  const int64_t M = std::min<int64_t>(options_.mlp_chunk, n);
  const float eps = cfg_.rms_norm_eps;
  const bool root = comm_.rank() == 0;
  const gpu::GateActivation act = cfg_.activation == runtime::Activation::SiLU ? gpu::GateActivation::kSiLU
                                  : cfg_.activation == runtime::Activation::GeluTanh
                                      ? gpu::GateActivation::kGeluTanh
                                      : gpu::GateActivation::kGelu;
  int64_t max_heads = 0, max_ffn = 0;
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    max_heads = std::max<int64_t>(max_heads, model_.layer(l).heads);
    max_ffn = std::max<int64_t>(max_ffn, model_.layer(l).ffn);
  }
  grow(tokens_, n);
  grow(x_, n * H);
  grow(h_, n * H);
  grow(q_, std::max<int64_t>(1, n * max_heads * D));
  grow(a_, std::max<int64_t>(1, n * max_heads * D));
  grow(gu_, std::max<int64_t>(1, M * 2 * max_ffn));
  if (cfg_.post_norms) grow(o_, n * H);
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    grow(cos_[r], n * (D / 2));
    grow(sin_[r], n * (D / 2));
    gpu::rope_tables(inv_freqs_[r].data(), static_cast<int>(D / 2), pos, n, cos_[r].data(), sin_[r].data(),
                     stream_);
  }
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), tokens.data(), tokens.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_));
  gpu::embed_tokens(tokens_.data(), n, model_.embedding(), H, cfg_.embedding_scale, x_.data(), stream_);

  // Where a partial sum goes before the all-reduce: x itself (rank 0 adds to it, the others overwrite it), or
  // o for Gemma-3's post-norms (the norm applies to the reduced sum).
  auto partial_target = [&](int64_t row0) -> std::pair<float*, float> {
    if (cfg_.post_norms) return {o_.data() + row0 * H, 0.0f};
    return {x_.data() + row0 * H, root ? 1.0f : 0.0f};
  };

  // The all-reduce of rows [r0, r0 + mm) of `t` (partial sums written on the compute stream): on the comm
  // stream after the piece is written (overlap_comm), else in order on the compute stream.
  const bool overlap = comm_stream_ != nullptr;
  const int64_t pieces = (n + M - 1) / M;
  if (overlap) piece_events(static_cast<size_t>(pieces));
  auto reduce_piece = [&](int64_t c, float* t, int64_t mm) {
    if (!overlap) {
      comm_.all_reduce_sum(t, static_cast<size_t>(mm * H), stream_);
      return;
    }
    TESSERA_CUDA_CHECK(cudaEventRecord(written_[static_cast<size_t>(c)], stream_));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, written_[static_cast<size_t>(c)], 0));
    comm_.all_reduce_sum(t, static_cast<size_t>(mm * H), comm_stream_);
    TESSERA_CUDA_CHECK(cudaEventRecord(reduced_[static_cast<size_t>(c)], comm_stream_));
  };

  AttentionSet set;
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const TpLayerWeights& L = model_.layer(l);
    bf16* kl = k_[static_cast<size_t>(l)].data();
    bf16* vl = v_[static_cast<size_t>(l)].data();
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    gpu::rms_norm_to_bf16(x_.data(), n, H, L.attn_norm, eps, h_.data(), H, stream_);
    for (size_t gi = 0; gi < L.groups.size(); ++gi) {
      const TpGroupWeights& g = L.groups[gi];
      const int64_t QD = static_cast<int64_t>(g.heads) * D;
      bf16* q = q_.data() + static_cast<int64_t>(n) * g.first_head * D;
      bf16* kc = kl + (static_cast<int64_t>(gi) * capacity_ + pos) * D;
      bf16* vc = vl + (static_cast<int64_t>(gi) * capacity_ + pos) * D;
      gemm_.linear(h_.data(), H, n, g.wq, QD, H, q, DType::BF16, QD, 0.0f);
      gemm_.linear(h_.data(), H, n, g.wk, D, H, kc, DType::BF16, D, 0.0f);
      gemm_.linear(h_.data(), H, n, g.wv, D, H, vc, DType::BF16, D, 0.0f);
      if (cfg_.qkv_bias) {
        gpu::add_bias(q, n, QD, QD, g.bq, stream_);
        gpu::add_bias(kc, n, D, D, g.bk, stream_);
        gpu::add_bias(vc, n, D, D, g.bv, stream_);
      }
      gpu::qk_norm_rope(q, n, QD, g.heads, static_cast<int>(D), cfg_.qk_norm ? L.q_norm : nullptr, eps,
                        cos_[r].data(), sin_[r].data(), stream_);
      gpu::qk_norm_rope(kc, n, D, 1, static_cast<int>(D), cfg_.qk_norm ? L.k_norm : nullptr, eps,
                        cos_[r].data(), sin_[r].data(), stream_);
    }
    if (options_.time_layers)
      TESSERA_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(2 * l)], stream_));
    layer_attention(l, pos, n, policy, total_len, set);
    if (options_.time_layers)
      TESSERA_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(2 * l + 1)], stream_));

    // o_proj per row piece, each piece all-reduced on the comm stream as soon as it is written; then the MLP
    // per piece, once its rows are reduced, its own all-reduce again on the comm stream (header: overlap_comm).
    for (int64_t c = 0; c < pieces; ++c) {
      const int64_t r0 = c * M, mm = std::min<int64_t>(M, n - r0);
      auto [t, beta] = partial_target(r0);
      if (L.groups.empty() && beta == 0.0f)
        TESSERA_CUDA_CHECK(cudaMemsetAsync(t, 0, static_cast<size_t>(mm * H) * sizeof(float), stream_));
      for (size_t gi = 0; gi < L.groups.size(); ++gi) {
        const TpGroupWeights& g = L.groups[gi];
        const int64_t QD = static_cast<int64_t>(g.heads) * D;
        const bf16* a = a_.data() + static_cast<int64_t>(n) * g.first_head * D + r0 * QD;
        gemm_.linear(a, QD, mm, g.wo, H, QD, t, DType::F32, H, gi == 0 ? beta : 1.0f);
      }
      reduce_piece(c, t, mm);
    }
    for (int64_t c = 0; c < pieces; ++c) {
      const int64_t r0 = c * M, mm = std::min<int64_t>(M, n - r0);
      if (overlap) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream_, reduced_[static_cast<size_t>(c)], 0));
      if (cfg_.post_norms)
        gpu::add_rms_normed(x_.data() + r0 * H, o_.data() + r0 * H, mm, H, L.post_attn_norm, eps, stream_);
      gpu::rms_norm_to_bf16(x_.data() + r0 * H, mm, H, L.ffn_norm, eps, h_.data() + r0 * H, H, stream_);
      const int64_t F = L.ffn;
      auto [t, b] = partial_target(r0);
      if (F == 0) {
        if (b == 0.0f)
          TESSERA_CUDA_CHECK(cudaMemsetAsync(t, 0, static_cast<size_t>(mm * H) * sizeof(float), stream_));
      } else {
        gemm_.linear(h_.data() + r0 * H, H, mm, L.w_gate_up, 2 * F, H, gu_.data(), DType::BF16, 2 * F, 0.0f);
        gpu::gated_activation(gu_.data(), mm, F, act, stream_);
        gemm_.linear(gu_.data(), 2 * F, mm, L.w_down, H, F, t, DType::F32, H, b);
      }
      reduce_piece(c, t, mm);
    }
    // The comm stream runs in order: the last piece reduced means every piece is.
    if (overlap) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream_, reduced_[static_cast<size_t>(pieces - 1)], 0));
    if (cfg_.post_norms) gpu::add_rms_normed(x_.data(), o_.data(), n, H, L.post_ffn_norm, eps, stream_);
  }

  const int32_t first = last_only ? n - 1 : 0;
  const int64_t count = n - first;
  grow(logits_, count * V);
  gpu::rms_norm_to_bf16(x_.data() + static_cast<int64_t>(first) * H, count, H, model_.final_norm(), eps,
                        h_.data(), H, stream_);
  gemm_.linear(h_.data(), H, count, model_.output(), V, H, logits_.data(), DType::F32, V, 0.0f);
  if (cfg_.final_logit_softcap > 0)
    gpu::softcap(logits_.data(), count * V, cfg_.final_logit_softcap, stream_);
  std::vector<float> out(static_cast<size_t>(count * V));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_.data(), out.size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (options_.time_layers)
    for (int32_t l = 0; l < cfg_.num_layers; ++l)
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&layer_ms_[static_cast<size_t>(l)],
                                              events_[static_cast<size_t>(2 * l)],
                                              events_[static_cast<size_t>(2 * l + 1)]));
  return out;
}

}  // namespace tessera::dist
