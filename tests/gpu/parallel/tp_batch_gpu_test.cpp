// The batched tensor-parallel engine on ONE GPU (parallel/cuda/tp_batch_gpu.h; `serve --gpus N --parallel M`): its
// rank backend against the one-GPU batched backend (runtime/cuda/batch_gpu.h) on the real models.
//  - one rank (SingleRank: no all-reduce; and a one-rank SameDeviceGroup, whose all-reduce hook runs: Gemma-3's
//    post-norm path) gives the one-GPU backend's logits, prefill and batched decode;
//  - SmolLM2 (3 KV heads) over 3 ranks on the same GPU, each rank a thread with its own stream and backend, rank 0's
//    calls sent through the wire format (TpBatchLeader -> tp_batch_worker), the partial sums added on the device in
//    rank order (SameDeviceGroup, CUDA graphs off): logits within the tensor-parallel GPU tests' bf16 tolerance
//    (rel L2 < 2e-2), and the batched engine's greedy requests start with the one-GPU engine's tokens.
// Skips when a model file is missing (scripts/setup.sh models).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "../../test_support.h"
#include "../../tp_wire.h"
#include "cuda/cuda_check.h"
#include "model/model.h"
#include "parallel/cuda/collective.h"
#include "parallel/cuda/tp_batch_gpu.h"
#include "parallel/tp_batch.h"
#include "runtime/batch_engine.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"
#include "runtime/paged_kv.h"
#include "../gpu_test_support.h"

using namespace tessera;
using namespace tessera::parallel;
using runtime::gpu::GpuBatchBackend;
using runtime::gpu::GpuBatchOptions;
using test::random_tokens;  // called with lowest 100: the prompts draw tokens from 100 up

namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, n = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    d += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d / std::max(n, 1e-30));
}

// Drives a backend as the scheduler does: three prompts prefilled (last-row logits), then `steps` batched decode
// steps of all three with fixed tokens. Returns every logits row (3 prefill rows, then 3 per step).
std::vector<std::vector<float>> drive(runtime::BatchBackend& b, const runtime::ModelConfig& c, int steps) {
  const runtime::PagedKVShape shape{c.num_layers, c.num_kv_heads, c.head_dim, 64};
  const int32_t blocks = 3 * c.num_layers * c.num_kv_heads * (2048 / 64 + 2);
  b.create_store(shape, blocks, 4, 2048);
  runtime::BlockPool pool(blocks);
  std::vector<std::unique_ptr<runtime::SequenceBlocks>> seqs;
  std::vector<std::vector<runtime::DecodeView>> views;
  std::vector<std::vector<float>> out;
  const int32_t lengths[3] = {333, 700, 1100};
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> p = random_tokens(lengths[i], c.vocab_size, 11u + static_cast<uint32_t>(i), 100);
    out.push_back(b.prefill_chunk(p, 0, lengths[i], nullptr, true));
    views.push_back(runtime::decode_views(c, nullptr, lengths[i]));
    seqs.push_back(std::make_unique<runtime::SequenceBlocks>(shape, runtime::kv_retention(c, views.back())));
    seqs.back()->grow(lengths[i], pool);
    b.finish_prefill(*seqs.back(), views.back());
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> tokens;
    std::vector<runtime::DecodeRow> rows;
    for (int i = 0; i < 3; ++i) {
      seqs[static_cast<size_t>(i)]->grow(1, pool);
      tokens.push_back(static_cast<int32_t>((1000 + 37 * s + 101 * i) % c.vocab_size));
      rows.push_back(runtime::DecodeRow{seqs[static_cast<size_t>(i)].get(), views[static_cast<size_t>(i)], nullptr});
    }
    const std::vector<float> logits = b.decode(tokens, rows);
    for (int i = 0; i < 3; ++i)
      out.emplace_back(logits.begin() + static_cast<int64_t>(i) * c.vocab_size,
                       logits.begin() + static_cast<int64_t>(i + 1) * c.vocab_size);
  }
  for (auto& s : seqs) {
    b.release_sequence(*s);
    s->release(pool);
  }
  return out;
}

std::vector<runtime::BatchRequest> greedy_requests(const runtime::ModelConfig& c) {
  std::vector<runtime::BatchRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    runtime::BatchRequest r;
    r.prompt = random_tokens(200 + 300 * i, c.vocab_size, 50u + static_cast<uint32_t>(i), 100);
    r.options.max_new_tokens = 12;
    reqs.push_back(r);
  }
  return reqs;
}

std::vector<std::vector<int32_t>> run_engine(runtime::BatchBackend& b, const std::vector<runtime::BatchRequest>& reqs) {
  runtime::BatchEngineOptions o;
  o.max_batch = 3;
  o.max_context = 4096;
  o.kv_bytes = 256e6;
  runtime::BatchEngine engine(b, o);
  return engine.generate_all(reqs);
}

}  // namespace

