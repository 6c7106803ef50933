// qmatmul_bench: matrix products over weights kept as stored (model/qmatmul) against the f32 expansion that the
// runtime multiplies today (OpenBLAS sgemv / sgemm on the dequantized matrix, same thread count).
//
//   qmatmul_bench [--quick] [--decode-only | --prefill-only] [--threads 1,2] [--shape SUBSTRING] [--no-scalar]
//                 [--act int8|int8x2|int8outliers] [--outliers P] [--cpu-time]
//
// --act int8x2 runs the quantized types on two-level int8 activations (model::QAct::Int8x2; default int8),
// int8outliers on one level plus the second level on the outlier blocks (model::QAct::Int8Outliers). --outliers P
// gives each 32-element chunk of each x row, with probability P, one element set to +-10 (1 + |x|) (the real models'
// activations have such outliers: ~8-10% of their blocks are picked by Int8Outliers); the share of blocks that
// Int8Outliers picks is printed per shape (for 32- and 256-element activation blocks).
// Decode: y = W x (m = 1), memory bound. Each timed call reads a different copy of the matrix, with at least
// 256 MiB of copies in rotation, so the weights come from DRAM as they do in a forward pass (a model's layers do
// not fit in L3); GB/s = stored bytes of W / time. Prefill: m = 512, GFLOP/s = 2 m rows cols / time. Times are
// medians over the calls; the machine may be shared (the load average is printed before and after).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "model/qmatmul.h"
#include "model/quant.h"

#if defined(TESSERA_BENCH_OPENBLAS)
#include <cblas.h>
#endif

using namespace tessera;
using namespace tessera::model;

namespace {

struct Shape {
  const char* name;
  int64_t rows, cols;
};

const Shape kDecodeShapes[] = {
    {"smol.attn_q", 576, 576},     {"smol.ffn_up", 1536, 576},   {"smol.ffn_down", 576, 1536},
    {"smol.lm_head", 49152, 576},  {"8b.ffn_up", 14336, 4096},   {"8b.ffn_down", 4096, 14336},
};
const Shape kPrefillShapes[] = {
    {"smol.ffn_up", 1536, 576},
    {"smol.ffn_down", 576, 1536},
    {"8b.ffn_up", 14336, 4096},
};
const TensorType kTypes[] = {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1,
                             TensorType::Q8_0, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K,
                             TensorType::BF16, TensorType::F16,  TensorType::F32};

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string s;
  std::getline(f, s);
  return s;
}

void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v).bits;
  std::memcpy(p, &h, 2);
}

// Random rows of `type` (speed does not depend on the values; the scales are kept finite and small).
std::vector<uint8_t> random_matrix(TensorType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t bytes = tensor_type_bytes(type, cols) * static_cast<size_t>(rows);
  std::vector<uint8_t> w(bytes);
  if (type == TensorType::F32 || type == TensorType::F16 || type == TensorType::BF16) {
    std::normal_distribution<float> nd(0.0f, 0.05f);
    std::vector<float> row(static_cast<size_t>(cols));
    const size_t rb = tensor_type_bytes(type, cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = nd(rng);
      quantize_row(type, row.data(), cols, w.data() + static_cast<size_t>(r) * rb);
    }
    return w;
  }
  uint32_t state = static_cast<uint32_t>(rng());
  for (auto& b : w) {
    state = state * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(state >> 24);
  }
  const size_t bb = tensor_type_block_bytes(type);
  for (size_t off = 0; off < bytes; off += bb) {
    uint8_t* b = w.data() + off;
    if (type == TensorType::Q6_K) {
      put_f16(b + 208, 0.001f);
    } else {
      put_f16(b, 0.002f);
      if (type != TensorType::Q4_0 && type != TensorType::Q5_0 && type != TensorType::Q8_0) put_f16(b + 2, 0.001f);
    }
  }
  return w;
}

