// tessera/runtime/sequence_engine.h — the single-sequence engine's API on any device (runtime/device.h opens one).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "runtime/generation.h"

namespace tessera::runtime {

class StreamingKV;

struct EngineStats {
  int64_t prefill_tokens = 0;
  double prefill_seconds = 0;
  int64_t decode_tokens = 0;
  double decode_seconds = 0;
  double attention_seconds = 0;  // within prefill and decode
  double gemm_seconds = 0;       // within prefill and decode
  double prefill_tokens_per_second() const {
    return prefill_seconds > 0 ? prefill_tokens / prefill_seconds : 0;
  }
  double decode_tokens_per_second() const { return decode_seconds > 0 ? decode_tokens / decode_seconds : 0; }
};

// Memory of one engine (the GPU's: every field; the CPU's: weights and KV cache).
struct EngineMemory {
  size_t weights_bytes = 0;
  size_t kv_cache_bytes = 0;
  size_t scratch_bytes = 0;       // the forward pass's activation buffers (attention's own buffers excluded)
  size_t peak_in_use_bytes = 0;   // most device memory in use (whole device) seen during prefill/decode
  size_t device_total_bytes = 0;
};

// The API of one sequence's inference on any device (runtime::Engine, runtime::gpu::GpuEngine): see engine.h for
// the semantics of each call.
class SequenceEngine {
 public:
  using Progress = std::function<void(int64_t done, int64_t total)>;
  using OnToken = std::function<bool(int32_t token)>;
  virtual ~SequenceEngine() = default;

  virtual std::vector<float> prefill(std::span<const int32_t> tokens, const Progress& progress = {}) = 0;
  virtual std::vector<float> decode(int32_t token) = 0;
  virtual std::vector<int32_t> generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                        const OnToken& on_token = {}) = 0;
  // The logits of every token ([tokens.size(), vocab]).
  virtual std::vector<float> forward_all_logits(std::span<const int32_t> tokens) = 0;
  // For i in [1, tokens.size()): the natural-log probability of tokens[i] after tokens[0..i) (perplexity).
  virtual std::vector<double> score(std::span<const int32_t> tokens, const Progress& progress = {}) = 0;
  virtual void reset() = 0;
  virtual int32_t position() const = 0;
  virtual int32_t max_context() const = 0;
  virtual const EngineStats& stats() const = 0;
  virtual void reset_stats() = 0;
  virtual size_t kv_cache_bytes() const = 0;
  virtual EngineMemory memory() const = 0;
  // The streaming memory's decisions, or null without streaming.
  virtual const StreamingKV* streaming() const = 0;
  // The most device memory in use since reset_peak_memory() in bytes (GPU engines); -1: not tracked (CPU).
  virtual double peak_device_bytes() const { return -1; }
  virtual void reset_peak_memory() {}
};

}  // namespace tessera::runtime
