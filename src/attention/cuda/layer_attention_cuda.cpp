#include "attention/cuda/layer_attention_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <iterator>
#include <string>
#include <utility>
#include <variant>

#include "attention/cuda/cudnn_sdpa.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/work_plan.h"
#include "attention/index/dense_shortcut.h"
#include "attention/index/lower.h"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace {

// TESSERA_DENSE_BACKEND=ours|cudnn|auto: "ours" forces our kernel, "cudnn" takes cuDNN wherever it can run
// the call (no minimum length); anything else leaves kAuto.
std::string env_dense_backend() {
  const char* e = std::getenv("TESSERA_DENSE_BACKEND");
  return e == nullptr ? std::string() : std::string(e);
}

bool env_fallback_off() {
  const char* e = std::getenv("TESSERA_DENSE_FALLBACK");
  return e != nullptr && std::string(e) == "0";
}

// Cost (work_plan.h) of the dense causal index of this shape: per item 1 + ceil(tile_key_end / 64).
int64_t dense_index_cost(const LoweringContext& ctx, int64_t num_heads) {
  if (ctx.tile <= 0 || ctx.q_len <= 0) return 0;
  const int64_t tiles = (ctx.q_len + ctx.tile - 1) / ctx.tile;
  int64_t per_head = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t last_row = std::min<int64_t>((t + 1) * ctx.tile, ctx.q_len);
    const int64_t key_end = std::min<int64_t>(ctx.kv_len, ctx.q_begin + last_row);
    per_head += 1 + (key_end + kPrefillKeyTile - 1) / kPrefillKeyTile;
  }
  return per_head * num_heads;
}

}  // namespace

double cudnn_rel_tile_cost(int64_t q_len) {
  constexpr auto& t = kCudnnRelTime;
  constexpr size_t n = std::size(kCudnnRelTime);
  if (q_len <= t[0].q_len) return t[0].cudnn_over_ours;
  for (size_t i = 1; i < n; ++i) {
    if (q_len <= t[i].q_len) {
      const double x0 = std::log2(static_cast<double>(t[i - 1].q_len)), x1 = std::log2(static_cast<double>(t[i].q_len));
      const double f = (std::log2(static_cast<double>(q_len)) - x0) / (x1 - x0);
      return t[i - 1].cudnn_over_ours + f * (t[i].cudnn_over_ours - t[i - 1].cudnn_over_ours);
    }
  }
  return t[n - 1].cudnn_over_ours;
}

const char* dense_backend_name(DenseBackend b) {
  switch (b) {
    case DenseBackend::kAuto:
      return "auto";
    case DenseBackend::kOurs:
      return "ours";
    case DenseBackend::kCudnn:
      return "cudnn";
  }
  return "?";
}

CudaLayerAttention::CudaLayerAttention(std::vector<Pattern> patterns, const LoweringContext& ctx,
                                       int num_kv_heads, int head_dim)
    : patterns_(std::move(patterns)), ctx_(ctx), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  for (size_t h = 0; h < patterns_.size(); ++h)
    validate(patterns_[h], "CUDA layer attention head " + std::to_string(h));
  check(sparse_prefill_supports(head_dim, ctx.tile),
        "CUDA layer attention: head_dim " + std::to_string(head_dim) + " with tile " +
            std::to_string(ctx.tile) + " is not supported (head_dim 64, 128 or 256; tile 64 or 128)");
  estimates_ = DeviceEstimates(patterns_, ctx_, num_kv_heads, head_dim);
  builder_ = DeviceIndexBuilder(patterns_, ctx_, estimates_);
  all_dense_ = !patterns_.empty();
  for (const Pattern& p : patterns_) all_dense_ = all_dense_ && std::holds_alternative<DensePattern>(p);
  dense_cost_ = dense_index_cost(ctx_, static_cast<int64_t>(patterns_.size()));
  shortcut_ours_ = !all_dense_ && attn::dense_before_estimation(patterns_, ctx_, 1.0);
  shortcut_cudnn_ = !all_dense_ && attn::dense_before_estimation(patterns_, ctx_, cudnn_rel_tile_cost(ctx_.q_len));
}

bool CudaLayerAttention::dense_before_estimation(const AttentionArgs& args) const {
  if (all_dense_ || !dense_shortcut_ || !dense_fallback_ || env_fallback_off() || args.window != 0 || args.q_len() == 0) return false;
  if (!shortcut_ours_ && !shortcut_cudnn_) return false;  // (the cuDNN threshold is the lower one)
  return resolve_dense_backend(args) == DenseBackend::kCudnn ? shortcut_cudnn_ : shortcut_ours_;
}

void CudaLayerAttention::check_args(const AttentionArgs& args) const {
  validate_cuda_args(args);
  check(args.num_q_heads() == static_cast<int64_t>(patterns_.size()) &&
            args.num_kv_heads() == num_kv_heads_ && args.head_dim() == head_dim_ &&
            args.q_len() == ctx_.q_len && args.kv_len() == ctx_.kv_len && args.q_begin == ctx_.q_begin,
        "CUDA layer attention: the call (q " + args.q.shape_string() + ", k " + args.k.shape_string() +
            ", q_begin " + std::to_string(args.q_begin) + ") does not match the layer's shape");
}

