#include "runtime/cuda/batch_gpu.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <climits>
#include <limits>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/memory_budget.h"
#include "cuda/cuda_check.h"
#include "runtime/recipe.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/stream_gpu_kv.h"

namespace tessera::runtime::gpu {

namespace {

int32_t clamp32(int64_t v) { return static_cast<int32_t>(std::min<int64_t>(v, INT32_MAX)); }

}  // namespace

int64_t padded_rows(int64_t n) {
  if (n <= 4) return n;
  for (int64_t p = 4;; p *= 2) {
    if (n <= p) return p;
    if (n <= p + p / 2) return p + p / 2;
  }
}

int32_t bucket_splits(int32_t splits) {
  int32_t p = 1;
  while (p <= splits / 2) p *= 2;
  return p;
}

GpuBatchBackend::GpuBatchBackend(const DeviceModel& model, GpuBatchOptions options)
    : model_(model), options_(std::move(options)), cfg_(model.config()), timer_(options_.timing) {
  // TESSERA_GPU_GRAPHS=0 runs every decode step eagerly (no CUDA graph), to tell a graph's fault from the step's.
  if (const char* e = std::getenv("TESSERA_GPU_GRAPHS"); e != nullptr && std::string(e) == "0") options_.graphs = false;
  TESSERA_CUDA_CHECK(cudaStreamCreate(&stream_));
  try {
    gemm_ = std::make_unique<Gemm>(stream_);
    if (options_.gemm == GemmPrecision::kFp8) {
      check_gemm_precision_supported(options_.gemm);
      fp8_ = DeviceFp8Weights::quantize(model_, stream_);
    }
    prefill_ = std::make_unique<GpuForward>(model_, options_.prefill, stream_, *gemm_, timer_, fp8_.get());
    check(options_.decode_gemm != GemmPrecision::kFp8 || fp8_ != nullptr,
          "GPU batched engine: FP8 decode GEMMs need FP8 weights (GpuBatchOptions::gemm = kFp8)");
    decode_fp8_ = options_.decode_gemm == GemmPrecision::kFp8;
    if (options_.decode_gemm == GemmPrecision::kW4) w4_ = DeviceW4Weights::quantize(model_, stream_);
    // Decode steps captured into graphs record no events (a replay would not re-record the timer's bookkeeping).
    ops_ = std::make_unique<GpuOps>(model_, stream_, *gemm_, options_.graphs ? untimed_ : timer_,
                                    decode_fp8_ ? fp8_.get() : nullptr, std::numeric_limits<int32_t>::max());
    ops_->set_w4(w4_.get());
    const int32_t group = cfg_.num_q_heads / cfg_.num_kv_heads;
    paged_decode_ = (cfg_.head_dim == 64 || cfg_.head_dim == 128 || cfg_.head_dim == 256) && group <= 8 &&
                    options_.prefill.attention != AttentionBackend::kSimple;
    check(options_.kv == KVPrecision::kBf16 || paged_decode_,
          "GPU batched engine: an FP8 KV cache needs the paged decode kernel (head dims 64, 128 or 256, GQA groups of "
          "at most 8 query heads, not the simple attention backend); model " + cfg_.name + " has head dim " +
              std::to_string(cfg_.head_dim) + ", groups of " + std::to_string(group));
    paged_ = std::make_unique<PagedDecodeStep>(cfg_, ops_->attention_scale(), layout_);
    int dev = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    cudaStreamDestroy(stream_);
    throw;
  }
}

GpuBatchBackend::~GpuBatchBackend() {
  cudaStreamSynchronize(stream_);
  drop_graphs();
  paged_.reset();
  ops_.reset();
  prefill_.reset();
  fp8_.reset();
  w4_.reset();
  gemm_.reset();
  cudaStreamDestroy(stream_);
}

size_t GpuBatchBackend::scratch_bytes() const {
  return prefill_->scratch_bytes() + ops_->scratch_bytes() + gemm_->workspace_bytes() + step_.bytes() +
         o_part_.bytes() + lse_part_.bytes() + chosen_.bytes() + sample_scratch_.bytes();
}

void GpuBatchBackend::release_scratch() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  drop_graphs();
  staging_.release();
  prefill_->release_scratch();
  ops_->release_scratch();
}

void GpuBatchBackend::collect_timers() {
  if (!timer_.enabled()) return;
  const auto t = timer_.collect();
  timers_.gemm_seconds += t[EventTimer::kGemm];
  timers_.attention_seconds += t[EventTimer::kAttention];
  kernel_seconds_.norm += t[EventTimer::kNorm];
  kernel_seconds_.rope += t[EventTimer::kRope];
  kernel_seconds_.activation += t[EventTimer::kActivation];
  kernel_seconds_.misc += t[EventTimer::kMisc];
}

void GpuBatchBackend::set_rank_reduce(const GpuOps::RankReduce& reduce) {
  ops_->set_rank_reduce(reduce);
  prefill_->ops().set_rank_reduce(reduce);
}

double GpuBatchBackend::default_kv_bytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  TESSERA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return 0.7 * static_cast<double>(free_bytes);
}

