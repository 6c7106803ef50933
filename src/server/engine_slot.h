// tessera/server/engine_slot.h — a scheduler slot over today's single-sequence engines.
//
// EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions> on the CPU, and the same with the GPU
// engine (runtime/cuda/gpu_engine.h) over a DeviceModel: the slot keeps one engine (sharing the loaded weights) and
// resets it between requests, which empties the sequence and keeps the engine's KV block pool, scratch buffers and,
// with streaming memory (--stream), the pinned host slabs; a request under another attention policy gets a new
// engine (the kept one is dropped first), and so does the request after one that failed. kv_tokens / kv_bytes follow
// the engine between tokens. A cancelled or timed-out request stops
// between prefill chunks too (the engine's progress callback), so a long prompt does not hold the slot to its end.
#pragma once

#include <algorithm>
#include <memory>
#include <type_traits>
#include <utility>

#include "core/thread_pool.h"
#include "runtime/device.h"
#include "runtime/engine.h"
#include "runtime/generation.h"
#include "server/scheduler.h"

namespace tessera::server {

struct PrefillAborted {};

// The engine as runtime::generate_tokens drives it, with a prefill that asks `abort` after every chunk.
template <class EngineT>
struct Abortable {
  EngineT& engine;
  const std::function<bool()>& abort;
  std::vector<float> prefill(std::span<const int32_t> tokens) {
    return engine.prefill(tokens, [this](int64_t, int64_t) {
      if (abort && abort()) throw PrefillAborted{};
    });
  }
  std::vector<float> decode(int32_t token) { return engine.decode(token); }
  int32_t position() const { return engine.position(); }
  int32_t max_context() const { return engine.max_context(); }
};

template <class EngineT, class ModelT, class OptionsT>
class EngineSlot final : public SlotEngine {
 public:
  // `pool`, when given, is this slot's own thread pool (options.pool points at it).
  EngineSlot(const ModelT& model, OptionsT options, std::unique_ptr<ThreadPool> pool = nullptr)
      : model_(model), options_(std::move(options)), pool_(std::move(pool)) {
    if constexpr (requires { options_.pool; }) {
      if (pool_) options_.pool = pool_.get();
    }
  }

  std::vector<int32_t> generate(std::span<const int32_t> prompt, const runtime::GenerateOptions& gen,
                                const attn::AttentionPolicy& policy, const std::function<bool(int32_t)>& on_token,
                                const std::function<bool()>& abort) override {
    std::unique_ptr<EngineT> engine = take_engine(policy);
    std::vector<int32_t> out;
    try {
      Abortable<EngineT> run{*engine, abort};
      // The request's sequence is not continued, so the last token need not enter the cache (no append_last).
      out = runtime::generate_tokens(
          run, prompt, gen,
          [&](int32_t token) {
            kv_tokens_.store(engine->position(), std::memory_order_relaxed);
            kv_bytes_.store(static_cast<int64_t>(engine->kv_cache_bytes()), std::memory_order_relaxed);
            return on_token(token);
          },
          [](int32_t) {});
    } catch (const PrefillAborted&) {
      out.clear();  // reset() at the next request empties what the aborted prefill left
    } catch (...) {
      // An engine that failed is not kept (the next request makes a new one).
      kv_tokens_.store(0);
      kv_bytes_.store(0);
      throw;
    }
    kv_tokens_.store(0);
    kv_bytes_.store(0);
    engine->reset();  // the request's KV blocks go back now (on the CPU their pages too), not at the next request
    kept_ = std::move(engine);
    return out;
  }

