// Device memory reserved up front and committed on use (runtime/cuda/reserved_memory.h), and the GPU engine's KV pool
// over it: a prompt's KV held once after its move into the blocks, the same logits as a pool allocated whole. ctest
// runs it alone (RUN_SERIAL, *_serial_test): it reads the whole device's free memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/reserved_memory.h"
#include "runtime/cuda/synthetic_config.h"
#include "../gpu_test_support.h"

namespace tessera::runtime::gpu {
namespace {

size_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  return free_bytes;
}

std::vector<unsigned char> bytes_at(const ReservedMemory& m, size_t offset, size_t n) {
  std::vector<unsigned char> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), static_cast<const char*>(m.data()) + offset, n, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

// Sets TESSERA_GPU_VMM for one scope.
struct VmmSetting {
  explicit VmmSetting(const char* value) { setenv("TESSERA_GPU_VMM", value, 1); }
  ~VmmSetting() { unsetenv("TESSERA_GPU_VMM"); }
};

TEST(ReservedMemory, CommitsTheChunksWrittenAndGivesThemBack) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  ReservedMemory m;
  const size_t free0 = free_device_bytes();
  m.reserve(size_t{1} << 30);
  if (!m.lazy()) GTEST_SKIP() << "the device has no virtual memory management";
  const size_t c = m.chunk_bytes();
  ASSERT_GT(c, 0u);
  EXPECT_EQ(m.reserved_bytes() % c, 0u);
  EXPECT_GE(m.reserved_bytes(), size_t{1} << 30);
  EXPECT_EQ(m.committed_bytes(), 0u);
  // Address space only: the free memory does not move by a chunk.
  EXPECT_LT(free0 - std::min(free0, free_device_bytes()), c);

  m.commit(3 * c + 5, 10);  // inside chunk 3
  EXPECT_EQ(m.committed_bytes(), c);
  m.commit(3 * c, c);  // the same chunk again
  EXPECT_EQ(m.committed_bytes(), c);
  m.commit(3 * c - 1, 2);  // chunks 2 and 3
  EXPECT_EQ(m.committed_bytes(), 2 * c);
  EXPECT_GE(free0 - free_device_bytes(), 2 * c - (size_t{4} << 20));

  ASSERT_EQ(cudaMemset(static_cast<char*>(m.data()) + 2 * c, 0xAB, 2 * c), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(bytes_at(m, 2 * c, 4), std::vector<unsigned char>(4, 0xAB));
  EXPECT_EQ(bytes_at(m, 4 * c - 4, 4), std::vector<unsigned char>(4, 0xAB));

  m.decommit_all(3 * c + 100, 1);  // keeps chunk 3 only
  EXPECT_EQ(m.committed_bytes(), c);
  EXPECT_EQ(bytes_at(m, 3 * c, 4), std::vector<unsigned char>(4, 0xAB));

  try {
    m.commit(m.reserved_bytes() - 1, 2);
    ADD_FAILURE() << "a commit past the reservation";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "reserved device memory: commit of [" + std::to_string(m.reserved_bytes() - 1) +
                                         ", " + std::to_string(m.reserved_bytes() + 1) + ") past the " +
                                         std::to_string(m.reserved_bytes()) + " bytes reserved");
  }
  // What a commit costs (the first decode step after a long prefill commits the prompt's blocks: 17 GB at 128K
  // for Llama-3-8B shapes).
  const auto t0 = std::chrono::steady_clock::now();
  m.commit(0, m.reserved_bytes());
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(m.committed_bytes(), m.reserved_bytes());
  std::printf("[commit] %zu chunks of %.0f MB in %.2f ms (%.3f ms a chunk)\n", m.reserved_bytes() / c - 1, c / 1e6,
              ms, ms / static_cast<double>(m.reserved_bytes() / c - 1));
  m.release();
  EXPECT_EQ(m.data(), nullptr);
  EXPECT_EQ(m.committed_bytes(), 0u);
  EXPECT_LT(free0 - std::min(free0, free_device_bytes()), c);
}

// A reservation under a chunk (a small model's KV pool, e.g. 49.2 MB) is one chunk of its size rounded up to the
// granularity, which need not be a power of two.
TEST(ReservedMemory, ASmallReservationIsOneChunk) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  ReservedMemory m;
  m.reserve(49'200'000);
  if (!m.lazy()) GTEST_SKIP() << "the device has no virtual memory management";
  EXPECT_EQ(m.reserved_bytes(), m.chunk_bytes());
  EXPECT_GE(m.chunk_bytes(), size_t{49'200'000});
  m.commit(49'199'999, 1);
  EXPECT_EQ(m.committed_bytes(), m.chunk_bytes());
  ASSERT_EQ(cudaMemset(m.data(), 0x11, 49'200'000), cudaSuccess);
  EXPECT_EQ(bytes_at(m, 49'199'998, 2), std::vector<unsigned char>(2, 0x11));
}

