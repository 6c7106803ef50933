// tessera — the command line: run, bench, inspect.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

namespace {

// Debian 12's OpenBLAS (0.3.21) does not recognise recent Xeons (Sapphire/Emerald Rapids) and falls back to its
// generic "Prescott" kernels, about 10x slower than its AVX-512 ones. The core type can only be chosen before the
// library initialises, i.e. before main: so pick it from the CPU's features and re-execute once.
void choose_openblas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const char* core = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? "SkylakeX"
                     : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")   ? "Haswell"
                                                                                         : nullptr;
  if (core == nullptr) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then carry on with the library's own choice
}

}  // namespace

int main(int argc, char** argv) {
  choose_openblas_core(argv);
  using namespace tessera::cli;
  CLI::App app{"tessera: long-context LLM inference with per-head sparse attention"};
  app.require_subcommand(1);

  RunOptions run;
  auto* r = app.add_subcommand("run", "Run a prompt through a model (dense or sparse attention)");
  r->add_option("-m,--model", run.model, "Model: .gguf, .safetensors or a Hugging Face folder")->required();
  auto* p = r->add_option("-p,--prompt", run.prompt, "Prompt text");
  auto* pf = r->add_option("-f,--prompt-file", run.prompt_file, "File holding the prompt");
  p->excludes(pf);
  r->add_flag("--chat", run.chat, "Wrap the prompt as a user turn in the model's chat format");
  r->add_option("--system", run.system, "System message (with --chat)");
  r->add_option("--attn", run.attn,
                "Attention policy: dense, ashape[:sink=,local=], triangle[:sink=,local=,last=], vs|minference[:v=,s=], "
                "bs[:top_k=], moa[:alpha=,beta=], trianglemix[:start=,inner=dense|vs], or a policy file")
      ->capture_default_str();
  r->add_flag("--compare", run.compare, "Run dense first, then --attn; print both answers and the speedup");
  r->add_option("-n,--max-tokens", run.max_tokens, "Tokens to generate")->capture_default_str();
  r->add_option("--temperature", run.sampling.temperature, "0 = greedy")->capture_default_str();
  r->add_option("--top-k", run.sampling.top_k, "0 = off")->capture_default_str();
  r->add_option("--top-p", run.sampling.top_p, "1 = off")->capture_default_str();
  r->add_option("--seed", run.sampling.seed, "Sampling seed")->capture_default_str();
  r->add_option("--chunk", run.chunk, "Prefill chunk size (tokens)")->capture_default_str();
  r->add_option("--max-context", run.max_context, "Context limit (default: the model's)");
  auto* nd = r->add_option("--needle", run.needle_tokens,
                           "Needle-in-a-haystack prompt of this many tokens instead of --prompt");
  nd->excludes(p)->excludes(pf);
  r->add_option("--needle-depth", run.needle_depth, "Needle position, 0..1")->capture_default_str();
  r->add_option("--needle-seed", run.needle_seed, "Seed of the needle case")->capture_default_str();
  r->add_option("--haystack", run.haystack, "kjv, noise[:seed] or file:<path>")->capture_default_str();
  r->add_flag("--progress", run.progress, "Show the prefill progress bar even when stderr is not a terminal");

  BenchOptions bench;
  auto* b = app.add_subcommand("bench", "Prefill and decode rates at several depths, dense and sparse");
  b->add_option("-m,--model", bench.model, "Model file or folder")->required();
  b->add_option("-d,--depths", bench.depths, "Prompt lengths")->delimiter(',')->capture_default_str();
  b->add_option("--attn", bench.attn, "Sparse policies to compare with dense")->delimiter(';')->capture_default_str();
  b->add_option("--decode", bench.decode_tokens, "Decode steps timed at each depth")->capture_default_str();
  b->add_option("--chunk", bench.chunk, "Prefill chunk size")->capture_default_str();
  b->add_option("--reps", bench.reps, "Repetitions (best is reported)")->capture_default_str();
  b->add_option("--format", bench.format, "md, csv or json")->check(CLI::IsMember({"md", "csv", "json"}))->capture_default_str();

  InspectOptions inspect;
  auto* i = app.add_subcommand("inspect", "Show what a model file holds");
  i->add_option("model", inspect.model, "Model file or folder")->required();
  i->add_flag("--tensors", inspect.tensors, "List every tensor");
  i->add_flag("--metadata", inspect.metadata, "List every metadata key");

  CLI11_PARSE(app, argc, argv);
  try {
    if (r->parsed()) return run_command(run);
    if (b->parsed()) return bench_command(bench);
    if (i->parsed()) return inspect_command(inspect);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
