#include "runtime/cuda/gpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/rope.h"
#include "runtime/cuda/fp8_gemv.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/paged_decode.h"
#include "runtime/cuda/w4_gemv.h"

namespace tessera::runtime::gpu {

GateActivation gate_activation(Activation a) {
  return a == Activation::SiLU       ? GateActivation::kSiLU
         : a == Activation::GeluTanh ? GateActivation::kGeluTanh
                                     : GateActivation::kGelu;
}

GpuOps::GpuOps(const DeviceModel& model, cudaStream_t stream, Gemm& gemm, EventTimer& timer,
               const DeviceFp8Weights* fp8, int64_t mlp_piece)
    : GpuOps(model.config(), {}, model.embedding(), model.output(), model.final_norm(), model.rope_freq_factors(),
             stream, gemm, timer, mlp_piece) {
  model_ = &model;
  fp8_ = fp8;
  const char* fused = std::getenv("TESSERA_FP8_FUSED");
  fuse8_ = fused == nullptr || std::string(fused) != "0";
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const DeviceLayer& L = model.layer(l);
    norms_.push_back({L.attn_norm, L.ffn_norm, L.post_attn_norm, L.post_ffn_norm, L.q_norm, L.k_norm});
  }
}

GpuOps::GpuOps(const ModelConfig& config, std::vector<LayerNorms> norms, const bf16* embedding, const bf16* output,
               const float* final_norm, const std::vector<float>& rope_freq_factors, cudaStream_t stream, Gemm& gemm,
               EventTimer& timer, int64_t mlp_piece)
    : cfg_(config), stream_(stream), gemm_(gemm), timer_(timer), norms_(std::move(norms)), embedding_(embedding),
      output_(output), final_norm_(final_norm), mlp_piece_(mlp_piece) {
  check(mlp_piece_ > 0, "GPU forward: mlp_chunk must be positive");
  scale_ = cfg_.attention_scale > 0 ? cfg_.attention_scale : 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  LayerRopes ropes = layer_ropes(cfg_, rope_freq_factors);
  for (const std::vector<float>& f : ropes.inv_freqs) {
    inv_freqs_.emplace_back();
    inv_freqs_.back().upload(f, stream_);
  }
  host_inv_freqs_ = std::move(ropes.inv_freqs);
  layer_rope_ = std::move(ropes.layer);
  cos_.resize(inv_freqs_.size());
  sin_.resize(inv_freqs_.size());
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `f` above is gone when this returns
}

cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& launch) {
  cudaGraph_t graph = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    launch();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TESSERA_CUDA_CHECK(err);
  return exec;
}

namespace {

// Bytes of the buffers, and releasing them.
template <class... B>
size_t bytes_of(const B&... b) {
  return (b.bytes() + ... + size_t{0});
}
template <class... B>
void release_all(B&... b) {
  ((b = {}), ...);
}

// The step rotates q and k itself in some layer and the model has QK-norm: QK-norm alone needs the identity
// rotation's tables.
bool needs_identity(const ModelConfig& cfg, const GpuAttentionStep& step) {
  if (!cfg.qk_norm) return false;
  for (int32_t l = 0; l < cfg.num_layers; ++l)
    if (step.rotates(l)) return true;
  return false;
}

}  // namespace

bool GpuOps::reserve_buffers(int64_t n, int64_t logit_rows, int64_t q_elems, int64_t a_elems, int64_t gu_elems,
                             int64_t kv_elems, bool identity) {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, V = cfg_.vocab_size;
  bool grew = false;
  grew |= grow(tokens_, n);
  grew |= grow(x_, n * H);
  grew |= grow(h_, n * H);
  grew |= grow(q_, std::max<int64_t>(1, q_elems));
  grew |= grow(a_, std::max<int64_t>(1, a_elems));
  grew |= grow(gu_, std::max<int64_t>(1, gu_elems));
  if (cfg_.post_norms) grew |= grow(o_, n * H);
  if (fp8_ != nullptr && fuse8_) {  // (allocated here: never inside a graph capture)
    const int64_t F = cfg_.intermediate_size, piece = std::min<int64_t>(mlp_piece_, n);
    grew |= grow(h8_, n * H);
    grew |= grow(h8_scales_, n);
    grew |= grow(gu8_, piece * F);
    grew |= grow(gu8_scales_, piece);
  }
  if (kv_elems > 0) {
    grew |= grow(k_, kv_elems);
    grew |= grow(v_, kv_elems);
  }
  if (logit_rows > 0) grew |= grow(logits_, logit_rows * V);
  for (size_t r = 0; r < inv_freqs_.size(); ++r) {
    grew |= grow(cos_[r], n * (D / 2));
    grew |= grow(sin_[r], n * (D / 2));
  }
  if (identity) {
    grew |= grow(no_freq_, D / 2);
    grew |= grow(id_cos_, n * (D / 2));
    grew |= grow(id_sin_, n * (D / 2));
  }
  return grew;
}

