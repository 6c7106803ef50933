// tessera/eval/results.h — one scored model output per (case, policy), and the results file.
//
// File format (JSON):
//   {"tessera_eval_results": 1, "meta": {...free-form: model, date, command...},
//    "results": [{"id": "niah_single/4096/d50/s0", "task": "niah_single", "length": 4096, "depth": 50,
//                 "seed": 0, "sample": 0, "policy": "dense", "metric": "string_match_all",
//                 "expected": ["1234567"], "output": "...", "score": 1.0, "pass": true}, ...]}
// "depth" is null for tasks without depth. Tasks are kept as strings so files from newer versions still load.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "eval/scoring.h"
#include "eval/task.h"

namespace tessera::eval {

struct CaseResult {
  std::string id;
  std::string task;
  size_t length = 0;
  std::optional<double> depth;
  uint64_t seed = 0;
  uint32_t sample = 0;
  std::string policy;  // "dense" for the baseline, else the policy's name
  Metric metric = Metric::string_match_all;
  std::vector<std::string> expected;
  std::string output;
  double score = 0;
  bool pass = false;
};

// Scores `output` (the model's continuation after the answer prefix) against the case.
CaseResult score_case(const TaskCase& c, const std::string& policy, const std::string& output);

nlohmann::json result_to_json(const CaseResult& r);
// Throws tessera::Error naming `source` and the field at fault.
CaseResult result_from_json(const nlohmann::json& j, const std::string& source);

nlohmann::json results_to_json(const std::vector<CaseResult>& results, const nlohmann::json& meta = {});
std::vector<CaseResult> results_from_json(const nlohmann::json& j, const std::string& source);

// File I/O (pretty-printed, 1 space indent). Errors name the path.
void write_results_file(const std::filesystem::path& path, const std::vector<CaseResult>& results,
                        const nlohmann::json& meta = {});
std::vector<CaseResult> read_results_file(const std::filesystem::path& path);

}  // namespace tessera::eval
