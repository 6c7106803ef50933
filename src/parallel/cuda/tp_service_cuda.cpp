#include "parallel/cuda/tp_service_cuda.h"

#include <algorithm>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::parallel {

NcclCommandChannel::NcclCommandChannel(Collective& comm, cudaStream_t stream, int device)
    : comm_(comm), stream_(stream), device_(device) {}

void NcclCommandChannel::broadcast(std::vector<int32_t>& host) {
  TESSERA_CUDA_CHECK(cudaSetDevice(device_));
  if (buf_.size() < host.size()) buf_.resize(std::max<size_t>(host.size(), 1024));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(buf_.data(), host.data(), host.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_));
  comm_.broadcast(buf_.data(), host.size(), stream_);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(host.data(), buf_.data(), host.size() * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void NcclCommandChannel::send(const TpCommand& c) {
  const TpHeader h = encode_header(c);
  std::vector<int32_t> hv(h.begin(), h.end());
  broadcast(hv);
  std::vector<int32_t> p = encode_payload(c);
  if (!p.empty()) broadcast(p);
}

TpCommand NcclCommandChannel::receive() {
  std::vector<int32_t> hv(kTpHeaderInts, 0);
  broadcast(hv);
  TpHeader h;
  std::copy(hv.begin(), hv.end(), h.begin());
  std::vector<int32_t> p(payload_ints(h), 0);
  if (!p.empty()) broadcast(p);
  return decode_command(h, p);
}

TpRankForward::TpRankForward(TpGpuForward& forward, int device, int32_t max_context)
    : forward_(forward), device_(device) {
  forward_.reserve(max_context);
}

std::vector<float> TpRankForward::run(std::span<const int32_t> tokens, int32_t pos,
                                      const attn::AttentionPolicy* policy, int32_t total_len) {
  TESSERA_CUDA_CHECK(cudaSetDevice(device_));
  return forward_.run(tokens, pos, policy, total_len, /*last_only=*/true);
}

}  // namespace tessera::parallel
