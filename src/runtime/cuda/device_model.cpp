#include "runtime/cuda/device_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "core/error.h"
#include "runtime/cuda/fp8_quant.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/local_attention_init.h"
#include "runtime/cuda/w4_gemv.h"

namespace tessera::runtime::gpu {

bf16* DeviceModel::alloc_bf16(int64_t count) {
  bf16_buffers_.emplace_back(static_cast<size_t>(count));
  bytes_ += static_cast<size_t>(count) * sizeof(bf16);
  return bf16_buffers_.back().data();
}

float* DeviceModel::alloc_f32(int64_t count) {
  f32_buffers_.emplace_back(static_cast<size_t>(count));
  bytes_ += static_cast<size_t>(count) * sizeof(float);
  return f32_buffers_.back().data();
}

void DeviceModel::allocate_layout() {
  const ModelConfig& c = config_;
  check(c.num_layers > 0 && static_cast<int32_t>(c.layers.size()) == c.num_layers && c.hidden_size > 0 &&
            c.head_dim > 0 && c.num_q_heads > 0 && c.num_kv_heads > 0 && c.intermediate_size > 0 && c.vocab_size > 0,
        "device model: incomplete configuration for " + c.name);
  const int64_t H = c.hidden_size, F = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  // Refuse weights that cannot fit before allocating any, with the sizes (norms and biases, a few MB, aside).
  const double need = 2.0 * (static_cast<double>(V * H) * (c.tied_embeddings ? 1 : 2) +
                             static_cast<double>(c.num_layers) * static_cast<double>(2 * QD * H + 2 * KD * H + 3 * F * H));
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.2f GB of device memory in bf16, but only %.2f GB of %.1f GB are free", need / 1e9,
                  static_cast<double>(free_bytes) / 1e9, static_cast<double>(total_bytes) / 1e9);
    check(need <= static_cast<double>(free_bytes),
          "device model " + c.name + ": the weights need " + buf + "; free device memory or run on the CPU (--device cpu)");
  } else {
    (void)cudaGetLastError();
  }
  embedding_ = alloc_bf16(V * H);
  output_ = c.tied_embeddings ? embedding_ : alloc_bf16(V * H);
  final_norm_ = alloc_f32(H);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    LayerSlots s{};
    s.attn_norm = alloc_f32(H);
    // Q, K and V projections in one allocation, rows of wq then wk then wv: the batched decode's one QKV GEMM.
    s.wqkv = alloc_bf16((QD + 2 * KD) * H);
    s.wq = s.wqkv;
    s.wk = s.wqkv + QD * H;
    s.wv = s.wqkv + (QD + KD) * H;
    s.wo = alloc_bf16(H * QD);
    if (c.qkv_bias) {
      s.bq = alloc_f32(QD);
      s.bk = alloc_f32(KD);
      s.bv = alloc_f32(KD);
    }
    if (c.qk_norm) {
      s.q_norm = alloc_f32(D);
      s.k_norm = alloc_f32(D);
    }
    if (c.post_norms) {
      s.post_attn_norm = alloc_f32(H);
      s.post_ffn_norm = alloc_f32(H);
    }
    s.ffn_norm = alloc_f32(H);
    s.w_gate_up = alloc_bf16(2 * F * H);
    s.w_down = alloc_bf16(H * F);
    slots_.push_back(s);
    layers_.push_back(std::bit_cast<DeviceLayer>(s));  // the same pointers, read-only
  }
}

namespace {

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = tessera::f32_to_bf16(x[i]);
  return out;
}

// Writes columns of row-major bf16 device matrices from host values, through a device staging buffer.
class ColumnWriter {
 public:
  explicit ColumnWriter(int64_t max_rows) : staging_(static_cast<size_t>(max_rows)) {}
  // Column `col` of [rows, ld] matrix m = values (rows of them).
  void write(bf16* m, int64_t rows, int64_t ld, int64_t col, const std::vector<bf16>& values) {
    check(static_cast<int64_t>(values.size()) == rows && rows <= static_cast<int64_t>(staging_.size()),
          "device model: column of the wrong length");
    TESSERA_CUDA_CHECK(cudaMemcpy(staging_.data(), values.data(), static_cast<size_t>(rows) * sizeof(bf16),
                                  cudaMemcpyHostToDevice));
    write_column_bf16(m, rows, ld, col, staging_.data(), nullptr);
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // the staging buffer is reused by the next column
  }

