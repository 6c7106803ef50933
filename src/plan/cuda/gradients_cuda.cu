// tessera/plan/cuda/gradients_cuda.cu — the reverse mode of plan/model_gradients.h on the GPU (gradients_cuda.h):
// the pass. Its forward is the engines' layer recipe (runtime/recipe.h), run with this pass as the recipe's ops, as
// the CPU pass (model_gradients.cpp) runs it: every call of the recipe keeps what the backward reads (the norms'
// 1/rms, the projections before QK-norm, q/k/v, the attention's log-sum-exp and output, the MLP's gate and up).
// The embedding and the RoPE tables are the GPU engine's kernels (runtime/cuda/kernels.h) over f32 weights; the
// products are cuBLAS in f32; the kernels the backward needs are gradient_kernels.cuh.
#include "plan/cuda/gradients_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/memory_budget.h"
#include "cuda/cuda_check.h"
#include "plan/cuda/gradient_kernels.cuh"
#include "plan/cuda/gradient_weights.h"
#include "plan/pass_dims.h"
#include "runtime/cuda/kernels.h"
#include "runtime/recipe.h"
#include "runtime/rope.h"

namespace tessera::plan::cuda {

using attn::gpu::check_launch;
using runtime::Activation;
using runtime::ModelConfig;

namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("attention gradients (CUDA): cuBLAS error ") + std::to_string(static_cast<int>(s)) +
                " in " + what);
}

