// attention_gpu_bench — tessera's CUDA attention on Llama-3-8B shapes: dense and sparse patterns, end to end.
//
// One sequence, 32 query heads, 8 KV heads, head_dim 128, bf16, index tile 128. For each sequence length and
// pattern it times (CUDA events, warm-up first, median of --reps) the three steps of a layer on one stream —
// estimate (VS/BS only), index build + plan, kernel — and their sum, and reports:
//   density        visible cells / causal cells
//   TFLOP/s mask   4 * d * visible cells / kernel time (useful work)
//   TFLOP/s tiles  4 * d * cells of the computed 128 x 64 tiles / kernel time (what the kernel executes)
//   vs dense       dense total time / this total time, from the same run
//   SM MHz, W      the GPU's mean SM clock (MHz) and mean board power (W) during the row's timed repetitions
//                  (the est/index/kernel/total loop; not the mma, backend or index-mode timings),
//                  sampled every ~5 ms by gpu_clock.h through NVML loaded at run time. Power-capped H100 /
//                  H200 run at clocks that differ from run to run (the same kernel: 14.5 ms at ~1.7 GHz in
//                  one run, 15.5 ms at ~1.6 GHz in another), so compare times at similar clocks. NVML's power
//                  on Hopper is a 1-second average, so rows shorter than that include the warm-up before
//                  them. Without NVML the bench prints "clock: unavailable (reason)" once and the columns
//                  show "—" (CSV: empty). --trace-reps prints every timed repetition's kernel time with
//                  the SM clock and board power read right after it (the power-cap study of docs/PERF.md);
//                  --idle-ms N leaves the GPU idle N ms before each row's warm-up.
// Output: a line per row as it finishes, then a markdown table and, with --csv, a CSV with the columns seq,
// pattern, density, estimate_ms, index_ms, kernel_ms, total_ms, tflops_mask, tflops_tiles, speedup_vs_dense,
// max_over_mean_item_cost, non_finite, kernel, mma_kernel_ms, rel_diff_vs_mma, path, dense_ours_ms,
// dense_cudnn_ms, sm_mhz, power_w (in that order: new columns go at the end, so that readers that go by
// position keep working).
// Patterns: dense; vs = vertical_slash(1000, 6096); bs = block_sparse(top 100, block 64); ashape(sink 128,
// window 4096); triangle(sink 8, window 512, last 128); vsaNN = vertical_slash with adaptive budgets (issue 16,
// pattern.h): gamma NN / 100, at most vs's 1000 columns and 6096 slashes (vsa90, vsa95; a line per row says
// how many each head kept); bsaNN = block_sparse with adaptive budgets, gamma NN / 100, at most bs's 100 blocks
// per query block. scripts/gpu/adaptive_check.sh runs dense, vs, bs, vsa90, vsa95, bsa90, bsa95 at 32K and 128K.
// Inputs (never zeros): --inputs rope (default) gives attention a structure like a real model's, so that the
// dynamic estimators pick a realistic (local-heavy) index: per kv head a fixed direction a, q_t = R(t)(0.6 a
// + 0.8 n) and k_t = R(t)(0.6 a + 0.8 n') with R(t) the RoPE rotation (base 500000) and fresh N(0, 1) noise
// n, so that scores decay with distance along diagonals, plus a sink: k_0 = R(0)(3 a). --inputs random draws
// every element from N(0, 1), for which VS and BS estimates spread over the whole causal triangle (near
// dense). --inputs local: the rope construction with most of each vector on the shared direction (alpha
// 0.95, noise 0.31): q_t . k_s then falls off steadily with log |t - s| (each RoPE frequency stops
// contributing once (t - s) theta_f passes ~1), so the VS estimator's best slashes are the offsets nearest
// the diagonal and its columns the sink and the most recent keys — the local/sink structure real models give
// (the default rope inputs scatter the 6096 slashes, which makes VS near dense at 32K). Measured on the H200,
// local still gave VS density 0.76 at 32K and 0.36 at 128K: a random shared direction puts most of its energy on
// short-wavelength RoPE pairs, whose cos((t - s) theta) keeps oscillating at every distance, so the "best"
// diagonals still scatter far from the diagonal.
// --inputs model (bench/gpu/model_inputs.h, which explains it in full): the shared direction's energy sits
// only on the RoPE pairs (Llama-3.1's frequencies) whose wavelength is 4K-262K tokens (runtime/cuda/
// local_attention_spectrum.h), so that the shared part of q_t . k_s is a function of t - s that falls
// steadily with distance (32 logits at distance 0, 0.74 of that at 6096, 0.44 at 16K), plus a sink (the first
// 4 keys: 38 logits at any distance, on pairs that hardly rotate), per-head sharpness (x 0.8-1.2) and noise
// (about 1.2 logits per cell): the VS estimator's best slashes are then (nearly) the 6096 offsets nearest the
// diagonal, its columns the sink and the most recent keys, as on real models. The CPU twin
// (tests/model_inputs_test.cpp: same values, CPU estimator and lowering, 128-row tiles, two heads) measured VS
// density 0.357 / 0.359 at 32K (the nearest 6096 diagonals give 0.342: ratio 1.04-1.05) and 0.0974 / 0.0982
// at 128K (nearest 0.0922: ratio 1.06-1.07); largest chosen offset 6409-6911 (plus 67 diagonals through the
// sink from the last rows); BS (top 100) 0.353 at 32K, 0.095 at 128K.
// Kernels (sparse_prefill.h): the kernel column is what PrefillKernel::kAuto ran (wgmma on Hopper when its
// self-check passed, else mma.sync); with --kernel both (default) the mma.sync kernel is timed as well
// ("mma ms") and both outputs are compared ("rel diff" = ||auto - mma|| / ||mma||).
// Paths (layer_attention_cuda.h): each row runs what the engine runs (CudaLayerAttention::run): dense rows on
// the dense backend (--dense-backend; auto: cuDNN's fused SDPA where available and q_len >= 2048), sparse rows
// sparse or, with the dense fallback (--fallback on, default), dense when their index costs more; the path
// column says which. Dense rows also time both backends alone ("dense backends" lines: ours, cuDNN, their
// ratio, cuDNN's first call with its plan build), and a row that fell back times its sparse path alone
// ("fallback" lines).
//
//   attention_gpu_bench [--seq 8192,32768,131072] [--patterns dense,vs,bs,ashape,triangle] [--reps 5]
//                       [--warmup 1] [--inputs rope|random|local|model] [--kernel both|auto|mma|wgmma]
//                       [--dense-backend auto|ours|cudnn] [--fallback on|off] [--csv FILE]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_check.h"
#include "attention/cuda/cudnn_sdpa.h"
#include "cuda/device_buffer.h"
#include "attention/cuda/layer_attention_cuda.h"
#include "attention/cuda/sparse_prefill.h"
#include "attention/cuda/work_plan.h"
#include "attention/index/sparse_index.h"
#include "gpu_clock.h"
#include "model_inputs.h"