 private:
  attn::gpu::DeviceBuffer<bf16> staging_;
};

// Host f32 -> device bf16 through a device staging buffer (copy, then round on the device).
class Uploader {
 public:
  Uploader() : staging_(kChunk) {}

  // w in any kept type: dequantized on the host a row range at a time (kChunk floats at most), then copied.
  void bf16_weight(bf16* dst, const Weight& w, int64_t count, const std::string& what) {
    check(w.numel() == count && !w.empty(),
          "device model: " + what + " has " + std::to_string(w.numel()) + " values, expected " + std::to_string(count));
    const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kChunk) / std::max<int64_t>(w.cols, 1));
    std::vector<float> host(static_cast<size_t>(std::min(step, w.rows) * w.cols));
    for (int64_t r = 0; r < w.rows; r += step) {
      const int64_t rows = std::min(step, w.rows - r), n = rows * w.cols;
      w.rows_f32(r, rows, host.data());
      TESSERA_CUDA_CHECK(cudaMemcpy(staging_.data(), host.data(), static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyHostToDevice));
      f32_to_bf16(staging_.data(), n, dst + r * w.cols, nullptr);
    }
  }

  static void f32_weight(float* dst, const Weight& w, int64_t count, const std::string& what) {
    if (dst == nullptr) return;
    check(w.numel() == count && !w.empty(),
          "device model: " + what + " has " + std::to_string(w.numel()) + " values, expected " + std::to_string(count));
    const std::vector<float> host = w.to_f32();
    TESSERA_CUDA_CHECK(
        cudaMemcpy(dst, host.data(), static_cast<size_t>(count) * sizeof(float), cudaMemcpyHostToDevice));
  }

 private:
  static constexpr size_t kChunk = size_t{16} << 20;  // floats (64 MB)
  attn::gpu::DeviceBuffer<float> staging_;
};

}  // namespace

std::unique_ptr<DeviceModel> DeviceModel::upload(const Model& model) { return upload(model.config(), model.weights()); }

std::unique_ptr<DeviceModel> DeviceModel::upload(const ModelConfig& config, const ModelWeights& w) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  m->config_ = config;
  m->rope_freq_factors_ = w.rope_freq_factors;
  m->allocate_layout();
  const ModelConfig& c = m->config_;
  const int64_t H = c.hidden_size, F = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  check(static_cast<int32_t>(w.layers.size()) == c.num_layers, "device model: layer count differs from the config");
  Uploader up;
  up.bf16_weight(m->embedding_, w.embedding, V * H, "embedding");
  if (!c.tied_embeddings) up.bf16_weight(m->output_, w.output(), V * H, "lm_head");
  Uploader::f32_weight(m->final_norm_, w.final_norm, H, "final norm");
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const LayerSlots& s = m->slots_[static_cast<size_t>(l)];
    const std::string p = "layer " + std::to_string(l) + " ";
    Uploader::f32_weight(s.attn_norm, L.attn_norm, H, p + "attn_norm");
    up.bf16_weight(s.wq, L.wq, QD * H, p + "wq");
    up.bf16_weight(s.wk, L.wk, KD * H, p + "wk");
    up.bf16_weight(s.wv, L.wv, KD * H, p + "wv");
    up.bf16_weight(s.wo, L.wo, H * QD, p + "wo");
    Uploader::f32_weight(s.bq, L.bq, QD, p + "bq");
    Uploader::f32_weight(s.bk, L.bk, KD, p + "bk");
    Uploader::f32_weight(s.bv, L.bv, KD, p + "bv");
    Uploader::f32_weight(s.q_norm, L.q_norm, D, p + "q_norm");
    Uploader::f32_weight(s.k_norm, L.k_norm, D, p + "k_norm");
    Uploader::f32_weight(s.post_attn_norm, L.post_attn_norm, H, p + "post_attn_norm");
    Uploader::f32_weight(s.ffn_norm, L.ffn_norm, H, p + "ffn_norm");
    Uploader::f32_weight(s.post_ffn_norm, L.post_ffn_norm, H, p + "post_ffn_norm");
    up.bf16_weight(s.w_gate_up, L.w_gate, F * H, p + "w_gate");
    up.bf16_weight(s.w_gate_up + F * H, L.w_up, F * H, p + "w_up");
    up.bf16_weight(s.w_down, L.w_down, H * F, p + "w_down");
  }
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return m;
}