class Pass : private PassDims {
 public:
  Pass(const GradientModel::Impl& m, std::span<const int32_t> tokens, const GradientOptions& opt,
       const DeviceRunOptions& run)
      : PassDims(m.cfg), m_(m), cfg_(m.cfg), opt_(opt), S_(static_cast<int64_t>(tokens.size())) {
    G_ = NQ_ / NKV_;
    nb_ = (S_ + opt.block - 1) / opt.block;
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cublas_check(cublasCreate(&blas_), "cublasCreate");
    cublas_check(cublasSetStream(blas_, stream_), "cublasSetStream");
    cublas_check(cublasSetMathMode(blas_, opt.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                 "cublasSetMathMode");
    // RoPE tables per distinct RopeConfig for positions [0, S), by the engine's kernel (the CPU's formula).
    runtime::LayerRopes ropes = runtime::layer_ropes(cfg_, m.rope_freq_factors);
    for (const std::vector<float>& inv : ropes.inv_freqs) {
      inv_freqs_.emplace_back(inv.size(), &tr_);
      transfer(inv_freqs_.back().get(), inv.data(), inv.size(), cudaMemcpyHostToDevice);
      cos_.emplace_back(sz(S_ * (D_ / 2)), &tr_);
      sin_.emplace_back(sz(S_ * (D_ / 2)), &tr_);
      runtime::gpu::rope_tables(inv_freqs_.back().get(), static_cast<int>(D_ / 2), 0, S_, cos_.back().get(),
                                sin_.back().get(), stream_);
    }
    layer_rope_ = std::move(ropes.layer);
    // The query chunk: the two [heads, R, S] buffers within 1 GiB.
    int64_t R = run.chunk_rows;
    const int64_t S64 = (S_ + 63) / 64 * 64;
    if (R <= 0) {
      R = (int64_t(1) << 30) / (NQ_ * std::max<int64_t>(S_, 1) * 8) / 64 * 64;
      R = std::clamp<int64_t>(R, 64, S64);
    }
    check(R % 64 == 0, "attention gradients (CUDA): chunk rows must be a multiple of 64, got " + std::to_string(R));
    R_ = std::min(R, S64);
    loss_rows_ = run.loss_rows;
    check(loss_rows_ >= 0, "attention gradients (CUDA): loss rows must be >= 0, got " + std::to_string(loss_rows_));
  }
  ~Pass() {
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  int64_t chunk_rows() const { return R_; }
  const Tracker& tracker() const { return tr_; }
  size_t peak_used() const { return peak_used_; }

  // The forward alone, observe() after each layer's attention (GradientModel::forward).
  void forward(std::span<const int32_t> tokens, const std::function<void(const GradientModel::AttentionView&)>& observe) {
    begin(tokens);
    observe_ = &observe;
    runtime::run_layers(cfg_, *this);
    observe_ = nullptr;
    sample_memory();
    sync();
  }

  GradientResult run(std::span<const int32_t> tokens, std::span<const Target> targets) {
    GradientResult result;
    result.seq_len = static_cast<int32_t>(S_);
    result.block = opt_.block;
    result.num_blocks = static_cast<int32_t>(nb_);
    result.num_q_heads = static_cast<int32_t>(NQ_);
    const int64_t L = cfg_.num_layers;
    // Forward through the recipe, keeping each layer's input.
    begin(tokens);
    if (!opt_.loss_only) inputs_.alloc(sz(L * S_ * H_), &tr_);
    embed();
    for (int64_t l = 0; l < L; ++l) {
      if (!opt_.loss_only) copy(inputs_.get() + l * S_ * H_, x_.get(), sz(S_ * H_));
      runtime::run_layer(cfg_, *this, static_cast<int32_t>(l));
    }
    sample_memory();

    // The loss over the target rows on the device, in chunks of rows whose logits stay within 1 GiB: the rows gathered
    // from x, the final norm, their logits, the cross-entropy and (unless loss_only) dL/dlogits in place
    // (cross_entropy_kernel, the twin of plan/cross_entropy.h), then back through the output projection and the final
    // norm into dx at the rows' positions. Only the per-row losses come to the host (summed there in order, as the CPU).
    const int64_t NT = static_cast<int64_t>(targets.size());
    const int64_t V = cfg_.vocab_size;
    const DevWeight& wout = m_.output();
    std::vector<int32_t> pos_h(sz(NT)), tok_h(sz(NT));
    for (int64_t t = 0; t < NT; ++t) {
      pos_h[sz(t)] = targets[sz(t)].position;
      tok_h[sz(t)] = targets[sz(t)].token;
    }
    Buf<int32_t> pos(sz(NT), &tr_), tok(sz(NT), &tr_);
    Buf<double> row_loss(sz(NT), &tr_);
    transfer(pos.get(), pos_h.data(), pos_h.size(), cudaMemcpyHostToDevice);
    transfer(tok.get(), tok_h.data(), tok_h.size(), cudaMemcpyHostToDevice);
    const int64_t C = loss_rows_ > 0 ? std::min(loss_rows_, NT)
                                     : std::clamp<int64_t>((int64_t(1) << 30) / (V * int64_t(sizeof(float))), 1, NT);
    Buf<float> xt(sz(C * H_), &tr_), rf(sz(C), &tr_), hf(sz(C * H_), &tr_), z(sz(C * V), &tr_);
    Buf<float> dhf, dxt, dx;  // dx: the gradient of the last layer's output (x_ is the recipe's again below)
    if (!opt_.loss_only) {
      alloc(C * H_, {&dhf, &dxt});
      alloc(S_ * H_, {&dx});
      TESSERA_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0, sz(S_ * H_) * sizeof(float), stream_));
    }
    for (int64_t t0 = 0; t0 < NT; t0 += C) {
      const int64_t n = std::min(C, NT - t0);
      gather_rows_kernel<<<grid_for(n * H_), kThreads, 0, stream_>>>(x_.get(), pos.get() + t0, xt.get(), n, H_);
      check_launch("gather target rows");
      rms_forward_kernel<<<n, kThreads, 0, stream_>>>(xt.get(), hf.get(), rf.get(), H_, m_.final_norm.ptr(),
                                                      static_cast<float>(cfg_.rms_norm_eps));
      check_launch("final norm");
      gemm(true, false, V, n, H_, 1.0f, wout.ptr(), H_, hf.get(), H_, 0.0f, z.get(), V);
      cross_entropy_kernel<<<n, kLossThreads, 0, stream_>>>(z.get(), V, tok.get() + t0, cfg_.final_logit_softcap,
                                                            static_cast<double>(NT), !opt_.loss_only,
                                                            row_loss.get() + t0);
      check_launch("cross-entropy");
      if (opt_.loss_only) continue;
      gemm(false, false, H_, n, V, 1.0f, wout.ptr(), H_, z.get(), V, 0.0f, dhf.get(), H_);
      rms_backward_kernel<<<n, kThreads, 0, stream_>>>(xt.get(), rf.get(), H_, m_.final_norm.ptr(), dhf.get(),
                                                       dxt.get(), false);
      check_launch("final norm backward");
      scatter_add_rows_kernel<<<grid_for(n * H_), kThreads, 0, stream_>>>(dx.get(), pos.get() + t0, dxt.get(), n, H_);
      check_launch("scatter target rows");
    }
    std::vector<double> losses(sz(NT));
    transfer(losses.data(), row_loss.get(), losses.size(), cudaMemcpyDeviceToHost);
    double loss = 0;
    for (double l : losses) loss += l;
    result.loss = NT > 0 ? loss / static_cast<double>(NT) : 0.0;
    if (opt_.loss_only) {
      sync();
      return result;
    }

    alloc_backward();
    result.layers.resize(sz(L));
    for (int64_t l = L - 1; l >= 0; --l) {
      const float* xin = inputs_.get() + l * S_ * H_;
      layer_forward(static_cast<int32_t>(l), xin);
      layer_backward(static_cast<int32_t>(l), xin, dx.get(), result.layers[sz(l)]);
    }
    sync();
    return result;
  }

