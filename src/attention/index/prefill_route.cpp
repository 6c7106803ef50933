#include "attention/index/prefill_route.h"

#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>
#include <string_view>

#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace {

// In the enums' order (core/enum_names.h).
constexpr std::string_view kPrefillKernelNames[] = {"auto", "mma.sync", "wgmma"};
constexpr std::string_view kDenseBackendNames[] = {"auto", "ours", "cudnn"};

}  // namespace

const char* prefill_kernel_name(PrefillKernel kernel) {
  return enum_name(kPrefillKernelNames, kernel).data();
}

const char* dense_backend_name(DenseBackend b) {
  return enum_name(kDenseBackendNames, b).data();
}

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

PrefillKernel parse_prefill_kernel(const std::string& s, const std::string& what) {
  if (s == "auto") return PrefillKernel::kAuto;
  if (s == "mma") return PrefillKernel::kMma;
  if (s == "wgmma") return PrefillKernel::kWgmma;
  throw Error(what + ": expected auto, mma or wgmma, got '" + s + "'");
}

DenseBackend parse_dense_backend(const std::string& s, const std::string& what) {
  if (const auto b = enum_value<DenseBackend>(kDenseBackendNames, s)) return *b;
  throw Error(what + ": expected auto, ours or cudnn, got '" + s + "'");
}

CudaAttentionOptions apply_env_overrides(CudaAttentionOptions o,
                                         const std::function<const char*(const char*)>& getenv) {
  if (const char* e = getenv("TESSERA_PREFILL_KERNEL"); e != nullptr && *e != '\0') {
    o.kernel = parse_prefill_kernel(e, "TESSERA_PREFILL_KERNEL");
  }
  if (const char* e = getenv("TESSERA_DENSE_BACKEND"); e != nullptr && *e != '\0') {
    // cudnn here means "wherever cuDNN has a plan" (any length), not cuDNN or an error.
    o.dense_backend = parse_dense_backend(e, "TESSERA_DENSE_BACKEND");
    if (o.dense_backend == DenseBackend::kCudnn) {
      o.dense_backend = DenseBackend::kAuto;
      o.cudnn_any_length = true;
    }
  }
  if (const char* e = getenv("TESSERA_DENSE_FALLBACK"); e != nullptr && *e != '\0') {
    const std::string s = e;
    if (s == "0") {
      o.dense_fallback = false;
    } else if (s == "1") {
      o.dense_fallback = true;
    } else {
      throw Error("TESSERA_DENSE_FALLBACK: expected 0 or 1, got '" + s + "'");
    }
  }
  return o;
}

const CudaAttentionOptions& cuda_attention_defaults() {
  static const CudaAttentionOptions options =
      apply_env_overrides(CudaAttentionOptions{}, [](const char* name) { return std::getenv(name); });
  return options;
}

namespace {

// The dense backend of the dense paths (kOurs or kCudnn).
DenseBackend resolve_dense(const RouteInputs& in, const CudaAttentionOptions& opt) {
  if (opt.dense_backend != DenseBackend::kAuto) return opt.dense_backend;
  return wants_cudnn(in, opt) && in.cudnn_has_plan ? DenseBackend::kCudnn : DenseBackend::kOurs;
}

// Our kernel for a plan (with or without split units).
PrefillKernel resolve_kernel(const RouteInputs& in, const CudaAttentionOptions& opt, bool split_units) {
  switch (opt.kernel) {
    case PrefillKernel::kMma:
      return PrefillKernel::kMma;
    case PrefillKernel::kWgmma:
      check(in.hopper_applies,
            "CUDA attention: the wgmma (Hopper) kernel was asked for, but it runs bf16/f16, head_dim 128, tile 128 "
            "on compute capability 9.0 only (and after its self-check passed)");
      check(!split_units,
            "CUDA attention: the wgmma (Hopper) kernel was asked for, but this layer's plan has split-K units, which "
            "only the mma.sync kernel runs (switch splitting off: CudaAttentionOptions::split)");
      return PrefillKernel::kWgmma;
    case PrefillKernel::kAuto:
      break;
  }
  return in.hopper_applies && !split_units ? PrefillKernel::kWgmma : PrefillKernel::kMma;
}

}  // namespace

bool wants_cudnn(const RouteInputs& in, const CudaAttentionOptions& opt) {
  if (opt.dense_backend == DenseBackend::kCudnn) return true;
  if (opt.dense_backend == DenseBackend::kOurs || in.q_len <= 0 || in.window != 0) return false;
  if (opt.cudnn_any_length) return true;
  return in.q_len >= kCudnnMinQLen && cudnn_rel_tile_cost(in.q_len) < 1.0;
}

std::string PrefillRoute::name(RoutePath p) const {
  const char* dense_name = dense == DenseBackend::kCudnn ? "cudnn" : prefill_kernel_name(dense_kernel);
  switch (p) {
    case RoutePath::kDense:
      return std::string("dense ") + dense_name;
    case RoutePath::kDenseShortcut:
      return std::string("dense shortcut ") + dense_name;
    case RoutePath::kDenseFallback:
      return std::string("dense fallback ") + dense_name;
    case RoutePath::kSparse:
      break;
  }
  return std::string("sparse ") + prefill_kernel_name(sparse_kernel);
}

PrefillRoute plan_prefill_route(const RouteInputs& in, const CudaAttentionOptions& opt) {
  PrefillRoute r;
  r.dense = resolve_dense(in, opt);
  r.dense_tile_cost = r.dense == DenseBackend::kCudnn ? cudnn_rel_tile_cost(in.q_len) : 1.0;
  // An all-dense layer runs on its own index (split units possible); the other layers' dense index has none.
  r.dense_kernel = resolve_kernel(in, opt, in.all_dense && in.split_units);
  r.sparse_kernel = resolve_kernel(in, opt, in.split_units);
  const bool dense_checks = opt.dense_fallback && in.window == 0 && in.q_len > 0 && !in.all_dense;
  if (in.all_dense && in.q_len > 0) {
    r.path = RoutePath::kDense;
  } else if (dense_checks && opt.dense_shortcut &&
             (r.dense == DenseBackend::kCudnn ? in.shortcut_cudnn : in.shortcut_ours)) {
    r.path = RoutePath::kDenseShortcut;
  } else {
    r.path = RoutePath::kSparse;
    r.fallback_check = dense_checks;
  }
  return r;
}

}  // namespace tessera::attn::gpu
