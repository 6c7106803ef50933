// Argument checks, the kernel table's dispatch and the Hopper kernel's self-check of the sparse prefill executor
// (kernels: mma_prefill_kernel.cuh, hopper/prefill_kernel.cuh; instantiations: prefill_instances.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/prefill_cursor.h"
#include "attention/cuda/prefill_instances.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/split_merge.h"
#include "attention/cuda/work_plan.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace detail {
// Instantiated in prefill_mma_{bf16,f16}.cu and prefill_hopper_{bf16,f16}.cu.
template <typename T, int D, int BM>
void launch_mma_prefill(const PrefillParams& p, cudaStream_t stream);
template <typename T>
void launch_hopper_prefill(const PrefillParams& p, cudaStream_t stream);
#define TESSERA_DECLARE_MMA(T, D, BM) \
  extern template void launch_mma_prefill<T, D, BM>(const PrefillParams&, cudaStream_t);
#define TESSERA_DECLARE_DTYPE(T, E, S)              \
  TESSERA_MMA_PREFILL_SHAPES(TESSERA_DECLARE_MMA, T) \
  extern template void launch_hopper_prefill<T>(const PrefillParams&, cudaStream_t);
TESSERA_PREFILL_DTYPES(TESSERA_DECLARE_DTYPE)
#undef TESSERA_DECLARE_DTYPE
#undef TESSERA_DECLARE_MMA
}  // namespace detail

namespace {

void check_view(const TensorView& t, const char* what, DType dtype) {
  const std::string w = std::string("CUDA attention ") + what;
  check(t.rank == 3, w + ": expected rank 3, got " + std::to_string(t.rank));
  check(t.dtype == dtype, w + ": expected dtype " + std::string(dtype_name(dtype)) + ", got " +
                              std::string(dtype_name(t.dtype)));
  check(t.stride[2] == 1, w + ": the head_dim dimension must be contiguous");
  check(t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0,
        w + ": token and head strides must be multiples of 8 elements (16 bytes)");
  check(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, w + ": data must be 16-byte aligned");
}

using LaunchFn = void (*)(const detail::PrefillParams&, cudaStream_t);
struct KernelEntry {
  DType dtype;
  int head_dim, tile;
  LaunchFn launch;
};
// The kernel tables, expanded from prefill_instances.h: a family's SHAPES x ENTRY for every dtype, built once.
#define TESSERA_MMA_ENTRY(T, D, BM) KernelEntry{kDType, D, BM, &detail::launch_mma_prefill<T, D, BM>},
#define TESSERA_HOPPER_ENTRY(T, D, BM) KernelEntry{kDType, D, BM, &detail::launch_hopper_prefill<T>},
#define TESSERA_KERNEL_ROWS(SHAPES, ENTRY, T, E)                     \
  {                                                                  \
    constexpr DType kDType = DType::E;                               \
    for (const KernelEntry& e : {SHAPES(ENTRY, T)}) v.push_back(e); \
  }
#define TESSERA_MMA_ROWS(T, E, S) TESSERA_KERNEL_ROWS(TESSERA_MMA_PREFILL_SHAPES, TESSERA_MMA_ENTRY, T, E)
#define TESSERA_HOPPER_ROWS(T, E, S) TESSERA_KERNEL_ROWS(TESSERA_HOPPER_PREFILL_SHAPES, TESSERA_HOPPER_ENTRY, T, E)
#define TESSERA_KERNEL_TABLE(ROWS)                     \
  static const std::vector<KernelEntry> table = [] { \
    std::vector<KernelEntry> v;                        \
    TESSERA_PREFILL_DTYPES(ROWS)                       \
    return v;                                          \
  }();                                                 \
  return table;
const std::vector<KernelEntry>& mma_kernels() { TESSERA_KERNEL_TABLE(TESSERA_MMA_ROWS) }
const std::vector<KernelEntry>& hopper_kernels() { TESSERA_KERNEL_TABLE(TESSERA_HOPPER_ROWS) }
#undef TESSERA_KERNEL_TABLE
#undef TESSERA_HOPPER_ROWS
#undef TESSERA_MMA_ROWS
#undef TESSERA_KERNEL_ROWS
#undef TESSERA_HOPPER_ENTRY
#undef TESSERA_MMA_ENTRY

const KernelEntry* find_kernel(const std::vector<KernelEntry>& table, DType dtype, int head_dim, int tile) {
  for (const KernelEntry& e : table) {
    if (e.dtype == dtype && e.head_dim == head_dim && e.tile == tile) return &e;
  }
  return nullptr;
}

}  // namespace

