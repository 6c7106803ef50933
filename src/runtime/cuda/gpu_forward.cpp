#include "runtime/cuda/gpu_forward.h"

#include <string>

#include "core/error.h"
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

std::vector<float> GpuForward::run_step(std::span<const int32_t> tokens, int32_t pos, GpuAttentionStep& step,
                                        LogitRows rows) {
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t first = rows == LogitRows::kLast ? n - 1 : 0;
  const int64_t count = rows == LogitRows::kNone ? 0 : n - first;
  ops_.reserve(n, count, step);
  ops_.upload_tokens(tokens);
  ops_.begin(n, ops_.tokens(), pos, nullptr, step);
  run_layers(cfg_, ops_);
  if (rows == LogitRows::kNone) return {};
  ops_.head(first);
  return ops_.download_logits(count);
}

}  // namespace tessera::runtime::gpu