void GpuBatchBackend::create_store(const PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                                   int32_t max_context) {
  check((shape.block_tokens & (shape.block_tokens - 1)) == 0,
        "GPU batched decode: block_tokens must be a power of two, got " + std::to_string(shape.block_tokens));
  shape_ = shape;
  slots_ = max_sequences;
  max_blocks_ = static_cast<int32_t>((static_cast<int64_t>(max_context) + shape.block_tokens - 1) / shape.block_tokens);
  const int64_t heads = static_cast<int64_t>(shape.num_layers) * shape.num_kv_heads;
  const double pool_bytes = block_bytes(shape) * (num_blocks + 1.0);  // + the padding rows' scratch block
  const double table_bytes = (slots_ + 1.0) * static_cast<double>(heads) * max_blocks_ * 4.0;
  size_t free_bytes = 0, total_bytes = 0;
  TESSERA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (pool_bytes + table_bytes > 0.95 * static_cast<double>(free_bytes))
    throw Error("KV cache of " + std::to_string(num_blocks) + " blocks of " + std::to_string(shape.block_tokens) +
                " tokens (K and V in " + kv_precision_name(options_.kv) + ") and block tables need " +
                format_bytes(pool_bytes + table_bytes) + ", " + format_bytes(static_cast<double>(free_bytes)) +
                " of device memory free; lower the KV budget");
  const size_t blocks = static_cast<size_t>(num_blocks) + 1;
  // Address space for the whole budget; memory as blocks are written (commit_block).
  k_pool_.reserve(blocks * pool_block_bytes());
  v_pool_.reserve(blocks * pool_block_bytes());
  if (options_.kv == KVPrecision::kFp8) {
    k_scale_.reserve(blocks * static_cast<size_t>(shape.block_tokens) * sizeof(float));
    v_scale_.reserve(blocks * static_cast<size_t>(shape.block_tokens) * sizeof(float));
  }
  // Slots [0, slots_) for sequences; slot slots_ for the padding rows: every table's first block is the scratch
  // block, every view dense.
  scratch_block_ = num_blocks;
  commit_block(scratch_block_);
  host_tables_.assign((static_cast<size_t>(slots_) + 1) * static_cast<size_t>(heads) * static_cast<size_t>(max_blocks_),
                      -1);
  for (int64_t h = 0; h < heads; ++h)
    host_tables_[static_cast<size_t>((static_cast<int64_t>(slots_) * heads + h) * max_blocks_)] = scratch_block_;
  tables_.upload(host_tables_, stream_);
  const size_t views_per_slot = static_cast<size_t>(cfg_.num_layers) * cfg_.num_q_heads * 3;
  std::vector<int32_t> views((static_cast<size_t>(slots_) + 1) * views_per_slot, 0);
  for (size_t i = static_cast<size_t>(slots_) * views_per_slot; i < views.size(); i += 3) {
    views[i + 1] = INT32_MAX;
    views[i + 2] = INT32_MAX;
  }
  views_.upload(views, stream_);
  free_slots_.clear();
  for (int32_t s = slots_ - 1; s >= 0; --s) free_slots_.push_back(s);
  slot_.clear();
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<float> GpuBatchBackend::prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                  const attn::AttentionPolicy* policy, bool logits) {
  if (pos == 0) begin_staging(total_len);
  std::vector<float> out =
      prefill_->run(tokens, pos, staging_, policy, total_len, logits ? LogitRows::kLast : LogitRows::kNone);
  collect_timers();
  return out;
}

std::vector<float> GpuBatchBackend::prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos,
                                                       int32_t total_len, const attn::AttentionPolicy* policy) {
  if (pos == 0) begin_staging(total_len);
  std::vector<float> out = prefill_->run(tokens, pos, staging_, policy, total_len, LogitRows::kAll);
  collect_timers();
  return out;
}

std::vector<double> GpuBatchBackend::prefill_chunk_logprobs(std::span<const int32_t> tokens, int32_t pos,
                                                            int32_t total_len, const attn::AttentionPolicy* policy,
                                                            std::span<const int32_t> next) {
  if (pos == 0) begin_staging(total_len);
  std::vector<double> out = prefill_->score(tokens, pos, staging_, policy, total_len, next);
  collect_timers();
  return out;
}

int32_t GpuBatchBackend::slot_of(const SequenceBlocks& seq) const {
  const auto it = slot_.find(&seq);
  check(it != slot_.end(), "GPU batched decode: a sequence without a slot (decoded before its prefill ended)");
  return it->second;
}

void GpuBatchBackend::upload_table_columns(int32_t slot, const SequenceBlocks& seq, int64_t b0, int64_t b1) {
  const int64_t heads = static_cast<int64_t>(shape_.num_layers) * shape_.num_kv_heads;
  b1 = std::min<int64_t>(b1, max_blocks_);
  if (b1 <= b0) return;
  int32_t* base = host_tables_.data() + static_cast<int64_t>(slot) * heads * max_blocks_;
  for (int32_t l = 0; l < shape_.num_layers; ++l)
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::vector<int32_t>& t = seq.table(l, h);
      int32_t* row = base + (static_cast<int64_t>(l) * shape_.num_kv_heads + h) * max_blocks_;
      for (int64_t b = b0; b < b1; ++b) row[b] = b < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(b)] : -1;
    }
  const size_t pitch = static_cast<size_t>(max_blocks_) * sizeof(int32_t);
  TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(tables_.data() + static_cast<int64_t>(slot) * heads * max_blocks_ + b0, pitch,
                                       base + b0, pitch, static_cast<size_t>(b1 - b0) * sizeof(int32_t),
                                       static_cast<size_t>(heads), cudaMemcpyHostToDevice, stream_));
}

