// --stream: the CLI's streaming-memory options, shared by run, bench and eval.
#include <string>

#include "cli/commands.h"
#include "cli/usage.h"
#include "core/error.h"
#include "core/memory_budget.h"

namespace tessera::cli {

std::string stream_label(const std::string& method) { return "stream:" + method; }

std::string stream_method_of(const std::string& label) {
  return label.rfind("stream:", 0) == 0 ? label.substr(7) : std::string();
}

// Streaming runs on either device (the GPU twin: runtime/cuda/stream_gpu_kv.h).
bool use_gpu_device_for(const std::string& device, const StreamFlags& stream) {
  (void)stream;
  return use_gpu_device(device);
}

runtime::StreamOptions stream_options(const StreamFlags& f, const std::string& method, bool gpu) {
  runtime::StreamOptions o;
  o.method = runtime::parse_stream_method(method, "--stream");
  usage_check(o.method != runtime::StreamMethod::None,
              "--stream must be ltri, infllm or streamingllm, got '" + method + "'");
  o.sinks = f.sinks;
  o.local = f.local;
  o.chunk = f.chunk;
  o.block = f.block;
  o.top_k = f.top_k;
  o.last_chunk = f.last_chunk;
  if (!f.host_budget.empty()) o.host_budget = parse_byte_size(f.host_budget, "--stream-host-budget");
  usage_check(f.host_kv == "bf16" || f.host_kv == "fp8", "--stream-host-kv must be bf16 or fp8, got '" + f.host_kv + "'");
  usage_check(f.host_kv == "bf16" || gpu,
              "--stream-host-kv fp8 is the GPU path's (--device cuda); the CPU keeps its evicted blocks in f32");
  o.host_fp8 = f.host_kv == "fp8";
  if (!f.retrieval_heads.empty()) o.retrieval_heads = runtime::read_retrieval_heads(f.retrieval_heads);
  o.index_ratio = f.index_ratio;
  usage_check(f.index_heads == "retrieval" || f.index_heads == "all",
              "--stream-index-heads must be retrieval or all, got '" + f.index_heads + "'");
  o.index_all_heads = f.index_heads == "all";
  usage_check(f.early_layers == "score" || f.early_layers == "votes",
              "--stream-early-layers must be score or votes, got '" + f.early_layers + "'");
  o.early_from_votes = f.early_layers == "votes";
  usage_check(f.map_heads == "all" || f.map_heads == "retrieval",
              "--stream-map-heads must be all or retrieval, got '" + f.map_heads + "'");
  o.map_retrieval_head = f.map_heads == "retrieval";
  try {  // the flags' values: a wrong command line (exit 2)
    runtime::check_stream_options(o);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  if (o.method == runtime::StreamMethod::StreamingLLM) o = runtime::streamingllm_equal_memory(o);
  return o;
}

}  // namespace tessera::cli
