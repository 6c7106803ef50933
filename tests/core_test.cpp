#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <vector>

#include "core/crash_report.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace tessera {
namespace {

TEST(DType, Bf16RoundTripsEveryBf16Value) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const bf16 h = bf16::from_bits(static_cast<uint16_t>(b));
    const float f = bf16_to_f32(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f).bits, h.bits) << "bits " << b;
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0.00390625f)), 1.0f);
  // 1 + 3*2^-8 lies between 1+2^-7 and 1+2^-6: tie goes to even, 1 + 2^-6.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * 0.00390625f)), 1.0f + 0.015625f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0.0050f)), 1.0f + 0.0078125f);
}

TEST(DType, F16RoundTripsEveryF16Value) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const f16 h = f16::from_bits(static_cast<uint16_t>(b));
    const float f = f16_to_f32(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f).bits, h.bits) << "bits " << b << " value " << f;
  }
}

TEST(DType, F16KnownValuesAndRounding) {
  EXPECT_EQ(f32_to_f16(1.0f).bits, 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f).bits, 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f).bits, 0x7c00);  // rounds up to infinity
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_EQ(f32_to_f16(5.9604645e-8f).bits, 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(2.9802322e-8f).bits, 0x0000);  // half of it: tie to even (zero)
  EXPECT_EQ(f32_to_f16(8.940697e-8f).bits, 0x0002);   // 1.5 * smallest: tie to even (2)
  EXPECT_FLOAT_EQ(f16_to_f32(f16::from_bits(0x3555)), 0.33325195f);
}

TEST(Tensor, ContiguousStridesAndShapeErrors) {
  Tensor t(DType::F32, {3, 4, 5});
  EXPECT_EQ(t.view().stride[0], 20);
  EXPECT_EQ(t.view().stride[1], 5);
  EXPECT_EQ(t.view().stride[2], 1);
  EXPECT_EQ(t.numel(), 60);
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.ptr<float>()) % 64, 0u);
  *t.view().at<float>(2, 3, 4) = 7.0f;
  EXPECT_EQ(t.ptr<float>()[59], 7.0f);
  try {
    t.view().expect_shape("q", {3, -1, 6});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "q: expected shape [3, *, 6], got [3, 4, 5]");
  }
  try {
    t.view().expect_dtype("k", {DType::BF16, DType::F16});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "k: expected dtype bf16 or f16, got f32");
  }
}

TEST(ThreadPool, RunsEveryIndexOnceAndPropagatesErrors) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.size(), 3);
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<std::atomic<int>> hits(1000);
    pool.parallel_for(1000, [&](int64_t i, int worker) {
      ASSERT_GE(worker, 0);
      ASSERT_LT(worker, 3);
      hits[static_cast<size_t>(i)].fetch_add(1);
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
  EXPECT_THROW(pool.parallel_for(100,
                                 [](int64_t i, int) {
                                   if (i == 37) throw Error("boom");
                                 }),
               Error);
  int count = 0;
  pool.parallel_for(1, [&](int64_t, int) { ++count; });  // still usable after an error
  EXPECT_EQ(count, 1);
}

TEST(MemoryBudget, SizesParseAndPrint) {
  EXPECT_EQ(parse_byte_size("24G", "x"), int64_t{24} << 30);
  EXPECT_EQ(parse_byte_size("512MiB", "x"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("1.5g", "x"), int64_t{3} << 29);
  EXPECT_EQ(parse_byte_size("1000", "x"), 1000);
  for (const char* bad : {"", "G", "12Q", "-1G", "0", "1e30T", "5 G"}) {
    try {
      parse_byte_size(bad, "--memory-budget");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("--memory-budget: '" + std::string(bad) + "' ", 0), 0u) << msg;
    }
  }
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1536.0 * 1024 * 1024), "1.61 GB");
  EXPECT_EQ(format_bytes(51.2e6), "51.2 MB");
  EXPECT_EQ(format_bytes(640e9), "640 GB");
}

TEST(MemoryBudget, ChecksAgainstTheBudgetInForce) {
  set_host_memory_budget(int64_t{8} << 30, "--memory-budget");
  EXPECT_EQ(host_memory_budget().bytes, int64_t{8} << 30);
  EXPECT_NO_THROW(check_host_allocation("x", 1e9, "y"));
  try {
    check_host_allocation("the weights of m.gguf", 12.9e9, "use a smaller model");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "the weights of m.gguf needs 12.9 GB, over the host memory budget of 8.59 GB (--memory-budget); use a "
              "smaller model, or change the budget with --memory-budget or TESSERA_MEMORY_BUDGET");
  }
  EXPECT_THROW(check_host_allocation("x", -1, "y"), Error);  // an overflowed size computation
  set_host_memory_budget(0);
  setenv("TESSERA_MEMORY_BUDGET", "3G", 1);
  EXPECT_EQ(host_memory_budget().bytes, int64_t{3} << 30);
  EXPECT_EQ(host_memory_budget().source, "TESSERA_MEMORY_BUDGET");
  setenv("TESSERA_MEMORY_BUDGET", "lots", 1);
  EXPECT_THROW(host_memory_budget(), Error);
  unsetenv("TESSERA_MEMORY_BUDGET");
  EXPECT_GT(host_memory_budget().bytes, int64_t{1} << 28);  // physical memory or the cgroup limit
}

// The CLI's crash report: the signal's name and a call stack on standard error, then death by the same signal.
TEST(CrashReport, NamesTheSignalPrintsTheStackAndDiesOfIt) {
  if (!tessera::crash_report_available()) GTEST_SKIP() << "a sanitizer build: the sanitizer reports crashes";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_crash_report();
        std::raise(SIGSEGV);
      },
      testing::KilledBySignal(SIGSEGV), "tessera: fatal signal 11 \\(SIGSEGV\\); call stack:\n.*\\[0x[0-9a-f]+\\]");
  EXPECT_EXIT(
      {
        install_crash_report();
        std::abort();
      },
      testing::KilledBySignal(SIGABRT), "tessera: fatal signal 6 \\(SIGABRT\\); call stack:");
}

}  // namespace
}  // namespace tessera
