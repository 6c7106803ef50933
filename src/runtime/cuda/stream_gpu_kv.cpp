#include "runtime/cuda/stream_gpu_kv.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "attention/attention_args.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/work_plan.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "cuda/cuda_check.h"
#include "runtime/stream/stream_layout.h"
#include "runtime/cuda/stream_kernels.h"

namespace tessera::runtime::gpu {

namespace {

constexpr int64_t kSlabBlocks = 256;

// Blocks evicted from every layer once a sequence holds `tokens` tokens (streaming_kv.cpp's rule).
int64_t evicted_at(const StreamOptions& o, int64_t tokens) {
  const int64_t over = tokens - o.sinks - o.local;
  return over >= o.block ? over / o.block : 0;
}

// Pinned slabs. TESSERA_STREAM_PIN=alloc: cudaHostAlloc. Default (register): anonymous memory with transparent huge
// pages, first touched by several threads (the kernel zeroes pages far faster in parallel and in 2 MB pages), then
// cudaHostRegister. Returns null when the memory cannot be had.
bool pin_with_alloc() {
  const char* v = std::getenv("TESSERA_STREAM_PIN");
  return v != nullptr && std::string(v) == "alloc";
}

void* alloc_slab(size_t bytes) {
  if (pin_with_alloc()) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return p;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  (void)madvise(p, bytes, MADV_HUGEPAGE);
  const size_t threads = 8, part = (bytes / threads + 4095) / 4096 * 4096;
  std::vector<std::thread> touch;
  for (size_t t = 0; t < threads; ++t) {
    const size_t b = t * part, e = std::min(bytes, b + part);
    if (b < e) touch.emplace_back([p, b, e] { std::memset(static_cast<char*>(p) + b, 0, e - b); });
  }
  for (std::thread& t : touch) t.join();
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    (void)cudaGetLastError();
    munmap(p, bytes);
    return nullptr;
  }
  return p;
}

void free_slab(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (pin_with_alloc()) {
    cudaFreeHost(p);
    return;
  }
  cudaHostUnregister(p);
  munmap(p, bytes);
}

void d2d(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes > 0) TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}

// Copies (pinned host <-> device) enqueued on `s`: one cudaMemcpyBatchAsync call for all of them (CUDA 12.8+; the
// sources read in stream order), or, with `batched` false or where the call is refused, one cudaMemcpyAsync each.
void copy_batch(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes, bool batched,
                cudaStream_t s) {
  if (dsts.empty()) return;
#if CUDART_VERSION >= 13000
  if (batched) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &first, 1, s) == cudaSuccess) {
      dsts.clear();
      srcs.clear();
      sizes.clear();
      return;
    }
    (void)cudaGetLastError();  // refused: the copies one by one
  }
#else
  (void)batched;
#endif
  for (size_t i = 0; i < dsts.size(); ++i)
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s));
  dsts.clear();
  srcs.clear();
  sizes.clear();
}

}  // namespace

GpuStreamingKV::GpuStreamingKV(const ModelConfig& config, StreamOptions options)
    : cfg_(config), opt_(options), host_(config, std::move(options), StreamingKV::Storage::Device) {
  check_model_streams(cfg_, true);
  row_ = static_cast<int64_t>(cfg_.num_kv_heads) * cfg_.head_dim;
  qrow_ = static_cast<int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
  fp8_ = opt_.host_fp8;
  if (fp8_)
    check(cfg_.head_dim % 8 == 0 && (static_cast<int64_t>(opt_.block) * cfg_.num_kv_heads) % 4 == 0, [&] {
      return "GPU streaming: FP8 evicted blocks need a head_dim that is a multiple of 8 and block x kv heads "
             "a multiple "
             "of 4, got head_dim " +
             std::to_string(cfg_.head_dim) + ", block " + std::to_string(opt_.block) + ", " +
             std::to_string(cfg_.num_kv_heads) + " kv heads";
    });
  block_bytes_ = fp8_ ? stream_fp8_block_bytes(opt_.block, cfg_.num_kv_heads, cfg_.head_dim)
                      : 2 * static_cast<int64_t>(opt_.block) * row_ * static_cast<int64_t>(sizeof(bf16));
  layers_.resize(static_cast<size_t>(cfg_.num_layers));
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_in_, cudaStreamNonBlocking));
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&blocks_in_, cudaEventDisableTiming));
  for (LayerState& L : layers_) TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&L.evicted, cudaEventDisableTiming));
  const char* where = std::getenv("TESSERA_STREAM_DECISIONS");
  device_decisions_ = where == nullptr || std::string(where) != "host";
  if (host_.needs_qk()) decider_ = std::make_unique<StreamDecider>(cfg_);
  const char* win = std::getenv("TESSERA_STREAM_WINDOW");
  window_kept_ = opt_.method == StreamMethod::StreamingLLM && (win == nullptr || std::string(win) != "copy");
  // The decisions' stream at the highest priority: its small kernels are the host's critical path (three round trips
  // per layer and chunk), so the local pass beside them must not hold them back.
  int least = 0, greatest = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TESSERA_CUDA_CHECK(cudaStreamCreateWithPriority(&decide_, cudaStreamNonBlocking, greatest));
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&decided_, cudaEventDisableTiming));
  const char* ov = std::getenv("TESSERA_STREAM_OVERLAP");
  overlap_ = ov != nullptr && std::string(ov) == "1";
  if (const char* at = std::getenv("TESSERA_STREAM_LOCAL_AT")) {
    const std::string a = at;
    check(a == "after" || a == "candidates" || a == "masses" || a == "scores", [&] {
      return "TESSERA_STREAM_LOCAL_AT must be after, candidates, masses or scores, got '" + a + "'";
    });
    local_at_ = a == "candidates" ? LocalAt::Candidates
                : a == "masses"   ? LocalAt::Masses
                : a == "scores"   ? LocalAt::Scores
                                  : LocalAt::After;
  }
  const char* slots = std::getenv("TESSERA_STREAM_CACHE");
  const int64_t factor = slots != nullptr ? std::atoll(slots) : kCacheFactor;
  check(factor >= 1 && factor <= 64, [&] {
    return "TESSERA_STREAM_CACHE must be 1 to 64 (block cache slots per retrieved block), got '" +
           std::string(slots != nullptr ? slots : "") + "'";
  });
  cache_slots_ = std::max<int64_t>(opt_.top_k, 1) * factor;
  const char* split = std::getenv("TESSERA_STREAM_COPY_IN");
  split_copies_ = split == nullptr || std::string(split) != "0";
  const char* copies = std::getenv("TESSERA_STREAM_COPIES");
  batched_copies_ = copies == nullptr || std::string(copies) != "each";
  const char* prof = std::getenv("TESSERA_STREAM_PROFILE");
  profile_ = prof != nullptr && std::string(prof) == "1";
  if (decider_) decider_->profile(profile_);
}

