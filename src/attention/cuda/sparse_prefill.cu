// Argument checks and dispatch of the sparse prefill executor (kernel: sparse_prefill_kernel.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/sparse_prefill_kernel.cuh"
#include "core/error.h"

namespace tessera::attn::gpu {

namespace detail {
// Instantiated in sparse_prefill_{bf16,f16}_d{64,128,256}.cu.
#define TESSERA_DECLARE_PREFILL(T, D)                                                       \
  extern template void launch_sparse_prefill<T, D, 64>(const PrefillParams&, cudaStream_t); \
  extern template void launch_sparse_prefill<T, D, 128>(const PrefillParams&, cudaStream_t);
TESSERA_DECLARE_PREFILL(__nv_bfloat16, 64)
TESSERA_DECLARE_PREFILL(__nv_bfloat16, 128)
TESSERA_DECLARE_PREFILL(__nv_bfloat16, 256)
TESSERA_DECLARE_PREFILL(__half, 64)
TESSERA_DECLARE_PREFILL(__half, 128)
TESSERA_DECLARE_PREFILL(__half, 256)
#undef TESSERA_DECLARE_PREFILL
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

template <typename T>
void dispatch(int d, int tile, const detail::PrefillParams& p, cudaStream_t stream) {
  switch (d * 1000 + tile) {
    case 64064:
      detail::launch_sparse_prefill<T, 64, 64>(p, stream);
      return;
    case 64128:
      detail::launch_sparse_prefill<T, 64, 128>(p, stream);
      return;
    case 128064:
      detail::launch_sparse_prefill<T, 128, 64>(p, stream);
      return;
    case 128128:
      detail::launch_sparse_prefill<T, 128, 128>(p, stream);
      return;
    case 256064:
      detail::launch_sparse_prefill<T, 256, 64>(p, stream);
      return;
    case 256128:
      detail::launch_sparse_prefill<T, 256, 128>(p, stream);
      return;
    default:
      break;
  }
  throw Error("CUDA sparse prefill: head_dim " + std::to_string(d) + " with index tile " +
              std::to_string(tile) + " is not built (head_dim 64, 128 or 256; tile 64 or 128)");
}

}  // namespace

bool sparse_prefill_supports(int head_dim, int tile) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && (tile == 64 || tile == 128);
}

void validate_cuda_args(const AttentionArgs& a) {
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

void sparse_prefill(const AttentionArgs& args, const DeviceSparseIndex& index, DeviceWorkPlan& plan,
                    cudaStream_t stream) {
  validate_cuda_args(args);
  check(index.num_heads == args.num_q_heads() && index.q_begin == args.q_begin &&
            index.q_len == args.q_len() && index.kv_len == args.kv_len(),
        "CUDA sparse prefill: the index (heads " + std::to_string(index.num_heads) + ", q_begin " +
            std::to_string(index.q_begin) + ", q_len " + std::to_string(index.q_len) + ", kv_len " +
            std::to_string(index.kv_len) + ") does not describe this call");
  check(plan.num_items == index.num_items(), "CUDA sparse prefill: the work plan has " +
                                                 std::to_string(plan.num_items) + " items, the index " +
                                                 std::to_string(index.num_items()));
  if (args.q_len() == 0) return;

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
  p.num_tiles = index.num_tiles();
  p.group = static_cast<int32_t>(args.group_size());
  p.scale_log2 = args.effective_scale() * 1.4426950408889634f;
  p.range_offsets = index.range_offsets.data();
  p.ranges = reinterpret_cast<const int2*>(index.ranges.data());
  p.column_offsets = index.column_offsets.data();
  p.columns = index.columns.data();
  p.order = plan.order.data();
  p.num_items = plan.num_items;
  p.counter = plan.counter.data();

  const int d = static_cast<int>(args.head_dim());
  if (args.q.dtype == DType::BF16) {
    dispatch<__nv_bfloat16>(d, index.tile, p, stream);
  } else {
    dispatch<__half>(d, index.tile, p, stream);
  }
}

}  // namespace tessera::attn::gpu
