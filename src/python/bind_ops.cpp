// The attention ops of tessera.ops, on the caller's memory: every tensor arrives through DLPack (nb::ndarray)
// and is read and written in place, through its own strides (no copy of q, k, v or out). Python's tessera.ops
// wraps these as torch custom ops; numpy arrays work too.
//
// Layouts: q and out [batch, num_q_heads, q_len, head_dim], k and v [batch, num_kv_heads, kv_len, head_dim]
// (what torch's scaled_dot_product_attention takes); each batch element is one AttentionArgs call whose views
// are token-major through strides ([q_len, heads, head_dim] with the head and token strides swapped). On the
// CPU q, k and v are f32 or bf16 and out f32 (the CPU executor's output); on CUDA q, k, v and out share one
// dtype, bf16 or f16, and run on the caller's stream (an int: torch.cuda.current_stream().cuda_stream).
//
// A layer's policy is a string: a --attn preset for every head or a one-layer policy JSON (policy_handle.h).
// The step functions (estimate, build_index, run_index) exchange plain int32 arrays: estimates packed as
// documented at pack_estimates, the index as its four CSR arrays (attention/index/sparse_index.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/reference.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "python/bindings.h"
#include "python/policy_handle.h"
#ifdef TESSERA_PY_WITH_CUDA
#include <cuda_runtime.h>

#include "attention/cuda/device_index.h"
#include "attention/cuda/layer_attention_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/work_plan.h"
#include "cuda/cuda_check.h"
#endif

namespace tessera::python {

namespace {

using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
constexpr int kDLCPU = 1, kDLCUDA = 2;

DType dtype_of(const nb::ndarray<>& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 32) return DType::F32;
    if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return DType::F16;
    if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DType::BF16;
  }
  throw Error(
      what + ": dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
      " bits) is not supported: tessera's attention takes float32 or bfloat16 on the CPU, bfloat16 or "
      "float16 on CUDA");
}

