// tessera/runtime/stream/stream_memory.h — one sequence's streaming memory as the batched engine holds it.
//
// The batched engine (runtime/batch_engine.h) asks its backend for one per streamed request
// (BatchBackend::new_stream) and hands it back in prefill_stream_chunk and in the decode rows (DecodeRow::stream):
// on the CPU it is a StreamingKV (streaming_kv.h), which holds every row; on the GPU the backend's device memory
// (runtime/cuda/batch_gpu.h: a GpuStreamingKV, whose host side decides and keeps the evicted blocks in pinned
// memory). The scheduler only needs what this says: the sequence's length, the host budget's check, the bytes held.
#pragma once

#include <cstdint>

namespace tessera::runtime {

class StreamMemory {
 public:
  virtual ~StreamMemory() = default;
  // Tokens in the sequence (the position of the next one).
  virtual int64_t sequence_length() const = 0;
  // Throws tessera::Error when a sequence of `tokens` tokens cannot fit the host store's budget (StreamingKV's
  // message).
  virtual void check_sequence(int64_t tokens) const = 0;
  // Prepares for a sequence of `tokens` tokens before its first chunk runs (the GPU memory starts allocating the
  // pinned host slabs its evicted blocks will need, in the background, as the single-sequence GPU engine always did);
  // a hint: chunks reserve what they need themselves.
  virtual void reserve(int64_t /*tokens*/) {}
  // Bytes held for the sequence: the resident rows (sinks, window, workspace), the evicted blocks in host memory,
  // the span index; on the GPU its device buffers and pinned host memory.
  virtual double memory_bytes() const = 0;
  // Empties the sequence, keeping what the next one reuses (the GPU's pinned slabs); the settings (method, the
  // environment overrides read when it was made) stay. The single-sequence engine's reset().
  virtual void reset() = 0;
};

}  // namespace tessera::runtime
