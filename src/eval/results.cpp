#include "eval/results.h"

#include <fstream>

#include "core/error.h"

namespace tessera::eval {

CaseResult score_case(const TaskCase& c, const std::string& policy, const std::string& output) {
  CaseResult r;
  r.id = c.id;
  r.task = std::string(task_name(c.task));
  r.length = c.length;
  r.depth = c.depth;
  r.seed = c.seed;
  r.sample = c.sample;
  r.policy = policy;
  r.metric = c.metric;
  r.expected = c.answers;
  r.output = output;
  const Score s = score_output(c.metric, output, c.answers);
  r.score = s.score;
  r.pass = s.pass;
  return r;
}

nlohmann::json result_to_json(const CaseResult& r) {
  nlohmann::json j;
  j["id"] = r.id;
  j["task"] = r.task;
  j["length"] = r.length;
  j["depth"] = r.depth ? nlohmann::json(*r.depth) : nlohmann::json(nullptr);
  j["seed"] = r.seed;
  j["sample"] = r.sample;
  j["policy"] = r.policy;
  j["metric"] = metric_name(r.metric);
  j["expected"] = r.expected;
  j["output"] = r.output;
  j["score"] = r.score;
  j["pass"] = r.pass;
  return j;
}

CaseResult result_from_json(const nlohmann::json& j, const std::string& source) {
  try {
    check(j.is_object(), "a result must be a JSON object");
    auto field = [&](const char* name) -> const nlohmann::json& {
      check(j.contains(name), std::string("result is missing field '") + name + "'");
      return j.at(name);
    };
    CaseResult r;
    r.id = field("id").get<std::string>();
    r.task = field("task").get<std::string>();
    r.length = field("length").get<size_t>();
    if (!field("depth").is_null()) r.depth = field("depth").get<double>();
    r.seed = field("seed").get<uint64_t>();
    r.sample = field("sample").get<uint32_t>();
    r.policy = field("policy").get<std::string>();
    r.metric = parse_metric(field("metric").get<std::string>());
    r.expected = field("expected").get<std::vector<std::string>>();
    r.output = field("output").get<std::string>();
    r.score = field("score").get<double>();
    r.pass = field("pass").get<bool>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": result " + (j.is_object() && j.contains("id") ? j["id"].dump() + " " : "") +
                "has a field of the wrong type (" + e.what() + ")");
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

nlohmann::json results_to_json(const std::vector<CaseResult>& results, const nlohmann::json& meta) {
  nlohmann::json j;
  j["tessera_eval_results"] = 1;
  j["meta"] = meta.is_null() ? nlohmann::json::object() : meta;
  nlohmann::json arr = nlohmann::json::array();
  for (const CaseResult& r : results) arr.push_back(result_to_json(r));
  j["results"] = std::move(arr);
  return j;
}

std::vector<CaseResult> results_from_json(const nlohmann::json& j, const std::string& source) {
  check(j.is_object() && j.contains("tessera_eval_results"),
        source + ": not a tessera results file (no \"tessera_eval_results\" field)");
  check(j["tessera_eval_results"] == 1, source + ": results format version " +
                                            j["tessera_eval_results"].dump() +
                                            " is not supported (this build reads version 1)");
  check(j.contains("results") && j["results"].is_array(), source + ": \"results\" must be an array");
  std::vector<CaseResult> out;
  const auto& arr = j["results"];
  for (size_t i = 0; i < arr.size(); ++i) {
    out.push_back(result_from_json(arr[i], source + ": results[" + std::to_string(i) + "]"));
  }
  return out;
}

void write_results_file(const std::filesystem::path& path, const std::vector<CaseResult>& results,
                        const nlohmann::json& meta) {
  std::ofstream out(path, std::ios::binary);
  check(static_cast<bool>(out), path.string() + ": cannot open for writing");
  // Model outputs may hold invalid UTF-8 (a character cut by the token limit): written with U+FFFD.
  out << results_to_json(results, meta).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  check(static_cast<bool>(out), path.string() + ": write failed");
}

std::vector<CaseResult> read_results_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), path.string() + ": cannot open the results file");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  return results_from_json(j, path.string());
}

}  // namespace tessera::eval