void GpuBatchBackend::adopt(const SequenceBlocks& seq, std::span<const DecodeView> views) {
  check(!free_slots_.empty(), "GPU batched decode: more sequences than slots");
  check(views.size() == static_cast<size_t>(cfg_.num_layers) * static_cast<size_t>(cfg_.num_q_heads),
        "GPU batched decode: one decode view per layer and query head");
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slot_[&seq] = slot;
  upload_table_columns(slot, seq, 0, (seq.length() + shape_.block_tokens - 1) / shape_.block_tokens);
  std::vector<int32_t> v;
  v.reserve(views.size() * 3);
  for (const DecodeView& dv : views) {
    v.push_back(dv.sink);
    v.push_back(clamp32(dv.window));
    v.push_back(clamp32(dv.horizon));
  }
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(views_.data() + static_cast<int64_t>(slot) * static_cast<int64_t>(v.size()),
                                     v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // v is on this stack
}

size_t GpuBatchBackend::pool_block_bytes() const {
  return static_cast<size_t>(shape_.elements_per_block()) * (options_.kv == KVPrecision::kFp8 ? 1 : sizeof(bf16));
}

template <class Op>
void GpuBatchBackend::for_each_pool(int32_t id, const Op& op) {
  const size_t bytes = pool_block_bytes();
  op(k_pool_, static_cast<size_t>(id) * bytes, bytes);
  op(v_pool_, static_cast<size_t>(id) * bytes, bytes);
  if (options_.kv == KVPrecision::kFp8) {
    const size_t sb = static_cast<size_t>(shape_.block_tokens) * sizeof(float);
    op(k_scale_, static_cast<size_t>(id) * sb, sb);
    op(v_scale_, static_cast<size_t>(id) * sb, sb);
  }
}

void GpuBatchBackend::commit_block(int32_t id) {
  for_each_pool(id, [](ReservedMemory& m, size_t offset, size_t bytes) { m.commit(offset, bytes); });
}

void GpuBatchBackend::release_free_memory() {
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for_each_pool(scratch_block_, [](ReservedMemory& m, size_t offset, size_t bytes) { m.decommit_all(offset, bytes); });
}

void GpuBatchBackend::copy_pages(const SequenceBlocks& seq, int64_t len, PageCopy direction, int64_t from,
                                 const std::function<void(int32_t)>& after_layer) {
  const int64_t B = shape_.block_tokens;
  // Every layer's entries, uploaded once; a copy launched per layer, its blocks committed just before it (so that a
  // move into fresh blocks, with after_layer freeing the layer's staged rows, holds one layer twice at most).
  std::vector<int32_t> entries;
  std::vector<size_t> first(static_cast<size_t>(shape_.num_layers) + 1, 0);
  for (int32_t l = 0; l < shape_.num_layers; ++l) {
    first[static_cast<size_t>(l)] = entries.size() / 4;
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::vector<int32_t>& t = seq.table(l, h);
      for (int64_t b = from / B; b < static_cast<int64_t>(t.size()) && b * B < len; ++b)
        if (const int32_t id = t[static_cast<size_t>(b)]; id >= 0)
          entries.insert(entries.end(), {l, h, static_cast<int32_t>(b), id});
    }
  }
  first.back() = entries.size() / 4;
  std::vector<bf16*> kl, vl;
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    kl.push_back(staging_.k(l, 0));
    vl.push_back(staging_.v(l, 0));
  }
  attn::gpu::DeviceBuffer<int32_t> dev_entries;
  attn::gpu::DeviceBuffer<bf16*> dk, dv;
  if (!entries.empty()) {
    dev_entries.upload(entries, stream_);
    dk.upload(kl, stream_);
    dv.upload(vl, stream_);
  }
  for (int32_t l = 0; l < shape_.num_layers; ++l) {
    const size_t e0 = first[static_cast<size_t>(l)], e1 = first[static_cast<size_t>(l) + 1];
    // (A block read was written, so committed, unless release_free_memory() ran too soon: committing it anyway turns
    // that bug into wrong values instead of a device fault.)
    for (size_t e = e0; e < e1; ++e) commit_block(entries[4 * e + 3]);
    if (e1 > e0)
      paged_copy(dev_entries.data() + 4 * e0, static_cast<int32_t>(e1 - e0), dk.data(), dv.data(),
                 staging_.row_elements(), shape_.head_dim, shape_.block_tokens, static_cast<int32_t>(len), pools(),
                 direction, stream_);
    if (after_layer) after_layer(l);
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host vectors above are on this stack
}

void GpuBatchBackend::finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) {
  // (An empty sequence, one that decodes before any prefill, has nothing staged: it only takes its slot.) A layer at
  // a time, each layer's staged rows freed once in its blocks (cudaFree waits for the copy): the blocks' memory is
  // committed as the staging's goes, so the move holds one layer twice, not the whole prompt.
  // Rows a cached prefix or the sequence's earlier turns staged (load_prefix) are in their blocks already, bit for
  // bit: only the blocks from the one holding row staged_from_ on are written (a later turn over a 28K-token prefix
  // writes its ~100 new rows, not 28K; the shared blocks of the prefix cache are never written again).
  if (seq.length() > staged_from_) {
    if (staged_from_ == 0)
      copy_pages(seq, seq.length(), PageCopy::kToPages, 0, [&](int32_t l) {
        prefill_->ops().sample_memory();  // the move's peak: layer l both staged and in its blocks
        staging_.release_layer(l);
      });
    else
      copy_pages(seq, seq.length(), PageCopy::kToPages, staged_from_);
  }
  staging_.release();
  staged_from_ = 0;
  adopt(seq, views);
}

void GpuBatchBackend::begin_staging(int32_t total_len) {
  staging_ = DeviceKVCache(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, total_len);
  staging_.reserve(total_len, 0);
  staged_from_ = 0;
}

void GpuBatchBackend::load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) {
  begin_staging(total_len);
  staged_from_ = rows;  // rows [0, rows) are the blocks' own: finish_prefill does not write them back
  // Rows the sequence does not keep (a sliding-window layer's early blocks) are not copied, yet the prefill kernel
  // still reads those of a key tile that straddles the window's start, gives them a tiny masked weight (poly_exp2:
  // 2^-125, not 0) and multiplies their values: fresh device memory holding a NaN or Inf there would poison the
  // rows' outputs. Zeros are harmless: every row below `rows` gets them before the kept blocks are copied in. (This
  // did not explain the Gemma-3 multi-turn answers that differ with the cache on the H200: prefix_cache_gpu_test
  // ConcurrentConversationsEqualUncached still fails with it; issue 34.)
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(staging_.row_elements()) * sizeof(bf16);
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    TESSERA_CUDA_CHECK(cudaMemsetAsync(staging_.k(l, 0), 0, bytes, stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(staging_.v(l, 0), 0, bytes, stream_));
  }
  copy_pages(seq, rows, PageCopy::kFromPages);
}

