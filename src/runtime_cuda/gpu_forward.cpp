#include "runtime_cuda/gpu_forward.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <variant>

#include "cuda/cuda_check.h"
#include "attention/cuda/layer_attention_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "core/error.h"
#include "runtime/rope.h"
#include "runtime_cuda/kernels.h"

namespace tessera::runtime::gpu {

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::kAuto:
      return "auto";
    case AttentionBackend::kExecutor:
      return "executor";
    case AttentionBackend::kSimple:
      return "simple";
  }
  return "?";
}

AttentionBackend parse_attention_backend(const std::string& name) {
  if (name == "auto") return AttentionBackend::kAuto;
  if (name == "executor") return AttentionBackend::kExecutor;
  if (name == "simple") return AttentionBackend::kSimple;
  throw Error("unknown GPU attention backend '" + name + "' (auto, executor, simple)");
}

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

// The executors of one chunk, one per distinct (patterns, window) of its layers.
struct GpuForward::AttentionSet {
  struct Entry {
    std::vector<attn::Pattern> patterns;
    int32_t window = 0;
    std::unique_ptr<attn::gpu::CudaLayerAttention> layer;
    bool index_built = false;
  };
  std::vector<Entry> entries;

  Entry& find(const std::vector<attn::Pattern>& patterns, int32_t window) {
    for (Entry& e : entries)
      if (e.window == window && e.patterns == patterns) return e;
    entries.push_back(Entry{patterns, window, nullptr, false});
    return entries.back();
  }
};

GpuForward::GpuForward(const DeviceModel& model, const ForwardOptions& options, cudaStream_t stream, Gemm& gemm,
                       EventTimer& timer, const DeviceFp8Weights* fp8)
    : model_(model), cfg_(model.config()), options_(options), stream_(stream), gemm_(gemm), timer_(timer), fp8_(fp8) {
  check(options_.mlp_chunk > 0, "GPU forward: mlp_chunk must be positive");
  check(options_.tile == 64 || options_.tile == 128,
        "GPU forward: the index tile must be 64 or 128, got " + std::to_string(options_.tile));
  scale_ = cfg_.attention_scale > 0 ? cfg_.attention_scale : 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  const LayerRopes ropes = layer_ropes(cfg_, model.rope_freq_factors());
  for (const std::vector<float>& f : ropes.inv_freqs) {
    inv_freqs_.emplace_back();
    inv_freqs_.back().upload(f);
  }
  layer_rope_ = ropes.layer;
  host_inv_freqs_ = ropes.inv_freqs;
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads above ran on the legacy stream
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
}

size_t GpuForward::scratch_bytes() const {
  size_t b = tokens_.bytes() + x_.bytes() + o_.bytes() + logits_.bytes() + h_.bytes() + q_.bytes() + a_.bytes() +
             gu_.bytes() + k_chunk_.bytes() + v_chunk_.bytes() + no_freq_.bytes() + id_cos_.bytes() + id_sin_.bytes();
  for (const auto& c : cos_) b += c.bytes();
  for (const auto& s : sin_) b += s.bytes();
  return b;
}

void GpuForward::release_scratch() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  tokens_ = {};
  x_ = {};
  o_ = {};
  logits_ = {};
  h_ = {};
  q_ = {};
  a_ = {};
  gu_ = {};
  k_chunk_ = {};
  v_chunk_ = {};
  no_freq_ = {};
  id_cos_ = {};
  id_sin_ = {};
  for (auto& c : cos_) c = {};
  for (auto& s : sin_) s = {};
}

void GpuForward::sample_memory() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    peak_in_use_ = std::max(peak_in_use_, total_bytes - free_bytes);
  else
    (void)cudaGetLastError();
}

