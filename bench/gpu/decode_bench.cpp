// decode_bench — batched decode on the GPU over the paged KV cache (runtime/cuda/batch_gpu.h): step time against
// the bandwidth floor, and throughput of dense KV against MoA per-head KV under one memory budget.
//
//   decode_bench [--model llama3-8b] [--ctx 8192,32768,131072] [--batch 1,8,32,64] [--kv-gb 40] [--steps 20]
//                [--moa-density 0.5] [--moa-plan FILE] [--block 64] [--layers N] [--csv FILE] [--no-graphs]
//                [--gemm bf16,fp8,w4] [--kv bf16,fp8] [--breakdown]
//
// Weights are pseudo-random (DeviceModel::random) of the model's shapes; every sequence's KV is pseudo-random
// bf16 (no prefill: the benchmark is the decode step), laid out in blocks exactly as a prefill would leave it.
// Per (context, policy, batch): B sequences of `ctx` tokens decode `steps` tokens each (after 3 warm-up steps);
// the step time is wall time from the token ids on the host to the B rows of logits on the host. The floor is
// (weight bytes + KV bytes the step reads) / the device's measured copy bandwidth (cudaMemcpy device to device,
// read + write bytes over time). "moa" is a uniform MoA plan, span = density x N and a sink of 64, so the KV
// held and read is about density x dense. --moa-plan adds "moa-plan": a MoA alpha/beta file (MoA's own format,
// e.g. its published Llama-3-8B-Instruct-262k plan), whose KV per kv head is the widest span of the head's group.
// A batch whose sequences do not fit the KV budget is reported as such. --gemm: the layers' GEMMs in each precision
// given, one after the other in the same table (fp8: GpuBatchOptions::gemm, weights quantized once, E4M3; the floor
// then counts the FP8 copy of the layers' weights instead of their bf16 bytes, the LM head staying bf16; w4: the decode
// step's products of up to 8 rows read a 4-bit copy of the layers' weights (4.25 bits a weight, w4_gemv.h), which the
// floor of batches of up to 8 counts instead of their bf16 bytes; larger batches read the bf16 weights). --kv: the KV
// blocks' element type, each given (every --gemm x --kv combination in one table): bf16, or fp8 (E4M3 codes and a
// scale per stored row, paged_decode.h; the pools filled with pseudo-random codes); the floor counts the KV bytes a step
// reads at that precision (head_dim + 4 bytes a row for FP8) and the KV budget holds blocks of that precision.
// --breakdown (implies --no-graphs: CUDA events time only eager steps): after each row, the step's GPU time by part
// (GEMMs, attention, the small kernels) beside each part's own floor (the weights' bytes, the KV bytes read, over the
// copy bandwidth), and what is left of the step's wall time (launches and host work of an eager step).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "runtime/batch_engine.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/synthetic_config.h"
#include "runtime/cuda/w4_gemv.h"

using namespace tessera;
using namespace tessera::runtime;