void GpuBatchBackend::abort_prefill() {
  cudaStreamSynchronize(stream_);
  (void)cudaGetLastError();
  staging_.release();
  staged_from_ = 0;
}

void GpuBatchBackend::release_sequence(const SequenceBlocks& seq) {
  const auto it = slot_.find(&seq);
  if (it == slot_.end()) return;
  free_slots_.push_back(it->second);
  slot_.erase(it);
}

void GpuBatchBackend::download_staged(int32_t layer, int32_t rows, std::vector<bf16>& k, std::vector<bf16>& v) {
  check(layer >= 0 && layer < cfg_.num_layers && rows >= 0 && rows <= staging_.capacity(),
        "GPU batched engine: staged rows [0, " + std::to_string(rows) + ") of layer " + std::to_string(layer) +
            " outside the staging cache's " + std::to_string(staging_.capacity()));
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(staging_.row_elements());
  k.resize(n);
  v.resize(n);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (n == 0) return;
  TESSERA_CUDA_CHECK(cudaMemcpy(k.data(), staging_.k(layer, 0), n * sizeof(bf16), cudaMemcpyDeviceToHost));
  TESSERA_CUDA_CHECK(cudaMemcpy(v.data(), staging_.v(layer, 0), n * sizeof(bf16), cudaMemcpyDeviceToHost));
}

namespace {

// Block id's bytes [id * n, (id + 1) * n) of a pool into out (resized to n / sizeof(T) elements), synchronously.
template <class T>
void download_range(const ReservedMemory& pool, int32_t id, size_t n, std::vector<T>& out) {
  out.resize(n / sizeof(T));
  TESSERA_CUDA_CHECK(cudaMemcpy(out.data(), static_cast<const char*>(pool.data()) + static_cast<size_t>(id) * n, n,
                                cudaMemcpyDeviceToHost));
}

}  // namespace

void GpuBatchBackend::download_block(int32_t id, std::vector<bf16>& k, std::vector<bf16>& v) {
  check(options_.kv == KVPrecision::kBf16, "GPU batched engine: download_block reads bf16 pools; these hold FP8");
  check(id >= 0 && static_cast<size_t>(id + 1) * pool_block_bytes() <= k_pool_.reserved_bytes(),
        "GPU batched engine: block " + std::to_string(id) + " outside the pool");
  commit_block(id);  // (a block never written reads as whatever the memory held)
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  download_range(k_pool_, id, pool_block_bytes(), k);
  download_range(v_pool_, id, pool_block_bytes(), v);
}

void GpuBatchBackend::download_block_fp8(int32_t id, std::vector<uint8_t>& k, std::vector<uint8_t>& v,
                                         std::vector<float>& k_scale, std::vector<float>& v_scale) {
  check(options_.kv == KVPrecision::kFp8, "GPU batched engine: download_block_fp8 reads FP8 pools; these hold bf16");
  check(id >= 0 && static_cast<size_t>(id + 1) * pool_block_bytes() <= k_pool_.reserved_bytes(),
        "GPU batched engine: block " + std::to_string(id) + " outside the pool");
  commit_block(id);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const size_t sb = static_cast<size_t>(shape_.block_tokens) * sizeof(float);
  download_range(k_pool_, id, pool_block_bytes(), k);
  download_range(v_pool_, id, pool_block_bytes(), v);
  download_range(k_scale_, id, sb, k_scale);
  download_range(v_scale_, id, sb, v_scale);
}

std::vector<int32_t> GpuBatchBackend::download_table(const SequenceBlocks& seq) const {
  const int64_t per_slot = static_cast<int64_t>(shape_.num_layers) * shape_.num_kv_heads * max_blocks_;
  std::vector<int32_t> out(static_cast<size_t>(per_slot));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TESSERA_CUDA_CHECK(cudaMemcpy(out.data(), tables_.data() + slot_of(seq) * per_slot, out.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost));
  return out;
}

std::vector<int32_t> GpuBatchBackend::download_views(const SequenceBlocks& seq) const {
  const int64_t per_slot = static_cast<int64_t>(cfg_.num_layers) * cfg_.num_q_heads * 3;
  std::vector<int32_t> out(static_cast<size_t>(per_slot));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TESSERA_CUDA_CHECK(cudaMemcpy(out.data(), views_.data() + slot_of(seq) * per_slot, out.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost));
  return out;
}