std::string shape_string(const nb::ndarray<>& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// A 4-D [B, H, S, D] array; returns its dims.
std::array<int64_t, 4> dims4(const nb::ndarray<>& a, const std::string& what) {
  check(a.ndim() == 4,
        what + ": expected 4 dimensions [batch, heads, seq, head_dim], got " + shape_string(a));
  return {static_cast<int64_t>(a.shape(0)), static_cast<int64_t>(a.shape(1)),
          static_cast<int64_t>(a.shape(2)), static_cast<int64_t>(a.shape(3))};
}

// Batch element b of a [B, H, S, D] array as the token-major view [S, H, D] the executors read (no copy).
TensorView token_major(const nb::ndarray<>& a, int64_t b, DType t) {
  TensorView v;
  v.data = static_cast<char*>(const_cast<void*>(static_cast<const void*>(a.data()))) +
           b * a.stride(0) * static_cast<int64_t>(dtype_size(t));
  v.dtype = t;
  v.rank = 3;
  v.shape = {static_cast<int64_t>(a.shape(2)), static_cast<int64_t>(a.shape(1)),
             static_cast<int64_t>(a.shape(3)), 0};
  v.stride = {a.stride(2), a.stride(1), a.stride(3), 0};
  return v;
}

struct Call {
  int64_t batch = 0, nq = 0, nkv = 0, q_len = 0, kv_len = 0, d = 0;
  DType qt = DType::F32, kt = DType::F32, vt = DType::F32, ot = DType::F32;
  int device_type = kDLCPU, device_id = 0;
};

// Checks q, k, v (and out when given) against each other; the executors check the rest (validate(args)).
Call check_call(const nb::ndarray<>& q, const nb::ndarray<>& k, const nb::ndarray<>& v,
                const nb::ndarray<>* out) {
  Call c;
  const auto qd = dims4(q, "q"), kd = dims4(k, "k"), vd = dims4(v, "v");
  c.batch = qd[0], c.nq = qd[1], c.q_len = qd[2], c.d = qd[3];
  c.nkv = kd[1], c.kv_len = kd[2];
  check(kd[0] == c.batch && vd[0] == c.batch, "attention: q, k and v must have the same batch size, got q " +
                                                  shape_string(q) + ", k " + shape_string(k) + ", v " +
                                                  shape_string(v));
  check(vd == kd,
        "attention: k " + shape_string(k) + " and v " + shape_string(v) + " must have the same shape");
  check(kd[3] == c.d,
        "attention: q " + shape_string(q) + " and k " + shape_string(k) + " must have the same head_dim");
  check(c.nkv > 0 && c.nq % c.nkv == 0, "attention: " + std::to_string(c.nq) +
                                            " query heads are not a multiple of " + std::to_string(c.nkv) +
                                            " kv heads");
  c.qt = dtype_of(q, "q"), c.kt = dtype_of(k, "k"), c.vt = dtype_of(v, "v");
  c.device_type = q.device_type(), c.device_id = q.device_id();
  auto same_device = [&](const nb::ndarray<>& a, const char* what) {
    check(a.device_type() == c.device_type && a.device_id() == c.device_id,
          std::string("attention: ") + what + " is on another device than q");
  };
  same_device(k, "k");
  same_device(v, "v");
  check(c.device_type == kDLCPU || c.device_type == kDLCUDA,
        "attention: tensors must be on the CPU or a CUDA device (DLPack device type " +
            std::to_string(c.device_type) + ")");
  if (out) {
    const auto od = dims4(*out, "out");
    check(od == qd, "attention: out " + shape_string(*out) + " must have q's shape " + shape_string(q));
    c.ot = dtype_of(*out, "out");
    same_device(*out, "out");
  }
  if (c.device_type == kDLCPU) {
    if (out) check(c.ot == DType::F32, "attention: on the CPU out must be float32 (the executor's output)");
    for (auto [t, what] : {std::pair{c.qt, "q"}, std::pair{c.kt, "k"}, std::pair{c.vt, "v"}})
      check(t != DType::F16, std::string("attention: ") + what +
                                 " is float16, which the CPU executor does not read (float32 or bfloat16)");
  } else {
    check(c.qt != DType::F32, "attention: on CUDA q, k and v must be bfloat16 or float16 (got float32)");
    check(c.kt == c.qt && c.vt == c.qt && (!out || c.ot == c.qt),
          "attention: on CUDA q, k, v and out must share one dtype");
  }
  return c;
}

#ifdef TESSERA_PY_WITH_CUDA
// Runs f with the tensors' device current, restoring the caller's afterwards.
template <class F>
void on_device(int device_id, F&& f) {
  int previous = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device_id) TESSERA_CUDA_CHECK(cudaSetDevice(device_id));
  try {
    f();
  } catch (...) {
    if (previous != device_id) cudaSetDevice(previous);
    throw;
  }
  if (previous != device_id) TESSERA_CUDA_CHECK(cudaSetDevice(previous));
}

// One CudaLayerAttention per (policy, shape, device, fallback): the route, cuDNN plans, estimates and index
// buffers are made once and reused by later calls of the same shape (a model's layers share shapes and
// policies). dense_fallback = false switches off the dense fallback and shortcut (the pattern runs exactly).
attn::gpu::CudaLayerAttention& cuda_layer(const std::string& policy,
                                          const std::vector<attn::Pattern>& patterns,
                                          const attn::LoweringContext& ctx, int nkv, int d, int device,
                                          bool dense_fallback = true) {
  static std::mutex mutex;
  using Key = std::tuple<std::string, int, int, int, int, int, int, int, int, bool>;
  static std::map<Key, std::unique_ptr<attn::gpu::CudaLayerAttention>> cache;
  const Key key{
      policy, ctx.q_begin, ctx.q_len, ctx.kv_len,    ctx.total_len, static_cast<int>(patterns.size()),
      nkv,    d,           device,    dense_fallback};
  std::lock_guard lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= 64)
      cache.clear();  // shapes of one workload are few; a bound against unbounded growth
    attn::gpu::CudaAttentionOptions options = attn::gpu::cuda_attention_defaults();
    if (!dense_fallback) options.dense_fallback = options.dense_shortcut = false;
    it = cache.emplace(key, std::make_unique<attn::gpu::CudaLayerAttention>(patterns, ctx, nkv, d, options))
             .first;
  }
  return *it->second;
}
#endif

