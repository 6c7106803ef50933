#include "parallel/cuda/tp_gpu_forward.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/recipe.h"
#include "runtime/cuda/gpu_attention.h"
#include "runtime/cuda/gpu_ops.h"
#include "runtime/cuda/kernels.h"

namespace tessera::parallel {

namespace gpu = runtime::gpu;

namespace {

// The rank's layer calls need no attention step of the base (they attend group by group, below).
class NoAttention final : public gpu::GpuAttentionStep {
 public:
  void attend(int32_t, const gpu::GpuQkv&, bf16*, cudaStream_t) override {}
};

std::vector<gpu::GpuOps::LayerNorms> replicated_norms(const TpDeviceModel& model);

}  // namespace

// runtime::gpu::GpuOps for the replicated residual stream (embedding, norms, head); the QKV, attention, output and MLP
// calls run the rank's shard, and out_proj / mlp all-reduce the partial sums (the recipe's reductions).
//
// Communication overlaps compute (TpForwardOptions::overlap_comm, FlexAttn's pipelining where it pays): out_proj runs
// in row pieces of mlp_chunk rows (the recipe's MLP pieces), and each piece's all-reduce runs on a second stream as
// soon as its partial sum is written, while the next pieces compute; the MLP of piece c waits only for piece c's
// out_proj all-reduce, so ffn_norm is deferred into mlp's piece (the norm of rows that are reduced). Only the last
// piece's MLP all-reduce is exposed. The sums are the same either way (row pieces of one in-place all-reduce); with
// overlap_comm off the all-reduces run on the compute stream (the baseline).
class TpGpuForward::Ops final : public gpu::GpuOps {
 public:
  Ops(const TpDeviceModel& model, Collective& comm, const TpForwardOptions& options, cudaStream_t stream,
      gpu::Gemm& gemm, gpu::EventTimer& timer)
      : GpuOps(model.config(), replicated_norms(model), model.embedding(), model.output(), model.final_norm(),
               model.rope_freq_factors(), stream, gemm, timer, options.mlp_chunk),
        tp_(model), comm_(comm), options_(options),
        attention_{gpu::AttentionBackend::kAuto, options.tile, options.dense_fallback, options.cuda_attention} {
    events_.resize(static_cast<size_t>(2 * cfg_.num_layers));
    for (cudaEvent_t& e : events_) TESSERA_CUDA_CHECK(cudaEventCreate(&e));
    layer_ms_.assign(static_cast<size_t>(cfg_.num_layers), 0.0f);
    if (options_.overlap_comm) TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }
  ~Ops() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : written_) cudaEventDestroy(e);
    for (cudaEvent_t e : reduced_) cudaEventDestroy(e);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }
  Ops(const Ops&) = delete;
  Ops& operator=(const Ops&) = delete;

  void reserve_kv(int32_t tokens) {
    capacity_ = tokens;
    k_.clear();
    v_.clear();
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      const size_t n = tp_.layer(l).groups.size() * static_cast<size_t>(tokens) * static_cast<size_t>(cfg_.head_dim);
      k_.emplace_back(n);
      v_.emplace_back(n);
    }
  }
  int32_t capacity() const { return capacity_; }
  size_t kv_bytes() const {
    size_t b = 0;
    for (size_t l = 0; l < k_.size(); ++l) b += k_[l].bytes() + v_[l].bytes();
    return b;
  }
  const std::vector<float>& layer_ms() const { return layer_ms_; }

  // Sets up a run of `tokens` at pos with `logit_rows` rows of logits.
  void start(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy, int32_t total_len,
             int64_t logit_rows) {
    const auto n = static_cast<int64_t>(tokens.size());
    const int64_t D = cfg_.head_dim;
    int64_t max_heads = 0, max_ffn = 0;
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      max_heads = std::max<int64_t>(max_heads, tp_.layer(l).heads);
      max_ffn = std::max<int64_t>(max_ffn, tp_.layer(l).ffn);
    }
    reserve_buffers(n, logit_rows, n * max_heads * D, n * max_heads * D, std::min<int64_t>(mlp_piece_, n) * 2 * max_ffn,
                    0, false);
    pos_ = pos;
    policy_ = policy;
    total_len_ = total_len;
    set_ = std::make_unique<gpu::ExecutorSet>(true);
    pieces_ = (n + mlp_piece_ - 1) / mlp_piece_;
    if (comm_stream_ != nullptr) piece_events(static_cast<size_t>(pieces_));
    upload_tokens(tokens);
    begin(n, this->tokens(), pos, nullptr, no_attention_);
  }
  void finish() {
    set_.reset();
    if (options_.time_layers)
      for (int32_t l = 0; l < cfg_.num_layers; ++l)
        TESSERA_CUDA_CHECK(cudaEventElapsedTime(&layer_ms_[static_cast<size_t>(l)], events_[static_cast<size_t>(2 * l)],
                                                events_[static_cast<size_t>(2 * l + 1)]));
  }

  // --- the recipe's calls that run the shard
  void qkv(int32_t l, bool bias) {
    const TpLayerWeights& L = tp_.layer(l);
    const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, n = n_;
    for (size_t gi = 0; gi < L.groups.size(); ++gi) {
      const TpGroupWeights& g = L.groups[gi];
      const int64_t QD = static_cast<int64_t>(g.heads) * D;
      bf16* q = group_q(g);
      bf16* kc = group_k(l, gi) + static_cast<int64_t>(pos_) * D;
      bf16* vc = group_v(l, gi) + static_cast<int64_t>(pos_) * D;
      gemm_.linear(h_.data(), H, n, g.wq, QD, H, q, DType::BF16, QD, 0.0f);
      gemm_.linear(h_.data(), H, n, g.wk, D, H, kc, DType::BF16, D, 0.0f);
      gemm_.linear(h_.data(), H, n, g.wv, D, H, vc, DType::BF16, D, 0.0f);
      if (bias) {
        gpu::add_bias(q, n, QD, QD, g.bq, stream_);
        gpu::add_bias(kc, n, D, D, g.bk, stream_);
        gpu::add_bias(vc, n, D, D, g.bv, stream_);
      }
    }
  }
  void qk_norm_rope(int32_t l, bool norm, bool rope) {
    const TpLayerWeights& L = tp_.layer(l);
    const auto D = static_cast<int>(cfg_.head_dim);
    const size_t r = layer_rope_[static_cast<size_t>(l)];
    if (!rope) return;  // (the rank's layers rotate always: no rotating attention step)
    for (size_t gi = 0; gi < L.groups.size(); ++gi) {
      const TpGroupWeights& g = L.groups[gi];
      gpu::qk_norm_rope(group_q(g), n_, static_cast<int64_t>(g.heads) * D, g.heads, D, norm ? L.q_norm : nullptr,
                        cfg_.rms_norm_eps, cos_[r].data(), sin_[r].data(), stream_);
      gpu::qk_norm_rope(group_k(l, gi) + static_cast<int64_t>(pos_) * D, n_, D, 1, D, norm ? L.k_norm : nullptr,
                        cfg_.rms_norm_eps, cos_[r].data(), sin_[r].data(), stream_);
    }
  }
  bool attention_rotates(int32_t) const { return false; }
  void attend(int32_t l) {
    if (options_.time_layers) TESSERA_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(2 * l)], stream_));
    const TpLayerWeights& L = tp_.layer(l);
    const bool sparse = policy_ != nullptr && !policy_->table().empty();
    const std::vector<int32_t>& heads = tp_.plan().layers[static_cast<size_t>(l)].heads;
    for (size_t gi = 0; gi < L.groups.size(); ++gi) {
      const TpGroupWeights& g = L.groups[gi];
      std::vector<attn::Pattern> patterns;
      for (int32_t h = g.first_head; h < g.first_head + g.heads; ++h)
        patterns.push_back(sparse ? policy_->at(l, heads[static_cast<size_t>(h)]) : attn::Pattern{attn::DensePattern{}});
      gpu::ContiguousCall c;
      c.q = group_q(g);
      c.k = group_k(l, gi);
      c.v = group_v(l, gi);
      c.out = a_.data() + n_ * g.first_head * cfg_.head_dim;
      c.n = static_cast<int32_t>(n_);
      c.pos = pos_;
      c.total_len = total_len_;
      c.heads = g.heads;
      c.kv_heads = 1;
      c.head_dim = cfg_.head_dim;
      c.model_window = cfg_.layers[static_cast<size_t>(l)].sliding_window;
      c.scale = scale_;
      c.model = cfg_.name;
      gpu::attend_contiguous(*set_, patterns, c, attention_,
                             "layer " + std::to_string(l) + " attention (KV group " + std::to_string(g.group) + ")",
                             stream_);
    }
    if (options_.time_layers) TESSERA_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(2 * l + 1)], stream_));
  }
  // The rank's partial a Wo^T per row piece, each piece all-reduced as soon as it is written.
  void out_proj(int32_t l, bool /*post_norm*/) {
    const TpLayerWeights& L = tp_.layer(l);
    const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, M = std::min<int64_t>(mlp_piece_, n_);
    for (int64_t c = 0; c < pieces_; ++c) {
      const int64_t r0 = c * M, mm = std::min<int64_t>(M, n_ - r0);
      auto [t, beta] = partial_target(r0);
      if (L.groups.empty() && beta == 0.0f)
        TESSERA_CUDA_CHECK(cudaMemsetAsync(t, 0, static_cast<size_t>(mm * H) * sizeof(float), stream_));
      for (size_t gi = 0; gi < L.groups.size(); ++gi) {
        const TpGroupWeights& g = L.groups[gi];
        const int64_t QD = static_cast<int64_t>(g.heads) * D;
        const bf16* a = a_.data() + n_ * g.first_head * D + r0 * QD;
        gemm_.linear(a, QD, mm, g.wo, H, QD, t, DType::F32, H, gi == 0 ? beta : 1.0f);
      }
      reduce_piece(c, t, mm);
    }
  }
  void ffn_norm(int32_t) {}  // per piece, once the piece is reduced (mlp)
  void mlp(int32_t l, int64_t r0, int64_t mm, runtime::Activation act, bool post_norm) {
    const TpLayerWeights& L = tp_.layer(l);
    const int64_t H = cfg_.hidden_size, F = L.ffn;
    const float eps = cfg_.rms_norm_eps;
    const int64_t c = r0 / std::min<int64_t>(mlp_piece_, n_);
    if (comm_stream_ != nullptr) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream_, reduced_[static_cast<size_t>(c)], 0));
    if (post_norm) gpu::add_rms_normed(x_.data() + r0 * H, o_.data() + r0 * H, mm, H, L.post_attn_norm, eps, stream_);
    gpu::rms_norm_to_bf16(x_.data() + r0 * H, mm, H, L.ffn_norm, eps, h_.data() + r0 * H, H, stream_);
    auto [t, beta] = partial_target(r0);
    if (F == 0) {
      if (beta == 0.0f) TESSERA_CUDA_CHECK(cudaMemsetAsync(t, 0, static_cast<size_t>(mm * H) * sizeof(float), stream_));
    } else {
      gemm_.linear(h_.data() + r0 * H, H, mm, L.w_gate_up, 2 * F, H, gu_.data(), DType::BF16, 2 * F, 0.0f);
      gpu::gated_activation(gu_.data(), mm, F, gpu::gate_activation(act), stream_);
      gemm_.linear(gu_.data(), 2 * F, mm, L.w_down, H, F, t, DType::F32, H, beta);
    }
    reduce_piece(c, t, mm);
    if (r0 + mm < n_) return;
    // The comm stream runs in order: the last piece reduced means every piece is.
    if (comm_stream_ != nullptr)
      TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream_, reduced_[static_cast<size_t>(pieces_ - 1)], 0));
    if (post_norm) gpu::add_rms_normed(x_.data(), o_.data(), n_, H, L.post_ffn_norm, eps, stream_);
  }

 private:
  bf16* group_q(const TpGroupWeights& g) { return q_.data() + n_ * g.first_head * cfg_.head_dim; }
  bf16* group_k(int32_t l, size_t gi) {
    return k_[static_cast<size_t>(l)].data() + static_cast<int64_t>(gi) * capacity_ * cfg_.head_dim;
  }
  bf16* group_v(int32_t l, size_t gi) {
    return v_[static_cast<size_t>(l)].data() + static_cast<int64_t>(gi) * capacity_ * cfg_.head_dim;
  }
  // Where a partial sum goes before the all-reduce: x itself (rank 0 adds to it, the others overwrite it), or o for
  // Gemma-3's post-norms (the norm applies to the reduced sum).
  std::pair<float*, float> partial_target(int64_t row0) {
    const int64_t H = cfg_.hidden_size;
    if (cfg_.post_norms) return {o_.data() + row0 * H, 0.0f};
    return {x_.data() + row0 * H, comm_.rank() == 0 ? 1.0f : 0.0f};
  }
  // The all-reduce of rows [r0, r0 + mm) of `t` (partial sums written on the compute stream): on the comm stream
  // after the piece is written (overlap_comm), else in order on the compute stream.
  void reduce_piece(int64_t c, float* t, int64_t mm) {
    const auto count = static_cast<size_t>(mm * cfg_.hidden_size);
    if (comm_stream_ == nullptr) {
      comm_.all_reduce_sum(t, count, stream_);
      return;
    }
    TESSERA_CUDA_CHECK(cudaEventRecord(written_[static_cast<size_t>(c)], stream_));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, written_[static_cast<size_t>(c)], 0));
    comm_.all_reduce_sum(t, count, comm_stream_);
    TESSERA_CUDA_CHECK(cudaEventRecord(reduced_[static_cast<size_t>(c)], comm_stream_));
  }
  void piece_events(size_t pieces) {
    while (written_.size() < pieces) {
      cudaEvent_t w, r;
      TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&w, cudaEventDisableTiming));
      TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&r, cudaEventDisableTiming));
      written_.push_back(w);
      reduced_.push_back(r);
    }
  }

  const TpDeviceModel& tp_;
  Collective& comm_;
  TpForwardOptions options_;
  gpu::ContiguousOptions attention_;
  cudaStream_t comm_stream_ = nullptr;  // overlap_comm: the all-reduces' stream
  NoAttention no_attention_;
  std::unique_ptr<gpu::ExecutorSet> set_;  // the run's executors
  int32_t pos_ = 0, total_len_ = 0, capacity_ = 0;
  const attn::AttentionPolicy* policy_ = nullptr;
  int64_t pieces_ = 0;
  std::vector<attn::gpu::DeviceBuffer<bf16>> k_, v_;  // per layer [groups, capacity, d]
  std::vector<cudaEvent_t> events_;                   // 2 per layer
  // overlap_comm: per row piece, "partial sum written" and "all-reduced" (re-recorded every layer).
  std::vector<cudaEvent_t> written_, reduced_;
  std::vector<float> layer_ms_;
};