bool GpuOps::reserve(int64_t n, int64_t logit_rows, const GpuAttentionStep& step) {
  const int64_t D = cfg_.head_dim, F = cfg_.intermediate_size;
  const int64_t QD = static_cast<int64_t>(cfg_.num_q_heads) * D, KD = static_cast<int64_t>(cfg_.num_kv_heads) * D;
  const bool own_kv = step.k_rows(0) == nullptr;
  const bool fused = own_kv && step.fused_qkv() && fp8_ == nullptr;
  return reserve_buffers(n, logit_rows, fused ? n * (QD + 2 * KD) : n * QD, n * QD,
                         std::min<int64_t>(mlp_piece_, n) * 2 * F, own_kv && !fused ? n * KD : 0,
                         needs_identity(cfg_, step));
}

void GpuOps::upload_tokens(std::span<const int32_t> tokens) {
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), tokens.data(), tokens.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_));
}

void GpuOps::begin(int64_t n, const int32_t* tokens, int32_t pos, const int32_t* positions, GpuAttentionStep& step) {
  const int64_t D = cfg_.head_dim;
  n_ = n;
  step_tokens_ = tokens;
  step_ = &step;
  fused_ = step.k_rows(0) == nullptr && step.fused_qkv() && fp8_ == nullptr;
  identity_ = needs_identity(cfg_, step);
  timed(EventTimer::kRope, [&] {
    for (size_t r = 0; r < inv_freqs_.size(); ++r) {
      if (positions != nullptr)
        rope_tables_at(inv_freqs_[r].data(), static_cast<int>(D / 2), positions, n, cos_[r].data(), sin_[r].data(),
                       stream_);
      else
        rope_tables(inv_freqs_[r].data(), static_cast<int>(D / 2), pos, n, cos_[r].data(), sin_[r].data(), stream_);
    }
    if (identity_) {
      TESSERA_CUDA_CHECK(cudaMemsetAsync(no_freq_.data(), 0, static_cast<size_t>(D / 2) * sizeof(float), stream_));
      rope_tables(no_freq_.data(), static_cast<int>(D / 2), 0, n, id_cos_.data(), id_sin_.data(), stream_);
    }
  });
}

void GpuOps::gemm(const bf16* x, int64_t ldx, int64_t m, const bf16* w, const Fp8Matrix* w8, int64_t out, int64_t in,
                  void* y, DType y_type, int64_t ldy, float beta, bool reuse) {
  timer_.begin(EventTimer::kGemm, stream_);
  static const bool w8_gemv = [] {
    const char* e = std::getenv("TESSERA_GPU_W8_GEMV");
    return e == nullptr || std::string(e) != "0";
  }();
  const W4Matrix* w4 = w4_ != nullptr && m <= kW4Rows ? w4_->find(w, out) : nullptr;
  if (w4 != nullptr) {
    // A decode step's few rows: weight-only 4-bit (w4_gemv.h), a quarter of the bf16 bytes.
    check(w4->cols == in, "GPU forward: the 4-bit copy of a [" + std::to_string(out) + ", " + std::to_string(in) +
                              "] matrix has " + std::to_string(w4->cols) + " columns");
    gemv_w4a16(x, ldx, m, *w4, y, y_type == DType::F32, ldy, beta, stream_);
  } else if (fp8_ != nullptr && w8 != nullptr && m <= kW8Rows && w8_gemv) {
    // A decode step's few rows: weight-only FP8 (fp8_gemv.h), the bytes W8A8 saves without its quantization launches.
    gemv_w8a16(x, ldx, m, *w8, y, y_type == DType::F32, ldy, beta, stream_);
  } else if (fp8_ != nullptr && w8 != nullptr) {
    if (pre8_set_) {  // quantized by the kernel that made x (fused8())
      check(pre8_.rows == m && pre8_.cols == in, "GPU forward: internal: pre-quantized input of the wrong shape");
      x8_ = pre8_;
    } else if (!reuse) {
      x8_ = gemm_.quantize_activation(x, ldx, m, in);
    }
    gemm_.linear_fp8(x8_, *w8, y, y_type, ldy, beta);
  } else {
    gemm_.linear(x, ldx, m, w, out, in, y, y_type, ldy, beta);
  }
  pre8_set_ = false;
  timer_.end(EventTimer::kGemm, stream_);
}

