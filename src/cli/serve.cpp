// `tessera serve`: an OpenAI-compatible HTTP server over one model (src/server, docs/server.md).
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <thread>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#ifdef TESSERA_WITH_SERVER
#include "server/engine_slot.h"
#include "server/http/http_server.h"
#include "server/policy_cache.h"
#include "server/scheduler.h"
#endif
#ifdef TESSERA_WITH_GPU_ENGINE
#include "runtime_cuda/batch_gpu.h"
#include "runtime_cuda/device_model.h"
#include "runtime_cuda/gpu_engine.h"
#endif
#include "core/memory_budget.h"
#include "runtime/batch_engine.h"

namespace tessera::cli {

#ifndef TESSERA_WITH_SERVER
int serve_command(const ServeOptions&) {
  throw Error("serve: this tessera was built without cpp-httplib (install libcpp-httplib-dev, e.g. with "
              "scripts/setup.sh, and configure again)");
}
#else

namespace {

std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int) { g_stop.store(true); }

}  // namespace

int serve_command(const ServeOptions& o) {
  check(o.parallel >= 1, "--parallel must be at least 1, got " + std::to_string(o.parallel));
  check(o.queue >= 0, "--queue must not be negative, got " + std::to_string(o.queue));
  check(o.timeout > 0, "--timeout must be positive");
  check(o.max_body_mb > 0, "--max-body must be positive");
  check(o.port >= 0 && o.port <= 65535, "--port must be in [0, 65535], got " + std::to_string(o.port));
  const bool gpu = use_gpu_device(o.device);
  (void)cuda_attention_options(o.cuda, gpu);

  const double t0 = now_seconds();
  const Session s = Session::open(o.model);
  const auto& c = s.model->config();
  std::printf("model: %s (%s, %d layers, context %s) loaded in %.1f s\n", c.name.c_str(),
              std::string(runtime::architecture_name(c.arch)).c_str(), c.num_layers,
              with_commas(c.context_length).c_str(), now_seconds() - t0);

  server::ServedModel served;
  served.id = o.model_name.empty() ? std::filesystem::path(o.model).stem().string() : o.model_name;
  served.tokenizer = s.tokenizer.get();
  served.chat = s.chat ? &*s.chat : nullptr;
  served.context_length = o.max_context > 0 ? std::min(o.max_context, c.context_length) : c.context_length;
  served.created = static_cast<int64_t>(std::time(nullptr));
  server::PolicyCache policies({c.num_layers, c.num_q_heads, c.num_kv_heads}, o.attn, o.policy_dir);

  // --parallel 1: one single-sequence engine (a slot); more: the batched engine over a paged KV cache.
  const bool batched = o.parallel > 1;
  const double kv_bytes = o.kv_budget.empty() ? 0.0 : static_cast<double>(parse_byte_size(o.kv_budget, "--kv-budget"));
  runtime::BatchEngineOptions bo;
  bo.chunk_size = o.chunk;
  bo.max_batch = o.parallel;
  bo.max_context = served.context_length;
  bo.kv_bytes = kv_bytes;
  server::BatchedEngine batch;
  server::SlotFactory factory;
  std::string device = "cpu";
#ifdef TESSERA_WITH_GPU_ENGINE
  std::unique_ptr<runtime::gpu::DeviceModel> weights;
  if (gpu) {
    weights = runtime::gpu::DeviceModel::upload(*s.model);
    device = runtime::gpu::gpu_description();
    runtime::gpu::GpuEngineOptions go;
    go.max_context = served.context_length;
    go.cuda_attention = cuda_attention_options(o.cuda, true);
    if (batched) {
      runtime::gpu::GpuBatchOptions gbo;
      gbo.prefill.cuda_attention = go.cuda_attention;
      batch.backend = std::make_unique<runtime::gpu::GpuBatchBackend>(*weights, gbo);
      bo.chunk_size = go.chunk_size;  // the GPU prefill's chunk (32K), not the CPU's
    }
    factory = [&weights, go](int, int) -> std::unique_ptr<server::SlotEngine> {
      using Slot = server::EngineSlot<runtime::gpu::GpuEngine, runtime::gpu::DeviceModel, runtime::gpu::GpuEngineOptions>;
      return std::make_unique<Slot>(*weights, go);
    };
  }
#endif
  if (!gpu) {
    runtime::EngineOptions eo;
    eo.chunk_size = o.chunk;
    eo.max_context = served.context_length;
    factory = server::cpu_slot_factory(*s.model, eo);
    if (batched) batch.backend = std::make_unique<runtime::CpuBatchBackend>(*s.model);
  }
  if (batched) batch.engine = std::make_unique<runtime::BatchEngine>(*batch.backend, bo);

  server::Metrics metrics;
  std::string kv_note;
  if (batched) {
    const runtime::BatchEngine& e = *batch.engine;
    kv_note = ", batched: KV " + format_bytes(e.blocks().total() * e.block_bytes()) + " in " +
              with_commas(e.blocks().total()) + " blocks of " + std::to_string(e.shape().block_tokens) + " tokens";
  }
  std::unique_ptr<server::Scheduler> scheduler_ptr =
      batched ? std::make_unique<server::Scheduler>(server::SchedulerOptions{.slots = o.parallel, .queue = o.queue},
                                                    std::move(batch), *s.tokenizer, metrics)
              : std::make_unique<server::Scheduler>(server::SchedulerOptions{.slots = o.parallel, .queue = o.queue},
                                                    factory, *s.tokenizer, metrics);
  server::Scheduler& scheduler = *scheduler_ptr;
  server::HttpOptions ho;
  ho.host = o.host;
  ho.port = o.port;
  ho.api_key = o.api_key;
  if (ho.api_key.empty())
    if (const char* env = std::getenv("TESSERA_API_KEY")) ho.api_key = env;
  ho.max_body_bytes = static_cast<size_t>(o.max_body_mb) << 20;
  ho.timeout_seconds = o.timeout;
  ho.log_requests = !o.quiet;
  server::HttpServer http(ho, served, policies, scheduler, metrics);
  const int port = http.bind();

  std::signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not the end of the server
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  std::atomic<bool> listening_done{false};
  std::thread watcher([&] {
    while (!g_stop.load() && !listening_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (g_stop.load()) {
      std::printf("tessera serve: stopping\n");
      std::fflush(stdout);
      scheduler.shutdown();
      http.stop();
    }
  });
  std::printf("tessera serve: listening on http://%s:%d (model '%s', device %s, %d slot%s, queue %d, attn %s%s%s)\n",
              o.host.c_str(), port, served.id.c_str(), device.c_str(), o.parallel, o.parallel == 1 ? "" : "s",
              o.queue, o.attn.c_str(), kv_note.c_str(), ho.api_key.empty() ? "" : ", API key required");
  std::fflush(stdout);
  http.listen();
  listening_done.store(true);
  watcher.join();
  return 0;
}

#endif

}  // namespace tessera::cli
