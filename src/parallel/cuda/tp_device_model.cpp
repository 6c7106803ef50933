#include "parallel/cuda/tp_device_model.h"

#include <cmath>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "runtime/cuda/kernels.h"

namespace tessera::parallel {

using runtime::ModelConfig;
using runtime::Weight;

bf16* TpDeviceModel::bf16_buffer(int64_t count) {
  if (count <= 0) return nullptr;
  bf16_.emplace_back(static_cast<size_t>(count));
  bytes_ += bf16_.back().bytes();
  return bf16_.back().data();
}

float* TpDeviceModel::f32_buffer(int64_t count) {
  if (count <= 0) return nullptr;
  f32_.emplace_back(static_cast<size_t>(count));
  bytes_ += f32_.back().bytes();
  return f32_.back().data();
}

namespace {

// Rows [r0, r1) of a [rows, cols] matrix in any kept type, dequantized and rounded to bf16 on the host.
std::vector<bf16> rows_bf16(const Weight& w, int64_t r0, int64_t r1) {
  std::vector<float> f(static_cast<size_t>((r1 - r0) * w.cols));
  w.rows_f32(r0, r1 - r0, f.data());
  std::vector<bf16> out(f.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = f32_to_bf16(f[i]);
  return out;
}

std::vector<bf16> cols_bf16(const Weight& w, int64_t c0, int64_t c1) {
  std::vector<bf16> out(static_cast<size_t>(w.rows * (c1 - c0)));
  std::vector<float> row(static_cast<size_t>(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    w.rows_f32(r, 1, row.data());
    for (int64_t c = c0; c < c1; ++c) out[static_cast<size_t>(r * (c1 - c0) + c - c0)] = f32_to_bf16(row[static_cast<size_t>(c)]);
  }
  return out;
}

// Held group gi of a layer, its weights not yet set: the global group and the rank's local heads of it.
TpGroupWeights group_of(const RankLayer& rl, size_t gi) {
  TpGroupWeights g;
  g.group = rl.groups[gi];
  g.first_head = rl.group_heads[gi].first;
  g.heads = rl.group_heads[gi].second - rl.group_heads[gi].first;
  return g;
}

}  // namespace

std::unique_ptr<TpDeviceModel> TpDeviceModel::upload(const runtime::Model& model, const RankPlan& plan) {
  return upload(model.config(), model.weights(), plan);
}

std::unique_ptr<TpDeviceModel> TpDeviceModel::upload(const ModelConfig& c, const runtime::ModelWeights& w,
                                                     const RankPlan& plan) {
  std::unique_ptr<TpDeviceModel> m(new TpDeviceModel());
  m->config_ = c;
  m->plan_ = plan;
  m->rope_freq_factors_ = w.rope_freq_factors;
  const int64_t H = c.hidden_size, D = c.head_dim;
  auto put_bf16 = [&](const std::vector<bf16>& host) -> const bf16* {
    bf16* p = m->bf16_buffer(static_cast<int64_t>(host.size()));
    if (p != nullptr)
      TESSERA_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    return p;
  };
  auto put_f32 = [&](const float* host, int64_t count) -> const float* {
    if (host == nullptr || count <= 0) return nullptr;
    float* p = m->f32_buffer(count);
    TESSERA_CUDA_CHECK(
        cudaMemcpy(p, host, static_cast<size_t>(count) * sizeof(float), cudaMemcpyHostToDevice));
    return p;
  };
  auto vec = [&](const Weight& x) { return x.empty() ? nullptr : put_f32(x.ptr(), x.rows * x.cols); };
  m->embedding_ = put_bf16(rows_bf16(w.embedding, 0, w.embedding.rows));
  m->output_ = w.lm_head.empty() ? m->embedding_ : put_bf16(rows_bf16(w.lm_head, 0, w.lm_head.rows));
  m->final_norm_ = vec(w.final_norm);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const RankLayer& rl = plan.layers[static_cast<size_t>(l)];
    const runtime::LayerWeights s =
        shard_layer(w.layers[static_cast<size_t>(l)], c, rl, plan.ffn_begin, plan.ffn_end);
    TpLayerWeights L;
    L.attn_norm = vec(s.attn_norm);
    L.ffn_norm = vec(s.ffn_norm);
    L.post_attn_norm = vec(s.post_attn_norm);
    L.post_ffn_norm = vec(s.post_ffn_norm);
    L.q_norm = vec(s.q_norm);
    L.k_norm = vec(s.k_norm);
    L.heads = static_cast<int32_t>(rl.heads.size());
    for (size_t gi = 0; gi < rl.groups.size(); ++gi) {
      TpGroupWeights g = group_of(rl, gi);
      const int64_t h0 = g.first_head * D, h1 = (g.first_head + g.heads) * D;
      g.wq = put_bf16(rows_bf16(s.wq, h0, h1));
      g.wk = put_bf16(rows_bf16(s.wk, static_cast<int64_t>(gi) * D, static_cast<int64_t>(gi + 1) * D));
      g.wv = put_bf16(rows_bf16(s.wv, static_cast<int64_t>(gi) * D, static_cast<int64_t>(gi + 1) * D));
      g.wo = put_bf16(cols_bf16(s.wo, h0, h1));
      if (c.qkv_bias) {
        g.bq = put_f32(s.bq.ptr() + h0, h1 - h0);
        g.bk = put_f32(s.bk.ptr() + static_cast<int64_t>(gi) * D, D);
        g.bv = put_f32(s.bv.ptr() + static_cast<int64_t>(gi) * D, D);
      }
      L.groups.push_back(g);
    }
    L.ffn = plan.ffn_end - plan.ffn_begin;
    std::vector<bf16> gu = rows_bf16(s.w_gate, 0, L.ffn);
    const std::vector<bf16> up = rows_bf16(s.w_up, 0, L.ffn);
    gu.insert(gu.end(), up.begin(), up.end());
    L.w_gate_up = put_bf16(gu);
    L.w_down = put_bf16(rows_bf16(s.w_down, 0, H));
    m->layers_.push_back(std::move(L));
  }
  return m;
}

std::unique_ptr<TpDeviceModel> TpDeviceModel::random(const ModelConfig& c, const RankPlan& plan,
                                                     uint64_t seed) {
  std::unique_ptr<TpDeviceModel> m(new TpDeviceModel());
  m->config_ = c;
  m->plan_ = plan;
  const int64_t H = c.hidden_size, D = c.head_dim, V = c.vocab_size;
  const float scale = 0.02f * std::sqrt(3.0f);  // uniform [-a, a] with standard deviation 0.02
  uint64_t tensor = 0;
  auto matrix = [&](int64_t count) -> const bf16* {
    bf16* p = m->bf16_buffer(count);
    if (p != nullptr)
      runtime::gpu::fill_uniform_bf16(p, count, seed * 0x100000001b3ull + ++tensor, scale, nullptr);
    return p;
  };
  auto vec = [&](int64_t count, float value) -> const float* {
    float* p = m->f32_buffer(count);
    if (p != nullptr) runtime::gpu::fill_f32(p, count, value, nullptr);
    return p;
  };
  m->embedding_ = matrix(V * H);
  m->output_ = c.tied_embeddings ? m->embedding_ : matrix(V * H);
  m->final_norm_ = vec(H, 1.0f);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const RankLayer& rl = plan.layers[static_cast<size_t>(l)];
    TpLayerWeights L;
    L.attn_norm = vec(H, 1.0f);
    L.ffn_norm = vec(H, 1.0f);
    if (c.post_norms) {
      L.post_attn_norm = vec(H, 1.0f);
      L.post_ffn_norm = vec(H, 1.0f);
    }
    if (c.qk_norm) {
      L.q_norm = vec(D, 1.0f);
      L.k_norm = vec(D, 1.0f);
    }
    L.heads = static_cast<int32_t>(rl.heads.size());
    for (size_t gi = 0; gi < rl.groups.size(); ++gi) {
      TpGroupWeights g = group_of(rl, gi);
      g.wq = matrix(g.heads * D * H);
      g.wk = matrix(D * H);
      g.wv = matrix(D * H);
      g.wo = matrix(H * g.heads * D);
      if (c.qkv_bias) {
        g.bq = vec(g.heads * D, 0.0f);
        g.bk = vec(D, 0.0f);
        g.bv = vec(D, 0.0f);
      }
      L.groups.push_back(g);
    }
    L.ffn = plan.ffn_end - plan.ffn_begin;
    L.w_gate_up = matrix(2 * L.ffn * H);
    L.w_down = matrix(H * L.ffn);
    m->layers_.push_back(std::move(L));
  }
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return m;
}

}  // namespace tessera::parallel