bool GpuOps::fused8(int64_t m) {
  static const bool w8_gemv = [] {
    const char* e = std::getenv("TESSERA_GPU_W8_GEMV");
    return e == nullptr || std::string(e) != "0";
  }();
  return fp8_ != nullptr && fuse8_ && gemm_.fp8_scaling() == Fp8Scaling::kRow && m > kW4Rows &&
         (m > kW8Rows || !w8_gemv) && h8_.size() >= static_cast<size_t>(n_ * cfg_.hidden_size);
}

void GpuOps::norm_x(const float* w) {
  const int64_t H = cfg_.hidden_size;
  h8_rows_ = 0;
  timed(EventTimer::kNorm, [&] {
    // h in bf16 always (the decode-sized pieces and the LM head read it), its FP8 codes with it where they are used.
    if (fused8(std::min(n_, mlp_piece_)) &&
        rms_norm_to_fp8_rows(x_.data(), n_, H, w, cfg_.rms_norm_eps, h_.data(), H, h8_.data(), h8_scales_.data(),
                             stream_)) {
      h8_rows_ = n_;
      return;
    }
    rms_norm_to_bf16(x_.data(), n_, H, w, cfg_.rms_norm_eps, h_.data(), H, stream_);
  });
}

void GpuOps::use_h8(int64_t row0, int64_t rows) {
  if (h8_rows_ < row0 + rows || !fused8(rows)) return;
  const int64_t H = cfg_.hidden_size;
  pre8_ = Fp8Matrix{h8_.data() + row0 * H, h8_scales_.data() + row0, rows, H, Fp8Scaling::kRow};
  pre8_set_ = true;
}

void GpuOps::embed() {
  timed(EventTimer::kMisc, [&] {
    embed_tokens(step_tokens_, n_, embedding_, cfg_.hidden_size, cfg_.embedding_scale, x_.data(), stream_);
  });
}

void GpuOps::qkv(int32_t l, bool bias) {
  const DeviceLayer& L = model_->layer(l);
  const Fp8Layer* L8 = fp8_ != nullptr ? &fp8_->layer(l) : nullptr;
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, n = n_;
  const int64_t QD = static_cast<int64_t>(cfg_.num_q_heads) * D, KD = static_cast<int64_t>(cfg_.num_kv_heads) * D;
  GpuQkv& r = qkv_rows_;
  if (fused_) {
    // One GEMM for Q, K and V (DeviceModel keeps the three weights as one [QD + 2 KD, H] matrix): row t holds q,
    // then k, then v.
    const int64_t QKV = QD + 2 * KD;
    r = {q_.data(), q_.data() + QD, q_.data() + QD + KD, QKV, QKV};
    gemm(h_.data(), H, n, L.wqkv, nullptr, QKV, H, r.q, DType::BF16, QKV, 0.0f);
  } else {
    bf16* k = step_->k_rows(l);
    bf16* v = step_->v_rows(l);
    r = {q_.data(), k != nullptr ? k : k_.data(), v != nullptr ? v : v_.data(), QD, KD};
    if (L8 != nullptr) use_h8(0, n);
    gemm(h_.data(), H, n, L.wq, L8 ? &L8->wq : nullptr, QD, H, r.q, DType::BF16, QD, 0.0f);
    gemm(h_.data(), H, n, L.wk, L8 ? &L8->wk : nullptr, KD, H, r.k, DType::BF16, KD, 0.0f, true);
    gemm(h_.data(), H, n, L.wv, L8 ? &L8->wv : nullptr, KD, H, r.v, DType::BF16, KD, 0.0f, true);
  }
  if (bias)
    timed(EventTimer::kMisc, [&] {
      add_bias(r.q, n, QD, r.q_ld, L.bq, stream_);
      add_bias(r.k, n, KD, r.kv_ld, L.bk, stream_);
      add_bias(r.v, n, KD, r.kv_ld, L.bv, stream_);
    });
}