void GpuStreamingKV::prof_mark(cudaStream_t s) {
  if (!profile_) return;
  if (prof_used_ == prof_events_.size()) {
    prof_events_.push_back(nullptr);
    TESSERA_CUDA_CHECK(cudaEventCreate(&prof_events_.back()));
  }
  TESSERA_CUDA_CHECK(cudaEventRecord(prof_events_[prof_used_++], s));
}

void GpuStreamingKV::collect_profile() {
  if (decider_) {  // (summed by the decider at its synchronisations)
    stats_.decide = decider_->profile_stats();
  }
  if (prof_used_ == 0) return;
  TESSERA_CUDA_CHECK(cudaEventSynchronize(prof_events_[prof_used_ - 1]));
  double* sums[5] = {&stats_.workspace_gpu_seconds, &stats_.local_gpu_seconds, &stats_.copy_wait_gpu_seconds,
                     &stats_.global_gpu_seconds, &stats_.store_gpu_seconds};
  for (size_t c = 0; c + 6 <= prof_used_; c += 6)
    for (size_t i = 0; i < 5; ++i) {
      float ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, prof_events_[c + i], prof_events_[c + i + 1]));
      *sums[i] += ms / 1e3;
    }
  prof_used_ = 0;
}

GpuStreamingKV::~GpuStreamingKV() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reserver_.joinable()) reserver_.join();
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  if (copy_in_ != nullptr) cudaStreamSynchronize(copy_in_);
  for (cudaEvent_t e : prof_events_) cudaEventDestroy(e);
  for (LayerState& L : layers_)
    if (L.evicted != nullptr) cudaEventDestroy(L.evicted);
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (blocks_in_ != nullptr) cudaEventDestroy(blocks_in_);
  if (decided_ != nullptr) cudaEventDestroy(decided_);
  if (decide_ != nullptr) {
    cudaStreamSynchronize(decide_);
    cudaStreamDestroy(decide_);
  }
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  if (copy_in_ != nullptr) cudaStreamDestroy(copy_in_);
  const auto slab_bytes = static_cast<size_t>(kSlabBlocks * block_bytes_);
  for (uint8_t* p : slabs_) free_slab(p, slab_bytes);
  for (uint8_t* p : ready_slabs_) free_slab(p, slab_bytes);
}

size_t GpuStreamingKV::device_bytes() const {
  size_t b = ws_k_.bytes() + ws_v_.bytes() + q_local_.bytes() + q_global_.bytes() + out_global_.bytes() +
             lse_local_.bytes() + lse_global_.bytes();
  for (const LayerState& L : layers_)
    b += L.sink_k.bytes() + L.sink_v.bytes() + L.ring_k.bytes() + L.ring_v.bytes() + L.cache_k.bytes() +
         L.cache_v.bytes() + L.cache_fp8.bytes() + L.win_k.bytes() + L.win_v.bytes();
  return b + evict_stage_.bytes() + (decider_ ? decider_->device_bytes() : 0);
}

void GpuStreamingKV::ensure_device(int32_t n) {
  const int32_t B = opt_.block;
  if (max_chunk_ == 0) {
    max_chunk_ = std::max(opt_.chunk, n);
    ring_rows_ = ((opt_.local + B + max_chunk_ + B - 1) / B) * B + B;
    for (int32_t l = 0; l < cfg_.num_layers; ++l) {
      LayerState& L = layers_[static_cast<size_t>(l)];
      if (host_.windowed(l)) {  // its window and a chunk, twice over (attend_sliding() moves it to the front)
        const int32_t window = cfg_.layers[static_cast<size_t>(l)].sliding_window;
        L.win_k.resize(static_cast<size_t>((2 * static_cast<int64_t>(window - 1) + max_chunk_) * row_));
        L.win_v.resize(L.win_k.size());
        L.win_origin = 0;
        continue;
      }
      L.sink_k.resize(static_cast<size_t>(std::max(opt_.sinks, 1) * row_));
      L.sink_v.resize(L.sink_k.size());
      L.ring_k.resize(static_cast<size_t>(ring_rows_ * row_));
      L.ring_v.resize(L.ring_k.size());
      if (fp8_) {  // the retrieved blocks stay FP8 on the device; stream_dequantize_blocks fills the workspace
        L.cache_fp8.resize(static_cast<size_t>(cache_slots_ * block_bytes_));
      } else {
        L.cache_k.resize(static_cast<size_t>(cache_slots_ * B * row_));
        L.cache_v.resize(L.cache_k.size());
      }
      L.cache_block.assign(static_cast<size_t>(cache_slots_), -1);
      L.cache_used.assign(static_cast<size_t>(cache_slots_), -1);
    }
    // FP8: the blocks a layer evicts in one chunk, quantized here before their copy to the host (one buffer for all
    // layers: the copy stream runs a layer's quantization after the previous layer's copies out of it).
    if (fp8_) evict_stage_.resize(static_cast<size_t>((max_chunk_ / B + 2) * block_bytes_));
    if (window_kept_) {
      win_rows_ = opt_.sinks + 2 * static_cast<int64_t>(opt_.local + B) + max_chunk_;
      for (int32_t l = 0; l < cfg_.num_layers; ++l) {
        if (host_.windowed(l)) continue;
        LayerState& L = layers_[static_cast<size_t>(l)];
        L.win_k.resize(static_cast<size_t>(win_rows_ * row_));
        L.win_v.resize(L.win_k.size());
        L.win_origin = 0;
      }
    }
  }
  check(n <= max_chunk_, [&] {
    return "GPU streaming: a chunk of " + std::to_string(n) + " tokens, over the " +
           std::to_string(max_chunk_) + " the buffers were sized for";
  });
  const int64_t ws_rows = opt_.attended_tokens() + max_chunk_ + B;
  if (ws_k_.size() < static_cast<size_t>(ws_rows * row_)) {
    ws_k_.resize(static_cast<size_t>(ws_rows * row_));
    ws_v_.resize(ws_k_.size());
    q_local_.resize(static_cast<size_t>(max_chunk_ * qrow_));
    q_global_.resize(q_local_.size());
    out_global_.resize(q_local_.size());
    lse_local_.resize(static_cast<size_t>(max_chunk_) * static_cast<size_t>(cfg_.num_q_heads));
    lse_global_.resize(lse_local_.size());
    stage_.reset(static_cast<size_t>(max_chunk_ * (qrow_ + row_)));
  }
}