attn::LoweringContext context(int64_t q_len, int64_t kv_len, int64_t q_begin, int64_t total_len, int tile) {
  check(q_begin >= 0, "attention: q_begin must be >= 0, got " + std::to_string(q_begin));
  check(kv_len >= q_begin + q_len, "attention: kv_len " + std::to_string(kv_len) +
                                       " is less than q_begin + q_len = " + std::to_string(q_begin + q_len) +
                                       " (every query must see its own position)");
  check(total_len >= 0, "attention: total_len must be >= 0 (0: kv_len), got " + std::to_string(total_len));
  return attn::LoweringContext{static_cast<int32_t>(q_begin), static_cast<int32_t>(q_len),
                               static_cast<int32_t>(kv_len),
                               static_cast<int32_t>(std::max(total_len, kv_len)), tile};
}

// What an estimation step (ops_estimate, ops_pattern_mask) works from: q and k checked (batch 1), the layer's
// patterns and the lowering context.
struct EstimateCall {
  Call c;
  std::vector<attn::Pattern> patterns;
  attn::LoweringContext ctx;
};
EstimateCall estimate_call(const char* what, const nb::ndarray<>& q, const nb::ndarray<>& k, const std::string& policy,
                           int64_t q_begin, int64_t total_len, int tile) {
  const Call c = check_call(q, k, k, nullptr);
  check(c.batch == 1, std::string(what) + ": the step functions take batch 1, got " + std::to_string(c.batch));
  std::vector<attn::Pattern> patterns = parse_layer(policy, static_cast<int>(c.nq), static_cast<int>(c.nkv));
  const attn::LoweringContext ctx = context(c.q_len, c.kv_len, q_begin, total_len, tile);
  return {c, std::move(patterns), ctx};
}

bool all_dense(const std::vector<attn::Pattern>& patterns) {
  for (const attn::Pattern& p : patterns)
    if (!std::holds_alternative<attn::DensePattern>(p)) return false;
  return true;
}

uintptr_t address(const nb::ndarray<>& a) {
  return reinterpret_cast<uintptr_t>(a.data());
}

// Estimates as int32: [num_heads, then per head: kind (0 none, 1 vertical-slash, 2 block-sparse), then
//   VS: n_columns, n_offsets, columns..., offsets...
//   BS: block, first_q_block, n_offsets, n_key_blocks, offsets..., key_blocks...]
std::vector<int32_t> pack_estimates(const std::vector<attn::HeadEstimate>& estimates) {
  std::vector<int32_t> out{static_cast<int32_t>(estimates.size())};
  for (const attn::HeadEstimate& e : estimates) {
    if (const auto* vs = std::get_if<attn::VerticalSlashEstimate>(&e)) {
      out.insert(out.end(),
                 {1, static_cast<int32_t>(vs->columns.size()), static_cast<int32_t>(vs->offsets.size())});
      out.insert(out.end(), vs->columns.begin(), vs->columns.end());
      out.insert(out.end(), vs->offsets.begin(), vs->offsets.end());
    } else if (const auto* bs = std::get_if<attn::BlockSparseEstimate>(&e)) {
      out.insert(out.end(), {2, bs->block, bs->first_q_block, static_cast<int32_t>(bs->offsets.size()),
                             static_cast<int32_t>(bs->key_blocks.size())});
      out.insert(out.end(), bs->offsets.begin(), bs->offsets.end());
      out.insert(out.end(), bs->key_blocks.begin(), bs->key_blocks.end());
    } else {
      out.push_back(0);
    }
  }
  return out;
}

