// `tessera serve`: an OpenAI-compatible HTTP server over one model (src/server, docs/server.md).
#include <csignal>
#include <cstdio>
#include <ctime>
#include <limits>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "cli/session.h"
#include "cli/usage.h"
#include "core/error.h"
#ifdef TESSERA_WITH_SERVER
#include "server/engine_slot.h"
#include "server/http/http_server.h"
#include "server/policy_cache.h"
#include "server/scheduler.h"
#include "server/stream_serving.h"
#endif
#include "core/memory_budget.h"
#include "parallel/launch.h"
#include "parallel/placement.h"
#include "plan/planned_range.h"
#include "parallel/shard.h"
#include "runtime/batch_engine.h"
#include "runtime/device.h"
#ifdef TESSERA_WITH_TP
#include "cuda/cuda_check.h"
#include "parallel/cuda/collective.h"
#include "parallel/cuda/rank_gpu.h"
#include "parallel/cuda/tp_device_model.h"
#include "parallel/cuda/tp_gpu_forward.h"
#include "parallel/cuda/tp_batch_gpu.h"
#include "parallel/cuda/tp_service_cuda.h"
#include "parallel/tp_batch.h"
#include "parallel/tp_service.h"
#include "runtime/cuda/batch_gpu.h"
#include "runtime/cuda/gemm.h"
#endif

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

// The HTTP front end over a scheduler, until SIGINT / SIGTERM.
int listen_and_serve(const ServeOptions& o, server::ServedModel& served, server::PolicyCache& policies,
                     server::Scheduler& scheduler, server::Metrics& metrics, const std::string& device,
                     const std::string& kv_note) {
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
  if (const auto r = plan::planned_range_in_file(o.attn))  // plan/planned_range.h
    std::printf("tessera serve: plan %s was made for prompts of %s-%s tokens; under half or over twice that, its "
                "density and accuracy may differ from the plan's\n",
                o.attn.c_str(), with_commas(r->min).c_str(), with_commas(r->max).c_str());
  std::fflush(stdout);
  http.listen();
  listening_done.store(true);
  watcher.join();
  return 0;
}


// A server slot over the tensor-parallel engine: rank 0's TpLeader, which sends every step to the other ranks.
#ifdef TESSERA_WITH_TP
class TpSlot final : public server::SlotEngine {
 public:
  explicit TpSlot(parallel::TpLeader& leader) : leader_(leader) {}
  std::vector<int32_t> generate(std::span<const int32_t> prompt, const runtime::GenerateOptions& gen,
                                const attn::AttentionPolicy& policy, const std::function<bool(int32_t)>& on_token,
                                const std::function<bool()>& abort) override {
    std::vector<int32_t> out;
    leader_.begin(policy);
    try {
      server::Abortable<parallel::TpLeader> run{leader_, abort};
      out = runtime::generate_tokens(
          run, prompt, gen,
          [&](int32_t token) {
            kv_tokens_.store(leader_.position(), std::memory_order_relaxed);
            return on_token(token);
          },
          [](int32_t) {});
    } catch (const server::PrefillAborted&) {
      out.clear();  // TpLeader::prefill has sent kEnd
    } catch (...) {
      leader_.end();
      kv_tokens_.store(0);
      throw;
    }
    leader_.end();
    kv_tokens_.store(0);
    return out;
  }

 private:
  parallel::TpLeader& leader_;
};
#endif

