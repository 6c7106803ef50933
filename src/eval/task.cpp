#include "eval/task.h"

#include <cmath>
#include <iterator>

#include "core/error.h"
#include "core/format.h"
#include "eval/rng.h"
#include "eval/task_generators.h"

namespace tessera::eval {

namespace {

void check_option(bool ok, const std::string& what, const std::string& option, const std::string& rule) {
  check(ok, what + ": option " + option + " must be " + rule);
}

void validate(const CaseSpec& spec, const TaskOptions& o, const std::string& what) {
  check(spec.length > o.reserve_tokens,
        what + ": the length must exceed reserve_tokens (" + std::to_string(o.reserve_tokens) + ")");
  if (task_uses_depth(spec.task)) {
    check(spec.depth.has_value(), what + ": this task needs a depth (percent, 0 to 100)");
    check(std::isfinite(*spec.depth) && *spec.depth >= 0 && *spec.depth <= 100,
          what + ": depth must be a percentage in [0, 100], got " + format_g(*spec.depth));
  } else {
    check(!spec.depth.has_value(), what + ": this task has no depth; leave it unset");
  }
  switch (spec.task) {
    case TaskKind::niah_single:
    case TaskKind::niah_multikey:
    case TaskKind::niah_multivalue:
      check_option(o.number_digits >= 1 && o.number_digits <= 18, what, "number_digits", "in 1..18");
      check_option(o.multikey_needles >= 1 && o.multikey_needles <= 1000, what, "multikey_needles",
                   "in 1..1000");
      check_option(o.multivalue_values >= 1 && o.multivalue_values <= 1000, what, "multivalue_values",
                   "in 1..1000");
      break;
    case TaskKind::passkey:
      check_option(o.passkey_digits >= 1 && o.passkey_digits <= 18, what, "passkey_digits", "in 1..18");
      break;
    case TaskKind::variable_tracking:
      check_option(o.vt_chains >= 1 && o.vt_chains <= 100, what, "vt_chains", "in 1..100");
      check_option(o.vt_hops >= 0 && o.vt_hops <= 1000, what, "vt_hops", "in 0..1000");
      break;
    case TaskKind::common_words:
      check_option(o.cwe_words >= 1 && o.cwe_words <= 1000, what, "cwe_words", "in 1..1000");
      check_option(o.cwe_rare_count >= 1, what, "cwe_rare_count", ">= 1");
      check_option(o.cwe_common_count > o.cwe_rare_count, what, "cwe_common_count", "> cwe_rare_count");
      break;
    case TaskKind::frequent_words:
      check_option(o.fwe_words >= 1 && o.fwe_words <= 100, what, "fwe_words", "in 1..100");
      check_option(std::isfinite(o.fwe_alpha) && o.fwe_alpha > 0 && o.fwe_alpha <= 8, what, "fwe_alpha",
                   "in (0, 8]");
      break;
  }
}

// Each task in the enum's order: its name, whether its cases sit at a depth, the tokens the model may answer
// in (RULER's budgets) and its generator.
struct TaskTraits {
  std::string_view name;
  bool uses_depth;
  size_t answer_tokens;
  void (*generate)(TaskCase& c, const GeneratorInput& in);
};

constexpr TaskTraits kTasks[] = {
    {"niah_single", true, 128, generate_needle_task},
    {"niah_multikey", true, 128, generate_needle_task},
    {"niah_multivalue", true, 128, generate_needle_task},
    {"passkey", true, 32, generate_needle_task},
    {"variable_tracking", false, 30, generate_variable_tracking},
    {"common_words", false, 120, generate_common_words},
    {"frequent_words", false, 50, generate_frequent_words},
};
static_assert(std::size(kTasks) == static_cast<size_t>(TaskKind::frequent_words) + 1);

// nullptr for a number past the last task.
const TaskTraits* traits(TaskKind task) {
  const auto i = static_cast<size_t>(task);
  return i < std::size(kTasks) ? &kTasks[i] : nullptr;
}

}  // namespace

const std::vector<TaskKind>& all_tasks() {
  static const std::vector<TaskKind> v = [] {
    std::vector<TaskKind> tasks;
    for (size_t i = 0; i < std::size(kTasks); ++i) tasks.push_back(static_cast<TaskKind>(i));
    return tasks;
  }();
  return v;
}

std::string_view task_name(TaskKind task) {
  const TaskTraits* t = traits(task);
  return t != nullptr ? t->name : "unknown";
}

TaskKind parse_task(std::string_view name) {
  std::string names;
  for (TaskKind t : all_tasks()) {
    if (task_name(t) == name) return t;
    names += (names.empty() ? "" : ", ") + std::string(task_name(t));
  }
  throw Error("unknown task '" + std::string(name) + "': expected one of " + names);
}

bool task_uses_depth(TaskKind task) {
  const TaskTraits* t = traits(task);
  return t != nullptr && t->uses_depth;
}

size_t answer_tokens(TaskKind task) {
  const TaskTraits* t = traits(task);
  return t != nullptr ? t->answer_tokens : 128;
}

std::string assemble_prompt(std::string_view instruction, std::string_view context, std::string_view question,
                            std::string_view answer_prefix) {
  std::string s;
  s.reserve(instruction.size() + context.size() + question.size() + answer_prefix.size() + 8);
  s.append(instruction).append("\n\n").append(context).append("\n\n").append(question);
  if (!answer_prefix.empty()) s.append(" ").append(answer_prefix);
  return s;
}

std::string user_prompt(const TaskCase& c) {
  std::string s = c.instruction;
  s.append("\n\n").append(c.context).append("\n\n").append(c.question);
  return s;
}

std::string full_prompt(const TaskCase& c) {
  return assemble_prompt(c.instruction, c.context, c.question, c.answer_prefix);
}

std::string case_id(const CaseSpec& spec) {
  std::string id = std::string(task_name(spec.task)) + "/" + std::to_string(spec.length);
  if (spec.depth) id += "/d" + format_g(*spec.depth);
  return id + "/s" + std::to_string(spec.sample);
}

TaskCase generate_case(const CaseSpec& spec, const Haystack& haystack, const TokenCounter& count_tokens,
                       const TaskOptions& options) {
  const std::string what =
      std::string(task_name(spec.task)) + " at " + std::to_string(spec.length) + " tokens";
  validate(spec, options, what);
  check(static_cast<bool>(count_tokens), what + ": no token counter given");
  check(!haystack.sentences.empty(), what + ": the haystack '" + haystack.name + "' has no sentences");
  TaskCase c;
  c.id = case_id(spec);
  c.task = spec.task;
  c.length = spec.length;
  c.depth = spec.depth;
  c.seed = spec.seed;
  c.sample = spec.sample;
  const GeneratorInput in{spec,
                          haystack,
                          count_tokens,
                          options,
                          derive_seed(spec.seed, task_name(spec.task), spec.sample),
                          spec.length - options.reserve_tokens,
                          what};
  if (const TaskTraits* t = traits(spec.task)) t->generate(c, in);
  return c;
}

std::vector<double> depth_grid(int steps) {
  check(steps >= 2, "depth_grid: steps must be >= 2");
  std::vector<double> v;
  for (int i = 0; i < steps; ++i) {
    // Rounded to 1e-6 so that 3 steps give 0, 50, 100 rather than 49.99999999999999.
    v.push_back(std::round(100.0 * i / (steps - 1) * 1e6) / 1e6);
  }
  return v;
}

std::vector<CaseSpec> suite_specs(const SuiteSpec& suite) {
  check(!suite.tasks.empty() && !suite.lengths.empty(), "eval suite: no tasks or no lengths given");
  check(suite.samples >= 1, "eval suite: samples must be >= 1");
  std::vector<CaseSpec> specs;
  for (TaskKind task : suite.tasks) {
    const bool with_depth = task_uses_depth(task);
    check(!with_depth || !suite.depths.empty(),
          "eval suite: task " + std::string(task_name(task)) + " needs depths, and none were given");
    for (size_t length : suite.lengths) {
      const size_t depth_count = with_depth ? suite.depths.size() : 1;
      for (size_t d = 0; d < depth_count; ++d) {
        for (uint32_t s = 0; s < suite.samples; ++s) {
          CaseSpec spec;
          spec.task = task;
          spec.length = length;
          if (with_depth) spec.depth = suite.depths[d];
          spec.seed = suite.seed;
          spec.sample = s;
          specs.push_back(spec);
        }
      }
    }
  }
  return specs;
}

std::vector<TaskCase> generate_suite(const SuiteSpec& suite, const Haystack& haystack,
                                     const TokenCounter& count_tokens) {
  std::vector<TaskCase> cases;
  for (const CaseSpec& spec : suite_specs(suite)) {
    cases.push_back(generate_case(spec, haystack, count_tokens, suite.options));
  }
  return cases;
}

nlohmann::json case_to_json(const TaskCase& c) {
  nlohmann::json j;
  j["id"] = c.id;
  j["task"] = task_name(c.task);
  j["length"] = c.length;
  j["depth"] = c.depth ? nlohmann::json(*c.depth) : nlohmann::json(nullptr);
  j["seed"] = c.seed;
  j["sample"] = c.sample;
  j["haystack"] = c.haystack;
  j["instruction"] = c.instruction;
  j["context"] = c.context;
  j["question"] = c.question;
  j["answer_prefix"] = c.answer_prefix;
  j["answers"] = c.answers;
  j["metric"] = metric_name(c.metric);
  j["prompt_tokens"] = c.prompt_tokens;
  return j;
}

TaskCase case_from_json(const nlohmann::json& j, const std::string& source) {
  check(j.is_object(), source + ": a case must be a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json& {
    check(j.contains(name), std::string("case is missing field '") + name + "'");
    return j.at(name);
  };
  try {
    TaskCase c;
    c.id = field("id").get<std::string>();
    c.task = parse_task(field("task").get<std::string>());
    c.length = field("length").get<size_t>();
    if (!field("depth").is_null()) c.depth = field("depth").get<double>();
    c.seed = field("seed").get<uint64_t>();
    c.sample = field("sample").get<uint32_t>();
    c.haystack = field("haystack").get<std::string>();
    c.instruction = field("instruction").get<std::string>();
    c.context = field("context").get<std::string>();
    c.question = field("question").get<std::string>();
    c.answer_prefix = field("answer_prefix").get<std::string>();
    c.answers = field("answers").get<std::vector<std::string>>();
    c.metric = parse_metric(field("metric").get<std::string>());
    c.prompt_tokens = field("prompt_tokens").get<size_t>();
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": case " + (j.contains("id") ? j["id"].dump() + " " : "") +
                "has a field of the wrong " + "type (" + e.what() + ")");
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

}  // namespace tessera::eval