void GpuBatchBackend::fill_random(uint64_t seed, float scale) {
  for (ReservedMemory* m : {&k_pool_, &v_pool_, &k_scale_, &v_scale_})
    if (m->reserved_bytes() > 0) m->commit(0, m->reserved_bytes());
  const PagedPools p = pools();
  if (options_.kv == KVPrecision::kFp8) {
    // (Each pool's reservation is rounded up to its chunks: the rows both the codes and the scales have.)
    const auto rows = std::min<int64_t>(static_cast<int64_t>(k_pool_.reserved_bytes()) / shape_.head_dim,
                                        static_cast<int64_t>(k_scale_.reserved_bytes() / sizeof(float)));
    fill_random_fp8(static_cast<uint8_t*>(p.k), p.k_scale, rows, shape_.head_dim, seed, scale, stream_);
    fill_random_fp8(static_cast<uint8_t*>(p.v), p.v_scale, rows, shape_.head_dim, seed + 1, scale, stream_);
  } else {
    const auto n = static_cast<int64_t>(k_pool_.reserved_bytes() / sizeof(bf16));
    fill_uniform_bf16(static_cast<bf16*>(p.k), n, seed, scale, stream_);
    fill_uniform_bf16(static_cast<bf16*>(p.v), n, seed + 1, scale, stream_);
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

namespace {

// A streamed sequence's memory on the GPU: its GpuStreamingKV (device buffers, evicted blocks in pinned host memory).
class GpuStreamMemory final : public StreamMemory {
 public:
  GpuStreamMemory(const ModelConfig& cfg, const StreamOptions& options) : kv(cfg, options) {}
  int64_t sequence_length() const override { return kv.decisions().length(); }
  void check_sequence(int64_t tokens) const override { kv.check_sequence(tokens); }
  void reserve(int64_t tokens) override { kv.reserve(tokens); }
  double memory_bytes() const override {
    return static_cast<double>(kv.device_bytes()) + static_cast<double>(kv.gpu_stats().pinned_bytes);
  }
  void reset() override { kv.reset(); }
  GpuStreamingKV kv;
};

GpuStreamingKV& device_stream(StreamMemory* memory) {
  auto* m = dynamic_cast<GpuStreamMemory*>(memory);
  check(m != nullptr, "GPU batched engine: streaming memory not made by the GPU backend's new_stream");
  return m->kv;
}

}  // namespace

GpuStreamingKV* gpu_stream_kv(StreamMemory* memory) { return memory == nullptr ? nullptr : &device_stream(memory); }

const GpuStreamingKV* gpu_stream_kv(const StreamMemory* memory) {
  return gpu_stream_kv(const_cast<StreamMemory*>(memory));
}

namespace {

// The attention of a decode step of streamed rows: row i's memory rotates its q and k and attends (one token at
// pos[i]) within its own layout, as the single-sequence GPU engine's decode does.
class StreamRowsStep final : public GpuAttentionStep {
 public:
  StreamRowsStep(const GpuOps& ops, std::vector<GpuStreamingKV*> rows, std::vector<int32_t> pos)
      : ops_(ops), rows_(std::move(rows)), pos_(std::move(pos)) {}
  bool rotates(int32_t) const override { return true; }
  void attend(int32_t layer, const GpuQkv& qkv, bf16* out, cudaStream_t stream) override {
    const ModelConfig& cfg = ops_.config();
    const int64_t QD = static_cast<int64_t>(cfg.num_q_heads) * cfg.head_dim;
    for (size_t i = 0; i < rows_.size(); ++i) {
      const auto r = static_cast<int64_t>(i);
      rows_[i]->attend(layer, pos_[i], 1, qkv.q + r * qkv.q_ld, qkv.k + r * qkv.kv_ld, qkv.v + r * qkv.kv_ld,
                       ops_.inv_freq(layer), ops_.host_inv_freq(layer), ops_.attention_scale(), out + r * QD, stream);
    }
  }

 private:
  const GpuOps& ops_;
  std::vector<GpuStreamingKV*> rows_;
  std::vector<int32_t> pos_;
};

}  // namespace

std::unique_ptr<StreamMemory> GpuBatchBackend::new_stream(const StreamOptions& options) {
  return std::make_unique<GpuStreamMemory>(cfg_, options);
}

template <class Run>
auto GpuBatchBackend::stream_chunk(StreamMemory& memory, std::span<const int32_t> tokens, int32_t pos,
                                   StreamingKV::ChunkKind kind, bool wait, const Run& run) {
  GpuStreamingKV& kv = device_stream(&memory);
  const int64_t end = static_cast<int64_t>(pos) + static_cast<int64_t>(tokens.size());
  check(end < (int64_t{1} << 31), "streaming: a sequence of " + std::to_string(end) + " tokens (at most 2^31 - 1)");
  kv.check_sequence(end);
  kv.reserve(end);
  kv.begin_chunk(pos, static_cast<int32_t>(tokens.size()), kind);
  try {
    auto out = run(kv);
    // The host runs ahead between the chunks of a prompt (as the single-sequence GPU engine did: a 128K prompt's
    // stream chunks are ~60, and a wait after each cost 1% of its TTFT); the chunk that returns logits or ends
    // the prompt waits, and its errors surface there.
    if (wait || kind == StreamingKV::ChunkKind::LastPrefill) {
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      collect_timers();
    }
    return out;
  } catch (...) {
    cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
    throw;
  }
}

std::vector<float> GpuBatchBackend::prefill_stream_chunk(StreamMemory& memory, std::span<const int32_t> tokens,
                                                         int32_t pos, StreamingKV::ChunkKind kind, bool logits) {
  const LogitRows rows = logits ? LogitRows::kLast : LogitRows::kNone;
  return stream_chunk(memory, tokens, pos, kind, logits,
                      [&](GpuStreamingKV& kv) { return prefill_->run(tokens, pos, kv, rows); });
}

std::vector<float> GpuBatchBackend::prefill_stream_chunk_rows(StreamMemory& memory, std::span<const int32_t> tokens,
                                                              int32_t pos, StreamingKV::ChunkKind kind) {
  return stream_chunk(memory, tokens, pos, kind, true,
                      [&](GpuStreamingKV& kv) { return prefill_->run(tokens, pos, kv, LogitRows::kAll); });
}

std::vector<double> GpuBatchBackend::prefill_stream_chunk_logprobs(StreamMemory& memory,
                                                                   std::span<const int32_t> tokens, int32_t pos,
                                                                   StreamingKV::ChunkKind kind,
                                                                   std::span<const int32_t> next) {
  return stream_chunk(memory, tokens, pos, kind, true,
                      [&](GpuStreamingKV& kv) { return prefill_->score(tokens, pos, kv, next); });
}

int64_t GpuBatchBackend::run_stream_step(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  const auto n = static_cast<int64_t>(tokens.size());
  std::vector<GpuStreamingKV*> kvs;
  std::vector<int32_t> pos;
  std::vector<int32_t> step(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < n; ++i) {
    const DecodeRow& row = rows[static_cast<size_t>(i)];
    check(row.stream != nullptr, "GPU batched decode: a batch mixes streamed and paged rows");
    GpuStreamingKV& kv = device_stream(row.stream);
    const int32_t p = kv.decisions().length();
    const int32_t tok = tokens[static_cast<size_t>(i)];
    check(tok >= 0 && tok < cfg_.vocab_size,
          "GPU batched decode: token id " + std::to_string(tok) + " outside the vocabulary");
    kv.check_sequence(static_cast<int64_t>(p) + 1);
    kv.reserve(static_cast<int64_t>(p) + 1);
    kv.begin_chunk(p, 1, StreamingKV::ChunkKind::Decode);
    kvs.push_back(&kv);
    pos.push_back(p);
    step[static_cast<size_t>(i)] = tok;
    step[static_cast<size_t>(n + i)] = p;
  }
  StreamRowsStep attention(*ops_, std::move(kvs), std::move(pos));
  // The paged steps' graphs hold the scratch's addresses: a buffer that grows here invalidates them.
  bool grew = ops_->reserve(n, n, attention);
  grew |= grow(step_, 2 * n);
  if (grew) drop_graphs();
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(step_.data(), step.data(), step.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                     stream_));
  ops_->begin(n, step_.data(), 0, step_.data() + n, attention);
  run_layers(cfg_, *ops_);
  ops_->head(0);
  last_rows_ = n;
  return n;
}

int64_t GpuBatchBackend::run_step(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  const auto n = static_cast<int64_t>(tokens.size());
  check(rows.size() == tokens.size(), "GPU batched decode: one row per token");
  if (n > 0 && rows.front().stream != nullptr) return run_stream_step(tokens, rows);
  const int64_t np = options_.pad_rows ? padded_rows(n) : n;
  const int32_t L = cfg_.num_layers, Hkv = cfg_.num_kv_heads;
  const int64_t Bt = shape_.block_tokens;

  // Step data: tokens, positions, slots, lengths, then the block of each (row, layer, kv head)'s new row; the
  // padding rows decode token 0 at position 0 of the scratch slot (length 1, the scratch block).
  std::vector<int32_t> step(static_cast<size_t>(4 * np + np * L * Hkv), 0);
  int64_t max_len = 0;
  for (int64_t i = 0; i < np; ++i) {
    if (i >= n) {
      step[static_cast<size_t>(2 * np + i)] = slots_;
      step[static_cast<size_t>(3 * np + i)] = 1;
      for (int64_t j = 0; j < static_cast<int64_t>(L) * Hkv; ++j)
        step[static_cast<size_t>(4 * np + i * L * Hkv + j)] = scratch_block_;
      continue;
    }
    check(rows[static_cast<size_t>(i)].seq != nullptr, "GPU batched decode: a batch mixes streamed and paged rows");
    const SequenceBlocks& seq = *rows[static_cast<size_t>(i)].seq;
    const int32_t slot = slot_of(seq);
    const int64_t pos = seq.length() - 1;
    check(tokens[static_cast<size_t>(i)] >= 0 && tokens[static_cast<size_t>(i)] < cfg_.vocab_size,
          "GPU batched decode: token id " + std::to_string(tokens[static_cast<size_t>(i)]) + " outside the vocabulary");
    step[static_cast<size_t>(i)] = tokens[static_cast<size_t>(i)];
    step[static_cast<size_t>(np + i)] = static_cast<int32_t>(pos);
    step[static_cast<size_t>(2 * np + i)] = slot;
    step[static_cast<size_t>(3 * np + i)] = static_cast<int32_t>(seq.length());
    max_len = std::max(max_len, seq.length());
    for (int32_t l = 0; l < L; ++l)
      for (int32_t h = 0; h < Hkv; ++h) {
        const int32_t id = seq.block(l, h, pos);
        step[static_cast<size_t>(4 * np + (i * L + l) * Hkv + h)] = id;
        if (pos % Bt == 0 && id >= 0) commit_block(id);  // a block's first row: its memory
      }
    // A row that starts a block: its (new) table column goes up.
    if (pos % Bt == 0) upload_table_columns(slot, seq, pos / Bt, pos / Bt + 1);
  }
  const int32_t splits = options_.splits > 0
                             ? options_.splits
                             : bucket_splits(paged_decode_splits(static_cast<int32_t>(np), Hkv, max_len, sms_));
  last_splits_ = splits;
  last_rows_ = np;
  // Buffers first (a graph holds their addresses: one that grows invalidates every graph), then the step's data.
  if (reserve_step(np, splits)) drop_graphs();
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(step_.data(), step.data(), step.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                     stream_));
  // Graphs captured before the Gemm reallocated a scratch buffer (an FP8 prefill or step with more rows) would read
  // freed memory: they are captured anew on their next use.
  const auto sync_generation = [&] {
    if (gemm_->buffer_generation() == gemm_generation_) return;
    gemm_generation_ = gemm_->buffer_generation();
    if (!graphs_.empty()) {
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      drop_graphs();
    }
  };
  sync_generation();
  const auto key = std::make_pair(np, splits);
  if (!options_.graphs || (decode_fp8_ && warmed_.insert(key).second)) {
    launch_step(np, splits);  // (FP8: its first use, eager; the Gemm may grow its buffers)
  } else {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      it = graphs_.emplace(key, capture_graph(stream_, [&] { launch_step(np, splits); })).first;
      ++step_builds_;
    }
    TESSERA_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
  }
  sync_generation();
  return np;  // `step` may go: an asynchronous copy from pageable memory returns once the data is staged
}