TEST(TpBatchGpu, OneRankEqualsTheOneGpuBackend) {
  for (const char* file : {"smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"}) {
    const std::string path = test::real_model_path(file);
    if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing";
    const auto model = runtime::Model::load(path);
    const runtime::ModelConfig& c = model->config();
    const Placement one = uniform_rank_placement(c, 1);
    const auto dev = runtime::gpu::DeviceModel::upload(*model);
    for (bool graphs : {true, false}) {
      GpuBatchOptions go;
      go.graphs = graphs;
      GpuBatchBackend ref(*dev, go);
      const auto want = drive(ref, c, 5);
      SingleRank single;
      TpRankBatchBackend rank(*model, one, 0, single, go);
      const auto got = drive(rank, c, 5);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_l2(got[i], want[i]), 1e-6) << file << " row " << i;
      if (graphs) continue;
      // The all-reduce hook on (a group of one: x = 0 + x), graphs off: Gemma-3's post-norm reduction path.
      SameDeviceGroup group(1);
      auto comm = group.rank(0);
      TpRankBatchBackend hooked(*model, one, 0, *comm, go);
      hooked.inner().set_rank_reduce({0, [&](float* x, size_t n, cudaStream_t s) { comm->all_reduce_sum(x, n, s); }});
      const auto got2 = drive(hooked, c, 5);
      for (size_t i = 0; i < got2.size(); ++i) EXPECT_LT(rel_l2(got2[i], want[i]), 1e-6) << file << " hooked row " << i;
    }
  }
}

TEST(TpBatchGpu, ThreeRanksOnOneGpuEqualTheOneGpuBackend) {
  const std::string path = test::real_model_path("smollm2-135m-instruct-q4_1.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing";
  const auto model = runtime::Model::load(path);
  const runtime::ModelConfig& c = model->config();
  ASSERT_EQ(c.num_kv_heads % 3, 0);
  GpuBatchOptions go;
  go.graphs = false;  // the same-device all-reduce meets on the host
  const auto dev = runtime::gpu::DeviceModel::upload(*model);
  GpuBatchBackend ref(*dev, go);
  const auto want = drive(ref, c, 6);
  const auto want_tokens = run_engine(ref, greedy_requests(c));

  constexpr int kRanks = 3;
  const Placement p = uniform_rank_placement(c, kRanks);
  SameDeviceGroup group(kRanks);
  std::vector<std::unique_ptr<Collective>> comms;
  for (int r = 0; r < kRanks; ++r) comms.push_back(group.rank(r));
  std::vector<std::unique_ptr<TpRankBatchBackend>> ranks;
  for (int r = 0; r < kRanks; ++r)
    ranks.push_back(std::make_unique<TpRankBatchBackend>(*model, p, r, *comms[static_cast<size_t>(r)], go));

  // Twice through the protocol: the driver's calls, then the batched engine's.
  for (int round = 0; round < 2; ++round) {
    std::vector<Wire> wires(kRanks - 1);
    std::vector<Wire*> wp;
    for (Wire& w : wires) wp.push_back(&w);
    LeaderChannel lc(wp);
    std::vector<std::thread> followers;
    for (int r = 1; r < kRanks; ++r)
      followers.emplace_back([&, r] {
        TESSERA_CUDA_CHECK(cudaSetDevice(0));
        WorkerChannel wc(wires[static_cast<size_t>(r - 1)]);
        tp_batch_worker(wc, *ranks[static_cast<size_t>(r)], attn::PolicyShape{c.num_layers, c.num_q_heads, c.num_kv_heads});
      });
    TpBatchLeader leader(lc, *ranks[0]);
    if (round == 0) {
      const auto got = drive(leader, c, 6);
      EXPECT_EQ(got.size(), want.size());
      for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) EXPECT_LT(rel_l2(got[i], want[i]), 2e-2) << "row " << i;
    } else {
      const auto got = run_engine(leader, greedy_requests(c));
      EXPECT_EQ(got.size(), want_tokens.size());
      int same = 0;
      for (size_t i = 0; i < std::min(got.size(), want_tokens.size()); ++i) {
        EXPECT_FALSE(got[i].empty());
        if (!got[i].empty()) {
          EXPECT_EQ(got[i][0], want_tokens[i][0]) << "request " << i << "'s first token";
        }
        same += got[i] == want_tokens[i] ? 1 : 0;
      }
      std::printf("3 ranks on one GPU: %d of %zu greedy requests identical to the one-GPU engine's 12 tokens\n", same,
                  got.size());
    }
    leader.quit();
    for (std::thread& t : followers) t.join();
  }
}
