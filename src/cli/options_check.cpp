// Checks of every command's options that need no model: run before anything is loaded, so that a typo in a flag or
// an --attn spec fails in milliseconds with the flag's name, not after a multi-gigabyte load (or, for bench, after
// the first dense row).
// Their errors are UsageError (exit code 2), except a policy file's (a file that cannot be read is not a wrong
// command line: exit code 1).
#include <cmath>
#include <filesystem>
#include <string>

#include "attention/pattern/presets.h"
#include "cli/commands.h"
#include "cli/usage.h"
#include "core/error.h"

namespace tessera::cli {

namespace {

const runtime::SamplingOptionNames kSamplingFlags{.temperature = "--temperature",
                                                .top_k = "--top-k",
                                                .top_p = "--top-p",
                                                .min_p = "--min-p",
                                                .repetition_penalty = "--repeat-penalty",
                                                .presence_penalty = "--presence-penalty",
                                                .frequency_penalty = "--frequency-penalty",
                                                .logit_bias = "--logit-bias"};

void check_sampling(const runtime::SamplingOptions& s) {
  try {
    runtime::check_sampling_options(s, kSamplingFlags);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

void check_spec(const std::string& spec, const char* flag) {
  try {
    attn::check_policy_spec(spec);
  } catch (const Error& e) {
    std::error_code ec;
    const bool file = spec.find(':') == std::string::npos && std::filesystem::exists(spec, ec);
    if (file) throw Error(std::string(flag) + ": " + e.what());
    throw UsageError(std::string(flag) + ": " + e.what());
  }
}

void check_chunk(int chunk) { usage_check(chunk > 0, "--chunk must be positive, got " + std::to_string(chunk)); }

// The sizes only: the retrieval-heads file is read (and its errors are exit code 1) when the engine is made.
void check_stream(StreamFlags f, const std::string& device) {
  f.retrieval_heads.clear();
  try {
    for (const std::string& m : f.methods) (void)stream_options(f, m, device == "cuda");
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

}  // namespace

void check_run_options(const RunOptions& o) {
  usage_check(o.max_tokens >= -1, "-n/--max-tokens must be >= 0, or -1 (until the end of the text or a full "
                                  "context), got " + std::to_string(o.max_tokens));
  usage_check(!(o.quiet && o.json), "--quiet and --json are two outputs: pick one");
  usage_check(!o.quiet || !o.compare, "--quiet prints one answer: drop --compare (or use --json, which holds both)");
  check_sampling(o.sampling);
  usage_check(o.system.empty() || o.chat, "--system needs --chat (the system message is a turn of the chat format)");
  check_chunk(o.chunk);
  usage_check(o.max_context >= 0, "--max-context must be >= 0 (0 = the model's), got " + std::to_string(o.max_context));
  usage_check(o.needle_tokens >= 0, "--needle must be a positive number of tokens, got " + std::to_string(o.needle_tokens));
  usage_check(o.needle_depth >= 0 && o.needle_depth <= 1, "--needle-depth must be in [0, 1]");
  usage_check(!o.compare || o.attn != "dense" || !o.stream.methods.empty(),
              "--compare runs dense first and then --attn (or --stream): give a sparse --attn or --stream");
  check_spec(o.attn, "--attn");
  usage_check(!o.compare || o.logits_out.empty(), "--logits-out writes one run's logits: drop --compare");
  usage_check(o.stream.methods.size() <= 1, "run: --stream takes one method");
  usage_check(o.stream_trace.empty() || !o.stream.methods.empty(),
              "--stream-trace records what streaming memory retrieved: add --stream ltri|infllm|streamingllm");
  check_stream(o.stream, o.device);
  usage_check(o.stream.methods.empty() || o.attn == "dense",
              "--stream runs its own layout (dense attention within it); it cannot be combined with --attn " + o.attn);
}

void check_bench_options(const BenchOptions& o) {
  usage_check(!o.depths.empty(), "--depths is empty");
  for (int d : o.depths) usage_check(d > 0, "--depths must be positive, got " + std::to_string(d));
  usage_check(o.decode_tokens >= 0, "--decode must be >= 0, got " + std::to_string(o.decode_tokens));
  usage_check(o.reps >= 1, "--reps must be >= 1, got " + std::to_string(o.reps));
  check_chunk(o.chunk);
  for (const std::string& spec : o.attn) check_spec(spec, "--attn");
  check_stream(o.stream, o.device);
}

void check_eval_options(const EvalOptions& o) {
  check_chunk(o.chunk);
  usage_check(o.answer_tokens >= 0, "--answer-tokens must be >= 0 (0 = the task's budget), got " + std::to_string(o.answer_tokens));
  for (int l : o.layer_stats_lengths) usage_check(l > 0, "--layer-stats lengths must be positive, got " + std::to_string(l));
  for (int l : o.perplexity_lengths) usage_check(l > 1, "--perplexity lengths must be > 1, got " + std::to_string(l));
  for (const std::string& spec : o.attn)
    if (spec != "dense") check_spec(spec, "--attn");
  check_stream(o.stream, o.device);
}

void check_tokenize_options(const TokenizeOptions& o) {
  usage_check(!o.prompt.empty() || !o.prompt_file.empty(), "no text: pass -p TEXT, -f FILE or -f - (standard input)");
  usage_check(o.system.empty() || o.chat, "--system needs --chat (the system message is a turn of the chat format)");
  usage_check(!o.chat || (!o.no_special && !o.parse_special),
              "--chat encodes the chat template as run --chat does: drop --no-special and --parse-special");
  usage_check(!(o.ids && o.json), "--ids and --json are two outputs: pick one");
}

}  // namespace tessera::cli
