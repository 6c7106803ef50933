// `tessera eval`: RULER-style tasks and needle grids through a real model, dense and sparse on the same cases;
// per-layer attention metrics on the dense model's activations; perplexity on long text. See
// docs/accuracy/README.md for the tasks and the files written.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <span>

#include "attention/cpu/layer_attention_cpu.h"
#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "plan/retrieval_heads.h"
#include "eval/attention_stats.h"
#include "eval/haystack.h"
#include "eval/heatmap.h"
#include "eval/metrics.h"
#include "eval/report.h"
#include "eval/results.h"
#include "eval/task.h"
#include "runtime/forward.h"

#include "runtime/device.h"

namespace tessera::cli {

namespace fs = std::filesystem;

// results -> report.md and one needle heatmap per (policy, task with depths) in `dir`; prints the report.
void write_report(const fs::path& dir, const std::vector<eval::CaseResult>& results, const EvalOptions& o);

namespace {

// "vs:v=128,s=512" -> "vs-v128-s512": safe in file names.
std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.') {
      out += c;
    } else if (c != '=' && !out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out;
}

bool chat_mode(const Session& s, const std::string& chat) {
  if (chat == "on") return true;
  if (chat == "off") return false;
  return s.chat.has_value();  // auto
}

// The prompt a case gives the model: a chat user turn with the answer prefix opening the reply, or the plain
// text a base model continues.
std::vector<int32_t> case_prompt(const Session& s, const eval::TaskCase& c, bool chat) {
  if (!chat) return s.tokenizer->encode(eval::full_prompt(c), {.add_special = true, .parse_special = false});
  std::vector<int32_t> ids = s.encode_prompt(eval::user_prompt(c), true, "");
  const auto prefix = s.tokenizer->encode(c.answer_prefix, {.add_special = false});
  ids.insert(ids.end(), prefix.begin(), prefix.end());
  return ids;
}

// Greedy answer. Stops at an end-of-generation token, after max_tokens, or, with stop_when_found, once every
// expected answer is in the output: the metrics only look for the answers' presence, so later tokens cannot
// change the score and need not be computed.
std::string answer(runtime::SequenceEngine& engine, const Session& s, const std::vector<int32_t>& prompt,
                   const eval::TaskCase& c, int max_tokens, bool stop_when_found) {
  engine.reset();
  runtime::GenerateOptions g;  // greedy: the default sampling options
  g.max_new_tokens = max_tokens;
  g.stop_tokens = s.tokenizer->special().end_of_generation;
  model::StreamingDecoder decoder(*s.tokenizer, {.skip_special = true});
  std::string text;
  engine.generate(prompt, g, [&](int32_t t) {
    text += decoder.push(t);
    return !(stop_when_found && eval::score_output(c.metric, text, c.answers).pass);
  });
  return text + decoder.flush();
}

std::vector<std::string> policy_list(const std::vector<std::string>& attn, const StreamFlags& stream) {
  std::vector<std::string> out = {"dense"};
  for (const std::string& a : attn)
    if (a != "dense" && std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  for (const std::string& m : stream.methods)
    if (std::find(out.begin(), out.end(), stream_label(m)) == out.end()) out.push_back(stream_label(m));
  return out;
}

// The CPU engine's options for a policy spec or a "stream:<method>" label.
// What a streaming case held at its end: the index and the host store (the GPU path's pinned blocks: bf16, or FP8
// codes and scales with --stream-host-kv fp8).
std::string stream_note(const runtime::StreamingKV& kv) {
  const runtime::StreamStats st = kv.stats();
  return "; index " + with_commas(st.index_vectors) + " vectors, " + format_bytes(static_cast<double>(st.index_bytes)) +
         " (" + with_commas(st.index_head_vectors) + " kv-head vectors)" +
         "; host " + format_bytes(static_cast<double>(st.host_bytes));
}

// The engine's options for a policy spec or a "stream:<method>" label; on the GPU with --gemm and no dense fallback
// (the policy must really run: a dense fallback would measure dense).
runtime::EngineOptions engine_options(const Session& s, const EvalOptions& o, const std::string& policy,
                                      bool gpu = false) {
  runtime::EngineOptions eo;
  eo.chunk_size = o.chunk;
  const std::string method = stream_method_of(policy);
  if (method.empty())
    eo.policy = s.policy(policy);
  else
    eo.stream = stream_options(o.stream, method, gpu);
  if (gpu) {
    eo.gpu.cuda_attention.dense_fallback = false;
    eo.gpu.fp8_gemm = o.gemm == "fp8";
    eo.gpu.w4_decode = o.gemm == "w4";
    eo.gpu.fp8_kv = kv_fp8(true);
  }
  return eo;
}

nlohmann::json meta_of(const Session& s, const EvalOptions& o, const std::vector<std::string>& policies) {
  const auto& c = s.model->config();
  return {{"model", c.name},
          {"device", o.device},
          {"model_file", fs::path(o.model).filename().string()},
          {"layers", c.num_layers},
          {"context_length", c.context_length},
          {"policies", policies},
          {"chat", o.chat},
          {"haystack", o.haystack},
          {"seed", o.seed},
          {"samples", o.samples},
          {"chunk", o.chunk},
          {"command", o.command_line}};
}

// The tasks x lengths x depths suite: cases, answers for every policy, results.json after every case.
// What the task suite and the layer metrics both need to turn a spec into a case: the haystack, whether the
// chat template wraps the prompt, the model's token counter and the tokens that counter does not see.
struct CaseSource {
  eval::Haystack hay;
  bool chat;
  eval::TokenCounter count;
  size_t overhead;  // the chat template (or BOS) around the prompt, plus a little slack

  CaseSource(const Session& s, const EvalOptions& o)
      : hay(eval::load_haystack(o.haystack)),
        chat(chat_mode(s, o.chat)),
        count([&s](const std::string& t) { return s.tokenizer->encode(t, {.add_special = false}).size(); }),
        overhead((chat ? s.encode_prompt("", true, "").size() : 1) + 4) {}

  // A case of spec.length tokens whose prompt leaves room for `answer_budget` generated tokens.
  eval::TaskCase make(const eval::CaseSpec& spec, size_t answer_budget) const {
    eval::TaskOptions topts;
    topts.reserve_tokens = overhead + answer_budget;
    return eval::generate_case(spec, hay, count, topts);
  }
};

void run_tasks(const Session& s, const EvalOptions& o, const std::vector<std::string>& policies, const fs::path& dir,
               const runtime::Device& device) {
  const CaseSource source(s, o);

  const fs::path results_path = dir / "results.json";
  std::vector<eval::CaseResult> results;
  std::set<std::pair<std::string, std::string>> done;
  if (o.resume && fs::exists(results_path)) {
    results = eval::read_results_file(results_path);
    for (const auto& r : results) done.insert({r.id, r.policy});
    std::fprintf(stderr, "eval: resuming with %zu results from %s\n", results.size(), results_path.c_str());
  }
  std::vector<eval::CaseSpec> specs;
  for (const std::string& name : o.tasks) {
    eval::SuiteSpec suite;
    suite.tasks = {eval::parse_task(name)};
    for (int l : o.lengths) suite.lengths.push_back(static_cast<size_t>(l));
    suite.depths = o.depths;
    suite.samples = static_cast<uint32_t>(o.samples);
    suite.seed = o.seed;
    const auto part = eval::suite_specs(suite);
    specs.insert(specs.end(), part.begin(), part.end());
  }
  const auto& cfg = s.model->config();
  size_t index = 0;
  for (const eval::CaseSpec& spec : specs) {
    ++index;
    const int max_answer = o.answer_tokens > 0 ? o.answer_tokens : static_cast<int>(eval::answer_tokens(spec.task));
    const bool past_context = spec.length > static_cast<size_t>(cfg.context_length);  // streaming policies only
    check(!past_context || !o.stream.methods.empty(),
          "eval: length " + std::to_string(spec.length) + " exceeds the context of " + cfg.name + " (" +
              std::to_string(cfg.context_length) + " tokens)");
    const eval::TaskCase c = source.make(spec, static_cast<size_t>(max_answer));
    const std::vector<int32_t> prompt = case_prompt(s, c, source.chat);
    for (const std::string& policy : policies) {
      if (done.count({c.id, policy})) continue;
      const bool streaming = !stream_method_of(policy).empty();
      if (past_context && !streaming) continue;
      const auto max_context = static_cast<int32_t>(
          std::min<size_t>(static_cast<size_t>(cfg.context_length), prompt.size() + static_cast<size_t>(max_answer)));
      std::string note;
      const double t0 = now_seconds();
      std::string out;
      runtime::EngineOptions eo = engine_options(s, o, policy, device.gpu());
      if (!streaming) eo.max_context = max_context;
      const std::unique_ptr<runtime::SequenceEngine> engine = device.engine(eo);
      out = answer(*engine, s, prompt, c, max_answer, !o.full_answers);
      if (streaming) note = stream_note(*engine->streaming());
      eval::CaseResult r = eval::score_case(c, policy, out);
      std::string shown = eval::normalize_output(out).substr(0, 60);
      std::replace(shown.begin(), shown.end(), '\n', ' ');
      std::fprintf(stderr, "[%zu/%zu] %s %s: %s (%zu tokens, %.1f s%s) \"%s\"\n", index, specs.size(), c.id.c_str(),
                   policy.c_str(), r.pass ? "pass" : "FAIL", prompt.size(), now_seconds() - t0, note.c_str(),
                   shown.c_str());
      results.push_back(std::move(r));
      done.insert({c.id, policy});
    }
    eval::write_results_file(results_path, results, meta_of(s, o, policies));
  }
  write_report(dir, results, o);
}

}  // namespace

void write_report(const fs::path& dir, const std::vector<eval::CaseResult>& results, const EvalOptions& o) {
  std::string md = "# tessera eval\n\n";
  if (!o.command_line.empty()) md += "Command: `" + o.command_line + "`\n\n";
  md += eval::markdown_report(results);
  write_text(dir / "report.md", md);
  for (const std::string& policy : eval::policies_in(results)) {
    for (const std::string& task : eval::tasks_in(results)) {
      const eval::PassGrid grid = eval::depth_length_grid(results, policy, task);
      if (grid.rows() == 0 || grid.cols() == 0) continue;
      const std::string title = task + " — " + policy + (o.model_name.empty() ? "" : " — " + o.model_name);
      write_text(dir / ("heatmap_" + task + "_" + file_safe(policy) + ".svg"), eval::heatmap_svg(grid, title));
    }
  }
  std::printf("%s", md.c_str());
}

namespace {

// Retrieval heads (plan/retrieval_heads.h) on niah_single cases at each length and depth, written to
// o.retrieval_heads_out.
void find_retrieval_heads(const Session& s, const EvalOptions& o) {
  const CaseSource source(s, o);
  std::vector<plan::RetrievalCase> cases;
  for (int length : o.lengths)
    for (double depth : o.depths)
      for (int k = 0; k < o.samples; ++k) {
        const eval::TaskCase c = source.make(
            {eval::TaskKind::niah_single, static_cast<size_t>(length), depth, o.seed, static_cast<uint32_t>(k)}, 16);
        plan::RetrievalCase rc;
        rc.prompt = case_prompt(s, c, source.chat);
        for (const std::string& text : {" " + c.answers.front(), c.answers.front()}) {  // as the haystack holds it
          rc.answer = s.tokenizer->encode(text, {.add_special = false});
          if (plan::find_tokens(rc.prompt, rc.answer) >= 0) break;
        }
        cases.push_back(std::move(rc));
      }
  const double t0 = now_seconds();
  const std::vector<runtime::RetrievalHead> heads = plan::retrieval_head_scores(*s.model, cases);
  write_text(o.retrieval_heads_out, plan::retrieval_heads_text(heads));
  std::fprintf(stderr, "eval: retrieval heads from %zu cases in %.1f s -> %s\n", cases.size(), now_seconds() - t0,
               o.retrieval_heads_out.c_str());
}

// Per layer and head, what each sparse policy would lose on the dense model's own activations, on the
// niah_single case at each length (depth 50%).
void run_layer_stats(const Session& s, const EvalOptions& o, const std::vector<std::string>& policies,
                     const fs::path& dir) {
  const CaseSource source(s, o);
  const auto& cfg = s.model->config();
  nlohmann::json all = nlohmann::json::object();
  std::string md = "# Attention metrics per layer (dense activations)\n\n";
  if (!o.command_line.empty()) md += "Command: `" + o.command_line + "`\n\n";
  md += "Recall: share of the dense softmax mass the policy keeps; rel. error: ||sparse - dense|| / ||dense|| of "
        "the layer's attention output; density: kept cells / cells dense attention computes. Means over query "
        "heads, measured on the niah_single case (depth 50%) through the dense model.\n\n";
  for (int length : o.layer_stats_lengths) {
    const eval::TaskCase c =
        source.make({eval::TaskKind::niah_single, static_cast<size_t>(length), 50.0, o.seed, 0}, 0);
    const std::vector<int32_t> prompt = case_prompt(s, c, source.chat);
    std::map<std::string, std::vector<eval::LayerAttentionStats>> stats;  // policy -> per layer (row-weighted)
    std::map<std::string, attn::AttentionPolicy> table;
    for (const std::string& p : policies) {
      if (p == "dense" || !stream_method_of(p).empty()) continue;  // streaming is no policy table
      table[p] = s.policy(p);
      stats[p].resize(static_cast<size_t>(cfg.num_layers));
    }
    runtime::EngineOptions eo;
    eo.chunk_size = o.chunk;
    eo.observer = [&](int32_t layer, const attn::AttentionArgs& args) {
      for (auto& [name, policy] : table) {
        const eval::LayerAttentionStats part = eval::measure_layer(
            layer, policy.layer(layer), args, static_cast<int32_t>(prompt.size()), attn::kCpuQueryTile);
        eval::LayerAttentionStats& acc = stats[name][static_cast<size_t>(layer)];
        if (acc.heads.empty()) acc.heads.assign(part.heads.size(), eval::HeadAttentionStats{0, 0, 0});
        acc.layer = layer;
        for (size_t h = 0; h < part.heads.size(); ++h) {  // running row-weighted means over chunks
          const double w0 = static_cast<double>(acc.rows), w1 = static_cast<double>(part.rows), w = w0 + w1;
          acc.heads[h].recall = (acc.heads[h].recall * w0 + part.heads[h].recall * w1) / w;
          acc.heads[h].rel_error = (acc.heads[h].rel_error * w0 + part.heads[h].rel_error * w1) / w;
          acc.heads[h].density = (acc.heads[h].density * w0 + part.heads[h].density * w1) / w;
        }
        acc.rows += part.rows;
      }
    };
    runtime::Engine engine(*s.model, eo);
    const double t0 = now_seconds();
    engine.prefill(prompt);
    std::fprintf(stderr, "eval: layer metrics at %d tokens (%zu prompt tokens) in %.1f s\n", length, prompt.size(),
                 now_seconds() - t0);
    nlohmann::json at_length = nlohmann::json::object();
    for (const auto& [name, layers] : stats) {
      md += "## " + eval::format_length(static_cast<size_t>(length)) + ", " + name + "\n\n" +
            eval::layer_stats_markdown(layers) + "\n";
      at_length[name] = eval::layer_stats_to_json(layers);
    }
    all[std::to_string(length)] = at_length;
  }
  write_text(dir / "layer_stats.json", all.dump(1) + "\n");
  write_text(dir / "layer_stats.md", md);
  std::printf("%s", md.c_str());
}

// "GPU, bf16", "GPU, FP8 GEMMs" or "GPU, bf16, 4-bit decode" for --gemm (the perplexity's and the log's label).
std::string gpu_precision_label(const std::string& gemm) {
  return gemm == "fp8" ? "GPU, FP8 GEMMs" : gemm == "w4" ? "GPU, bf16, 4-bit decode" : "GPU, bf16";
}

// Perplexity of the haystack's text from its first sentence, at each length, under each policy: on the CPU engine
// (Engine::score), or on the GPU engine with --device cuda (--gemm applies; the same log-softmax on the host).
void run_perplexity(const Session& s, const EvalOptions& o, const std::vector<std::string>& policies,
                    const fs::path& dir, const runtime::Device& device) {
  const eval::Haystack hay = eval::load_haystack(o.haystack);
  const int max_len = *std::max_element(o.perplexity_lengths.begin(), o.perplexity_lengths.end());
  std::string text;
  std::vector<int32_t> ids;
  for (size_t i = 0; static_cast<int>(ids.size()) < max_len; i += 256) {
    for (size_t j = i; j < i + 256; ++j) text += hay.sentence(j) + " ";
    ids = s.tokenizer->encode(text, {.add_special = true, .parse_special = false});
    check(i < 100 * hay.sentences.size(), "eval: the haystack is too short for perplexity at " + std::to_string(max_len));
  }
  std::string md = "# Perplexity (" + hay.name + ", from its first sentence; " +
                   (device.gpu() ? gpu_precision_label(o.gemm) : std::string("CPU, f32")) +
                   ")\n\n";
  if (!o.command_line.empty()) md += "Command: `" + o.command_line + "`\n\n";
  md += "| policy |";
  for (int l : o.perplexity_lengths) md += " " + eval::format_length(static_cast<size_t>(l)) + " |";
  md += "\n|---|";
  for (size_t i = 0; i < o.perplexity_lengths.size(); ++i) md += "---:|";
  md += "\n";
  nlohmann::json j = nlohmann::json::array();
  for (const std::string& policy : policies) {
    md += "| " + policy + " |";
    for (int l : o.perplexity_lengths) {
      if (stream_method_of(policy).empty() && l > s.model->config().context_length) {  // streaming only
        md += " - |";
        continue;
      }
      const double t0 = now_seconds();
      const std::span<const int32_t> text_ids(ids.data(), static_cast<size_t>(l));
      runtime::EngineOptions eo = engine_options(s, o, policy, device.gpu());
      eo.max_context = l;
      const std::vector<double> lp = device.engine(eo)->score(text_ids);
      const double ppl = eval::perplexity(lp);
      std::fprintf(stderr, "eval: perplexity %s at %d tokens: %.3f (%.1f s, %s)\n", policy.c_str(), l, ppl,
                   now_seconds() - t0, device.gpu() ? gpu_precision_label(o.gemm).c_str() : "CPU");
      char cell[32];
      std::snprintf(cell, sizeof cell, " %.3f |", ppl);
      md += cell;
      j.push_back({{"policy", policy},
                   {"length", l},
                   {"perplexity", ppl},
                   {"tokens_scored", lp.size()},
                   {"device", device.gpu() ? "cuda" : "cpu"},
                   {"gemm", device.gpu() ? (o.gemm.empty() ? "bf16" : o.gemm) : "f32"}});
    }
    md += "\n";
  }
  write_text(dir / "perplexity.json", nlohmann::json{{"haystack", hay.name}, {"results", j}}.dump(1) + "\n");
  write_text(dir / "perplexity.md", md);
  std::printf("%s", md.c_str());
}

}  // namespace

int eval_command(EvalOptions o) {
  check(!o.lengths.empty(), "eval: --lengths is empty");
  for (int l : o.lengths) check(l > 0, "eval: lengths must be positive");
  for (double d : o.depths) check(d >= 0 && d <= 100, "eval: depths are percentages in [0, 100]");
  check(o.samples > 0, "eval: --samples must be positive");
  check_eval_options(o);
  const Session s = Session::open(o.model);
  o.model_name = s.model->config().name;
  for (int l : o.lengths)  // past the context only streaming runs
    check(l <= s.model->config().context_length || !o.stream.methods.empty(),
          "eval: length " + std::to_string(l) + " exceeds the context of " + o.model_name + " (" +
              std::to_string(s.model->config().context_length) + " tokens)");
  const std::vector<std::string> policies = policy_list(o.attn, o.stream);
  for (const std::string& p : policies)  // bad specs fail before any work (on the device the run asks for)
    (void)engine_options(s, o, p, use_gpu_device_for(o.device, o.stream));
  const fs::path dir = o.out;
  fs::create_directories(dir);
  if (o.report_only) {
    write_report(dir, eval::read_results_file(dir / "results.json"), o);
    return 0;
  }
  const bool gpu = use_gpu_device_for(o.device, o.stream);
  (void)kv_fp8(gpu);  // --kv-type fp8 on the CPU: its error
  check(o.gemm.empty() || gpu, "--gemm applies to --device cuda (this run is on the CPU)");
  check(o.gemm.empty() || o.gemm == "bf16" || o.gemm == "fp8" || o.gemm == "w4",
        "--gemm must be bf16, fp8 or w4, got '" + o.gemm + "'");
  const std::unique_ptr<runtime::Device> device_ptr = runtime::open_device(gpu ? "cuda" : "cpu", *s.model);
  const runtime::Device& device = *device_ptr;
  if (!o.retrieval_heads_out.empty()) find_retrieval_heads(s, o);
  std::fprintf(stderr, "eval: cases run on the %s\n", device.gpu() ? (o.gemm == "fp8" ? "GPU (bf16, FP8 GEMMs, no dense fallback)" : "GPU (bf16, no dense fallback)") : "CPU (f32)");
  if (!o.tasks.empty()) run_tasks(s, o, policies, dir, device);
  if (!o.layer_stats_lengths.empty()) run_layer_stats(s, o, policies, dir);
  if (!o.perplexity_lengths.empty()) run_perplexity(s, o, policies, dir, device);
  return 0;
}

}  // namespace tessera::cli