namespace {

std::vector<gpu::GpuOps::LayerNorms> replicated_norms(const TpDeviceModel& model) {
  std::vector<gpu::GpuOps::LayerNorms> norms;
  for (int32_t l = 0; l < model.config().num_layers; ++l) {
    const TpLayerWeights& L = model.layer(l);
    norms.push_back({L.attn_norm, L.ffn_norm, L.post_attn_norm, L.post_ffn_norm, L.q_norm, L.k_norm});
  }
  return norms;
}

}  // namespace

TpGpuForward::TpGpuForward(const TpDeviceModel& model, Collective& comm, const TpForwardOptions& options,
                           cudaStream_t stream, gpu::Gemm& gemm)
    : model_(model) {
  check(options.mlp_chunk > 0, "tensor-parallel forward: mlp_chunk must be positive");
  ops_ = std::make_unique<Ops>(model, comm, options, stream, gemm, timer_);
}

TpGpuForward::~TpGpuForward() = default;

void TpGpuForward::reserve(int32_t tokens) { ops_->reserve_kv(tokens); }

size_t TpGpuForward::kv_bytes() const { return ops_->kv_bytes(); }

const std::vector<float>& TpGpuForward::layer_attention_ms() const { return ops_->layer_ms(); }

std::vector<float> TpGpuForward::run(std::span<const int32_t> tokens, int32_t pos,
                                     const attn::AttentionPolicy* policy, int32_t total_len, bool last_only) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(pos + n <= ops_->capacity(), "tensor-parallel forward: the KV cache has room for " +
                                         std::to_string(ops_->capacity()) + " tokens, the chunk ends at " +
                                         std::to_string(pos + n) + " (reserve more)");
  const int32_t first = last_only ? n - 1 : 0;
  ops_->start(tokens, pos, policy, total_len, n - first);
  runtime::run_layers(model_.config(), *ops_);
  ops_->head(first);
  std::vector<float> out = ops_->download_logits(n - first);
  ops_->finish();
  return out;
}

}  // namespace tessera::parallel