  // The prompt's logits piece by piece (forward_all_logits continues the sequence; a piece's logits are at most
  // ~128 MB), each row reduced to token_logprobs of the next prompt token.
  std::vector<runtime::TokenLogprobs> prompt_logprobs(std::span<const int32_t> prompt, int32_t top,
                                                      const attn::AttentionPolicy& policy,
                                                      const std::function<bool()>& abort) override {
    std::unique_ptr<EngineT> engine = take_engine(policy);
    std::vector<runtime::TokenLogprobs> out;
    size_t piece = 64;  // until the vocabulary's size is known
    {
      for (size_t p0 = 0; p0 + 1 < prompt.size();) {
        if (abort && abort()) {
          out.clear();
          break;
        }
        const size_t p1 = std::min(prompt.size(), p0 + piece);
        const std::vector<float> logits = engine->forward_all_logits(prompt.subspan(p0, p1 - p0));
        const size_t vocab = logits.size() / (p1 - p0);
        for (size_t r = 0; r < p1 - p0 && p0 + r + 1 < prompt.size(); ++r)
          out.push_back(runtime::token_logprobs(std::span<const float>(logits).subspan(r * vocab, vocab),
                                                prompt[p0 + r + 1], top));
        p0 = p1;
        piece = std::clamp<size_t>((size_t{1} << 25) / std::max<size_t>(vocab, 1), 16, 2048);
      }
    }  // (an exception drops the engine: it is not kept)
    engine->reset();
    kept_ = std::move(engine);
    return out;
  }

  // Engines this slot has made: one, plus one per change of attention policy between requests and per request
  // after a failed one. (Before the engine was the batched scheduler with one sequence, the slot made one per
  // request but with streaming memory; a GPU engine now allocates its KV block pool when it is made: ~17 GB at 128K
  // for Llama-3-8B shapes, which a fresh engine per request would allocate and free every time.)
  int64_t engines_made() const { return engines_made_; }

 private:
  // The kept engine, reset, when it runs `policy` (with streaming memory every request has the slot's policy: the
  // server refuses others); otherwise a fresh engine under `policy`, the kept one dropped first (its memory freed).
  std::unique_ptr<EngineT> take_engine(const attn::AttentionPolicy& policy) {
    std::unique_ptr<EngineT> engine;
    const bool streams = [&] {
      if constexpr (requires { options_.stream.method; })
        return options_.stream.method != runtime::StreamMethod::None;
      else
        return false;
    }();
    if (kept_ && (streams || kept_policy_ == policy)) {
      engine = std::move(kept_);
      engine->reset();  // a fresh sequence; the pool, the buffers (pinned slabs on the GPU) stay
    } else {
      kept_.reset();
      OptionsT options = options_;
      options.policy = policy;
      if constexpr (std::is_same_v<ModelT, runtime::Device>)
        engine = model_.engine(options);  // the device's engine (runtime/device.h)
      else
        engine = std::make_unique<EngineT>(model_, std::move(options));
      kept_policy_ = policy;
      ++engines_made_;
    }
    return engine;
  }

  const ModelT& model_;
  OptionsT options_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<EngineT> kept_;
  attn::AttentionPolicy kept_policy_;  // the policy kept_ runs
  int64_t engines_made_ = 0;
};

// Slots of the CPU engine. One slot uses the process's thread pool; several split the cores between them (each
// its own pool of cores / slots threads, at least one), so that their parallel loops do not share one pool.
// Slots over a device's engines (runtime/device.h): on the CPU, with more than one slot, each slot gets its own
// thread pool (the global pool's threads shared out), as cpu_slot_factory.
inline SlotFactory device_slot_factory(const runtime::Device& device, runtime::EngineOptions options) {
  return [&device, options](int, int count) -> std::unique_ptr<SlotEngine> {
    using Slot = EngineSlot<runtime::SequenceEngine, runtime::Device, runtime::EngineOptions>;
    if (count == 1 || device.gpu()) return std::make_unique<Slot>(device, options);
    const int threads = std::max(1, ThreadPool::global().size() / count);
    return std::make_unique<Slot>(device, options, std::make_unique<ThreadPool>(threads));
  };
}

inline SlotFactory cpu_slot_factory(const runtime::Model& model, runtime::EngineOptions options) {
  return [&model, options](int, int count) -> std::unique_ptr<SlotEngine> {
    using Slot = EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions>;
    if (count == 1) return std::make_unique<Slot>(model, options);
    const int threads = std::max(1, ThreadPool::global().size() / count);
    return std::make_unique<Slot>(model, options, std::make_unique<ThreadPool>(threads));
  };
}

}  // namespace tessera::server