bool sparse_prefill_supports(int head_dim, int tile) {
  return find_kernel(mma_kernels(), DType::BF16, head_dim, tile) != nullptr;
}

std::vector<PrefillShape> prefill_kernel_table(PrefillKernel kernel) {
  check(kernel != PrefillKernel::kAuto, "prefill_kernel_table: name a kernel (kMma or kWgmma)");
  std::vector<PrefillShape> out;
  for (const KernelEntry& e : kernel == PrefillKernel::kMma ? mma_kernels() : hopper_kernels())
    out.push_back({e.dtype, e.head_dim, e.tile});
  return out;
}

void validate_cuda_args(const AttentionArgs& a) {
  // args.window (a model's row-exact sliding window: Gemma-3 local layers, Mistral) is applied by both kernels
  // on top of the index (the visible set is the intersection).
  check(a.window >= 0, "CUDA attention: window must be >= 0 (0: no window), got " + std::to_string(a.window));
  check(a.q.dtype == DType::BF16 || a.q.dtype == DType::F16,
        "CUDA attention q: dtype must be bf16 or f16, got " + std::string(dtype_name(a.q.dtype)));
  check_view(a.q, "q", a.q.dtype);
  check_view(a.k, "k", a.q.dtype);
  check_view(a.v, "v", a.q.dtype);
  check_view(a.out, "out", a.q.dtype);
  const int64_t q_len = a.q.dim(0), hq = a.q.dim(1), d = a.q.dim(2);
  a.k.expect_shape("CUDA attention k", {-1, -1, d});
  const int64_t kv_len = a.k.dim(0), hkv = a.k.dim(1);
  a.v.expect_shape("CUDA attention v", {kv_len, hkv, d});
  a.out.expect_shape("CUDA attention out", {q_len, hq, d});
  check(hq > 0 && hkv > 0 && hq % hkv == 0, "CUDA attention: " + std::to_string(hq) +
                                                " query heads are not a multiple of " + std::to_string(hkv) +
                                                " kv heads");
  check(d == 64 || d == 128 || d == 256,
        "CUDA attention: head_dim " + std::to_string(d) + " is not supported (64, 128 or 256)");
  if (a.has_lse()) {
    a.lse.expect_shape("CUDA attention lse", {hq, q_len});
    a.lse.expect_dtype("CUDA attention lse", {DType::F32});
  }
  check(a.q_begin >= 0, "CUDA attention: q_begin must be >= 0, got " + std::to_string(a.q_begin));
  check(kv_len >= a.q_begin + q_len,
        "CUDA attention: kv_len " + std::to_string(kv_len) +
            " is less than q_begin + q_len = " + std::to_string(a.q_begin + q_len));
  check(kv_len < (int64_t{1} << 31) && a.q_begin + q_len < (int64_t{1} << 31),
        "CUDA attention: positions must fit in int32");
  check(std::isfinite(a.scale), "CUDA attention: scale must be finite");
  if (q_len > 0) {
    check(a.q.data && a.k.data && a.v.data && a.out.data, "CUDA attention: a data pointer is null");
  }
}

