#include "parallel/cuda/tp_batch_gpu.h"

#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "parallel/cuda/tp_sum.h"

namespace tessera::parallel {

using runtime::DecodeRow;
using runtime::DecodeView;
using runtime::SequenceBlocks;

TpRankBatchBackend::TpRankBatchBackend(const runtime::Model& model, const Placement& placement, int32_t rank,
                                       Collective& comm, runtime::gpu::GpuBatchOptions options)
    : config_(model.config()), slice_(rank_slice(model.config(), placement, rank)) {
  TESSERA_CUDA_CHECK(cudaGetDevice(&gpu_));
  check(comm.world() == placement.num_gpus && comm.rank() == rank,
        "tensor-parallel batching: rank " + std::to_string(rank) + " of " + std::to_string(placement.num_gpus) +
            " GPUs over a collective of rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.world()));
  device_ = runtime::gpu::DeviceModel::upload(rank_config(config_, slice_),
                                              rank_weights(config_, model.weights(), placement, rank));
  inner_ = std::make_unique<runtime::gpu::GpuBatchBackend>(*device_, options);
  if (placement.num_gpus > 1)
    inner_->set_rank_reduce({rank, [&comm](float* x, size_t count, cudaStream_t stream) {
                               comm.all_reduce_sum(x, count, stream);
                             }});
}

void TpRankBatchBackend::sync() { TESSERA_CUDA_CHECK(cudaStreamSynchronize(inner_->stream())); }

void TpRankBatchBackend::use() const { TESSERA_CUDA_CHECK(cudaSetDevice(gpu_)); }

void TpRankBatchBackend::create_store(const runtime::PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                                      int32_t max_context) {
  use();
  check(shape.num_kv_heads == config_.num_kv_heads, "tensor-parallel batching: a store of " +
                                                        std::to_string(shape.num_kv_heads) + " KV heads, the model has " +
                                                        std::to_string(config_.num_kv_heads));
  tables_ = std::make_unique<RankTables>(shape, slice_);
  inner_->create_store(tables_->shape(), num_blocks, max_sequences, max_context);
  sync();
}

std::vector<float> TpRankBatchBackend::prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                     const attn::AttentionPolicy* policy, bool logits) {
  use();
  const attn::AttentionPolicy p = rank_policy(policy, slice_);
  std::vector<float> out = inner_->prefill_chunk(tokens, pos, total_len, p.table().empty() ? nullptr : &p, logits);
  sync();
  return out;
}

std::vector<float> TpRankBatchBackend::prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos,
                                                          int32_t total_len, const attn::AttentionPolicy* policy) {
  use();
  const attn::AttentionPolicy p = rank_policy(policy, slice_);
  std::vector<float> out = inner_->prefill_chunk_rows(tokens, pos, total_len, p.table().empty() ? nullptr : &p);
  sync();
  return out;
}

void TpRankBatchBackend::finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) {
  use();
  std::vector<DecodeView>& v = views_[&seq];
  v = rank_views(views, config_, slice_);
  inner_->finish_prefill(tables_->sync(seq, /*whole=*/true), v);
  sync();
}

void TpRankBatchBackend::load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) {
  use();
  inner_->load_prefix(tables_->sync(seq, /*whole=*/true), rows, total_len);
  sync();
}

void TpRankBatchBackend::release_sequence(const SequenceBlocks& seq) {
  use();
  if (tables_ != nullptr) {
    inner_->release_sequence(tables_->sync(seq, /*whole=*/false));
    tables_->forget(seq);
  }
  views_.erase(&seq);
}

void TpRankBatchBackend::abort_prefill() {
  use();
  inner_->abort_prefill();
}

std::vector<DecodeRow> TpRankBatchBackend::rank_rows(std::span<const DecodeRow> rows) {
  check(tables_ != nullptr, "tensor-parallel batching: decode before create_store");
  std::vector<DecodeRow> out;
  for (const DecodeRow& r : rows) {
    check(r.seq != nullptr && r.stream == nullptr, "tensor-parallel batching: a decode row without blocks");
    const auto v = views_.find(r.seq);
    check(v != views_.end(), "tensor-parallel batching: a sequence decoded before its prefill ended");
    out.push_back(DecodeRow{&tables_->sync(*r.seq, /*whole=*/false), v->second, nullptr});
  }
  return out;
}

