// attention_bench — CPU attention prefill: dense executor against every sparse pattern, same run, same
// inputs.
//
// Prints, first, the machine's measured f32 FMA peak (AVX-512 and AVX2; one core, and all cores together),
// then one table per (dtype, head_dim, seq_len): the dense causal executor, then each pattern with its
// density, the time to estimate and lower its index, the executor's time alone, and the speedups over dense.
//
// Two clocks, because the machine this runs on is often shared:
//  - wall: elapsed time (what a user waits for), best of --reps;
//  - cpu: CPU time of the whole process (all threads) for the same kind of run, best of --reps. It does not
//  grow
//    when other processes take turns on the cores, so GFLOP/s per busy core (FLOPs / cpu time) against the
//    one-core peak is a load-independent efficiency, and cpu speedups are load-independent ratios.
// FLOPs are 4·d per visible (row, key) cell: causal cells for dense, mask cells for a pattern.
// The peak is measured with CPU time per thread as well (a loop of independent FMAs); "all cores" sums the
// threads' rates, so it shows whether the cores really are separate (SMT siblings would share one peak).
//
//   attention_bench [--seq 4096,8192,16384] [--dim 64,128] [--dtype f32,bf16] [--heads 1] [--kv-heads H]
//                   [--reps 3] [--threads 0] [--kernel auto|baseline|avx512] [--no-peak]
//                   [--patterns ashape,triangle,moa_window,vertical_slash,block_sparse]
//   attention_bench --decode [--seq 8192,32768] [--shapes 9/3/64,4/1/256] [--q-len 1,4] [--dtype f32,bf16]
//                   [--reps 3] [--threads 0] [--kernel ...]
//
// --decode times dense attention of a few query rows at the end of a kv_len-long cache (a decode step: the
// rows are the last positions), per shape `q_heads/kv_heads/head_dim`; one timing is the mean over a batch of
// calls (>= 0.2 s), best of --reps. Bandwidth is the K and V bytes of one step over its wall time.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention/attention_args.h"
#include "attention/cpu/cpu_kernel.h"
#include "attention/cpu/dense_attention.h"
#include "attention/cpu/sparse_attention.h"
#include "attention/index/estimate.h"
#include "attention/index/lower.h"
#include "attention/index/sparse_index.h"
#include "attention/pattern/pattern.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace {

using namespace tessera;
using namespace tessera::attn;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------------------------
// FMA peak: independent FMA chains (more than latency x ports), nothing else in the loop.

double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double process_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Runs body() -> flops on `threads` threads at once; returns the sum of the threads' rates, each measured
// with its own CPU time (GFLOP/s).
template <class F>
double gflops_of(F body, int threads) {
  std::vector<double> rate(static_cast<size_t>(threads));
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      const double t0 = thread_cpu_seconds();
      const double flops = body();
      rate[static_cast<size_t>(t)] = flops / (thread_cpu_seconds() - t0) * 1e-9;
    });
  }
  for (auto& th : ts) th.join();
  double total = 0;
  for (double r : rate) total += r;
  return total;
}

