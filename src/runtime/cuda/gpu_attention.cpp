#include "runtime/cuda/gpu_attention.h"

#include <algorithm>
#include <variant>

#include "attention/cuda/layer_attention_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "core/enum_names.h"
#include "core/error.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/paged_decode.h"

namespace tessera::runtime::gpu {

// In AttentionBackend's order (core/enum_names.h).
constexpr std::string_view kBackendNames[] = {"auto", "executor", "simple"};

const char* attention_backend_name(AttentionBackend b) { return enum_name(kBackendNames, b).data(); }

AttentionBackend parse_attention_backend(const std::string& name) {
  if (const auto b = enum_value<AttentionBackend>(kBackendNames, name)) return *b;
  throw Error("unknown GPU attention backend '" + name + "' (auto, executor, simple)");
}

struct ExecutorSet::Entry {
  std::vector<attn::Pattern> patterns;
  int32_t window = 0;
  std::unique_ptr<attn::gpu::CudaLayerAttention> layer;
  bool index_built = false;
};

ExecutorSet::ExecutorSet(bool release_dynamic) : release_dynamic_(release_dynamic) {}
ExecutorSet::~ExecutorSet() = default;

void ExecutorSet::run(const std::vector<attn::Pattern>& patterns, const attn::LoweringContext& ctx, int32_t kv_heads,
                      const ContiguousOptions& options, const attn::AttentionArgs& args, cudaStream_t stream) {
  Entry* e = nullptr;
  for (auto& x : entries_)
    if (x->window == args.window && x->patterns == patterns) e = x.get();
  if (e == nullptr) {
    entries_.push_back(std::make_unique<Entry>(Entry{patterns, args.window, nullptr, false}));
    e = entries_.back().get();
  }
  if (!e->layer) {
    // The engine's options of the backend, with its fallback switch.
    attn::gpu::CudaAttentionOptions opt = options.cuda_attention;
    opt.dense_fallback = opt.dense_fallback && options.dense_fallback;
    e->layer = std::make_unique<attn::gpu::CudaLayerAttention>(patterns, ctx, kv_heads, args.q.shape[2], opt);
  }
  if (e->layer->has_dynamic_heads()) {
    e->layer->run(args, stream);  // estimate, index, attend: afresh on every call
    if (release_dynamic_) e->layer.reset();
  } else if (!e->index_built) {
    e->layer->run(args, stream);  // estimate, index (unless cuDNN runs an all-dense layer), attend
    e->index_built = true;
  } else {
    e->layer->attend(args, stream);  // static patterns: the index of the first call serves every later one
  }
}

void attend_contiguous(ExecutorSet& set, const std::vector<attn::Pattern>& patterns, const ContiguousCall& c,
                       const ContiguousOptions& options, const std::string& where, cudaStream_t stream) {
  const int32_t kv_len = c.pos + c.n, d = c.head_dim;
  const int32_t window = c.model_window > 0 && c.model_window < kv_len ? c.model_window : 0;
  const int32_t tile = c.n <= 64 ? 64 : options.tile;
  const bool dense = attn::all_dense(patterns);
  AttentionBackend backend = options.backend;
  if (backend == AttentionBackend::kAuto) {
    backend = AttentionBackend::kExecutor;
    if (!attn::gpu::sparse_prefill_supports(d, tile)) {
      backend = AttentionBackend::kSimple;
      if (!dense)
        throw Error(where + ": the CUDA sparse executor does not support head_dim " + std::to_string(d) +
                    " (64, 128 or 256), so model " + std::string(c.model) +
                    " runs only dense attention on the GPU; run sparse policies with --device cpu");
    }  // (the executor applies sliding windows itself: args.window)
  }
  if (backend == AttentionBackend::kSimple) {
    if (!dense) {
      const auto sparse = std::find_if(patterns.begin(), patterns.end(), [](const attn::Pattern& p) {
        return !std::holds_alternative<attn::DensePattern>(p);
      });
      throw Error(where + ": the simple attention kernel runs dense attention only; this layer's policy has " +
                  attn::describe(*sparse) + " (the sparse executor runs sparse policies)");
    }
    const int64_t q_ld = static_cast<int64_t>(c.heads) * d;
    simple_attention(c.q, q_ld, c.k, c.v, static_cast<int64_t>(c.kv_heads) * d, c.out, q_ld, c.n, c.heads, c.kv_heads,
                     d, c.pos, window, c.scale, stream);
    return;
  }
  attn::AttentionArgs args;
  args.q = TensorView(const_cast<bf16*>(c.q), DType::BF16, {c.n, c.heads, d});
  args.k = TensorView(const_cast<bf16*>(c.k), DType::BF16, {kv_len, c.kv_heads, d});
  args.v = TensorView(const_cast<bf16*>(c.v), DType::BF16, {kv_len, c.kv_heads, d});
  args.out = TensorView(c.out, DType::BF16, {c.n, c.heads, d});
  args.scale = c.scale;
  args.q_begin = c.pos;
  args.window = window;
  try {
    const attn::LoweringContext ctx{c.pos, c.n, kv_len, std::max(c.total_len, kv_len), tile};
    set.run(patterns, ctx, c.kv_heads, options, args, stream);
  } catch (const Error& err) {
    std::string msg = where;
    if (window > 0) msg += " (sliding window " + std::to_string(window) + ")";
    msg += ": ";
    msg += err.what();
    throw Error(msg);
  }
}

void PagedDecodeStep::attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) {
  const PagedLayout& p = layout_;
  const int32_t D = cfg_.head_dim, Hkv = cfg_.num_kv_heads;
  paged_append_kv(qkv.k, qkv.v, qkv.kv_ld, p.rows, Hkv, D, p.blocks, layer, cfg_.num_layers, p.row_pos, p.block_tokens,
                  p.pools, stream);
  const PagedDecodeArgs args{.q = qkv.q, .q_stride = qkv.q_ld, .k_pool = p.pools.k, .v_pool = p.pools.v,
                             .kv = p.pools.precision, .k_scale = p.pools.k_scale, .v_scale = p.pools.v_scale,
                             .tables = p.tables, .views = p.views, .row_slot = p.row_slot, .row_len = p.row_len,
                             .rows = p.rows, .layer = layer, .num_layers = cfg_.num_layers,
                             .q_heads = cfg_.num_q_heads, .kv_heads = Hkv, .head_dim = D,
                             .block_tokens = p.block_tokens, .max_blocks = p.max_blocks, .scale = scale_,
                             .splits = p.splits, .o_part = p.o_part, .lse_part = p.lse_part, .out = out};
  paged_decode_attention(args, stream);
}

}  // namespace tessera::runtime::gpu
