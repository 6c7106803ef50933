#include "runtime/cuda/gpu_forward.h"

#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/recipe.h"

namespace tessera::runtime::gpu {

namespace {

// A sequence's keys and values contiguous in a DeviceKVCache, attended under a sparse policy (gpu_attention.h).
class ContiguousAttention final : public GpuAttentionStep {
 public:
  ContiguousAttention(const GpuOps& ops, DeviceKVCache& cache, int32_t pos, int32_t n,
                      const attn::AttentionPolicy* policy, int32_t total_len, const ContiguousOptions& options)
      : ops_(ops), cache_(cache), pos_(pos), n_(n), policy_(policy), total_len_(total_len), options_(options) {}

  bf16* k_rows(int32_t layer) const override { return cache_.k(layer, pos_); }
  bf16* v_rows(int32_t layer) const override { return cache_.v(layer, pos_); }

  void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) override {
    const ModelConfig& cfg = ops_.config();
    const std::vector<attn::Pattern> patterns =
        policy_ != nullptr && !policy_->table().empty()
            ? policy_->layer(layer)
            : std::vector<attn::Pattern>(static_cast<size_t>(cfg.num_q_heads), attn::DensePattern{});
    ContiguousCall c;
    c.q = qkv.q;
    c.k = cache_.k(layer, 0);
    c.v = cache_.v(layer, 0);
    c.out = out;
    c.n = n_;
    c.pos = pos_;
    c.total_len = total_len_;
    c.heads = cfg.num_q_heads;
    c.kv_heads = cfg.num_kv_heads;
    c.head_dim = cfg.head_dim;
    c.model_window = cfg.layers[static_cast<size_t>(layer)].sliding_window;
    c.scale = ops_.attention_scale();
    c.model = cfg.name;
    attend_contiguous(set_, patterns, c, options_, "layer " + std::to_string(layer) + " attention", stream);
  }

 private:
  const GpuOps& ops_;
  DeviceKVCache& cache_;
  int32_t pos_, n_;
  const attn::AttentionPolicy* policy_;
  int32_t total_len_;
  const ContiguousOptions& options_;
  ExecutorSet set_;  // the chunk's executors
};

// A GpuKVPolicy (streaming memory) holds the keys and values and rotates q and k itself.
class PolicyAttention final : public GpuAttentionStep {
 public:
  PolicyAttention(GpuKVPolicy& kv, const GpuOps& ops, int32_t pos, int32_t n) : kv_(kv), ops_(ops), pos_(pos), n_(n) {}
  bool rotates(int32_t) const override { return true; }
  void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) override {
    kv_.attend(layer, pos_, n_, qkv.q, qkv.k, qkv.v, ops_.inv_freq(layer), ops_.host_inv_freq(layer),
               ops_.attention_scale(), out, stream);
  }

 private:
  GpuKVPolicy& kv_;
  const GpuOps& ops_;
  int32_t pos_, n_;
};

// The mixed step's attention: rows [0, n) a prefill chunk of the cache's sequence at [pos, pos + n) (their K/V copied
// from the scratch into the cache, then the contiguous route under the policy, as ContiguousAttention), rows
// [n, rows) decode rows through `decode` (the paged decode step) over the tail of q, k, v and out.
class MixedAttention final : public GpuAttentionStep {
 public:
  MixedAttention(const GpuOps& ops, DeviceKVCache& cache, int32_t pos, int32_t n, const attn::AttentionPolicy* policy,
                 int32_t total_len, const ContiguousOptions& options, GpuAttentionStep& decode)
      : chunk_(ops, cache, pos, n, policy, total_len, options), ops_(ops), cache_(cache), pos_(pos), n_(n),
        decode_(decode) {}

  // K and V in the scratch ([rows, kv_heads * d] each, not fused: the contiguous route reads q rows QD apart).
  void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) override {
    const ModelConfig& cfg = ops_.config();
    const int64_t QD = static_cast<int64_t>(cfg.num_q_heads) * cfg.head_dim;
    const int64_t KD = static_cast<int64_t>(cfg.num_kv_heads) * cfg.head_dim;
    check(qkv.q_ld == QD && qkv.kv_ld == KD, "GPU mixed step: q, k and v must be separate, contiguous rows");
    const size_t row = static_cast<size_t>(KD) * sizeof(bf16);
    const size_t pitch = static_cast<size_t>(cache_.row_elements()) * sizeof(bf16);
    TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(cache_.k(layer, pos_), pitch, qkv.k, row, row, static_cast<size_t>(n_),
                                         cudaMemcpyDeviceToDevice, stream));
    TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(cache_.v(layer, pos_), pitch, qkv.v, row, row, static_cast<size_t>(n_),
                                         cudaMemcpyDeviceToDevice, stream));
    chunk_.attend(layer, qkv, out, stream);  // (reads q's first n rows and the cache)
    const GpuQkv tail{qkv.q + n_ * QD, qkv.k + n_ * KD, qkv.v + n_ * KD, QD, KD};
    decode_.attend(layer, tail, out + n_ * QD, stream);
  }

 private:
  ContiguousAttention chunk_;
  const GpuOps& ops_;
  DeviceKVCache& cache_;
  int32_t pos_, n_;
  GpuAttentionStep& decode_;
};

}  // namespace