std::unique_ptr<DeviceModel> DeviceModel::random(const ModelConfig& config, uint64_t seed, RandomInit init) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  m->config_ = config;
  const bool local = init == RandomInit::kLocalAttention;
  if (local) {
    check(config.hidden_size >= 64 && config.head_dim % 2 == 0,
          "device model: local-attention random init needs hidden_size >= 64 and an even head_dim");
    check(!config.qk_norm, "device model: local-attention random init does not support QK-norm (Gemma-3)");
  }
  m->allocate_layout();
  const ModelConfig& c = m->config_;
  const int64_t H = c.hidden_size, F = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  const int64_t QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  const float scale = 0.02f * std::sqrt(3.0f);  // uniform [-a, a] with standard deviation 0.02
  uint64_t tensor = 0;
  auto matrix = [&](bf16* p, int64_t count) {
    fill_uniform_bf16(p, count, seed * 0x100000001b3ull + ++tensor, scale, nullptr);
  };
  auto vec = [&](float* p, int64_t count, float value) {
    if (p != nullptr) fill_f32(p, count, value, nullptr);
  };
  if (local) {  // the token part of the embedding rows (shape_local_attention adds the rest)
    fill_uniform_bf16(m->embedding_, V * H, seed * 0x100000001b3ull + ++tensor,
                      static_cast<float>(local_init::kTokenStd * std::sqrt(3.0)), nullptr);
  } else {
    matrix(m->embedding_, V * H);
  }
  if (!c.tied_embeddings) matrix(m->output_, V * H);
  vec(m->final_norm_, H, 1.0f);
  for (const LayerSlots& s : m->slots_) {
    vec(s.attn_norm, H, 1.0f);
    matrix(s.wq, QD * H);
    matrix(s.wk, KD * H);
    matrix(s.wv, KD * H);
    matrix(s.wo, H * QD);
    vec(s.bq, QD, 0.0f);
    vec(s.bk, KD, 0.0f);
    vec(s.bv, KD, 0.0f);
    vec(s.q_norm, D, 1.0f);
    vec(s.k_norm, D, 1.0f);
    vec(s.post_attn_norm, H, 1.0f);
    vec(s.ffn_norm, H, 1.0f);
    vec(s.post_ffn_norm, H, 1.0f);
    matrix(s.w_gate_up, 2 * F * H);
    matrix(s.w_down, H * F);
  }
  if (local) m->shape_local_attention(seed);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return m;
}