namespace {

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

double copy_bandwidth() {
  const size_t bytes = size_t{2} << 30;
  attn::gpu::DeviceBuffer<char> a(bytes), b(bytes);
  TESSERA_CUDA_CHECK(cudaMemset(a.data(), 1, bytes));
  TESSERA_CUDA_CHECK(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) TESSERA_CUDA_CHECK(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 5.0 * static_cast<double>(bytes) / s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b", csv, moa_plan;
  std::vector<int64_t> ctxs{8192, 32768, 131072}, batches{1, 8, 32, 64};
  double kv_gb = 40, density = 0.5;
  int steps = 20, block = 64, layers = 0;
  bool graphs = true, breakdown = false;
  std::vector<gpu::GemmPrecision> gemms{gpu::GemmPrecision::kBf16};
  std::vector<gpu::KVPrecision> kv_types{gpu::KVPrecision::kBf16};
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        check(i + 1 < argc, a + " needs a value");
        return argv[++i];
      };
      if (a == "--model") model = next();
      else if (a == "--ctx") ctxs = parse_list(next());
      else if (a == "--batch") batches = parse_list(next());
      else if (a == "--kv-gb") kv_gb = std::stod(next());
      else if (a == "--steps") steps = std::stoi(next());
      else if (a == "--moa-density") density = std::stod(next());
      else if (a == "--moa-plan") moa_plan = next();
      else if (a == "--block") block = std::stoi(next());
      else if (a == "--layers") layers = std::stoi(next());
      else if (a == "--csv") csv = next();
      else if (a == "--no-graphs") graphs = false;
      else if (a == "--breakdown") breakdown = true, graphs = false;
      else if (a == "--gemm") {
        gemms.clear();
        std::stringstream list(next());
        for (std::string g; std::getline(list, g, ',');) gemms.push_back(gpu::parse_gemm_precision(g));
      } else if (a == "--kv") {
        kv_types.clear();
        std::stringstream list(next());
        for (std::string k; std::getline(list, k, ',');) kv_types.push_back(gpu::parse_kv_precision(k));
      }
      else throw Error("unknown option " + a + " (see the comment at the top of bench/gpu/decode_bench.cpp)");
    }
    check(density > 0 && density <= 1, "--moa-density must be in (0, 1]");
    ModelConfig cfg = gpu::synthetic_config(model);
    if (layers > 0) {
      cfg.num_layers = layers;
      cfg.layers.resize(static_cast<size_t>(layers));
    }
    int64_t max_ctx = 0, max_batch = 0;
    for (int64_t c : ctxs) max_ctx = std::max(max_ctx, c);
    for (int64_t b : batches) max_batch = std::max(max_batch, b);
    cfg.context_length = std::max<int32_t>(cfg.context_length, static_cast<int32_t>(max_ctx + 64));
    std::printf("device: %s\n", gpu::gpu_description().c_str());
    const double bw = copy_bandwidth();
    std::printf("copy bandwidth (device to device, read + write): %.0f GB/s\n", bw / 1e9);
    const auto dev = gpu::DeviceModel::random(cfg, 1);
    const double bf16_bytes = static_cast<double>(dev->bytes());
    const PagedKVShape shape{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block};
    std::printf("model %s (%d layers, random weights %.2f GB bf16), KV budget %.1f GB in blocks of %d tokens, CUDA graphs %s\n\n",
                model.c_str(), cfg.num_layers, bf16_bytes / 1e9, kv_gb, block, graphs ? "on" : "off");
    std::printf("| GEMM | KV type | context | KV | batch | step ms | tokens/s | KV read GB/step | floor ms | step / floor | splits |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::ofstream out;
    if (!csv.empty()) {
      out.open(csv);
      out << "context,kv,batch,step_ms,tokens_per_s,kv_read_gb,floor_ms,ratio,splits,gemm,kv_type\n";
    }
    for (const gpu::GemmPrecision gemm : gemms)
    for (const gpu::KVPrecision kv_type : kv_types) {
      const char* gemm_name = gpu::gemm_precision_name(gemm);
      const char* kv_name = gpu::kv_precision_name(kv_type);
      gpu::GpuBatchOptions bo;
      bo.graphs = graphs;
      bo.timing = breakdown;
      bo.gemm = gemm;
      bo.decode_gemm = gemm;
      bo.kv = kv_type;
      gpu::GpuBatchBackend backend(*dev, bo);
      const auto num_blocks = static_cast<int32_t>(kv_gb * 1e9 / backend.block_bytes(shape));
      // Bytes a step reads per key of a kv head: its K and V rows (FP8: codes and scales).
      const double key_bytes = 2.0 * static_cast<double>(gpu::kv_row_bytes(kv_type, cfg.head_dim));
      // The bytes a step reads of the weights: FP8 replaces the layers' bf16 matrices by their E4M3 copy (1 byte an
      // element, + the scales): bf16 bytes - 2 x codes + codes + scales ~= bf16 bytes - the FP8 copy's bytes.
      const double default_weight_bytes =
          bf16_bytes - (backend.decode_fp8() ? static_cast<double>(backend.fp8_weight_bytes()) : 0.0);
      // 4 bits: the layers' bf16 bytes (2 an element) replaced by their 4-bit copy (half a byte + 4 bytes a group).
      const double layer_elements = static_cast<double>(cfg.num_layers) *
                                    static_cast<double>(cfg.hidden_size) *
                                    (2.0 * cfg.num_q_heads * cfg.head_dim + 2.0 * cfg.num_kv_heads * cfg.head_dim +
                                     3.0 * static_cast<double>(cfg.intermediate_size));
      const double w4_weight_bytes =
          bf16_bytes - 2 * layer_elements + layer_elements / 2 + layer_elements / gpu::kW4Group * 4;
      backend.create_store(shape, num_blocks, static_cast<int32_t>(max_batch), static_cast<int32_t>(max_ctx + 64));
      backend.fill_random(7, 1.0f);
      const int warm = 3;
      std::vector<std::pair<std::string, std::optional<attn::AttentionPolicy>>> kinds;
      kinds.emplace_back("dense", std::nullopt);
      kinds.emplace_back("moa", attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
                                                               attn::ElasticWindowPattern{0, density, 64}));
      if (!moa_plan.empty()) {
        std::ifstream f(moa_plan);
        check(static_cast<bool>(f), "cannot open --moa-plan " + moa_plan);
        attn::AttentionPolicy p = attn::import_moa(nlohmann::json::parse(f), moa_plan, cfg.num_kv_heads);
        check(p.num_layers() == cfg.num_layers && p.num_q_heads() == cfg.num_q_heads,
              "--moa-plan " + moa_plan + " is not for " + std::to_string(cfg.num_layers) + " layers x " +
                  std::to_string(cfg.num_q_heads) + " heads");
        kinds.emplace_back("moa-plan", std::move(p));
      }
      for (int64_t ctx : ctxs) {
        for (const auto& [kind, policy] : kinds) {
          const char* label = kind.c_str();
          const std::vector<DecodeView> views = decode_views(cfg, policy ? &*policy : nullptr, ctx);
          const std::vector<KVRetention> ret = kv_retention(cfg, views);
          for (int64_t batch : batches) {
            BlockPool pool(num_blocks);
            std::vector<SequenceBlocks> seqs;
            seqs.reserve(static_cast<size_t>(batch));
            const int64_t per_seq = SequenceBlocks(shape, ret).max_blocks(ctx, ctx + warm + steps);
            if (per_seq * batch > num_blocks) {
              std::printf("| %s | %s | %lld | %s | %lld | does not fit (%lld blocks of %d needed) | | | | | |\n",
                          gemm_name, kv_name, static_cast<long long>(ctx), label, static_cast<long long>(batch),
                          static_cast<long long>(per_seq * batch), num_blocks);
              continue;
            }
            for (int64_t b = 0; b < batch; ++b) {
              seqs.emplace_back(shape, ret);
              seqs.back().grow(ctx - 1, pool);
              backend.adopt(seqs.back(), views);
            }
            std::vector<int32_t> toks(static_cast<size_t>(batch), 1000);
            double seconds = 0, kv_read = 0;
            ForwardTimers t_before;
            gpu::GpuKernelSeconds k_before;
            for (int s = 0; s < warm + steps; ++s) {
              if (s == warm) {
                t_before = backend.timers();
                k_before = backend.kernel_seconds();
              }
              std::vector<DecodeRow> rows;
              double kv = 0;
              for (auto& q : seqs) {
                q.grow(1, pool);
                rows.push_back({&q, views});
                for (int32_t l = 0; l < cfg.num_layers; ++l)
                  for (int32_t h = 0; h < cfg.num_kv_heads; ++h) {
                    // The keys the kv head's group reads: its widest view.
                    int64_t keys = 0;
                    for (int32_t g = 0; g < cfg.num_q_heads / cfg.num_kv_heads; ++g)
                      keys = std::max(keys, views[static_cast<size_t>(l * cfg.num_q_heads + h * (cfg.num_q_heads / cfg.num_kv_heads) + g)]
                                                .ranges(q.length())
                                                .count());
                    kv += static_cast<double>(keys) * key_bytes;
                  }
              }
              const auto t0 = std::chrono::steady_clock::now();
              backend.decode(toks, rows);
              const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
              if (s >= warm) {
                seconds += dt;
                kv_read += kv;
              }
            }
            const double step = seconds / steps, kv_step = kv_read / steps;
            const double weight_bytes =
                gemm == gpu::GemmPrecision::kW4 && batch <= gpu::kW4Rows ? w4_weight_bytes : default_weight_bytes;
            const double floor = (weight_bytes + kv_step) / bw;
            std::printf("| %s | %s | %lld | %s | %lld | %.2f | %.0f | %.2f | %.2f | %.2f | %d |\n", gemm_name, kv_name,
                        static_cast<long long>(ctx), label, static_cast<long long>(batch), step * 1e3,
                        static_cast<double>(batch) / step,
                        kv_step / 1e9, floor * 1e3, step / floor, backend.last_splits());
            if (breakdown) {
              const ForwardTimers t = backend.timers();
              const gpu::GpuKernelSeconds& k = backend.kernel_seconds();
              const double gemm_ms = 1e3 * (t.gemm_seconds - t_before.gemm_seconds) / steps;
              const double attn_ms = 1e3 * (t.attention_seconds - t_before.attention_seconds) / steps;
              const double small_ms = 1e3 * (k.total() - k_before.total()) / steps;
              std::printf("|  |  | breakdown | GPU ms a step: GEMM %.3f (weights floor %.3f, %.2fx), attention %.3f (KV floor %.3f, "
                          "%.2fx), norm / rope / act / misc %.3f / %.3f / %.3f / %.3f; GPU sum %.3f of the eager step's "
                          "%.3f ms | | | | | | |\n",
                          gemm_ms, 1e3 * weight_bytes / bw, gemm_ms / (1e3 * weight_bytes / bw), attn_ms,
                          1e3 * kv_step / bw, attn_ms / (1e3 * kv_step / bw),
                          1e3 * (k.norm - k_before.norm) / steps, 1e3 * (k.rope - k_before.rope) / steps,
                          1e3 * (k.activation - k_before.activation) / steps, 1e3 * (k.misc - k_before.misc) / steps,
                          gemm_ms + attn_ms + small_ms, step * 1e3);
            }
            std::fflush(stdout);
            if (out) {
              out << ctx << ',' << (label) << ',' << batch << ',' << step * 1e3 << ','
                  << static_cast<double>(batch) / step << ',' << kv_step / 1e9 << ',' << floor * 1e3 << ','
                  << step / floor << ',' << backend.last_splits() << ',' << gemm_name << ',' << kv_name << '\n';
            }
            for (auto& q : seqs) {
              backend.release_sequence(q);
              q.release(pool);
            }
          }
        }
      }
    }  // gemm x kv type
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