void GpuOps::qk_norm_rope(int32_t l, bool norm, bool rope) {
  if (!norm && !rope) return;
  const auto D = static_cast<int>(cfg_.head_dim);
  const size_t set = layer_rope_[static_cast<size_t>(l)];
  const float* c = rope ? cos_[set].data() : id_cos_.data();
  const float* s = rope ? sin_[set].data() : id_sin_.data();
  const LayerNorms& N = norms_[static_cast<size_t>(l)];
  const float eps = cfg_.rms_norm_eps;
  const GpuQkv& r = qkv_rows_;
  timed(EventTimer::kRope, [&] {
    if (fused_ && !norm) {  // the q and k heads are adjacent in a row: one launch rotates both
      gpu::qk_norm_rope(r.q, n_, r.q_ld, cfg_.num_q_heads + cfg_.num_kv_heads, D, nullptr, eps, c, s, stream_);
    } else {
      gpu::qk_norm_rope(r.q, n_, r.q_ld, cfg_.num_q_heads, D, norm ? N.q_norm : nullptr, eps, c, s, stream_);
      gpu::qk_norm_rope(r.k, n_, r.kv_ld, cfg_.num_kv_heads, D, norm ? N.k_norm : nullptr, eps, c, s, stream_);
    }
  });
}

void GpuOps::attend(int32_t l) {
  timer_.begin(EventTimer::kAttention, stream_);
  step_->attend(l, qkv_rows_, a_.data(), stream_);
  timer_.end(EventTimer::kAttention, stream_);
  if (sample_) sample_memory();
}

void GpuOps::out_proj(int32_t l, bool post_norm) {
  const DeviceLayer& L = model_->layer(l);
  const Fp8Matrix* wo = fp8_ != nullptr ? &fp8_->layer(l).wo : nullptr;
  const int64_t H = cfg_.hidden_size, QD = static_cast<int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
  if (post_norm) {
    gemm(a_.data(), QD, n_, L.wo, wo, H, QD, o_.data(), DType::F32, H, 0.0f);
    if (reduce_.all_reduce) reduce_.all_reduce(o_.data(), static_cast<size_t>(n_ * H), stream_);
    timed(EventTimer::kNorm, [&] {
      add_rms_normed(x_.data(), o_.data(), n_, H, L.post_attn_norm, cfg_.rms_norm_eps, stream_);
    });
  } else {
    const float beta = reduce_.all_reduce && reduce_.rank != 0 ? 0.0f : 1.0f;
    gemm(a_.data(), QD, n_, L.wo, wo, H, QD, x_.data(), DType::F32, H, beta);  // x += a Wo^T
    if (reduce_.all_reduce) reduce_.all_reduce(x_.data(), static_cast<size_t>(n_ * H), stream_);
  }
}