namespace {

using namespace tessera;
using namespace tessera::attn;
namespace gpu = tessera::attn::gpu;

constexpr int kHq = 32, kHkv = 8, kD = 128, kTile = 128;

// normal_at: N(0, 1) from a hash of (seed, index), shared with the model inputs' CPU twin (model_inputs.h).
using tessera::bench::normal_at;

__global__ void fill_normal(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __float2bfloat16(normal_at(seed, static_cast<uint64_t>(i)));
  }
}

// x [seq, heads, d]: per (token, head) the pair (2f, 2f + 1) of R(t)(alpha a + beta n), a depending on the kv
// head (head / group) only; token 0 gets sink * a instead when sink > 0.
__global__ void fill_rope(__nv_bfloat16* x, int seq, int heads, int d, int group, uint64_t seed, float alpha,
                          float beta, float sink) {
  const int64_t pairs = int64_t{seq} * heads * (d / 2);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int f = static_cast<int>(i % (d / 2));
    const int h = static_cast<int>((i / (d / 2)) % heads);
    const int64_t t = i / (int64_t{d / 2} * heads);
    const uint64_t base = static_cast<uint64_t>((h / group) * d + 2 * f);
    const float a0 = normal_at(12345, base), a1 = normal_at(12345, base + 1);
    float v0, v1;
    if (t == 0 && sink > 0) {
      v0 = sink * a0;
      v1 = sink * a1;
    } else {
      v0 = alpha * a0 + beta * normal_at(seed, 2 * static_cast<uint64_t>(i));
      v1 = alpha * a1 + beta * normal_at(seed, 2 * static_cast<uint64_t>(i) + 1);
    }
    const double theta = static_cast<double>(t) * pow(500000.0, -2.0 * f / d);
    const float c = static_cast<float>(cos(theta)), s = static_cast<float>(sin(theta));
    x[2 * i] = __float2bfloat16(v0 * c - v1 * s);
    x[2 * i + 1] = __float2bfloat16(v0 * s + v1 * c);
  }
}

// --inputs model (model_inputs.h): x [seq, heads, d], every RoPE pair of every (token, head) from
// model_input_pair, the same function the CPU check (tests/model_inputs_test.cpp) calls.
__global__ void fill_model(__nv_bfloat16* x, int seq, int heads, int group, bool key, tessera::bench::ModelInputs m,
                           uint64_t seed) {
  const int half = m.half;
  const int64_t pairs = int64_t{seq} * heads * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int f = static_cast<int>(i % half);
    const int h = static_cast<int>((i / half) % heads);
    const int64_t t = i / (int64_t{half} * heads);
    float v[2];
    tessera::bench::model_input_pair(m, key, t, heads, h, h / group, f, seed, v);
    __nv_bfloat16* row = x + (t * heads + h) * (2 * half);
    row[f] = __float2bfloat16(v[0]);
    row[f + half] = __float2bfloat16(v[1]);
  }
}

