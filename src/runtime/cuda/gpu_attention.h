// tessera/runtime/cuda/gpu_attention.h — the GPU's attention routes for the layer recipe (gpu_ops.h), decided in one
// place: contiguous K/V under a sparse policy (prefill chunks: the single-sequence forward and each tensor-parallel
// rank's KV groups) and the paged decode step (the batched engine's, and the single-sequence decode over its
// contiguous cache).
//
// Contiguous (attend_contiguous), the patterns of the layer's heads as the CPU Forward takes them:
//  - the sparse executor (attn::gpu::CudaLayerAttention: estimate, index, prefill kernel) with the lowering context
//    {pos, n, pos + n, total_len, tile}, through CudaLayerAttention::run (which sends all-dense layers to cuDNN where
//    it can run them, and sparse layers whose index costs more than dense to the dense path). Calls with the same
//    patterns and window share one CudaLayerAttention per chunk (ExecutorSet); static patterns (dense, A-shape,
//    Triangle, ...) build their index once per chunk and later calls only attend();
//  - the simple kernel (kernels.h simple_attention): dense only, for head dims the executor is not built for (it
//    runs 64, 128 and 256), or when asked for (AttentionBackend::kSimple, the reference in tests);
//  - sliding-window layers (Gemma-3 local layers, Mistral) pass their row-exact window: args.window for the
//    executor (which applies it row-exactly on top of any policy), the kernel's own window for the simple kernel.
//
// Paged decode (PagedDecodeStep): one row per sequence, its new K/V appended to its blocks (paged_append_kv), then
// flash-decoding over each (row, query head)'s view (paged_decode.h; bf16 or FP8 E4M3 blocks). Every launch reads its
// per-step data (tokens' positions, lengths, blocks) from device memory: the step is captured into CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "attention/attention_args.h"
#include "attention/index/lowering_context.h"
#include "attention/index/prefill_route.h"
#include "attention/pattern/pattern.h"
#include "runtime/cuda/gpu_ops.h"
#include "runtime/cuda/paged_decode.h"

namespace tessera::attn::gpu {
class CudaLayerAttention;
}

namespace tessera::runtime::gpu {

enum class AttentionBackend {
  kAuto,      // the executor where it runs the layer (head dim), else the simple kernel (dense layers only)
  kExecutor,  // always the sparse executor
  kSimple,    // always the simple kernel (dense layers only)
};
const char* attention_backend_name(AttentionBackend b);  // "auto", "executor", "simple"
// Throws tessera::Error for other names.
AttentionBackend parse_attention_backend(const std::string& name);

// How contiguous attention runs (a forward's options).
struct ContiguousOptions {
  AttentionBackend backend = AttentionBackend::kAuto;
  int32_t tile = 128;           // the executor's query tile in prefill; chunks of at most 64 rows use 64
  bool dense_fallback = true;   // ANDed into cuda_attention's
  attn::gpu::CudaAttentionOptions cuda_attention = attn::gpu::cuda_attention_defaults();
};

// The executors of one chunk, one per distinct (patterns, window). release_dynamic: a layer with dynamic heads is
// dropped after its call (they estimate and index afresh on every call: nothing to keep, and keeping every KV group's
// estimates and index would fill the GPU: the tensor-parallel ranks); otherwise it is kept and run again.
class ExecutorSet {
 public:
  explicit ExecutorSet(bool release_dynamic = false);
  ~ExecutorSet();
  ExecutorSet(const ExecutorSet&) = delete;
  ExecutorSet& operator=(const ExecutorSet&) = delete;

  // Runs args through the executor of (patterns, args.window), made with `ctx` on first use.
  void run(const std::vector<attn::Pattern>& patterns, const attn::LoweringContext& ctx, int32_t kv_heads,
           const ContiguousOptions& options, const attn::AttentionArgs& args, cudaStream_t stream);

 private:
  struct Entry;
  bool release_dynamic_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// One attention call over contiguous K/V (all bf16, contiguous rows): q and out [n, heads, d], k and v
// [pos + n, kv_heads, d]; row t at position pos + t.
struct ContiguousCall {
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  bf16* out = nullptr;
  int32_t n = 0, pos = 0, total_len = 0;  // total_len: the sequence length at the end of this prefill
  int32_t heads = 0, kv_heads = 0, head_dim = 0;
  int32_t model_window = 0;  // the layer's sliding window (0: none)
  float scale = 0;
  std::string_view model;    // the model's name (messages)
};

// The call's attention with the heads' patterns (see the top of this file); errors name `where` (e.g. "layer 3
// attention").
void attend_contiguous(ExecutorSet& set, const std::vector<attn::Pattern>& patterns, const ContiguousCall& call,
                       const ContiguousOptions& options, const std::string& where, cudaStream_t stream);

// Where a paged decode step's keys live and what each row sees.
struct PagedLayout {
  // One pool for every layer (block ids per layer in the tables: the batched engine's store), bf16 or FP8 E4M3 with
  // per-row scales (paged_decode.h).
  PagedPools pools;
  const int32_t* tables = nullptr;  // [slots, layers * kv_heads, max_blocks]
  const int32_t* views = nullptr;   // [slots, layers * q_heads, 3]
  int32_t block_tokens = 0, max_blocks = 0;
  // The step's rows, on the device.
  const int32_t* row_slot = nullptr;  // [rows]
  const int32_t* row_len = nullptr;   // [rows]: keys of the row (its position + 1)
  const int32_t* row_pos = nullptr;   // [rows]
  const int32_t* blocks = nullptr;    // the new row's block: [rows, layers, kv_heads]
  int32_t rows = 0, splits = 1;
  float* o_part = nullptr;    // [rows, q_heads, splits, head_dim] scratch
  float* lse_part = nullptr;  // [rows, q_heads, splits]
};

class PagedDecodeStep final : public GpuAttentionStep {
 public:
  PagedDecodeStep(const ModelConfig& cfg, float scale, const PagedLayout& layout)
      : cfg_(cfg), scale_(scale), layout_(layout) {}
  bool fused_qkv() const override { return true; }
  void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) override;

 private:
  const ModelConfig& cfg_;
  float scale_;
  const PagedLayout& layout_;
};

}  // namespace tessera::runtime::gpu