#ifdef TESSERA_WITH_TP
// `tessera serve --gpus N --parallel M`: one process per GPU; rank 0 serves HTTP with the batched engine (M requests
// at once) over parallel::TpBatchLeader, which sends every backend call to the other ranks before running it on its
// own GPU; the others run them (parallel/tp_batch.h, parallel/cuda/tp_batch_gpu.h).
int serve_tensor_parallel_batched(const ServeOptions& o, const Session& s, server::ServedModel& served,
                                  server::PolicyCache& policies, const parallel::Placement& placement) {
  const attn::PolicyShape shape = s.policy_shape();
  const double kv_bytes = o.kv_budget.empty() ? 0.0 : static_cast<double>(parse_byte_size(o.kv_budget, "--kv-budget"));
  return parallel::run_gpu_ranks(o.gpus, [&](const parallel::RankEnv& env, parallel::RankGpu& g) -> int {
    int rc = 0;
    runtime::gpu::GpuBatchOptions go;
    go.prefill.cuda_attention = cuda_attention_options(o.cuda, true);
    parallel::TpRankBatchBackend rank(*s.model, placement, env.rank, g.comm, go);
    parallel::NcclCommandChannel channel(g.comm, g.stream, g.device);
    if (env.rank != 0) {
      std::signal(SIGINT, SIG_IGN);  // rank 0 handles a Ctrl-C and sends kQuit
      std::signal(SIGTERM, SIG_IGN);
      parallel::tp_batch_worker(channel, rank, shape);
      return 0;
    }
    runtime::BatchEngineOptions bo;
    bo.chunk_size = 32768;  // the GPU prefill chunk (as one GPU's)
    bo.max_batch = o.parallel;
    bo.max_context = served.context_length;
    bo.kv_bytes = kv_bytes;
    bo.prefix_cache = o.prefix_cache;
    bo.step_tokens = o.step_tokens;
    server::BatchedEngine batch;
    auto leader = std::make_unique<parallel::TpBatchLeader>(channel, rank);
    parallel::TpBatchLeader& lead = *leader;
    batch.backend = std::move(leader);
    try {
      batch.engine = std::make_unique<runtime::BatchEngine>(lead, bo);
      const runtime::BatchEngine& e = *batch.engine;
      const std::string kv_note = ", batched: KV " + format_bytes(e.blocks().total() * e.block_bytes()) +
                                  " per GPU in " + with_commas(e.blocks().total()) + " blocks of " +
                                  std::to_string(e.shape().block_tokens) + " tokens" +
                                  (o.prefix_cache ? ", prefix cache on" : "");
      server::Metrics metrics;
      auto scheduler = std::make_unique<server::Scheduler>(
          server::SchedulerOptions{.slots = o.parallel, .queue = o.queue}, std::move(batch), *s.tokenizer, metrics);
      const std::string device = std::to_string(placement.num_gpus) + " GPUs, tensor parallel (uniform placement)";
      rc = listen_and_serve(o, served, policies, *scheduler, metrics, device, kv_note);
      scheduler.reset();  // joins the engine's thread: no call after this one
    } catch (...) {
      channel.send(parallel::tp_command(parallel::TpOp::kQuit));
      throw;
    }
    channel.send(parallel::tp_command(parallel::TpOp::kQuit));
    return rc;
  });
}
#endif

// `tessera serve --gpus N`: one process per GPU (forked here, or started by torchrun / mpirun); rank 0 serves HTTP
// with one slot over parallel::TpLeader, the other ranks run the commands it sends (parallel/tp_service.h).
int serve_tensor_parallel(const ServeOptions& o, const Session& s, server::ServedModel& served,
                          server::PolicyCache& policies) {
#ifndef TESSERA_WITH_TP
  (void)s;
  (void)served;
  (void)policies;
  throw Error("--gpus " + std::to_string(o.gpus) +
              ": this tessera was built without the tensor-parallel engine (CUDA and NCCL; see docs/multi-gpu.md)");
#else
  const runtime::ModelConfig& c = s.model->config();
  const int32_t world = parallel::world_for_gpus(o.gpus);
  const int32_t context = static_cast<int32_t>(served.context_length);
  if (o.parallel > 1) {
    // The batched engine over the ranks runs the uniform placement (whole KV heads per GPU, the same in every layer):
    // a --placement must be that one; a plan's placement is not used.
    if (!o.placement.empty())
      (void)parallel::rank_slice(
          c, parallel::load_placement(o.placement, world, c.num_layers, c.num_q_heads, c.num_kv_heads), 0,
          o.placement);
    return serve_tensor_parallel_batched(o, s, served, policies, parallel::uniform_rank_placement(c, world));
  }
  // The placement: --placement, else the default policy's plan's, else genetic on the FLOP costs of a full context.
  const attn::AttentionPolicy default_policy = s.policy(o.attn);
  std::string note;
  std::optional<parallel::Placement> placement =
      !o.placement.empty()
          ? std::optional<parallel::Placement>(
                parallel::load_placement(o.placement, world, c.num_layers, c.num_q_heads, c.num_kv_heads))
          : parallel::placement_in_policy_file(o.attn, world, c.num_layers, c.num_q_heads, c.num_kv_heads, &note);
  if (!note.empty()) std::printf("%s\n", note.c_str());
  if (!placement)
    placement = parallel::plan_placement(default_policy.table().empty()
                                         ? attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads,
                                                                          c.num_kv_heads, attn::DensePattern{})
                                         : default_policy,
                                     context, c.hidden_size, c.head_dim, world, parallel::PlacementMethod::kGenetic);
  const attn::PolicyShape shape = s.policy_shape();
  return parallel::run_gpu_ranks(o.gpus, [&](const parallel::RankEnv& env, parallel::RankGpu& g) -> int {
    const int dev = g.device;
    parallel::Collective* comm = &g.comm;
    cudaStream_t stream = g.stream;
    int rc = 0;
    {
      auto model = parallel::TpDeviceModel::upload(*s.model, parallel::rank_plan(c, *placement, env.rank));
      parallel::TpForwardOptions fo;
      fo.cuda_attention = cuda_attention_options(o.cuda, true);
      parallel::TpGpuForward fwd(*model, g.comm, fo, stream, g.gemm);
      parallel::TpRankForward forward(fwd, dev, context);
      parallel::NcclCommandChannel channel(*comm, stream, dev);
      if (env.rank != 0) {
        // The others follow rank 0's commands; only rank 0's kQuit ends them (a terminal's Ctrl-C reaches every
        // process of the group: rank 0 handles it and sends kQuit).
        std::signal(SIGINT, SIG_IGN);
        std::signal(SIGTERM, SIG_IGN);
        parallel::tp_serve_worker(channel, forward, shape);
      } else {
        parallel::TpLeader leader(channel, forward, context, 32768);
        server::Metrics metrics;
        auto scheduler = std::make_unique<server::Scheduler>(
            server::SchedulerOptions{.slots = 1, .queue = o.queue},
            [&leader](int, int) -> std::unique_ptr<server::SlotEngine> { return std::make_unique<TpSlot>(leader); },
            *s.tokenizer, metrics);
        const std::string device = std::to_string(world) + " GPUs, tensor parallel (placement " +
                                   placement->method + ")";
        // The scheduler goes first (it cancels and joins its slot, whose request then sends kEnd), then kQuit.
        try {
          rc = listen_and_serve(o, served, policies, *scheduler, metrics, device, "");
        } catch (...) {
          scheduler.reset();
          leader.quit();
          throw;
        }
        scheduler.reset();
        leader.quit();
      }
    }
    return rc;
  });
