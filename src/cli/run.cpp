// `tessera run`: one prompt through a model, with any attention policy; --compare runs dense first.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/session.h"
#include "cli/usage.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "eval/haystack.h"
#include "plan/retrieval_heads.h"
#include "plan/planned_range.h"
#include "eval/scoring.h"
#include "eval/task.h"
#include "runtime/device.h"
#include "runtime/grammar.h"

namespace tessera::cli {

bool use_gpu_device(const std::string& device) { return runtime::device_is_gpu(device); }

attn::gpu::CudaAttentionOptions cuda_attention_options(const CudaAttentionFlags& f, bool gpu) {
  if (!gpu) {
    check(f.prefill_kernel.empty(), "--prefill-kernel applies to --device cuda (this run is on the CPU)");
    check(f.dense_backend.empty(), "--dense-backend applies to --device cuda (this run is on the CPU)");
    check(f.gemm.empty(), "--gemm applies to --device cuda (this run is on the CPU)");
  }
  attn::gpu::CudaAttentionOptions o = attn::gpu::cuda_attention_defaults();
  if (!f.prefill_kernel.empty()) o.kernel = attn::gpu::parse_prefill_kernel(f.prefill_kernel, "--prefill-kernel");
  if (!f.dense_backend.empty()) {
    o.dense_backend = attn::gpu::parse_dense_backend(f.dense_backend, "--dense-backend");
    o.cudnn_any_length = false;
  }
  return o;
}

bool gemm_fp8(const CudaAttentionFlags& f, bool tensor_parallel) {
  check(f.gemm.empty() || f.gemm == "bf16" || f.gemm == "fp8" || f.gemm == "w4",
        "--gemm must be bf16, fp8 or w4, got '" + f.gemm + "'");
  check(f.gemm.empty() || f.gemm == "bf16" || !tensor_parallel,
        "--gemm " + f.gemm + " is not supported with --gpus (tensor parallelism): run on one GPU");
  return f.gemm == "fp8";
}

bool gemm_w4(const CudaAttentionFlags& f, bool tensor_parallel) {
  (void)gemm_fp8(f, tensor_parallel);  // the checks
  return f.gemm == "w4";
}

namespace {
bool kv_fp8_asked = false;  // --kv-type fp8 (set before the command runs)
}  // namespace

void set_kv_fp8(bool on) { kv_fp8_asked = on; }

bool kv_fp8(bool gpu, bool tensor_parallel) {
  check(!kv_fp8_asked || !tensor_parallel,
        "--kv-type fp8 is not supported with --gpus (tensor parallelism): run on one GPU");
  check(!kv_fp8_asked || gpu, "--kv-type fp8 is the GPU's KV type (--device cuda); the CPU's KV cache is f32, bf16 or f16");
  return kv_fp8_asked;
}

void check_tensor_parallel_precisions(const CudaAttentionFlags& flags) {
  (void)gemm_fp8(flags, true);
  (void)kv_fp8(true, true);
}

namespace {

// A prompt file is read whole, so it must be a regular file of a size a prompt can have (1 GiB: far beyond any
// context limit; the exact bound against the model's context follows once the tokenizer is loaded).
constexpr uintmax_t kMaxPromptFileBytes = uintmax_t{1} << 30;

std::string read_prompt_file(const std::string& path) {
  std::error_code ec;
  check(std::filesystem::exists(path, ec), path + ": prompt file not found");
  check(std::filesystem::is_regular_file(path, ec), path + ": not a regular file (the prompt is read from a file)");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  check(!ec, path + ": cannot read the file size: " + ec.message());
  check(size <= kMaxPromptFileBytes, path + ": " + with_commas(static_cast<int64_t>(size)) +
                                         " bytes, more than a prompt file may hold (1 GiB)");
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), path + ": cannot read the prompt file");
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  check(!in.bad() && static_cast<uintmax_t>(in.gcount()) == size, path + ": error while reading the prompt file");
  return text;
}