 private:
  // ------------------------------------------------------------------ helpers
  // n T from src to dst (host to device or back), synchronously.
  template <class T>
  void transfer(T* dst, const T* src, size_t n, cudaMemcpyKind kind) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), kind, stream_));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy(float* d, const float* s, size_t n) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(d, s, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void add(float* y, const float* x, int64_t n) {
    add_kernel<<<grid_for(n), kThreads, 0, stream_>>>(y, x, n);
    check_launch("add");
  }
  void sync() { TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  void sample_memory() {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) peak_used_ = std::max(peak_used_, total_b - free_b);
  }

  // Column-major cuBLAS: C[m, n] = alpha op(A) op(B) + beta C.
  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    if (m == 0 || n == 0) return;
    cublas_check(cublasSgemm(blas_, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, int(m), int(n),
                             int(k), &alpha, A, int(lda), B, int(ldb), &beta, C, int(ldc)),
                 "cublasSgemm");
  }
  void gemm_batched(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
                    int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc,
                    int64_t sc, int64_t batch) {
    if (m == 0 || n == 0) return;
    cublas_check(cublasSgemmStridedBatched(blas_, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           int(m), int(n), int(k), &alpha, A, int(lda), sa, B, int(ldb), sb, &beta, C,
                                           int(ldc), sc, int(batch)),
                 "cublasSgemmStridedBatched");
  }
  // y[S, out] = x[S, in] W^T (+ bias).
  void linear(const float* x, int64_t in, const DevWeight& w, const DevWeight* bias, float* y) {
    gemm(true, false, w.rows, S_, in, 1.0f, w.ptr(), in, x, in, 0.0f, y, w.rows);
    if (bias != nullptr && !bias->empty()) {
      add_bias_kernel<<<grid_for(S_ * w.rows), kThreads, 0, stream_>>>(y, bias->ptr(), S_, w.rows);
      check_launch("bias");
    }
  }
  // dx[S, in] (+)= dy[S, out] W.
  void linear_back(const float* dy, const DevWeight& w, float* dx, bool accumulate) {
    gemm(false, false, w.cols, S_, w.rows, 1.0f, w.ptr(), w.cols, dy, w.rows, accumulate ? 1.0f : 0.0f, dx, w.cols);
  }
  void rms(const float* x, float* y, float* r, int64_t rows, int64_t n, const DevWeight& w) {
    rms_forward_kernel<<<rows, kThreads, 0, stream_>>>(x, y, r, n, w.ptr(), static_cast<float>(cfg_.rms_norm_eps));
    check_launch("rms norm");
  }
  void rms_back(const float* x, const float* r, int64_t rows, int64_t n, const DevWeight& w, const float* dy, float* dx,
                bool accumulate) {
    rms_backward_kernel<<<rows, kThreads, 0, stream_>>>(x, r, n, w.ptr(), dy, dx, accumulate);
    check_launch("rms norm backward");
  }
  void rope(float* x, int64_t heads, int64_t stride, size_t table, bool inverse) {
    rope_kernel<<<grid_for(S_ * heads * (D_ / 2)), kThreads, 0, stream_>>>(x, S_, heads, stride, D_, cos_[table].get(),
                                                                          sin_[table].get(), inverse);
    check_launch("rope");
  }
  int64_t window(int32_t l) const { return cfg_.layers[sz(l)].sliding_window; }
  int64_t first_key_host(int32_t l, int64_t i) const {
    const int64_t w = window(l);
    return w > 0 ? std::max<int64_t>(0, i - w + 1) : 0;
  }

  // The activations allocated and the tokens on the device: the recipe's step set up.
  void begin(std::span<const int32_t> tokens) {
    tokens_.alloc(sz(S_), &tr_);
    transfer(tokens_.get(), tokens.data(), tokens.size(), cudaMemcpyHostToDevice);
    alloc(S_, {&r1_, &ra_, &r2_, &rm_});  // the norms' 1/rms per row
    alloc(S_ * H_, {&x_, &h1_, &att_, &x2_, &h2_, &m_out_, &tmp_});
    alloc(S_ * QD_, {&q_pre_, &q_, &o_});
    alloc(S_ * KD_, {&k_pre_, &k_, &v_});
    alloc(S_ * F_, {&g_, &u_, &act_});
    if (cfg_.qk_norm) {
      alloc(S_ * NQ_, {&rq_});
      alloc(S_ * NKV_, {&rk_});
    }
    alloc(NQ_ * S_, {&lse_});
    alloc(NQ_ * R_ * S_, {&P_});
  }
  void alloc_backward() {
    alloc(S_ * H_, {&dm_, &dh2_, &dx2_, &da_, &dh1_});
    alloc(S_ * QD_, {&dout_, &dq_, &dke_, &dve_, &tq_});
    alloc(S_ * KD_, {&dk_, &dv_});
    alloc(S_ * F_, {&dact_});
    alloc(NQ_ * S_, {&dvec_});
    alloc(NQ_ * R_ * S_, {&dP_});
    const size_t blocks = sz(NQ_ * nb_ * nb_);
    sums_.alloc(3 * blocks + 6, &tr_);
    cells_.alloc(3, &tr_);
  }
  // Each of `bufs` as n floats, counted in the pass's peak.
  void alloc(int64_t n, std::initializer_list<Buf<float>*> bufs) {
    for (Buf<float>* b : bufs) b->alloc(sz(n), &tr_);
  }

  const DevLayer& layer(int32_t l) const { return m_.layers[sz(l)]; }

  // Layer l's forward again from its input x (the backward recomputes what it did not keep).
  void layer_forward(int32_t l, const float* x) {
    copy(x_.get(), x, sz(S_ * H_));
    runtime::run_layer(cfg_, *this, l);
  }

 public:
  // --- the layer recipe's calls (runtime/recipe.h; the whole sequence is one step and one MLP piece): x_ is the
  // residual stream, each call keeps in the members what the backward reads.
  int64_t rows() const { return S_; }
  int64_t mlp_piece() const { return S_; }
  void embed() {
    runtime::gpu::embed_tokens(tokens_.get(), S_, m_.embedding.ptr(), H_, static_cast<float>(cfg_.embedding_scale),
                               x_.get(), stream_);
  }
  void attn_norm(int32_t l) { rms(x_.get(), h1_.get(), r1_.get(), S_, H_, layer(l).attn_norm); }
  void qkv(int32_t l, bool bias) {
    const DevLayer& W = layer(l);
    linear(h1_.get(), H_, W.wq, bias ? &W.bq : nullptr, q_pre_.get());
    linear(h1_.get(), H_, W.wk, bias ? &W.bk : nullptr, k_pre_.get());
    linear(h1_.get(), H_, W.wv, bias ? &W.bv : nullptr, v_.get());
  }
  void qk_norm_rope(int32_t l, bool norm, bool rotate) {
    const DevLayer& W = layer(l);
    if (norm) {
      rms(q_pre_.get(), q_.get(), rq_.get(), S_ * NQ_, D_, W.q_norm);
      rms(k_pre_.get(), k_.get(), rk_.get(), S_ * NKV_, D_, W.k_norm);
    } else {
      copy(q_.get(), q_pre_.get(), sz(S_ * QD_));
      copy(k_.get(), k_pre_.get(), sz(S_ * KD_));
    }
    if (rotate) {
      const size_t r = layer_rope_[sz(l)];
      rope(q_.get(), NQ_, QD_, r, false);
      rope(k_.get(), NKV_, KD_, r, false);
    }
  }
  bool attention_rotates(int32_t) const { return false; }
  void attend(int32_t l) {
    attention_forward(l);
    if (observe_ == nullptr) return;
    (*observe_)({.layer = l, .tokens = S_, .q = q_.get(), .k = k_.get(), .v = v_.get(), .o = o_.get(),
                 .stream = stream_});
  }
  // x2 = x + [RMSNorm(post_attn_norm)](o Wo^T); x_ stays the layer's input until mlp().
  void out_proj(int32_t l, bool post_norm) {
    linear(o_.get(), QD_, layer(l).wo, nullptr, att_.get());
    copy(x2_.get(), x_.get(), sz(S_ * H_));
    add_branch(x2_.get(), att_.get(), ra_.get(), post_norm ? &layer(l).post_attn_norm : nullptr);
  }
  void ffn_norm(int32_t l) { rms(x2_.get(), h2_.get(), r2_.get(), S_, H_, layer(l).ffn_norm); }
  // x_ = x2 + [RMSNorm(post_ffn_norm)](act(h2 Wg^T) * (h2 Wu^T) Wd^T).
  void mlp(int32_t l, int64_t, int64_t, Activation act, bool post_norm) {
    const DevLayer& W = layer(l);
    linear(h2_.get(), H_, W.w_gate, nullptr, g_.get());
    linear(h2_.get(), H_, W.w_up, nullptr, u_.get());
    act_forward_kernel<<<grid_for(S_ * F_), kThreads, 0, stream_>>>(g_.get(), u_.get(), act_.get(), S_ * F_, act);
    check_launch("activation");
    linear(act_.get(), F_, W.w_down, nullptr, m_out_.get());
    copy(x_.get(), x2_.get(), sz(S_ * H_));
    add_branch(x_.get(), m_out_.get(), rm_.get(), post_norm ? &W.post_ffn_norm : nullptr);
  }

 private:
  // y += branch, or y += RMSNorm(branch; *post_norm) keeping its 1/rms in r (Gemma-3's post-norms).
  void add_branch(float* y, const float* branch, float* r, const DevWeight* post_norm) {
    if (post_norm != nullptr) {
      rms(branch, tmp_.get(), r, S_, H_, *post_norm);
      branch = tmp_.get();
    }
    add(y, branch, S_ * H_);
  }

  // out [heads][rows][nk] = alpha * A_h B_kv^T for chunk rows [r0, r0 + rows) of A ([S, QD]: q or dO) against
  // keys [k0, k0 + nk) of B ([S, KD]: k or v): the scaled scores, or dP = dO V^T.
  void chunk_products(const float* A, const float* B, int64_t r0, int64_t rows, int64_t k0, int64_t nk, float alpha,
                      float* out) {
    for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
      const int64_t h0 = kvh * G_;
      gemm_batched(true, false, nk, rows, D_, alpha, B + k0 * KD_ + kvh * D_, KD_, 0, A + r0 * QD_ + h0 * D_, QD_, D_,
                   0.0f, out + h0 * rows * nk, nk, rows * nk, G_);
    }
  }

  void attention_forward(int32_t l) {
    const float scale = static_cast<float>(cfg_.attention_scale);
    Gate gate;
    if (opt_.gate && opt_.gate->layer == l) {
      gate.head = opt_.gate->head;
      gate.query = opt_.gate->query;
      gate.key = opt_.gate->key;
      gate.value = static_cast<float>(opt_.gate->value);
    }
    for (int64_t r0 = 0; r0 < S_; r0 += R_) {
      const int64_t r1 = std::min(S_, r0 + R_), rows = r1 - r0, k0 = first_key_host(l, r0), nk = r1 - k0;
      chunk_products(q_.get(), k_.get(), r0, rows, k0, nk, scale, P_.get());
      softmax_kernel<<<dim3(unsigned(rows), unsigned(NQ_)), kThreads, 0, stream_>>>(P_.get(), lse_.get(), rows, nk, r0,
                                                                                 k0, window(l), S_, gate);
      check_launch("attention softmax");
      // O = P V
      for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
        const int64_t h0 = kvh * G_;
        gemm_batched(false, false, D_, rows, nk, 1.0f, v_.get() + k0 * KD_ + kvh * D_, KD_, 0,
                     P_.get() + h0 * rows * nk, nk, rows * nk, 0.0f, o_.get() + r0 * QD_ + h0 * D_, QD_, D_, G_);
      }
    }
  }

  void attention_backward(int32_t l, LayerGradients& g) {
    const float scale = static_cast<float>(cfg_.attention_scale);
    const size_t blocks = sz(NQ_ * nb_ * nb_);
    TESSERA_CUDA_CHECK(cudaMemsetAsync(sums_.get(), 0, sums_.size() * sizeof(double), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(cells_.get(), 0, 3 * sizeof(unsigned long long), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dke_.get(), 0, sz(S_ * QD_) * sizeof(float), stream_));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(dve_.get(), 0, sz(S_ * QD_) * sizeof(float), stream_));
    {
      const int64_t warps = S_ * NQ_;
      dvec_kernel<<<unsigned((warps * 32 + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
          dout_.get(), o_.get(), dvec_.get(), S_, NQ_, D_, QD_);
      check_launch("attention D");
    }
    TileArgs ta{};
    ta.lse = lse_.get();
    ta.Dv = dvec_.get();
    ta.window = window(l);
    ta.S = S_;
    ta.block = opt_.block;
    ta.nb = nb_;
    ta.sink = opt_.regions.sink;
    ta.local = opt_.regions.local;
    ta.last = opt_.regions.last;
    ta.tiny = 1e-6f;
    ta.influence = sums_.get();
    ta.gate = sums_.get() + blocks;
    ta.attention = sums_.get() + 2 * blocks;
    ta.regions = sums_.get() + 3 * blocks;
    ta.cells = cells_.get();
    for (int64_t r0 = 0; r0 < S_; r0 += R_) {
      const int64_t r1 = std::min(S_, r0 + R_), rows = r1 - r0, k0 = first_key_host(l, r0), nk = r1 - k0;
      chunk_products(q_.get(), k_.get(), r0, rows, k0, nk, scale, P_.get());
      chunk_products(dout_.get(), v_.get(), r0, rows, k0, nk, 1.0f, dP_.get());
      ta.P = P_.get();
      ta.dP = dP_.get();
      ta.rows = rows;
      ta.nk = nk;
      ta.r0 = r0;
      ta.k0 = k0;
      ta.k0_aligned = k0 / 64 * 64;
      const dim3 grid(unsigned((r1 - ta.k0_aligned + 63) / 64), unsigned((rows + 63) / 64), unsigned(NQ_));
      backward_tile_kernel<<<grid, kThreads, 0, stream_>>>(ta);
      check_launch("attention backward tiles");
      for (int64_t kvh = 0; kvh < NKV_; ++kvh) {
        const int64_t h0 = kvh * G_;
        // dQ = scale dS K
        gemm_batched(false, false, D_, rows, nk, scale, k_.get() + k0 * KD_ + kvh * D_, KD_, 0,
                     dP_.get() + h0 * rows * nk, nk, rows * nk, 0.0f, dq_.get() + r0 * QD_ + h0 * D_, QD_, D_, G_);
        // dK (per query head) += scale dS^T Q
        gemm_batched(false, true, D_, nk, rows, scale, q_.get() + r0 * QD_ + h0 * D_, QD_, D_,
                     dP_.get() + h0 * rows * nk, nk, rows * nk, 1.0f, dke_.get() + k0 * QD_ + h0 * D_, QD_, D_, G_);
        // dV (per query head) += P^T dO
        gemm_batched(false, true, D_, nk, rows, 1.0f, dout_.get() + r0 * QD_ + h0 * D_, QD_, D_,
                     P_.get() + h0 * rows * nk, nk, rows * nk, 1.0f, dve_.get() + k0 * QD_ + h0 * D_, QD_, D_, G_);
      }
    }
    group_sum_kernel<<<grid_for(S_ * KD_), kThreads, 0, stream_>>>(dke_.get(), dk_.get(), S_, NKV_, G_, D_);
    group_sum_kernel<<<grid_for(S_ * KD_), kThreads, 0, stream_>>>(dve_.get(), dv_.get(), S_, NKV_, G_, D_);
    check_launch("group sums");
    sample_memory();
    std::vector<double> h(sums_.size());
    std::vector<unsigned long long> c(3);
    transfer(h.data(), sums_.get(), h.size(), cudaMemcpyDeviceToHost);
    transfer(c.data(), cells_.get(), 3, cudaMemcpyDeviceToHost);
    g.influence.assign(h.begin(), h.begin() + static_cast<ptrdiff_t>(blocks));
    g.gate_grad.assign(h.begin() + static_cast<ptrdiff_t>(blocks), h.begin() + static_cast<ptrdiff_t>(2 * blocks));
    g.attention.assign(h.begin() + static_cast<ptrdiff_t>(2 * blocks), h.begin() + static_cast<ptrdiff_t>(3 * blocks));
    RegionSums* rs[3] = {&g.probe.streaming, &g.probe.middle, &g.probe.last};
    for (int r = 0; r < 3; ++r) {
      rs[r]->sum = h[3 * blocks + 2 * sz(r)];
      rs[r]->abs_sum = h[3 * blocks + 2 * sz(r) + 1];
      rs[r]->cells = static_cast<int64_t>(c[sz(r)]);
    }
  }

  // dx: in = d(layer output), out = d(layer input).
  void layer_backward(int32_t l, const float* x, float* dx, LayerGradients& g) {
    const DevLayer& W = m_.layers[sz(l)];
    const float* dm = dx;
    if (cfg_.post_norms) {  // rm_: from the forward just recomputed
      rms_back(m_out_.get(), rm_.get(), S_, H_, W.post_ffn_norm, dx, dm_.get(), false);
      dm = dm_.get();
    }
    linear_back(dm, W.w_down, dact_.get(), false);
    act_backward_kernel<<<grid_for(S_ * F_), kThreads, 0, stream_>>>(g_.get(), u_.get(), dact_.get(), S_ * F_,
                                                                     cfg_.activation);
    check_launch("activation backward");
    linear_back(g_.get(), W.w_gate, dh2_.get(), false);
    linear_back(u_.get(), W.w_up, dh2_.get(), true);
    copy(dx2_.get(), dx, sz(S_ * H_));
    rms_back(x2_.get(), r2_.get(), S_, H_, W.ffn_norm, dh2_.get(), dx2_.get(), true);
    const float* da = dx2_.get();
    if (cfg_.post_norms) {
      rms_back(att_.get(), ra_.get(), S_, H_, W.post_attn_norm, dx2_.get(), da_.get(), false);
      da = da_.get();
    }
    linear_back(da, W.wo, dout_.get(), false);
    attention_backward(l, g);
    const size_t r = layer_rope_[sz(l)];
    rope(dq_.get(), NQ_, QD_, r, true);
    rope(dk_.get(), NKV_, KD_, r, true);
    if (cfg_.qk_norm) {
      rms_back(q_pre_.get(), rq_.get(), S_ * NQ_, D_, W.q_norm, dq_.get(), tq_.get(), false);
      copy(dq_.get(), tq_.get(), sz(S_ * QD_));
      rms_back(k_pre_.get(), rk_.get(), S_ * NKV_, D_, W.k_norm, dk_.get(), tq_.get(), false);
      copy(dk_.get(), tq_.get(), sz(S_ * KD_));
    }
    linear_back(dq_.get(), W.wq, dh1_.get(), false);
    linear_back(dk_.get(), W.wk, dh1_.get(), true);
    linear_back(dv_.get(), W.wv, dh1_.get(), true);
    copy(dx, dx2_.get(), sz(S_ * H_));
    rms_back(x, r1_.get(), S_, H_, W.attn_norm, dh1_.get(), dx, true);
  }

  const GradientModel::Impl& m_;
  const ModelConfig& cfg_;
  const GradientOptions& opt_;
  int64_t S_;
  int64_t G_ = 1, nb_ = 0, R_ = 64, loss_rows_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  Tracker tr_;
  size_t peak_used_ = 0;
  std::vector<Buf<float>> inv_freqs_, cos_, sin_;  // per distinct RoPE set
  std::vector<size_t> layer_rope_;
  Buf<int32_t> tokens_;
  Buf<float> x_;       // the recipe's residual stream
  Buf<float> inputs_;  // every layer's input [layers, S, H] (not with loss_only)
  Buf<float> r1_, h1_, q_pre_, k_pre_, rq_, rk_, q_, k_, v_, lse_, o_, att_, ra_, x2_, r2_, h2_, g_, u_, act_, m_out_,
      rm_, tmp_, P_;
  Buf<float> dP_, dm_, dact_, dh2_, dx2_, da_, dout_, dq_, dk_, dv_, dke_, dve_, dvec_, dh1_, tq_;
  Buf<double> sums_;
  Buf<unsigned long long> cells_;
  const std::function<void(const GradientModel::AttentionView&)>* observe_ = nullptr;
};