void DeviceModel::shape_local_attention(uint64_t seed) {
  namespace li = local_init;
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t QD = c.num_q_heads * c.head_dim, KD = c.num_kv_heads * c.head_dim;
  const li::Channels ch = li::channels(H);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // the plain fill (default stream) first
  ColumnWriter cw(std::max({V, 2 * F, QD, KD}));
  auto write_column = [&](bf16* m, int64_t rows, int64_t ld, int64_t col, const std::vector<bf16>& values) {
    cw.write(m, rows, ld, col, values);
  };

  // Embedding: every row holds the shared value on the massive channels and 0 on the sink channels; the sink
  // token's row holds only its sink channels (same value).
  const bf16 massive = tessera::f32_to_bf16(static_cast<float>(li::massive_value(H)));
  for (int64_t j : ch.massive) write_column(embedding_, V, H, j, std::vector<bf16>(static_cast<size_t>(V), massive));
  for (int64_t j : ch.sink) write_column(embedding_, V, H, j, std::vector<bf16>(static_cast<size_t>(V), bf16{}));
  bf16* sink_row = embedding_ + static_cast<int64_t>(kSinkToken) * H;
  TESSERA_CUDA_CHECK(cudaMemset(sink_row, 0, static_cast<size_t>(H) * sizeof(bf16)));
  for (int64_t j : ch.sink) TESSERA_CUDA_CHECK(cudaMemcpy(sink_row + j, &massive, sizeof(bf16), cudaMemcpyHostToDevice));

  const std::vector<bf16> zeros_kd(static_cast<size_t>(KD)), zeros_qd(static_cast<size_t>(QD)),
      zeros_2f(static_cast<size_t>(2 * F));
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LayerSlots& s = slots_[static_cast<size_t>(l)];
    // Layers read the special channels only in Q and K, and write them nowhere.
    for (int64_t j : ch.all()) {
      write_column(s.wv, KD, H, j, zeros_kd);
      write_column(s.w_gate_up, 2 * F, H, j, zeros_2f);
      TESSERA_CUDA_CHECK(cudaMemset(s.wo + j * QD, 0, static_cast<size_t>(QD) * sizeof(bf16)));
      TESSERA_CUDA_CHECK(cudaMemset(s.w_down + j * F, 0, static_cast<size_t>(F) * sizeof(bf16)));
    }
    const li::LayerColumns cols = li::layer_columns(c, l, seed);
    const std::vector<bf16> qm = to_bf16(cols.q_massive), km = to_bf16(cols.k_massive), kz = to_bf16(cols.k_sink);
    for (int64_t j : ch.massive) {
      write_column(s.wq, QD, H, j, qm);
      write_column(s.wk, KD, H, j, km);
    }
    for (int64_t j : ch.sink) {
      write_column(s.wq, QD, H, j, zeros_qd);
      write_column(s.wk, KD, H, j, kz);
    }
  }
}

namespace {

// Layer L's output projection and MLP matrices into a quantized copy q (Fp8Layer, W4Layer) through add(w, rows, cols).
template <class Layer, class Add>
void add_o_and_mlp(Layer& q, const DeviceLayer& L, int64_t H, int64_t QD, int64_t F, Add&& add) {
  q.wo = add(L.wo, H, QD);
  q.w_gate_up = add(L.w_gate_up, 2 * F, H);
  q.w_down = add(L.w_down, H, F);
}

}  // namespace

Fp8Matrix DeviceFp8Weights::add(const bf16* w, int64_t rows, int64_t cols, cudaStream_t stream) {
  codes_.emplace_back(static_cast<size_t>(rows * cols));
  bytes_ += static_cast<size_t>(rows * cols);
  float* work = scales_.data() + next_scale_;
  if (scaling_ == Fp8Scaling::kRow) {
    next_scale_ += static_cast<size_t>((rows + 3) / 4 * 4);
    quantize_e4m3_rows(w, cols, rows, cols, codes_.back().data(), work, stream);
    return Fp8Matrix{codes_.back().data(), work, rows, cols, Fp8Scaling::kRow};
  }
  next_scale_ += kFp8WorkFloats;
  quantize_e4m3(w, cols, rows, cols, codes_.back().data(), work, stream);
  return Fp8Matrix{codes_.back().data(), work + kFp8ScaleOffset, rows, cols, Fp8Scaling::kTensor};
}

std::unique_ptr<DeviceFp8Weights> DeviceFp8Weights::quantize(const DeviceModel& model, cudaStream_t stream,
                                                             Fp8Scaling scaling) {
  check_gemm_precision_supported(GemmPrecision::kFp8);
  const ModelConfig& c = model.config();
  const int64_t H = c.hidden_size, F = c.intermediate_size, D = c.head_dim;
  const int64_t QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  // Rows of the six matrices (each rounded up to 4 for the per-row scales' alignment).
  const int64_t rows[6] = {QD, KD, KD, H, 2 * F, H};
  size_t scale_floats = 0;
  for (int64_t r : rows)
    scale_floats += scaling == Fp8Scaling::kRow ? static_cast<size_t>((r + 3) / 4 * 4) : size_t{kFp8WorkFloats};
  scale_floats *= static_cast<size_t>(c.num_layers);
  const double need = static_cast<double>(c.num_layers) * static_cast<double>(2 * QD * H + 2 * KD * H + 3 * F * H) +
                      static_cast<double>(scale_floats * sizeof(float));
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.2f GB of device memory in FP8, but only %.2f GB of %.1f GB are free", need / 1e9,
                  static_cast<double>(free_bytes) / 1e9, static_cast<double>(total_bytes) / 1e9);
    check(need <= static_cast<double>(free_bytes), "FP8 weights of " + c.name + ": the layers need " + buf);
  } else {
    (void)cudaGetLastError();
  }
  std::unique_ptr<DeviceFp8Weights> out(new DeviceFp8Weights());
  out->scaling_ = scaling;
  out->scales_ = attn::gpu::DeviceBuffer<float>(scale_floats);
  out->bytes_ += out->scales_.size() * sizeof(float);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& L = model.layer(l);
    Fp8Layer f;
    f.wq = out->add(L.wq, QD, H, stream);
    f.wk = out->add(L.wk, KD, H, stream);
    f.wv = out->add(L.wv, KD, H, stream);
    add_o_and_mlp(f, L, H, QD, F, [&](const bf16* w, int64_t r, int64_t k) { return out->add(w, r, k, stream); });
    out->layers_.push_back(f);
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