// Standard input (-f -), read whole, at most kMaxPromptFileBytes.
std::string read_stdin() {
  std::string text;
  char buf[1 << 16];
  while (std::cin.read(buf, sizeof buf) || std::cin.gcount() > 0) {
    text.append(buf, static_cast<size_t>(std::cin.gcount()));
    check(text.size() <= kMaxPromptFileBytes, "standard input (-f -): more than a prompt may hold (1 GiB)");
  }
  check(!std::cin.bad(), "standard input (-f -): read error");
  return text;
}

}  // namespace

std::string read_prompt(const std::string& prompt, const std::string& prompt_file) {
  if (prompt_file.empty()) return prompt;
  return prompt_file == "-" ? read_stdin() : read_prompt_file(prompt_file);
}

namespace {

// Where the text goes while it is generated: nowhere (--json), after "answer: " (the default), alone (--quiet).
enum class Echo { None, Labeled, Raw };

struct Outcome {
  std::string text;
  runtime::EngineStats prefill;  // right after the prefill
  runtime::EngineStats stats;    // at the end
  std::vector<int32_t> tokens;  // the generated ids (the end-of-generation token excluded)
  int64_t generated = 0;
  bool context_full = false;  // generation stopped because the context limit was reached
  std::string finish_reason = "length";  // "stop" (end-of-generation token), "length" (-n), "context" (full)
  double peak_gb = -1;  // GPU: peak device memory in use
  std::string stream_summary;  // streaming memory: what it held at the end
  std::string needle_recall;   // streaming with --needle: was the needle's block retrieved
};

std::string stream_summary(const runtime::StreamingKV& kv) {
  const runtime::StreamStats st = kv.stats();
  const runtime::StreamOptions& so = kv.options();
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "sinks %d + top %d blocks of %d + local %d, chunk %d: %s blocks per layer evicted %s"
                "(%s); index %s vectors in %s spans (%s; %s kv-head vectors); at most %s keys attended per chunk; retrieval %.2f s",
                so.sinks, so.method == runtime::StreamMethod::StreamingLLM ? 0 : so.top_k, so.block, so.local, so.chunk,
                with_commas(st.evicted_blocks).c_str(),
                kv.keeps_evicted() ? "to host memory " : "and dropped (streamingllm never retrieves them) ",
                format_bytes(static_cast<double>(st.host_bytes)).c_str(),
                with_commas(st.index_vectors).c_str(), with_commas(st.index_spans).c_str(), format_bytes(static_cast<double>(st.index_bytes)).c_str(),
                with_commas(st.index_head_vectors).c_str(), with_commas(st.workspace_tokens).c_str(), st.retrieval_seconds);
  return buf;
}

// Where the needle's tokens sit among the evicted blocks, and in how many layers the last prefill chunk retrieved
// the block holding their first token (the paper's recall); "" when the needle is still in the window.
std::string needle_recall(const runtime::StreamingKV& kv, const std::vector<int32_t>& prompt,
                          const std::vector<int32_t>& needle) {
  const int64_t at = plan::find_tokens(prompt, needle);
  const runtime::StreamOptions& so = kv.options();
  if (at < 0) return "needle tokens not found in the prompt";
  if (at < so.sinks) return "needle among the sinks";
  const auto block = static_cast<int32_t>((at - so.sinks) / so.block);
  if (block >= kv.evicted_blocks()) return "needle in the local window";
  int32_t layers = 0;
  const int32_t n = kv.layers();
  for (int32_t l = 0; l < n; ++l) {
    const auto& r = kv.retrieved(l);
    layers += std::find(r.begin(), r.end(), block) != r.end();
  }
  return "needle in evicted block " + std::to_string(block) + " of " + std::to_string(kv.evicted_blocks()) +
         ", retrieved for the last chunk in " + std::to_string(layers) + " of " + std::to_string(n) + " layers";
}

