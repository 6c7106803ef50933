// `tessera run --gpus N [--placement FILE]`: the prompt through the tensor-parallel engine
// (docs/multi-gpu.md), one process per GPU. Without WORLD_SIZE in the environment this process forks N ranks
// on this host (it never touches CUDA itself); with it (torchrun, mpirun, or by hand on several hosts) this
// process is one rank. Greedy or sampled decoding needs no broadcast: every rank computes the same logits
// (the all-reduce gives every rank the same sum) and draws with the same seed; rank 0 prints.

#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#include "parallel/launch.h"
#include "parallel/placement.h"
#include "parallel/shard.h"
#ifdef TESSERA_WITH_TP
#include <cuda_runtime.h>

#include "parallel/cuda/collective.h"
#include "parallel/cuda/rank_gpu.h"
#include "parallel/cuda/tp_device_model.h"
#include "parallel/cuda/tp_gpu_forward.h"
#include "runtime/sampling.h"
#include "runtime/cuda/gemm.h"
#endif

namespace tessera::cli {

int run_tp_command(const RunOptions& o) {
  check_tensor_parallel_precisions(o.cuda);
  check(o.needle_tokens == 0 && o.stream.methods.empty() && !o.compare,
        "--gpus runs --prompt or --prompt-file with --attn (not --needle, --stream or --compare)");
#ifndef TESSERA_WITH_TP
  throw Error(
      "--gpus " + std::to_string(o.gpus) +
      ": this tessera was built without the tensor-parallel engine (CUDA and NCCL; see docs/multi-gpu.md)");
#else
  std::string text = o.prompt;
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    check(static_cast<bool>(in), o.prompt_file + ": cannot read the prompt file");
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  check(!text.empty(), "no prompt: pass --prompt TEXT or --prompt-file FILE");
  // The host model and tokenizer load here, before the ranks are forked (they share them; none touches CUDA
  // here).
  const Session s = Session::open(o.model);
  const runtime::ModelConfig& c = s.model->config();
  check_prompt_text_fits(s, text.size(), o.max_context > 0 ? o.max_context : c.context_length,
                         o.prompt_file.empty() ? "the prompt" : o.prompt_file);
  const std::vector<int32_t> prompt = s.encode_prompt(text, o.chat, o.system);
  std::printf("model: %s; prompt: %s tokens\n", c.summary().c_str(),
              with_commas(static_cast<int64_t>(prompt.size())).c_str());
  const int32_t world = parallel::world_for_gpus(o.gpus);
  const attn::AttentionPolicy policy = s.policy(o.attn);
  parallel::Placement placement;
  std::string note;
  const std::optional<parallel::Placement> in_plan =
      o.placement.empty()
          ? parallel::placement_in_policy_file(o.attn, world, c.num_layers, c.num_q_heads, c.num_kv_heads, &note)
          : std::nullopt;
  if (!note.empty()) std::printf("%s\n", note.c_str());
  if (!o.placement.empty()) {
    placement = parallel::load_placement(o.placement, world, c.num_layers, c.num_q_heads, c.num_kv_heads);
  } else if (in_plan) {
    placement = *in_plan;  // saved by `tessera plan --gpus N`
  } else {
    const attn::AttentionPolicy costs_policy =
        policy.table().empty() ? attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads,
                                                                attn::DensePattern{})
                               : policy;
    placement = parallel::place(
        parallel::flop_costs(costs_policy, static_cast<int64_t>(prompt.size()), c.hidden_size, c.head_dim), world,
        parallel::PlacementMethod::kGenetic);
  }
  const int32_t capacity = static_cast<int32_t>(prompt.size()) + o.max_tokens;
  return parallel::run_gpu_ranks(o.gpus, [&](const parallel::RankEnv& env, parallel::RankGpu& g) -> int {
    parallel::Collective* comm = &g.comm;
    cudaStream_t stream = g.stream;
    {
      const double t0 = now_seconds();
      auto model = parallel::TpDeviceModel::upload(*s.model, parallel::rank_plan(c, placement, env.rank));
      parallel::TpForwardOptions fo;
      fo.cuda_attention = cuda_attention_options(o.cuda, true);
      parallel::TpGpuForward fwd(*model, g.comm, fo, stream, g.gemm);
      fwd.reserve(capacity);
      if (env.rank == 0)
        std::printf(
            "tensor parallel: %d GPUs, placement %s; rank 0 holds %.2f GB of weights (loaded in %.1f s)\n",
            world, placement.method.c_str(), static_cast<double>(model->bytes()) / 1e9, now_seconds() - t0);
      comm->barrier(stream);
      const double t1 = now_seconds();
      std::vector<float> logits = fwd.run(prompt, 0, &policy, static_cast<int32_t>(prompt.size()), true);
      const double prefill = now_seconds() - t1;
      if (env.rank == 0 && !o.logits_out.empty()) write_logits(o.logits_out, logits);
      runtime::Sampler sampler(o.sampling);
      sampler.set_prompt(prompt);
      std::vector<int32_t> out;
      const double t2 = now_seconds();
      for (int i = 0; i < o.max_tokens; ++i) {
        const int32_t next = parallel::broadcast_token(*comm, sampler.sample(logits), stream);
        if (s.tokenizer->is_end_of_generation(next)) break;
        out.push_back(next);
        if (i + 1 == o.max_tokens) break;
        const int32_t pos = static_cast<int32_t>(prompt.size() + out.size()) - 1;
        logits = fwd.run(std::span<const int32_t>(&out.back(), 1), pos, nullptr, pos + 1, true);
      }
      const double decode = now_seconds() - t2;
      if (env.rank == 0) {
        std::printf("%s\n", s.tokenizer->decode(out).c_str());
        std::printf(
            "[%s, %d GPUs] prefill %s tokens in %.2f s (%.0f tok/s); decode %zu tokens at %.1f tok/s\n",
            o.attn.c_str(), world, with_commas(static_cast<int64_t>(prompt.size())).c_str(), prefill,
            static_cast<double>(prompt.size()) / prefill, out.size(),
            decode > 0 ? static_cast<double>(out.size()) / decode : 0.0);
      }
    }
    return 0;
  });
#endif
}

}  // namespace tessera::cli