void GpuBatchBackend::run_rows_through_prefill(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  check(rows.size() == tokens.size(), "GPU batched decode: one row per token");
  const int64_t V = cfg_.vocab_size;
  logits_host_.assign(tokens.size() * static_cast<size_t>(V), 0.0f);
  // The rows run through the staging cache; a prefill staged there already (a server's request whose next chunk
  // comes in a later step) is set aside meanwhile and put back after, so that its rows are still there.
  DeviceKVCache set_aside;
  std::swap(set_aside, staging_);
  struct PutBack {
    DeviceKVCache& staging;
    DeviceKVCache& set_aside;
    int64_t& staged_from;  // the set-aside prefill's (load_prefix below sets it for each row)
    int64_t saved;
    ~PutBack() {
      staging.release();
      std::swap(staging, set_aside);
      staged_from = saved;
    }
  } put_back{staging_, set_aside, staged_from_, staged_from_};
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(rows[i].seq != nullptr, "GPU batched decode: a batch mixes streamed and paged rows");
    const SequenceBlocks& seq = *rows[i].seq;
    check(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size,
          "GPU batched decode: token id " + std::to_string(tokens[i]) + " outside the vocabulary");
    const auto len = static_cast<int32_t>(seq.length()), pos = len - 1;
    try {
      load_prefix(seq, pos, len);  // rows [0, pos) from the blocks
      const std::vector<float> out = prefill_->run(tokens.subspan(i, 1), pos, staging_, nullptr, len, LogitRows::kLast);
      std::copy(out.begin(), out.end(), logits_host_.begin() + static_cast<int64_t>(i) * V);
      copy_pages(seq, len, PageCopy::kToPages, pos);  // the new row into its block (the block of `pos`)
    } catch (...) {
      cudaStreamSynchronize(stream_);
      (void)cudaGetLastError();
      staging_.release();
      throw;
    }
    staging_.release();
  }
  collect_timers();
}