__global__ void count_non_finite(const __nv_bfloat16* x, int64_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (!isfinite(__bfloat162float(x[i]))) ++local;
  }
  if (local) atomicAdd(count, local);
}

// sums[0] += sum (a - b)^2, sums[1] += sum b^2 over finite pairs.
__global__ void diff_norms(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, double* sums) {
  double num = 0, den = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (isfinite(x) && isfinite(y)) {
      num += (x - y) * (x - y);
      den += y * y;
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    num += __shfl_xor_sync(0xffffffffu, num, o);
    den += __shfl_xor_sync(0xffffffffu, den, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], num);
    atomicAdd(&sums[1], den);
  }
}

struct Options {
  std::vector<int> seqs = {8192, 32768, 131072};
  std::vector<std::string> patterns = {"dense", "vs", "bs", "ashape", "triangle"};
  int reps = 5;
  int warmup = 1;
  std::string inputs = "rope";
  std::string kernel = "both";
  std::string dense_backend = "auto";
  bool fallback = true;
  std::string csv;
  bool trace_reps = false;  // --trace-reps: a line per timed repetition (kernel ms, SM MHz, W, host time)
  int idle_ms = 0;          // --idle-ms N: the GPU left idle N ms before each row's warm-up
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--seq") {
      o.seqs.clear();
      for (const std::string& s : split(value())) o.seqs.push_back(std::stoi(s));
    } else if (a == "--patterns") {
      o.patterns = split(value());
    } else if (a == "--reps") {
      o.reps = std::max(1, std::stoi(value()));
    } else if (a == "--warmup") {
      o.warmup = std::max(0, std::stoi(value()));
    } else if (a == "--inputs") {
      o.inputs = value();
      if (o.inputs != "rope" && o.inputs != "random" && o.inputs != "local" && o.inputs != "model")
        throw Error("--inputs must be rope, random, local or model");
    } else if (a == "--kernel") {
      o.kernel = value();
      if (o.kernel != "both" && o.kernel != "auto" && o.kernel != "mma" && o.kernel != "wgmma")
        throw Error("--kernel must be both, auto, mma or wgmma");
    } else if (a == "--dense-backend") {
      o.dense_backend = value();
      if (o.dense_backend != "auto" && o.dense_backend != "ours" && o.dense_backend != "cudnn")
        throw Error("--dense-backend must be auto, ours or cudnn");
    } else if (a == "--fallback") {
      const std::string v = value();
      if (v != "on" && v != "off") throw Error("--fallback must be on or off");
      o.fallback = v == "on";
    } else if (a == "--csv") {
      o.csv = value();
    } else if (a == "--trace-reps") {
      o.trace_reps = true;
    } else if (a == "--idle-ms") {
      o.idle_ms = std::max(0, std::stoi(value()));
    } else {
      throw Error("unknown argument " + a + " (see the header of attention_gpu_bench.cu)");
    }
  }
  return o;
}