// Hand-written loops: 24 (AVX-512) or 12 (AVX2) independent FMA chains on zeroed registers, so that neither
// latency nor the compiler limits the rate.
__attribute__((target("avx512f"))) double fma_loop_avx512(int64_t iters) {
  int64_t n = iters;
  __asm__ volatile(
      "vpxord %%zmm30, %%zmm30, %%zmm30\n"
      "vpxord %%zmm31, %%zmm31, %%zmm31\n"
      "vxorps %%xmm0, %%xmm0, %%xmm0\n"
      "vxorps %%xmm1, %%xmm1, %%xmm1\n"
      "vxorps %%xmm2, %%xmm2, %%xmm2\n"
      "vxorps %%xmm3, %%xmm3, %%xmm3\n"
      "vxorps %%xmm4, %%xmm4, %%xmm4\n"
      "vxorps %%xmm5, %%xmm5, %%xmm5\n"
      "vxorps %%xmm6, %%xmm6, %%xmm6\n"
      "vxorps %%xmm7, %%xmm7, %%xmm7\n"
      "vxorps %%xmm8, %%xmm8, %%xmm8\n"
      "vxorps %%xmm9, %%xmm9, %%xmm9\n"
      "vxorps %%xmm10, %%xmm10, %%xmm10\n"
      "vxorps %%xmm11, %%xmm11, %%xmm11\n"
      "vxorps %%xmm12, %%xmm12, %%xmm12\n"
      "vxorps %%xmm13, %%xmm13, %%xmm13\n"
      "vxorps %%xmm14, %%xmm14, %%xmm14\n"
      "vxorps %%xmm15, %%xmm15, %%xmm15\n"
      "vmovaps %%zmm0, %%zmm16\n"
      "vmovaps %%zmm0, %%zmm17\n"
      "vmovaps %%zmm0, %%zmm18\n"
      "vmovaps %%zmm0, %%zmm19\n"
      "vmovaps %%zmm0, %%zmm20\n"
      "vmovaps %%zmm0, %%zmm21\n"
      "vmovaps %%zmm0, %%zmm22\n"
      "vmovaps %%zmm0, %%zmm23\n"
      ".p2align 5\n"
      "1:\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm1\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm2\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm3\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm4\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm5\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm6\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm7\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm8\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm9\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm11\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm12\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm13\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm14\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm15\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm16\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm17\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm18\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm19\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm20\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm21\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm22\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm23\n"
      "dec %0\n"
      "jnz 1b\n"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",
        "xmm23", "xmm30", "xmm31", "cc");
  return static_cast<double>(iters) * 24 * 16 * 2;
}

double fma_loop_avx2(int64_t iters) {
  int64_t n = iters;
  __asm__ volatile(
      "vxorps %%xmm0, %%xmm0, %%xmm0\n"
      "vxorps %%xmm1, %%xmm1, %%xmm1\n"
      "vxorps %%xmm2, %%xmm2, %%xmm2\n"
      "vxorps %%xmm3, %%xmm3, %%xmm3\n"
      "vxorps %%xmm4, %%xmm4, %%xmm4\n"
      "vxorps %%xmm5, %%xmm5, %%xmm5\n"
      "vxorps %%xmm6, %%xmm6, %%xmm6\n"
      "vxorps %%xmm7, %%xmm7, %%xmm7\n"
      "vxorps %%xmm8, %%xmm8, %%xmm8\n"
      "vxorps %%xmm9, %%xmm9, %%xmm9\n"
      "vxorps %%xmm10, %%xmm10, %%xmm10\n"
      "vxorps %%xmm11, %%xmm11, %%xmm11\n"
      "vxorps %%xmm12, %%xmm12, %%xmm12\n"
      "vxorps %%xmm13, %%xmm13, %%xmm13\n"
      "vxorps %%xmm14, %%xmm14, %%xmm14\n"
      "vxorps %%xmm15, %%xmm15, %%xmm15\n"
      ".p2align 5\n"
      "1:\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n"
      "dec %0\n"
      "jnz 1b\n"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  return static_cast<double>(iters) * 12 * 8 * 2;
}

struct Peak {
  double avx512_1 = 0, avx512_all = 0, avx2_1 = 0, avx2_all = 0;
};

Peak measure_peak(int threads) {
  Peak p;
  const int64_t iters = 40'000'000;
  auto best = [&](auto body, int n) {
    double b = 0;
    for (int rep = 0; rep < 3; ++rep) b = std::max(b, gflops_of(body, n));
    return b;
  };
  if (cpu_has_avx512()) {
    p.avx512_1 = best([&] { return fma_loop_avx512(iters); }, 1);
    p.avx512_all = best([&] { return fma_loop_avx512(iters); }, threads);
  }
  p.avx2_1 = best([&] { return fma_loop_avx2(iters); }, 1);
  p.avx2_all = best([&] { return fma_loop_avx2(iters); }, threads);
  return p;
}

// ---------------------------------------------------------------------------------------------------------------

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    const size_t e = s.find(',', b);
    const std::string item = s.substr(b, e == std::string::npos ? std::string::npos : e - b);
    if (!item.empty()) out.push_back(item);
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

std::vector<int> split_ints(const std::string& s) {
  std::vector<int> out;
  for (const std::string& x : split(s)) out.push_back(std::atoi(x.c_str()));
  return out;
}

Tensor random_tensor(DType t, int64_t n, int64_t heads, int64_t d, uint32_t seed) {
  Tensor x(t, {n, heads, d});
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = dist(rng);
    if (t == DType::BF16) {
      x.ptr<bf16>()[i] = f32_to_bf16(v);
    } else {
      x.ptr<float>()[i] = v;
    }
  }
  return x;
}

