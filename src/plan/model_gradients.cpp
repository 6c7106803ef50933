#include "plan/model_gradients.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "core/memory_budget.h"
#include "plan/activation.h"
#include "plan/cross_entropy.h"
#include "plan/pass_dims.h"
#include "runtime/recipe.h"
#include "runtime/rope.h"

namespace tessera::plan {

using runtime::Activation;
using runtime::LayerWeights;
using runtime::Model;
using runtime::ModelConfig;
using runtime::Weight;

void check_backward_supported(const ModelConfig& config) {
  switch (config.arch) {
    case runtime::Architecture::Llama:
    case runtime::Architecture::Qwen2:
    case runtime::Architecture::Gemma3:
      return;
  }
  throw Error(config.name + ": tessera has no backward pass for architecture " +
              std::string(runtime::architecture_name(config.arch)) +
              " yet (tessera plan supports Llama, Mistral, Qwen2 and Gemma-3 models)");
}

namespace {

// C = alpha * op(A) op(B) + beta * C, row-major; cblas_sgemm or cblas_dgemm by T.
template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc, T alpha = T(1)) {
  if (m == 0 || n == 0) return;
  const auto blas = [] {
    if constexpr (std::is_same_v<T, float>)
      return &cblas_sgemm;
    else
      return &cblas_dgemm;
  }();
  blas(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
       static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
       static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

template <typename T>
using Vec = std::vector<T>;

// The attention tiles' products run inside the pool's workers, one small GEMM per (head, query tile): OpenBLAS
// must not spread each over its own threads as well (its workers then spin against ours, about 10x slower).
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : threads_(openblas_get_num_threads()) { openblas_set_num_threads(1); }
  ~SingleThreadedBlas() { openblas_set_num_threads(threads_); }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int threads_;
};

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// The activations of one layer's forward pass that its backward pass reads.
template <typename T>
struct LayerActivations {
  Vec<T> r1, h1;            // attention RMSNorm: 1/rms per row, output
  Vec<T> q_pre, k_pre;      // projections (+ bias), before QK-norm
  Vec<T> rq, rk;            // QK-norm 1/rms per (row, head)
  Vec<T> q, k, v;           // after QK-norm and RoPE
  Vec<T> lse;               // [heads][S] log-sum-exp of the scaled scores
  Vec<T> o;                 // attention output [S, QD]
  Vec<T> a, ra;             // o Wo^T, and its post-norm 1/rms (Gemma-3)
  Vec<T> x2, r2, h2;        // after the attention residual; FFN RMSNorm
  Vec<T> g, u, act;         // gate, up, act(gate) * up
  Vec<T> m, rm;             // act Wd^T, and its post-norm 1/rms
};

template <typename T>
class Backprop : private PassDims {
 public:
  Backprop(const Model& model, std::span<const int32_t> tokens, const GradientOptions& opt, ThreadPool& pool)
      : PassDims(model.config()), model_(model), cfg_(model.config()), opt_(opt), pool_(pool),
        S_(static_cast<int64_t>(tokens.size())), tokens_(tokens) {
    runtime::LayerRopes ropes = runtime::layer_ropes(cfg_, model.weights().rope_freq_factors);
    for (const std::vector<float>& inv : ropes.inv_freqs) {
      std::vector<float> c(sz(S_ * (D_ / 2))), s(sz(S_ * (D_ / 2)));
      runtime::rope_tables(inv, 0, S_, c.data(), s.data());
      cos_.emplace_back(c.begin(), c.end());
      sin_.emplace_back(s.begin(), s.end());
    }
    layer_rope_ = std::move(ropes.layer);
  }

  GradientResult run(std::span<const Target> targets) {
    GradientResult result;
    result.seq_len = static_cast<int32_t>(S_);
    result.block = opt_.block;
    result.num_blocks = static_cast<int32_t>((S_ + opt_.block - 1) / opt_.block);
    result.num_q_heads = static_cast<int32_t>(NQ_);
    nb_ = result.num_blocks;

    // Forward, keeping each layer's input.
    const int64_t L = cfg_.num_layers;
    inputs_.assign(sz(L), {});
    LayerActivations<T> act;
    act_ = &act;
    embed();
    for (int64_t l = 0; l < L; ++l) {
      if (!opt_.loss_only) inputs_[sz(l)] = x_;
      runtime::run_layer(cfg_, *this, static_cast<int32_t>(l));
    }
    Vec<T> x = std::move(x_);

    // Loss over the target rows.
    const int64_t NT = static_cast<int64_t>(targets.size());
    const int64_t V = cfg_.vocab_size;
    const Weight& wf = model_.weights().final_norm;
    const T* wout = weight(model_.weights().output());
    Vec<T> xt(sz(NT * H_)), rf(sz(NT)), hf(sz(NT * H_)), z(sz(NT * V));
    for (int64_t t = 0; t < NT; ++t)
      std::copy_n(x.begin() + static_cast<ptrdiff_t>(targets[sz(t)].position * H_), H_,
                  xt.begin() + static_cast<ptrdiff_t>(t * H_));
    rms_forward(xt.data(), hf.data(), rf.data(), NT, H_, weight(wf));
    gemm(false, true, NT, V, H_, hf.data(), H_, wout, H_, T(0), z.data(), V);
    Vec<T> dz(opt_.loss_only ? 0 : sz(NT * V));
    result.loss = cross_entropy<T>(z, V, targets, static_cast<T>(cfg_.final_logit_softcap), dz);
    if (opt_.loss_only) return result;

    Vec<T> dhf(sz(NT * H_)), dxt(sz(NT * H_));
    gemm(false, false, NT, H_, V, dz.data(), V, wout, H_, T(0), dhf.data(), H_);
    rms_backward(xt.data(), rf.data(), NT, H_, weight(wf), dhf.data(), dxt.data(), false);
    std::fill(x.begin(), x.end(), T(0));
    Vec<T>& dx = x;
    for (int64_t t = 0; t < NT; ++t)
      for (int64_t i = 0; i < H_; ++i) dx[sz(targets[sz(t)].position * H_ + i)] += dxt[sz(t * H_ + i)];

    result.layers.resize(sz(L));
    for (int64_t l = L - 1; l >= 0; --l) {
      const Vec<T> xin = std::move(inputs_[sz(l)]);
      layer_forward(static_cast<int32_t>(l), xin, act);
      layer_backward(static_cast<int32_t>(l), xin, act, dx, result.layers[sz(l)]);
    }
    return result;
  }

  // The weights as T: f32 weights in place; others (kept in a stored type, or T = f64) converted once per pass.
  const T* weight(const Weight& w) {
    if constexpr (std::is_same_v<T, float>) {
      if (w.type == model::TensorType::F32) return w.ptr();
    }
    auto it = converted_.find(&w);
    if (it == converted_.end()) {
      const std::vector<float> v = w.to_f32();
      it = converted_.emplace(&w, Vec<T>(v.begin(), v.end())).first;
    }
    return it->second.data();
  }

  // --- the layer recipe's calls (runtime/recipe.h: the forward is the engines' recipe): layer l on x_ (its input,
  // then its output), recording into *act_ what the backward reads.
  int64_t rows() const { return S_; }
  int64_t mlp_piece() const { return S_; }
  void embed() {
    x_.resize(sz(S_ * H_));
    const auto& emb = model_.weights().embedding;
    std::vector<float> row(sz(H_));
    for (int64_t t = 0; t < S_; ++t) {
      emb.rows_f32(tokens_[sz(t)], 1, row.data());  // dequantized on lookup
      for (int64_t i = 0; i < H_; ++i)
        x_[sz(t * H_ + i)] = static_cast<T>(row[sz(i)]) * static_cast<T>(cfg_.embedding_scale);
    }
  }
  void attn_norm(int32_t l) {
    LayerActivations<T>& a = *act_;
    a.r1.resize(sz(S_));
    a.h1.resize(sz(S_ * H_));
    rms_forward(x_.data(), a.h1.data(), a.r1.data(), S_, H_, weight(layer(l).attn_norm));
  }
  void qkv(int32_t l, bool bias) {
    LayerActivations<T>& a = *act_;
    const LayerWeights& W = layer(l);
    linear(a.h1, H_, W.wq, bias ? &W.bq : nullptr, a.q_pre);
    linear(a.h1, H_, W.wk, bias ? &W.bk : nullptr, a.k_pre);
    linear(a.h1, H_, W.wv, bias ? &W.bv : nullptr, a.v);
  }
  void qk_norm_rope(int32_t l, bool norm, bool rotate) {
    LayerActivations<T>& a = *act_;
    const LayerWeights& W = layer(l);
    a.q = a.q_pre;
    a.k = a.k_pre;
    if (norm) {
      a.rq.resize(sz(S_ * NQ_));
      a.rk.resize(sz(S_ * NKV_));
      rms_forward(a.q_pre.data(), a.q.data(), a.rq.data(), S_ * NQ_, D_, weight(W.q_norm));
      rms_forward(a.k_pre.data(), a.k.data(), a.rk.data(), S_ * NKV_, D_, weight(W.k_norm));
    }
    if (rotate) {
      const size_t r = layer_rope_[sz(l)];
      rope(a.q.data(), NQ_, QD_, r, false);
      rope(a.k.data(), NKV_, KD_, r, false);
    }
  }
  bool attention_rotates(int32_t) const { return false; }
  void attend(int32_t l) { attention_forward(l, *act_); }
  void out_proj(int32_t l, bool post_norm) {
    LayerActivations<T>& a = *act_;
    linear(a.o, QD_, layer(l).wo, nullptr, a.a);
    a.x2 = x_;
    if (post_norm) {
      a.ra.resize(sz(S_));
      Vec<T> n(sz(S_ * H_));
      rms_forward(a.a.data(), n.data(), a.ra.data(), S_, H_, weight(layer(l).post_attn_norm));
      for (size_t i = 0; i < n.size(); ++i) a.x2[i] += n[i];
    } else {
      for (size_t i = 0; i < a.a.size(); ++i) a.x2[i] += a.a[i];
    }
  }
  void ffn_norm(int32_t l) {
    LayerActivations<T>& a = *act_;
    a.r2.resize(sz(S_));
    a.h2.resize(sz(S_ * H_));
    rms_forward(a.x2.data(), a.h2.data(), a.r2.data(), S_, H_, weight(layer(l).ffn_norm));
  }
  // The whole sequence as one piece (mlp_piece): x_ = x2 + [RMSNorm](act(g) * u Wd^T).
  void mlp(int32_t l, int64_t, int64_t, Activation act_kind, bool post_norm) {
    LayerActivations<T>& a = *act_;
    const LayerWeights& W = layer(l);
    linear(a.h2, H_, W.w_gate, nullptr, a.g);
    linear(a.h2, H_, W.w_up, nullptr, a.u);
    a.act.resize(a.g.size());
    for (size_t i = 0; i < a.g.size(); ++i) a.act[i] = activation(act_kind, a.g[i]) * a.u[i];
    linear(a.act, F_, W.w_down, nullptr, a.m);
    x_ = a.x2;
    const Vec<T>* ffn = &a.m;  // the FFN branch's contribution to the residual: m, or RMSNorm(m) (Gemma-3)
    if (post_norm) {
      a.rm.resize(sz(S_));
      scratch_.resize(a.m.size());
      rms_forward(a.m.data(), scratch_.data(), a.rm.data(), S_, H_, weight(W.post_ffn_norm));
      ffn = &scratch_;
    }
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += (*ffn)[i];
  }

 private:
  const LayerWeights& layer(int32_t l) const { return model_.weights().layers[sz(l)]; }

  // The gradient of a residual branch's input v given dy, the branch being v, or RMSNorm(v; w) with the 1/rms r
  // (Gemma-3's post-norms).
  Vec<T> branch_back(const Vec<T>& v, const Vec<T>& r, const Weight& w, const Vec<T>& dy) {
    if (!cfg_.post_norms) return dy;
    Vec<T> dv(sz(S_ * H_));
    rms_backward(v.data(), r.data(), S_, H_, weight(w), dy.data(), dv.data(), false);
    return dv;
  }

  void rms_forward(const T* x, T* y, T* r, int64_t rows, int64_t n, const T* w) {
    for (int64_t i = 0; i < rows; ++i) {
      const T* in = x + i * n;
      T* out = y + i * n;
      double ss = 0;
      for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(in[j]) * static_cast<double>(in[j]);
      const T inv = T(1) / std::sqrt(static_cast<T>(ss / static_cast<double>(n)) + static_cast<T>(cfg_.rms_norm_eps));
      r[i] = inv;
      for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (in[j] * inv);
    }
  }

  // dx (= or +=) the gradient of y = w * x * r(x) given dy.
  void rms_backward(const T* x, const T* r, int64_t rows, int64_t n, const T* w, const T* dy, T* dx,
                    bool accumulate) {
    for (int64_t i = 0; i < rows; ++i) {
      const T* in = x + i * n;
      const T* g = dy + i * n;
      T* out = dx + i * n;
      double dot = 0;
      for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(w[j] * g[j]) * static_cast<double>(in[j]);
      const T ri = r[i];
      const T c = static_cast<T>(dot) * ri * ri * ri / static_cast<T>(n);
      for (int64_t j = 0; j < n; ++j) {
        const T v = w[j] * g[j] * ri - in[j] * c;
        out[j] = accumulate ? out[j] + v : v;
      }
    }
  }

  void linear(const Vec<T>& x, int64_t in, const Weight& w, const Weight* bias, Vec<T>& y) {
    y.resize(sz(S_ * w.rows));
    gemm(false, true, S_, w.rows, in, x.data(), in, weight(w), in, T(0), y.data(), w.rows);
    if (bias != nullptr && !bias->empty()) {
      const T* b = weight(*bias);
      for (int64_t t = 0; t < S_; ++t)
        for (int64_t j = 0; j < w.rows; ++j) y[sz(t * w.rows + j)] += b[j];
    }
  }

  // dx (+)= dy W for y = x W^T.
  void linear_back(const Vec<T>& dy, const Weight& w, Vec<T>& dx, bool accumulate) {
    dx.resize(sz(S_ * w.cols));
    gemm(false, false, S_, w.cols, w.rows, dy.data(), w.rows, weight(w), w.cols, accumulate ? T(1) : T(0),
         dx.data(), w.cols);
  }

  void rope(T* x, int64_t heads, int64_t stride, size_t table, bool inverse) {
    const int64_t half = D_ / 2;
    const Vec<T>& cs = cos_[table];
    const Vec<T>& sn = sin_[table];
    for (int64_t t = 0; t < S_; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * stride + h * D_;
        for (int64_t i = 0; i < half; ++i) {
          const T c = cs[sz(t * half + i)], s = inverse ? -sn[sz(t * half + i)] : sn[sz(t * half + i)];
          const T a = v[i], b = v[i + half];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
  }

  int64_t window(int32_t layer) const { return cfg_.layers[sz(layer)].sliding_window; }
  // First key visible to query row i.
  int64_t first_key(int32_t layer, int64_t i) const {
    const int64_t w = window(layer);
    return w > 0 ? std::max<int64_t>(0, i - w + 1) : 0;
  }

  // Layer l's forward again from its input (the backward recomputes what it did not keep).
  void layer_forward(int32_t l, const Vec<T>& x, LayerActivations<T>& a) {
    x_ = x;
    act_ = &a;
    runtime::run_layer(cfg_, *this, l);
  }

  // Query rows [r0, r1) of head h against keys [k0, r1): scaled, masked scores into s [rows, r1 - k0].
  void scores(int32_t l, const LayerActivations<T>& a, int64_t h, int64_t r0, int64_t r1, int64_t k0, T* s) const {
    const int64_t kvh = h / (NQ_ / NKV_);
    const int64_t nk = r1 - k0;
    gemm(false, true, r1 - r0, nk, D_, a.q.data() + r0 * QD_ + h * D_, QD_, a.k.data() + k0 * KD_ + kvh * D_, KD_,
         T(0), s, nk, static_cast<T>(cfg_.attention_scale));
    for (int64_t i = r0; i < r1; ++i) {
      T* row = s + (i - r0) * nk;
      const int64_t lo = first_key(l, i);
      for (int64_t j = k0; j < r1; ++j)
        if (j > i || j < lo) row[j - k0] = -std::numeric_limits<T>::infinity();
    }
  }

  // Work items: (head, query block of opt_.block rows, processed in sub-tiles of <= 64 rows), heaviest first.
  std::vector<std::pair<int64_t, int64_t>> items() const {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t qb = nb_ - 1; qb >= 0; --qb)
      for (int64_t h = 0; h < NQ_; ++h) out.emplace_back(h, qb);
    return out;
  }
  static constexpr int64_t kTile = 64;

  void attention_forward(int32_t l, LayerActivations<T>& a) {
    a.o.assign(sz(S_ * QD_), T(0));
    a.lse.assign(sz(NQ_ * S_), T(0));
    const auto work = items();
    const int64_t B = opt_.block;
    std::vector<Vec<T>> tiles(sz(pool_.size()));
    const SingleThreadedBlas single;
    pool_.parallel_for(static_cast<int64_t>(work.size()), [&](int64_t it, int worker) {
      const auto [h, qb] = work[sz(it)];
      const int64_t kvh = h / (NQ_ / NKV_);
      for (int64_t r0 = qb * B; r0 < std::min(S_, (qb + 1) * B); r0 += kTile) {
        const int64_t r1 = std::min({S_, (qb + 1) * B, r0 + kTile});
        const int64_t k0 = first_key(l, r0), nk = r1 - k0;
        Vec<T>& s = tiles[sz(worker)];
        s.resize(sz((r1 - r0) * nk));
        scores(l, a, h, r0, r1, k0, s.data());
        for (int64_t i = r0; i < r1; ++i) {
          T* row = s.data() + (i - r0) * nk;
          const T mx = *std::max_element(row, row + nk);
          T sum = 0;
          for (int64_t j = 0; j < nk; ++j) sum += (row[j] = std::exp(row[j] - mx));
          for (int64_t j = 0; j < nk; ++j) row[j] /= sum;
          a.lse[sz(h * S_ + i)] = mx + std::log(sum);
          if (opt_.gate && opt_.gate->layer == l && opt_.gate->head == h && opt_.gate->query == i &&
              opt_.gate->key >= k0 && opt_.gate->key < r1)
            row[opt_.gate->key - k0] *= static_cast<T>(opt_.gate->value);
        }
        gemm(false, false, r1 - r0, D_, nk, s.data(), nk, a.v.data() + k0 * KD_ + kvh * D_, KD_, T(0),
             a.o.data() + r0 * QD_ + h * D_, QD_);
      }
    });
  }

  // dq [S, QD] (=), dk, dv [S, KD] (=); block sums and the probe into g.
  void attention_backward(int32_t l, const LayerActivations<T>& a, const Vec<T>& dout, Vec<T>& dq, Vec<T>& dk,
                          Vec<T>& dv, LayerGradients& g) {
    dq.assign(sz(S_ * QD_), T(0));
    const int workers = pool_.size();
    std::vector<Vec<T>> dks(sz(workers)), dvs(sz(workers)), ps(sz(workers)), dps(sz(workers));
    std::vector<LayerProbe> probes(sz(workers));
    const size_t blocks = sz(NQ_) * sz(nb_) * sz(nb_);
    g.influence.assign(blocks, 0.0);
    g.gate_grad.assign(blocks, 0.0);
    g.attention.assign(blocks, 0.0);
    const auto work = items();
    const int64_t B = opt_.block;
    const ProbeRegions& reg = opt_.regions;
    const T tiny = std::is_same_v<T, float> ? T(1e-6) : T(1e-12);
    const SingleThreadedBlas single;
    pool_.parallel_for(static_cast<int64_t>(work.size()), [&](int64_t it, int worker) {
      const auto [h, qb] = work[sz(it)];
      const int64_t kvh = h / (NQ_ / NKV_);
      Vec<T>& dkw = dks[sz(worker)];
      Vec<T>& dvw = dvs[sz(worker)];
      if (dkw.empty()) {
        dkw.assign(sz(S_ * KD_), T(0));
        dvw.assign(sz(S_ * KD_), T(0));
      }
      LayerProbe& probe = probes[sz(worker)];
      for (int64_t r0 = qb * B; r0 < std::min(S_, (qb + 1) * B); r0 += kTile) {
        const int64_t r1 = std::min({S_, (qb + 1) * B, r0 + kTile});
        const int64_t rows = r1 - r0, k0 = first_key(l, r0), nk = r1 - k0;
        Vec<T>& p = ps[sz(worker)];
        Vec<T>& dp = dps[sz(worker)];
        p.resize(sz(rows * nk));
        dp.resize(sz(rows * nk));
        scores(l, a, h, r0, r1, k0, p.data());
        for (int64_t i = r0; i < r1; ++i) {
          const T lse = a.lse[sz(h * S_ + i)];
          T* row = p.data() + (i - r0) * nk;
          for (int64_t j = 0; j < nk; ++j) row[j] = std::exp(row[j] - lse);
        }
        // dP = dO V^T
        gemm(false, true, rows, nk, D_, dout.data() + r0 * QD_ + h * D_, QD_, a.v.data() + k0 * KD_ + kvh * D_,
             KD_, T(0), dp.data(), nk);
        for (int64_t i = r0; i < r1; ++i) {
          T* pr = p.data() + (i - r0) * nk;
          T* dr = dp.data() + (i - r0) * nk;
          double dsum = 0;
          for (int64_t j = 0; j < nk; ++j) dsum += static_cast<double>(pr[j]) * static_cast<double>(dr[j]);
          const T D = static_cast<T>(dsum);
          const int64_t lo = first_key(l, i);
          double* infl = g.influence.data() + (sz(h) * sz(nb_) + sz(i / B)) * sz(nb_);
          double* gg = g.gate_grad.data() + (sz(h) * sz(nb_) + sz(i / B)) * sz(nb_);
          double* att = g.attention.data() + (sz(h) * sz(nb_) + sz(i / B)) * sz(nb_);
          const bool last_row = i >= S_ - reg.last;
          for (int64_t j = lo; j <= i; ++j) {
            const T aij = pr[j - k0], daij = dr[j - k0];
            const T ds = aij * (daij - D);
            const T one_minus = T(1) - aij;
            const double e = (aij > T(0) && one_minus > tiny) ? -static_cast<double>(ds) / static_cast<double>(one_minus) : 0.0;
            const double gate = static_cast<double>(aij) * static_cast<double>(daij);
            const size_t kb = sz(j / B);
            infl[kb] += e;
            gg[kb] += gate;
            att[kb] += static_cast<double>(aij);
            const bool streaming = j < reg.sink || i - j < reg.local;
            RegionSums& rs = streaming ? probe.streaming : (last_row ? probe.last : probe.middle);
            rs.sum += gate;
            rs.abs_sum += std::abs(gate);
            ++rs.cells;
            dr[j - k0] = ds;  // dS from here on
          }
          for (int64_t j = 0; j < lo - k0; ++j) dr[j] = T(0);
          for (int64_t j = i + 1; j < r1; ++j) dr[j - k0] = T(0);
        }
        // dQ = scale dS K; dK += scale dS^T Q; dV += P^T dO.
        const T scale = static_cast<T>(cfg_.attention_scale);
        gemm(false, false, rows, D_, nk, dp.data(), nk, a.k.data() + k0 * KD_ + kvh * D_, KD_, T(0),
             dq.data() + r0 * QD_ + h * D_, QD_, scale);
        gemm(true, false, nk, D_, rows, dp.data(), nk, a.q.data() + r0 * QD_ + h * D_, QD_, T(1),
             dkw.data() + k0 * KD_ + kvh * D_, KD_, scale);
        gemm(true, false, nk, D_, rows, p.data(), nk, dout.data() + r0 * QD_ + h * D_, QD_, T(1),
             dvw.data() + k0 * KD_ + kvh * D_, KD_);
      }
    });
    dk.assign(sz(S_ * KD_), T(0));
    dv.assign(sz(S_ * KD_), T(0));
    for (int w = 0; w < workers; ++w) {
      if (dks[sz(w)].empty()) continue;
      for (size_t i = 0; i < dk.size(); ++i) {
        dk[i] += dks[sz(w)][i];
        dv[i] += dvs[sz(w)][i];
      }
    }
    g.probe = {};
    for (const LayerProbe& p : probes)
      for (auto [dst, src] : {std::pair{&g.probe.streaming, &p.streaming}, std::pair{&g.probe.middle, &p.middle},
                              std::pair{&g.probe.last, &p.last}}) {
        dst->sum += src->sum;
        dst->abs_sum += src->abs_sum;
        dst->cells += src->cells;
      }
  }

  // dx: in = d(layer output), out = d(layer input).
  void layer_backward(int32_t l, const Vec<T>& x, LayerActivations<T>& a, Vec<T>& dx, LayerGradients& g) {
    const LayerWeights& W = model_.weights().layers[sz(l)];
    // FFN branch: x3 = x2 + post(m).
    const Vec<T> dm = branch_back(a.m, a.rm, W.post_ffn_norm, dx);
    Vec<T> dact;
    linear_back(dm, W.w_down, dact, false);
    Vec<T> dg(a.g.size()), du(a.g.size());
    for (size_t i = 0; i < a.g.size(); ++i) {
      du[i] = dact[i] * activation(cfg_.activation, a.g[i]);
      dg[i] = dact[i] * a.u[i] * activation_grad(cfg_.activation, a.g[i]);
    }
    Vec<T> dh2;
    linear_back(dg, W.w_gate, dh2, false);
    linear_back(du, W.w_up, dh2, true);
    Vec<T> dx2 = dx;
    rms_backward(a.x2.data(), a.r2.data(), S_, H_, weight(W.ffn_norm), dh2.data(), dx2.data(), true);
    // Attention branch: x2 = x + post(a).
    const Vec<T> da = branch_back(a.a, a.ra, W.post_attn_norm, dx2);
    Vec<T> dout;
    linear_back(da, W.wo, dout, false);
    Vec<T> dq, dk, dv;
    attention_backward(l, a, dout, dq, dk, dv, g);
    const size_t r = layer_rope_[sz(l)];
    rope(dq.data(), NQ_, QD_, r, true);
    rope(dk.data(), NKV_, KD_, r, true);
    if (cfg_.qk_norm) {
      Vec<T> t(dq.size());
      rms_backward(a.q_pre.data(), a.rq.data(), S_ * NQ_, D_, weight(W.q_norm), dq.data(), t.data(), false);
      dq.swap(t);
      t.resize(dk.size());
      rms_backward(a.k_pre.data(), a.rk.data(), S_ * NKV_, D_, weight(W.k_norm), dk.data(), t.data(), false);
      dk.swap(t);
    }
    Vec<T> dh1;
    linear_back(dq, W.wq, dh1, false);
    linear_back(dk, W.wk, dh1, true);
    linear_back(dv, W.wv, dh1, true);
    dx = std::move(dx2);
    rms_backward(x.data(), a.r1.data(), S_, H_, weight(W.attn_norm), dh1.data(), dx.data(), true);
  }

  const Model& model_;
  const ModelConfig& cfg_;
  const GradientOptions& opt_;
  ThreadPool& pool_;
  int64_t S_;
  std::span<const int32_t> tokens_;
  int64_t nb_ = 0;
  std::vector<Vec<T>> cos_, sin_;
  std::vector<size_t> layer_rope_;
  std::vector<Vec<T>> inputs_;
  Vec<T> x_;                          // the recipe's residual stream
  LayerActivations<T>* act_ = nullptr;  // where the recipe's calls record
  Vec<T> scratch_;
  std::map<const Weight*, Vec<T>> converted_;
};

}  // namespace

namespace {
std::atomic<DeviceGradientFn> g_cuda_gradients{nullptr};
}  // namespace

void register_cuda_gradients(DeviceGradientFn fn) { g_cuda_gradients.store(fn); }
bool cuda_gradients_registered() { return g_cuda_gradients.load() != nullptr; }

const char* device_name(Device d) { return d == Device::Cuda ? "cuda" : "cpu"; }

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::Cpu;
  if (name == "cuda") return Device::Cuda;
  throw Error("--device must be cpu or cuda, got '" + name + "'");
}

void check_gradient_inputs(const ModelConfig& cfg, std::span<const int32_t> tokens, std::span<const Target> targets,
                           const GradientOptions& options) {
  check_backward_supported(cfg);
  const int64_t S = static_cast<int64_t>(tokens.size());
  check(S > 0, "attention gradients: empty token sequence");
  check(!targets.empty(), "attention gradients: no target tokens (the loss needs at least one)");
  check(options.block >= 1, "attention gradients: block must be >= 1, got " + std::to_string(options.block));
  for (size_t i = 0; i < tokens.size(); ++i)
    check(tokens[i] >= 0 && tokens[i] < cfg.vocab_size,
          "attention gradients: token " + std::to_string(i) + " has id " + std::to_string(tokens[i]) +
              ", outside the vocabulary of " + std::to_string(cfg.vocab_size));
  for (const Target& t : targets) {
    check(t.position >= 0 && t.position < S,
          "attention gradients: target position " + std::to_string(t.position) + " outside the sequence of " +
              std::to_string(S) + " tokens");
    check(t.token >= 0 && t.token < cfg.vocab_size,
          "attention gradients: target token id " + std::to_string(t.token) + " outside the vocabulary of " +
              std::to_string(cfg.vocab_size));
  }
  check(!options.gate || options.loss_only, "attention gradients: an attention gate needs loss_only");
  if (options.device == Device::Cuda)
    check(options.precision == Precision::F32,
          "attention gradients: the CUDA path runs in f32 only (f64 is the CPU's, for finite-difference checks)");
  else
    check(!options.tf32, "attention gradients: tf32 applies to the CUDA path only");
}

GradientResult attention_gradients(const Model& model, std::span<const int32_t> tokens,
                                   std::span<const Target> targets, const GradientOptions& options,
                                   ThreadPool& pool) {
  const ModelConfig& cfg = model.config();
  check_gradient_inputs(cfg, tokens, targets, options);
  if (options.device == Device::Cuda) {
    const DeviceGradientFn fn = g_cuda_gradients.load();
    check(fn != nullptr,
          "attention gradients: this tessera has no CUDA reverse mode (built without the CUDA toolkit, or "
          "src/plan/cuda not linked); use the CPU (--device cpu)");
    return fn(model, tokens, targets, options);
  }
  const int64_t S = static_cast<int64_t>(tokens.size());
  const double elem = options.precision == Precision::F64 ? 8.0 : 4.0;
  const double s = static_cast<double>(S);
  const double qd = static_cast<double>(cfg.num_q_heads) * cfg.head_dim;
  const double kd = static_cast<double>(cfg.num_kv_heads) * cfg.head_dim;
  const double nb = std::ceil(s / options.block);
  const double bytes = elem * s * (static_cast<double>(cfg.num_layers + 8) * cfg.hidden_size + 4 * qd + 6 * kd +
                                   4.0 * cfg.intermediate_size) +
                       elem * pool.size() * (2 * s * kd + 2 * 64.0 * s) +
                       (options.loss_only ? 0.0 : 24.0 * cfg.num_layers * cfg.num_q_heads * nb * nb);
  check_host_allocation("attention gradients of " + std::to_string(S) + " tokens (" + cfg.name + ")", bytes,
                        "use shorter calibration samples");
  if (options.precision == Precision::F64) return Backprop<double>(model, tokens, options, pool).run(targets);
  return Backprop<float>(model, tokens, options, pool).run(targets);
}

}  // namespace tessera::plan