Pattern make_pattern(const std::string& name) {
  if (name == "dense") return DensePattern{};
  if (name == "vs") return VerticalSlashPattern{1000, 6096, 64, 30, 100};
  if (name == "bs") return BlockSparsePattern{100, 64};
  if (name == "ashape") return AShapePattern{128, 4096};
  if (name == "triangle") return TrianglePattern{8, 512, 128};
  if (name.rfind("vsa", 0) == 0 && name.size() > 3) {  // vsaNN: adaptive budgets, gamma NN / 100, maxima of vs
    VerticalSlashPattern p{1000, 6096, 64, 30, 100};
    try {
      p.gamma = std::stod(name.substr(3)) / 100.0;
    } catch (const std::exception&) {
      p.gamma = -1;
    }
    check(p.gamma > 0 && p.gamma <= 1, "pattern " + name + ": vsaNN takes gamma NN / 100 in (0, 1], e.g. vsa90");
    return p;
  }
  if (name.rfind("bsa", 0) == 0 && name.size() > 3) {  // bsaNN: adaptive block-sparse, gamma NN / 100, max bs's 100
    BlockSparsePattern p{100, 64};
    try {
      p.gamma = std::stod(name.substr(3)) / 100.0;
    } catch (const std::exception&) {
      p.gamma = -1;
    }
    check(p.gamma > 0 && p.gamma <= 1, "pattern " + name + ": bsaNN takes gamma NN / 100 in (0, 1], e.g. bsa90");
    return p;
  }
  throw Error("unknown pattern " + name + " (dense, vs, bs, ashape, triangle, vsaNN, bsaNN)");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Row {
  int seq = 0;
  std::string pattern;
  double density = 0, est_ms = 0, index_ms = 0, kernel_ms = 0, total_ms = 0;
  double mask_tflops = 0, tile_tflops = 0, speedup = 0, max_over_mean_cost = 0;
  std::string kernel;    // the prefill kernel kAuto resolves to
  std::string path;      // what ran in kernel_ms (CudaLayerAttention::last_path)
  double ours_dense_ms = 0, cudnn_ms = 0;  // dense rows: each backend alone (0: not run)
  double mma_ms = 0;     // the mma.sync kernel alone (--kernel both), 0 if not timed
  double rel_diff = -1;  // ||out - out_mma|| / ||out_mma||, -1 if not compared
  unsigned long long non_finite = 0;
  // The GPU's mean SM clock (MHz) and board power (W) over the timed repetitions (gpu_clock.h); -1: not
  // measured.
  double sm_mhz = -1, power_w = -1;
};

// A measured value with printf format `fmt`, or "—" when not measured (negative).
std::string measured(double v, const char* fmt) {
  if (v < 0) return "—";
  char buf[32];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    cudaDeviceProp prop{};
    TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize / 1048576.0);
    std::printf(
        "shape: 1 sequence, %d query heads, %d kv heads, head_dim %d, bf16, tile %d; reps %d (median), "
        "warm-up %d; inputs %s; dense backend %s, dense fallback %s\n",
        kHq, kHkv, kD, kTile, opt.reps, opt.warmup, opt.inputs.c_str(), opt.dense_backend.c_str(),
        opt.fallback ? "on" : "off");
    {
      std::string why;
      const bool ok = gpu::cudnn_available(&why);
      std::printf("cuDNN: %s (%s)\n", ok ? "available" : "unavailable", why.c_str());
    }
    tessera::bench::GpuClockSampler gpu_clock(0);  // device 0, as everything here
    std::printf("clock: %s\n", gpu_clock.description().c_str());
    cudaStream_t stream;
    TESSERA_CUDA_CHECK(cudaStreamCreate(&stream));
    if (gpu::wgmma_prefill_applies(DType::BF16, kD, kTile)) {
      const gpu::HopperSelfCheck& sc = gpu::hopper_prefill_self_check(DType::BF16, stream);
      std::printf("wgmma self-check: %s\n%s",
                  sc.passed ? "passed" : "FAILED (kAuto runs the mma.sync kernel)", sc.report.c_str());
    } else {
      std::printf("wgmma kernel: does not apply on this device (kAuto runs the mma.sync kernel)\n");
    }
    cudaEvent_t ev[4];
    for (cudaEvent_t& e : ev) TESSERA_CUDA_CHECK(cudaEventCreate(&e));
    gpu::DeviceBuffer<unsigned long long> bad(1);
    gpu::DeviceBuffer<double> sums(2);

    std::vector<Row> rows;
    for (int seq : opt.seqs) {
      const int64_t nq = int64_t{seq} * kHq * kD, nkv = int64_t{seq} * kHkv * kD;
      gpu::DeviceBuffer<__nv_bfloat16> q(static_cast<size_t>(nq)), k(static_cast<size_t>(nkv)),
          v(static_cast<size_t>(nkv)), out(static_cast<size_t>(nq)), out_mma(static_cast<size_t>(nq));
      if (opt.inputs == "model") {
        const tessera::bench::ModelInputs m = tessera::bench::make_model_inputs(kD);
        fill_model<<<1024, 256, 0, stream>>>(q.data(), seq, kHq, kHq / kHkv, false, m, 1);
        fill_model<<<1024, 256, 0, stream>>>(k.data(), seq, kHkv, 1, true, m, 2);
      } else if (opt.inputs == "local") {
        fill_rope<<<1024, 256, 0, stream>>>(q.data(), seq, kHq, kD, kHq / kHkv, 1, 0.95f, 0.31f, 0.0f);
        fill_rope<<<1024, 256, 0, stream>>>(k.data(), seq, kHkv, kD, 1, 2, 0.95f, 0.31f, 3.0f);
      } else if (opt.inputs == "rope") {
        fill_rope<<<1024, 256, 0, stream>>>(q.data(), seq, kHq, kD, kHq / kHkv, 1, 0.6f, 0.8f, 0.0f);
        fill_rope<<<1024, 256, 0, stream>>>(k.data(), seq, kHkv, kD, 1, 2, 0.6f, 0.8f, 3.0f);
      } else {
        fill_normal<<<1024, 256, 0, stream>>>(q.data(), nq, 1);
        fill_normal<<<1024, 256, 0, stream>>>(k.data(), nkv, 2);
      }
      fill_normal<<<1024, 256, 0, stream>>>(v.data(), nkv, 3);
      gpu::check_launch("fill inputs");
      AttentionArgs args;
      args.q = TensorView(q.data(), DType::BF16, {seq, kHq, kD});
      args.k = TensorView(k.data(), DType::BF16, {seq, kHkv, kD});
      args.v = TensorView(v.data(), DType::BF16, {seq, kHkv, kD});
      args.out = TensorView(out.data(), DType::BF16, {seq, kHq, kD});
      const LoweringContext ctx = LoweringContext::prefill(seq, kTile);

      double dense_total = 0;
      for (const std::string& name : opt.patterns) {
        Row r;
        r.seq = seq;
        r.pattern = name;
        gpu::CudaLayerAttention layer(std::vector<Pattern>(kHq, make_pattern(name)), ctx, kHkv, kD);
        layer.set_dense_backend(opt.dense_backend == "ours"    ? gpu::DenseBackend::kOurs
                                : opt.dense_backend == "cudnn" ? gpu::DenseBackend::kCudnn
                                                               : gpu::DenseBackend::kAuto);
        layer.set_dense_fallback(opt.fallback);
        const gpu::PrefillKernel main_kernel = opt.kernel == "mma"     ? gpu::PrefillKernel::kMma
                                               : opt.kernel == "wgmma" ? gpu::PrefillKernel::kWgmma
                                                                       : gpu::PrefillKernel::kAuto;
        r.kernel = gpu::prefill_kernel_name(
            gpu::resolve_prefill_kernel(main_kernel, DType::BF16, kD, kTile,
                                        layer.options().split && !layer.split_units().empty(), stream));
        TESSERA_CUDA_CHECK(cudaMemsetAsync(out.data(), 0xff, out.bytes(), stream));  // NaN poison
        // As CudaLayerAttention::run: an all-dense layer on cuDNN needs no index (built once here for the
        // density and the explicit-kernel timings below).
        layer.estimate(args, stream);
        layer.build_index(stream);
        // The dense shortcut (dense_shortcut.h): no estimation and no index either, as in run().
        const bool shortcut = main_kernel == gpu::PrefillKernel::kAuto && layer.dense_before_estimation(args);
        const bool needs_index =
            !shortcut && !(layer.all_dense() && main_kernel == gpu::PrefillKernel::kAuto &&
                           layer.resolve_dense_backend(args) == gpu::DenseBackend::kCudnn);
        TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
        if (opt.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(opt.idle_ms));
        for (int i = 0; i < opt.warmup; ++i) {
          if (!shortcut) layer.estimate(args, stream);
          if (needs_index) layer.build_index(stream);
          layer.attend(args, stream, main_kernel);
        }
        TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<double> est, idx, ker, tot;
        gpu_clock.start();
        for (int rep = 0; rep < opt.reps; ++rep) {
          TESSERA_CUDA_CHECK(cudaEventRecord(ev[0], stream));
          if (!shortcut) layer.estimate(args, stream);
          TESSERA_CUDA_CHECK(cudaEventRecord(ev[1], stream));
          if (needs_index) layer.build_index(stream);
          TESSERA_CUDA_CHECK(cudaEventRecord(ev[2], stream));
          layer.attend(args, stream, main_kernel);
          TESSERA_CUDA_CHECK(cudaEventRecord(ev[3], stream));
          TESSERA_CUDA_CHECK(cudaEventSynchronize(ev[3]));
          float t[3];
          for (int i = 0; i < 3; ++i) TESSERA_CUDA_CHECK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
          est.push_back(t[0]);
          idx.push_back(t[1]);
          ker.push_back(t[2]);
          if (opt.trace_reps) {  // the clock and power NVML reads now (after the kernel), host time in ms
            const tessera::bench::ClockNow now = gpu_clock.now();
            std::printf("rep %d %s %d: kernel %.4f ms, SM %d MHz, %.1f W, %d C, reasons 0x%llx, t %.1f ms\n", rep,
                        r.pattern.c_str(), r.seq, t[2], now.sm_mhz, now.power_w, now.temperature_c,
                        static_cast<unsigned long long>(now.reasons),
                        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
                            .count());
          }
          tot.push_back(double{t[0]} + t[1] + t[2]);
        }
        {
          const tessera::bench::ClockStats cs = gpu_clock.stop();
          r.sm_mhz = cs.mean_sm_mhz;
          r.power_w = cs.mean_power_w;
        }
        TESSERA_CUDA_CHECK(cudaMemsetAsync(bad.data(), 0, sizeof(unsigned long long), stream));
        count_non_finite<<<1024, 256, 0, stream>>>(out.data(), nq, bad.data());
        gpu::check_launch("count_non_finite");
        r.non_finite = bad.download()[0];
        r.path = main_kernel == gpu::PrefillKernel::kAuto ? layer.last_path() : "sparse " + r.kernel;
        if (!needs_index) {  // the explicit-kernel runs below need the estimates and the index
          layer.estimate(args, stream);
          layer.build_index(stream);
        }

        // Times `attend` alone (median of reps, after one untimed call) with the layer's current settings.
        auto time_attend = [&](const AttentionArgs& a) {
          layer.attend(a, stream);
          std::vector<double> ts;
          for (int rep = 0; rep < opt.reps; ++rep) {
            TESSERA_CUDA_CHECK(cudaEventRecord(ev[0], stream));
            layer.attend(a, stream);
            TESSERA_CUDA_CHECK(cudaEventRecord(ev[1], stream));
            TESSERA_CUDA_CHECK(cudaEventSynchronize(ev[1]));
            float t = 0;
            TESSERA_CUDA_CHECK(cudaEventElapsedTime(&t, ev[0], ev[1]));
            ts.push_back(t);
          }
          return median(ts);
        };
        // Dense rows: both dense backends alone, on the same inputs (outputs compared).
        if (name == "dense") {
          AttentionArgs margs = args;
          margs.out = TensorView(out_mma.data(), DType::BF16, {seq, kHq, kD});
          layer.set_dense_backend(gpu::DenseBackend::kOurs);
          r.ours_dense_ms = time_attend(margs);
          const std::string ours_path = layer.last_path();
          std::string why;
          if (gpu::cudnn_dense_plan(args, &why) || gpu::cudnn_dense_supports(args)) {
            layer.set_dense_backend(gpu::DenseBackend::kCudnn);
            AttentionArgs cargs = args;
            cargs.out = TensorView(out.data(), DType::BF16, {seq, kHq, kD});
            try {
              const auto t0 = std::chrono::steady_clock::now();
              layer.attend(cargs, stream);
              TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
              const double first_ms =
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
              r.cudnn_ms = time_attend(cargs);
              TESSERA_CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, 2 * sizeof(double), stream));
              diff_norms<<<1024, 256, 0, stream>>>(out.data(), out_mma.data(), nq, sums.data());
              gpu::check_launch("diff_norms");
              const std::vector<double> sd = sums.download();
              std::printf(
                  "  dense backends seq %6d: ours %9.3f ms (%s), cuDNN %9.3f ms (first call %.1f ms), cuDNN/ours "
                  "%.3f, rel diff %.2e; kAuto runs %s\n",
                  seq, r.ours_dense_ms, ours_path.c_str(), r.cudnn_ms, first_ms, r.cudnn_ms / r.ours_dense_ms,
                  sd[1] > 0 ? std::sqrt(sd[0] / sd[1]) : -1.0, r.path.c_str());
              std::string plan_why;
              (void)gpu::cudnn_dense_plan(cargs, &plan_why);
              std::printf("  cuDNN plan seq %6d: %s\n", seq, plan_why.c_str());
            } catch (const std::exception& e) {
              std::printf("  dense backends seq %6d: ours %9.3f ms (%s), cuDNN failed: %s\n", seq,
                          r.ours_dense_ms, ours_path.c_str(), e.what());
            }
          } else {
            std::printf("  dense backends seq %6d: ours %9.3f ms (%s), cuDNN not run: %s\n", seq, r.ours_dense_ms,
                        ours_path.c_str(), why.c_str());
          }
          std::fflush(stdout);
          layer.set_dense_backend(gpu::DenseBackend::kAuto);
        }
        // A row that fell back to dense: its sparse path alone, and the costs the rule compared.
        if (r.path.rfind("dense fallback", 0) == 0) {
          layer.set_dense_fallback(false);
          const double sparse_ms = time_attend(args);
          layer.set_dense_fallback(true);
          std::printf("  fallback seq %6d %-9s sparse cost %lld, dense cost %lld: ran %s (%.3f ms) instead of %s "
                      "(%.3f ms)\n",
                      seq, name.c_str(), static_cast<long long>(layer.sparse_cost(stream)),
                      static_cast<long long>(layer.dense_cost()), r.path.c_str(), median(ker),
                      layer.last_path().c_str(), sparse_ms);
          std::fflush(stdout);
        }

        // The mma.sync kernel on the same index: time and output, compared with the main kernel's.
        if (opt.kernel == "both" && r.kernel != gpu::prefill_kernel_name(gpu::PrefillKernel::kMma)) {
          TESSERA_CUDA_CHECK(cudaMemsetAsync(out_mma.data(), 0xff, out_mma.bytes(), stream));
          AttentionArgs margs = args;
          margs.out = TensorView(out_mma.data(), DType::BF16, {seq, kHq, kD});
          for (int i = 0; i < opt.warmup; ++i) layer.attend(margs, stream, gpu::PrefillKernel::kMma);
          std::vector<double> mk;
          for (int rep = 0; rep < opt.reps; ++rep) {
            TESSERA_CUDA_CHECK(cudaEventRecord(ev[0], stream));
            layer.attend(margs, stream, gpu::PrefillKernel::kMma);
            TESSERA_CUDA_CHECK(cudaEventRecord(ev[1], stream));
            TESSERA_CUDA_CHECK(cudaEventSynchronize(ev[1]));
            float t = 0;
            TESSERA_CUDA_CHECK(cudaEventElapsedTime(&t, ev[0], ev[1]));
            mk.push_back(t);
          }
          r.mma_ms = median(mk);
          TESSERA_CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, 2 * sizeof(double), stream));
          diff_norms<<<1024, 256, 0, stream>>>(out.data(), out_mma.data(), nq, sums.data());
          gpu::check_launch("diff_norms");
          const std::vector<double> sd = sums.download();
          r.rel_diff = sd[1] > 0 ? std::sqrt(sd[0] / sd[1]) : -1;
        }

        const SparseIndex index = layer.download_index();
        const bool adaptive_bs = name.rfind("bsa", 0) == 0;
        const bool adaptive = name.rfind("vsa", 0) == 0 || adaptive_bs;
        if (adaptive_bs && !shortcut) {  // what the coverage target kept: key blocks per query block
          int64_t kept = 0, room = 0, lists = 0;
          double hmin = 1e300, hmax = 0;
          for (const HeadEstimate& e : layer.download_estimates()) {
            const auto& b = std::get<BlockSparseEstimate>(e);
            const int64_t n = static_cast<int64_t>(b.offsets.size()) - 1;
            int64_t r = 0;
            for (int64_t q = 0; q < n; ++q) r += std::min<int64_t>(100, b.first_q_block + q + 1);
            kept += b.offsets.back();
            room += r;
            lists += n;
            const double mean = n > 0 ? double(b.offsets.back()) / double(n) : 0.0;
            hmin = std::min(hmin, mean);
            hmax = std::max(hmax, mean);
          }
          std::printf("  adaptive seq %6d %-9s kept key blocks per query block: mean %.1f (heads %.1f..%.1f) of "
                      "<= 100 (%.1f%% of the fixed layout's room)\n",
                      seq, name.c_str(), double(kept) / double(std::max<int64_t>(lists, 1)), hmin, hmax,
                      100.0 * double(kept) / double(std::max<int64_t>(room, 1)));
        } else if (adaptive && !shortcut) {  // what the coverage target kept, per head
          int64_t cols = 0, offs = 0, cmin = INT64_MAX, cmax = 0, omin = INT64_MAX, omax = 0;
          for (const HeadEstimate& e : layer.download_estimates()) {
            const auto& v = std::get<VerticalSlashEstimate>(e);
            const int64_t c = static_cast<int64_t>(v.columns.size()), o = static_cast<int64_t>(v.offsets.size());
            cols += c;
            offs += o;
            cmin = std::min(cmin, c);
            cmax = std::max(cmax, c);
            omin = std::min(omin, o);
            omax = std::max(omax, o);
          }
          std::printf("  adaptive seq %6d %-9s kept per head: columns mean %.0f (%lld..%lld of <= 1000), slashes mean "
                      "%.0f (%lld..%lld of <= 6096)\n",
                      seq, name.c_str(), double(cols) / kHq, (long long)cmin, (long long)cmax, double(offs) / kHq,
                      (long long)omin, (long long)omax);
        }
        // Index build modes (lower_cuda.h IndexBuildMode; `idx` timed the default, per kind): a warp per tile
        // and a thread per tile for every head, timed the same way, and the same index?
        if (name == "vs" || name == "bs" || adaptive) {
          double mode_ms[2] = {0, 0};
          bool same[2] = {true, true};
          const gpu::IndexBuildMode modes[2] = {gpu::IndexBuildMode::kWarp, gpu::IndexBuildMode::kThread};
          for (int m = 0; m < 2; ++m) {
            layer.set_index_build_mode(modes[m]);
            layer.build_index(stream);
            std::vector<double> wi;
            for (int rep = 0; rep < opt.reps; ++rep) {
              TESSERA_CUDA_CHECK(cudaEventRecord(ev[0], stream));
              layer.build_index(stream);
              TESSERA_CUDA_CHECK(cudaEventRecord(ev[1], stream));
              TESSERA_CUDA_CHECK(cudaEventSynchronize(ev[1]));
              float t = 0;
              TESSERA_CUDA_CHECK(cudaEventElapsedTime(&t, ev[0], ev[1]));
              wi.push_back(t);
            }
            const SparseIndex other = layer.download_index();
            mode_ms[m] = median(wi);
            same[m] = other.range_offsets == index.range_offsets && other.ranges == index.ranges &&
                      other.column_offsets == index.column_offsets && other.columns == index.columns;
          }
          layer.set_index_build_mode(gpu::IndexBuildMode::kPerKind);
          std::printf("  index seq %6d %-9s per kind (default) %8.3f ms, warp per tile %8.3f ms, thread per tile "
                      "%8.3f ms, %s\n",
                      seq, name.c_str(), median(idx), mode_ms[0], mode_ms[1],
                      same[0] && same[1] ? "same index" : "DIFFERENT INDEX");
          std::fflush(stdout);
        }
        const IndexStats st = index_stats(index);
        const std::vector<int32_t> costs = gpu::prefill_item_costs(index);
        const gpu::PlanSummary plan = gpu::summarize_plan(costs);
        // Computed tiles: every key tile of the plan is BN=64 keys by the 128 rows of the query tile.
        const double tile_cells =
            static_cast<double>(plan.total_cost - plan.items) * gpu::kPrefillKeyTile * kTile;
        r.density = st.density();
        r.est_ms = median(est);
        r.index_ms = median(idx);
        r.kernel_ms = median(ker);
        r.total_ms = median(tot);
        r.mask_tflops = st.mask_flops(kD) / (r.kernel_ms * 1e-3) / 1e12;
        r.tile_tflops = 4.0 * kD * tile_cells / (r.kernel_ms * 1e-3) / 1e12;
        r.max_over_mean_cost =
            plan.items ? plan.max_cost / (static_cast<double>(plan.total_cost) / plan.items) : 0;
        if (name == "dense") dense_total = r.total_ms;
        r.speedup = dense_total > 0 ? dense_total / r.total_ms : 0;
        rows.push_back(r);
        std::printf(
            "  seq %6d %-9s density %.4f  est %8.3f ms  index %8.3f ms  kernel %9.3f ms (%s)  total %9.3f ms "
            " "
            "%6.1f TFLOP/s mask  %6.1f tiles  mma %9.3f ms  rel diff %.2e  SM %s MHz  %s W%s\n",
            seq, name.c_str(), r.density, r.est_ms, r.index_ms, r.kernel_ms, r.path.c_str(), r.total_ms,
            r.mask_tflops, r.tile_tflops, r.mma_ms, r.rel_diff, measured(r.sm_mhz, "%.0f").c_str(),
            measured(r.power_w, "%.0f").c_str(), r.non_finite ? "  NON-FINITE OUTPUT" : "");
        std::fflush(stdout);
      }
    }

    std::printf(
        "\n| seq | pattern | density | estimate ms | index ms | path | kernel ms | total ms | TFLOP/s mask "
        "| "
        "TFLOP/s tiles | vs dense | mma.sync ms | rel diff vs mma | non-finite | dense: ours ms | dense: cuDNN ms "
        "| SM MHz | W |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      std::printf(
          "| %d | %s | %.4f | %.3f | %.3f | %s | %.3f | %.3f | %.1f | %.1f | %.2fx | %.3f | %.1e | %llu | %.3f | "
          "%.3f | %s | %s |\n",
          r.seq, r.pattern.c_str(), r.density, r.est_ms, r.index_ms, r.path.c_str(), r.kernel_ms, r.total_ms,
          r.mask_tflops, r.tile_tflops, r.speedup, r.mma_ms, r.rel_diff, r.non_finite, r.ours_dense_ms,
          r.cudnn_ms, measured(r.sm_mhz, "%.0f").c_str(), measured(r.power_w, "%.0f").c_str());
    }
    if (!opt.csv.empty()) {
      std::ofstream f(opt.csv);
      f << "seq,pattern,density,estimate_ms,index_ms,kernel_ms,total_ms,tflops_mask,tflops_tiles,speedup_vs_"
           "dense,"
           "max_over_mean_item_cost,non_finite,kernel,mma_kernel_ms,rel_diff_vs_mma,path,dense_ours_ms,dense_cudnn_"
           "ms,sm_mhz,power_w\n";
      for (const Row& r : rows) {
        f << r.seq << ',' << r.pattern << ',' << r.density << ',' << r.est_ms << ',' << r.index_ms << ','
          << r.kernel_ms << ',' << r.total_ms << ',' << r.mask_tflops << ',' << r.tile_tflops << ','
          << r.speedup << ',' << r.max_over_mean_cost << ',' << r.non_finite << ',' << r.kernel << ','
          << r.mma_ms << ',' << r.rel_diff << ',' << r.path << ',' << r.ours_dense_ms << ',' << r.cudnn_ms
          << ',' << (r.sm_mhz >= 0 ? measured(r.sm_mhz, "%.0f") : "") << ','
          << (r.power_w >= 0 ? measured(r.power_w, "%.1f") : "") << '\n';
      }
    }
    for (cudaEvent_t& e : ev) cudaEventDestroy(e);
    cudaStreamDestroy(stream);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_gpu_bench: %s\n", e.what());
    return 1;
  }
}
