// tessera — the command line: run, bench, eval, inspect, tokenize, serve, plan. Exit codes (cli/usage.h,
// docs/cli.md): 0 done, 1 failed while running, 2 a wrong command line (CLI11's parse errors, unknown flags, flag
// values out of range), found before anything is loaded.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/usage.h"
#include "core/crash_report.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "core/thread_pool.h"
#include "runtime/kv_cache.h"

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

// --threads: the size of the one CPU thread pool (ThreadPool::global); run, bench, serve and eval.
void add_threads_option(CLI::App* app) {
  app->add_option_function<int>("--threads", [](int n) { tessera::ThreadPool::set_global_threads(n); },
                                "CPU threads (default: TESSERA_NUM_THREADS, else every hardware thread)")
      ->check(CLI::Range(1, 4096));
  app->add_option_function<std::string>(
         "--kv-type",
         [](const std::string& t) {
           if (t == "fp8")
             tessera::cli::set_kv_fp8(true);  // the GPU's (kv_fp8 refuses it on the CPU)
           else
             tessera::runtime::set_default_kv_type(tessera::runtime::parse_kv_type(t));
         },
         "KV cache element type: on the CPU f32, bf16 or f16 (default: TESSERA_KV_TYPE, else f16); on the GPU bf16 "
         "(default) or fp8 (E4M3 blocks, a scale per K/V row: half the KV bytes)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "fp8"}));
}

// --device and the GPU's knobs (CudaAttentionFlags), and --threads: run, bench and serve.
void add_device_options(CLI::App* app, std::string& device, tessera::cli::CudaAttentionFlags& f) {
  add_threads_option(app);
  app->add_option("--device", device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))->capture_default_str();
  app->add_option("--prefill-kernel", f.prefill_kernel,
                  "GPU prefill kernel: auto (the Hopper kernel where it applies), mma or wgmma")
      ->check(CLI::IsMember({"auto", "mma", "wgmma"}));
  app->add_option("--dense-backend", f.dense_backend, "GPU dense attention: auto (the faster), ours or cudnn")
      ->check(CLI::IsMember({"auto", "ours", "cudnn"}));
  app->add_option("--gemm", f.gemm,
                  "GPU GEMM precision: bf16 (default), fp8 (E4M3 weights and activations: a scale per output channel "
                  "and per token, TESSERA_FP8_SCALING=tensor for one per tensor; compute capability 8.9+) or w4 (the "
                  "decode step's products of up to 8 rows over 4-bit weights, groups of 128; the prefill bf16)")
      ->check(CLI::IsMember({"bf16", "fp8", "w4"}));
}

