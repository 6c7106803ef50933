// MInference's search forward on the GPU (contract: minference_cuda.h).
#include "plan/cuda/minference_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>

#include "attention/cuda/layer_attention_cuda.h"
#include "attention/index/sparse_index.h"
#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "plan/minference_plan.h"

namespace tessera::plan::cuda {

namespace {

using attn::gpu::check_launch;
using attn::gpu::DeviceBuffer;

constexpr int kThreads = 256;
constexpr int kErrorChunks = 64;  // token chunks per head of the error kernel (partial sums summed on the host)

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}

// grid (kErrorChunks, heads): partial[(h * kErrorChunks + c) * 2 + {0, 1}] = the sums of (out - ref)^2 and ref^2
// over the tokens of chunk c of head h (f64, a fixed order: deterministic).
__global__ void head_error_kernel(const __nv_bfloat16* out, const float* ref, int64_t tokens, int heads, int d,
                                  double* partial) {
  __shared__ double s_err[kThreads], s_ref[kThreads];
  const int h = blockIdx.y, c = blockIdx.x;
  const int64_t per = (tokens + kErrorChunks - 1) / kErrorChunks, t0 = c * per;
  const int64_t t1 = t0 + per < tokens ? t0 + per : tokens;
  double e = 0, r = 0;
  for (int64_t i = threadIdx.x; t0 < t1 && i < (t1 - t0) * d; i += kThreads) {
    const int64_t t = t0 + i / d, at = (t * heads + h) * d + i % d;
    const double o = __bfloat162float(out[at]), x = ref[at];
    e += (o - x) * (o - x);
    r += x * x;
  }
  s_err[threadIdx.x] = e;
  s_ref[threadIdx.x] = r;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      s_err[threadIdx.x] += s_err[threadIdx.x + s];
      s_ref[threadIdx.x] += s_ref[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[(int64_t(h) * kErrorChunks + c) * 2] = s_err[0];
    partial[(int64_t(h) * kErrorChunks + c) * 2 + 1] = s_ref[0];
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

}  // namespace

void minference_errors(const GradientModel& model, const std::vector<int32_t>& tokens,
                       const std::vector<attn::Pattern>& candidates, double weight, std::vector<double>& error,
                       std::vector<double>& density, MInferenceDeviceStats* stats, int64_t query_rows,
                       std::vector<double>* query_error) {
  const auto t_start = std::chrono::steady_clock::now();
  const runtime::ModelConfig& cfg = model.config();
  const int64_t S = static_cast<int64_t>(tokens.size()), NQ = cfg.num_q_heads, NKV = cfg.num_kv_heads,
                D = cfg.head_dim;
  const size_t C = candidates.size(), heads = static_cast<size_t>(cfg.num_layers) * static_cast<size_t>(NQ);
  check(D == 64 || D == 128 || D == 256, "minference (CUDA): head_dim " + std::to_string(D) +
                                             " is not run by the GPU sparse executors (64, 128, 256); use --device cpu");
  check(error.size() == heads * C && density.size() == heads * C,
        "minference (CUDA): error and density must hold layers x heads x candidates entries");
  check(S <= INT32_MAX, "minference (CUDA): sample too long");
  check(query_error == nullptr || (query_rows > 0 && query_error->size() == heads * C),
        "minference (CUDA): the query rows' error needs query_rows > 0 and layers x heads x candidates entries");
  const int64_t tail = query_error == nullptr ? S : S - std::min<int64_t>(query_rows, S);  // the query rows' first
  DeviceBuffer<__nv_bfloat16> qb(static_cast<size_t>(S * NQ * D)), kb(static_cast<size_t>(S * NKV * D)),
      vb(static_cast<size_t>(S * NKV * D)), ob(static_cast<size_t>(S * NQ * D));
  DeviceBuffer<double> partial(static_cast<size_t>(NQ) * kErrorChunks * 2), qpartial(partial.size());
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(static_cast<int32_t>(S), 64);
  attn::gpu::CudaAttentionOptions opts = attn::gpu::cuda_attention_defaults();
  opts.dense_fallback = false;  // the candidate's own mask, whatever it costs
  opts.dense_shortcut = false;
  std::vector<std::unique_ptr<attn::gpu::CudaLayerAttention>> layers;
  for (const attn::Pattern& p : candidates) {
    layers.push_back(std::make_unique<attn::gpu::CudaLayerAttention>(
        std::vector<attn::Pattern>(static_cast<size_t>(NQ), p), ctx, static_cast<int>(NKV), static_cast<int>(D), opts));
  }
  cudaEvent_t ev[2];
  TESSERA_CUDA_CHECK(cudaEventCreate(&ev[0]));
  TESSERA_CUDA_CHECK(cudaEventCreate(&ev[1]));
  double candidate_ms = 0;
  const float scale = cfg.attention_scale > 0 ? static_cast<float>(cfg.attention_scale)
                                              : 1.0f / std::sqrt(static_cast<float>(D));
  model.forward(tokens, [&](const GradientModel::AttentionView& v) {
    const auto stream = static_cast<cudaStream_t>(v.stream);
    to_bf16_kernel<<<grid_for(S * NQ * D), kThreads, 0, stream>>>(v.q, qb.data(), S * NQ * D);
    to_bf16_kernel<<<grid_for(S * NKV * D), kThreads, 0, stream>>>(v.k, kb.data(), S * NKV * D);
    to_bf16_kernel<<<grid_for(S * NKV * D), kThreads, 0, stream>>>(v.v, vb.data(), S * NKV * D);
    check_launch("minference: bf16 copies");
    attn::AttentionArgs args;
    args.q = TensorView(qb.data(), DType::BF16, {S, NQ, D});
    args.k = TensorView(kb.data(), DType::BF16, {S, NKV, D});
    args.v = TensorView(vb.data(), DType::BF16, {S, NKV, D});
    args.out = TensorView(ob.data(), DType::BF16, {S, NQ, D});
    args.scale = scale;
    args.window = cfg.layers[static_cast<size_t>(v.layer)].sliding_window;
    for (size_t c = 0; c < C; ++c) {
      TESSERA_CUDA_CHECK(cudaEventRecord(ev[0], stream));
      layers[c]->run(args, stream);
      head_error_kernel<<<dim3(kErrorChunks, static_cast<unsigned>(NQ)), kThreads, 0, stream>>>(
          ob.data(), v.o, S, static_cast<int>(NQ), static_cast<int>(D), partial.data());
      if (tail < S)  // the same sums over the query rows [tail, S) alone
        head_error_kernel<<<dim3(kErrorChunks, static_cast<unsigned>(NQ)), kThreads, 0, stream>>>(
            ob.data() + tail * NQ * D, v.o + tail * NQ * D, S - tail, static_cast<int>(NQ), static_cast<int>(D),
            qpartial.data());
      check_launch("minference: head errors");
      TESSERA_CUDA_CHECK(cudaEventRecord(ev[1], stream));
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
      float ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
      candidate_ms += ms;
      const std::vector<double> sums = partial.download();
      const std::vector<double> qsums = tail < S ? qpartial.download() : std::vector<double>();
      const std::vector<attn::IndexStats> st = attn::index_stats_per_head(layers[c]->download_index(), args.window);
      for (int64_t h = 0; h < NQ; ++h) {
        double num = 0, den = 0;
        for (int k = 0; k < kErrorChunks; ++k) {
          num += sums[static_cast<size_t>((h * kErrorChunks + k) * 2)];
          den += sums[static_cast<size_t>((h * kErrorChunks + k) * 2 + 1)];
        }
        const size_t hh = static_cast<size_t>(v.layer) * static_cast<size_t>(NQ) + static_cast<size_t>(h);
        error[hh * C + c] += weight * std::sqrt(num / std::max(den, 1e-300));
        if (!qsums.empty()) {
          double qnum = 0, qden = 0;
          for (int k = 0; k < kErrorChunks; ++k) {
            qnum += qsums[static_cast<size_t>((h * kErrorChunks + k) * 2)];
            qden += qsums[static_cast<size_t>((h * kErrorChunks + k) * 2 + 1)];
          }
          (*query_error)[hh * C + c] += weight * std::sqrt(qnum / std::max(qden, 1e-300));
        }
        density[hh * C + c] += weight * st[static_cast<size_t>(h)].density();
      }
    }
  });
  cudaEventDestroy(ev[0]);
  cudaEventDestroy(ev[1]);
  if (stats) {
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    stats->candidate_seconds = candidate_ms / 1000.0;
  }
}

namespace {

void run_registered(const runtime::Model& model, const std::vector<int32_t>& tokens,
                    const std::vector<attn::Pattern>& candidates, double weight, std::vector<double>& error,
                    std::vector<double>& density, int32_t query_rows, std::vector<double>* query_error) {
  with_device_weights(model, [&](const GradientModel& g) {
    minference_errors(g, tokens, candidates, weight, error, density, nullptr, query_rows, query_error);
  });
}

}  // namespace

void register_minference() { register_cuda_minference(&run_registered); }

}  // namespace tessera::plan::cuda
