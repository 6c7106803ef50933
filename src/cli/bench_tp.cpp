// `tessera bench --gpus N`: prefill and decode rates of the tensor-parallel engine (docs/multi-gpu.md) at
// several depths, dense and each --attn policy, one table (markdown). Ranks are forked here (this process
// loads the model and tokenizer and never touches CUDA) or started by torchrun / mpirun. Each (depth, policy)
// gets its own placement: the genetic search on the FLOP cost model of that depth (the placement depends on
// the prompt's length).

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#include "parallel/launch.h"
#include "parallel/placement.h"
#include "parallel/shard.h"
#include "eval/haystack.h"
#ifdef TESSERA_WITH_TP
#include <cuda_runtime.h>

#include "parallel/cuda/collective.h"
#include "parallel/cuda/rank_gpu.h"
#include "parallel/cuda/tp_device_model.h"
#include "parallel/cuda/tp_gpu_forward.h"
#include "runtime/cuda/gemm.h"
#endif

namespace tessera::cli {

int bench_tp_command(const BenchOptions& o) {
  check_tensor_parallel_precisions(o.cuda);
  check(o.stream.methods.empty(), "--gpus: streaming rows (--stream) run on one device only");
#ifndef TESSERA_WITH_TP
  throw Error(
      "--gpus " + std::to_string(o.gpus) +
      ": this tessera was built without the tensor-parallel engine (CUDA and NCCL; see docs/multi-gpu.md)");
#else
  const Session s = Session::open(o.model);
  const runtime::ModelConfig& c = s.model->config();
  const int max_depth = *std::max_element(o.depths.begin(), o.depths.end());
  check(max_depth + o.decode_tokens <= c.context_length,
        "bench: depth " + std::to_string(max_depth) + " plus --decode exceeds the model's context of " +
            std::to_string(c.context_length));
  const std::vector<int32_t> tokens = bench_tokens(s, max_depth);

  const int32_t world = parallel::world_for_gpus(o.gpus);
  std::vector<std::string> specs = {"dense"};
  for (const std::string& a : o.attn)
    if (a != "dense") specs.push_back(a);
  std::map<std::string, attn::AttentionPolicy> policies;
  std::map<std::pair<int, std::string>, parallel::Placement> placements;
  for (const std::string& spec : specs) {
    policies[spec] = s.policy(spec);
    const attn::AttentionPolicy costs =
        policies[spec].table().empty() ? attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads,
                                                                        c.num_kv_heads, attn::DensePattern{})
                                       : policies[spec];
    for (int depth : o.depths)
      placements[{depth, spec}] = parallel::place(parallel::flop_costs(costs, depth, c.hidden_size, c.head_dim),
                                              world, parallel::PlacementMethod::kGenetic);
  }
  std::printf("model: %s; tensor parallel over %d GPUs (genetic placement per depth and policy)\n",
              c.summary().c_str(), world);
  std::fflush(stdout);

  return parallel::run_gpu_ranks(o.gpus, [&](const parallel::RankEnv& env, parallel::RankGpu& g) -> int {
    parallel::Collective* comm = &g.comm;
    cudaStream_t stream = g.stream;
    {
      if (env.rank == 0)
        std::printf(
            "\n| depth | policy | prefill (s) | tok/s | vs dense | decode tok/s "
            "|\n|---:|---|---:|---:|---:|---:|\n");
      for (int depth : o.depths) {
        double dense_s = 0;
        for (const std::string& spec : specs) {
          const parallel::Placement& p = placements.at({depth, spec});
          auto model = parallel::TpDeviceModel::upload(*s.model, parallel::rank_plan(c, p, env.rank));
          parallel::TpForwardOptions fo;
          fo.cuda_attention = cuda_attention_options(o.cuda, true);
          parallel::TpGpuForward fwd(*model, g.comm, fo, stream, g.gemm);
          fwd.reserve(depth + o.decode_tokens);
          const std::span<const int32_t> prompt(tokens.data(), static_cast<size_t>(depth));
          const attn::AttentionPolicy* policy = &policies.at(spec);
          double best = 1e30;
          std::vector<float> logits;
          for (int r = 0; r < std::max(1, o.reps); ++r) {
            comm->barrier(stream);
            const double t0 = now_seconds();
            logits = fwd.run(prompt, 0, policy, depth, true);
            comm->barrier(stream);
            best = std::min(best, now_seconds() - t0);
          }
          if (spec == "dense") dense_s = best;
          const double t1 = now_seconds();
          int32_t next =
              static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
          for (int i = 0; i < o.decode_tokens; ++i) {
            logits = fwd.run(std::span<const int32_t>(&next, 1), depth + i, nullptr, depth + i + 1, true);
            next = parallel::broadcast_token(
                *comm, static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()),
                stream);
          }
          const double decode = now_seconds() - t1;
          if (env.rank == 0)
            std::printf("| %d | %s | %.3f | %.0f | %.2fx | %.1f |\n", depth, spec.c_str(), best, depth / best,
                        dense_s > 0 ? dense_s / best : 1.0, decode > 0 ? o.decode_tokens / decode : 0.0);
          std::fflush(stdout);
        }
      }
    }
    return 0;
  });
#endif
}

}  // namespace tessera::cli