void GpuOps::mlp(int32_t l, int64_t row0, int64_t rows, Activation act, bool post_norm) {
  const DeviceLayer& L = model_->layer(l);
  const Fp8Layer* L8 = fp8_ != nullptr ? &fp8_->layer(l) : nullptr;
  const int64_t H = cfg_.hidden_size, F = cfg_.intermediate_size;
  if (L8 != nullptr) use_h8(row0, rows);
  gemm(h_.data() + row0 * H, H, rows, L.w_gate_up, L8 ? &L8->w_gate_up : nullptr, 2 * F, H, gu_.data(), DType::BF16,
       2 * F, 0.0f);
  bool gu8 = false;
  timed(EventTimer::kActivation, [&] {
    // W8A8 down projection: the activation's FP8 codes in the same pass, its bf16 values not written.
    gu8 = L8 != nullptr && fused8(rows) && gu8_.size() >= static_cast<size_t>(rows * F) &&
          gated_activation_fp8_rows(gu_.data(), rows, F, gate_activation(act), false, gu8_.data(), gu8_scales_.data(),
                                    stream_);
    if (!gu8) gated_activation(gu_.data(), rows, F, gate_activation(act), stream_);
  });
  if (gu8) {
    pre8_ = Fp8Matrix{gu8_.data(), gu8_scales_.data(), rows, F, Fp8Scaling::kRow};
    pre8_set_ = true;
  }
  const Fp8Matrix* wd = L8 ? &L8->w_down : nullptr;
  if (post_norm) {
    gemm(gu_.data(), 2 * F, rows, L.w_down, wd, H, F, o_.data() + row0 * H, DType::F32, H, 0.0f);
    if (reduce_.all_reduce) reduce_.all_reduce(o_.data() + row0 * H, static_cast<size_t>(rows * H), stream_);
    timed(EventTimer::kNorm, [&] {
      add_rms_normed(x_.data() + row0 * H, o_.data() + row0 * H, rows, H, L.post_ffn_norm, cfg_.rms_norm_eps,
                     stream_);
    });
  } else {
    const float beta = reduce_.all_reduce && reduce_.rank != 0 ? 0.0f : 1.0f;
    gemm(gu_.data(), 2 * F, rows, L.w_down, wd, H, F, x_.data() + row0 * H, DType::F32, H, beta);  // x += m Wd^T
    if (reduce_.all_reduce) reduce_.all_reduce(x_.data() + row0 * H, static_cast<size_t>(rows * H), stream_);
  }
  if (l == 0 && row0 + rows == n_ && sample_) sample_memory();
}

void GpuOps::head(int64_t first) {
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  const int64_t count = n_ - first;
  if (count <= 0) return;
  h8_rows_ = 0;  // h is rewritten below
  timed(EventTimer::kNorm, [&] {
    rms_norm_to_bf16(x_.data() + first * H, count, H, final_norm_, cfg_.rms_norm_eps, h_.data(), H, stream_);
  });
  timer_.begin(EventTimer::kGemm, stream_);  // the LM head: bf16 in both precisions
  gemm_.linear(h_.data(), H, count, output_, V, H, logits_.data(), DType::F32, V, 0.0f);
  timer_.end(EventTimer::kGemm, stream_);
  if (cfg_.final_logit_softcap > 0)
    timed(EventTimer::kMisc, [&] { softcap(logits_.data(), count * V, cfg_.final_logit_softcap, stream_); });
}

std::vector<float> GpuOps::download_logits(int64_t count) {
  std::vector<float> out(static_cast<size_t>(count * cfg_.vocab_size));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (sample_) sample_memory();
  return out;
}

std::vector<double> GpuOps::download_logprobs(std::span<const int32_t> next) {
  const auto rows = static_cast<int64_t>(next.size());
  std::vector<double> out(next.size());
  if (rows == 0) return out;
  for (const int32_t t : next)
    check(t >= 0 && t < cfg_.vocab_size, "GPU log-probabilities: token id " + std::to_string(t) + " outside the vocabulary");
  grow(next_, rows);
  grow(logprobs_, rows);
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(next_.data(), next.data(), next.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  timed(EventTimer::kMisc, [&] {
    row_logprobs(logits_.data(), rows, cfg_.vocab_size, cfg_.vocab_size, next_.data(), logprobs_.data(), stream_);
  });
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(out.data(), logprobs_.data(), out.size() * sizeof(double), cudaMemcpyDeviceToHost, stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (next and out are on this stack)
  if (sample_) sample_memory();
  return out;
}

size_t GpuOps::scratch_bytes() const {
  size_t b = bytes_of(tokens_, next_, logprobs_, x_, o_, logits_, h_, q_, a_, gu_, k_, v_, no_freq_, id_cos_, id_sin_,
                      h8_, gu8_, h8_scales_, gu8_scales_);
  for (size_t r = 0; r < cos_.size(); ++r) b += bytes_of(cos_[r], sin_[r]);
  return b;
}

void GpuOps::release_scratch() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  release_all(tokens_, next_, logprobs_, x_, o_, logits_, h_, q_, a_, gu_, k_, v_, no_freq_, id_cos_, id_sin_, h8_, gu8_,
              h8_scales_, gu8_scales_);
  h8_rows_ = 0;
  for (size_t r = 0; r < cos_.size(); ++r) release_all(cos_[r], sin_[r]);
}

void GpuOps::sample_memory() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    peak_in_use_ = std::max(peak_in_use_, total_bytes - free_bytes);
  else
    (void)cudaGetLastError();
}

}  // namespace tessera::runtime::gpu