void GpuStreamingKV::reserve(int64_t tokens) {
  if (!host_.keeps_evicted()) return;  // streamingllm drops its evicted blocks: no pinned memory
  const int64_t blocks = evicted_at(opt_, tokens) * host_.global_layers();  // (sliding-window layers evict nothing)
  const int64_t slabs = (blocks + kSlabBlocks - 1) / kSlabBlocks;
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  std::unique_lock<std::mutex> lock(mu_);
  if (slabs <= static_cast<int64_t>(slabs_.size()) + want_slabs_) return;
  want_slabs_ = slabs - static_cast<int64_t>(slabs_.size());
  if (reserver_.joinable()) {
    lock.unlock();
    reserver_.join();
    lock.lock();
  }
  reserver_ = std::thread([this, device] {
    if (cudaSetDevice(device) != cudaSuccess) return;
    const auto bytes = static_cast<size_t>(kSlabBlocks * block_bytes_);
    for (;;) {
      {
        std::lock_guard<std::mutex> g(mu_);
        if (stop_ || made_slabs_ >= want_slabs_) return;
      }
      const auto t0 = Clock::now();
      void* p = alloc_slab(bytes);
      std::lock_guard<std::mutex> g(mu_);
      stats_.pin_seconds += seconds_since(t0);
      if (p == nullptr) {
        reserve_error_ = "no pinned memory";
        want_slabs_ = made_slabs_;
        cv_.notify_all();
        return;
      }
      ready_slabs_.push_back(static_cast<uint8_t*>(p));
      ++made_slabs_;
      cv_.notify_all();
    }
  });
}

void GpuStreamingKV::wait_reserved() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return made_slabs_ >= want_slabs_ || stop_; });
}

uint8_t* GpuStreamingKV::pinned_block() {
  if (slabs_.empty() || slab_used_ == kSlabBlocks) {
    uint8_t* slab = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !ready_slabs_.empty() || made_slabs_ >= want_slabs_ || stop_; });
      if (!ready_slabs_.empty()) {
        slab = ready_slabs_.front();
        ready_slabs_.erase(ready_slabs_.begin());
        --made_slabs_;
        --want_slabs_;
      }
    }
    const auto bytes = static_cast<size_t>(kSlabBlocks * block_bytes_);
    if (slab == nullptr) {
      const auto t0 = Clock::now();
      void* p = alloc_slab(bytes);
      stats_.pin_seconds += seconds_since(t0);
      if (p == nullptr)
        throw Error("streaming: out of pinned host memory allocating " + format_bytes(static_cast<double>(bytes)) +
                    " for evicted KV blocks (" + std::to_string(slabs_.size()) + " slabs of it held); lower "
                    "--stream-host-budget or shorten the prompt");
      slab = static_cast<uint8_t*>(p);
    }
    slabs_.push_back(slab);
    slab_used_ = 0;
    stats_.pinned_bytes += static_cast<int64_t>(bytes);
  }
  return slabs_.back() + (slab_used_++) * block_bytes_;
}

GpuStreamingKV::Indexes& GpuStreamingKV::indexes(const stream::StreamLayout& lay, int32_t tile, cudaStream_t s) {
  const auto key = std::make_tuple(lay.global, lay.local, lay.chunk, tile);
  auto it = index_cache_.find(key);
  if (it != index_cache_.end()) return it->second;
  if (index_cache_.size() > 1024) {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
    index_cache_.clear();
  }
  Indexes& ix = index_cache_[key];
  stream::StreamIndexes host = stream::lower_stream_layout(lay, cfg_.num_q_heads, tile);
  ix.host_global = std::move(host.global);
  ix.host_local = std::move(host.local);
  ix.local = attn::gpu::DeviceSparseIndex::upload(ix.host_local, s);
  ix.local_plan = attn::gpu::DeviceWorkPlan::upload(attn::gpu::plan_prefill(ix.host_local), s);
  if (lay.global > 0) {
    ix.global = attn::gpu::DeviceSparseIndex::upload(ix.host_global, s);
    ix.global_plan = attn::gpu::DeviceWorkPlan::upload(attn::gpu::plan_prefill(ix.host_global), s);
  }
  return ix;
}

void GpuStreamingKV::copy_to_ring(attn::gpu::DeviceBuffer<bf16>& ring, int32_t p, int32_t rows, const bf16* src,
                                  cudaStream_t s) {
  const int32_t slot = (p - opt_.sinks) % ring_rows_;
  const int32_t first = std::min(rows, ring_rows_ - slot);
  d2d(ring.data() + slot * row_, src, static_cast<size_t>(first * row_) * sizeof(bf16), s);
  if (rows > first) d2d(ring.data(), src + first * row_, static_cast<size_t>((rows - first) * row_) * sizeof(bf16), s);
}

// The local pass over the workspace [global | local | chunk] (wk, wv: lay.kv_len() rows): the queries rotated at their
// true positions, the local index, into `out` and lse_local_. Returns its arguments for global_pass().
attn::AttentionArgs GpuStreamingKV::local_pass(const stream::StreamLayout& lay, Indexes& ix, int32_t n, bf16* q_rot,
                                               bf16* wk, bf16* wv, float scale, bf16* out, cudaStream_t s,
                                               int32_t window) {
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim, kv_len = lay.kv_len();
  attn::AttentionArgs a;
  a.q = TensorView(q_rot, DType::BF16, {n, nq, d});
  a.k = TensorView(wk, DType::BF16, {kv_len, nkv, d});
  a.v = TensorView(wv, DType::BF16, {kv_len, nkv, d});
  a.out = TensorView(out, DType::BF16, {n, nq, d});
  a.lse = TensorView(lse_local_.data(), DType::F32, {nq, n});
  a.scale = scale;
  a.q_begin = lay.global + lay.local;
  a.window = window;
  attn::gpu::sparse_prefill(a, ix.local, ix.local_plan, s);
  return a;
}