namespace {

detail::PrefillParams make_params(const AttentionArgs& args, const DeviceSparseIndex& index,
                                  DeviceWorkPlan& plan) {
  detail::PrefillParams p;
  p.q = args.q.data;
  p.k = args.k.data;
  p.v = args.v.data;
  p.out = args.out.data;
  p.q_tok = args.q.stride[0];
  p.q_head = args.q.stride[1];
  p.k_tok = args.k.stride[0];
  p.k_head = args.k.stride[1];
  p.v_tok = args.v.stride[0];
  p.v_head = args.v.stride[1];
  p.o_tok = args.out.stride[0];
  p.o_head = args.out.stride[1];
  if (args.has_lse()) {
    p.lse = static_cast<float*>(args.lse.data);
    p.lse_head = args.lse.stride[0];
    p.lse_tok = args.lse.stride[1];
  }
  p.q_len = static_cast<int32_t>(args.q_len());
  p.q_begin = args.q_begin;
  p.kv_len = static_cast<int32_t>(args.kv_len());
  p.num_q_heads = static_cast<int32_t>(args.num_q_heads());
  p.num_kv_heads = static_cast<int32_t>(args.num_kv_heads());
  p.num_tiles = index.num_tiles();
  p.group = static_cast<int32_t>(args.group_size());
  p.window = args.window;
  p.span = args.window > 0 ? static_cast<uint32_t>(args.window) : 0x7fffffffu;
  p.scale_log2 = args.effective_scale() * 1.4426950408889634f;
  p.range_offsets = index.range_offsets.data();
  p.ranges = reinterpret_cast<const int2*>(index.ranges.data());
  p.column_offsets = index.column_offsets.data();
  p.columns = index.columns.data();
  p.order = plan.order.data();
  p.num_items = plan.num_items;
  p.counter = plan.counter.data();
  if (plan.num_units > 0) {  // split-K: the units' scratch rows (split_merge.h)
    const size_t rows = static_cast<size_t>(plan.num_units) * static_cast<size_t>(index.tile);
    const size_t cols = rows * static_cast<size_t>(args.head_dim());
    if (plan.part_o.size() < cols) plan.part_o.resize(cols);
    if (plan.part_lse.size() < rows) plan.part_lse.resize(rows);
    p.units = plan.units.data();
    p.num_units = plan.num_units;
    p.part_o = plan.part_o.data();
    p.part_lse = plan.part_lse.data();
  }
  p.part_rows = index.tile;
  return p;
}

void check_call(const AttentionArgs& args, const DeviceSparseIndex& index, const DeviceWorkPlan& plan) {
  validate_cuda_args(args);
  check(index.num_heads == args.num_q_heads() && index.q_begin == args.q_begin &&
            index.q_len == args.q_len() && index.kv_len == args.kv_len(),
        "CUDA sparse prefill: the index (heads " + std::to_string(index.num_heads) + ", q_begin " +
            std::to_string(index.q_begin) + ", q_len " + std::to_string(index.q_len) + ", kv_len " +
            std::to_string(index.kv_len) + ") does not describe this call");
  check(plan.num_units == 0 || (plan.units.size() >= static_cast<size_t>(plan.num_units) && plan.num_merges > 0),
        "CUDA sparse prefill: the work plan's split units are not set");
  check(plan.num_items == index.num_items(), "CUDA sparse prefill: the work plan has " +
                                                 std::to_string(plan.num_items) + " items, the index " +
                                                 std::to_string(index.num_items()));
}

bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) return false;
  return major == 9 && minor == 0;
}

void launch_mma(DType dtype, int d, int tile, const detail::PrefillParams& p, cudaStream_t stream) {
  const KernelEntry* e = find_kernel(mma_kernels(), dtype, d, tile);
  if (e == nullptr) {
    throw Error("CUDA sparse prefill: head_dim " + std::to_string(d) + " with index tile " + std::to_string(tile) +
                " is not built (head_dim 64, 128 or 256; tile 64 or 128)");
  }
  e->launch(p, stream);
}

void launch_hopper(DType dtype, int d, int tile, const detail::PrefillParams& p, cudaStream_t stream) {
  const KernelEntry* e = find_kernel(hopper_kernels(), dtype, d, tile);
  check(e != nullptr, "CUDA sparse prefill: the Hopper kernel is not built for head_dim " + std::to_string(d) +
                          " with tile " + std::to_string(tile));
  e->launch(p, stream);
}