// Median seconds per call of fn(i) over at least min_calls calls and min_seconds.
// --cpu-time: the process's CPU seconds per call instead (on a shared machine, the time waited for a core is left
// out; with several threads it is their sum).
bool g_cpu_time = false;
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median_seconds(const std::function<void(int)>& fn, int min_calls, double min_seconds) {
  using clock = std::chrono::steady_clock;
  fn(0);  // warm-up
  std::vector<double> t;
  const auto start = clock::now();
  for (int i = 1;; ++i) {
    const auto a = clock::now();
    const double c = g_cpu_time ? cpu_seconds() : 0.0;
    fn(i);
    t.push_back(g_cpu_time ? cpu_seconds() - c : std::chrono::duration<double>(clock::now() - a).count());
    if (static_cast<int>(t.size()) >= min_calls && std::chrono::duration<double>(clock::now() - start).count() >= min_seconds)
      break;
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void add_outliers(std::vector<float>& x, double p, std::mt19937& rng) {
  if (p <= 0) return;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int> at(0, 31);
  for (size_t c = 0; c + 32 <= x.size(); c += 32)
    if (u(rng) < p) {
      float& v = x[c + static_cast<size_t>(at(rng))];
      v = std::copysign(10.0f * (1.0f + std::fabs(v)), v);
    }
}

// The share of activation blocks (ab elements) of the m x rows that Int8Outliers gives a second level: scale
// max|x| / 127 above kOutlierRatio x the row's median scale.
double picked_share(const std::vector<float>& x, int64_t m, int64_t cols, int64_t ab) {
  const int64_t nb = cols / ab;
  if (nb == 0) return 0;
  int64_t picked = 0;
  std::vector<float> d(static_cast<size_t>(nb)), sd;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      float a = 0;
      for (int64_t k = 0; k < ab; ++k) a = std::max(a, std::fabs(x[static_cast<size_t>(i * cols + b * ab + k)]));
      d[static_cast<size_t>(b)] = a / 127.0f;
    }
    sd = d;
    std::nth_element(sd.begin(), sd.begin() + nb / 2, sd.end());
    for (const float v : d) picked += v > kOutlierRatio * sd[static_cast<size_t>(nb / 2)] ? 1 : 0;
  }
  return static_cast<double>(picked) / static_cast<double>(m * nb);
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != 0;) {
    v.push_back(std::atoi(p));
    while (*p != 0 && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

#if defined(TESSERA_BENCH_OPENBLAS)
void blas_threads(int t) {
  openblas_set_num_threads(t);
}
#else
void blas_threads(int) {}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, decode = true, prefill = true, scalar = true;
  std::vector<int> threads = {1, 2};
  std::string shape_filter;
  QAct act = QAct::Int8;
  double outliers = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--decode-only") prefill = false;
    else if (a == "--prefill-only") decode = false;
    else if (a == "--threads" && i + 1 < argc) threads = parse_list(argv[++i]);
    else if (a == "--shape" && i + 1 < argc) shape_filter = argv[++i];
    else if (a == "--no-scalar") scalar = false;
    else if (a == "--act" && i + 1 < argc && std::string(argv[i + 1]) == "int8") act = QAct::Int8, ++i;
    else if (a == "--act" && i + 1 < argc && std::string(argv[i + 1]) == "int8x2") act = QAct::Int8x2, ++i;
    else if (a == "--act" && i + 1 < argc && std::string(argv[i + 1]) == "int8outliers") act = QAct::Int8Outliers, ++i;
    else if (a == "--outliers" && i + 1 < argc) outliers = std::atof(argv[++i]);
    else if (a == "--cpu-time") g_cpu_time = true;
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--decode-only | --prefill-only] [--threads 1,2] [--shape S] [--no-scalar] "
                   "[--act int8|int8x2|int8outliers] [--outliers P] [--cpu-time]\n", argv[0]);
      return 2;
    }
  }
  const double min_s = quick ? 0.05 : 0.25;
  std::vector<QIsa> isas;
  for (const QIsa isa : {QIsa::Scalar, QIsa::Avx2, QIsa::Avx512})
    if (qmatmul_isa_available(isa) && (scalar || isa != QIsa::Scalar)) isas.push_back(isa);
  std::printf("# qmatmul_bench: best path %s; activations %s; outliers %g; load average before: %s\n",
              std::string(qmatmul_isa_name(qmatmul_best_isa())).c_str(),
              act == QAct::Int8x2 ? "int8x2" : act == QAct::Int8Outliers ? "int8outliers" : "int8", outliers,
              loadavg().c_str());