// The global pass over the same workspace with q_global_ (the caller rotated it at position `local`), into
// out_global_ / lse_global_, merged into `out` by the two passes' log-sum-exps.
void GpuStreamingKV::global_pass(const attn::AttentionArgs& local, Indexes& ix, int32_t n, bf16* out,
                                 cudaStream_t s) {
  const int32_t nq = cfg_.num_q_heads, d = cfg_.head_dim;
  attn::AttentionArgs g = local;
  g.q = TensorView(q_global_.data(), DType::BF16, {n, nq, d});
  g.out = TensorView(out_global_.data(), DType::BF16, {n, nq, d});
  g.lse = TensorView(lse_global_.data(), DType::F32, {nq, n});
  attn::gpu::sparse_prefill(g, ix.global, ix.global_plan, s);
  stream_merge_lse(out, out_global_.data(), lse_local_.data(), lse_global_.data(), n, nq, d, s);
}

void GpuStreamingKV::attend(int32_t layer, int32_t pos, int32_t n, bf16* q, bf16* k, bf16* v, const float* inv_freq,
                            std::span<const float> inv_freq_host, float scale, bf16* out, cudaStream_t s) {
  ensure_device(n);
  if (host_.windowed(layer)) {  // a sliding-window layer: its own window only (no decisions, no eviction)
    if (record_) record_data_ = {};
    const auto tw = Clock::now();
    const stream::StreamLayout lay = host_.plan(layer, pos, n, nullptr, nullptr, inv_freq_host, scale);
    stats_.decision_seconds += seconds_since(tw);
    attend_sliding(layer, pos, n, lay, q, k, v, inv_freq, scale, out, s);
    return;
  }
  LayerState& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim, B = opt_.block;
  const size_t row_bytes = static_cast<size_t>(row_) * sizeof(bf16);

  // Steps 4 and 5's local pass (below) for a layout `lay` after E evictions: the workspace's local part and chunk
  // (rows [lay.global, ...)), rotated at their true positions; the queries; the local index's pass into `out`.
  // (profile: the host gaps after each result, GpuStreamStats::host_gap_seconds; gap: the last result, -1 none)
  Clock::time_point back{};
  int gap = -1;
  attn::AttentionArgs a_local;
  Indexes* ixp = nullptr;
  bool local_done = false;
  auto local_first = [&](const stream::StreamLayout& lay_local, int32_t E) {
    if (profile_ && gap == 2) stats_.host_gap_seconds[2] += seconds_since(back);
    prof_mark(s);
    const int32_t local_begin = E > 0 ? opt_.sinks + E * B : 0;
    const int32_t G = lay_local.global;
    bf16* wk = ws_k_.data();
    bf16* wv = ws_v_.data();
    {
      // K: the sinks (before the first eviction), the ring's one or two pieces, the chunk, rotated on their way into
      // the workspace at consecutive positions from local_begin (one launch); V: copied as they are.
      StreamRopeJobs kj;
      int64_t at = G;  // rows
      int32_t p = local_begin;
      auto piece = [&](const bf16* src_k, const bf16* src_v, int32_t rows) {
        kj.add(wk + at * row_, src_k, rows, local_begin + (at - G), 1);
        d2d(wv + at * row_, src_v, static_cast<size_t>(rows) * row_bytes, s);
        at += rows;
      };
      if (E == 0) {  // the sinks are local too
        const int32_t sinks = std::min(pos, opt_.sinks);
        piece(L.sink_k.data(), L.sink_v.data(), sinks);
        p = sinks;
      }
      if (pos > p) {
        const int32_t slot = (p - opt_.sinks) % ring_rows_, rows = pos - p;
        const int32_t first = std::min(rows, ring_rows_ - slot);
        piece(L.ring_k.data() + slot * row_, L.ring_v.data() + slot * row_, first);
        if (rows > first) piece(L.ring_k.data(), L.ring_v.data(), rows - first);
      }
      check(at == G + lay_local.local, [&] {
        return "GPU streaming: the local window holds " + std::to_string(at - G) + " rows, the layout " +
               std::to_string(lay_local.local);
      });
      piece(k, v, n);
      stream_rope_copy(kj, row_, nkv, d, inv_freq, s);
      // The queries: at their positions for the local pass; all at position `local` for the global pass (when the
      // layout has a global part), both from q in one launch.
      StreamRopeJobs qj;
      qj.add(q_local_.data(), q, n, pos, 1);
      if (G > 0) qj.add(q_global_.data(), q, n, opt_.local, 0);
      stream_rope_copy(qj, qrow_, nq, d, inv_freq, s);
    }

    // 5. Attention: the local index now (overlapping the block copies), then the global one, merged.
    prof_mark(s);
    ixp = &indexes(lay_local, n <= 64 ? 64 : 128, s);
    a_local = local_pass(lay_local, *ixp, n, q_local_.data(), wk, wv, scale, out, s);
    prof_mark(s);
    local_done = true;
  };

  // The ring rows the evictions copy out and the cache slots the retrieved blocks replace were last written / read by
  // work already on the compute stream: the copy stream waits for this point (not for this layer's own work).
  TESSERA_CUDA_CHECK(cudaEventRecord(ready_, s));

  // 1. The decisions: the CPU class's, with the map, votes and block scores from the device (or, with
  // device_decisions(false), all on the host from f32 copies of q and k).
  const auto t0 = Clock::now();
  stream::StreamLayout lay;
  // (A voted-only layer, Ltri with retrieval heads, maps nothing and scores nothing: its blocks are the votes.)
  const bool maps = host_.maps_chunk(layer);
  // Overlap (overlap_decisions(), TESSERA_STREAM_OVERLAP=1; off by default: measured slower, docs/streaming.md): a
  // prefill chunk's device decisions run on a second stream (decide_) while the compute stream builds the workspace's
  // local part and runs the local pass, which read no decision: the layout's sizes follow from pos alone (E
  // evictions; min(top_k, E) retrieved blocks), checked after the decisions.
  const bool overlap = overlap_ && maps && device_decisions_ && chunk_kind_ != StreamingKV::ChunkKind::Decode;
  const int32_t E_pred = evicted_at(opt_, pos);
  stream::StreamLayout pred;
  pred.global = E_pred > 0 ? std::min(pos, opt_.sinks) + std::min(opt_.top_k, E_pred) * B : 0;
  pred.local = E_pred > 0 ? pos - (opt_.sinks + E_pred * B) : pos;
  pred.chunk = n;
  // local_at(): the local pass queued just before the host waits for one of the decisions' results (one stream).
  const LocalAt early_at = !overlap && maps && device_decisions_ && chunk_kind_ != StreamingKV::ChunkKind::Decode
                               ? local_at_
                               : LocalAt::After;
  auto local_before_wait = [&](LocalAt at) {
    if (early_at == at && !local_done) decider_->before_next_wait([&] { local_first(pred, E_pred); });
  };
  cudaStream_t ds = s;  // the decisions' stream
  if (overlap) {
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(decide_, ready_, 0));  // q, k and the ring written
    ds = decide_;
  }
  if (record_ && !maps) record_data_ = {};
  if (maps && device_decisions_) {
    // The map, votes and (ltri, linear variant) span candidates on the device; nothing waits until the evictions'
    // index keys (gathered from the ring) or the votes are needed. The host gets no q and no K.
    const bool ltri = opt_.method == StreamMethod::Ltri;
    const bool cands = ltri && opt_.linear_nms;
    auto td = Clock::now();
    decider_->launch_chunk(q, k, n, pos, inv_freq, scale, (ltri && !cands) || record_, cands, opt_.theta_quantile, ds,
                           host_.map_head(layer));
    stats_.decision_device_seconds += seconds_since(td);
    if (record_) record_data_ = {};
    StreamingKV::DeviceDecisions given;
    if (ltri && !cands) given.map = decider_->map();
    given.votes = decider_->votes();
    given.has_candidates = cands;
    given.ready = [&] {
      const auto tw = Clock::now();
      local_before_wait(LocalAt::Candidates);
      decider_->wait(ds);
      stats_.decision_device_seconds += seconds_since(tw);
      back = Clock::now();
      gap = 0;
      given.candidates = decider_->candidates();
      if (record_) {
        record_data_.map.assign(decider_->map().begin(), decider_->map().end());
        record_data_.votes.assign(decider_->votes().begin(), decider_->votes().end());
        record_data_.candidates.assign(decider_->candidates().begin(), decider_->candidates().end());
        record_data_.theta = decider_->theta();
      }
    };
    given.keys_on_device = ltri;  // Ltri's keys go from the ring to its index mirror; InfLLM's come back (4 a block)
    given.index_keys = [&](std::span<const int32_t> positions) {
      const auto tk = Clock::now();
      std::vector<float> keys;
      if (ltri)
        decider_->append_index_keys(layer, L.ring_k.data(), ring_rows_, opt_.sinks, positions,
                                    host_.span_index(layer).kv_head_begin(), host_.span_index(layer).kv_heads_kept(), ds);
      else
        keys = decider_->gather_keys(L.ring_k.data(), ring_rows_, opt_.sinks, positions, ds);
      stats_.decision_device_seconds += seconds_since(tk);
      if (record_) {
        record_data_.key_positions.assign(positions.begin(), positions.end());
        record_data_.keys = keys;
      }
      return keys;
    };
    given.span_masses = [&](std::span<const stream::Span> spans) {
      const auto tm = Clock::now();
      if (profile_ && gap == 0) stats_.host_gap_seconds[0] += std::chrono::duration<double>(tm - back).count();
      local_before_wait(LocalAt::Masses);
      std::vector<stream::SpanMasses> masses = decider_->span_masses(spans, ds);
      stats_.decision_device_seconds += seconds_since(tm);
      back = Clock::now();
      gap = 1;
      if (record_) {
        record_data_.mass_spans.assign(spans.begin(), spans.end());
        record_data_.masses = masses;
      }
      return masses;
    };
    given.block_scores = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts,
                             const stream::HeadWeights& w) {
      const auto ts = Clock::now();
      if (profile_ && gap >= 0 && gap < 2) stats_.host_gap_seconds[gap] += std::chrono::duration<double>(ts - back).count();
      local_before_wait(LocalAt::Scores);
      std::vector<double> scores;
      if (ltri)
        scores = decider_->ltri_scores(layer, host_.span_index(layer), q, tokens, counts, w, ds);
      else  // InfLLM: the mean query and the blocks' scores on the device (exactly the host's arithmetic)
        scores = decider_->infllm_scores(layer, host_.repr_index(layer), q, n, w, ds);
      stats_.decision_device_seconds += seconds_since(ts);
      back = Clock::now();
      gap = 2;
      if (record_) {
        record_data_.tokens.assign(tokens.begin(), tokens.end());
        record_data_.counts.assign(counts.begin(), counts.end());
        record_data_.scores = scores;
      }
      return scores;
    };
    if (overlap) local_first(pred, E_pred);  // on the compute stream while the decisions run on decide_
    try {
      lay = host_.plan(layer, pos, n, nullptr, inv_freq_host, given);
    } catch (...) {
      decider_->before_next_wait(nullptr);
      decider_->wait(ds);
      throw;
    }
    decider_->before_next_wait(nullptr);  // (a hook whose result was never waited for: the local pass comes below)
    decider_->wait(ds);  // (a no-op: plan() waited)
    if (overlap) {  // the compute stream's later work (the chunk into the ring, q reused) after the decisions' reads
      TESSERA_CUDA_CHECK(cudaEventRecord(decided_, ds));
      TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s, decided_, 0));
    }
    if (local_done) {  // the local pass ran on the layout predicted from the position
      check(lay.global == pred.global && lay.local == pred.local && lay.chunk == pred.chunk, [&] {
        return "GPU streaming: internal: the layout [" + std::to_string(lay.global) + " | " +
               std::to_string(lay.local) + " | " + std::to_string(lay.chunk) +
               "] differs from the one the local pass ran on [" + std::to_string(pred.global) + " | " +
               std::to_string(pred.local) + " | " + std::to_string(pred.chunk) + "]";
      });
    }
  } else if (maps) {
    bf16* hq = stage_.data();
    bf16* hk = stage_.data() + n * qrow_;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(hq, q, static_cast<size_t>(n * qrow_) * sizeof(bf16), cudaMemcpyDeviceToHost, s));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(hk, k, static_cast<size_t>(n) * row_bytes, cudaMemcpyDeviceToHost, s));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
    qf_.resize(static_cast<size_t>(n * qrow_));
    kf_.resize(static_cast<size_t>(n * row_));
    for (size_t i = 0; i < qf_.size(); ++i) qf_[i] = bf16_to_f32(hq[i]);
    for (size_t i = 0; i < kf_.size(); ++i) kf_[i] = bf16_to_f32(hk[i]);
    lay = host_.plan(layer, pos, n, qf_.data(), kf_.data(), inv_freq_host, scale, &pool_);
  } else {
    lay = host_.plan(layer, pos, n, nullptr, nullptr, inv_freq_host, scale);
  }
  stats_.decision_seconds += seconds_since(t0);

  // 2. Evicted blocks: out of the ring into pinned host memory, on the copy stream once the ring rows are written
  // (streamingllm never retrieves them: they are dropped, their ring rows simply overwritten).
  const int32_t e0 = host_.evicted_before(), e1 = host_.evicted_blocks();
  if (e1 > e0 && host_.keeps_evicted()) {
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(copy_, ready_, 0));
    const size_t bytes = static_cast<size_t>(B) * row_bytes;  // bf16: K, then V
    if (fp8_)
      check(static_cast<int64_t>(e1 - e0) * block_bytes_ <= static_cast<int64_t>(evict_stage_.size()),
            "GPU streaming: more blocks evicted in one chunk than the FP8 staging holds");
    // FP8: quantized on the copy stream (all of the chunk's blocks in one launch per StreamFp8Evictions::kMax), then
    // each whole block (codes and scales) to the host.
    StreamFp8Evictions q8;
    auto quantize = [&] {
      stream_quantize_blocks(q8, B, cfg_.num_kv_heads, cfg_.head_dim, copy_);
      q8.count = 0;
    };
    for (int32_t b = e0; b < e1; ++b) {
      check(static_cast<int32_t>(L.host_k.size()) == b, "GPU streaming: blocks evicted out of order");
      uint8_t* dst = pinned_block();
      const int32_t slot = (b * B) % ring_rows_;
      if (fp8_) {
        uint8_t* staged = evict_stage_.data() + static_cast<int64_t>(b - e0) * block_bytes_;
        if (q8.count == StreamFp8Evictions::kMax) quantize();
        q8.k[q8.count] = L.ring_k.data() + slot * row_;
        q8.v[q8.count] = L.ring_v.data() + slot * row_;
        q8.dst[q8.count++] = staged;
        batch_dst_.push_back(dst);
        batch_src_.push_back(staged);
        batch_bytes_.push_back(static_cast<size_t>(block_bytes_));
        L.host_k.push_back(dst);
        L.host_v.push_back(dst);
      } else {
        for (int kv = 0; kv < 2; ++kv) {
          batch_dst_.push_back(dst + kv * bytes);
          batch_src_.push_back((kv == 0 ? L.ring_k.data() : L.ring_v.data()) + slot * row_);
          batch_bytes_.push_back(bytes);
        }
        L.host_k.push_back(dst);
        L.host_v.push_back(dst + bytes);
      }
      ++stats_.blocks_to_host;
    }
    if (q8.count > 0) quantize();
    copy_batch(batch_dst_, batch_src_, batch_bytes_, batched_copies_, copy_);
    TESSERA_CUDA_CHECK(cudaEventRecord(L.evicted, copy_));
  }

  // 3. Retrieved blocks not in the layer's cache: host-to-device on the copy stream (after the evictions above, and
  // after the compute stream's last reads of the slots they replace).
  const std::vector<int32_t>& R = host_.retrieved(layer);
  std::vector<int32_t> slot_of(R.size(), -1);
  bool copies = false, waited_evicted = false;
  // The copies in: on copy_ behind the evictions' copies out (the default), or on their own stream
  // (split_copies_).
  cudaStream_t cin = split_copies_ ? copy_in_ : copy_;
  if (lay.global > 0 && !R.empty()) {
    check(R.size() <= L.cache_block.size(), "GPU streaming: more retrieved blocks than cache slots");
    std::vector<bool> keep(L.cache_block.size(), false);
    for (size_t i = 0; i < R.size(); ++i)
      for (size_t c = 0; c < L.cache_block.size(); ++c)
        if (L.cache_block[c] == R[i]) {
          slot_of[i] = static_cast<int32_t>(c);
          keep[c] = true;
        }
    ++cache_clock_;
    for (size_t i = 0; i < R.size(); ++i) {
      if (slot_of[i] >= 0) {
        ++stats_.blocks_cached;
        L.cache_used[static_cast<size_t>(slot_of[i])] = cache_clock_;
        continue;
      }
      // The least recently used slot this retrieval does not read (empty slots first: used -1).
      size_t free_slot = L.cache_block.size();
      for (size_t c = 0; c < L.cache_block.size(); ++c)
        if (!keep[c] && (free_slot == L.cache_block.size() || L.cache_used[c] < L.cache_used[free_slot])) free_slot = c;
      keep[free_slot] = true;
      L.cache_used[free_slot] = cache_clock_;
      slot_of[i] = static_cast<int32_t>(free_slot);
      L.cache_block[free_slot] = R[i];
      if (!copies) {
        TESSERA_CUDA_CHECK(cudaStreamWaitEvent(cin, ready_, 0));
        copies = true;
      }
      // (A block this chunk evicted: its copy out, on copy_, first. Earlier chunks' were waited for before
      // ready_.)
      if (cin != copy_ && !waited_evicted && R[i] >= e0) {
        TESSERA_CUDA_CHECK(cudaStreamWaitEvent(cin, L.evicted, 0));
        waited_evicted = true;
      }
      if (fp8_) {
        batch_dst_.push_back(L.cache_fp8.data() + static_cast<int64_t>(free_slot) * block_bytes_);
        batch_src_.push_back(L.host_k[static_cast<size_t>(R[i])]);
        batch_bytes_.push_back(static_cast<size_t>(block_bytes_));
      } else {
        const size_t bytes = static_cast<size_t>(B) * row_bytes;
        const int64_t at = static_cast<int64_t>(free_slot) * B * row_;
        batch_dst_.push_back(L.cache_k.data() + at);
        batch_src_.push_back(L.host_k[static_cast<size_t>(R[i])]);
        batch_bytes_.push_back(bytes);
        batch_dst_.push_back(L.cache_v.data() + at);
        batch_src_.push_back(L.host_v[static_cast<size_t>(R[i])]);
        batch_bytes_.push_back(bytes);
      }
      ++stats_.blocks_to_device;
    }
    copy_batch(batch_dst_, batch_src_, batch_bytes_, batched_copies_, cin);
    if (copies) TESSERA_CUDA_CHECK(cudaEventRecord(blocks_in_, cin));
  }

  // streamingllm past its first eviction: the window kept rotated in place (attend_window()).
  if (window_kept_ && e1 > 0) {
    attend_window(layer, pos, n, lay, q, k, v, inv_freq, scale, out, s);
    return;
  }

  // 4. The workspace's local part and chunk, rotated at their true positions; the queries; 5. the local pass (with
  // overlap: done above, while the decisions ran).
  const int32_t G = lay.global;
  bf16* wk = ws_k_.data();
  bf16* wv = ws_v_.data();
  if (!local_done) local_first(lay, e1);
  const attn::AttentionArgs a = a_local;
  Indexes& ix = *ixp;
  if (G > 0 && copies) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s, blocks_in_, 0));
  prof_mark(s);  // (the wait for the retrieved blocks' copies, timed apart)
  if (G > 0) {
    const int32_t sinks = std::min(pos, opt_.sinks);
    if (fp8_) {  // the sinks as they are, the retrieved blocks dequantized out of the FP8 cache
      d2d(wk, L.sink_k.data(), static_cast<size_t>(sinks) * row_bytes, s);
      d2d(wv, L.sink_v.data(), static_cast<size_t>(sinks) * row_bytes, s);
      for (size_t first = 0; first < R.size(); first += StreamFp8Blocks::kMax) {
        StreamFp8Blocks c;
        for (size_t i = first; i < R.size() && c.count < StreamFp8Blocks::kMax; ++i, ++c.count) {
          c.src[c.count] = L.cache_fp8.data() + static_cast<int64_t>(slot_of[i]) * block_bytes_;
          c.dst_row[c.count] = sinks + static_cast<int32_t>(i) * B;
        }
        stream_dequantize_blocks(wk, wv, B, cfg_.num_kv_heads, cfg_.head_dim, c, s);
      }
    } else if (batched_copies_ && R.size() + 1 <= static_cast<size_t>(StreamRowCopies::kMax)) {
      // The sinks and every retrieved block in one launch (two cudaMemcpyAsync calls per block otherwise).
      StreamRowCopies c;
      c.src_k[0] = L.sink_k.data();
      c.src_v[0] = L.sink_v.data();
      c.dst_row[0] = 0;
      c.rows[0] = sinks;
      for (size_t i = 0; i < R.size(); ++i) {
        const int64_t src = static_cast<int64_t>(slot_of[i]) * B * row_;
        c.src_k[i + 1] = L.cache_k.data() + src;
        c.src_v[i + 1] = L.cache_v.data() + src;
        c.dst_row[i + 1] = sinks + static_cast<int32_t>(i) * B;
        c.rows[i + 1] = B;
      }
      c.count = static_cast<int32_t>(R.size()) + 1;
      stream_copy_rows(wk, wv, row_, c, s);
    } else {
      d2d(wk, L.sink_k.data(), static_cast<size_t>(sinks) * row_bytes, s);
      d2d(wv, L.sink_v.data(), static_cast<size_t>(sinks) * row_bytes, s);
      for (size_t i = 0; i < R.size(); ++i) {
        const int64_t src = static_cast<int64_t>(slot_of[i]) * B * row_;
        const int64_t dst = (sinks + static_cast<int64_t>(i) * B) * row_;
        d2d(wk + dst, L.cache_k.data() + src, static_cast<size_t>(B) * row_bytes, s);
        d2d(wv + dst, L.cache_v.data() + src, static_cast<size_t>(B) * row_bytes, s);
      }
    }
    global_pass(a, ix, n, out, s);  // (q_global_ rotated by local_first)
  }

  // 6. The chunk's raw K / V into the sinks and the ring (after the evictions' copies out of the ring).
  prof_mark(s);
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s, L.evicted, 0));
  const int32_t into_sinks = std::clamp(opt_.sinks - pos, 0, n);
  d2d(L.sink_k.data() + static_cast<int64_t>(pos) * row_, k, static_cast<size_t>(into_sinks) * row_bytes, s);
  d2d(L.sink_v.data() + static_cast<int64_t>(pos) * row_, v, static_cast<size_t>(into_sinks) * row_bytes, s);
  if (n > into_sinks) {
    copy_to_ring(L.ring_k, pos + into_sinks, n - into_sinks, k + into_sinks * row_, s);
    copy_to_ring(L.ring_v, pos + into_sinks, n - into_sinks, v + into_sinks * row_, s);
  }
  if (window_kept_) store_window(L, pos, n, k, v, inv_freq, s);  // (the ring serves until the first eviction)
  prof_mark(s);
}