// The self-check problem: 2 query heads on 1 kv head, head_dim 128, 320 queries (tiles of 128, the last one
// partial); head 0 dense causal, head 1 a sink range, a local range and gathered columns in between.
SparseIndex self_check_index() {
  SparseIndex x;
  x.num_heads = 2;
  x.tile = 128;
  x.q_begin = 0;
  x.q_len = 320;
  x.kv_len = 320;
  x.range_offsets.push_back(0);
  x.column_offsets.push_back(0);
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < x.num_tiles(); ++t) {
      const int end = x.tile_key_end(t);
      if (h == 0) {
        x.ranges.push_back({0, end});
      } else {
        const int lo = std::max(40, t * 128 - 70);
        x.ranges.push_back({0, 3});
        x.ranges.push_back({lo, end});
        for (int j = 3; j < lo; ++j) {
          if (j % 7 == 3) x.columns.push_back(j);
        }
      }
      x.range_offsets.push_back(static_cast<int32_t>(x.ranges.size()));
      x.column_offsets.push_back(static_cast<int32_t>(x.columns.size()));
    }
  }
  x.validate();
  return x;
}

std::vector<float> decode_all(const std::vector<uint16_t>& bits, DType t) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    out[i] = t == DType::BF16 ? bf16_to_f32(bf16::from_bits(bits[i])) : f16_to_f32(f16::from_bits(bits[i]));
  }
  return out;
}

HopperSelfCheck run_self_check(DType dtype, cudaStream_t stream) {
  HopperSelfCheck result;
  try {
    const SparseIndex index = self_check_index();
    const int hq = 2, d = 128, n = index.q_len;
    std::mt19937_64 rng(20261122);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    auto random_bits = [&](size_t count) {
      std::vector<uint16_t> b(count);
      for (uint16_t& x : b)
        x = dtype == DType::BF16 ? f32_to_bf16(dist(rng)).bits : f32_to_f16(dist(rng)).bits;
      return b;
    };
    const size_t nq = static_cast<size_t>(n) * hq * d, nkv = static_cast<size_t>(n) * d;
    DeviceBuffer<uint16_t> q, k, v, out_ref(nq), out(nq);
    q.upload(random_bits(nq));
    k.upload(random_bits(nkv));
    v.upload(random_bits(nkv));
    DeviceBuffer<float> lse_ref(static_cast<size_t>(hq) * n), lse(static_cast<size_t>(hq) * n);
    DeviceSparseIndex dindex = DeviceSparseIndex::upload(index, stream);
    DeviceWorkPlan plan = DeviceWorkPlan::upload(plan_prefill(index), stream);
    auto args_for = [&](DeviceBuffer<uint16_t>& o, DeviceBuffer<float>& l) {
      AttentionArgs a;
      a.q = TensorView(q.data(), dtype, {n, hq, d});
      a.k = TensorView(k.data(), dtype, {n, 1, d});
      a.v = TensorView(v.data(), dtype, {n, 1, d});
      a.out = TensorView(o.data(), dtype, {n, hq, d});
      a.lse = TensorView(l.data(), DType::F32, {hq, n});
      return a;
    };
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out_ref.data(), 0xff, out_ref.bytes(), stream));
    launch_mma(dtype, d, 128, make_params(args_for(out_ref, lse_ref), dindex, plan), stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> ref = decode_all(out_ref.download(), dtype);
    const std::vector<float> ref_lse = lse_ref.download();
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out.data(), 0xff, out.bytes(), stream));
    try {
      detail::PrefillParams hp = make_params(args_for(out, lse), dindex, plan);
      hp.max_ctas = 2;  // several items per CTA: the hand-over from one item to the next is checked too
      launch_hopper(dtype, d, 128, hp, stream);
    } catch (const Error& e) {  // a kernel this device cannot launch fails alone (not a CUDA error state)
      result.report = std::string("wgmma ") + std::string(dtype_name(dtype)) + ": FAIL, not launched: " + e.what() + "\n";
      return result;
    }
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> got = decode_all(out.download(), dtype);
    const std::vector<float> got_lse = lse.download();
    double num = 0, den = 0, lse_err = 0;
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
        ++bad;
        continue;
      }
      num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
      den += static_cast<double>(ref[i]) * ref[i];
    }
    for (size_t i = 0; i < got_lse.size(); ++i) {
      const double e = std::abs(static_cast<double>(got_lse[i]) - ref_lse[i]);
      lse_err = std::max(lse_err, std::isfinite(e) ? e : 1e30);
    }
    const double rel = den > 0 ? std::sqrt(num / den) : 1e30;
    result.passed = bad == 0 && rel < 1e-2 && lse_err < 1e-2;
    char line[256];
    std::snprintf(line, sizeof line, "wgmma %s: %s rel_err %.2e lse_err %.2e non_finite %lld\n",
                  dtype_name(dtype).data(), result.passed ? "PASS" : "FAIL", rel, lse_err, static_cast<long long>(bad));
    result.report = line;
  } catch (const std::exception& e) {
    result.passed = false;
    result.report += std::string("wgmma self-check error: ") + e.what() + "\n";
  }
  return result;
}

}  // namespace

