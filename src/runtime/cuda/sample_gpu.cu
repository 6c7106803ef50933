#include "runtime/cuda/sample_gpu.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include <cfloat>
#include <climits>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace tessera::runtime::gpu {

namespace {

using attn::gpu::check_launch;

constexpr int kThreads = 512;

// Order key of a float: larger float, larger key (the sampler orders by logit, ties to the smaller id).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The value thread 0 holds (a CUB block reduction's result) on every thread, through `slot` in shared memory; the
// reduction's storage may be reused afterwards.
template <class T, class Slot>
__device__ __forceinline__ T to_all(T v, Slot& slot) {
  if (threadIdx.x == 0) slot = v;
  __syncthreads();
  const T r = static_cast<T>(slot);
  __syncthreads();
  return r;
}

struct Shared {
  union {
    cub::BlockReduce<double, kThreads>::TempStorage rd;
    cub::BlockReduce<float, kThreads>::TempStorage rf;
    cub::BlockReduce<unsigned, kThreads>::TempStorage ru;
    cub::BlockReduce<int, kThreads>::TempStorage ri;
    cub::BlockScan<double, kThreads>::TempStorage sd;
    cub::BlockScan<int, kThreads>::TempStorage si;
  } t;
  double d;
  unsigned u;
  int found;
};

__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const float* logits, int64_t ld, int n,
                                                               const SampleRow* rows, double* scratch, int32_t* out) {
  __shared__ Shared sh;
  const SampleRow job = rows[blockIdx.x];
  const float* x = logits + static_cast<int64_t>(job.row) * ld;
  double* p = scratch + static_cast<int64_t>(blockIdx.x) * n;
  const int tid = threadIdx.x;

  // The largest logit, then every probability relative to it.
  float m = -FLT_MAX;
  for (int i = tid; i < n; i += kThreads) m = fmaxf(m, x[i]);
  m = cub::BlockReduce<float, kThreads>(sh.t.rf).Reduce(m, cuda::maximum<>{});
  const double inv_t = 1.0 / static_cast<double>(job.temperature);
  const double top = to_all(static_cast<double>(m), sh.d) * inv_t;
  for (int i = tid; i < n; i += kThreads) p[i] = exp(static_cast<double>(x[i]) * inv_t - top);
  __syncthreads();

  // count / mass of the tokens (of the kept set so far) whose key is >= t.
  uint32_t tk = 0;          // top_k: members have key > tk, or key == tk and id <= tk_id
  int tk_id = INT_MAX;
  auto in_k = [&](int i, uint32_t k) { return k > tk || (k == tk && i <= tk_id); };
  auto count_ge = [&](uint32_t t) {
    unsigned c = 0;
    for (int i = tid; i < n; i += kThreads) c += order_key(x[i]) >= t ? 1u : 0u;
    return to_all(cub::BlockReduce<unsigned, kThreads>(sh.t.ru).Sum(c), sh.u);
  };
  auto mass_ge = [&](uint64_t t) {  // t may be 2^32: nothing
    double s = 0;
    for (int i = tid; i < n; i += kThreads) {
      const uint32_t k = order_key(x[i]);
      if (k >= t && in_k(i, k)) s += p[i];
    }
    return to_all(cub::BlockReduce<double, kThreads>(sh.t.rd).Sum(s), sh.d);
  };
  // The smallest id i with weight(i) > 0 at which the running sum of the weights in id order satisfies
  // reached(sum), or INT_MAX.
  auto first_reaching = [&](auto weight, auto reached) {
    if (tid == 0) sh.found = INT_MAX;
    __syncthreads();
    double carry = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + tid;
      const double w = i < n ? weight(i) : 0.0;
      double incl, total;
      cub::BlockScan<double, kThreads>(sh.t.sd).InclusiveSum(w, incl, total);
      if (w > 0 && reached(carry + incl)) atomicMin(&sh.found, i);
      __syncthreads();
      if (sh.found != INT_MAX) break;
      carry += total;
    }
    const int r = sh.found;
    __syncthreads();
    return r;
  };
  // The smallest id i among tokens with key == t (and in the top_k set) at which the running sum of their weights
  // reaches `need` (weights: 1 for a count, p for a mass).
  auto tie_cut = [&](uint32_t t, double need, bool by_mass) {
    return first_reaching(
        [&](int i) {
          const uint32_t k = order_key(x[i]);
          return k == t && in_k(i, k) ? (by_mass ? p[i] : 1.0) : 0.0;
        },
        [&](double sum) { return sum >= need; });
  };

  if (job.top_k > 0 && job.top_k < n) {
    const auto k = static_cast<unsigned>(job.top_k);
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      if (count_ge(cand) >= k) prefix = cand;
    }
    const unsigned above = prefix == 0xFFFFFFFFu ? 0u : count_ge(prefix + 1);
    tk = prefix;
    tk_id = INT_MAX;
    tk_id = tie_cut(prefix, static_cast<double>(k - above), false);
  }
  uint32_t tp = 0;  // top_p: members also have key > tp, or key == tp and id <= tp_id
  int tp_id = INT_MAX;
  if (job.top_p < 1.0f) {
    const double total = mass_ge(0);
    const double target = static_cast<double>(job.top_p) * total;
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      if (mass_ge(cand) >= target) prefix = cand;
    }
    const double above = mass_ge(static_cast<uint64_t>(prefix) + 1);
    tp = prefix;
    tp_id = tie_cut(prefix, target - above, true);
    if (tp_id == INT_MAX) tp_id = INT_MAX - 1;  // rounding: the whole tie
  }
  // min_p: p is relative to the largest logit, whose p is exp(0) = 1 (the host's rule).
  const double min_p = static_cast<double>(job.min_p);
  auto kept = [&](int i) {
    const uint32_t k = order_key(x[i]);
    return in_k(i, k) && (k > tp || (k == tp && i <= tp_id)) && (min_p <= 0.0 || p[i] >= min_p);
  };

  // The draw: the kept tokens in id order against u times their total.
  double s = 0;
  int last = -1;
  for (int i = tid; i < n; i += kThreads)
    if (kept(i)) {
      s += p[i];
      last = max(last, i);
    }
  const double r = job.u * to_all(cub::BlockReduce<double, kThreads>(sh.t.rd).Sum(s), sh.d);
  last = cub::BlockReduce<int, kThreads>(sh.t.ri).Reduce(last, cuda::maximum<>{});
  const int found = first_reaching([&](int i) { return kept(i) ? p[i] : 0.0; }, [&](double sum) { return r < sum; });
  if (tid == 0) out[blockIdx.x] = found != INT_MAX ? found : max(last, 0);
}

__global__ void edit_rows_kernel(float* logits, int64_t ld, const RowEdit* edits, int count) {
  const int i = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const RowEdit e = edits[i];
  float* x = logits + static_cast<int64_t>(e.row) * ld + e.edit.token;
  *x = edit_logit(*x, e.edit);
}

}  // namespace

void edit_rows(float* logits, int64_t ld, const RowEdit* edits, int32_t count, cudaStream_t stream) {
  if (count <= 0) return;
  constexpr int kEditThreads = 256;
  edit_rows_kernel<<<static_cast<unsigned>((count + kEditThreads - 1) / kEditThreads), kEditThreads, 0, stream>>>(
      logits, ld, edits, count);
  check_launch("edit_rows");
}

void sample_rows(const float* logits, int64_t ld, int32_t n, const SampleRow* rows, int32_t count, double* scratch,
                 int32_t* out, cudaStream_t stream) {
  if (count <= 0) return;
  check(n > 0 && ld >= n, "sample_rows: bad row size " + std::to_string(n));
  sample_rows_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(logits, ld, n, rows, scratch, out);
  check_launch("sample_rows");
}

}  // namespace tessera::runtime::gpu
