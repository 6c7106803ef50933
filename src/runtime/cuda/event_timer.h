// tessera/runtime/cuda/event_timer.h — GPU time of categories of work (GEMMs, attention, the small kernels:
// norms, RoPE, activations, the rest), by CUDA events.
//
// begin(kind) / end(kind) record a pair of events on the stream around the work; collect() waits for the last
// event and returns the summed elapsed time per kind since the previous collect(). Pairs must not nest or
// overlap on the stream. Events are pooled and reused. Disabled: every call is a no-op and collect() returns 0.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <vector>

namespace tessera::runtime::gpu {

class EventTimer {
 public:
  enum Kind {
    kGemm = 0,
    kAttention = 1,
    kNorm = 2,        // RMSNorms: before attention and MLP, Gemma-3's post-norms, the final norm
    kRope = 3,        // RoPE tables, QK-norm + RoPE of q and k
    kActivation = 4,  // the gated MLP's activation
    kMisc = 5,        // embedding, QKV bias, logit softcap
    kKinds = 6
  };

  explicit EventTimer(bool enabled = true) : enabled_(enabled) {}
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void begin(Kind kind, cudaStream_t stream);
  void end(Kind kind, cudaStream_t stream);
  // Seconds per kind of the pairs recorded since the last collect(). Synchronises with the last event.
  std::array<double, kKinds> collect();
  bool enabled() const { return enabled_; }

 private:
  cudaEvent_t event(size_t i);

  bool enabled_;
  std::vector<cudaEvent_t> pool_;
  std::vector<Kind> kinds_;  // kind of pair i (events 2i, 2i + 1)
  size_t used_ = 0;          // events recorded since the last collect
};

}  // namespace tessera::runtime::gpu
