#include "plan/calibration.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "eval/haystack.h"
#include "eval/task.h"
#include "runtime/engine.h"

namespace tessera::plan {

namespace fs = std::filesystem;

namespace {

std::string read_all(const fs::path& path) {
  std::error_code ec;
  check(fs::is_regular_file(path, ec), path.string() + ": no such calibration file");
  std::ifstream f(path, std::ios::binary);
  check(f.good(), path.string() + ": cannot read the calibration file");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

bool is_jsonl(const fs::path& path) { return path.extension() == ".jsonl"; }

struct JsonlItem {
  int line = 0;
  std::string prompt;
  std::optional<std::string> target;
};

std::vector<JsonlItem> parse_jsonl(const fs::path& path, const std::string& text) {
  std::vector<JsonlItem> items;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (blank(line)) continue;
    const std::string where = path.string() + ": line " + std::to_string(n) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      throw Error(where + "not valid JSON (each line of a .jsonl calibration file is one object "
                          "{\"prompt\": \"...\", \"target\": \"...\"})");
    }
    check(j.is_object() && j.contains("prompt") && j["prompt"].is_string(),
          where + "expected a JSON object with a string \"prompt\"");
    check(!j.contains("target") || j["target"].is_string(), where + "\"target\" must be a string");
    check(!j["prompt"].get<std::string>().empty(), where + "\"prompt\" is empty");
    JsonlItem item{n, j["prompt"].get<std::string>(), std::nullopt};
    if (j.contains("target")) {
      item.target = j["target"].get<std::string>();
      check(!item.target->empty(), where + "\"target\" is empty");
    }
    items.push_back(std::move(item));
  }
  check(!items.empty(), path.string() + ": no calibration samples (the file has no lines)");
  return items;
}

}  // namespace

std::unique_ptr<runtime::SequenceEngine> engine_on(const runtime::Model& model, const runtime::Device* device,
                                                   const runtime::EngineOptions& eo) {
  if (device != nullptr) return device->engine(eo);
  return std::make_unique<runtime::Engine>(model, eo);
}

CalibrationSample answer_sample(const runtime::Model& model, const model::Tokenizer& tokenizer, std::string name,
                                std::vector<int32_t> prompt, int32_t answer_tokens, std::vector<int32_t> target,
                                const runtime::Device* device) {
  CalibrationSample s;
  s.name = std::move(name);
  s.prompt_tokens = static_cast<int32_t>(prompt.size());
  check(!prompt.empty(), s.name + ": empty prompt");
  if (target.empty()) {
    runtime::EngineOptions eo;
    eo.max_context = static_cast<int32_t>(prompt.size()) + answer_tokens + 1;
    const std::unique_ptr<runtime::SequenceEngine> engine = engine_on(model, device, eo);
    runtime::GenerateOptions g;
    g.max_new_tokens = answer_tokens;
    bool ended = false;
    g.stop_tokens = {};
    engine->generate(prompt, g, [&](int32_t t) {
      if (ended) return false;
      target.push_back(t);
      if (tokenizer.is_end_of_generation(t)) ended = true;  // the end token is a target too, then stop
      return !ended;
    });
  }
  check(!target.empty(), s.name + ": the dense model gave no answer token");
  s.tokens = std::move(prompt);
  // Target k (the answer's token k) is predicted at the position of the token before it.
  for (size_t k = 0; k < target.size(); ++k)
    s.targets.push_back({static_cast<int32_t>(s.tokens.size() + k) - 1, target[k]});
  // The last answer token is predicted but needs no position of its own.
  s.tokens.insert(s.tokens.end(), target.begin(), target.end() - 1);
  return s;
}

