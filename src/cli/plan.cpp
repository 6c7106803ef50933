// tessera plan: an attention plan for a model, by MInference's search, MoA's optimiser or TriangleMix's probe
// (src/plan). Writes the plan (tessera's policy JSON, which run/bench/eval/serve take with --attn), the method's
// own format where it has one (MInference per-head JSON, MoA alphas/betas), an SVG picture and a JSON report;
// prints the per-layer summary and the expected density and attention FLOPs at the report lengths.
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "attention/pattern/config_io.h"
#include "cli/commands.h"
#include "cli/usage.h"
#include "cli/session.h"
#include "core/error.h"
#include "core/memory_budget.h"
#include "parallel/placement.h"
#include "eval/haystack.h"
#include "eval/metrics.h"
#include "plan/calibration.h"
#include "plan/compare.h"
#include "plan/measure.h"
#include "plan/minference_plan.h"
#include "plan/moa_plan.h"
#include "plan/plan_report.h"
#include "plan/planned_range.h"
#include "plan/profile.h"
#include "plan/trianglemix_plan.h"
#include "plan/validation.h"
#ifdef TESSERA_WITH_GPU_PLAN
#include "plan/cuda/gradients_cuda.h"
#endif

namespace tessera::cli {

namespace fs = std::filesystem;

namespace {

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

fs::path beside(const fs::path& out, const std::string& suffix) {
  fs::path p = out;
  p.replace_extension();
  return p.string() + suffix;
}

void log(const char* fmt, const std::string& s, double t0) {
  std::fprintf(stderr, fmt, s.c_str(), now_seconds() - t0);
  std::fflush(stderr);
}

// The validation texts for MoA's pick: the haystack from a sentence far from the calibration tasks' start (and from
// the evaluation's: eval --perplexity reads it from its first sentence); text k from 1,000 sentences after text k-1.
std::vector<int32_t> validation_tokens(const Session& s, const std::string& haystack, int32_t length, int32_t text_index) {
  const eval::Haystack hay = eval::load_haystack(haystack);
  std::string text;
  std::vector<int32_t> ids;
  const size_t start = 7919 + 1000 * static_cast<size_t>(text_index);
  for (size_t i = 0; static_cast<int32_t>(ids.size()) < length; i += 256) {
    check(i < 100 * hay.sentences.size(), "plan: the haystack is too short for validation at " + std::to_string(length));
    for (size_t j = i; j < i + 256; ++j) text += hay.sentence(start + j) + " ";
    ids = s.tokenizer->encode(text, {.add_special = true});
  }
  ids.resize(static_cast<size_t>(length));
  return ids;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

void check_plan_options(const PlanOptions& o) {
  usage_check(o.method == "minference" || o.method == "moa" || o.method == "trianglemix" || o.method == "measure",
              "--method must be minference, moa, trianglemix or measure, got '" + o.method + "'");
  usage_check((o.method == "measure") == !o.attn.empty(), o.method == "measure"
                                                              ? "--method measure needs --attn (the policies to measure)"
                                                              : "--attn is for --method measure");
  usage_check(!o.out.empty(), "-o/--out is required (the plan file to write)");
  if (o.budget)
    usage_check(*o.budget > 0 && *o.budget <= 1, "--budget must be a density in (0, 1], got " + num(*o.budget));
  usage_check(!o.lengths.empty(), "--lengths is empty");
  for (int l : o.lengths) usage_check(l >= 128, "--lengths must be >= 128 tokens, got " + std::to_string(l));
  usage_check(o.samples >= 1, "--samples must be >= 1, got " + std::to_string(o.samples));
  usage_check(o.answer_tokens >= 1, "--answer-tokens must be >= 1, got " + std::to_string(o.answer_tokens));
  usage_check(o.threshold > 0 && o.threshold < 1, "--threshold must be in (0, 1), got " + num(o.threshold));
  usage_check(!o.validation_lengths.empty(), "--validation-length is empty");
  for (int l : o.validation_lengths)
    usage_check(l >= 0 && (l > 0 || o.validation_lengths.size() == 1),
                "--validation-length must be lengths > 0, or 0 alone (none), got " + std::to_string(l));
  usage_check(o.validation_texts >= 1, "--validation-texts must be >= 1, got " + std::to_string(o.validation_texts));
  usage_check(o.moa_head_cap > 0 && o.moa_head_cap <= 1, "--moa-head-cap must be in (0, 1], got " + num(o.moa_head_cap));
  usage_check((o.moa_profile_in.empty() && o.moa_profile_out.empty()) || o.method == "moa",
              "--moa-profile-in/--moa-profile-out are for --method moa");
  usage_check(o.moa_profile_in.empty() || fs::exists(o.moa_profile_in),
              "--moa-profile-in: no file '" + o.moa_profile_in + "'");
  usage_check(!o.minference_repair || o.method == "minference", "--minference-repair is for --method minference");
  usage_check(!o.moa_layer_repair || o.method == "moa", "--moa-layer-repair is for --method moa");
  usage_check(!o.calib_tasks || !o.calib.empty(), "--calib-tasks adds synthetic tasks to a --calib file: give one");
  usage_check(!o.trianglemix_select || o.method == "trianglemix", "--trianglemix-select is for --method trianglemix");
  usage_check(!o.trianglemix_select || *o.trianglemix_select >= 0,
              "--trianglemix-select must be a tolerance >= 0, got " + num(o.trianglemix_select.value_or(0)));
  usage_check(!o.trianglemix_select || o.validation_lengths.front() > 0,
              "--trianglemix-select needs held-out tasks or validation texts (a --validation-length)");
  usage_check(!o.trianglemix_select || !o.budget, "--trianglemix-select and --budget both choose the split: give one");
  usage_check(!o.moa_layer_repair || o.validation_lengths.front() > 0,
              "--moa-layer-repair needs validation texts (a --validation-length)");
  usage_check(!o.minference_repair || (o.validation_cases > 0 && o.validation_lengths.front() > 0),
              "--minference-repair needs held-out tasks (--validation-cases > 0 at a --validation-length)");
  usage_check(o.compare_with == "auto" || o.compare_with == "none" ||
                  (o.validation_cases > 0 && o.validation_lengths.front() > 0),
              "--compare-with needs held-out tasks (--validation-cases > 0 at a --validation-length)");
  usage_check(!o.compare_with.empty(), "--compare-with must name presets, auto or none");
  usage_check(o.validation_cases >= 0, "--validation-cases must be >= 0 (0: none), got " + std::to_string(o.validation_cases));
  for (int l : o.report_lengths) usage_check(l > 0, "--report-lengths must be positive, got " + std::to_string(l));
  usage_check(o.device == "cpu" || o.device == "cuda" || o.device == "auto",
              "--device must be cpu, cuda or auto, got '" + o.device + "'");
  usage_check(o.inner == "dense" || o.inner == "vs" || fs::exists(o.inner),
              "--inner must be dense, vs or a policy file, got '" + o.inner + "'");
  if (!o.calib.empty()) {
    try {
      plan::check_calibration_file(o.calib);
    } catch (const Error& e) {
      throw Error(std::string("--calib: ") + e.what());
    }
  }
}

// Where the reverse-mode passes (moa, trianglemix) or the search's forward (minference) run: --device cpu, cuda (an
// error where tessera has no GPU path or no GPU is usable), auto (the GPU when both are there).
static plan::Device plan_device(const PlanOptions& o) {
  if (o.device == "cpu") return plan::Device::Cpu;
#ifdef TESSERA_WITH_GPU_PLAN
  const bool usable = plan::cuda::gpu_available();
  if (o.device == "cuda") check(usable, "--device cuda: no CUDA device is usable");
  if (!usable) return plan::Device::Cpu;
  plan::cuda::enable();
  return plan::Device::Cuda;
#else
  check(o.device == "auto", "--device cuda: this tessera was built without the CUDA backend (configure with "
                            "-DTESSERA_CUDA=ON on a machine with nvcc)");
  return plan::Device::Cpu;
#endif
}

// ';'-separated policy specs (--attn, --compare-with), empty pieces dropped.
static std::vector<std::string> split_specs(const std::string& list) {
  std::vector<std::string> out;
  for (size_t i = 0; i <= list.size();) {
    const size_t j = std::min(list.find(';', i), list.size());
    if (j > i) out.push_back(list.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

// --method measure: per length, one held-out retrieval prompt (another seed than calibration's), the executed
// density of every policy on it (plan/measure.h); a table on stdout and JSON at -o.
static int measure_command(const PlanOptions& o) {
  const double t0 = now_seconds();
  Session s = Session::open(o.model);
  const std::vector<std::string> specs = split_specs(o.attn);
  std::vector<attn::AttentionPolicy> policies;
  for (const std::string& sp : specs) policies.push_back(s.policy(sp));
  nlohmann::json out = {{"model", s.model->config().name}, {"command", o.command_line}, {"rows", nlohmann::json::array()}};
  std::printf("| policy | length | executed density |\n|---|---:|---:|\n");
  for (int length : o.lengths) {
    plan::CalibrationSpec spec;
    spec.seed = o.seed + plan::kHeldOutSeed;
    spec.haystack = o.haystack;
    spec.answer_tokens = o.answer_tokens;
    const std::vector<int32_t> tokens = plan::retrieval_prompt(*s.tokenizer, spec, length, 0);
    const std::vector<double> d = plan::executed_density(*s.model, tokens, policies, ThreadPool::global());
    for (size_t i = 0; i < specs.size(); ++i) {
      std::printf("| %s | %d | %.3f |\n", specs[i].c_str(), length, d[i]);
      out["rows"].push_back({{"policy", specs[i]}, {"length", length}, {"tokens", tokens.size()}, {"density", d[i]}});
    }
    std::fflush(stdout);
  }
  out["seconds"] = now_seconds() - t0;
  write_text(o.out, out.dump(1) + "\n");
  return 0;
}

// --compare-with's specs: auto = vs_adaptive and trianglemix, and MoA's uniform window of the plan's density when
// there is one; none = nothing; else the ';'-separated list as given.
static std::vector<std::string> compare_specs(const std::string& arg, const std::string& window_spec) {
  if (arg == "none") return {};
  if (arg == "auto") {
    std::vector<std::string> out{"vs_adaptive", "trianglemix"};
    if (!window_spec.empty()) out.push_back(window_spec);
    return out;
  }
  return split_specs(arg);
}

int plan_command(const PlanOptions& o) {
  check_plan_options(o);
  if (o.method == "measure") return measure_command(o);
  const plan::Device device = plan_device(o);
  const double t0 = now_seconds();
  Session s = Session::open(o.model);
  const runtime::ModelConfig& cfg = s.model->config();
  if (o.gpus > 0) parallel::check_gpu_count(o.gpus, cfg.num_q_heads);  // before the long part
  if (o.method != "minference") plan::check_backward_supported(cfg);
  for (const std::string& sp : compare_specs(o.compare_with, "")) {  // before the long part
    try {
      (void)s.policy(sp);
    } catch (const Error& e) {
      throw Error(std::string("--compare-with: ") + e.what());
    }
  }
  ThreadPool& pool = ThreadPool::global();
  log("plan: loaded %s (%.1f s)\n", cfg.summary(), t0);
  // Where the model answers (the dense answers, the held-out checks, the validation texts): the GPU's engine when the
  // planner's passes run there (bf16), else the CPU engine. (Null: the CPU engine on the model.)
  std::unique_ptr<runtime::Device> gpu_engines;
  if (device == plan::Device::Cuda && runtime::gpu_device_usable()) gpu_engines = runtime::open_device("cuda", *s.model);
  const runtime::Device* answers = gpu_engines.get();
  if (answers != nullptr) log("plan: %s (%.1f s)\n", "answers and validation on " + answers->description(), t0);

  // Calibration samples.
  std::vector<plan::CalibrationSample> samples;
  const int32_t longest = *std::max_element(o.lengths.begin(), o.lengths.end());
  if (!o.calib.empty()) {
    try {
      samples = plan::load_calibration_file(o.calib, *s.model, *s.tokenizer, longest, o.answer_tokens, answers);
    } catch (const Error& e) {
      throw Error(std::string("--calib: ") + e.what());
    }
  }
  if (o.calib.empty() || o.calib_tasks) {
    plan::CalibrationSpec spec;
    spec.lengths = o.lengths;
    spec.samples_per_length = o.samples;
    spec.seed = o.seed;
    spec.answer_tokens = o.answer_tokens;
    spec.haystack = o.haystack;
    std::vector<plan::CalibrationSample> tasks = plan::make_calibration(
        *s.model, *s.tokenizer, spec, [&](const std::string& what) { log("plan: %s (%.1f s)\n", what, t0); }, answers);
    samples.insert(samples.end(), std::make_move_iterator(tasks.begin()), std::make_move_iterator(tasks.end()));
  }
  log("plan: %s calibration samples ready (%.1f s)\n", std::to_string(samples.size()), t0);
  // The range of prompt lengths the plan is made for (saved in the plan; run warns far outside it).
  plan::PlannedRange range{*std::min_element(o.lengths.begin(), o.lengths.end()), longest};
  if (!o.calib.empty()) {
    range = {INT32_MAX, 0};
    for (const auto& smp : samples) {
      range.min = std::min(range.min, static_cast<int32_t>(smp.tokens.size()) + 1);
      range.max = std::max(range.max, static_cast<int32_t>(smp.tokens.size()) + 1);
    }
  }
  // Held-out tasks (another seed): the dense model's answers a plan should reproduce.
  std::vector<plan::CalibrationSample> heldout;
  const bool validation = o.validation_lengths.front() > 0;
  std::string validation_lengths_text;
  for (int l : o.validation_lengths)
    validation_lengths_text += (validation_lengths_text.empty() ? "" : ",") + std::to_string(l);
  if (o.validation_cases > 0 && validation) {
    plan::CalibrationSpec spec;
    spec.lengths = o.validation_lengths;
    spec.samples_per_length = o.validation_cases;
    spec.seed = o.seed + plan::kHeldOutSeed;
    spec.answer_tokens = o.answer_tokens;
    spec.haystack = o.haystack;
    heldout = plan::make_calibration(
        *s.model, *s.tokenizer, spec, [&](const std::string& what) { log("plan: held-out %s (%.1f s)\n", what, t0); },
        answers);
  }
  const double calib_seconds = now_seconds() - t0;

  nlohmann::json report = {{"method", o.method}, {"model", cfg.name}, {"model_file", fs::path(o.model).filename().string()},
                           {"command", o.command_line}, {"samples", nlohmann::json::array()}};
  report["answer_device"] = answers != nullptr ? answers->description() : "cpu";
  for (const auto& smp : samples)
    report["samples"].push_back({{"name", smp.name}, {"tokens", smp.tokens.size()}, {"targets", smp.targets.size()}});
  // The validation texts (MoA's pick and layer repair, TriangleMix's split selection) and their perplexities.
  std::vector<std::vector<int32_t>> texts;
  if (validation && (o.method == "moa" || o.trianglemix_select))
    for (int l : o.validation_lengths)
      for (int k = 0; k < o.validation_texts; ++k) texts.push_back(validation_tokens(s, o.haystack, l, k));
  auto perplexities = [&](const attn::AttentionPolicy& p) {
    std::vector<double> ppl;
    for (const std::vector<int32_t>& ids : texts) {
      runtime::EngineOptions eo;
      eo.policy = p;
      // score() keeps one chunk of logits: 512 x vocab (Gemma-3: 0.5 GB), not S x vocab; the GPU's default chunk
      // (its logits reduced on the device, the rows capped by its logits chunk)
      eo.chunk_size = answers != nullptr ? 0 : 512;
      eo.max_context = static_cast<int32_t>(ids.size());
      ppl.push_back(eval::perplexity(plan::engine_on(*s.model, answers, eo)->score(ids)));
    }
    return ppl;
  };
  auto summed_log_perplexity = [&](const attn::AttentionPolicy& p) {
    double lp = 0;
    for (double x : perplexities(p)) lp += std::log(x);
    return lp;
  };
  attn::AttentionPolicy policy;
  std::vector<std::string> extra_lines;
  std::string window_spec;  // MoA: the uniform window of the plan's density (at its longest profiled length)
  const double t_plan = now_seconds();
  if (o.method == "minference") {
    plan::MInferenceOptions mo;
    if (o.budget) mo.budget = *o.budget;
    mo.device = device;
    mo.query_rows = o.minference_query_rows;
    mo.query_weight = o.minference_query_weight;
    report["search_device"] = plan::device_name(device);
    report["query_rows"] = mo.query_rows;
    report["query_weight"] = mo.query_weight;
    auto r = plan::plan_minference(*s.model, samples, mo, pool, [&](int32_t done, int32_t total) {
      log("plan: %s (%.1f s)\n", "searched sample " + std::to_string(done) + "/" + std::to_string(total), t0);
    });
    if (o.minference_repair) {
      const int32_t dense_kept = plan::answer_agreement(*s.model, {}, heldout, answers).kept;
      plan::repair_by_heldout(r, cfg, dense_kept, [&](const attn::AttentionPolicy& p) {
        const int32_t k = plan::answer_agreement(*s.model, p, heldout, answers).kept;
        log("plan: %s (%.1f s)\n", "held-out repair: a trial keeps " + std::to_string(k), t0);
        return k;
      });
      report["repair"] = r.repair;
      for (const std::string& line : r.repair) extra_lines.push_back("held-out repair: " + line);
    }
    policy = r.policy;
    nlohmann::json cands = nlohmann::json::array();
    for (size_t c = 0; c < r.candidates.size(); ++c) {
      int chosen = 0;
      for (int32_t ch : r.choice) chosen += ch == static_cast<int32_t>(c);
      cands.push_back({{"pattern", attn::describe(r.candidates[c])}, {"density", r.candidate_density[c]},
                       {"heads", chosen}});
      char buf[160];
      std::snprintf(buf, sizeof buf, "candidate %-45s %s density %.3f, chosen by %d heads",
                    attn::describe(r.candidates[c]).c_str(), mo.size_by_measurement ? "measured" : "predicted",
                    r.candidate_density[c], chosen);
      extra_lines.push_back(buf);
    }
    for (const std::string& d : r.dropped) extra_lines.push_back("paper shape " + d);
    report["candidates"] = cands;
    report["dropped_candidates"] = r.dropped;
    report["calibration_length"] = r.length;
    report["head_error"] = r.score;
    report["error"] = r.error;
    if (!r.query_error.empty()) report["query_error"] = r.query_error;
    report["measured_density"] = r.measured_density;
    std::vector<double> scores = r.score;
    write_text(beside(o.out, ".minference.json"), attn::export_minference(policy, &scores).dump() + "\n");
  } else {
    plan::ProbeRegions regions;  // the paper's probe: 64 sink, 128 window, 128 last rows
    std::vector<int32_t> levels = o.lengths;
    const plan::GradientProfile prof =
        !o.moa_profile_in.empty()
            ? plan::load_moa_profile(o.moa_profile_in)
            : plan::profile_gradients(*s.model, samples, levels, regions, pool, [&](int32_t done, int32_t total) {
                log("plan: %s (%.1f s)\n", "profiled sample " + std::to_string(done) + "/" + std::to_string(total), t0);
              }, device, /*keep_samples=*/o.method == "moa");
    if (!o.moa_profile_in.empty()) {
      check(prof.num_layers == cfg.num_layers && prof.num_q_heads == cfg.num_q_heads,
            "--moa-profile-in: the profile is of " + std::to_string(prof.num_layers) + " layers x " +
                std::to_string(prof.num_q_heads) + " heads, the model has " + std::to_string(cfg.num_layers) + " x " +
                std::to_string(cfg.num_q_heads));
      std::vector<int32_t> have;
      for (const auto& lp : prof.lengths) have.push_back(lp.length);
      std::vector<int32_t> want(levels.begin(), levels.end());
      std::sort(want.begin(), want.end());
      want.erase(std::unique(want.begin(), want.end()), want.end());
      check(have == want, "--moa-profile-in: the profile's lengths are not --lengths");
      report["moa_profile_in"] = o.moa_profile_in;
    }
    if (!o.moa_profile_out.empty()) plan::save_moa_profile(prof, o.moa_profile_out);
    report["profile_seconds"] = prof.seconds;
    report["profile_device"] = plan::device_name(device);
    report["calibration_loss"] = prof.loss;
    if (o.method == "moa") {
      plan::MoaOptions mo;
      if (o.budget) mo.budget = *o.budget;
      mo.estimate = plan::parse_loss_estimate(o.moa_loss);
      mo.allow_sink_only = !o.moa_no_sink_only;
      mo.head_loss_cap = o.moa_head_cap;
      report["moa_head_cap"] = mo.head_loss_cap;
      mo.beta_steps = o.moa_beta_steps;
      report["moa_beta_steps"] = mo.beta_steps;
      for (const auto& layer : cfg.layers) mo.layer_windows.push_back(layer.sliding_window);
      report["moa_sink_only_rules"] = mo.allow_sink_only;
      report["moa_loss"] = plan::loss_estimate_name(mo.estimate);
      plan::PlanValidation validate;
      // Per Pareto plan (validate runs on them in order): each validation text's perplexity, for the report.
      std::vector<std::vector<double>> text_perplexities;
      if (validation) {
        validate = [&](const attn::AttentionPolicy& p) {
          const plan::Agreement a = heldout.empty() ? plan::Agreement{} : plan::answer_agreement(*s.model, p, heldout, answers);
          const std::vector<double> ppl = perplexities(p);
          text_perplexities.push_back(ppl);
          return plan::pooled_validation(a.kept, a.total, ppl);
        };
      }
      const auto r = plan::plan_moa(prof, cfg.num_kv_heads, mo, validate,
                                    [&](const std::string& what) { log("plan: %s (%.1f s)\n", what, t0); });
      policy = r.policy;
      if (o.moa_layer_repair) {
        // The plan's rules against the uniform window of its density (at the first profiled length), layer by
        // layer, by the summed log perplexity of the validation texts; the window where the rules lose.
        const double beta = plan::uniform_window_for(r.pareto[r.chosen].density[0], r.lengths[0], mo.sink).beta;
        int32_t evaluated = 0;
        const plan::LayerRepair lr = plan::repair_layers(
            r.policy, beta, r.lengths,
            [&](const attn::AttentionPolicy& p) {
              const double lp = summed_log_perplexity(p);
              log("plan: %s (%.1f s)\n", "layer repair: policy " + std::to_string(++evaluated) + " measured", t0);
              return lp;
            },
            mo.layer_windows, mo.sink);
        policy = lr.policy;
        report["layer_repair"] = {{"window_beta", lr.window_beta}, {"slope", lr.slope}, {"window_log_perplexity", lr.window_lp},
                                  {"plan_log_perplexity", lr.plan_lp}, {"net", lr.net}, {"kept_layers", lr.kept_layers},
                                  {"free_beta", lr.free_beta}, {"log_perplexity", lr.lp}, {"lines", lr.lines}};
        for (const std::string& line : lr.lines) extra_lines.push_back("layer repair: " + line);
        // The repair judges layers by the texts' perplexity, which a window can satisfy while answers need the
        // plan's reach (Gemma-3 with retrieval tasks: docs/plans/README.md): it stands only if it keeps as many
        // held-out answers as the plan.
        if (!heldout.empty()) {
          const double share = r.pareto[r.chosen].validation_agreement;  // the pick measured it (-1: not)
          const int32_t before = share >= 0 ? static_cast<int32_t>(std::lround(share * static_cast<double>(heldout.size())))
                                            : plan::answer_agreement(*s.model, r.policy, heldout, answers).kept;
          const int32_t after = plan::answer_agreement(*s.model, lr.policy, heldout, answers).kept;
          const bool stands = after >= before;
          if (!stands) policy = r.policy;
          report["layer_repair"]["heldout_plan"] = before;
          report["layer_repair"]["heldout_repaired"] = after;
          report["layer_repair"]["applied"] = stands;
          extra_lines.push_back("layer repair: the repaired plan keeps " + std::to_string(after) + " of " +
                                std::to_string(heldout.size()) + " held-out answers, the plan " +
                                std::to_string(before) + (stands ? ": the repair stands" : ": the plan stays"));
        }
      }
      nlohmann::json pareto = nlohmann::json::array();
      for (size_t i = 0; i < r.pareto.size(); ++i) {
        const auto& c = r.pareto[i];
        pareto.push_back({{"loss", c.loss}, {"density", c.density}, {"validation_perplexity", c.validation_perplexity},
                          {"validation_text_perplexities",
                           i < text_perplexities.size() ? text_perplexities[i] : std::vector<double>{}},
                          {"validation_agreement", c.validation_agreement},
                          {"proven_optimal", c.proven_optimal}, {"chosen", i == r.chosen}});
        std::string line = "pareto plan " + std::to_string(i + 1) + (i == r.chosen ? " (chosen):" : ":");
        for (size_t k = 0; k < r.lengths.size(); ++k) {
          char buf[96];
          std::snprintf(buf, sizeof buf, " loss@%d %.4g density %.3f;", r.lengths[k], c.loss[k], c.density[k]);
          line += buf;
        }
        if (c.validation_agreement >= 0) {
          char buf[64];
          std::snprintf(buf, sizeof buf, " held-out answers kept %.3f;", c.validation_agreement);
          line += buf;
        }
        if (c.validation_perplexity > 0) {
          char buf[64];
          std::snprintf(buf, sizeof buf, " validation perplexity %.4f", c.validation_perplexity);
          line += buf;
          if (i < text_perplexities.size() && text_perplexities[i].size() > 1) {
            line += " (geometric mean of";
            for (double p : text_perplexities[i]) {
              std::snprintf(buf, sizeof buf, " %.4f", p);
              line += buf;
            }
            line += ")";
          }
        }
        extra_lines.push_back(line);
      }
      report["lengths"] = r.lengths;
      report["pareto"] = pareto;
      report["mips"] = r.mips;
      report["distinct_rules"] = r.options;
      extra_lines.push_back(std::to_string(r.options) + " distinct rules at the profiled lengths, " +
                            std::to_string(r.mips) + " mixed-integer programs");
      report["validation_lengths"] = o.validation_lengths;
      report["validation_texts"] = o.validation_texts;
      // The calibration noise: the chosen plan's first-order loss against a uniform window of the same density at
      // each profiled length, mean and standard error over the calibration samples (compare_losses).
      nlohmann::json noise = nlohmann::json::array();
      const std::vector<attn::Pattern> chosen = r.policy.table();
      for (size_t k = 0; k < r.lengths.size(); ++k) {
        plan::GradientProfile one = prof;
        one.lengths = {prof.lengths[k]};
        const attn::ElasticWindowPattern uni =
            plan::uniform_window_for(r.pareto[r.chosen].density[k], r.lengths[k], mo.sink);
        const auto c =
            plan::compare_losses(one, chosen, std::vector<attn::Pattern>(chosen.size(), uni), mo.estimate).front();
        char spec[96];
        std::snprintf(spec, sizeof spec, "moa:alpha=0,beta=%.6f,sink=%d", uni.beta, uni.sink);
        noise.push_back({{"length", c.length}, {"samples", c.samples}, {"uniform", attn::describe(uni)},
                         {"uniform_spec", spec},
                         {"uniform_density", plan::pattern_density_exact(uni, c.length)},
                         {"plan_loss", c.loss}, {"plan_loss_se", c.loss_se}, {"uniform_loss", c.other},
                         {"uniform_loss_se", c.other_se}, {"difference", c.diff}, {"difference_se", c.diff_se},
                         {"loss", plan::loss_estimate_name(mo.estimate)}});
        window_spec = spec;
        if (mo.estimate != plan::LossEstimate::FirstOrder) {  // MoA's own estimate of the same two, beside it
          const auto f = plan::compare_losses(one, chosen, std::vector<attn::Pattern>(chosen.size(), uni)).front();
          noise.back()["first_order"] = {{"plan_loss", f.loss}, {"plan_loss_se", f.loss_se}, {"uniform_loss", f.other},
                                         {"uniform_loss_se", f.other_se}, {"difference", f.diff},
                                         {"difference_se", f.diff_se}};
        }
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "calibration noise at %d (%d samples, %s loss): plan %.4g +- %.2g (s.e.), uniform %s %.4g +- "
                      "%.2g, difference %.4g +- %.2g",
                      c.length, c.samples, plan::loss_estimate_name(mo.estimate), c.loss, c.loss_se, attn::describe(uni).c_str(), c.other, c.other_se,
                      c.diff, c.diff_se);
        extra_lines.push_back(buf);
      }
      report["calibration_noise"] = noise;
      // What the worst head loses of its influence mass (head_lost_shares), the plan against the uniform window of its
      // density: the per-head cap (--moa-head-cap) bounds the plan's; the window's is a natural value for it.
      nlohmann::json lost = nlohmann::json::array();
      {
        const std::vector<plan::ElasticRule> space = plan::moa_rule_space(mo.beta_steps);
        const auto shares = plan::head_lost_shares(prof, space, mo.sink);
        const auto& rule_of_head = r.pareto[r.chosen].rule_of_head;
        for (size_t k = 0; k < r.lengths.size(); ++k) {
          plan::GradientProfile one = prof;
          one.lengths = {prof.lengths[k]};
          const double beta = plan::uniform_window_for(r.pareto[r.chosen].density[k], r.lengths[k], mo.sink).beta;
          const auto uni = plan::head_lost_shares(one, {{0, beta}}, mo.sink).front();
          double pmax = 0, pmean = 0, umax = 0, umean = 0;
          for (size_t h = 0; h < rule_of_head.size(); ++h) {
            const double v = shares[k][h * space.size() + static_cast<size_t>(rule_of_head[h])];
            pmax = std::max(pmax, v);
            pmean += v / static_cast<double>(rule_of_head.size());
            umax = std::max(umax, uni[h]);
            umean += uni[h] / static_cast<double>(rule_of_head.size());
          }
          lost.push_back({{"length", r.lengths[k]}, {"plan_max", pmax}, {"plan_mean", pmean}, {"uniform_max", umax},
                          {"uniform_mean", umean}});
          char buf[200];
          std::snprintf(buf, sizeof buf,
                        "head influence mass lost at %d: the plan's worst head %.3f (mean %.3f), the uniform window's "
                        "%.3f (mean %.3f)",
                        r.lengths[k], pmax, pmean, umax, umean);
          extra_lines.push_back(buf);
        }
      }
      report["head_lost_share"] = lost;
      write_text(beside(o.out, ".moa.json"), attn::export_moa(policy).dump() + "\n");
    } else {
      plan::TriangleMixOptions to;
      to.threshold = o.threshold;
      to.budget = o.budget;
      to.length = o.report_lengths.empty() ? longest : o.report_lengths.front();
      attn::AttentionPolicy inner;
      if (o.inner == "vs")
        inner = attn::AttentionPolicy::uniform(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
                                               attn::VerticalSlashPattern{});
      else if (o.inner != "dense")
        inner = s.policy(o.inner);
      auto r = plan::plan_trianglemix(prof, cfg.num_kv_heads, inner, to);
      policy = r.policy;
      if (o.trianglemix_select) {
        // The split by held-out answers and validation perplexity, from the probe's.
        const plan::SplitSelection sel = plan::select_split(cfg.num_layers, r.probe_start, *o.trianglemix_select,
                                                            [&](int32_t start) {
          const attn::AttentionPolicy p = plan::trianglemix_policy(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
                                                                   inner, to.triangle, start);
          const int32_t kept = heldout.empty() ? 0 : plan::answer_agreement(*s.model, p, heldout, answers).kept;
          const double lp = summed_log_perplexity(p);
          log("plan: %s (%.1f s)\n", "split selection: triangle from layer " + std::to_string(start) + " keeps " +
                                        std::to_string(kept) + ", log perplexity " + std::to_string(lp), t0);
          return std::pair<int32_t, double>{kept, lp};
        });
        r.start_layer = sel.start;
        policy = plan::trianglemix_policy(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, inner, to.triangle,
                                          sel.start);
        nlohmann::json trials = nlohmann::json::array();
        for (const plan::SplitTrial& t : sel.trials) {
          trials.push_back({{"start", t.start}, {"kept", t.kept}, {"log_perplexity", t.log_perplexity},
                            {"acceptable", t.acceptable}});
          char buf[200];
          std::snprintf(buf, sizeof buf, "split selection: triangle from layer %d: held-out answers kept %d (dense %d), "
                        "log perplexity %.5f (dense %.5f)%s", t.start, t.kept, sel.reference_kept, t.log_perplexity,
                        sel.reference_log_perplexity, t.start == cfg.num_layers ? " (no triangle: dense)"
                                                      : t.acceptable ? "" : "  <- outside the tolerance");
          extra_lines.push_back(buf);
        }
        report["split_selection"] = {{"tolerance", *o.trianglemix_select}, {"from", r.probe_start},
                                     {"start", sel.start}, {"trials", trials}};
      }
      for (int32_t l = 0; l < cfg.num_layers; ++l) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "probe layer %2d: middle %.3e  last %.3e  streaming %.3e  (middle signed %+.3e)%s",
                      l, r.middle[static_cast<size_t>(l)], r.last[static_cast<size_t>(l)],
                      r.streaming[static_cast<size_t>(l)], r.middle_signed[static_cast<size_t>(l)],
                      l == r.start_layer ? "  <- triangle from here" : "");
        extra_lines.push_back(buf);
      }
      report["probe"] = {{"middle", r.middle}, {"last", r.last}, {"streaming", r.streaming},
                         {"middle_signed", r.middle_signed}, {"regions", {{"sink", regions.sink}, {"local", regions.local},
                                                                          {"last", regions.last}}}};
      report["probe_start_layer"] = r.probe_start;
      report["start_layer"] = r.start_layer;
      report["threshold"] = o.threshold;
    }
  }
  const double plan_seconds = now_seconds() - t_plan;

  // The plan on the held-out tasks, beside dense (which reproduces its own answers unless prefill and generation
  // round differently).
  if (!heldout.empty()) {
    const plan::Agreement dense = plan::answer_agreement(*s.model, {}, heldout, answers);
    const plan::Agreement mine = plan::answer_agreement(*s.model, policy, heldout, answers);
    report["heldout"] = {{"lengths", o.validation_lengths}, {"cases", heldout.size()}, {"seed", o.seed + plan::kHeldOutSeed},
                         {"plan_kept", mine.kept}, {"dense_kept", dense.kept}, {"plan_per_case", mine.per_sample}};
    extra_lines.push_back("held-out tasks at " + validation_lengths_text + " tokens: the plan reproduces " +
                          std::to_string(mine.kept) + " of " + std::to_string(mine.total) +
                          " dense answers (dense itself " + std::to_string(dense.kept) + ")");
  }

  // The plan beside presets on the same held-out tasks (--compare-with): the answers each keeps and its executed
  // density at the validation lengths (one held-out retrieval prompt each, as --method measure).
  const std::vector<std::string> compared = compare_specs(o.compare_with, window_spec);
  if (!heldout.empty() && !compared.empty()) {
    std::vector<std::pair<std::string, attn::AttentionPolicy>> pols{{"plan", policy}, {"dense", {}}};
    for (const std::string& sp : compared) pols.emplace_back(sp, s.policy(sp));
    std::vector<std::vector<int32_t>> prompts;
    for (int length : o.validation_lengths) {
      plan::CalibrationSpec spec;
      spec.seed = o.seed + plan::kHeldOutSeed;
      spec.haystack = o.haystack;
      spec.answer_tokens = o.answer_tokens;
      prompts.push_back(plan::retrieval_prompt(*s.tokenizer, spec, length, 0));
    }
    log("plan: %s (%.1f s)\n", "comparing with " + std::to_string(compared.size()) + " presets", t0);
    const std::vector<plan::ComparedPolicy> rows =
        plan::compare_policies(*s.model, pols, prompts, heldout, answers, pool);
    nlohmann::json cj = nlohmann::json::array();
    for (const plan::ComparedPolicy& r : rows)
      cj.push_back({{"policy", r.name}, {"density", r.density}, {"kept", r.heldout.kept}, {"total", r.heldout.total},
                    {"per_case", r.heldout.per_sample}});
    report["compared"] = {{"lengths", o.validation_lengths}, {"policies", cj}};
    extra_lines.push_back("beside presets on the held-out tasks (--compare-with):");
    for (const std::string& line : plan::compare_lines(rows, o.validation_lengths)) extra_lines.push_back("  " + line);
  }

  // The plan, its picture and the report.
  nlohmann::json pj = attn::save_policy_json(policy);
  pj["comment"] = "tessera plan --method " + o.method + " for " + cfg.name + ": " + o.command_line;
  pj["planned_lengths"] = plan::planned_range_json(range);
  report["planned_lengths"] = plan::planned_range_json(range);
  if (o.gpus > 0) {
    // FlexAttn's placement of this plan's heads over tensor-parallel GPUs (docs/multi-gpu.md), on the FLOP costs.
    const int64_t len = o.placement_length > 0 ? o.placement_length
                        : o.report_lengths.empty() ? longest
                                                   : *std::max_element(o.report_lengths.begin(), o.report_lengths.end());
    const parallel::Placement p = parallel::plan_placement(policy, len, cfg.hidden_size, cfg.head_dim, o.gpus,
                                                   parallel::parse_placement_method(o.placement));
    const parallel::PlacementSummary ps = parallel::summarize(parallel::flop_costs(policy, len, cfg.hidden_size, cfg.head_dim), p);
    pj["placement"] = parallel::placement_to_json(p);
    extra_lines.push_back("placement: " + o.placement + " over " + std::to_string(o.gpus) + " GPUs for " +
                          with_commas(len) + "-token prompts (FLOP costs): predicted per-layer imbalance mean " +
                          std::to_string(ps.mean_imbalance).substr(0, 5) + ", max " +
                          std::to_string(ps.max_imbalance).substr(0, 5) + " (saved in the plan as \"placement\")");
  }
  write_text(o.out, attn::format_policy_json(pj));
  const int32_t pic_len = o.report_lengths.empty() ? longest : o.report_lengths.back();
  const fs::path svg = o.svg.empty() ? beside(o.out, ".svg") : fs::path(o.svg);
  write_text(svg, plan::plan_svg(policy, cfg.num_layers, cfg.num_q_heads, pic_len,
                                 o.method + " plan for " + cfg.name));

  std::printf("# %s plan for %s\n\n", o.method.c_str(), cfg.name.c_str());
  for (const std::string& l : extra_lines) std::printf("%s\n", l.c_str());
  if (!extra_lines.empty()) std::printf("\n");
  for (const std::string& l : plan::layer_summary(policy, cfg.num_layers, cfg.num_q_heads, pic_len))
    std::printf("%s\n", l.c_str());
  std::printf("\n| length | density | attention TFLOP | dense TFLOP |\n|---:|---:|---:|---:|\n");
  nlohmann::json costs = nlohmann::json::array();
  std::vector<int32_t> layer_windows;
  for (const auto& layer : cfg.layers) layer_windows.push_back(layer.sliding_window);
  for (const auto& c : plan::plan_costs(policy, cfg.num_layers, cfg.num_q_heads, cfg.head_dim,
                                        o.report_lengths.empty() ? std::vector<int32_t>{longest} : o.report_lengths,
                                        layer_windows)) {
    std::printf("| %d | %.3f | %.4f | %.4f |\n", c.length, c.density, c.flops / 1e12, c.dense_flops / 1e12);
    costs.push_back({{"length", c.length}, {"density", c.density}, {"flops", c.flops}, {"dense_flops", c.dense_flops}});
  }
  report["costs"] = costs;
  report["layers"] = plan::layer_summary(policy, cfg.num_layers, cfg.num_q_heads, pic_len);
  report["notes"] = extra_lines;
  report["seconds"] = {{"calibration", calib_seconds}, {"planning", plan_seconds}, {"total", now_seconds() - t0}};
  report["peak_rss_bytes"] = peak_rss_bytes();
#ifdef TESSERA_WITH_GPU_PLAN
  if (device == plan::Device::Cuda) {
    const plan::cuda::RegisteredStats g = plan::cuda::registered_stats();
    report["gpu"] = {{"passes", g.passes}, {"seconds", g.seconds}, {"weight_bytes", g.weight_bytes},
                     {"peak_pass_bytes", g.peak_pass_bytes}, {"peak_device_used_bytes", g.peak_used_bytes}};
    std::printf("GPU: %lld %s, %.1f s; device memory: weights %s, pass peak %s, in use at most %s\n",
                static_cast<long long>(g.passes), o.method == "minference" ? "search forwards" : "gradient passes",
                g.seconds, format_bytes(static_cast<double>(g.weight_bytes)).c_str(),
                format_bytes(static_cast<double>(g.peak_pass_bytes)).c_str(),
                format_bytes(static_cast<double>(g.peak_used_bytes)).c_str());
  }
#endif
  write_text(beside(o.out, ".report.json"), report.dump(1) + "\n");
  std::printf("\nwrote %s, %s, %s%s (calibration %.1f s, planning %.1f s, peak memory %s)\n", o.out.c_str(),
              svg.string().c_str(), beside(o.out, ".report.json").string().c_str(),
              o.method == "minference" ? (", " + beside(o.out, ".minference.json").string()).c_str()
              : o.method == "moa"      ? (", " + beside(o.out, ".moa.json").string()).c_str()
                                       : "",
              calib_seconds, plan_seconds, format_bytes(peak_rss_bytes()).c_str());
  return 0;
}

}  // namespace tessera::cli