bool hopper_prefill_built(DType dtype, int head_dim, int tile) {
  return find_kernel(hopper_kernels(), dtype, head_dim, tile) != nullptr;
}

bool wgmma_prefill_applies(DType dtype, int head_dim, int tile) {
  if (cuda_attention_defaults().kernel == PrefillKernel::kMma) return false;  // TESSERA_PREFILL_KERNEL=mma
  return hopper_prefill_built(dtype, head_dim, tile) && device_is_sm90();
}

const HopperSelfCheck& hopper_prefill_self_check(DType dtype, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, HopperSelfCheck> done;
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, static_cast<int>(dtype));
  auto it = done.find(key);
  if (it == done.end()) {
    HopperSelfCheck r;
    if (!wgmma_prefill_applies(dtype, 128, 128)) {
      r.report = "wgmma kernel does not apply on this device (needs compute capability 9.0, bf16 or f16)\n";
    } else {
      r = run_self_check(dtype, stream);
    }
    it = done.emplace(key, std::move(r)).first;
  }
  return it->second;
}

bool hopper_prefill_ready(DType dtype, int head_dim, int tile, cudaStream_t stream) {
  return wgmma_prefill_applies(dtype, head_dim, tile) && hopper_prefill_self_check(dtype, stream).passed;
}

PrefillKernel resolve_prefill_kernel(PrefillKernel requested, DType dtype, int head_dim, int tile, bool split_units,
                                     cudaStream_t stream) {
  if (requested == PrefillKernel::kAuto) requested = cuda_attention_defaults().kernel;
  if (requested == PrefillKernel::kMma) return PrefillKernel::kMma;
  const bool applies = wgmma_prefill_applies(dtype, head_dim, tile);
  if (requested == PrefillKernel::kWgmma) {
    check(applies,
          "CUDA sparse prefill: the wgmma kernel runs bf16/f16, head_dim 128, tile 128 on compute "
          "capability 9.0 only (got head_dim " +
              std::to_string(head_dim) + ", tile " + std::to_string(tile) + ")");
    const HopperSelfCheck& sc = hopper_prefill_self_check(dtype, stream);
    check(sc.passed, "CUDA sparse prefill: the wgmma kernel failed its self-check:\n" + sc.report);
    check(!split_units, "CUDA sparse prefill: the wgmma kernel runs no split-K units; this plan has some (the "
                        "mma.sync kernel runs them)");
    return PrefillKernel::kWgmma;
  }
  if (!applies || split_units) return PrefillKernel::kMma;
  return hopper_prefill_self_check(dtype, stream).passed ? PrefillKernel::kWgmma : PrefillKernel::kMma;
}

void sparse_prefill(const AttentionArgs& args, const DeviceSparseIndex& index, DeviceWorkPlan& plan,
                    cudaStream_t stream, PrefillKernel kernel) {
  check_call(args, index, plan);
  const int d = static_cast<int>(args.head_dim());
  const PrefillKernel k = resolve_prefill_kernel(kernel, args.q.dtype, d, index.tile, plan.num_units > 0, stream);
  if (args.q_len() == 0) return;
  const detail::PrefillParams p = make_params(args, index, plan);
  if (k == PrefillKernel::kWgmma) {
    launch_hopper(args.q.dtype, d, index.tile, p, stream);
  } else {
    launch_mma(args.q.dtype, d, index.tile, p, stream);
  }
  if (plan.num_merges > 0) {
    if (args.q.dtype == DType::BF16) {
      detail::launch_split_merge<__nv_bfloat16>(p, plan.merges.data(), plan.num_merges, d, stream);
    } else {
      detail::launch_split_merge<__half>(p, plan.merges.data(), plan.num_merges, d, stream);
    }
  }
}

}  // namespace tessera::attn::gpu
