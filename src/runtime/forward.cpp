#include "runtime/forward.h"

#include <algorithm>
#include <variant>

#include "attention/attention_args.h"
#include "attention/cpu/layer_attention_cpu.h"
#include "core/error.h"
#include "runtime/recipe.h"

namespace tessera::runtime {

void attend_staged_chunk(const ModelConfig& cfg, const StagedChunk& c, int32_t layer, float* q, float* out,
                         ThreadPool& pool) {
  const int32_t nq = cfg.num_q_heads, d = cfg.head_dim, kv_len = c.pos + c.n;
  attn::AttentionArgs args;
  args.q = TensorView(q, DType::F32, {c.n, nq, d});
  args.k = c.cache.k_view(layer, kv_len);
  args.v = c.cache.v_view(layer, kv_len);
  args.out = TensorView(out, DType::F32, {c.n, nq, d});
  args.scale = cfg.attention_scale;
  args.q_begin = c.pos;
  // A sliding-window layer's window is part of the model: the executors apply it on top of whatever the
  // policy's pattern keeps (a window covering every key changes nothing, so it is left out).
  const int32_t window = cfg.layers[static_cast<size_t>(layer)].sliding_window;
  if (window > 0 && window < kv_len) args.window = window;
  const bool dense = c.policy == nullptr || c.policy->table().empty();
  attn::layer_attention_cpu(args, dense ? std::vector<attn::Pattern>{} : c.policy->layer(layer), c.total_len, pool);
  if (c.observer != nullptr && *c.observer) (*c.observer)(layer, args);
}

namespace {

// A sequence's keys and values contiguous in a KVCache, attended under a sparse policy (see forward.h).
class ContiguousAttention final : public CpuAttentionStep {
 public:
  ContiguousAttention(const ModelConfig& cfg, const StagedChunk& chunk, ThreadPool& pool)
      : cfg_(cfg), chunk_(chunk), pool_(pool) {}

  // An f32 cache takes the products' K/V rows in place; a bf16/f16 cache gets them converted in attend().
  float* k_rows(int32_t layer) override { return f32_ ? chunk_.cache.k(layer, chunk_.pos) : nullptr; }
  float* v_rows(int32_t layer) override { return f32_ ? chunk_.cache.v(layer, chunk_.pos) : nullptr; }

  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    if (!f32_) chunk_.cache.write(layer, chunk_.pos, chunk_.n, k, v);
    attend_staged_chunk(cfg_, chunk_, layer, q, out, pool_);
  }

 private:
  const ModelConfig& cfg_;
  StagedChunk chunk_;
  bool f32_ = chunk_.cache.type() == KVType::F32;
  ThreadPool& pool_;
};

// A KVPolicy (streaming memory) holds the keys and values and rotates q and k itself.
class PolicyAttention final : public CpuAttentionStep {
 public:
  PolicyAttention(KVPolicy& kv, const CpuOps& ops, int32_t pos, int32_t n)
      : kv_(kv), ops_(ops), pos_(pos), n_(n) {}
  bool rotates(int32_t) const override { return true; }
  void attend(int32_t layer, float* q, float* k, float* v, float* out) override {
    kv_.attend(layer, pos_, n_, q, k, v, ops_.inv_freq(layer), ops_.config().attention_scale, out, ops_.pool());
  }

 private:
  KVPolicy& kv_;
  const CpuOps& ops_;
  int32_t pos_, n_;
};

}  // namespace

Forward::Forward(const Model& model, ThreadPool& pool)
    : Forward(model, pool, std::make_unique<CpuOps>(model.config(), model.weights(), pool)) {}

Forward::Forward(const Model& model, ThreadPool& pool, std::unique_ptr<CpuOps> ops)
    : cfg_(model.config()), pool_(pool), ops_(std::move(ops)) {
  check(ops_ != nullptr, "forward: no CPU backend");
}

std::vector<float> Forward::finish(int32_t n, LogitRows rows) {
  if (rows == LogitRows::None) return {};
  return ops_->head(rows == LogitRows::Last ? n - 1 : 0);
}

std::vector<float> Forward::run(std::span<const int32_t> tokens, int32_t pos, KVCache& cache,
                                const attn::AttentionPolicy* policy, int32_t total_len, LogitRows rows,
                                ForwardTimers& timers) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  check(cache.capacity() >= pos + n, "forward: the KV cache has no room for the chunk");
  ContiguousAttention step(cfg_, StagedChunk{cache, pos, n, policy, total_len, observer_}, pool_);
  ops_->begin(tokens, pos, {}, step, timers);
  run_layers(cfg_, *ops_);
  return finish(n, rows);
}

std::vector<float> Forward::run(std::span<const int32_t> tokens, int32_t pos, KVPolicy& kv, LogitRows rows,
                                ForwardTimers& timers) {
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return {};
  PolicyAttention step(kv, *ops_, pos, n);
  ops_->begin(tokens, pos, {}, step, timers);
  run_layers(cfg_, *ops_);
  return finish(n, rows);
}

}  // namespace tessera::runtime