#if !defined(TESSERA_BENCH_OPENBLAS)
  std::printf("# (no OpenBLAS: the f32 baseline is qmatmul's own F32 kernel)\n");
#endif
  std::mt19937 rng(42);
  constexpr size_t kRotation = size_t{256} << 20;

  // The f32 baseline: y = W x on the dequantized matrix (OpenBLAS, or qmatmul's F32 kernel without it).
  auto f32_product = [&](const float* w, int64_t rows, int64_t cols, const float* x, int64_t m, float* y,
                         ThreadPool* pool) {
#if defined(TESSERA_BENCH_OPENBLAS)
    (void)pool;
    if (m == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(rows), static_cast<blasint>(cols), 1.0f, w,
                  static_cast<blasint>(cols), x, 1, 0.0f, y, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(rows),
                  static_cast<blasint>(cols), 1.0f, x, static_cast<blasint>(cols), w, static_cast<blasint>(cols),
                  0.0f, y, static_cast<blasint>(rows));
    }
#else
    qmatmul(QMatrix{reinterpret_cast<const uint8_t*>(w), rows, cols, TensorType::F32}, x, m, y, pool);
#endif
  };

  if (decode) {
    std::printf("\n## decode: y = W x (m = 1), weights from DRAM (>= 256 MiB of copies in rotation)\n\n");
    std::printf("| shape | type | path | threads | us | GB/s | f32 sgemv us | f32 GB/s | speedup |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& s : kDecodeShapes) {
      if (!shape_filter.empty() && std::string(s.name).find(shape_filter) == std::string::npos) continue;
      std::vector<float> x(static_cast<size_t>(s.cols)), y(static_cast<size_t>(s.rows));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (auto& v : x) v = nd(rng);
      add_outliers(x, outliers, rng);
      std::printf("| %s: picked blocks %.1f%% (32), %.1f%% (256) |\n", s.name, 100 * picked_share(x, 1, s.cols, 32),
                  100 * picked_share(x, 1, s.cols, 256));
      // f32 baseline copies
      const size_t f32_bytes = static_cast<size_t>(s.rows * s.cols) * 4;
      const size_t f32_copies = std::clamp<size_t>(kRotation / f32_bytes + 1, 1, 64);
      std::vector<std::vector<float>> wf(f32_copies);
      {
        const auto base = random_matrix(TensorType::F32, s.rows, s.cols, rng);
        for (auto& c : wf) {
          c.resize(static_cast<size_t>(s.rows * s.cols));
          std::memcpy(c.data(), base.data(), f32_bytes);
        }
      }
      std::vector<double> f32_us(threads.size());
      for (size_t ti = 0; ti < threads.size(); ++ti) {
        blas_threads(threads[ti]);
        ThreadPool pool(threads[ti]);
        ThreadPool* p = threads[ti] > 1 ? &pool : nullptr;
        f32_us[ti] = 1e6 * median_seconds(
                               [&](int i) {
                                 f32_product(wf[static_cast<size_t>(i) % f32_copies].data(), s.rows, s.cols, x.data(),
                                             1, y.data(), p);
                               },
                               5, min_s);
      }
      wf.clear();
      for (const TensorType t : kTypes) {
        if (s.cols % static_cast<int64_t>(tensor_type_block_size(t)) != 0) {
          std::printf("| %s %lldx%lld | %s | - | - | n/a (cols %% %zu != 0) | | | | |\n", s.name,
                      static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                      std::string(tensor_type_name(t)).c_str(), tensor_type_block_size(t));
          continue;
        }
        const size_t bytes = tensor_type_bytes(t, s.cols) * static_cast<size_t>(s.rows);
        const size_t copies = std::clamp<size_t>(kRotation / bytes + 1, 1, 256);
        std::vector<std::vector<uint8_t>> w(copies);
        w[0] = random_matrix(t, s.rows, s.cols, rng);
        for (size_t c = 1; c < copies; ++c) w[c] = w[0];
        for (const QIsa isa : isas) {
          for (size_t ti = 0; ti < threads.size(); ++ti) {
            ThreadPool pool(threads[ti]);
            ThreadPool* p = threads[ti] > 1 ? &pool : nullptr;
            const double us = 1e6 * median_seconds(
                                        [&](int i) {
                                          const QMatrix m{w[static_cast<size_t>(i) % copies].data(), s.rows, s.cols, t, act};
                                          qmatmul(m, x.data(), 1, y.data(), p, isa);
                                        },
                                        5, min_s);
            std::printf("| %s %lldx%lld | %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.2fx |\n", s.name,
                        static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                        std::string(tensor_type_name(t)).c_str(), std::string(qmatmul_isa_name(isa)).c_str(),
                        threads[ti], us, static_cast<double>(bytes) / us * 1e-3, f32_us[ti],
                        static_cast<double>(f32_bytes) / f32_us[ti] * 1e-3, f32_us[ti] / us);
            std::fflush(stdout);
          }
        }
      }
    }
  }

  if (prefill) {
    constexpr int64_t m = 512;
    std::printf("\n## prefill: Y = X W^T, m = %lld rows of x\n\n", static_cast<long long>(m));
    std::printf("| shape | type | path | threads | ms | GFLOP/s | f32 sgemm ms | f32 GFLOP/s | speedup |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& s : kPrefillShapes) {
      if (!shape_filter.empty() && std::string(s.name).find(shape_filter) == std::string::npos) continue;
      std::vector<float> x(static_cast<size_t>(m * s.cols)), y(static_cast<size_t>(m * s.rows));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (auto& v : x) v = nd(rng);
      add_outliers(x, outliers, rng);
      std::printf("| %s: picked blocks %.1f%% (32), %.1f%% (256) |\n", s.name, 100 * picked_share(x, m, s.cols, 32),
                  100 * picked_share(x, m, s.cols, 256));
      const double flop = 2.0 * static_cast<double>(m) * static_cast<double>(s.rows) * static_cast<double>(s.cols);
      const bool big = s.rows * s.cols > 4'000'000;
      std::vector<float> wf(static_cast<size_t>(s.rows * s.cols));
      {
        const auto base = random_matrix(TensorType::F32, s.rows, s.cols, rng);
        std::memcpy(wf.data(), base.data(), wf.size() * 4);
      }
      std::vector<double> f32_ms(threads.size());
      for (size_t ti = 0; ti < threads.size(); ++ti) {
        blas_threads(threads[ti]);
        ThreadPool pool(threads[ti]);
        ThreadPool* p = threads[ti] > 1 ? &pool : nullptr;
        f32_ms[ti] = 1e3 * median_seconds([&](int) { f32_product(wf.data(), s.rows, s.cols, x.data(), m, y.data(), p); },
                                          big ? 2 : 3, quick ? 0.0 : min_s);
      }
      for (const TensorType t : kTypes) {
        if (s.cols % static_cast<int64_t>(tensor_type_block_size(t)) != 0) {
          std::printf("| %s %lldx%lld | %s | - | - | n/a (cols %% %zu != 0) | | | | |\n", s.name,
                      static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                      std::string(tensor_type_name(t)).c_str(), tensor_type_block_size(t));
          continue;
        }
        const auto w = random_matrix(t, s.rows, s.cols, rng);
        const QMatrix mat{w.data(), s.rows, s.cols, t, act};
        for (const QIsa isa : isas) {
          if (isa == QIsa::Scalar && big) continue;  // minutes per call
          for (size_t ti = 0; ti < threads.size(); ++ti) {
            ThreadPool pool(threads[ti]);
            ThreadPool* p = threads[ti] > 1 ? &pool : nullptr;
            const double ms = 1e3 * median_seconds([&](int) { qmatmul(mat, x.data(), m, y.data(), p, isa); },
                                                   big ? 2 : 3, quick ? 0.0 : min_s);
            std::printf("| %s %lldx%lld | %s | %s | %d | %.2f | %.1f | %.2f | %.1f | %.2fx |\n", s.name,
                        static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                        std::string(tensor_type_name(t)).c_str(), std::string(qmatmul_isa_name(isa)).c_str(),
                        threads[ti], ms, flop / ms * 1e-6, f32_ms[ti], flop / f32_ms[ti] * 1e-6, f32_ms[ti] / ms);
            std::fflush(stdout);
          }
        }
      }
    }
  }
  std::printf("\n# load average after: %s\n", loadavg().c_str());
  return 0;
}