std::vector<int32_t> retrieval_prompt(const model::Tokenizer& tokenizer, const CalibrationSpec& spec, int32_t length,
                                      int32_t index, std::string* name) {
  static const eval::TaskKind kinds[] = {eval::TaskKind::niah_single, eval::TaskKind::niah_multikey,
                                         eval::TaskKind::passkey, eval::TaskKind::variable_tracking};
  const eval::Haystack hay = eval::load_haystack(spec.haystack);
  const eval::TokenCounter count = [&](const std::string& t) {
    return tokenizer.encode(t, {.add_special = false}).size();
  };
  eval::CaseSpec cs;
  cs.task = kinds[static_cast<size_t>(index) % 4];
  cs.length = static_cast<size_t>(length);
  if (eval::task_uses_depth(cs.task)) cs.depth = 100.0 * (0.15 + 0.7 * ((index * 37) % 11) / 10.0);
  cs.seed = spec.seed;
  cs.sample = static_cast<uint32_t>(index);
  eval::TaskOptions topts;
  topts.reserve_tokens = static_cast<size_t>(spec.answer_tokens) + 4;
  const eval::TaskCase c = eval::generate_case(cs, hay, count, topts);
  if (name) *name = std::string(eval::task_name(cs.task)) + "-" + std::to_string(length) + "-" + std::to_string(index);
  return tokenizer.encode(eval::full_prompt(c), {.add_special = true});
}

std::vector<CalibrationSample> make_calibration(const runtime::Model& model, const model::Tokenizer& tokenizer,
                                                const CalibrationSpec& spec, const CalibrationProgress& progress,
                                                const runtime::Device* device) {
  check(!spec.lengths.empty(), "calibration: no lengths");
  check(spec.samples_per_length >= 1, "calibration: samples per length must be >= 1");
  check(spec.answer_tokens >= 1, "calibration: answer tokens must be >= 1");
  std::vector<CalibrationSample> out;
  for (const int32_t length : spec.lengths) {
    check(length > spec.answer_tokens + 64 && length <= model.config().context_length,
          "calibration: length " + std::to_string(length) + " must be in (" + std::to_string(spec.answer_tokens + 64) +
              ", " + std::to_string(model.config().context_length) + "] for " + model.config().name);
    for (int32_t i = 0; i < spec.samples_per_length; ++i) {
      std::string name;
      std::vector<int32_t> prompt = retrieval_prompt(tokenizer, spec, length, i, &name);
      if (progress) progress("calibration sample " + name + " (" + std::to_string(prompt.size()) + " tokens)");
      out.push_back(answer_sample(model, tokenizer, name, std::move(prompt), spec.answer_tokens, {}, device));
    }
  }
  return out;
}

void check_calibration_file(const fs::path& path) {
  const std::string text = read_all(path);
  check(!blank(text), path.string() + ": no calibration samples (the file is empty)");
  if (is_jsonl(path)) parse_jsonl(path, text);
}

std::vector<CalibrationSample> load_calibration_file(const fs::path& path, const runtime::Model& model,
                                                     const model::Tokenizer& tokenizer, int32_t max_tokens,
                                                     int32_t answer_tokens, const runtime::Device* device) {
  const std::string text = read_all(path);
  check(!blank(text), path.string() + ": no calibration samples (the file is empty)");
  std::vector<CalibrationSample> out;
  if (is_jsonl(path)) {
    for (const JsonlItem& item : parse_jsonl(path, text)) {
      const std::string name = path.filename().string() + ":" + std::to_string(item.line);
      std::vector<int32_t> prompt = tokenizer.encode(item.prompt, {.add_special = true});
      std::vector<int32_t> target;
      if (item.target) target = tokenizer.encode(*item.target, {.add_special = false});
      const size_t total = prompt.size() + (item.target ? target.size() : static_cast<size_t>(answer_tokens));
      check(total <= static_cast<size_t>(max_tokens),
            path.string() + ": line " + std::to_string(item.line) + ": " + std::to_string(total) +
                " tokens (prompt + target) exceed the limit of " + std::to_string(max_tokens));
      out.push_back(answer_sample(model, tokenizer, name, std::move(prompt), answer_tokens, std::move(target), device));
    }
    return out;
  }
  std::vector<int32_t> prompt = tokenizer.encode(text, {.add_special = true});
  check(max_tokens > answer_tokens + 1, path.string() + ": the sample limit is too small");
  if (prompt.size() > static_cast<size_t>(max_tokens - answer_tokens))
    prompt.resize(static_cast<size_t>(max_tokens - answer_tokens));
  out.push_back(
      answer_sample(model, tokenizer, path.filename().string(), std::move(prompt), answer_tokens, {}, device));
  return out;
}

}  // namespace tessera::plan
