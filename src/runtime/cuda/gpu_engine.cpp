#include "runtime/cuda/gpu_engine.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "core/clock.h"
#include "core/error.h"
#include "runtime/input_checks.h"
#include "runtime/sampling.h"

namespace tessera::runtime::gpu {

bool gpu_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

std::string gpu_description() {
  int device = 0;
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(err) + ")";
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, " (sm_%d%d, %d SMs, %.1f GB)", prop.major, prop.minor, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / 1e9);
  return std::string(prop.name) + buf;
}

GpuEngine::GpuEngine(const DeviceModel& model, GpuEngineOptions options)
    : model_(model), options_(std::move(options)), timer_(options_.timing) {
  const ModelConfig& cfg = model.config();
  check(options_.max_context >= 0, "GPU engine: max_context must not be negative");
  check_policy_fits(options_.policy, cfg);
  // Streaming has no context limit but the one asked for (as the CPU engine): positions past the model's trained
  // context are what it is for, and it keeps no whole-sequence cache.
  const bool streams = options_.stream.method != StreamMethod::None;
  max_context_ = options_.max_context > 0 ? options_.max_context
                 : streams                 ? std::numeric_limits<int32_t>::max() - 1
                                           : cfg.context_length;
  // A blocking stream: the attention backend uploads its small descriptors on the legacy default stream,
  // which orders with blocking streams.
  TESSERA_CUDA_CHECK(cudaStreamCreate(&stream_));
  try {
    gemm_ = std::make_unique<Gemm>(stream_);
    if (!streams) cache_ = DeviceKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_context_);
    ForwardOptions fo;
    fo.mlp_chunk = options_.mlp_chunk;
    fo.tile = options_.tile;
    fo.attention = options_.attention;
    fo.dense_fallback = options_.dense_fallback;
    fo.cuda_attention = options_.cuda_attention;
    if (options_.gemm == GemmPrecision::kFp8) fp8_ = DeviceFp8Weights::quantize(model, stream_);
    forward_ = std::make_unique<GpuForward>(model, fo, stream_, *gemm_, timer_, fp8_.get());
    // Decode as the batched engine's step (gpu_decode.h) where its kernel runs the model; the simple attention
    // backend (the tests' reference) keeps decoding through the forward.
    const int32_t group = cfg.num_q_heads / cfg.num_kv_heads;
    if (!streams && options_.attention != AttentionBackend::kSimple && group <= 8 &&
        (cfg.head_dim == 64 || cfg.head_dim == 128 || cfg.head_dim == 256))
      decode_ = std::make_unique<GpuDecode>(model, stream_, *gemm_, timer_, fp8_.get(), options_.decode_graphs);
    if (options_.stream.method != StreamMethod::None) {
      streaming_ = std::make_unique<GpuStreamingKV>(cfg, options_.stream);
    }
  } catch (...) {
    streaming_.reset();
    decode_.reset();
    forward_.reset();
    fp8_.reset();
    gemm_.reset();
    cudaStreamDestroy(stream_);
    throw;
  }
}

GpuEngine::~GpuEngine() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  streaming_.reset();
  decode_.reset();
  forward_.reset();
  fp8_.reset();
  gemm_.reset();
  cache_.release();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

GpuMemoryStats GpuEngine::memory() const {
  GpuMemoryStats m;
  m.weights_bytes = model_.bytes() + (fp8_ ? fp8_->bytes() : 0);
  m.kv_cache_bytes = kv_cache_bytes();
  m.scratch_bytes = forward_->scratch_bytes() + (decode_ ? decode_->scratch_bytes() : 0) + gemm_->workspace_bytes();
  m.peak_in_use_bytes = forward_->peak_device_bytes();
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    m.device_total_bytes = total_bytes;
  else
    (void)cudaGetLastError();
  return m;
}

size_t GpuEngine::kv_cache_bytes() const { return streaming_ ? streaming_->device_bytes() : cache_.bytes(); }

void GpuEngine::reserve_stream(int64_t tokens, bool wait) {
  if (!streaming_) return;
  streaming_->check_sequence(tokens);
  streaming_->reserve(tokens);
  if (wait) streaming_->wait_reserved();
}

void GpuEngine::reset() {
  position_ = 0;
  if (streaming_) {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    streaming_->reset();
  }
}

void GpuEngine::release_memory() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cache_.release();
  forward_->release_scratch();
  if (decode_) decode_->release();
  position_ = 0;
}

void GpuEngine::discard_timers() noexcept {
  cudaStreamSynchronize(stream_);
  (void)cudaGetLastError();
  try {
    timer_.collect();
  } catch (...) {
  }
}

void GpuEngine::add_timers() {
  const auto t = timer_.collect();
  stats_.gemm_seconds += t[EventTimer::kGemm];
  stats_.attention_seconds += t[EventTimer::kAttention];
  kernel_seconds_.norm += t[EventTimer::kNorm];
  kernel_seconds_.rope += t[EventTimer::kRope];
  kernel_seconds_.activation += t[EventTimer::kActivation];
  kernel_seconds_.misc += t[EventTimer::kMisc];
}