void GpuStreamingKV::store_window(LayerState& L, int32_t pos, int32_t n, const bf16* k, const bf16* v,
                                  const float* inv_freq, cudaStream_t s) {
  const int32_t first = std::max(pos, opt_.sinks);  // the sinks are kept raw on their own
  const int32_t rows = pos + n - first;
  if (rows <= 0) return;
  const int64_t r0 = first - L.win_origin;
  check(r0 >= opt_.sinks && r0 + rows <= win_rows_, [&] {
    return "GPU streaming: the window buffer has no room for positions [" + std::to_string(first) + ", " +
           std::to_string(pos + n) + ")";
  });
  const size_t bytes = static_cast<size_t>(rows * row_) * sizeof(bf16);
  StreamRopeJobs kj;  // K rotated on its way in
  kj.add(L.win_k.data() + r0 * row_, k + (first - pos) * row_, rows, first, 1);
  stream_rope_copy(kj, row_, cfg_.num_kv_heads, cfg_.head_dim, inv_freq, s);
  d2d(L.win_v.data() + r0 * row_, v + (first - pos) * row_, bytes, s);
}

void GpuStreamingKV::attend_window(int32_t layer, int32_t pos, int32_t n, const stream::StreamLayout& lay, bf16* q,
                                   const bf16* k, const bf16* v, const float* inv_freq, float scale, bf16* out,
                                   cudaStream_t s) {
  LayerState& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, d = cfg_.head_dim;
  const size_t row_bytes = static_cast<size_t>(row_) * sizeof(bf16);
  const int32_t G = lay.global, local_begin = opt_.sinks + host_.evicted_blocks() * opt_.block;
  check(G == opt_.sinks && lay.local == pos - local_begin && host_.retrieved(layer).empty(), [&] {
    return "GPU streaming: the kept window expects [sinks | window | chunk], got a layout of " +
           std::to_string(G) + " + " + std::to_string(lay.local) + " + " + std::to_string(lay.chunk);
  });
  prof_mark(s);
  // The window [local_begin, pos) and the chunk must fit: else the window moves to the front (rows [sinks, ...);
  // the buffer holds more than twice the window, so the two ranges never overlap).
  if (pos + n - L.win_origin > win_rows_) {
    const int64_t from = local_begin - L.win_origin;
    check(from >= G + lay.local, "GPU streaming: the window buffer is too small to move the window");
    d2d(L.win_k.data() + G * row_, L.win_k.data() + from * row_, static_cast<size_t>(lay.local) * row_bytes, s);
    d2d(L.win_v.data() + G * row_, L.win_v.data() + from * row_, static_cast<size_t>(lay.local) * row_bytes, s);
    L.win_origin = local_begin - G;
  }
  const int64_t off = local_begin - L.win_origin;  // the window's first row (>= G)
  // The sinks (raw) just before the window: rows of tokens already evicted, never read again.
  d2d(L.win_k.data() + (off - G) * row_, L.sink_k.data(), static_cast<size_t>(G) * row_bytes, s);
  d2d(L.win_v.data() + (off - G) * row_, L.sink_v.data(), static_cast<size_t>(G) * row_bytes, s);
  store_window(L, pos, n, k, v, inv_freq, s);  // the chunk after the window, rotated
  // The queries: at their positions for the local pass, all at position `local` for the global one (one launch).
  StreamRopeJobs qj;
  qj.add(q_local_.data(), q, n, pos, 1);
  qj.add(q_global_.data(), q, n, opt_.local, 0);
  stream_rope_copy(qj, qrow_, nq, d, inv_freq, s);
  prof_mark(s);

  // The attention over [sinks | window | chunk] read in place: the workspace path's two passes and merge.
  Indexes& ix = indexes(lay, n <= 64 ? 64 : 128, s);
  const attn::AttentionArgs a = local_pass(lay, ix, n, q_local_.data(), L.win_k.data() + (off - G) * row_,
                                           L.win_v.data() + (off - G) * row_, scale, out, s);
  prof_mark(s);
  prof_mark(s);  // (no retrieved blocks to wait for)
  global_pass(a, ix, n, out, s);
  prof_mark(s);
  prof_mark(s);  // (nothing to store: the chunk is in the window buffer, the sinks are full)
}