W4Matrix DeviceW4Weights::add(const bf16* w, int64_t rows, int64_t cols, cudaStream_t stream) {
  codes_.emplace_back(static_cast<size_t>(rows * cols / 2));
  params_.emplace_back(static_cast<size_t>(rows * (cols / kW4Group)));
  bytes_ += codes_.back().bytes() + params_.back().bytes();
  quantize_w4(w, cols, rows, cols, codes_.back().data(), params_.back().data(), stream);
  const W4Matrix q{codes_.back().data(), params_.back().data(), rows, cols};
  by_weight_[{w, rows}] = q;
  return q;
}

const W4Matrix* DeviceW4Weights::find(const bf16* w, int64_t rows) const {
  const auto it = by_weight_.find({w, rows});
  return it == by_weight_.end() ? nullptr : &it->second;
}

std::unique_ptr<DeviceW4Weights> DeviceW4Weights::quantize(const DeviceModel& model, cudaStream_t stream) {
  const ModelConfig& c = model.config();
  const int64_t H = c.hidden_size, F = c.intermediate_size, D = c.head_dim;
  const int64_t QD = c.num_q_heads * D, KD = c.num_kv_heads * D;
  check(H % kW4Group == 0 && QD % kW4Group == 0 && F % kW4Group == 0,
        "4-bit weights of " + c.name + ": the layers' inputs (hidden " + std::to_string(H) + ", q " +
            std::to_string(QD) + ", ffn " + std::to_string(F) + ") must be multiples of " + std::to_string(kW4Group));
  const double elements = static_cast<double>(c.num_layers) * static_cast<double>(2 * QD * H + 2 * KD * H + 3 * F * H);
  const double need = elements / 2 + elements / static_cast<double>(kW4Group) * 4;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.2f GB of device memory in 4 bits, but only %.2f GB of %.1f GB are free",
                  need / 1e9, static_cast<double>(free_bytes) / 1e9, static_cast<double>(total_bytes) / 1e9);
    check(need <= static_cast<double>(free_bytes), "4-bit weights of " + c.name + ": the layers need " + buf);
  } else {
    (void)cudaGetLastError();
  }
  std::unique_ptr<DeviceW4Weights> out(new DeviceW4Weights());
  const auto rows_of = [](const W4Matrix& m, int64_t r0, int64_t rows) {
    return W4Matrix{m.codes + r0 * (m.cols / 2), m.params + r0 * (m.cols / kW4Group), rows, m.cols};
  };
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& L = model.layer(l);
    W4Layer q;
    q.wqkv = out->add(L.wqkv, QD + 2 * KD, H, stream);
    q.wq = rows_of(q.wqkv, 0, QD);
    q.wk = rows_of(q.wqkv, QD, KD);
    q.wv = rows_of(q.wqkv, QD + KD, KD);
    out->by_weight_[{L.wq, QD}] = q.wq;
    out->by_weight_[{L.wk, KD}] = q.wk;
    out->by_weight_[{L.wv, KD}] = q.wv;
    add_o_and_mlp(q, L, H, QD, F, [&](const bf16* w, int64_t r, int64_t k) { return out->add(w, r, k, stream); });
    out->layers_.push_back(q);
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace tessera::runtime::gpu
