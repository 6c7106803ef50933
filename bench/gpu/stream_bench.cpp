// stream_bench — streaming memory on the GPU (runtime/cuda/stream_gpu_kv.h) at long lengths: a prompt of up to 1M
// tokens through a model of Llama-3-8B shapes with deterministic random weights (DeviceModel::random, kPlain) on one
// GPU, with InfLLM's bounded workspace [sinks + retrieved blocks | local window | chunk] and the evicted KV in
// pinned host memory. Per (length, method) row: TTFT (wall time from the token ids on the host to the last
// position's logits), peak device memory in use (cudaMemGetInfo over the whole device, sampled after every layer's
// attention: weights included), decode tokens/s at that length (--decode steps after the prefill), host memory
// (pinned slabs for the evicted blocks, the index, the process's peak RSS), the GEMM / attention GPU time (CUDA
// events), the decisions' wall time and, in parentheses, the part spent waiting for the device's map and block
// scores (runtime/cuda/stream_decide.h; methods "ltri-host" / "infllm-host" decide on the host from copies of q and
// k, the path before it, as a baseline), copies to and from
// the host. A dense row (the normal GPU engine, whole KV on the device) at every length that fits the model's
// context (131,072) is the baseline from the same run.
//
//   stream_bench [--seq 131072,262144,524288,1048576] [--methods streamingllm,infllm,ltri] [--dense 131072]
//                [--sinks 128 --local 4096 --block 128 --top-k 32 --chunk 512 --last-chunk 64] [--decode 16]
//                [--layers N] [--seed 1] [--csv FILE] [--max-seconds S] [--method-max-seq ltri=32768,...]
//                [--host-budget BYTES]   (default: the host memory budget, core/memory_budget.h) [--prepin]
//                [--gemm bf16|fp8] [--host-kv bf16|fp8] [--retrieval-heads FILE]  ("layer head score" lines: Ltri's retrieval heads)
//
// "ltri-fullindex": ltri with every kv head in its span index (with --retrieval-heads, "ltri" keeps only the kv heads
// its retrieval heads read: StreamOptions::index_all_heads); the same decisions, a larger index.
// "ltri-earlyvotes" (also "ltri-earlyvotes-hostfp8-fp8", ...): the layers before the first retrieval layer take the
// previous chunk's collaborative vote instead of scoring with every head (--stream-early-layers votes).
// "ltri-maphead" (also "ltri-maphead-earlyvotes-..."): a retrieval layer's chunk map of its retrieval head alone
// (--stream-map-heads retrieval).
// "ltri-gemm" / "ltri-fused" (also "ltri-fullindex-gemm", ...): Ltri's block scores by the cuBLAS bf16 GEMMs and the
// dots buffer, or by the fused kernel, over the same bf16 index mirror (TESSERA_LTRI_SCORING=gemm | fused,
// stream_decide.h); plain "ltri" takes StreamDecider::kDefaultLtriScoring. Both in one run compare the two.
//
// TESSERA_STREAM_PROFILE=1: a line after each streaming row with the GPU time of attend()'s sections in the prefill
// (GpuStreamStats::*_gpu_seconds: events around each section of each layer's call; they cost a little TTFT).
//
// --prepin: before each streaming row's prefill, allocate (and wait for) the pinned slabs the row needs, timed on
// its own ("pin s"), as a server allocates its offload pool at start; without it the slabs are allocated by a host
// thread during the prefill (inside TTFT). Streaming engines are reused across lengths (ascending), so a row pins
// only what the previous rows did not.
//
// Ablations beside the default in the same run (suffixes, combinable: "ltri-overlap-cache1"): "-each" the blocks' host
// <-> device copies and the workspace's block copies one cudaMemcpyAsync each (TESSERA_STREAM_COPIES=each, the path
// before the batched copies); "-overlap" the device decisions on a second stream while the compute stream runs the
// local pass (TESSERA_STREAM_OVERLAP=1; the default: one stream, the local pass after the decisions; the rows of
// commit 97b90db, where overlap was the default, name that "-serial"); "-cache1" a block cache of top_k slots per
// layer (TESSERA_STREAM_CACHE=1; default 4x), "-cache16" of 16 x top_k (any of 1, 2, 8, 16, 32); "-onecopy" the retrieved blocks' copies to the
// device behind the evictions' copies out on one stream (TESSERA_STREAM_COPY_IN=0; the default: their own stream;
// the rows of a475533, where one stream was the default, name the split "-copyin"); "-localcands" / "-localmasses" /
// "-localscores" the local pass queued just before the host waits for the decisions' candidates / masses / block
// scores, "-localafter" after the decisions (TESSERA_STREAM_LOCAL_AT); "-sepquant" FP8 GEMMs' inputs quantized by
// their own kernel rather than by the norm / activation that makes them (TESSERA_FP8_FUSED=0); "-profile" that row's
// sections timed (TESSERA_STREAM_PROFILE=1). An engine is dropped after the last length's row (its pinned slabs with it), so that several rows' pinned memory is
// not held at once.
//
// "streamingllm-copy": streamingllm with its window copied out of the ring and rotated every chunk (the path before
// GpuStreamingKV::window_kept()), a baseline in the same run.
//
// --gemm fp8: every row's GEMMs in FP8 E4M3 (GpuEngineOptions::gemm; runtime/cuda/gemm.h). A method (or "dense") with
// the suffix "-fp8" runs in FP8 whatever --gemm says ("--methods streamingllm,streamingllm-fp8,dense-fp8": bf16 and
// FP8 rows from the same run); its rows are labelled with the suffix.
//
// --host-kv fp8: the retrieving methods' evicted blocks in FP8 in pinned host memory (StreamOptions::host_fp8: 0.52x
// the bytes of bf16, so 1M tokens of Llama-3-8B shapes fit a 128 GiB host); the suffix "-hostfp8" (before "-fp8")
// does it for one row ("--methods ltri,ltri-hostfp8": both from the same run).
//
// --method-max-seq skips a method's rows past a length (ltri-host / infllm-host: minutes at 32K+).
// --max-seconds skips the rows that would start after that budget. Rows are printed and appended to the CSV as they
// finish, so a run cut short keeps what it measured.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "bench_args.h"
#include "core/error.h"
#include "runtime/cuda/device_model.h"
#include "runtime/cuda/gpu_engine.h"
#include "runtime/cuda/synthetic_config.h"