// --stream and its sizes (StreamFlags); `several`: a comma-separated list of methods (bench, eval).
void add_stream_options(CLI::App* app, tessera::cli::StreamFlags& f, bool several) {
  auto* m = app->add_option("--stream", f.methods,
                            several ? "Streaming memory over unbounded context: ltri, infllm, streamingllm "
                                      "(comma-separated; each runs beside dense; docs/streaming.md)"
                                    : "Streaming memory over unbounded context: ltri, infllm or streamingllm "
                                      "(docs/streaming.md)");
  if (several) m->delimiter(',');
  m->check(CLI::IsMember({"ltri", "infllm", "streamingllm"}));
  if (!several) m->expected(1);
  app->add_option("--stream-sinks", f.sinks, "Streaming: initial tokens always attended")->capture_default_str();
  app->add_option("--stream-local", f.local, "Streaming: local window (tokens)")->capture_default_str();
  app->add_option("--stream-chunk", f.chunk, "Streaming: prefill chunk (tokens)")->capture_default_str();
  app->add_option("--stream-block", f.block, "Streaming: tokens per evicted block")->capture_default_str();
  app->add_option("--stream-last-chunk", f.last_chunk,
                  "Streaming: the prompt's last chunk (the query retrieval is made for) holds at most this many tokens "
                  "(0: --stream-chunk)")
      ->capture_default_str();
  app->add_option("--stream-top-k", f.top_k,
                  "Streaming: blocks retrieved per chunk (streamingllm gets their room as local window)")
      ->capture_default_str();
  app->add_option("--stream-host-budget", f.host_budget,
                  "Streaming: host memory for evicted KV blocks, e.g. 4G (default: the host memory budget)");
  app->add_option("--stream-host-kv", f.host_kv,
                  "Streaming on the GPU: evicted KV blocks in host memory as bf16 or fp8 (E4M3, a scale per token and "
                  "head: 0.52x the bytes)")
      ->capture_default_str();
  app->add_option("--stream-retrieval-heads", f.retrieval_heads,
                  "Streaming (ltri): file of 'layer head score' lines; the best head per layer above 0.1 votes");
  app->add_option("--stream-index-ratio", f.index_ratio,
                  "Streaming (ltri): target evicted tokens per index vector; each layer's retention slope lambda is "
                  "the smallest meeting it (0: lambda 3, 20 in the first four layers)")
      ->capture_default_str();
  app->add_option("--stream-index-heads", f.index_heads,
                  "Streaming (ltri, with --stream-retrieval-heads): the kv heads each layer's span index keeps: "
                  "'retrieval' (the retrieval heads' only: the same retrieval, a smaller index) or 'all'")
      ->capture_default_str();
  app->add_option("--stream-early-layers", f.early_layers,
                  "Streaming (ltri, with --stream-retrieval-heads): the layers before the first retrieval layer "
                  "'score' their blocks with every head, or take the previous chunk's collaborative 'votes' (no "
                  "index, no scoring for them)")
      ->capture_default_str();
  app->add_option("--stream-map-heads", f.map_heads,
                  "Streaming (ltri, with --stream-retrieval-heads): a layer with a retrieval head finds its spans in "
                  "the attention map of 'all' query heads (summed) or of its 'retrieval' head alone")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  tessera::install_crash_report();
  choose_openblas_core(argv);
  using namespace tessera::cli;
  CLI::App app{"tessera: long-context LLM inference with per-head sparse attention"};
  app.require_subcommand(1);
  app.fallthrough();  // options of the program itself may follow the subcommand
  app.set_version_flag("--version", std::string("tessera ") + TESSERA_VERSION);
  std::string memory_budget;
  app.add_option("--memory-budget", memory_budget,
                 "Host memory any one allocation may take (e.g. 16G; default: TESSERA_MEMORY_BUDGET, else the "
                 "machine's memory): weights, KV cache, prompts are checked against it before they are allocated");

  RunOptions run;
  auto* r = app.add_subcommand("run", "Run a prompt through a model (dense or sparse attention)");
  r->add_option("-m,--model", run.model, "Model: .gguf, .safetensors or a Hugging Face folder")->required();
  auto* p = r->add_option("-p,--prompt", run.prompt, "Prompt text");
  auto* pf = r->add_option("-f,--prompt-file,--file", run.prompt_file, "File holding the prompt (- for standard input)");
  p->excludes(pf);
  r->add_flag("--chat", run.chat, "Wrap the prompt as a user turn in the model's chat format");
  r->add_option("--system,--system-prompt", run.system, "System message (with --chat)");
  r->add_option("--attn", run.attn,
                "Attention policy: dense, ashape[:sink=,local=], triangle[:sink=,local=,last=], vs|minference[:v=,s=], "
                "bs[:top_k=], moa[:alpha=,beta=], trianglemix[:start=,inner=dense|vs], or a policy file")
      ->capture_default_str();
  r->add_flag("--compare", run.compare, "Run dense first, then --attn; print both answers and the speedup");
  r->add_option("-n,--max-tokens,--n-predict", run.max_tokens,
                "Tokens to generate (-1: until the end of the text or the context is full)")
      ->capture_default_str();
  r->add_option("--temperature,--temp", run.sampling.temperature, "0 = greedy")->capture_default_str();
  r->add_option("--top-k", run.sampling.top_k, "0 = off")->capture_default_str();
  r->add_option("--top-p", run.sampling.top_p, "1 = off")->capture_default_str();
  r->add_option("--min-p", run.sampling.min_p, "0 = off")->capture_default_str();
  r->add_option("--repeat-penalty", run.sampling.repetition_penalty,
                "1 = off; over the prompt and the answer (transformers' rule)")
      ->capture_default_str();
  r->add_option("--presence-penalty", run.sampling.presence_penalty, "0 = off; over the answer")->capture_default_str();
  r->add_option("--frequency-penalty", run.sampling.frequency_penalty, "0 = off; over the answer")
      ->capture_default_str();
  r->add_option("-s,--seed", run.sampling.seed, "Sampling seed")->capture_default_str();
  auto* gr = r->add_option("--grammar", run.grammar,
                           "The answer follows this grammar (EBNF as llama.cpp's GBNF; root rule 'root')");
  auto* grf = r->add_option("--grammar-file", run.grammar_file, "--grammar read from a file");
  auto* js = r->add_option("-j,--json-schema", run.json_schema, "The answer is JSON valid under this JSON Schema");
  auto* jsf = r->add_option("--json-schema-file", run.json_schema_file, "--json-schema read from a file");
  gr->excludes(grf)->excludes(js)->excludes(jsf);
  grf->excludes(js)->excludes(jsf);
  js->excludes(jsf);
  r->add_option("--chunk", run.chunk, "Prefill chunk size (tokens)")->capture_default_str();
  r->add_option("-c,--max-context,--ctx-size", run.max_context, "Context limit (default and 0: the model's)");
  auto* nd = r->add_option("--needle", run.needle_tokens,
                           "Needle-in-a-haystack prompt of this many tokens instead of --prompt");
  nd->excludes(p)->excludes(pf);
  r->add_option("--needle-depth", run.needle_depth, "Needle position, 0..1")->capture_default_str();
  r->add_option("--needle-seed", run.needle_seed, "Seed of the needle case")->capture_default_str();
  r->add_option("--haystack", run.haystack, "kjv, noise[:seed] or file:<path>")->capture_default_str();
  r->add_flag("--progress", run.progress, "Show the prefill progress bar even when stderr is not a terminal");
  auto* quiet = r->add_flag("-q,--quiet", run.quiet, "Print only the generated text (and a newline) on stdout");
  r->add_flag("--json", run.json,
              "Print one JSON object on stdout: text, tokens, finish_reason, timings (docs/cli.md)")
      ->excludes(quiet);
  add_device_options(r, run.device, run.cuda);
  add_stream_options(r, run.stream, false);
  r->add_option("--gpus", run.gpus, "Tensor parallelism over this many GPUs (NCCL; one process per GPU, forked here "
                                    "or started by torchrun/mpirun: docs/multi-gpu.md)")
      ->check(CLI::Range(1, 1024));
  r->add_option("--placement", run.placement, "Head placement file for --gpus (tp_bench writes them; default: genetic)");
  r->add_option("--logits-out", run.logits_out,
                "Write the logits after the prompt (raw f32, vocabulary-many) to this file, e.g. to compare devices");
  r->add_option("--stream-trace", run.stream_trace,
                "With --stream: write the blocks every layer retrieved after each prefill chunk and decode step "
                "(\"prefill|decode END LAYER: blocks\" lines), e.g. to compare the CPU and GPU paths");

  BenchOptions bench;
  auto* b = app.add_subcommand("bench", "Prefill and decode rates at several depths, dense and sparse");
  b->add_option("-m,--model", bench.model, "Model file or folder")->required();
  b->add_option("-d,--depths", bench.depths, "Prompt lengths")->delimiter(',')->capture_default_str();
  b->add_option("--gpus", bench.gpus, "Tensor parallelism over this many GPUs (NCCL, one process per GPU: "
                                      "docs/multi-gpu.md)")
      ->check(CLI::Range(1, 1024));
  b->add_option("--attn", bench.attn, "Sparse policies to compare with dense")->delimiter(';')->capture_default_str();
  b->add_option("--decode", bench.decode_tokens, "Decode steps timed at each depth")->capture_default_str();
  b->add_option("--chunk", bench.chunk, "Prefill chunk size")->capture_default_str();
  b->add_option("--reps", bench.reps, "Repetitions (best is reported)")->capture_default_str();
  auto* bf = b->add_option("--format", bench.format, "md, csv or json")
                ->check(CLI::IsMember({"md", "csv", "json"}))->capture_default_str();
  bool bench_json = false;
  b->add_flag("--json", bench_json, "The same as --format json")->excludes(bf);
  add_device_options(b, bench.device, bench.cuda);
  add_stream_options(b, bench.stream, true);

  EvalOptions ev;
  auto* ec = app.add_subcommand("eval", "Accuracy: needle grids and RULER-style tasks, dense vs sparse on the same cases");
  add_threads_option(ec);
  ec->add_option("-m,--model", ev.model, "Model file or folder")->required();
  ec->add_option("--tasks", ev.tasks,
                "Tasks: niah_single, niah_multikey, niah_multivalue, passkey, variable_tracking, common_words, "
                "frequent_words (\"none\": skip the task suite)")
      ->delimiter(',')->capture_default_str();
  ec->add_option("-l,--lengths", ev.lengths, "Context lengths in tokens (whole prompt incl. answer budget)")
      ->delimiter(',')->capture_default_str();
  ec->add_option("--depths", ev.depths, "Needle depths in percent")->delimiter(',')->capture_default_str();
  ec->add_option("--samples", ev.samples, "Cases per (task, length, depth)")->capture_default_str();
  ec->add_option("--seed", ev.seed, "Seed of the cases")->capture_default_str();
  ec->add_option("--attn", ev.attn, "Sparse policies (';'-separated specs as for run --attn); dense always runs")
      ->delimiter(';')->capture_default_str();
  ec->add_option("--haystack", ev.haystack, "kjv, noise[:seed] or file:<path>")->capture_default_str();
  ec->add_option("--chat", ev.chat, "Chat template: auto (when the model has one), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}))->capture_default_str();
  ec->add_option("--answer-tokens", ev.answer_tokens, "Answer budget (0: the task's RULER budget)")->capture_default_str();
  ec->add_flag("--full-answers", ev.full_answers, "Generate the whole budget even once every answer appeared");
  ec->add_option("--chunk", ev.chunk, "Prefill chunk size")->capture_default_str();
  ec->add_option("--device", ev.device, "Where the task cases run: cpu, cuda or auto (the bf16 GPU engine when a GPU is usable)")
      ->capture_default_str();
  ec->add_option("--gemm", ev.gemm,
                 "GPU GEMM precision of the task cases and the perplexity: bf16 (default), fp8 or w4 (decode only)")
      ->check(CLI::IsMember({"bf16", "fp8", "w4"}));
  ec->add_option("-o,--out", ev.out, "Output folder: results.json, report.md, heatmaps")->capture_default_str();
  ec->add_flag("--resume", ev.resume, "Keep the results already in the output folder and run only the missing ones");
  ec->add_flag("--report-only", ev.report_only, "Rewrite report.md and heatmaps from results.json");
  ec->add_option("--layer-stats", ev.layer_stats_lengths,
                "Per-layer attention recall / output error / density of each policy at these lengths")
      ->delimiter(',');
  ec->add_option("--perplexity", ev.perplexity_lengths, "Perplexity of the haystack text at these lengths")
      ->delimiter(',');
  add_stream_options(ec, ev.stream, true);
  ec->add_option("--retrieval-heads-out", ev.retrieval_heads_out,
                 "Find retrieval heads (Wu et al.) on niah_single cases at --lengths/--depths and write them here "
                 "(the file --stream-retrieval-heads reads)");

  InspectOptions inspect;
  auto* i = app.add_subcommand("inspect", "Show what a model file holds");
  i->add_option("model", inspect.model, "Model file or folder")->required();
  i->add_flag("--tensors", inspect.tensors, "List every tensor");
  i->add_flag("--metadata", inspect.metadata, "List every metadata key");

  TokenizeOptions tok;
  auto* tk = app.add_subcommand("tokenize", "Show the token ids of a text, as run prefills it (no weights are loaded)");
  tk->add_option("-m,--model", tok.model, "Model: .gguf, .safetensors or a Hugging Face folder")->required();
  auto* tp = tk->add_option("-p,--prompt", tok.prompt, "Text");
  tk->add_option("-f,--prompt-file,--file", tok.prompt_file, "File holding the text (- for standard input)")->excludes(tp);
  tk->add_flag("--chat", tok.chat, "As run --chat: the text as a user turn in the model's chat format");
  tk->add_option("--system,--system-prompt", tok.system, "System message (with --chat)");
  tk->add_flag("--no-special", tok.no_special, "Plain text: add no BOS (or other special tokens the tokenizer adds)");
  tk->add_flag("--parse-special", tok.parse_special,
               "Plain text: special tokens written in the text (<|im_start|>, ...) are those tokens");
  tk->add_flag("--ids", tok.ids, "Print only the ids, as one list: [1, 2, 3]");
  tk->add_flag("--json", tok.json, "Print one JSON object: tokens, pieces, count");

  PlanOptions plan;
  std::optional<double> plan_budget;
  auto* pl = app.add_subcommand("plan", "Find an attention plan for a model: MInference's search, MoA's optimiser or "
                                        "TriangleMix's probe (docs/plans/README.md)");
  pl->add_option("--method", plan.method, "minference, moa or trianglemix; or measure: the executed attention density "
                 "of the --attn policies on a held-out retrieval prompt at each --lengths (written to -o as JSON)")
      ->required();
  pl->add_option("--attn", plan.attn, "--method measure: the policies, ';'-separated (plan files or presets)");
  pl->add_option("-m,--model", plan.model, "Model file or folder")->required();
  pl->add_option("--budget", plan_budget, "Mean attention density in (0, 1] (default: minference 0.3, moa 0.5; "
                 "trianglemix: the probe decides)");
  pl->add_option("--calib", plan.calib, "Calibration file: .jsonl of {\"prompt\", \"target\"} or a text file "
                 "(default: synthetic retrieval tasks answered by the dense model)");
  pl->add_option("--lengths", plan.lengths, "Prompt lengths to plan for, in tokens: calibration samples at each (MoA: "
                 "the profiled lengths; MInference: candidates sized for the longest); saved in the plan as its range, "
                 "and run warns for prompts under half or over twice it")
      ->delimiter(',')->capture_default_str();
  pl->add_option("--samples", plan.samples, "Synthetic calibration samples per length")->capture_default_str();
  pl->add_flag("--calib-tasks", plan.calib_tasks,
               "With --calib: also --samples synthetic retrieval tasks per --lengths entry (--seed; the dense model's "
               "answers as targets), so the calibration holds the file's items and long-range retrieval both");
  pl->add_option("--seed", plan.seed, "Seed of the synthetic calibration tasks")->capture_default_str();
  pl->add_option("--answer-tokens", plan.answer_tokens, "Tokens of each dense answer (the loss's targets)")
      ->capture_default_str();
  pl->add_option("--haystack", plan.haystack, "Haystack of the calibration tasks: kjv, noise[:seed], file:PATH")
      ->capture_default_str();
  pl->add_option("--validation-length", plan.validation_lengths,
                 "MoA: perplexity at these unseen lengths (e.g. 2048,4096: the geometric mean over lengths and texts) "
                 "picks among the Pareto plans (0: the least loss)")
      ->delimiter(',')->capture_default_str();
  pl->add_option("--validation-texts", plan.validation_texts,
                 "MoA: held-out texts per --validation-length (passages of the haystack far from the calibration's "
                 "and the evaluation's)")
      ->check(CLI::Range(1, 16))->capture_default_str();
  pl->add_option("--validation-cases", plan.validation_cases,
                 "Held-out retrieval tasks (another seed than the calibration's) at each --validation-length whose dense "
                 "answers a plan should reproduce: MoA picks the Pareto plan keeping most (then the lower perplexity); "
                 "every method reports its plan's agreement (0: none)")
      ->capture_default_str();
  pl->add_option("--compare-with", plan.compare_with,
                 "Presets run beside the plan on the held-out tasks (--validation-cases), each with its executed "
                 "density at the --validation-length(s), in the report (\"compared\"): ';'-separated specs or policy "
                 "files; auto: vs_adaptive;trianglemix and, for MoA, the uniform window of the plan's density; none: "
                 "no comparison")
      ->capture_default_str();
  pl->add_option("--minference-query-rows", plan.minference_query_rows,
                 "MInference: each head's candidate is chosen by its relative output error over all rows and over "
                 "each sample's last N rows (the question and answer, where retrieval reads the needle), weighted by "
                 "--minference-query-weight; 0: all rows only, MInference's criterion (the CPU and the device search "
                 "alike)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  pl->add_option("--minference-query-weight", plan.minference_query_weight,
                 "MInference: the last rows' share of the choice's score: (1 - W) x the error over all rows + W x "
                 "the error over the last --minference-query-rows rows")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  pl->add_flag("--minference-repair", plan.minference_repair,
               "MInference: while the plan keeps fewer held-out answers (--validation-cases) than dense, take out the "
               "candidate whose heads' move to their next-best candidate keeps the most (the held-out agreement "
               "judges the per-head choice)");
  pl->add_option("--moa-loss", plan.moa_loss,
                 "MoA: a rule's loss from the influence it masks: fisher (1/2 mean over the calibration samples of the "
                 "squared first-order change: the second-order term of the KL to the dense model) or first-order "
                 "(MoA's mean; biased by the greedy targets)")
      ->check(CLI::IsMember({"fisher", "first-order"}))->capture_default_str();
  pl->add_flag("--moa-no-sink-only", plan.moa_no_sink_only,
              "MoA: leave out the rules that keep only the sink at a profiled length (span alpha + beta N <= 0), so "
              "every head keeps a window (docs/plans/README.md, \"MoA with long targets\")");
  pl->add_option("--trianglemix-select", plan.trianglemix_select,
                 "TriangleMix: choose the split by held-out validation instead of the probe alone: from the probe's "
                 "split, the earliest layer such that the plans from there on keep every held-out answer dense keeps "
                 "(--validation-cases) and the summed log perplexity of the validation texts stays within this "
                 "tolerance of dense's (e.g. 0.02: 2%)");
  pl->add_flag("--moa-layer-repair", plan.moa_layer_repair,
               "MoA: measure, per layer, the plan's rules against the uniform window of its density on the validation "
               "texts (log perplexity, net of the density each layer adds) and keep the window on the layers where "
               "the rules lose (docs/plans/README.md, \"repaired layer by layer\"); with held-out tasks the repair "
               "stands only if it keeps as many of their answers as the plan");
  pl->add_option("--moa-head-cap", plan.moa_head_cap,
                 "MoA: a per-head cap in (0, 1]: a head may take only rules that mask at most this share of its "
                 "influence mass (mean |block influence| over the samples) at every profiled length; 1: no cap")
      ->capture_default_str();
  pl->add_option("--moa-beta-steps", plan.moa_beta_steps,
                 "MoA: the beta grid of the rule space, betas 0, 1/N, ..., 1 (MoA's own: 8, 54 rules); a finer grid "
                 "lets a plan sit between MoA's widths (e.g. beside a uniform window of beta 0.2466)")
      ->check(CLI::Range(1, 64))->capture_default_str();
  pl->add_option("--moa-profile-out", plan.moa_profile_out,
                 "MoA: also save the gradient profile (the reverse-mode passes' influence) to this file");
  pl->add_option("--moa-profile-in", plan.moa_profile_in,
                 "MoA: plan from a profile saved by --moa-profile-out (made with the same model, --calib and --lengths) "
                 "instead of running the reverse-mode passes again");
  pl->add_option("--threshold", plan.threshold, "TriangleMix: Middle gradient (relative to the largest layer's) "
                 "below which deep layers run Triangle")->capture_default_str();
  pl->add_option("--inner", plan.inner, "TriangleMix: the shallow layers' policy: dense, vs or a policy file")
      ->capture_default_str();
  pl->add_option("--report-lengths", plan.report_lengths, "Lengths of the expected density/FLOPs table")
      ->delimiter(',')->capture_default_str();
  pl->add_option("-o,--out", plan.out, "The plan file to write (tessera policy JSON)")->required();
  pl->add_option("--svg", plan.svg, "The picture (default: beside the plan, .svg)");
  pl->add_option("--device", plan.device,
                 "Where the gradient passes (moa, trianglemix) or the search's forward (minference) run: cpu, cuda "
                 "or auto")
      ->capture_default_str();
  pl->add_option("--gpus", plan.gpus, "Also place the plan's heads over this many tensor-parallel GPUs (FlexAttn; saved "
                                      "in the plan, which `run --gpus N --attn plan.json` then uses)")
      ->check(CLI::Range(1, 1024));
  pl->add_option("--placement", plan.placement, "With --gpus: uniform, greedy or genetic")
      ->check(CLI::IsMember({"uniform", "greedy", "genetic"}))->capture_default_str();
  pl->add_option("--placement-length", plan.placement_length,
                 "With --gpus: the prompt length the placement is for (default: the longest --report-lengths)");
  // The recipes measured to keep every dense answer of 66 held-out cases on SmolLM2-135M and Gemma-3-270M
  // (docs/plans/README.md, "Which plan to use"); tests/cli/habits.py checks that each flag here is one of plan's.
  pl->footer(
      "Recipes that kept every dense answer on SmolLM2 and Gemma-3 (docs/plans/README.md, \"Which plan to use\"):\n"
      "  MoA:         --method moa --lengths 2048,4096 --calib data.jsonl --calib-tasks --samples 12 --seed 7\n"
      "               --budget 0.5 --validation-length 4096 --moa-loss fisher --moa-no-sink-only --moa-layer-repair\n"
      "               --device cuda\n"
      "  MInference:  --method minference --lengths 8192,32768 --samples 1 --budget 0.55 --validation-length 16384\n"
      "  TriangleMix: --method trianglemix --lengths 8192 --samples 4 --validation-length 16384\n"
      "               --trianglemix-select 0.02\n"
      "Set --lengths to the prompt lengths you will run. The report's \"compared\" section puts the plan's held-out\n"
      "answers beside vs_adaptive, trianglemix and the uniform window of its density: raise --budget while the plan\n"
      "keeps fewer than they do (Gemma-3's MoA needed 0.65: its window layers leave the budget to 3 global layers).");

  ServeOptions serve;
  auto* sv = app.add_subcommand("serve", "OpenAI-compatible HTTP server (docs/server.md)");
  sv->add_option("-m,--model", serve.model, "Model: .gguf, .safetensors or a Hugging Face folder")->required();
  sv->add_option("--model-name", serve.model_name, "The name clients pass as \"model\" (default: the file's stem)");
  sv->add_option("--host", serve.host, "Address to listen on")->capture_default_str();
  sv->add_option("--port", serve.port, "Port (0: any free port, printed)")->capture_default_str();
  sv->add_option("--attn", serve.attn, "Default attention policy (as for run --attn); requests pick others with "
                 "\"tessera\": {\"attn\": ...}")->capture_default_str();
  sv->add_option("--policy-dir", serve.policy_dir, "Folder of policy files requests may name (as plans)");
  add_device_options(sv, serve.device, serve.cuda);
  sv->add_option("--parallel", serve.parallel,
                 "Requests generated at once; above 1, the batched engine (continuous batching, paged KV cache)")
      ->capture_default_str();
  sv->add_option("--gpus", serve.gpus, "Tensor parallelism over this many GPUs (NCCL, one process per GPU; one request "
                                       "at a time: docs/multi-gpu.md)")
      ->check(CLI::Range(1, 1024));
  sv->add_option("--placement", serve.placement,
                 "Head placement file for --gpus (default: the --attn plan's, else genetic)");
  sv->add_option("--kv-budget", serve.kv_budget,
                 "KV cache memory of the batched engine, e.g. 8G (default: a quarter of the host memory budget on "
                 "the CPU, 70% of the free device memory on the GPU)");
  sv->add_flag("!--no-prefix-cache", serve.prefix_cache,
              "Batched engine: do not keep prompts' KV blocks for later requests that start with the same tokens "
              "(prefix caching is on by default; docs/runtime.md)");
  sv->add_option("--step-tokens", serve.step_tokens,
                 "Batched engine: tokens a step may run (vLLM's chunked prefill budget): every decoding request's token, "
                 "then prefill tokens up to the budget, so a long prompt arriving does not slow the others' decoding "
                 "(0: none, a --chunk of prefill beside every decode step)")
      ->capture_default_str();
  sv->add_option("--queue", serve.queue, "Requests that may wait for a slot (more get 429)")->capture_default_str();
  sv->add_option("--chunk", serve.chunk, "Prefill chunk size (CPU)")->capture_default_str();
  sv->add_option("-c,--max-context,--ctx-size", serve.max_context, "Context limit (default and 0: the model's)");
  sv->add_option("--api-key", serve.api_key, "Require 'Authorization: Bearer KEY' (also TESSERA_API_KEY)");
  sv->add_option("--timeout", serve.timeout, "Seconds a request may take, queueing included")->capture_default_str();
  sv->add_option("--max-body", serve.max_body_mb, "Request body limit in MiB")->capture_default_str();
  sv->add_flag("--quiet", serve.quiet, "No line per request");
  add_stream_options(sv, serve.stream, false);

  // Usage errors: exit code 2 with "tessera: error: ..." and where the flags are listed. An unknown flag is found
  // before CLI11 parses (which reads -ngl as -n gl).
  const std::string sub = subcommand_of(app, argc, argv);
  const std::string help = "Run 'tessera " + (sub.empty() ? std::string() : sub + " ") + "--help' for the flags.";
  if (const std::string unknown = unknown_argument(app, argc, argv); !unknown.empty()) {
    std::fprintf(stderr, "tessera: error: %s\n%s\n", unknown.c_str(), help.c_str());
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "tessera: error: %s%s\n%s\n", sub.empty() ? "" : (sub + ": ").c_str(), e.what(), help.c_str());
    return kExitUsage;
  }
  try {
    if (!memory_budget.empty()) {
      try {
        tessera::set_host_memory_budget(tessera::parse_byte_size(memory_budget, "--memory-budget"));
      } catch (const tessera::Error& e) {
        throw UsageError(e.what());
      }
    }
    if (r->parsed()) {
      if (run.gpus > 1 || !run.placement.empty()) {
        usage_check(!run.quiet && !run.json && run.max_tokens >= 0 && run.prompt_file != "-",
                    "--quiet, --json, -n -1 and -f - are for one device: not with --gpus or --placement");
        return run_tp_command(run);
      }
      return run_command(run);
    }
    if (b->parsed()) {
      if (bench_json) bench.format = "json";
      return bench.gpus > 1 ? bench_tp_command(bench) : bench_command(bench);
    }
    if (tk->parsed()) return tokenize_command(tok);
    if (i->parsed()) return inspect_command(inspect);
    if (sv->parsed()) return serve_command(serve);
    if (pl->parsed()) {
      plan.budget = plan_budget;
      for (int a = 0; a < argc; ++a) plan.command_line += (a ? " " : "") + std::string(a == 0 ? "tessera" : argv[a]);
      return plan_command(plan);
    }
    if (ec->parsed()) {
      for (int a = 0; a < argc; ++a) ev.command_line += (a ? " " : "") + std::string(a == 0 ? "tessera" : argv[a]);
      if (ev.tasks.size() == 1 && ev.tasks[0] == "none") ev.tasks.clear();
      return eval_command(ev);
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    return kExitUsage;
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    return kExitRuntime;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tessera: error: out of host memory (an allocation beyond what the machine has; lower "
                         "--memory-budget so that such requests are refused with their size)\n");
    return kExitRuntime;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: internal error: %s\n", e.what());
    return kExitRuntime;
  }
  return kExitOk;
}