#endif
}
}  // namespace

int serve_command(const ServeOptions& o) {
  usage_check(o.parallel >= 1, "--parallel must be at least 1, got " + std::to_string(o.parallel));
  usage_check(o.queue >= 0, "--queue must not be negative, got " + std::to_string(o.queue));
  usage_check(o.step_tokens == 0 || o.parallel > 1,
              "--step-tokens budgets the batched engine's steps: add --parallel N (N > 1)");
  usage_check(o.step_tokens == 0 || o.step_tokens > o.parallel,
              "--step-tokens must be more than --parallel (" + std::to_string(o.parallel) +
                  "): every running request decodes one token a step and a prefill needs one more, got " +
                  std::to_string(o.step_tokens));
  usage_check(o.timeout > 0, "--timeout must be positive");
  usage_check(o.max_body_mb > 0, "--max-body must be positive");
  usage_check(o.port >= 0 && o.port <= 65535, "--port must be in [0, 65535], got " + std::to_string(o.port));
  usage_check(o.gpus == 1 || o.device != "cpu", "--gpus runs on GPUs: drop --device cpu");
  const bool streaming = !o.stream.methods.empty();
  usage_check(!streaming || o.gpus == 1,
              "--stream serves on one GPU or the CPU: drop --gpus (the tensor-parallel engine has no streaming memory yet)");
  usage_check(!streaming || o.attn == "dense",
              "--stream cannot be combined with --attn " + o.attn +
                  ": streaming memory attends densely within its own layout (docs/streaming.md)");
  // --gpus forks one process per GPU: this process must not touch CUDA first (use_gpu_device would).
  const bool gpu = o.gpus == 1 && use_gpu_device(o.device);
  (void)cuda_attention_options(o.cuda, o.gpus > 1 || gpu);
  const bool fp8 = gemm_fp8(o.cuda, o.gpus > 1);
  const bool w4 = gemm_w4(o.cuda, o.gpus > 1);
  const bool fp8_kv = kv_fp8(gpu || o.gpus > 1, o.gpus > 1);

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
  server::PolicyCache policies(s.policy_shape(), o.attn, o.policy_dir);
  if (o.gpus > 1 && o.parallel > 1) {
    // The batched tensor-parallel backend gives each GPU whole KV heads, the same in every layer (parallel/tp_batch.h).
    const int32_t world = parallel::world_for_gpus(o.gpus);
    usage_check(c.num_kv_heads % world == 0,
                "--gpus " + std::to_string(o.gpus) + " --parallel " + std::to_string(o.parallel) + ": the model's " +
                    std::to_string(c.num_kv_heads) + " KV heads do not split over " + std::to_string(world) +
                    " GPUs (the batched tensor-parallel engine gives each GPU whole KV heads); use a GPU count that "
                    "divides " + std::to_string(c.num_kv_heads) + ", or --parallel 1");
  }
  if (o.gpus > 1) return serve_tensor_parallel(o, s, served, policies);

  // --stream: every request through streaming memory, each sequence its own (--parallel N: N at once in the batched
  // engine, sharing the host budget for evicted blocks). The context is what that budget holds, not the model's trained context.
  runtime::StreamOptions stream;
  std::string stream_note;
  if (streaming) {
    const std::string& method = o.stream.methods.front();
    stream = stream_options(o.stream, method, gpu);
    const int64_t total = stream.host_budget > 0 ? stream.host_budget : host_memory_budget().bytes;
    stream.host_budget = total / o.parallel;
    const int32_t cap = o.max_context > 0 ? o.max_context : std::numeric_limits<int32_t>::max() - 1;
    served.context_length = server::streaming_context_limit(
        c, stream, gpu ? runtime::StreamingKV::Storage::Device : runtime::StreamingKV::Storage::Host, cap);
    policies.only_dense("this server streams every request (--stream " + method +
                        "), which attends densely within its own layout; drop 'tessera.attn'",
                        stream_label(method));
    stream_note = ", streaming: " + server::describe_streaming(stream, stream.host_budget) +
                  (o.parallel > 1 ? " per slot" : "") + ", context " + with_commas(served.context_length) + " tokens";
  }

  // --parallel 1: one single-sequence engine (a slot); more: the batched engine, over a paged KV cache or, with
  // --stream, over each sequence's streaming memory (the decode steps batch the streamed requests).
  const bool batched = o.parallel > 1;
  const double kv_bytes = o.kv_budget.empty() ? 0.0 : static_cast<double>(parse_byte_size(o.kv_budget, "--kv-budget"));
  runtime::BatchEngineOptions bo;
  bo.chunk_size = o.chunk;
  bo.max_batch = o.parallel;
  bo.max_context = served.context_length;
  bo.kv_bytes = kv_bytes;
  bo.prefix_cache = o.prefix_cache;
  bo.step_tokens = o.step_tokens;
  if (streaming) bo.stream = stream;
  server::BatchedEngine batch;
  const std::unique_ptr<runtime::Device> device = runtime::open_device(gpu ? "cuda" : "cpu", *s.model);
  runtime::EngineOptions eo;
  eo.chunk_size = gpu ? device->default_chunk() : o.chunk;
  eo.max_context = served.context_length;
  eo.stream = stream;
  if (gpu) {
    eo.gpu.cuda_attention = cuda_attention_options(o.cuda, true);
    eo.gpu.fp8_gemm = fp8;
    eo.gpu.w4_decode = w4;
    eo.gpu.fp8_kv = fp8_kv;
  }
  if (batched) {
    batch.backend = device->batch_backend(eo);
    bo.chunk_size = eo.chunk_size;  // the device's prefill chunk (GPU: 32K, not the CPU's)
  }
  const server::SlotFactory factory = server::device_slot_factory(*device, eo);
  const std::string device_name = device->description();
  if (batched) batch.engine = std::make_unique<runtime::BatchEngine>(*batch.backend, bo);

  server::Metrics metrics;
  std::string kv_note = stream_note;
  if (batched && streaming) {
    kv_note += ", batched";
  } else if (batched) {
    const runtime::BatchEngine& e = *batch.engine;
    kv_note = ", batched: KV " + format_bytes(e.blocks().total() * e.block_bytes()) + " in " +
              with_commas(e.blocks().total()) + " blocks of " + std::to_string(e.shape().block_tokens) + " tokens" +
              (o.prefix_cache ? ", prefix cache on" : "") +
              (o.step_tokens > 0 ? ", " + with_commas(o.step_tokens) + " tokens a step" : "");
  }
  std::unique_ptr<server::Scheduler> scheduler_ptr =
      batched ? std::make_unique<server::Scheduler>(server::SchedulerOptions{.slots = o.parallel, .queue = o.queue},
                                                    std::move(batch), *s.tokenizer, metrics)
              : std::make_unique<server::Scheduler>(server::SchedulerOptions{.slots = o.parallel, .queue = o.queue},
                                                    factory, *s.tokenizer, metrics);
  server::Scheduler& scheduler = *scheduler_ptr;
  return listen_and_serve(o, served, policies, scheduler, metrics, device_name, kv_note);
}

#endif

}  // namespace tessera::cli