namespace {

using namespace tessera;
using namespace tessera::runtime;
using namespace tessera::runtime::gpu;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int> seqs = {131072, 262144, 524288, 1048576};
  std::vector<std::string> methods = {"streamingllm"};
  std::vector<int> dense = {131072};
  StreamOptions stream;
  int decode = 16;
  int layers = 0;
  uint64_t seed = 1;
  std::string csv;
  double max_seconds = 0;
  std::map<std::string, int> method_max;
  bool prepin = false;
  bool fp8 = false;  // --gemm fp8
};

using bench::split_list;

Options parse(int argc, char** argv) {
  Options o;
  o.stream.sinks = 128;
  o.stream.local = 4096;
  o.stream.block = 128;
  o.stream.top_k = 32;
  o.stream.chunk = 512;
  o.stream.last_chunk = 64;
  auto value = [&](int& i) -> std::string {
    check(i + 1 < argc, std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  auto ints = [](const std::string& s) {
    std::vector<int> v;
    for (const std::string& x : split_list(s, ',')) v.push_back(std::stoi(x));
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seq") o.seqs = ints(value(i));
    else if (a == "--methods") o.methods = split_list(value(i), ',');
    else if (a == "--dense") o.dense = ints(value(i));
    else if (a == "--sinks") o.stream.sinks = std::stoi(value(i));
    else if (a == "--local") o.stream.local = std::stoi(value(i));
    else if (a == "--block") o.stream.block = std::stoi(value(i));
    else if (a == "--top-k") o.stream.top_k = std::stoi(value(i));
    else if (a == "--chunk") o.stream.chunk = std::stoi(value(i));
    else if (a == "--last-chunk") o.stream.last_chunk = std::stoi(value(i));
    else if (a == "--decode") o.decode = std::stoi(value(i));
    else if (a == "--host-budget") o.stream.host_budget = static_cast<int64_t>(std::stod(value(i)));
    else if (a == "--layers") o.layers = std::stoi(value(i));
    else if (a == "--seed") o.seed = std::stoull(value(i));
    else if (a == "--csv") o.csv = value(i);
    else if (a == "--prepin") o.prepin = true;
    else if (a == "--host-kv") {
      const std::string h = value(i);
      check(h == "bf16" || h == "fp8", "--host-kv must be bf16 or fp8, got '" + h + "'");
      o.stream.host_fp8 = h == "fp8";
    }
    else if (a == "--retrieval-heads")  // "layer head score" lines (tessera's --stream-retrieval-heads file)
      o.stream.retrieval_heads = read_retrieval_heads(value(i));
    else if (a == "--gemm") {
      const std::string g = value(i);
      check(g == "bf16" || g == "fp8", "--gemm must be bf16 or fp8, got '" + g + "'");
      o.fp8 = g == "fp8";
    }
    else if (a == "--max-seconds") o.max_seconds = std::stod(value(i));
    else if (a == "--method-max-seq") {
      for (const std::string& kv : split_list(value(i), ',')) {
        const size_t eq = kv.find('=');
        check(eq != std::string::npos, "--method-max-seq takes method=length pairs");
        o.method_max[kv.substr(0, eq)] = std::stoi(kv.substr(eq + 1));
      }
    } else if (a == "--help" || a == "-h") {
      std::printf("stream_bench: see the header of bench/gpu/stream_bench.cpp\n");
      std::exit(0);
    } else {
      throw Error("unknown argument " + a);
    }
  }
  return o;
}

// VmHWM / VmRSS of this process, bytes.
int64_t proc_status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size())) * 1024;
  return 0;
}