std::vector<float> GpuEngine::run_prefill(std::span<const int32_t> tokens, LogitRows rows,
                                          const Progress& progress) {
  if (tokens.empty()) throw Error("prefill: empty prompt");
  check_token_ids(tokens, model_.config());
  check_prompt_fits(tokens.size(), position_, max_context_, model_.config());
  const int64_t end = static_cast<int64_t>(position_) + static_cast<int64_t>(tokens.size());
  if (streaming_) {
    streaming_->check_sequence(end);
    check(end < (int64_t{1} << 31), "streaming: a sequence of " + std::to_string(end) + " tokens (at most 2^31 - 1)");
  }
  const auto t0 = Clock::now();
  if (streaming_)
    streaming_->reserve(end);
  else
    cache_.reserve(static_cast<int32_t>(end), position_);
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t chunk = options_.chunk_size > 0 ? options_.chunk_size : n;
  const auto total_len = static_cast<int32_t>(end);
  std::vector<float> logits;
  try {
    // Chunks of chunk_size tokens under the policy; with streaming memory the CPU's chunks (stream_chunk_end).
    for (int64_t c0 = 0; c0 < n;) {
      const int64_t c1 = streaming_ ? stream_chunk_end(options_.stream, c0, n) : std::min<int64_t>(n, c0 + chunk);
      const bool last = c1 == n;
      const LogitRows want = rows == LogitRows::kAll ? LogitRows::kAll : (last ? rows : LogitRows::kNone);
      const auto piece = tokens.subspan(static_cast<size_t>(c0), static_cast<size_t>(c1 - c0));
      std::vector<float> part;
      try {
        if (streaming_) {
          streaming_->begin_chunk(position_, static_cast<int32_t>(c1 - c0),
                                  last ? StreamingKV::ChunkKind::LastPrefill : StreamingKV::ChunkKind::Prefill);
          part = forward_->run(piece, position_, *streaming_, want);
        } else {
          part = forward_->run(piece, position_, cache_, &options_.policy, total_len, want);
        }
      } catch (const Error& e) {
        // Say which part of the prompt was running; the engine stays usable after reset().
        throw Error(std::string(streaming_ ? "streaming prefill of " : "prefill of ") + std::to_string(n) +
                    " tokens, chunk [" + std::to_string(c0) + ", " + std::to_string(c1) + ") at position " +
                    std::to_string(position_) + ": " + e.what() + " (call reset() before the next prompt)");
      }
      position_ += static_cast<int32_t>(c1 - c0);
      logits.insert(logits.end(), part.begin(), part.end());
      if (progress) {
        TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
        progress(c1, n);
      }
      c0 = c1;
    }
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    discard_timers();
    throw;
  }
  stats_.prefill_tokens += n;
  stats_.prefill_seconds += seconds_since(t0);
  add_timers();
  return logits;
}

std::vector<float> GpuEngine::prefill(std::span<const int32_t> tokens, const Progress& progress) {
  return run_prefill(tokens, LogitRows::kLast, progress);
}

std::vector<float> GpuEngine::forward_all_logits(std::span<const int32_t> tokens) {
  return run_prefill(tokens, LogitRows::kAll, {});
}

std::vector<double> GpuEngine::score(std::span<const int32_t> tokens, const Progress& progress) {
  constexpr size_t kPiece = 2048;  // rows of logits on the host at once ([piece, vocab] f32)
  const int64_t vocab = model_.config().vocab_size;
  std::vector<double> logprobs;
  logprobs.reserve(tokens.empty() ? 0 : tokens.size() - 1);
  for (size_t p0 = 0; p0 + 1 < tokens.size(); p0 += kPiece) {
    const size_t p1 = std::min(tokens.size(), p0 + kPiece);
    const std::vector<float> logits = forward_all_logits(tokens.subspan(p0, p1 - p0));
    append_next_token_logprobs(logits, static_cast<int64_t>(p1 - p0), vocab, static_cast<int64_t>(p0), tokens, logprobs);
    if (progress) progress(static_cast<int64_t>(p1), static_cast<int64_t>(tokens.size()));
  }
  return logprobs;
}

std::vector<float> GpuEngine::decode(int32_t token) { return run_decode(token, LogitRows::kLast); }

std::vector<float> GpuEngine::run_decode(int32_t token, LogitRows rows) {
  const int32_t one[1] = {token};
  check_token_ids(one, model_.config());
  check_decode_fits(position_, max_context_, model_.config());
  const auto t0 = Clock::now();
  if (!streaming_) cache_.reserve(position_ + 1, position_);
  std::vector<float> logits;
  try {
    if (streaming_) {
      streaming_->check_sequence(static_cast<int64_t>(position_) + 1);
      streaming_->reserve(static_cast<int64_t>(position_) + 1);
      streaming_->begin_chunk(position_, 1, StreamingKV::ChunkKind::Decode);
      logits = forward_->run(one, position_, *streaming_, rows);
    } else {
      logits = decode_ ? decode_->run(token, position_, cache_, rows)
                       : forward_->run(one, position_, cache_, nullptr, position_ + 1, rows);
    }
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    discard_timers();
    throw;
  }
  position_ += 1;
  stats_.decode_tokens += 1;
  stats_.decode_seconds += seconds_since(t0);
  add_timers();
  return logits;
}

std::vector<int32_t> GpuEngine::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                         const OnToken& on_token) {
  return generate_tokens(*this, prompt, options, on_token, [this](int32_t t) { run_decode(t, LogitRows::kNone); });
}

}  // namespace tessera::runtime::gpu