struct Timing {
  double wall = 1e300;  // seconds, best of reps
  double cpu = 1e300;   // process CPU seconds (all threads), best of reps
};

Timing best_of(int reps, const std::function<void()>& f) {
  f();  // warm-up
  Timing best;
  for (int r = 0; r < reps; ++r) {
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    f();
    best.wall = std::min(best.wall, std::chrono::duration<double>(Clock::now() - t0).count());
    best.cpu = std::min(best.cpu, process_cpu_seconds() - c0);
  }
  return best;
}

struct Built {
  SparseIndex index;
  Timing time;  // estimate + lower
};

Built build_index(const std::vector<Pattern>& patterns, const AttentionArgs& args, const LoweringContext& ctx,
                  ThreadPool& pool, int reps) {
  Built b;
  b.time = best_of(reps, [&] {
    const auto est = estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool);
    b.index = lower_layer(patterns, est, ctx);
  });
  return b;
}

double density_of(const Pattern& p, int heads, const AttentionArgs& args, const LoweringContext& ctx,
                  ThreadPool& pool) {
  const std::vector<Pattern> patterns(static_cast<size_t>(heads), p);
  const auto est = estimate_layer(patterns, args.q, args.k, ctx, args.effective_scale(), pool);
  return index_stats(lower_layer(patterns, est, ctx)).density();
}

// Smallest budget in [lo, hi] whose density reaches target (density grows with the budget).
int32_t budget_for_density(double target, int32_t lo, int32_t hi,
                           const std::function<double(int32_t)>& density) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (density(mid) >= target) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

struct Options {
  bool decode = false;
  std::vector<int> decode_seqs = {8192, 32768};
  std::vector<int> q_lens = {1};
  std::vector<std::string> shapes = {"9/3/64", "4/1/256"};
  std::vector<int> seqs = {4096, 8192, 16384};
  std::vector<int> dims = {64, 128};
  std::vector<std::string> dtypes = {"f32", "bf16"};
  std::vector<std::string> patterns = {"ashape", "triangle", "moa_window", "vertical_slash", "block_sparse"};
  int heads = 1, kv_heads = 0, reps = 3, threads = 0;
  std::string kernel = "auto";
  bool peak = true;
};

void usage() {
  std::printf(
      "usage: attention_bench [--seq 4096,8192,16384] [--dim 64,128] [--dtype f32,bf16] [--heads 1] "
      "[--kv-heads H]\n"
      "                       [--reps 3] [--threads 0] [--kernel auto|baseline|avx512] [--no-peak]\n"
      "                       [--patterns ashape,triangle,moa_window,vertical_slash,block_sparse]\n"
      "       attention_bench --decode [--seq 8192,32768] [--shapes 9/3/64,4/1/256] [--q-len 1,4] "
      "[--dtype f32,bf16]\n"
      "                       [--reps 3] [--threads 0] [--kernel auto|baseline|avx512]\n");
}