std::vector<float> GpuBatchBackend::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  if (tokens.empty()) return {};
  if (!paged_decode_ && rows.front().stream == nullptr) {
    run_rows_through_prefill(tokens, rows);
    return logits_host_;
  }
  run_step(tokens, rows);
  std::vector<float> out(tokens.size() * static_cast<size_t>(cfg_.vocab_size));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.data(), ops_->logits(), out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  collect_timers();
  return out;
}

std::vector<int32_t> GpuBatchBackend::decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                                    std::span<const RowChoice> choice) {
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return {};
  check(choice.size() == tokens.size(), "GPU batched decode: one sampling choice per row");
  // Rows through the prefill forward: their logits on the host, chosen there (the default).
  if (!paged_decode_ && rows.front().stream == nullptr) return BatchBackend::decode_select(tokens, rows, choice);
  run_step(tokens, rows);
  return select_on_device(ops_->logits(), choice);
}

std::vector<int32_t> GpuBatchBackend::select_on_device(float* logits, std::span<const RowChoice> choice) {
  const auto n = static_cast<int64_t>(choice.size());
  const int64_t V = cfg_.vocab_size;
  // Rows that want log-probabilities: their raw logits to the host before the edits (token_logprobs on the host).
  std::vector<int64_t> lp_rows;
  for (int64_t i = 0; i < n; ++i)
    if (choice[static_cast<size_t>(i)].logprobs >= 0 && choice[static_cast<size_t>(i)].logprobs_out) lp_rows.push_back(i);
  std::vector<float> lp_logits(lp_rows.size() * static_cast<size_t>(V));
  for (size_t j = 0; j < lp_rows.size(); ++j)
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(lp_logits.data() + j * static_cast<size_t>(V), logits + lp_rows[j] * V,
                                       static_cast<size_t>(V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  // Penalties and logit biases, in place on the step's logits.
  std::vector<RowEdit> edits;
  for (int64_t i = 0; i < n; ++i)
    for (const LogitEdit& e : choice[static_cast<size_t>(i)].edits) edits.push_back({static_cast<int32_t>(i), e});
  if (!edits.empty()) {
    row_edits_.upload(edits, stream_);
    edit_rows(logits, V, row_edits_.data(), static_cast<int32_t>(edits.size()), stream_);
  }
  // chosen_[0, n): every row's argmax; chosen_[n, n + sampled): the sampled rows' draws.
  std::vector<SampleRow> sampled;
  for (int64_t i = 0; i < n; ++i) {
    const SamplingOptions& o = choice[static_cast<size_t>(i)].options;
    if (o.temperature > 0.0f)
      sampled.push_back(
          {static_cast<int32_t>(i), o.top_k, o.temperature, o.top_p, choice[static_cast<size_t>(i)].u, o.min_p});
  }
  const auto m = static_cast<int64_t>(sampled.size());
  if (static_cast<int64_t>(chosen_.size()) < n + m) chosen_.resize(static_cast<size_t>(n + m));
  row_argmax(logits, n, V, V, chosen_.data(), stream_);
  if (m > 0) {
    if (static_cast<int64_t>(sample_scratch_.size()) < m * V) sample_scratch_.resize(static_cast<size_t>(m * V));
    sample_rows_.upload(sampled, stream_);
    sample_rows(logits, V, static_cast<int32_t>(V), sample_rows_.data(), static_cast<int32_t>(m),
                sample_scratch_.data(), chosen_.data() + n, stream_);
  }
  std::vector<int32_t> got(static_cast<size_t>(n + m));
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(got.data(), chosen_.data(), got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                     stream_));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int64_t j = 0; j < m; ++j) got[static_cast<size_t>(sampled[static_cast<size_t>(j)].row)] = got[static_cast<size_t>(n + j)];
  got.resize(static_cast<size_t>(n));
  collect_timers();
  for (size_t j = 0; j < lp_rows.size(); ++j) {
    const RowChoice& c = choice[static_cast<size_t>(lp_rows[j])];
    *c.logprobs_out = token_logprobs(std::span<const float>(lp_logits).subspan(j * static_cast<size_t>(V), static_cast<size_t>(V)),
                                     got[static_cast<size_t>(lp_rows[j])], c.logprobs);
  }
  return got;
}

