// tests/tp_wire.h — rank 0 -> each worker rank through the tensor-parallel wire format (header, then payload), as
// the NCCL channel sends them, over in-process queues: the CPU tests' CommandChannel (parallel/tp_service.h).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "parallel/tp_service.h"

namespace tessera::parallel {

struct Wire {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::vector<int32_t>> messages;
};

class LeaderChannel final : public CommandChannel {
 public:
  explicit LeaderChannel(std::vector<Wire*> wires) : wires_(std::move(wires)) {}
  void send(const TpCommand& c) override {
    const TpHeader h = encode_header(c);
    const std::vector<int32_t> p = encode_payload(c);
    for (Wire* w : wires_) {
      std::lock_guard lock(w->m);
      w->messages.emplace_back(h.begin(), h.end());
      if (!p.empty()) w->messages.push_back(p);
      w->cv.notify_all();
    }
  }
  TpCommand receive() override { throw Error("rank 0 receives nothing"); }

 private:
  std::vector<Wire*> wires_;
};

class WorkerChannel final : public CommandChannel {
 public:
  explicit WorkerChannel(Wire& w) : w_(w) {}
  void send(const TpCommand&) override { throw Error("workers send nothing"); }
  TpCommand receive() override {
    const std::vector<int32_t> hv = pop();
    TpHeader h;
    std::copy(hv.begin(), hv.end(), h.begin());
    const size_t n = payload_ints(h);
    const std::vector<int32_t> p = n > 0 ? pop() : std::vector<int32_t>{};
    return decode_command(h, p);
  }

 private:
  std::vector<int32_t> pop() {
    std::unique_lock lock(w_.m);
    w_.cv.wait(lock, [&] { return !w_.messages.empty(); });
    std::vector<int32_t> v = std::move(w_.messages.front());
    w_.messages.pop_front();
    return v;
  }
  Wire& w_;
};

}  // namespace tessera::parallel