struct Row {
  int seq = 0;
  std::string method;
  double ttft = 0, gemm = 0, attention = 0, decision = 0, decision_device = 0, decode_tok_s = 0, peak_gb = 0, workspace_gb = 0;
  double pinned_gb = 0, index_gb = 0, rss_gb = 0, pin_s = 0, prepin_s = 0;
  double ws_s = 0, local_s = 0, wait_s = 0, global_s = 0, store_s = 0;  // TESSERA_STREAM_PROFILE=1: attend()'s sections, prefill
  double d_map = 0, d_spans = 0, d_masses = 0, d_keys = 0, d_scores = 0, d_scores_wide = 0, d_issue = 0, gap[3] = {0, 0, 0};  // ... and the decisions' device sections
  int64_t waits = 0;  // the decisions' host synchronisations in the prefill
  int64_t evicted = 0, to_host = 0, to_device = 0, cached = 0;
  std::string error;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    ModelConfig cfg = synthetic_config("llama3-8b");
    if (o.layers > 0) {
      cfg.num_layers = o.layers;
      cfg.layers.resize(static_cast<size_t>(o.layers));
    }
    std::printf("model: %s, random weights (seed %llu); device: %s\n", cfg.summary().c_str(),
                static_cast<unsigned long long>(o.seed), gpu_description().c_str());
    std::printf("streaming: sinks %d, local %d, blocks of %d, top-%d, chunk %d (last %d); decode %d steps\n",
                o.stream.sinks, o.stream.local, o.stream.block, o.stream.top_k, o.stream.chunk, o.stream.last_chunk,
                o.decode);
    const auto dev = DeviceModel::random(cfg, o.seed);
    const int max_seq = *std::max_element(o.seqs.begin(), o.seqs.end());
    std::vector<int32_t> tokens(static_cast<size_t>(max_seq + o.decode + 1));
    uint64_t x = o.seed * 0x9E3779B97F4A7C15ull + 1;
    for (auto& t : tokens) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      t = static_cast<int32_t>(x % static_cast<uint64_t>(cfg.vocab_size));
    }
    FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
    if (csv != nullptr) {
      std::fprintf(csv, "seq,method,ttft_s,prefill_tok_s,gemm_s,attention_s,decision_s,decision_device_s,decode_tok_s,peak_gpu_gb,"
                        "stream_device_gb,pinned_host_gb,index_gb,peak_rss_gb,pin_s,prepin_s,evicted_blocks_per_layer,"
                        "blocks_to_host,blocks_to_device,blocks_cached,error\n");
      std::fflush(csv);
    }
    const auto start = Clock::now();
    std::vector<Row> rows;
    auto print_row = [&](const Row& r) {
      std::printf("| %d | %s | %.2f | %.0f | %.2f | %.2f | %.2f (%.2f) | %.1f | %.2f | %.2f | %.2f | %.1f | %.2f | %.2f | %lld | "
                  "%lld / %lld / %lld | %s\n",
                  r.seq, r.method.c_str(), r.ttft, r.ttft > 0 ? r.seq / r.ttft : 0.0, r.gemm, r.attention, r.decision,
                  r.decision_device, r.decode_tok_s, r.peak_gb, r.workspace_gb, r.pinned_gb, r.prepin_s, r.index_gb, r.rss_gb,
                  static_cast<long long>(r.evicted), static_cast<long long>(r.to_host),
                  static_cast<long long>(r.to_device), static_cast<long long>(r.cached), r.error.c_str());
      if (r.ws_s + r.local_s + r.global_s + r.store_s > 0)
        std::printf("|   | (profile: %s at %d) | attention sections, GPU s: workspace %.3f, local pass %.3f, waiting for the "
                    "retrieved blocks' copies %.3f, global pass + merge %.3f, store %.3f |\n",
                    r.method.c_str(), r.seq, r.ws_s, r.local_s, r.wait_s, r.global_s, r.store_s);
      if (r.d_map + r.d_spans + r.d_masses + r.d_keys + r.d_scores > 0)  // (profiling on)
        std::printf("|   | (profile: %s at %d) | decisions on the device, GPU s: map %.3f, span discovery %.3f, masses "
                    "%.3f, index keys %.3f, block scores %.3f (every-head layers %.3f); host waits for them: %lld (host work in the decisions "
                    "%.2f s; issuing the device's work %.2f s; the host's gaps with nothing queued, after the candidates "
                    "%.2f, the masses %.2f, the block scores %.2f s) |\n",
                    r.method.c_str(), r.seq, r.d_map, r.d_spans, r.d_masses, r.d_keys, r.d_scores,
                    r.d_scores_wide, static_cast<long long>(r.waits), r.decision - r.decision_device, r.d_issue,
                    r.gap[0], r.gap[1], r.gap[2]);
      std::fflush(stdout);
      if (csv != nullptr) {
        std::fprintf(csv, "%d,%s,%.3f,%.1f,%.3f,%.3f,%.3f,%.3f,%.2f,%.3f,%.3f,%.3f,%.4f,%.3f,%.2f,%.2f,%lld,%lld,%lld,%lld,%s\n",
                     r.seq, r.method.c_str(), r.ttft, r.ttft > 0 ? r.seq / r.ttft : 0.0, r.gemm, r.attention,
                     r.decision, r.decision_device, r.decode_tok_s, r.peak_gb, r.workspace_gb, r.pinned_gb, r.index_gb, r.rss_gb, r.pin_s,
                     r.prepin_s,
                     static_cast<long long>(r.evicted), static_cast<long long>(r.to_host),
                     static_cast<long long>(r.to_device), static_cast<long long>(r.cached), r.error.c_str());
        std::fflush(csv);
      }
    };
    std::printf("\n| tokens | method | TTFT s | prefill tok/s | GEMM s | attention s | decisions s (device part) | decode tok/s | "
                "peak GPU GB | stream GPU GB | pinned host GB | pin s (before) | index GB | peak RSS GB | "
                "evicted blocks/layer | blocks to host / to GPU / cached |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    std::fflush(stdout);
    // A warm-up (cuBLAS handles, the executor's self-check) outside every row.
    {
      GpuEngineOptions w;
      w.stream = o.stream;
      w.stream.method = StreamMethod::StreamingLLM;
      w.stream = streamingllm_equal_memory(w.stream);
      GpuEngine warm(*dev, w);
      warm.prefill(std::span<const int32_t>(tokens.data(), 2048));
    }
    std::map<std::string, std::unique_ptr<GpuEngine>> engines;
    for (int seq : o.seqs) {
      std::vector<std::string> specs;
      if (std::find(o.dense.begin(), o.dense.end(), seq) != o.dense.end()) specs.push_back("dense");
      for (const std::string& m : o.methods) specs.push_back(m);
      for (const std::string& spec : specs) {
        Row r;
        r.seq = seq;
        r.method = spec;
        const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        if (o.max_seconds > 0 && elapsed > o.max_seconds) {
          r.error = "skipped (--max-seconds)";
          print_row(r);
          continue;
        }
        const auto mm = o.method_max.find(spec);
        if (mm != o.method_max.end() && seq > mm->second) continue;
        try {
          // "<method>-fp8" / "dense-fp8": that row in FP8 (as --gemm fp8 does for every row).
          const bool fp8_suffix = spec.size() > 4 && spec.substr(spec.size() - 4) == "-fp8";
          std::string spec_bf16 = fp8_suffix ? spec.substr(0, spec.size() - 4) : spec;
          // Ablations in the same run, each an environment variable GpuStreamingKV reads at construction (suffixes
          // in any order, before "-fp8"): "-each" the block copies one cudaMemcpyAsync each (TESSERA_STREAM_COPIES=
          // each), "-overlap" the decisions on a second stream beside the local pass (TESSERA_STREAM_OVERLAP=1),
          // "-cache1" a block cache of top_k slots (TESSERA_STREAM_CACHE=1), "-profile" the sections timed
          // (TESSERA_STREAM_PROFILE=1).
          // Removes `sfx` from the end of the spec (and says so) when it is there.
          const auto strip = [&spec_bf16](const std::string& sfx) {
            if (spec_bf16.size() <= sfx.size() || spec_bf16.compare(spec_bf16.size() - sfx.size(), sfx.size(), sfx) != 0)
              return false;
            spec_bf16.resize(spec_bf16.size() - sfx.size());
            return true;
          };
          std::vector<std::pair<const char*, const char*>> env;
          for (bool found = true; found;) {
            found = false;
            for (const auto& [sfx, var, val] : {std::tuple<std::string, const char*, const char*>{"-each", "TESSERA_STREAM_COPIES", "each"},
                                                {"-overlap", "TESSERA_STREAM_OVERLAP", "1"},
                                                {"-cache1", "TESSERA_STREAM_CACHE", "1"},
                                                {"-cache2", "TESSERA_STREAM_CACHE", "2"},
                                                {"-cache8", "TESSERA_STREAM_CACHE", "8"},
                                                {"-cache16", "TESSERA_STREAM_CACHE", "16"},
                                                {"-cache32", "TESSERA_STREAM_CACHE", "32"},
                                                {"-onecopy", "TESSERA_STREAM_COPY_IN", "0"},
                                                {"-localcands", "TESSERA_STREAM_LOCAL_AT", "candidates"},
                                                {"-localmasses", "TESSERA_STREAM_LOCAL_AT", "masses"},
                                                {"-localscores", "TESSERA_STREAM_LOCAL_AT", "scores"},
                                                {"-localafter", "TESSERA_STREAM_LOCAL_AT", "after"},
                                                {"-cache4", "TESSERA_STREAM_CACHE", "4"},
                                                {"-sepquant", "TESSERA_FP8_FUSED", "0"},
                                                {"-profile", "TESSERA_STREAM_PROFILE", "1"}})
              if (strip(sfx)) {
                env.emplace_back(var, val);
                found = true;
              }
          }
          // "<ltri...>-gemm" / "<ltri...>-fused": Ltri's scoring by the bf16 GEMMs or the fused kernel
          // (TESSERA_LTRI_SCORING, read by StreamDecider's constructor); without either, the default.
          std::string scoring;
          for (const std::string sfx : {"-gemm", "-fused"})
            if (strip(sfx)) scoring = sfx.substr(1);
          // "ltri-fullindex": Ltri with every kv head in its span index (StreamOptions::index_all_heads; the default
          // keeps the retrieval heads' kv heads only when --retrieval-heads is given), beside "ltri" in the same run.
          const bool full_index = strip("-fullindex");
          // "<method>-hostfp8": the evicted blocks in FP8 in host memory (StreamOptions::host_fp8, as --host-kv fp8
          // does for every row), beside the bf16 blocks in the same run.
          const bool host_fp8 = strip("-hostfp8");
          // "<ltri...>-earlyvotes": the layers before the first retrieval layer take the previous chunk's vote
          // (StreamOptions::early_from_votes, --stream-early-layers votes) instead of scoring with every head.
          const bool early_votes = strip("-earlyvotes");
          // "<ltri...>-maphead": a retrieval layer maps with its retrieval head alone (--stream-map-heads retrieval).
          const bool map_head = strip("-maphead");
          GpuEngineOptions go;
          go.chunk_size = 32768;
          if (fp8_suffix || o.fp8) go.gemm = GemmPrecision::kFp8;
          if (spec_bf16 != "dense") {
            const std::string& base = spec_bf16;
            go.stream = o.stream;
            if (host_fp8) go.stream.host_fp8 = true;
            // "ltri-host" / "infllm-host": the decisions' map, votes and block scores on the host (the path before
            // stream_decide.h), for a baseline in the same run.
            const bool host_decisions = base.size() > 5 && base.substr(base.size() - 5) == "-host";
            // "streamingllm-copy": the window copied out of the ring and rotated every chunk (the path before the
            // kept window, GpuStreamingKV::window_kept()), for a baseline in the same run.
            const bool copy_window = base.size() > 5 && base.substr(base.size() - 5) == "-copy";
            go.stream.method = parse_stream_method(host_decisions || copy_window ? base.substr(0, base.size() - 5) : base,
                                                   "--methods");
            if (go.stream.method == StreamMethod::StreamingLLM) go.stream = streamingllm_equal_memory(go.stream);
            go.stream.index_all_heads = full_index;
            go.stream.early_from_votes = early_votes;
            go.stream.map_retrieval_head = map_head;
          }
          // Dense: within the model's context, the decode steps included (the row says how many tokens it ran).
          const int run = spec_bf16 == "dense" ? std::min(seq, cfg.context_length - o.decode) : seq;
          r.seq = run;
          // One engine per streaming method, reused across lengths (its pinned slabs too: reset() keeps them).
          std::unique_ptr<GpuEngine> own;
          GpuEngine* ep = nullptr;
          if (spec_bf16 == "dense") {
            own = std::make_unique<GpuEngine>(*dev, go);
            ep = own.get();
          } else {
            auto& slot = engines[spec];
            if (!slot) {
              const std::string& base = spec_bf16;
              const bool host_decisions = base.size() > 5 && base.substr(base.size() - 5) == "-host";
              const bool copy_window = base.size() > 5 && base.substr(base.size() - 5) == "-copy";
              if (host_decisions) setenv("TESSERA_STREAM_DECISIONS", "host", 1);  // read by GpuStreamingKV's constructor
              if (copy_window) setenv("TESSERA_STREAM_WINDOW", "copy", 1);
              if (!scoring.empty()) setenv("TESSERA_LTRI_SCORING", scoring.c_str(), 1);
              for (const auto& [var, val] : env) setenv(var, val, 1);
              slot = std::make_unique<GpuEngine>(*dev, go);
              for (const auto& [var, val] : env) unsetenv(var);
              if (host_decisions) unsetenv("TESSERA_STREAM_DECISIONS");
              if (copy_window) unsetenv("TESSERA_STREAM_WINDOW");
              if (!scoring.empty()) unsetenv("TESSERA_LTRI_SCORING");
            }
            ep = slot.get();
            ep->reset();
            ep->reset_stats();
          }
          GpuEngine& engine = *ep;
          if (spec_bf16 != "dense" && o.prepin) {  // the pinned pool for this length first, timed on its own
            const auto p0 = Clock::now();
            engine.reserve_stream(run + o.decode, true);
            r.prepin_s = std::chrono::duration<double>(Clock::now() - p0).count();
          }
          GpuStreamStats before;  // the profile so far (earlier rows' decode steps included)
          if (GpuStreamingKV* g = engine.gpu_streaming()) {
            g->collect_profile();
            before = g->gpu_stats();
          }
          engine.reset_peak_memory();
          engine.prefill(std::span<const int32_t>(tokens.data(), static_cast<size_t>(run)));
          const auto& st = engine.stats();
          r.ttft = st.prefill_seconds;  // (reset_stats() below keeps it)
          r.gemm = st.gemm_seconds;
          r.attention = st.attention_seconds;
          if (GpuStreamingKV* g = engine.gpu_streaming()) {  // the sections' GPU time of this prefill (profiling on)
            g->collect_profile();
            r.ws_s = g->gpu_stats().workspace_gpu_seconds - before.workspace_gpu_seconds;
            r.local_s = g->gpu_stats().local_gpu_seconds - before.local_gpu_seconds;
            r.global_s = g->gpu_stats().global_gpu_seconds - before.global_gpu_seconds;
            r.wait_s = g->gpu_stats().copy_wait_gpu_seconds - before.copy_wait_gpu_seconds;
            r.store_s = g->gpu_stats().store_gpu_seconds - before.store_gpu_seconds;
            const GpuStreamStats& a = g->gpu_stats();
            r.d_map = a.decide.map - before.decide.map;
            r.d_spans = a.decide.spans - before.decide.spans;
            r.d_masses = a.decide.masses - before.decide.masses;
            r.d_keys = a.decide.keys - before.decide.keys;
            r.d_scores = a.decide.scores - before.decide.scores;
            r.d_scores_wide = a.decide.scores_wide - before.decide.scores_wide;
            r.d_issue = a.decide.issue - before.decide.issue;
            for (int i = 0; i < 3; ++i) r.gap[i] = a.host_gap_seconds[i] - before.host_gap_seconds[i];
            r.waits = a.decide.waits - before.decide.waits;
          }
          if (o.decode > 0) {
            engine.reset_stats();
            for (int i = 0; i < o.decode; ++i) engine.decode(tokens[static_cast<size_t>(run + i)]);
            r.decode_tok_s = engine.stats().decode_tokens_per_second();
          }
          const GpuMemoryStats mem = engine.memory();
          r.peak_gb = static_cast<double>(mem.peak_in_use_bytes) / 1e9;
          r.workspace_gb = static_cast<double>(mem.kv_cache_bytes) / 1e9;
          if (const GpuStreamingKV* g = engine.gpu_streaming()) {
            const GpuStreamStats& gs = g->gpu_stats();
            const StreamStats ss = g->decisions().stats();
            r.decision = gs.decision_seconds;
            r.decision_device = gs.decision_device_seconds;
            r.pinned_gb = static_cast<double>(gs.pinned_bytes) / 1e9;
            r.index_gb = static_cast<double>(ss.index_bytes) / 1e9;
            r.pin_s = gs.pin_seconds;
            r.evicted = ss.evicted_blocks;
            r.to_host = gs.blocks_to_host;
            r.to_device = gs.blocks_to_device;
            r.cached = gs.blocks_cached;
          }
        } catch (const std::exception& e) {
          r.error = e.what();
          for (char& c : r.error)
            if (c == ',' || c == '\n') c = ';';
        }
        r.rss_gb = static_cast<double>(proc_status_bytes("VmHWM:")) / 1e9;
        print_row(r);
        rows.push_back(r);
        if (seq == o.seqs.back()) engines.erase(spec);  // its pinned slabs are not needed again
      }
    }
    if (csv != nullptr) std::fclose(csv);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stream_bench: %s\n", e.what());
    return 1;
  }
}