void GpuStreamingKV::attend_sliding(int32_t layer, int32_t pos, int32_t n, const stream::StreamLayout& lay, bf16* q,
                                    const bf16* k, const bf16* v, const float* inv_freq, float scale, bf16* out,
                                    cudaStream_t s) {
  LayerState& L = layers_[static_cast<size_t>(layer)];
  const int32_t nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const int32_t window = cfg_.layers[static_cast<size_t>(layer)].sliding_window;
  const size_t row_bytes = static_cast<size_t>(row_) * sizeof(bf16);
  const int32_t held = lay.local;
  const int64_t rows = static_cast<int64_t>(L.win_k.size()) / row_;
  check(lay.global == 0 && lay.chunk == n && held < window, [&] {
    return "GPU streaming: a sliding-window layer expects [window | chunk], got a layout of " +
           std::to_string(lay.global) + " + " + std::to_string(held) + " + " + std::to_string(lay.chunk);
  });
  prof_mark(s);
  // The held tokens [pos - held, pos) and the chunk must fit: else the held ones move to the front (the buffer holds
  // 2 (window - 1) + chunk rows, so the two ranges never overlap).
  if (pos + n - L.win_origin > rows) {
    const int64_t from = pos - held - L.win_origin;
    check(from >= held, "GPU streaming: the sliding-window buffer is too small to move the window");
    d2d(L.win_k.data(), L.win_k.data() + from * row_, static_cast<size_t>(held) * row_bytes, s);
    d2d(L.win_v.data(), L.win_v.data() + from * row_, static_cast<size_t>(held) * row_bytes, s);
    L.win_origin = pos - held;
  }
  // The chunk after the held tokens, K rotated at its true positions with this layer's table; the queries in place.
  const int64_t r0 = pos - L.win_origin;
  StreamRopeJobs kj;
  kj.add(L.win_k.data() + r0 * row_, k, n, pos, 1);
  stream_rope_copy(kj, row_, nkv, d, inv_freq, s);
  d2d(L.win_v.data() + r0 * row_, v, static_cast<size_t>(n) * row_bytes, s);
  stream_rope_rows(q, n, qrow_, nq, d, inv_freq, pos, 1, s);
  prof_mark(s);
  // Causal attention over [held | chunk] with the model's row-exact window (positions relative to the first held
  // token: the mask is unchanged), as the CPU's attend_window().
  Indexes& ix = indexes(lay, n <= 64 ? 64 : 128, s);
  (void)local_pass(lay, ix, n, q, L.win_k.data() + (r0 - held) * row_, L.win_v.data() + (r0 - held) * row_, scale,
                   out, s, window < held + n ? window : 0);
  prof_mark(s);
  prof_mark(s);  // (no retrieved blocks to wait for)
  prof_mark(s);  // (no global pass)
  prof_mark(s);  // (nothing to store: the chunk is in the window buffer)
}

void GpuStreamingKV::reset() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(copy_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(copy_in_));
  host_.reset();
  if (decider_) decider_->reset();
  for (LayerState& L : layers_) {
    L.host_k.clear();
    L.host_v.clear();
    L.win_origin = 0;
    std::fill(L.cache_block.begin(), L.cache_block.end(), -1);
    std::fill(L.cache_used.begin(), L.cache_used.end(), -1);
  }
  // Pinned slabs are kept for the next sequence: reuse them from the first.
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = slabs_.rbegin(); it != slabs_.rend(); ++it) ready_slabs_.insert(ready_slabs_.begin(), *it);
    made_slabs_ += static_cast<int64_t>(slabs_.size());
    want_slabs_ += static_cast<int64_t>(slabs_.size());
    stats_.pinned_bytes = 0;
    slabs_.clear();
    slab_used_ = 0;
  }
}

}  // namespace tessera::runtime::gpu
