#include "attention/cuda/layer_attention_cuda.h"

#include <algorithm>
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

CudaLayerAttention::CudaLayerAttention(std::vector<Pattern> patterns, const LoweringContext& ctx,
                                       int num_kv_heads, int head_dim, const CudaAttentionOptions& options)
    : patterns_(std::move(patterns)),
      ctx_(ctx),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      options_(options) {
  for (size_t h = 0; h < patterns_.size(); ++h)
    validate(patterns_[h], "CUDA layer attention head " + std::to_string(h));
  check(sparse_prefill_supports(head_dim, ctx.tile),
        "CUDA layer attention: head_dim " + std::to_string(head_dim) + " with tile " +
            std::to_string(ctx.tile) + " is not supported (head_dim 64, 128 or 256; tile 64 or 128)");
  estimates_ = DeviceEstimates(patterns_, ctx_, num_kv_heads, head_dim);
  builder_ = DeviceIndexBuilder(patterns_, ctx_, estimates_);
  builder_.set_split(options_.split);
  all_dense_ = !patterns_.empty();
  for (const Pattern& p : patterns_) all_dense_ = all_dense_ && std::holds_alternative<DensePattern>(p);
  dense_cost_ = dense_index_cost(ctx_, static_cast<int64_t>(patterns_.size()));
  shortcut_ours_ = !all_dense_ && attn::dense_before_estimation(patterns_, ctx_, 1.0);
  shortcut_cudnn_ = !all_dense_ && attn::dense_before_estimation(patterns_, ctx_, cudnn_rel_tile_cost(ctx_.q_len));
}

void CudaLayerAttention::set_options(const CudaAttentionOptions& o) {
  options_ = o;
  builder_.set_split(o.split);
  invalidate_route();
}

const PrefillRoute& CudaLayerAttention::route(const AttentionArgs& args, cudaStream_t stream) {
  if (route_valid_ && route_dtype_ == args.q.dtype && route_window_ == args.window) return route_;
  RouteInputs in;
  in.q_len = args.q_len();
  in.window = args.window;
  in.all_dense = all_dense_;
  in.shortcut_ours = shortcut_ours_;
  in.shortcut_cudnn = shortcut_cudnn_;
  in.split_units = options_.split && !builder_.split_units().empty();
  in.hopper_applies = options_.kernel != PrefillKernel::kMma &&
                      hopper_prefill_ready(args.q.dtype, head_dim_, ctx_.tile, stream);
  // cudnn_dense_plan: built with cuDNN, a handle, the call supported, and an engine for its shape (the plan is
  // built here on first use of a shape and cached; a failure is cached too).
  in.cudnn_has_plan = !cudnn_failed_ && wants_cudnn(in, options_) && cudnn_dense_plan(args);
  CudaAttentionOptions opt = options_;
  if (cudnn_failed_ && opt.dense_backend == DenseBackend::kAuto) opt.dense_backend = DenseBackend::kOurs;
  route_ = plan_prefill_route(in, opt);
  route_valid_ = true;
  route_dtype_ = args.q.dtype;
  route_window_ = args.window;
  return route_;
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

DenseBackend CudaLayerAttention::attend_dense(const AttentionArgs& args, cudaStream_t stream, DenseBackend backend,
                                              PrefillKernel kernel) {
  if (backend == DenseBackend::kCudnn) {
    if (options_.dense_backend == DenseBackend::kCudnn) {  // asked for: its errors are the caller's
      cudnn_dense_attention(args, stream);
      return DenseBackend::kCudnn;
    }
    try {
      cudnn_dense_attention(args, stream);
      return DenseBackend::kCudnn;
    } catch (const Error& e) {
      // The route chose cuDNN (its plan built) but the launch failed: ours from now on, for this layer.
      cudnn_failed_ = true;
      cudnn_error_ = e.what();
      invalidate_route();
      kernel = route(args, stream).dense_kernel;
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
  sparse_prefill(args, *index, *plan, stream, kernel);
  return DenseBackend::kOurs;
}

bool CudaLayerAttention::fall_back_to_dense(const PrefillRoute& r, cudaStream_t stream) {
  int64_t sparse = static_sparse_cost_;
  if (sparse < 0) {
    sparse = builder_.download_total_cost(stream);
    if (!has_dynamic_heads()) static_sparse_cost_ = sparse;
  }
  return static_cast<double>(sparse) > r.dense_tile_cost * static_cast<double>(dense_cost_);
}

void CudaLayerAttention::attend(const AttentionArgs& args, cudaStream_t stream, PrefillKernel kernel) {
  check_args(args);
  if (kernel != PrefillKernel::kAuto) {  // a kernel asked for: that kernel on the sparse index
    sparse_prefill(args, index_, plan_, stream, kernel);
    last_path_ = std::string("sparse ") + prefill_kernel_name(kernel);
    return;
  }
  const PrefillRoute r = route(args, stream);  // a copy: a cuDNN failure below replaces the layer's route
  RoutePath path = r.path;
  if (path == RoutePath::kSparse && r.fallback_check && fall_back_to_dense(r, stream)) path = RoutePath::kDenseFallback;
  if (path == RoutePath::kSparse) {
    sparse_prefill(args, index_, plan_, stream, r.sparse_kernel);
    last_path_ = r.name(path);
    return;
  }
  const DenseBackend ran = attend_dense(args, stream, r.dense, r.dense_kernel);
  last_path_ = ran == r.dense ? r.name(path) : route_.name(path);
}

void CudaLayerAttention::run(const AttentionArgs& args, cudaStream_t stream) {
  const PrefillRoute& r = route(args, stream);
  if (args.q_len() > 0 && r.path == RoutePath::kDenseShortcut) {  // budgets cover the keys: no estimation, no index
    attend(args, stream);
    return;
  }
  estimate(args, stream);
  if (!(r.path == RoutePath::kDense && r.dense == DenseBackend::kCudnn)) build_index(stream);
  attend(args, stream);
}

}  // namespace tessera::attn::gpu