std::vector<attn::HeadEstimate> unpack_estimates(const int32_t* p, size_t n) {
  size_t i = 0;
  auto take = [&](const char* what) {
    check(i < n, std::string("estimates: the packed array ends early (at ") + what + ")");
    return p[i++];
  };
  auto take_list = [&](int32_t count, const char* what) {
    check(
        count >= 0 && static_cast<size_t>(count) <= n - i,
        std::string("estimates: ") + what + " count " + std::to_string(count) + " overruns the packed array");
    std::vector<int32_t> v(p + i, p + i + count);
    i += static_cast<size_t>(count);
    return v;
  };
  const int32_t heads = take("the head count");
  check(heads >= 0 && static_cast<size_t>(heads) <= n, "estimates: bad head count " + std::to_string(heads));
  std::vector<attn::HeadEstimate> out;
  for (int32_t h = 0; h < heads; ++h) {
    const int32_t kind = take("a head's kind");
    if (kind == 0) {
      out.emplace_back(std::monostate{});
    } else if (kind == 1) {
      attn::VerticalSlashEstimate e;
      const int32_t nc = take("n_columns"), no = take("n_offsets");
      e.columns = take_list(nc, "columns");
      e.offsets = take_list(no, "offsets");
      out.emplace_back(std::move(e));
    } else if (kind == 2) {
      attn::BlockSparseEstimate e;
      e.block = take("block");
      e.first_q_block = take("first_q_block");
      const int32_t no = take("n_offsets"), nk = take("n_key_blocks");
      e.offsets = take_list(no, "offsets");
      e.key_blocks = take_list(nk, "key_blocks");
      out.emplace_back(std::move(e));
    } else {
      throw Error("estimates: head " + std::to_string(h) + " has unknown kind " + std::to_string(kind));
    }
  }
  check(i == n, "estimates: " + std::to_string(n - i) + " values left over after the last head");
  return out;
}

// A new int32 numpy array owning a copy of `v` (with `shape`).
nb::ndarray<nb::numpy, int32_t> to_numpy(std::vector<int32_t> v, std::vector<size_t> shape) {
  auto* heap = new std::vector<int32_t>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  return nb::ndarray<nb::numpy, int32_t>(heap->data(), shape.size(), shape.data(), owner);
}

std::vector<int32_t> int32_vector(const nb::ndarray<>& a, const std::string& what) {
  check(a.device_type() == kDLCPU, what + ": must be on the CPU");
  const nb::dlpack::dtype t = a.dtype();
  check(t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) && t.bits == 32 && t.lanes == 1,
        what + ": must be int32");
  const size_t n = a.size();
  std::vector<int32_t> v(n);
  if (a.ndim() == 1) {
    for (size_t i = 0; i < n; ++i)
      v[i] = static_cast<const int32_t*>(a.data())[i * static_cast<size_t>(a.stride(0))];
  } else {
    check(a.ndim() == 2 && a.stride(1) == 1 && a.stride(0) == static_cast<int64_t>(a.shape(1)),
          what + ": must be 1-D, or 2-D and contiguous");
    std::memcpy(v.data(), a.data(), n * sizeof(int32_t));
  }
  return v;
}

// q, k (B = 1) -> per-head estimates for the layer's dynamic patterns (on the CPU).
std::vector<attn::HeadEstimate> estimate_cpu(const std::vector<attn::Pattern>& patterns,
                                             const nb::ndarray<>& q, const nb::ndarray<>& k, const Call& c,
                                             const attn::LoweringContext& ctx, float scale) {
  const TensorView qv = token_major(q, 0, c.qt), kv = token_major(k, 0, c.kt);
  const float s = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(c.d));
  return attn::estimate_layer(patterns, qv, kv, ctx, s, ThreadPool::global());
}

}  // namespace