void GpuForward::attention(int32_t layer, int32_t pos, int32_t n, DeviceKVCache& cache,
                           const attn::AttentionPolicy* policy, int32_t total_len, AttentionSet& set) {
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim, kv_len = pos + n;
  const int64_t QD = static_cast<int64_t>(nq) * d;
  const std::vector<attn::Pattern> patterns = policy != nullptr && !policy->table().empty()
                                                  ? policy->layer(layer)
                                                  : std::vector<attn::Pattern>(static_cast<size_t>(nq),
                                                                               attn::DensePattern{});
  const int32_t model_window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  const int32_t window = model_window > 0 && model_window < kv_len ? model_window : 0;
  const int32_t tile = n <= 64 ? 64 : options_.tile;
  const bool dense = all_dense(patterns);
  const std::string where = "layer " + std::to_string(layer) + " attention";
  AttentionBackend backend = options_.attention;
  if (backend == AttentionBackend::kAuto) {
    backend = AttentionBackend::kExecutor;
    if (!attn::gpu::sparse_prefill_supports(d, tile)) {
      backend = AttentionBackend::kSimple;
      if (!dense)
        throw Error(where + ": the CUDA sparse executor does not support head_dim " + std::to_string(d) +
                    " (64, 128 or 256), so model " + cfg_.name +
                    " runs only dense attention on the GPU; run sparse policies with --device cpu");
    }  // (the executor applies sliding windows itself: args.window)
  }

  if (backend == AttentionBackend::kSimple) {
    if (!dense) {
      const auto sparse = std::find_if(patterns.begin(), patterns.end(), [](const attn::Pattern& p) {
        return !std::holds_alternative<attn::DensePattern>(p);
      });
      throw Error(where + ": the simple attention kernel runs dense attention only; this layer's policy has " +
                  attn::describe(*sparse) + " (the sparse executor runs sparse policies)");
    }
    simple_attention(q_.data(), QD, cache.k(layer, 0), cache.v(layer, 0), cache.row_elements(), a_.data(), QD, n,
                     nq, nkv, d, pos, window, scale_, stream_);
    return;
  }

  attn::AttentionArgs args;
  args.q = TensorView(q_.data(), DType::BF16, {n, nq, d});
  args.k = TensorView(cache.k(layer, 0), DType::BF16, {kv_len, nkv, d});
  args.v = TensorView(cache.v(layer, 0), DType::BF16, {kv_len, nkv, d});
  args.out = TensorView(a_.data(), DType::BF16, {n, nq, d});
  args.scale = scale_;
  args.q_begin = pos;
  args.window = window;
  try {
    AttentionSet::Entry& e = set.find(patterns, window);
    if (!e.layer) {
      const attn::LoweringContext ctx{pos, n, kv_len, std::max(total_len, kv_len), tile};
      // The engine's options of the backend, with its fallback switch.
      attn::gpu::CudaAttentionOptions opt = options_.cuda_attention;
      opt.dense_fallback = opt.dense_fallback && options_.dense_fallback;
      e.layer = std::make_unique<attn::gpu::CudaLayerAttention>(patterns, ctx, nkv, d, opt);
    }
    if (e.layer->has_dynamic_heads() || !e.index_built) {
      e.layer->run(args, stream_);  // estimate, index (unless cuDNN runs an all-dense layer), attend
      e.index_built = true;
    } else {
      e.layer->attend(args, stream_);  // static patterns: the index of the first layer serves every layer
    }
  } catch (const Error& err) {
    std::string msg = where;
    if (window > 0) msg += " (sliding window " + std::to_string(window) + ")";
    msg += ": ";
    msg += err.what();
    throw Error(msg);
  }
}

std::vector<float> GpuForward::run(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache& cache,
                                   const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows) {
  return run_layers(tokens, pos, &cache, nullptr, policy, total_len, rows);
}

std::vector<float> GpuForward::run(std::span<const int32_t> tokens, int32_t pos, GpuKVPolicy& kv, LogitRows rows) {
  return run_layers(tokens, pos, nullptr, &kv, nullptr, pos + static_cast<int32_t>(tokens.size()), rows);
}

