// The GPU backend's routing step (attention/index/prefill_route.h), on the CPU: options and their environment
// overrides, the cuDNN/ours ratio table, and the route each kind of layer and call gets.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "attention/index/prefill_route.h"
#include "core/error.h"

namespace tessera::attn::gpu {
namespace {

CudaAttentionOptions with_env(const std::map<std::string, std::string>& env, CudaAttentionOptions base = {}) {
  return apply_env_overrides(base, [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    (void)with_env(env);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PrefillRouteOptions, DefaultsWithoutEnvironment) {
  const CudaAttentionOptions o = with_env({});
  EXPECT_EQ(o.kernel, PrefillKernel::kAuto);
  EXPECT_EQ(o.dense_backend, DenseBackend::kAuto);
  EXPECT_TRUE(o.dense_fallback);
  EXPECT_TRUE(o.dense_shortcut);
  EXPECT_TRUE(o.split);
  EXPECT_FALSE(o.cudnn_any_length);
}

TEST(PrefillRouteOptions, EnvironmentOverrides) {
  EXPECT_EQ(with_env({{"TESSERA_PREFILL_KERNEL", "mma"}}).kernel, PrefillKernel::kMma);
  EXPECT_EQ(with_env({{"TESSERA_PREFILL_KERNEL", "wgmma"}}).kernel, PrefillKernel::kWgmma);
  CudaAttentionOptions base;
  base.kernel = PrefillKernel::kMma;
  EXPECT_EQ(with_env({{"TESSERA_PREFILL_KERNEL", "auto"}}, base).kernel, PrefillKernel::kAuto);
  EXPECT_EQ(with_env({{"TESSERA_PREFILL_KERNEL", ""}}, base).kernel, PrefillKernel::kMma) << "empty: unset";
  EXPECT_EQ(with_env({{"TESSERA_DENSE_BACKEND", "ours"}}).dense_backend, DenseBackend::kOurs);
  const CudaAttentionOptions cudnn = with_env({{"TESSERA_DENSE_BACKEND", "cudnn"}});
  EXPECT_EQ(cudnn.dense_backend, DenseBackend::kAuto);
  EXPECT_TRUE(cudnn.cudnn_any_length);
  EXPECT_FALSE(with_env({{"TESSERA_DENSE_FALLBACK", "0"}}).dense_fallback);
  base.dense_fallback = false;
  EXPECT_TRUE(with_env({{"TESSERA_DENSE_FALLBACK", "1"}}, base).dense_fallback);
}

TEST(PrefillRouteOptions, MalformedValuesNameTheVariable) {
  EXPECT_EQ(error_of({{"TESSERA_PREFILL_KERNEL", "tma"}}),
            "TESSERA_PREFILL_KERNEL: expected auto, mma or wgmma, got 'tma'");
  EXPECT_EQ(error_of({{"TESSERA_DENSE_BACKEND", "flash"}}),
            "TESSERA_DENSE_BACKEND: expected auto, ours or cudnn, got 'flash'");
  EXPECT_EQ(error_of({{"TESSERA_DENSE_FALLBACK", "off"}}), "TESSERA_DENSE_FALLBACK: expected 0 or 1, got 'off'");
}

TEST(PrefillRouteOptions, CliNamesParse) {
  EXPECT_EQ(parse_prefill_kernel("auto"), PrefillKernel::kAuto);
  EXPECT_EQ(parse_prefill_kernel("mma"), PrefillKernel::kMma);
  EXPECT_EQ(parse_prefill_kernel("wgmma"), PrefillKernel::kWgmma);
  EXPECT_EQ(parse_dense_backend("ours"), DenseBackend::kOurs);
  EXPECT_EQ(parse_dense_backend("cudnn"), DenseBackend::kCudnn);
  try {
    (void)parse_prefill_kernel("hopper", "--prefill-kernel");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--prefill-kernel: expected auto, mma or wgmma, got 'hopper'");
  }
  try {
    (void)parse_dense_backend("sdpa", "--dense-backend");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--dense-backend: expected auto, ours or cudnn, got 'sdpa'");
  }
}

TEST(PrefillRoute, CudnnRatioTableInterpolatesInLog2) {
  EXPECT_DOUBLE_EQ(cudnn_rel_tile_cost(512), 1.054);  // below the table: its first value
  EXPECT_DOUBLE_EQ(cudnn_rel_tile_cost(1024), 1.054);
  EXPECT_DOUBLE_EQ(cudnn_rel_tile_cost(32768), 0.950);
  EXPECT_DOUBLE_EQ(cudnn_rel_tile_cost(1 << 20), 1.051);  // beyond: the last
  // 20000 lies between 16384 (1.021) and 24576 (0.957): linear in log2 of the length.
  const double f = (std::log2(20000.0) - 14.0) / (std::log2(24576.0) - 14.0);
  EXPECT_NEAR(cudnn_rel_tile_cost(20000), 1.021 + f * (0.957 - 1.021), 1e-12);
}

RouteInputs dense_layer(int64_t q_len) {
  RouteInputs in;
  in.q_len = q_len;
  in.all_dense = true;
  in.hopper_applies = true;
  in.cudnn_has_plan = true;
  return in;
}

TEST(PrefillRoute, AllDenseLayerTakesTheFasterDenseBackend) {
  const CudaAttentionOptions opt;
  // 32K: cuDNN is faster (0.950) and has a plan.
  PrefillRoute r = plan_prefill_route(dense_layer(32768), opt);
  EXPECT_EQ(r.path, RoutePath::kDense);
  EXPECT_EQ(r.dense, DenseBackend::kCudnn);
  EXPECT_EQ(r.name(), "dense cudnn");
  EXPECT_DOUBLE_EQ(r.dense_tile_cost, 0.950);
  // 128K: ours is faster (1.051); the Hopper kernel.
  r = plan_prefill_route(dense_layer(131072), opt);
  EXPECT_EQ(r.dense, DenseBackend::kOurs);
  EXPECT_EQ(r.name(), "dense wgmma");
  EXPECT_DOUBLE_EQ(r.dense_tile_cost, 1.0);
  // Below kCudnnMinQLen: ours even though the ratio table is not consulted.
  EXPECT_FALSE(wants_cudnn(dense_layer(1024), opt));
  EXPECT_EQ(plan_prefill_route(dense_layer(1024), opt).name(), "dense wgmma");
  // cuDNN without a plan for the call: ours.
  RouteInputs no_plan = dense_layer(32768);
  no_plan.cudnn_has_plan = false;
  EXPECT_EQ(plan_prefill_route(no_plan, opt).name(), "dense wgmma");
  // A window: never cuDNN.
  RouteInputs windowed = dense_layer(32768);
  windowed.window = 4096;
  EXPECT_FALSE(wants_cudnn(windowed, opt));
  EXPECT_EQ(plan_prefill_route(windowed, opt).name(), "dense wgmma");
}

TEST(PrefillRoute, SplitPlansAndNonHopperShapesRunMmaSync) {
  const CudaAttentionOptions opt;
  RouteInputs split = dense_layer(200);
  split.split_units = true;
  EXPECT_EQ(plan_prefill_route(split, opt).name(), "dense mma.sync");
  RouteInputs sparse = split;
  sparse.all_dense = false;
  const PrefillRoute r = plan_prefill_route(sparse, opt);
  EXPECT_EQ(r.name(), "sparse mma.sync");
  EXPECT_EQ(r.dense_kernel, PrefillKernel::kWgmma) << "the dense index of a sparse layer has no units";
  RouteInputs d64 = dense_layer(4096);
  d64.hopper_applies = false;  // e.g. head_dim 64, or not a Hopper GPU
  EXPECT_EQ(plan_prefill_route(d64, opt).name(), "dense mma.sync");
  CudaAttentionOptions mma;
  mma.kernel = PrefillKernel::kMma;
  EXPECT_EQ(plan_prefill_route(dense_layer(131072), mma).name(), "dense mma.sync");
}

TEST(PrefillRoute, WgmmaAskedForWhereItCannotRunIsAnError) {
  CudaAttentionOptions opt;
  opt.kernel = PrefillKernel::kWgmma;
  RouteInputs in = dense_layer(4096);
  in.hopper_applies = false;
  try {
    (void)plan_prefill_route(in, opt);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "CUDA attention: the wgmma (Hopper) kernel was asked for, but it runs bf16/f16, head_dim 128, tile 128 "
              "on compute capability 9.0 only (and after its self-check passed)");
  }
  in = dense_layer(200);
  in.split_units = true;
  try {
    (void)plan_prefill_route(in, opt);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "CUDA attention: the wgmma (Hopper) kernel was asked for, but this layer's plan has split-K units, "
              "which only the mma.sync kernel runs (switch splitting off: CudaAttentionOptions::split)");
  }
}

RouteInputs sparse_layer(int64_t q_len) {
  RouteInputs in;
  in.q_len = q_len;
  in.hopper_applies = true;
  in.cudnn_has_plan = true;
  return in;
}

TEST(PrefillRoute, SparseLayerShortcutAndFallback) {
  const CudaAttentionOptions opt;
  // 8K: cuDNN (0.993) has a plan, so the shortcut rule at cuDNN's ratio decides.
  RouteInputs in = sparse_layer(8192);
  in.shortcut_cudnn = true;
  PrefillRoute r = plan_prefill_route(in, opt);
  EXPECT_EQ(r.path, RoutePath::kDenseShortcut);
  EXPECT_EQ(r.name(), "dense shortcut cudnn");
  in.shortcut_cudnn = false;
  in.shortcut_ours = true;  // the rule at r = 1 says dense, at cuDNN's ratio not: cuDNN is the backend
  r = plan_prefill_route(in, opt);
  EXPECT_EQ(r.path, RoutePath::kSparse);
  EXPECT_TRUE(r.fallback_check);
  EXPECT_EQ(r.name(), "sparse wgmma");
  EXPECT_EQ(r.name(RoutePath::kDenseFallback), "dense fallback cudnn");
  // 128K: ours is the dense backend, so the shortcut at r = 1 applies.
  in.q_len = 131072;
  r = plan_prefill_route(in, opt);
  EXPECT_EQ(r.name(), "dense shortcut wgmma");
  // The shortcut alone off: sparse with the fallback check.
  CudaAttentionOptions no_shortcut;
  no_shortcut.dense_shortcut = false;
  r = plan_prefill_route(in, no_shortcut);
  EXPECT_EQ(r.path, RoutePath::kSparse);
  EXPECT_TRUE(r.fallback_check);
  // The fallback off: neither.
  CudaAttentionOptions no_fallback;
  no_fallback.dense_fallback = false;
  r = plan_prefill_route(in, no_fallback);
  EXPECT_EQ(r.path, RoutePath::kSparse);
  EXPECT_FALSE(r.fallback_check);
  // A window bounds the work already: neither.
  in.window = 1024;
  r = plan_prefill_route(in, opt);
  EXPECT_EQ(r.path, RoutePath::kSparse);
  EXPECT_FALSE(r.fallback_check);
}

TEST(PrefillRoute, DenseBackendOptions) {
  CudaAttentionOptions ours;
  ours.dense_backend = DenseBackend::kOurs;
  EXPECT_FALSE(wants_cudnn(dense_layer(32768), ours));
  EXPECT_EQ(plan_prefill_route(dense_layer(32768), ours).name(), "dense wgmma");
  // Forced cuDNN: taken even without a plan (cuDNN's own error then names why it cannot run the call).
  CudaAttentionOptions forced;
  forced.dense_backend = DenseBackend::kCudnn;
  RouteInputs no_plan = dense_layer(1024);
  no_plan.cudnn_has_plan = false;
  EXPECT_TRUE(wants_cudnn(no_plan, forced));
  EXPECT_EQ(plan_prefill_route(no_plan, forced).name(), "dense cudnn");
  // TESSERA_DENSE_BACKEND=cudnn: cuDNN wherever it has a plan, at any length.
  const CudaAttentionOptions any = with_env({{"TESSERA_DENSE_BACKEND", "cudnn"}});
  EXPECT_EQ(plan_prefill_route(dense_layer(1024), any).name(), "dense cudnn");
  EXPECT_EQ(plan_prefill_route(dense_layer(131072), any).name(), "dense cudnn");
  EXPECT_EQ(plan_prefill_route(no_plan, any).name(), "dense wgmma");
}

TEST(PrefillRoute, EmptyCallRunsNothingDense) {
  const PrefillRoute r = plan_prefill_route(dense_layer(0), CudaAttentionOptions{});
  EXPECT_EQ(r.path, RoutePath::kSparse);
  EXPECT_FALSE(r.fallback_check);
}

TEST(PrefillRoute, KernelNames) {
  EXPECT_STREQ(prefill_kernel_name(PrefillKernel::kAuto), "auto");
  EXPECT_STREQ(prefill_kernel_name(PrefillKernel::kMma), "mma.sync");
  EXPECT_STREQ(prefill_kernel_name(PrefillKernel::kWgmma), "wgmma");
  EXPECT_STREQ(dense_backend_name(DenseBackend::kCudnn), "cudnn");
}

}  // namespace
}  // namespace tessera::attn::gpu