void CudaLayerAttention::estimate(const AttentionArgs& args, cudaStream_t stream) {
  if (estimates_.empty()) return;
  check_args(args);
  estimates_.estimate(args.q, args.k, args.effective_scale(), stream);
}

void CudaLayerAttention::build_index(cudaStream_t stream) {
  builder_.build(index_, plan_, stream);
  index_built_ = true;
}

DenseBackend CudaLayerAttention::resolve_dense_backend(const AttentionArgs& args) const {
  if (dense_backend_ != DenseBackend::kAuto) return dense_backend_;
  if (cudnn_failed_) return DenseBackend::kOurs;
  const std::string env = env_dense_backend();
  if (env == "ours") return DenseBackend::kOurs;
  if (env != "cudnn" && (args.q_len() < kCudnnMinQLen || cudnn_rel_tile_cost(args.q_len()) >= 1.0))
    return DenseBackend::kOurs;
  // cudnn_dense_plan: built with cuDNN, a handle, the call supported, and an engine for its shape (the plan is
  // built here on first use of a shape and cached; a failure is cached too).
  return cudnn_dense_plan(args) ? DenseBackend::kCudnn : DenseBackend::kOurs;
}

void CudaLayerAttention::attend_dense(const AttentionArgs& args, cudaStream_t stream, DenseBackend backend) {
  if (backend == DenseBackend::kCudnn) {
    if (dense_backend_ == DenseBackend::kCudnn) {  // asked for: its errors are the caller's
      cudnn_dense_attention(args, stream);
      last_path_ = "dense cudnn";
      return;
    }
    try {
      cudnn_dense_attention(args, stream);
      last_path_ = "dense cudnn";
      return;
    } catch (const Error& e) {
      // kAuto chose cuDNN (its plan built) but the launch failed: ours from now on, for this layer.
      cudnn_failed_ = true;
      cudnn_error_ = e.what();
      if (all_dense_ && !index_built_) build_index(stream);
    }
  }
  DeviceSparseIndex* index = &index_;
  DeviceWorkPlan* plan = &plan_;
  if (!all_dense_) {
    if (!dense_index_built_) {
      const std::vector<Pattern> dense(patterns_.size(), Pattern{DensePattern{}});
      const SparseIndex host = lower_layer(dense, std::vector<HeadEstimate>(patterns_.size()), ctx_);
      dense_index_ = DeviceSparseIndex::upload(host, stream);
      dense_plan_ = DeviceWorkPlan::upload(plan_prefill(host), stream);
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host vectors die here
      dense_index_built_ = true;
    }
    index = &dense_index_;
    plan = &dense_plan_;
  }
  sparse_prefill(args, *index, *plan, stream);
  last_path_ = std::string("dense ") +
               prefill_kernel_name(resolve_prefill_kernel(PrefillKernel::kAuto, args.q.dtype, head_dim_,
                                                          ctx_.tile, stream));
}

bool CudaLayerAttention::fall_back_to_dense(const AttentionArgs& args, DenseBackend backend,
                                            cudaStream_t stream) {
  int64_t sparse = static_sparse_cost_;
  if (sparse < 0) {
    sparse = builder_.download_total_cost(stream);
    if (!has_dynamic_heads()) static_sparse_cost_ = sparse;
  }
  const double r = backend == DenseBackend::kCudnn ? cudnn_rel_tile_cost(args.q_len()) : 1.0;
  return static_cast<double>(sparse) > r * static_cast<double>(dense_cost_);
}

void CudaLayerAttention::attend(const AttentionArgs& args, cudaStream_t stream, PrefillKernel kernel,
                                int wgmma_variant) {
  check_args(args);
  if (kernel == PrefillKernel::kAuto && wgmma_variant < 0 && args.q_len() > 0) {
    if (all_dense_) {
      attend_dense(args, stream, resolve_dense_backend(args));
      return;
    }
    if (dense_before_estimation(args)) {
      attend_dense(args, stream, resolve_dense_backend(args));
      last_path_ = "dense shortcut " + last_path_.substr(6);  // "dense X" -> "dense shortcut X"
      return;
    }
    if (dense_fallback_ && !env_fallback_off() && args.window == 0) {
      const DenseBackend backend = resolve_dense_backend(args);
      if (fall_back_to_dense(args, backend, stream)) {
        attend_dense(args, stream, backend);
        last_path_ = "dense fallback " + last_path_.substr(6);  // "dense X" -> "dense fallback X"
        return;
      }
    }
  }
  sparse_prefill(args, index_, plan_, stream, kernel, wgmma_variant);
  last_path_ = std::string("sparse ") +
               prefill_kernel_name(resolve_prefill_kernel(kernel, args.q.dtype, head_dim_, ctx_.tile, stream));
}

void CudaLayerAttention::run(const AttentionArgs& args, cudaStream_t stream) {
  if (dense_before_estimation(args)) {  // budgets cover the keys: no estimation, no index
    attend(args, stream);
    return;
  }
  estimate(args, stream);
  if (!(all_dense_ && args.q_len() > 0 && resolve_dense_backend(args) == DenseBackend::kCudnn)) {
    build_index(stream);
  }
  attend(args, stream);
}

}  // namespace tessera::attn::gpu