std::vector<float> GpuForward::run_layers(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache* cache,
                                          GpuKVPolicy* kv, const attn::AttentionPolicy* policy, int32_t total_len,
                                          LogitRows rows) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(kv != nullptr || cache->capacity() >= pos + n, "GPU forward: the KV cache has no room for the chunk");
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, F = cfg_.intermediate_size, V = cfg_.vocab_size;
  const int64_t QD = cfg_.num_q_heads * D, KD = cfg_.num_kv_heads * D;
  const int64_t M = std::min<int64_t>(options_.mlp_chunk, n);
  const float eps = cfg_.rms_norm_eps;
  const GateActivation act = cfg_.activation == Activation::SiLU       ? GateActivation::kSiLU
                             : cfg_.activation == Activation::GeluTanh ? GateActivation::kGeluTanh
                                                                       : GateActivation::kGelu;

  grow(tokens_, n);
  grow(x_, n * H);
  grow(h_, n * H);
  grow(q_, n * QD);
  grow(a_, n * QD);
  grow(gu_, M * 2 * F);
  if (cfg_.post_norms) grow(o_, n * H);
  if (kv != nullptr) {
    grow(k_chunk_, n * KD);
    grow(v_chunk_, n * KD);
  }

  // The small kernels' GPU time by category (EventTimer pairs; no-ops when timing is off).
  auto timed = [&](EventTimer::Kind kind, auto&& launch) {
    timer_.begin(kind, stream_);
    launch();
    timer_.end(kind, stream_);
  };
  timed(EventTimer::kRope, [&] {
    for (size_t r = 0; r < inv_freqs_.size(); ++r) {
      grow(cos_[r], n * (D / 2));
      grow(sin_[r], n * (D / 2));
      rope_tables(inv_freqs_[r].data(), static_cast<int>(D / 2), pos, n, cos_[r].data(), sin_[r].data(), stream_);
    }
    if (kv != nullptr && cfg_.qk_norm) {
      // The identity rotation (angle 0: cos 1, sin 0 exactly) for QK-norm alone (qk_norm_rope below).
      grow(no_freq_, D / 2);
      grow(id_cos_, n * (D / 2));
      grow(id_sin_, n * (D / 2));
      TESSERA_CUDA_CHECK(cudaMemsetAsync(no_freq_.data(), 0, static_cast<size_t>(D / 2) * sizeof(float), stream_));
      rope_tables(no_freq_.data(), static_cast<int>(D / 2), 0, n, id_cos_.data(), id_sin_.data(), stream_);
    }
  });
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), tokens.data(), tokens.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_));
  timed(EventTimer::kMisc,
        [&] { embed_tokens(tokens_.data(), n, model_.embedding(), H, cfg_.embedding_scale, x_.data(), stream_); });

  // One product of the layers: bf16 (cuBLAS), or FP8 when fp8_ is set (w8: the same matrix in E4M3; the input is
  // quantized unless `reuse`: the previous product's input again, i.e. K and V after Q). The quantization counts as
  // GEMM time.
  Fp8Matrix x8;
  auto gemm = [&](const bf16* x, int64_t ldx, int64_t m, const bf16* w, const Fp8Matrix& w8, int64_t out, int64_t in,
                  void* y, DType y_type, int64_t ldy, float beta, bool reuse = false) {
    timer_.begin(EventTimer::kGemm, stream_);
    if (fp8_ != nullptr) {
      if (!reuse) x8 = gemm_.quantize_activation(x, ldx, m, in);
      gemm_.linear_fp8(x8, w8, y, y_type, ldy, beta);
    } else {
      gemm_.linear(x, ldx, m, w, out, in, y, y_type, ldy, beta);
    }
    timer_.end(EventTimer::kGemm, stream_);
  };

  AttentionSet set;
  const Fp8Layer no_fp8{};
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const DeviceLayer& L = model_.layer(l);
    const Fp8Layer& L8 = fp8_ != nullptr ? fp8_->layer(l) : no_fp8;
    bf16* kc = kv != nullptr ? k_chunk_.data() : cache->k(l, pos);
    bf16* vc = kv != nullptr ? v_chunk_.data() : cache->v(l, pos);
    timed(EventTimer::kNorm, [&] { rms_norm_to_bf16(x_.data(), n, H, L.attn_norm, eps, h_.data(), H, stream_); });
    gemm(h_.data(), H, n, L.wq, L8.wq, QD, H, q_.data(), DType::BF16, QD, 0.0f);
    gemm(h_.data(), H, n, L.wk, L8.wk, KD, H, kc, DType::BF16, KD, 0.0f, true);
    gemm(h_.data(), H, n, L.wv, L8.wv, KD, H, vc, DType::BF16, KD, 0.0f, true);
    if (cfg_.qkv_bias) {
      timed(EventTimer::kMisc, [&] {
        add_bias(q_.data(), n, QD, QD, L.bq, stream_);
        add_bias(kc, n, KD, KD, L.bk, stream_);
        add_bias(vc, n, KD, KD, L.bv, stream_);
      });
    }
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    if (kv != nullptr) {  // the policy rotates q and k itself (streaming: two positions per query)
      if (cfg_.qk_norm)  // QK-norm before the policy sees q and k, as the CPU Forward (rounded once to bf16)
        timed(EventTimer::kRope, [&] {
          qk_norm_rope(q_.data(), n, QD, cfg_.num_q_heads, static_cast<int>(D), L.q_norm, eps, id_cos_.data(),
                       id_sin_.data(), stream_);
          qk_norm_rope(kc, n, KD, cfg_.num_kv_heads, static_cast<int>(D), L.k_norm, eps, id_cos_.data(),
                       id_sin_.data(), stream_);
        });
      timer_.begin(EventTimer::kAttention, stream_);
      kv->attend(l, pos, n, q_.data(), kc, vc, inv_freqs_[r].data(), host_inv_freqs_[r], scale_, a_.data(), stream_);
      timer_.end(EventTimer::kAttention, stream_);
    } else {
      timed(EventTimer::kRope, [&] {
        qk_norm_rope(q_.data(), n, QD, cfg_.num_q_heads, static_cast<int>(D), cfg_.qk_norm ? L.q_norm : nullptr, eps,
                     cos_[r].data(), sin_[r].data(), stream_);
        qk_norm_rope(kc, n, KD, cfg_.num_kv_heads, static_cast<int>(D), cfg_.qk_norm ? L.k_norm : nullptr, eps,
                     cos_[r].data(), sin_[r].data(), stream_);
      });

      timer_.begin(EventTimer::kAttention, stream_);
      attention(l, pos, n, *cache, policy, total_len, set);
      timer_.end(EventTimer::kAttention, stream_);
    }
    sample_memory();

    if (cfg_.post_norms) {
      gemm(a_.data(), QD, n, L.wo, L8.wo, H, QD, o_.data(), DType::F32, H, 0.0f);
      timed(EventTimer::kNorm, [&] { add_rms_normed(x_.data(), o_.data(), n, H, L.post_attn_norm, eps, stream_); });
    } else {
      gemm(a_.data(), QD, n, L.wo, L8.wo, H, QD, x_.data(), DType::F32, H, 1.0f);  // x += a Wo^T
    }

    timed(EventTimer::kNorm, [&] { rms_norm_to_bf16(x_.data(), n, H, L.ffn_norm, eps, h_.data(), H, stream_); });
    for (int64_t m0 = 0; m0 < n; m0 += M) {
      const int64_t mm = std::min<int64_t>(M, n - m0);
      gemm(h_.data() + m0 * H, H, mm, L.w_gate_up, L8.w_gate_up, 2 * F, H, gu_.data(), DType::BF16, 2 * F, 0.0f);
      timed(EventTimer::kActivation, [&] { gated_activation(gu_.data(), mm, F, act, stream_); });
      if (cfg_.post_norms) {
        gemm(gu_.data(), 2 * F, mm, L.w_down, L8.w_down, H, F, o_.data() + m0 * H, DType::F32, H, 0.0f);
        timed(EventTimer::kNorm,
              [&] { add_rms_normed(x_.data() + m0 * H, o_.data() + m0 * H, mm, H, L.post_ffn_norm, eps, stream_); });
      } else {
        gemm(gu_.data(), 2 * F, mm, L.w_down, L8.w_down, H, F, x_.data() + m0 * H, DType::F32, H, 1.0f);  // x += m Wd^T
      }
    }
    if (l == 0) sample_memory();
  }

  if (rows == LogitRows::kNone) return {};
  const int32_t first = rows == LogitRows::kLast ? n - 1 : 0;
  const int64_t count = n - first;
  grow(logits_, count * V);
  timed(EventTimer::kNorm, [&] {
    rms_norm_to_bf16(x_.data() + static_cast<int64_t>(first) * H, count, H, model_.final_norm(), eps, h_.data(), H,
                     stream_);
  });
  timer_.begin(EventTimer::kGemm, stream_);  // the LM head: bf16 in both precisions
  gemm_.linear(h_.data(), H, count, model_.output(), V, H, logits_.data(), DType::F32, V, 0.0f);
  timer_.end(EventTimer::kGemm, stream_);
  if (cfg_.final_logit_softcap > 0)
    timed(EventTimer::kMisc, [&] { softcap(logits_.data(), count * V, cfg_.final_logit_softcap, stream_); });
  std::vector<float> out(static_cast<size_t>(count * V));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  sample_memory();
  return out;
}

}  // namespace tessera::runtime::gpu