// The costs of `pass`, begun at t0, into *stats (null: not asked for).
void report(const Pass& pass, size_t weight_bytes, std::chrono::steady_clock::time_point t0, DeviceStats* stats) {
  if (stats == nullptr) return;
  stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats->weight_bytes = weight_bytes;
  stats->peak_pass_bytes = pass.tracker().peak;
  stats->peak_used_bytes = pass.peak_used();
  stats->chunk_rows = pass.chunk_rows();
}

}  // namespace

GradientResult GradientModel::run(std::span<const int32_t> tokens, std::span<const Target> targets,
                                  const GradientOptions& options, const DeviceRunOptions& run) const {
  GradientOptions o = options;
  o.device = Device::Cuda;
  check_gradient_inputs(impl_->cfg, tokens, targets, o);
  if (!o.loss_only) {  // the block sums come back to the host: 3 doubles per block, head and layer
    const double nb = std::ceil(static_cast<double>(tokens.size()) / o.block);
    check_host_allocation("attention gradients of " + std::to_string(tokens.size()) + " tokens (" + impl_->cfg.name +
                              "): block sums",
                          24.0 * impl_->cfg.num_layers * impl_->cfg.num_q_heads * nb * nb,
                          "use shorter calibration samples");
  }
  const auto t0 = std::chrono::steady_clock::now();
  Pass pass(*impl_, tokens, o, run);
  GradientResult r = pass.run(tokens, targets);
  report(pass, impl_->bytes, t0, run.stats);
  return r;
}

void GradientModel::forward(std::span<const int32_t> tokens, const std::function<void(const AttentionView&)>& observe,
                            const DeviceRunOptions& run) const {
  const ModelConfig& cfg = impl_->cfg;
  check(!tokens.empty(), "forward (CUDA): empty token sequence");
  for (size_t i = 0; i < tokens.size(); ++i)
    check(tokens[i] >= 0 && tokens[i] < cfg.vocab_size,
          "forward (CUDA): token " + std::to_string(i) + " has id " + std::to_string(tokens[i]) +
              ", outside the vocabulary of " + std::to_string(cfg.vocab_size));
  GradientOptions o;
  o.device = Device::Cuda;
  o.loss_only = true;
  const auto t0 = std::chrono::steady_clock::now();
  Pass pass(*impl_, tokens, o, run);
  pass.forward(tokens, observe);
  report(pass, impl_->bytes, t0, run.stats);
}

}  // namespace tessera::plan::cuda