// --stream-trace: "prefill|decode END LAYER: b0 b1 ..." for every layer after each prefill chunk / decode step
// (END: the sequence's length after it), the blocks that layer's last chunk attended.
class StreamTrace {
 public:
  explicit StreamTrace(const std::string& path) {
    if (path.empty()) return;
    out_.open(path);
    check(static_cast<bool>(out_), "--stream-trace " + path + ": cannot write");
  }
  void record(const runtime::StreamingKV* kv, const char* kind) {
    if (!out_.is_open() || kv == nullptr) return;
    for (int32_t l = 0; l < kv->layers(); ++l) {
      out_ << kind << ' ' << kv->length() << ' ' << l << ':';
      for (const int32_t b : kv->retrieved(l)) out_ << ' ' << b;
      out_ << '\n';
    }
  }
  void finish(const std::string& path) {
    if (!out_.is_open()) return;
    out_.flush();
    check(static_cast<bool>(out_), "--stream-trace " + path + ": write failed");
  }

 private:
  std::ofstream out_;
};

// --grammar, --grammar-file, --json-schema, --json-schema-file: the compiled grammar (null: none given).
std::shared_ptr<const runtime::Grammar> run_grammar(const RunOptions& o, const model::Tokenizer& tokenizer) {
  auto read = [](const std::string& flag, const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    check(static_cast<bool>(in), flag + ": cannot read " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  std::string flag, text;
  bool schema = false;
  if (!o.grammar.empty()) flag = "--grammar", text = o.grammar;
  if (!o.grammar_file.empty()) flag = "--grammar-file", text = read(flag, o.grammar_file);
  if (!o.json_schema.empty()) flag = "--json-schema", text = o.json_schema, schema = true;
  if (!o.json_schema_file.empty()) flag = "--json-schema-file", text = read(flag, o.json_schema_file), schema = true;
  if (flag.empty()) return nullptr;
  try {
    runtime::GrammarCompiler compiler(tokenizer);
    return schema ? compiler.json_schema(text) : compiler.ebnf(text);
  } catch (const runtime::GrammarError& e) {
    throw Error(flag + ": " + e.what());
  }
}

Outcome generate_with(runtime::SequenceEngine& engine, const Session& s, const RunOptions& o, const std::string& spec,
                      const std::vector<int32_t>& prompt, Echo echo, const std::vector<int32_t>& needle_tokens) {
  runtime::GenerateOptions g;
  g.max_new_tokens = o.max_tokens;
  g.sampling = o.sampling;
  g.stop_tokens = s.tokenizer->special().end_of_generation;
  g.sampling.grammar = run_grammar(o, *s.tokenizer);
  ProgressBar bar("prefill " + spec, o.progress || (isatty(STDERR_FILENO) && !o.quiet && !o.json));
  model::StreamingDecoder decoder(*s.tokenizer, {.skip_special = true});
  Outcome out;
  bool first = true;
  StreamTrace trace(o.stream_trace);
  const auto streaming = [&engine] { return engine.streaming(); };
  // Prefill with a progress bar, then sample token by token.
  std::vector<float> logits = engine.prefill(prompt, [&](int64_t done, int64_t total) {
    bar.update(done, total);
    trace.record(streaming(), "prefill");
  });
  bar.finish();
  if (!o.logits_out.empty()) write_logits(o.logits_out, logits);
  out.prefill = engine.stats();
  if (engine.streaming() != nullptr && !needle_tokens.empty())
    out.needle_recall = needle_recall(*engine.streaming(), prompt, needle_tokens);
  runtime::Sampler sampler(g.sampling);
  sampler.set_prompt(prompt);  // the repetition penalty counts the prompt
  // Every sampled token comes from fresh logits: a token is sampled from the logits of the position before it and
  // then decoded (appended) so that the next one can be sampled. When the context is full no token can be
  // appended: the last sample is the last token, and the run says it stopped at the limit. -n -1: no budget.
  const bool unlimited = g.max_new_tokens < 0;
  for (int64_t i = 0; unlimited || i < g.max_new_tokens; ++i) {
    const int32_t t = sampler.sample(logits);
    if (s.tokenizer->is_end_of_generation(t)) {
      out.finish_reason = "stop";
      break;
    }
    const std::string piece = decoder.push(t);
    out.text += piece;
    out.tokens.push_back(t);
    ++out.generated;
    if (echo != Echo::None) {
      if (first && echo == Echo::Labeled) std::printf("answer: ");
      first = false;
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    }
    if (!unlimited && i + 1 == g.max_new_tokens) break;
    if (engine.position() >= engine.max_context()) {
      out.context_full = true;
      out.finish_reason = "context";
      break;
    }
    logits = engine.decode(t);
    trace.record(streaming(), "decode");
  }
  trace.finish(o.stream_trace);
  const std::string rest = decoder.flush();
  out.text += rest;
  if (echo != Echo::None) {
    if (first && echo == Echo::Labeled) std::printf("answer: ");
    std::printf("%s\n", rest.c_str());
    std::fflush(stdout);
  }
  if (out.context_full && echo != Echo::None)  // --quiet: stdout holds only the text
    std::fprintf(echo == Echo::Raw ? stderr : stdout,
                 "(generation stopped at the context limit of %s tokens after %lld tokens; raise --max-context to "
                 "generate more)\n",
                 with_commas(engine.max_context()).c_str(), static_cast<long long>(out.generated));
  out.stats = engine.stats();
  if (engine.peak_device_bytes() >= 0) out.peak_gb = engine.peak_device_bytes() / 1e9;
  if (engine.streaming() != nullptr) out.stream_summary = stream_summary(*engine.streaming());
  return out;
}

Outcome generate_once(const Session& s, const runtime::Device& d, const RunOptions& o, const std::string& spec,
                      const std::vector<int32_t>& prompt, Echo echo, const std::vector<int32_t>& needle_tokens = {}) {
  const std::string method = stream_method_of(spec);
  runtime::EngineOptions eo;
  eo.max_context = o.max_context;
  if (!method.empty()) {  // streaming memory
    eo.stream = stream_options(o.stream, method, d.gpu());
  } else {
    eo.chunk_size = o.chunk;
    eo.policy = s.policy(spec);
    if (const auto w = plan::planned_range_warning(spec, static_cast<int64_t>(prompt.size())))
      std::fprintf(stderr, "%s\n", w->c_str());  // a plan made for other lengths (plan/planned_range.h)
  }
  eo.gpu.fp8_kv = kv_fp8(d.gpu());
  if (d.gpu()) {
    eo.gpu.cuda_attention = cuda_attention_options(o.cuda, true);
    eo.gpu.fp8_gemm = gemm_fp8(o.cuda);
    eo.gpu.w4_decode = gemm_w4(o.cuda);
  }
  const std::unique_ptr<runtime::SequenceEngine> engine = d.engine(eo);
  return generate_with(*engine, s, o, spec, prompt, echo, needle_tokens);
}

void print_stats(const std::string& spec, const Outcome& r, int64_t prompt_tokens) {
  const auto& p = r.prefill;
  std::printf("[%s] prefill %s tokens in %.2f s (%.0f tok/s; attention %.2f s, GEMM %.2f s); decode %lld tokens at %.1f tok/s\n",
              spec.c_str(), with_commas(prompt_tokens).c_str(), p.prefill_seconds, p.prefill_tokens_per_second(),
              p.attention_seconds, p.gemm_seconds, static_cast<long long>(r.stats.decode_tokens),
              r.stats.decode_tokens_per_second());
  if (r.peak_gb >= 0) std::printf("[%s] peak device memory %.2f GB\n", spec.c_str(), r.peak_gb);
  if (!r.stream_summary.empty()) std::printf("[%s] %s\n", spec.c_str(), r.stream_summary.c_str());
  if (!r.needle_recall.empty()) std::printf("[%s] %s\n", spec.c_str(), r.needle_recall.c_str());
}

// One run as --json writes it (docs/cli.md#json-output).
nlohmann::json run_json(const std::string& spec, const Outcome& r, int64_t prompt_tokens) {
  const auto& p = r.prefill;
  const double decode_s = r.stats.decode_seconds - r.prefill.decode_seconds;
  nlohmann::json j = {
      {"attn", spec},
      {"text", r.text},
      {"tokens", r.tokens},
      {"prompt_tokens", prompt_tokens},
      {"generated_tokens", r.generated},
      {"finish_reason", r.finish_reason},
      {"timings",
       {{"prefill_s", p.prefill_seconds},
        {"prefill_tokens_per_s", p.prefill_tokens_per_second()},
        {"prefill_attention_s", p.attention_seconds},
        {"prefill_gemm_s", p.gemm_seconds},
        {"decode_s", decode_s},
        {"decode_tokens", r.stats.decode_tokens - p.decode_tokens},
        {"decode_tokens_per_s", decode_s > 0 ? static_cast<double>(r.stats.decode_tokens - p.decode_tokens) / decode_s : 0.0}}},
  };
  if (r.peak_gb >= 0) j["peak_device_gb"] = r.peak_gb;
  if (!r.stream_summary.empty()) j["stream"] = r.stream_summary;
  if (!r.needle_recall.empty()) j["needle_recall"] = r.needle_recall;
  return j;
}

// stdout as --json writes it: one line, text that is not valid UTF-8 replaced (U+FFFD).
void print_json(const nlohmann::json& j) {
  std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  std::fflush(stdout);
}

}  // namespace

int run_command(const RunOptions& o) {
  check_run_options(o);
  if (o.needle_tokens > 0) {
    usage_check(o.prompt.empty() && o.prompt_file.empty(), "--needle replaces --prompt and --prompt-file");
    usage_check(o.needle_depth >= 0 && o.needle_depth <= 1, "--needle-depth must be in [0, 1]");
  }
  usage_check(!o.prompt.empty() || !o.prompt_file.empty() || o.needle_tokens > 0,
              "no prompt: pass --prompt TEXT, --prompt-file FILE (- for standard input) or --needle TOKENS");
  const std::string text = read_prompt(o.prompt, o.prompt_file);
  const std::string what = o.prompt_file.empty() ? std::string("the prompt")
                           : o.prompt_file == "-" ? std::string("standard input (-f -)")
                                                  : o.prompt_file;
  check(!text.empty() || o.needle_tokens > 0, what + " is empty: nothing to run");
  // --quiet and --json: stdout holds the text alone or the JSON object; no progress bar unless --progress.
  const bool plain = !o.quiet && !o.json;
  const double t0 = now_seconds();
  const Session s = Session::open(o.model);
  const auto& c = s.model->config();
  const double load_seconds = now_seconds() - t0;
  if (plain)
    std::printf("model: %s (%s, %d layers, %d/%d heads, head dim %d, context %s) loaded in %.1f s\n", c.name.c_str(),
                std::string(runtime::architecture_name(c.arch)).c_str(), c.num_layers, c.num_q_heads, c.num_kv_heads,
                c.head_dim, with_commas(c.context_length).c_str(), load_seconds);
  if (plain) std::printf("weights: %s\n", s.model->weights().summary().c_str());
  const bool gpu = use_gpu_device_for(o.device, o.stream);
  (void)cuda_attention_options(o.cuda, gpu);  // flags for the GPU on a CPU run: an error before any work
  const std::unique_ptr<runtime::Device> device = runtime::open_device(gpu ? "cuda" : "cpu", *s.model);
  if (plain) std::printf("device: %s\n", device->description().c_str());
  std::optional<eval::TaskCase> needle;
  std::vector<int32_t> prompt;
  if (o.needle_tokens > 0) {
    const eval::Haystack hay = eval::load_haystack(o.haystack);
    eval::TaskOptions topts;
    topts.reserve_tokens = 64;  // chat template and answer prefix
    // CaseSpec's depth is in percent; --needle-depth a fraction.
    const eval::CaseSpec spec{eval::TaskKind::niah_single, static_cast<size_t>(o.needle_tokens), 100.0 * o.needle_depth,
                              o.needle_seed, 0};
    needle = eval::generate_case(
        spec, hay, [&](const std::string& t) { return s.tokenizer->encode(t, {.add_special = false}).size(); },
        topts);
    prompt = s.encode_prompt(eval::user_prompt(*needle), o.chat, o.system);
    const auto prefix = s.tokenizer->encode((o.chat ? "" : " ") + needle->answer_prefix, {.add_special = false});
    prompt.insert(prompt.end(), prefix.begin(), prefix.end());
    if (plain)
      std::printf("needle: haystack %s, depth %.0f%%, expected answer %s\n", hay.name.c_str(), 100 * o.needle_depth,
                  needle->answers.front().c_str());
  } else {
    if (o.stream.methods.empty() || o.max_context > 0)  // streaming has no context limit but --max-context
      check_prompt_text_fits(s, text.size(), o.max_context > 0 ? o.max_context : c.context_length,
                             what);
    prompt = s.encode_prompt(text, o.chat, o.system);
  }
  std::vector<int32_t> needle_tokens;  // the needle's value as the prompt holds it (streaming reports its block)
  if (needle)
    for (const std::string& value : {" " + needle->answers.front(), needle->answers.front()}) {
      needle_tokens = s.tokenizer->encode(value, {.add_special = false});
      if (plan::find_tokens(prompt, needle_tokens) >= 0) break;
    }
  if (plain) std::printf("prompt: %s tokens\n", with_commas(static_cast<int64_t>(prompt.size())).c_str());
  std::fflush(stdout);
  const std::string spec = o.stream.methods.empty() ? o.attn : stream_label(o.stream.methods.front());
  const auto prompt_tokens = static_cast<int64_t>(prompt.size());
  nlohmann::json head = {{"model", c.name}, {"device", device->description()}, {"prompt_tokens", prompt_tokens},
                         {"load_s", load_seconds}};
  if (needle) head["needle"] = {{"expected", needle->answers.front()}};
  const auto needle_found = [&](const Outcome& out) {
    return eval::score_output(needle->metric, out.text, needle->answers).pass;
  };
  const Echo echo = o.json ? Echo::None : o.quiet ? Echo::Raw : Echo::Labeled;
  if (!o.compare) {
    const Outcome r = generate_once(s, *device, o, spec, prompt, echo, needle_tokens);
    if (o.json) {
      nlohmann::json j = head;
      j.update(run_json(spec, r, prompt_tokens));
      if (needle) j["needle"]["found"] = needle_found(r);
      print_json(j);
      return 0;
    }
    if (o.quiet) return 0;
    print_stats(spec, r, static_cast<int64_t>(prompt.size()));
    if (needle) {
      std::printf("needle %s\n", needle_found(r) ? "found" : "NOT found");
    }
    return 0;
  }
  if (plain) std::printf("\n== dense ==\n");
  std::fflush(stdout);
  const Outcome dense = generate_once(s, *device, o, "dense", prompt, echo);
  if (plain) print_stats("dense", dense, static_cast<int64_t>(prompt.size()));
  if (plain) std::printf("\n== %s ==\n", spec.c_str());
  std::fflush(stdout);
  const Outcome sparse = generate_once(s, *device, o, spec, prompt, echo, needle_tokens);
  const double speedup = dense.prefill.prefill_seconds / sparse.prefill.prefill_seconds;
  const double attention_speedup =
      sparse.prefill.attention_seconds > 0 ? dense.prefill.attention_seconds / sparse.prefill.attention_seconds : 0.0;
  if (o.json) {
    nlohmann::json j = head;
    j["runs"] = {run_json("dense", dense, prompt_tokens), run_json(spec, sparse, prompt_tokens)};
    if (needle) {
      j["runs"][0]["needle_found"] = needle_found(dense);
      j["runs"][1]["needle_found"] = needle_found(sparse);
    }
    j["prefill_speedup"] = speedup;
    j["attention_speedup"] = attention_speedup;
    j["answers_identical"] = dense.text == sparse.text;
    print_json(j);
    return 0;
  }
  print_stats(spec, sparse, static_cast<int64_t>(prompt.size()));
  if (needle) {
    auto found = [&](const Outcome& out) { return needle_found(out) ? "found" : "NOT found"; };
    std::printf("\nneedle (%s): dense %s, %s %s\n", needle->answers.front().c_str(), found(dense), spec.c_str(),
                found(sparse));
  }
  std::printf("\nprefill speedup of %s over dense: %.2fx (attention alone: %.2fx); answers %s\n", spec.c_str(),
              speedup, attention_speedup, dense.text == sparse.text ? "identical" : "differ");
  return 0;
}

}  // namespace tessera::cli