void register_ops(nb::module_& m) {
  m.def(
      "ops_data_ptr", [](nb::ndarray<> a) { return address(a); }, "a"_a,
      "The data pointer the C++ side sees for a DLPack tensor (tests assert it is the caller's).");

  m.def(
      "ops_attention",
      [](nb::ndarray<> q, nb::ndarray<> k, nb::ndarray<> v, nb::ndarray<> out, const std::string& policy,
         float scale, int64_t q_begin, int64_t total_len, int32_t window, uintptr_t stream,
         bool dense_fallback) {
        const Call c = check_call(q, k, v, &out);
        std::vector<attn::Pattern> patterns =
            parse_layer(policy, static_cast<int>(c.nq), static_cast<int>(c.nkv));
        std::vector<uintptr_t> seen{address(q), address(k), address(v), address(out)};
        nb::gil_scoped_release release;
        for (int64_t b = 0; b < c.batch; ++b) {
          attn::AttentionArgs args;
          args.q = token_major(q, b, c.qt);
          args.k = token_major(k, b, c.kt);
          args.v = token_major(v, b, c.vt);
          args.out = token_major(out, b, c.ot);
          args.scale = scale;
          args.q_begin = static_cast<int32_t>(q_begin);
          args.window = window;
          if (c.device_type == kDLCUDA) {
#ifdef TESSERA_PY_WITH_CUDA
            const attn::LoweringContext ctx = context(c.q_len, c.kv_len, q_begin, total_len, 128);
            on_device(c.device_id, [&] {
              cuda_layer(policy, patterns, ctx, static_cast<int>(c.nkv), static_cast<int>(c.d), c.device_id,
                         dense_fallback)
                  .run(args, reinterpret_cast<cudaStream_t>(stream));
            });
            continue;
#else
            throw Error(
                "attention: CUDA tensors need a tessera module built with the CUDA backend (this one is CPU "
                "only)");
#endif
          }
          (void)stream, (void)dense_fallback;
          if (all_dense(patterns)) {
            attn::dense_attention_cpu(args);
            continue;
          }
          validate(args);
          const attn::LoweringContext ctx = context(c.q_len, c.kv_len, q_begin, total_len, 64);
          const auto estimates = attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(),
                                                      ThreadPool::global());
          attn::sparse_attention_cpu(args, attn::lower_layer(patterns, estimates, ctx));
        }
        return seen;
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "policy"_a, "scale"_a = 0.0f, "q_begin"_a = 0, "total_len"_a = 0,
      "window"_a = 0, "stream"_a = 0, "dense_fallback"_a = true,
      "Attention under one layer's policy, written into `out`: estimation, index and the sparse executor\n"
      "(dense layers: the dense executor). On CUDA, dense_fallback (the engine's rule) runs a layer dense "
      "where\n"
      "its index would cost more; False runs the pattern exactly. Returns the data pointers it read and "
      "wrote\n"
      "(q, k, v, out).");

  m.def(
      "ops_estimate",
      [](nb::ndarray<> q, nb::ndarray<> k, const std::string& policy, float scale, int64_t q_begin,
         int64_t total_len, int tile) {
        const auto [c, patterns, ctx] = estimate_call("estimate", q, k, policy, q_begin, total_len, tile);
        std::vector<int32_t> packed;
        if (c.device_type == kDLCUDA) {
#ifdef TESSERA_PY_WITH_CUDA
          // The device estimators (identical output to the CPU's), downloaded.
          attn::AttentionArgs args;
          args.q = token_major(q, 0, c.qt);
          args.k = token_major(k, 0, c.kt);
          args.v = args.k;
          args.out = args.q;  // never written: estimation reads q and k; the argument checks want an out view
          args.scale = scale;
          args.q_begin = static_cast<int32_t>(q_begin);
          nb::gil_scoped_release release;
          on_device(c.device_id, [&] {
            auto& layer = cuda_layer(policy, patterns, ctx, static_cast<int>(c.nkv), static_cast<int>(c.d),
                                     c.device_id);
            layer.estimate(args);
            TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
            packed =
                pack_estimates(layer.has_dynamic_heads() ? layer.download_estimates()
                                                         : std::vector<attn::HeadEstimate>(patterns.size()));
          });
#else
          throw Error("estimate: CUDA tensors need a tessera module built with the CUDA backend");
#endif
        } else {
          nb::gil_scoped_release release;
          packed = pack_estimates(estimate_cpu(patterns, q, k, c, ctx, scale));
        }
        const size_t n = packed.size();
        return to_numpy(std::move(packed), {n});
      },
      "q"_a, "k"_a, "policy"_a, "scale"_a = 0.0f, "q_begin"_a = 0, "total_len"_a = 0, "tile"_a = 64,
      "The estimates of the layer's dynamic heads (VS columns/offsets, BS blocks), packed into an int32 "
      "array.");

  m.def(
      "ops_unpack_estimates",
      [](nb::ndarray<> packed) {
        const std::vector<int32_t> v = int32_vector(packed, "estimates");
        nb::list heads;
        for (const attn::HeadEstimate& e : unpack_estimates(v.data(), v.size())) {
          nb::dict d;
          if (const auto* vs = std::get_if<attn::VerticalSlashEstimate>(&e)) {
            d["kind"] = "vertical_slash";
            d["columns"] = vs->columns;
            d["offsets"] = vs->offsets;
          } else if (const auto* bs = std::get_if<attn::BlockSparseEstimate>(&e)) {
            d["kind"] = "block_sparse";
            d["block"] = bs->block;
            d["first_q_block"] = bs->first_q_block;
            d["offsets"] = bs->offsets;
            d["key_blocks"] = bs->key_blocks;
          } else {
            d["kind"] = "static";
          }
          heads.append(d);
        }
        return heads;
      },
      "packed"_a, "The packed estimates as one dict per query head.");

  m.def(
      "ops_build_index",
      [](const std::string& policy, nb::ndarray<> estimates, int num_q_heads, int num_kv_heads, int64_t q_len,
         int64_t kv_len, int64_t q_begin, int64_t total_len, int tile) {
        const auto patterns = parse_layer(policy, num_q_heads, num_kv_heads);
        const attn::LoweringContext ctx = context(q_len, kv_len, q_begin, total_len, tile);
        const std::vector<int32_t> packed = int32_vector(estimates, "estimates");
        std::vector<attn::HeadEstimate> e = unpack_estimates(packed.data(), packed.size());
        check(e.size() == patterns.size(), "build_index: estimates for " + std::to_string(e.size()) +
                                               " heads, the layer has " + std::to_string(patterns.size()));
        attn::SparseIndex index;
        {
          nb::gil_scoped_release release;
          index = attn::lower_layer(patterns, e, ctx);
        }
        std::vector<int32_t> ranges;
        ranges.reserve(index.ranges.size() * 2);
        for (const attn::KeyRange& r : index.ranges) ranges.insert(ranges.end(), {r.begin, r.end});
        const size_t nr = index.ranges.size(), no = index.range_offsets.size(), nc = index.columns.size(),
                     nco = index.column_offsets.size();
        return nb::make_tuple(
            to_numpy(std::move(index.range_offsets), {no}), to_numpy(std::move(ranges), {nr, 2}),
            to_numpy(std::move(index.column_offsets), {nco}), to_numpy(std::move(index.columns), {nc}));
      },
      "policy"_a, "estimates"_a, "num_q_heads"_a, "num_kv_heads"_a, "q_len"_a, "kv_len"_a, "q_begin"_a = 0,
      "total_len"_a = 0, "tile"_a = 64,
      "Lowers the layer's patterns (with their estimates) to the range+column index: (range_offsets, ranges "
      "[n, 2],\n"
      "column_offsets, columns), int32, CSR per (query head, query tile).");

  m.def(
      "ops_run_index",
      [](nb::ndarray<> q, nb::ndarray<> k, nb::ndarray<> v, nb::ndarray<> out, nb::ndarray<> range_offsets,
         nb::ndarray<> ranges, nb::ndarray<> column_offsets, nb::ndarray<> columns, int tile, int64_t q_begin,
         float scale, int32_t window, uintptr_t stream) {
        const Call c = check_call(q, k, v, &out);
        check(c.batch == 1, "run_index: the step functions take batch 1, got " + std::to_string(c.batch));
        attn::SparseIndex index;
        index.num_heads = static_cast<int32_t>(c.nq);
        index.tile = tile;
        index.q_begin = static_cast<int32_t>(q_begin);
        index.q_len = static_cast<int32_t>(c.q_len);
        index.kv_len = static_cast<int32_t>(c.kv_len);
        index.range_offsets = int32_vector(range_offsets, "range_offsets");
        const std::vector<int32_t> flat = int32_vector(ranges, "ranges");
        check(flat.size() % 2 == 0, "ranges: expected [n, 2] (begin, end) pairs");
        for (size_t i = 0; i < flat.size(); i += 2) index.ranges.push_back({flat[i], flat[i + 1]});
        index.column_offsets = int32_vector(column_offsets, "column_offsets");
        index.columns = int32_vector(columns, "columns");
        index.validate();
        attn::AttentionArgs args;
        args.q = token_major(q, 0, c.qt);
        args.k = token_major(k, 0, c.kt);
        args.v = token_major(v, 0, c.vt);
        args.out = token_major(out, 0, c.ot);
        args.scale = scale;
        args.q_begin = static_cast<int32_t>(q_begin);
        args.window = window;
        nb::gil_scoped_release release;
        if (c.device_type == kDLCUDA) {
#ifdef TESSERA_PY_WITH_CUDA
          on_device(c.device_id, [&] {
            const auto s = reinterpret_cast<cudaStream_t>(stream);
            const attn::gpu::DeviceSparseIndex dix = attn::gpu::DeviceSparseIndex::upload(index, s);
            attn::gpu::DeviceWorkPlan plan =
                attn::gpu::DeviceWorkPlan::upload(attn::gpu::plan_prefill(index), s);
            attn::gpu::sparse_prefill(args, dix, plan, s);
            // The uploaded index and plan are freed on return: wait for the kernel that reads them.
            TESSERA_CUDA_CHECK(cudaStreamSynchronize(s));
          });
          return;
#else
          throw Error("run_index: CUDA tensors need a tessera module built with the CUDA backend");
#endif
        }
        (void)stream;
        attn::sparse_attention_cpu(args, index);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "range_offsets"_a, "ranges"_a, "column_offsets"_a, "columns"_a,
      "tile"_a = 64, "q_begin"_a = 0, "scale"_a = 0.0f, "window"_a = 0, "stream"_a = 0,
      "The sparse executor on a given index (batch 1), written into `out`.");

  m.def(
      "ops_pattern_mask",
      [](nb::ndarray<> q, nb::ndarray<> k, const std::string& policy, float scale, int64_t q_begin,
         int64_t total_len, int tile) {
        const auto [c, patterns, ctx] = estimate_call("pattern_mask", q, k, policy, q_begin, total_len, tile);
        check(c.device_type == kDLCPU, "pattern_mask: q and k must be on the CPU");
        auto* mask = new std::vector<uint8_t>(static_cast<size_t>(c.nq * c.q_len * c.kv_len));
        nb::capsule owner(mask, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
        {
          nb::gil_scoped_release release;
          const auto estimates = estimate_cpu(patterns, q, k, c, ctx, scale);
          for (size_t h = 0; h < patterns.size(); ++h) {
            const std::vector<uint8_t> m1 = attn::pattern_mask(patterns[h], estimates[h], ctx);
            std::memcpy(mask->data() + h * m1.size(), m1.data(), m1.size());
          }
        }
        const size_t shape[3] = {static_cast<size_t>(c.nq), static_cast<size_t>(c.q_len),
                                 static_cast<size_t>(c.kv_len)};
        return nb::ndarray<nb::numpy, uint8_t>(mask->data(), 3, shape, owner);
      },
      "q"_a, "k"_a, "policy"_a, "scale"_a = 0.0f, "q_begin"_a = 0, "total_len"_a = 0, "tile"_a = 64,
      "The layer's explicit mask [num_q_heads, q_len, kv_len] (uint8; causal included), straight from each\n"
      "pattern's per-cell definition (attention/index/lower.h pattern_mask), estimates made from q and k.");

  m.def(
      "ops_reference",
      [](nb::ndarray<> q, nb::ndarray<> k, nb::ndarray<> v, const std::string& policy, float scale,
         int64_t q_begin, int64_t total_len, int32_t window, int tile) {
        const Call c = check_call(q, k, v, nullptr);
        check(c.device_type == kDLCPU, "reference: q, k and v must be on the CPU");
        const auto patterns = parse_layer(policy, static_cast<int>(c.nq), static_cast<int>(c.nkv));
        const attn::LoweringContext ctx = context(c.q_len, c.kv_len, q_begin, total_len, tile);
        const size_t per = static_cast<size_t>(c.nq * c.q_len * c.d);
        auto* result = new std::vector<double>(per * static_cast<size_t>(c.batch));
        nb::capsule owner(result, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
        {
          nb::gil_scoped_release release;
          std::vector<float> scratch(per);
          for (int64_t b = 0; b < c.batch; ++b) {
            attn::AttentionArgs args;
            args.q = token_major(q, b, c.qt);
            args.k = token_major(k, b, c.kt);
            args.v = token_major(v, b, c.vt);
            args.out = TensorView(scratch.data(), DType::F32, {c.q_len, c.nq, c.d});
            args.scale = scale;
            args.q_begin = static_cast<int32_t>(q_begin);
            args.window = window;
            validate(args);
            const auto estimates = attn::estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(),
                                                        ThreadPool::global());
            std::vector<std::vector<uint8_t>> masks;
            for (size_t h = 0; h < patterns.size(); ++h)
              masks.push_back(attn::pattern_mask(patterns[h], estimates[h], ctx));
            std::vector<double> out64;
            const int64_t kv_len = c.kv_len;
            attn::reference_attention_masked(
                args,
                [&](int head, int row, int key) {
                  return masks[static_cast<size_t>(head)][static_cast<size_t>(row * kv_len + key)] != 0;
                },
                &out64);
            // out64 is [q_len][heads][head_dim]; the result is [batch][heads][q_len][head_dim].
            double* dst = result->data() + static_cast<size_t>(b) * per;
            for (int64_t s = 0; s < c.q_len; ++s)
              for (int64_t h = 0; h < c.nq; ++h)
                std::memcpy(dst + (h * c.q_len + s) * c.d, out64.data() + (s * c.nq + h) * c.d,
                            static_cast<size_t>(c.d) * sizeof(double));
          }
        }
        const size_t shape[4] = {static_cast<size_t>(c.batch), static_cast<size_t>(c.nq),
                                 static_cast<size_t>(c.q_len), static_cast<size_t>(c.d)};
        return nb::ndarray<nb::numpy, double>(result->data(), 4, shape, owner);
      },
      "q"_a, "k"_a, "v"_a, "policy"_a, "scale"_a = 0.0f, "q_begin"_a = 0, "total_len"_a = 0, "window"_a = 0,
      "tile"_a = 64,
      "tessera's masked reference in float64 ([batch, heads, q_len, head_dim]): dense attention over each "
      "head's\n"
      "explicit pattern mask (pattern_mask, causal and window on top), attention/cpu/reference.h.");
}

}  // namespace tessera::python