std::vector<int32_t> GpuBatchBackend::mixed_step(std::span<const int32_t> chunk, int32_t pos, int32_t total_len,
                                                 const attn::AttentionPolicy* policy, bool logits,
                                                 std::vector<float>* chunk_logits, std::span<const int32_t> tokens,
                                                 std::span<const DecodeRow> rows, std::span<const RowChoice> choice) {
  const bool paged = !rows.empty() && std::none_of(rows.begin(), rows.end(), [](const DecodeRow& r) { return r.stream != nullptr; });
  // (4-bit decode: the decode rows keep their own step, whose products of up to kW4Rows rows read the 4-bit weights.)
  if (!paged || chunk.empty() || !paged_decode_ || (fp8_ != nullptr && !decode_fp8_) || w4_ != nullptr)
    return BatchBackend::mixed_step(chunk, pos, total_len, policy, logits, chunk_logits, tokens, rows, choice);
  check(chunk_logits != nullptr, "mixed step: no place for the chunk's logits");
  check(rows.size() == tokens.size() && choice.size() == tokens.size(),
        "GPU mixed step: one decode row and one sampling choice per token");
  if (pos == 0) begin_staging(total_len);
  const auto n = static_cast<int64_t>(chunk.size()), B = static_cast<int64_t>(tokens.size()), N = n + B;
  const int32_t L = cfg_.num_layers, Hkv = cfg_.num_kv_heads;
  const int64_t Bt = shape_.block_tokens;
  // positions [N] (the chunk's pos + i, the decode rows' last), then the decode rows' slots [B], lengths [B] and the
  // block of each (row, layer, kv head)'s new row [B, L, Hkv], as run_step's (no padding rows).
  std::vector<int32_t> data(static_cast<size_t>(N + 2 * B + B * L * Hkv), 0);
  std::vector<int32_t> all(chunk.begin(), chunk.end());
  all.insert(all.end(), tokens.begin(), tokens.end());
  for (int64_t i = 0; i < n; ++i) data[static_cast<size_t>(i)] = pos + static_cast<int32_t>(i);
  int64_t max_len = 0;
  for (int64_t i = 0; i < B; ++i) {
    const SequenceBlocks& seq = *rows[static_cast<size_t>(i)].seq;
    const int32_t slot = slot_of(seq);
    const int64_t p = seq.length() - 1;
    data[static_cast<size_t>(n + i)] = static_cast<int32_t>(p);
    data[static_cast<size_t>(N + i)] = slot;
    data[static_cast<size_t>(N + B + i)] = static_cast<int32_t>(seq.length());
    max_len = std::max(max_len, seq.length());
    for (int32_t l = 0; l < L; ++l)
      for (int32_t h = 0; h < Hkv; ++h) {
        const int32_t id = seq.block(l, h, p);
        data[static_cast<size_t>(N + 2 * B + (i * L + l) * Hkv + h)] = id;
        if (p % Bt == 0 && id >= 0) commit_block(id);
      }
    if (p % Bt == 0) upload_table_columns(slot, seq, p / Bt, p / Bt + 1);
  }
  const int32_t splits = options_.splits > 0
                             ? options_.splits
                             : bucket_splits(paged_decode_splits(static_cast<int32_t>(B), Hkv, max_len, sms_));
  const int64_t D = cfg_.head_dim;
  // The decode graphs hold o_part_ / lse_part_'s addresses: a buffer that grows here invalidates them.
  bool grew = grow(o_part_, B * cfg_.num_q_heads * splits * D);
  grew |= grow(lse_part_, B * cfg_.num_q_heads * splits);
  if (grew) drop_graphs();
  grow(mixed_, static_cast<int64_t>(data.size()));
  try {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(mixed_.data(), data.data(), data.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_));
    const int32_t* d = mixed_.data();
    set_layout(d + n, d + N, d + N + B, d + N + 2 * B, B, splits);
    prefill_->run_mixed(all, static_cast<int32_t>(n), pos, staging_, policy, total_len, d, *paged_, logits);
    float* out = prefill_->ops().logits();
    const int64_t V = cfg_.vocab_size;
    chunk_logits->clear();
    if (logits) {
      chunk_logits->resize(static_cast<size_t>(V));
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(chunk_logits->data(), out, static_cast<size_t>(V) * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream_));
    }
    std::vector<int32_t> got = select_on_device(logits ? out + V : out, choice);  // (synchronises)
    last_rows_ = B;
    return got;
  } catch (...) {
    cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
    throw;
  }
}

bool GpuBatchBackend::reserve_step(int64_t n, int32_t splits) {
  const int64_t D = cfg_.head_dim;
  bool grew = ops_->reserve(n, n, *paged_);
  grew |= grow(step_, 4 * n + n * cfg_.num_layers * cfg_.num_kv_heads);
  grew |= grow(o_part_, n * cfg_.num_q_heads * splits * D);
  grew |= grow(lse_part_, n * cfg_.num_q_heads * splits);
  return grew;
}

void GpuBatchBackend::drop_graphs() noexcept {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
}

void GpuBatchBackend::set_layout(const int32_t* pos, const int32_t* slot, const int32_t* len, const int32_t* blocks,
                                 int64_t rows, int32_t splits) {
  PagedLayout& p = layout_;
  p.pools = pools();
  p.tables = tables_.data();
  p.views = views_.data();
  p.block_tokens = shape_.block_tokens;
  p.max_blocks = max_blocks_;
  p.row_pos = pos;
  p.row_slot = slot;
  p.row_len = len;
  p.blocks = blocks;
  p.rows = static_cast<int32_t>(rows);
  p.splits = splits;
  p.o_part = o_part_.data();
  p.lse_part = lse_part_.data();
}

void GpuBatchBackend::launch_step(int64_t n, int32_t splits) {
  const int32_t* d_tokens = step_.data();
  set_layout(d_tokens + n, d_tokens + 2 * n, d_tokens + 3 * n, d_tokens + 4 * n, n, splits);
  ops_->begin(n, d_tokens, 0, layout_.row_pos, *paged_);
  run_layers(cfg_, *ops_);
  ops_->head(0);
}

}  // namespace tessera::runtime::gpu