GpuForward::GpuForward(const DeviceModel& model, const ForwardOptions& options, cudaStream_t stream, Gemm& gemm,
                       EventTimer& timer, const DeviceFp8Weights* fp8)
    : cfg_(model.config()),
      attention_{options.attention, options.tile, options.dense_fallback, options.cuda_attention},
      ops_(model, stream, gemm, timer, fp8, options.mlp_chunk) {
  check(options.tile == 64 || options.tile == 128,
        "GPU forward: the index tile must be 64 or 128, got " + std::to_string(options.tile));
  ops_.set_sample_memory(true);
}

std::vector<float> GpuForward::run(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache& cache,
                                   const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(cache.capacity() >= pos + n, "GPU forward: the KV cache has no room for the chunk");
  ContiguousAttention step(ops_, cache, pos, n, policy, total_len, attention_);
  return run_step(tokens, pos, step, rows);
}

std::vector<float> GpuForward::run(std::span<const int32_t> tokens, int32_t pos, GpuKVPolicy& kv, LogitRows rows) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  PolicyAttention step(kv, ops_, pos, n);
  return run_step(tokens, pos, step, rows);
}

std::vector<double> GpuForward::score(std::span<const int32_t> tokens, int32_t pos, DeviceKVCache& cache,
                                      const attn::AttentionPolicy* policy, int32_t total_len,
                                      std::span<const int32_t> next) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(cache.capacity() >= pos + n, "GPU forward: the KV cache has no room for the chunk");
  ContiguousAttention step(ops_, cache, pos, n, policy, total_len, attention_);
  return score_step(tokens, pos, step, next);
}

std::vector<double> GpuForward::score(std::span<const int32_t> tokens, int32_t pos, GpuKVPolicy& kv,
                                      std::span<const int32_t> next) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  PolicyAttention step(kv, ops_, pos, n);
  return score_step(tokens, pos, step, next);
}

void GpuForward::run_mixed(std::span<const int32_t> tokens, int32_t n, int32_t pos, DeviceKVCache& cache,
                           const attn::AttentionPolicy* policy, int32_t total_len, const int32_t* positions,
                           GpuAttentionStep& decode, bool chunk_logits) {
  const auto rows = static_cast<int64_t>(tokens.size());
  check(n > 0 && rows > n, "GPU mixed step: needs a prefill chunk and decode rows");
  check(pos >= 0 && cache.capacity() >= pos + n, "GPU forward: the KV cache has no room for the chunk");
  for (const int32_t t : tokens)
    check(t >= 0 && t < cfg_.vocab_size, "GPU mixed step: token id " + std::to_string(t) + " outside the vocabulary");
  MixedAttention step(ops_, cache, pos, n, policy, total_len, attention_, decode);
  // No memory sampling (a cudaMemGetInfo after every layer's attention): only the single-sequence engine reports the
  // peak, and its chunks go through run(); a mixed step is the batched engine's.
  struct Sampling {
    GpuOps& ops;
    ~Sampling() { ops.set_sample_memory(true); }
  } restore{ops_};
  ops_.set_sample_memory(false);
  const int64_t first = chunk_logits ? n - 1 : n;
  ops_.reserve(rows, rows - first, step);
  ops_.upload_tokens(tokens);
  ops_.begin(rows, ops_.tokens(), 0, positions, step);
  run_layers(cfg_, ops_);
  ops_.head(first);
}

void GpuForward::forward(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step, int64_t first) {
  const auto n = static_cast<int64_t>(tokens.size());
  ops_.reserve(n, n - first, step);
  ops_.upload_tokens(tokens);
  ops_.begin(n, ops_.tokens(), pos, nullptr, step);
  run_layers(cfg_, ops_);
  if (first < n) ops_.head(first);
}

std::vector<float> GpuForward::run_step(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step,
                                        LogitRows rows) {
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t first = rows == LogitRows::kNone ? n : rows == LogitRows::kLast ? n - 1 : 0;
  forward(tokens, pos, step, first);
  if (rows == LogitRows::kNone) return {};
  return ops_.download_logits(n - first);
}

std::vector<double> GpuForward::score_step(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step,
                                           std::span<const int32_t> next) {
  check(next.size() <= tokens.size(), "GPU forward: more next tokens than rows");
  forward(tokens, pos, step, 0);
  return ops_.download_logprobs(next);
}

}  // namespace tessera::runtime::gpu