TEST(ReservedMemory, WithoutVmmEverythingIsAllocatedAtOnce) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  VmmSetting off("0");
  ReservedMemory m;
  m.reserve(size_t{10} << 20);
  EXPECT_FALSE(m.lazy());
  EXPECT_EQ(m.reserved_bytes(), size_t{10} << 20);
  EXPECT_EQ(m.committed_bytes(), size_t{10} << 20);
  m.commit(0, size_t{10} << 20);  // nothing to do
  ASSERT_EQ(cudaMemset(m.data(), 0x5A, size_t{10} << 20), cudaSuccess);
  EXPECT_EQ(bytes_at(m, (size_t{10} << 20) - 3, 3), std::vector<unsigned char>(3, 0x5A));
}

struct PoolRun {
  std::vector<float> prefill, decoded;
  size_t pool_bytes = 0;   // the pools' committed memory after the first decode
  size_t kv_in_use = 0;    // the blocks the sequence holds
  size_t used_growth = 0;  // device memory in use after the decode, less before the engine was made
};

PoolRun prefill_then_decode(const DeviceModel& dev, int64_t n) {
  GpuEngineOptions eo;
  eo.chunk_size = 4096;
  eo.max_context = 65536;
  PoolRun r;
  const size_t free0 = free_device_bytes();
  GpuEngine engine(dev, eo);
  const std::vector<int32_t> tokens = test::lcg_tokens(n, dev.config().vocab_size, 11);
  r.prefill = engine.prefill(tokens);
  r.decoded = engine.decode(tokens[5]);  // moves the staged rows into the blocks first
  r.pool_bytes = engine.batch_backend().pool_bytes();
  r.kv_in_use = engine.memory().kv_cache_bytes;
  r.used_growth = free0 - std::min(free0, free_device_bytes());
  return r;
}

// A pool sized for 64K tokens holds, after a 16K-token prompt and one decode step, the memory of the blocks the
// sequence uses (to a chunk per pool), not the whole budget; the logits equal those of a pool allocated whole.
TEST(GpuEngineMemory, ThePoolHoldsTheBlocksInUseAndTheSameLogits) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device available";
  ModelConfig cfg = synthetic_config("llama3-8b");
  cfg.num_layers = 2;
  cfg.layers.resize(2);
  const auto dev = DeviceModel::random(cfg, 5);
  const int64_t n = 16384;
  const PoolRun lazy = prefill_then_decode(*dev, n);
  PoolRun whole;
  {
    VmmSetting off("0");
    whole = prefill_then_decode(*dev, n);
  }
  EXPECT_EQ(lazy.prefill, whole.prefill);
  EXPECT_EQ(lazy.decoded, whole.decoded);
  // 16,385 rows x 2 layers x 8 kv heads x 128 x (K, V) x bf16, in blocks.
  EXPECT_GE(lazy.kv_in_use, size_t{16385} * 2 * 8 * 128 * 2 * 2);
  EXPECT_LT(lazy.kv_in_use, size_t{16385 + 256} * 2 * 8 * 128 * 2 * 2);
  ReservedMemory probe;
  probe.reserve(1);
  if (probe.lazy()) {
    // K and V: each its blocks in use rounded up to a chunk, and the padding rows' scratch block's chunk.
    const size_t chunk = ReservedMemory::kMaxChunkBytes;
    EXPECT_GE(lazy.pool_bytes, lazy.kv_in_use);
    EXPECT_LE(lazy.pool_bytes, lazy.kv_in_use + 4 * chunk);
    // The whole pool: 64K tokens' worth.
    EXPECT_GE(whole.pool_bytes, size_t{65536} * 2 * 8 * 128 * 2 * 2);
    // The device memory the two runs hold differs by the pools' difference (the staged prompt is gone in both).
    EXPECT_NEAR(static_cast<double>(whole.used_growth) - static_cast<double>(lazy.used_growth),
                static_cast<double>(whole.pool_bytes) - static_cast<double>(lazy.pool_bytes), 16e6);
  }
  std::printf("[memory] pool committed %.1f MB (blocks in use %.1f MB); whole pool %.1f MB; device memory growth "
              "%.1f vs %.1f MB\n",
              lazy.pool_bytes / 1e6, lazy.kv_in_use / 1e6, whole.pool_bytes / 1e6, lazy.used_growth / 1e6,
              whole.used_growth / 1e6);
}

}  // namespace
}  // namespace tessera::runtime::gpu
