#include "runtime/cuda/gpu_decode.h"

#include <algorithm>
#include <climits>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/paged_kv.h"
#include "runtime/recipe.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/paged_decode.h"

namespace tessera::runtime::gpu {

GpuDecode::GpuDecode(const DeviceModel& model, cudaStream_t stream, Gemm& gemm, EventTimer& timer,
                     const DeviceFp8Weights* fp8, bool graphs)
    : cfg_(model.config()), stream_(stream), use_graphs_(graphs), fp8_(fp8 != nullptr),
      ops_(model, stream, gemm, graphs ? untimed_ : timer, fp8, 1), step_(cfg_, ops_.attention_scale(), layout_) {
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  // Dense views with the model's windows (no policy), one slot.
  std::vector<int32_t> v;
  for (const DecodeView& dv : decode_views(cfg_, nullptr, 0)) {
    v.push_back(dv.sink);
    v.push_back(static_cast<int32_t>(std::min<int64_t>(dv.window, INT32_MAX)));
    v.push_back(static_cast<int32_t>(std::min<int64_t>(dv.horizon, INT32_MAX)));
  }
  views_.upload(v, stream_);
  host_step_.assign(4 + static_cast<size_t>(cfg_.num_kv_heads), 0);
  step_data_.resize(host_step_.size());
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // v is on this stack
  PagedLayout& p = layout_;
  p.per_layer_pools = true;
  p.tables = nullptr;  // the contiguous cache: no block table (paged_decode.h)
  p.views = views_.data();
  p.block_tokens = 1;
  p.row_pos = step_data_.data() + 1;
  p.row_slot = step_data_.data() + 2;
  p.row_len = step_data_.data() + 3;
  p.blocks = step_data_.data() + 4;
  p.rows = 1;
}

GpuDecode::~GpuDecode() {
  cudaStreamSynchronize(stream_);
  drop_graphs();
}

void GpuDecode::drop_graphs() noexcept {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  warmed_.clear();
}

size_t GpuDecode::scratch_bytes() const {
  return ops_.scratch_bytes() + step_data_.bytes() + o_part_.bytes() + lse_part_.bytes();
}

void GpuDecode::release() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  drop_graphs();
  ops_.release_scratch();
  o_part_ = {};
  lse_part_ = {};
  bound_k_.clear();
  bound_v_.clear();
  bound_capacity_ = 0;
}

void GpuDecode::bind_cache(DeviceKVCache& cache) {
  std::vector<bf16*> k, v;
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    k.push_back(cache.k(l, 0));
    v.push_back(cache.v(l, 0));
  }
  if (k == bound_k_ && v == bound_v_ && cache.capacity() == bound_capacity_) return;
  drop_graphs();
  bound_k_ = std::move(k);
  bound_v_ = std::move(v);
  bound_capacity_ = cache.capacity();
  layout_.k_pools = bound_k_;
  layout_.v_pools = bound_v_;
}

void GpuDecode::launch(bool logits) {
  ops_.begin(1, step_data_.data(), 0, layout_.row_pos, step_);
  run_layers(cfg_, ops_);
  if (logits) ops_.head(0);
}

std::vector<float> GpuDecode::run(int32_t token, int32_t pos, DeviceKVCache& cache, LogitRows rows) {
  check(cache.capacity() > pos, "GPU decode: the KV cache has no room for the token");
  const int32_t D = cfg_.head_dim, kvh = cfg_.num_kv_heads;
  bind_cache(cache);
  const int32_t splits = bucket_splits(paged_decode_splits(1, kvh, static_cast<int64_t>(pos) + 1, sms_));
  bool grew = ops_.reserve(1, 1, step_);
  grew |= grow(o_part_, static_cast<int64_t>(cfg_.num_q_heads) * splits * D);
  grew |= grow(lse_part_, static_cast<int64_t>(cfg_.num_q_heads) * splits);
  if (grew) drop_graphs();
  layout_.splits = splits;
  layout_.o_part = o_part_.data();
  layout_.lse_part = lse_part_.data();
  host_step_[0] = token;
  host_step_[1] = pos;
  host_step_[2] = 0;
  host_step_[3] = pos + 1;
  for (int32_t h = 0; h < kvh; ++h) host_step_[4 + static_cast<size_t>(h)] = pos * kvh + h;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(step_data_.data(), host_step_.data(), host_step_.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_));
  const bool logits = rows != LogitRows::kNone;
  const auto key = std::make_pair(splits, logits);
  const auto it = graphs_.find(key);
  if (it != graphs_.end()) {
    TESSERA_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
  } else if (!use_graphs_ || (fp8_ && warmed_.insert(key).second)) {
    launch(logits);  // eager (FP8: the first use of this key sets up cuBLASLt's plans and buffers outside a capture)
  } else {
    const cudaGraphExec_t exec = capture_graph(stream_, [&] { launch(logits); });
    graphs_.emplace(key, exec);
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  }
  if (!logits) {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {};
  }
  return ops_.download_logits(1);
}

}  // namespace tessera::runtime::gpu