// Decode steps: q_len rows at positions [kv_len - q_len, kv_len), dense over the whole cache.
void run_decode(const Options& o, const std::vector<int>& seqs, ThreadPool& pool) {
  std::printf(
      "\n## decode: dense attention of the last q_len rows over a kv_len cache\n\n"
      "| dtype | heads q/kv | d | kv_len | q_len | wall us | cpu us | K+V GB/s |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& dt : o.dtypes) {
    const DType dtype = dt == "bf16" ? DType::BF16 : DType::F32;
    for (const std::string& shape : o.shapes) {
      std::vector<int> hqd;
      size_t b = 0;
      while (b <= shape.size()) {
        const size_t e = shape.find('/', b);
        hqd.push_back(std::atoi(shape.substr(b, e == std::string::npos ? std::string::npos : e - b).c_str()));
        if (e == std::string::npos) break;
        b = e + 1;
      }
      if (hqd.size() != 3 || hqd[0] <= 0 || hqd[1] <= 0 || hqd[2] <= 0)
        throw Error("--shapes: expected q_heads/kv_heads/head_dim, got '" + shape + "'");
      const int hq = hqd[0], hkv = hqd[1], d = hqd[2];
      for (int s : seqs) {
        Tensor k = random_tensor(dtype, s, hkv, d, 2), v = random_tensor(dtype, s, hkv, d, 3);
        for (int q_len : o.q_lens) {
          Tensor q = random_tensor(dtype, q_len, hq, d, 1);
          Tensor out(DType::F32, {q_len, hq, d});
          AttentionArgs args;
          args.q = q;
          args.k = k;
          args.v = v;
          args.out = out;
          args.q_begin = s - q_len;
          // Calls per timing: enough for >= 0.2 s, measured on one call.
          const auto t0 = Clock::now();
          dense_attention_cpu(args, pool);
          const double one = std::chrono::duration<double>(Clock::now() - t0).count();
          const int batch = std::max(1, static_cast<int>(0.2 / std::max(one, 1e-6)));
          const Timing t = best_of(o.reps, [&] {
            for (int i = 0; i < batch; ++i) dense_attention_cpu(args, pool);
          });
          const double wall = t.wall / batch, cpu = t.cpu / batch;
          const double bytes = 2.0 * s * hkv * d * (dtype == DType::BF16 ? 2 : 4);
          std::printf("| %s | %d/%d | %d | %d | %d | %.1f | %.1f | %.1f |\n", dt.c_str(), hq, hkv, d, s,
                      q_len, wall * 1e6, cpu * 1e6, bytes / wall * 1e-9);
          std::fflush(stdout);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--decode") {
      o.decode = true;
    } else if (a == "--q-len") {
      o.q_lens = split_ints(next());
    } else if (a == "--shapes") {
      o.shapes = split(next());
    } else if (a == "--seq") {
      o.seqs = o.decode_seqs = split_ints(next());
    } else if (a == "--dim") {
      o.dims = split_ints(next());
    } else if (a == "--dtype") {
      o.dtypes = split(next());
    } else if (a == "--heads") {
      o.heads = std::atoi(next().c_str());
    } else if (a == "--kv-heads") {
      o.kv_heads = std::atoi(next().c_str());
    } else if (a == "--reps") {
      o.reps = std::atoi(next().c_str());
    } else if (a == "--threads") {
      o.threads = std::atoi(next().c_str());
    } else if (a == "--kernel") {
      o.kernel = next();
    } else if (a == "--patterns") {
      o.patterns = split(next());
    } else if (a == "--no-peak") {
      o.peak = false;
    } else {
      usage();
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (o.kv_heads <= 0) o.kv_heads = o.heads;

  try {
    if (o.kernel == "baseline") set_cpu_kernel(CpuKernel::Baseline);
    if (o.kernel == "avx512") set_cpu_kernel(CpuKernel::Avx512);
    ThreadPool pool(o.threads);
    const int threads = pool.size();

    std::printf("# attention_bench: %d thread(s), kernel %s, best of %d\n", threads,
                std::string(cpu_kernel_name(active_cpu_kernel())).c_str(), o.reps);
    if (o.decode) {
      run_decode(o, o.decode_seqs, pool);
      return 0;
    }
    Peak peak;
    double peak_core = 0;
    if (o.peak) {
      peak = measure_peak(threads);
      std::printf(
          "\n## f32 FMA peak (measured, CPU time per thread)\n\n| isa | 1 core GFLOP/s | %d cores GFLOP/s |\n"
          "|---|---:|---:|\n",
          threads);
      if (peak.avx512_1 > 0) std::printf("| avx512 | %.1f | %.1f |\n", peak.avx512_1, peak.avx512_all);
      std::printf("| avx2 | %.1f | %.1f |\n", peak.avx2_1, peak.avx2_all);
      peak_core = active_cpu_kernel() == CpuKernel::Avx512 ? peak.avx512_1 : peak.avx2_1;
    }
    auto pct = [&](double gf) { return peak_core > 0 ? 100.0 * gf / peak_core : 0.0; };

    for (const std::string& dt : o.dtypes) {
      const DType dtype = dt == "bf16" ? DType::BF16 : DType::F32;
      for (int d : o.dims) {
        for (int s : o.seqs) {
          Tensor q = random_tensor(dtype, s, o.heads, d, 1), k = random_tensor(dtype, s, o.kv_heads, d, 2),
                 v = random_tensor(dtype, s, o.kv_heads, d, 3);
          Tensor out(DType::F32, {s, o.heads, d});
          AttentionArgs args;
          args.q = q;
          args.k = k;
          args.v = v;
          args.out = out;
          const LoweringContext ctx = LoweringContext::prefill(s, 64);

          const double causal_flops = 4.0 * d * 0.5 * static_cast<double>(s) * (s + 1) * o.heads;
          const Timing dense = best_of(o.reps, [&] { dense_attention_cpu(args, pool); });
          const double dense_gf = causal_flops / dense.cpu * 1e-9;

          std::printf("\n## %s, S = %d, d = %d, heads %d/%d\n\n", dt.c_str(), s, d, o.heads, o.kv_heads);
          std::printf(
              "| kernel | density | est+lower ms | exec ms | exec cpu-ms | GFLOP/s per core | %% of core "
              "peak | "
              "speedup exec | speedup exec (cpu) | speedup with est+lower |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
          std::printf("| dense | 1.000 | - | %.1f | %.1f | %.1f | %.0f%% | 1.00 | 1.00 | 1.00 |\n",
                      dense.wall * 1e3, dense.cpu * 1e3, dense_gf, pct(dense_gf));
          std::fflush(stdout);

          for (const std::string& name : o.patterns) {
            Pattern p;
            if (name == "ashape") {
              p = AShapePattern{128, 1024};
            } else if (name == "triangle") {
              p = TrianglePattern{8, 512, 128};
            } else if (name == "moa_window") {
              p = ElasticWindowPattern{512, 0.05, 64};
            } else if (name == "vertical_slash") {
              // v = 1000, capped at S/16 so that the columns alone stay well below the target at short S (at
              // S = 4096, 1000 columns are already ~25% density); the slash budget is searched for ~10%
              // density.
              const int32_t vert = std::min(1000, s / 16);
              const int32_t slash = budget_for_density(0.10, 1, s, [&](int32_t sl) {
                return density_of(VerticalSlashPattern{vert, sl, 64, 30, 100}, o.heads, args, ctx, pool);
              });
              p = VerticalSlashPattern{vert, slash, 64, 30, std::min(100, slash)};
            } else if (name == "block_sparse") {
              const int32_t top_k = budget_for_density(0.10, 1, s / 64 + 1, [&](int32_t kk) {
                return density_of(BlockSparsePattern{kk, 64}, o.heads, args, ctx, pool);
              });
              p = BlockSparsePattern{top_k, 64};
            } else {
              throw Error("unknown pattern '" + name + "'");
            }
            const std::vector<Pattern> patterns(static_cast<size_t>(o.heads), p);
            const Built b = build_index(patterns, args, ctx, pool, o.reps);
            const IndexStats st = index_stats(b.index);
            const Timing exec = best_of(o.reps, [&] { sparse_attention_cpu(args, b.index, pool); });
            const double gf = st.mask_flops(d) / exec.cpu * 1e-9;
            std::printf("| %s | %.3f | %.1f | %.1f | %.1f | %.1f | %.0f%% | %.2f | %.2f | %.2f |\n",
                        describe(p).c_str(), st.density(), b.time.wall * 1e3, exec.wall * 1e3, exec.cpu * 1e3,
                        gf, pct(gf), dense.wall / exec.wall, dense.cpu / exec.cpu,
                        dense.wall / (exec.wall + b.time.wall));
            std::fflush(stdout);
          }
        }
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