std::vector<float> TpRankBatchBackend::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  use();
  const std::vector<DecodeRow> r = rank_rows(rows);
  std::vector<float> out = inner_->decode(tokens, r);
  sync();
  return out;
}

std::vector<int32_t> TpRankBatchBackend::decode_select(std::span<const int32_t> tokens,
                                                       std::span<const DecodeRow> rows,
                                                       std::span<const RowChoice> choice) {
  use();
  const std::vector<DecodeRow> r = rank_rows(rows);
  std::vector<int32_t> out = inner_->decode_select(tokens, r, choice);
  sync();
  return out;
}

// ---- SameDeviceGroup

class SameDeviceGroup::Rank final : public Collective {
 public:
  Rank(SameDeviceGroup& g, int32_t r) : g_(g), r_(r) {}
  int32_t rank() const override { return r_; }
  int32_t world() const override { return g_.world_; }

  // Every rank posts x and an event after its writes; each sums all x (rank order) into its own scratch, posts an
  // event after its reads; then each copies its sum over its x once every rank has read.
  void all_reduce_sum(float* x, size_t count, cudaStream_t stream) override {
    post(x, count, stream);
    std::vector<const float*> xs(g_.x_.begin(), g_.x_.end());
    if (sum_.size() < count) sum_.resize(count);
    sum_in_rank_order(xs, sum_.data(), count, stream);
    after_reads(stream);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(x, sum_.data(), count * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
  void broadcast(int32_t* x, size_t count, cudaStream_t stream) override {
    post(reinterpret_cast<float*>(x), count, stream);
    if (r_ != 0) {
      if (copy_.size() < count) copy_.resize(count);
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(copy_.data(), g_.x_[0], count * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                         stream));
    }
    after_reads(stream);
    if (r_ != 0)
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(x, copy_.data(), count * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  }
  void barrier(cudaStream_t stream) override {
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    g_.sync_.arrive_and_wait();
  }

 private:
  void post(float* x, size_t count, cudaStream_t stream) {
    g_.x_[static_cast<size_t>(r_)] = x;
    g_.count_[static_cast<size_t>(r_)] = count;
    TESSERA_CUDA_CHECK(cudaEventRecord(g_.ready_[static_cast<size_t>(r_)], stream));
    g_.sync_.arrive_and_wait();
    for (size_t k = 0; k < g_.count_.size(); ++k)
      check(g_.count_[k] == count, "same-device all-reduce: rank " + std::to_string(k) + " passed " +
                                       std::to_string(g_.count_[k]) + " values, rank " + std::to_string(r_) + " " +
                                       std::to_string(count));
    for (cudaEvent_t e : g_.ready_) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
  }
  void after_reads(cudaStream_t stream) {
    TESSERA_CUDA_CHECK(cudaEventRecord(g_.read_[static_cast<size_t>(r_)], stream));
    g_.sync_.arrive_and_wait();  // every rank has recorded its reads
    for (cudaEvent_t e : g_.read_) TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
    g_.sync_.arrive_and_wait();  // every rank waits on this round's events before the next round records them
  }

  SameDeviceGroup& g_;
  int32_t r_;
  attn::gpu::DeviceBuffer<float> sum_;
  attn::gpu::DeviceBuffer<int32_t> copy_;
};

SameDeviceGroup::SameDeviceGroup(int32_t world)
    : world_(world), sync_(world), x_(static_cast<size_t>(world), nullptr), count_(static_cast<size_t>(world), 0),
      ready_(static_cast<size_t>(world), nullptr), read_(static_cast<size_t>(world), nullptr) {
  check(world >= 1 && world <= 8, "same-device all-reduce: 1 to 8 ranks, got " + std::to_string(world));
  for (size_t r = 0; r < ready_.size(); ++r) {
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&read_[r], cudaEventDisableTiming));
  }
}

SameDeviceGroup::~SameDeviceGroup() {
  for (cudaEvent_t e : ready_)
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : read_)
    if (e != nullptr) cudaEventDestroy(e);
}

std::unique_ptr<Collective> SameDeviceGroup::rank(int32_t r) {
  check(r >= 0 && r < world_, "same-device all-reduce: rank " + std::to_string(r) + " outside [0, " +
                                  std::to_string(world_) + ")");
  return std::make_unique<Rank>(*this, r);
}

}  // namespace tessera::parallel
