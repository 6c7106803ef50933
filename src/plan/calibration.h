// tessera/plan/calibration.h — the calibration samples the planners profile on.
//
// A sample is one token sequence and the target tokens whose cross-entropy is the loss (model_gradients.h). As
// MoA and MInference do, the targets are the dense model's own answers: what the planners preserve is the model's
// behaviour, not a reference text's.
//
// Synthetic samples (make_calibration) are generated deterministically from the project's haystacks (eval/task.h:
// the KJV or the noise haystack): for each length and sample index one long-context retrieval task (single
// needle, multi-key needles, passkey, variable tracking, in turn) whose prompt fills the length minus the answer;
// the dense model answers greedily (up to answer_tokens tokens, stopping at an end-of-generation token) and
// sequence = prompt + answer, targets = the answer tokens.
//
// Users' own samples (load_calibration_file):
//  - *.jsonl: one JSON object per line, {"prompt": "...", "target": "..."}; without "target" the dense model's
//    greedy answer is the target. Blank lines are skipped.
//  - any other file: plain text, one sample whose prompt is the text (truncated to max_tokens - answer_tokens
//    tokens) and whose target is the dense model's continuation.
// Errors name the file (and line): "calib.jsonl: line 3: expected a JSON object with a string \"prompt\"",
// "calib.txt: no calibration samples (the file is empty)".
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/tokenizer/tokenizer.h"
#include "plan/model_gradients.h"
#include "runtime/device.h"
#include "runtime/sequence_engine.h"
#include "model/model.h"

namespace tessera::plan {

struct CalibrationSample {
  std::string name;             // "niah_single-4096-0", "calib.jsonl:3"
  std::vector<int32_t> tokens;  // prompt + answer
  std::vector<Target> targets;  // the answer tokens (position = index of the token before it)
  int32_t prompt_tokens = 0;
};

struct CalibrationSpec {
  std::vector<int32_t> lengths{2048};  // tokens per sample (prompt + answer)
  int32_t samples_per_length = 2;
  uint64_t seed = 0;
  int32_t answer_tokens = 16;          // most tokens of each dense answer
  std::string haystack = "kjv";        // eval::load_haystack spec
};

using CalibrationProgress = std::function<void(const std::string& what)>;

// The dense model's greedy answer to `prompt` (1 .. answer_tokens tokens: when the first token ends the
// generation, that token is the answer). Returns prompt + answer as a sample.
// device: where the dense model answers (runtime/device.h: the GPU's engine for `tessera plan --device cuda`); null:
// the CPU engine on `model`. So for every function here that runs the model.
CalibrationSample answer_sample(const runtime::Model& model, const model::Tokenizer& tokenizer, std::string name,
                                std::vector<int32_t> prompt, int32_t answer_tokens,
                                std::vector<int32_t> target = {}, const runtime::Device* device = nullptr);
// A single-sequence engine with options `eo` on `device`, or the CPU engine on `model` when it is null.
std::unique_ptr<runtime::SequenceEngine> engine_on(const runtime::Model& model, const runtime::Device* device,
                                                   const runtime::EngineOptions& eo);

// The prompt of synthetic sample `index` at `length` (the task kind cycles niah_single, niah_multikey, passkey,
// variable_tracking; spec's seed, haystack and answer room), without the dense answer; `name` gets its name.
std::vector<int32_t> retrieval_prompt(const model::Tokenizer& tokenizer, const CalibrationSpec& spec, int32_t length,
                                      int32_t index, std::string* name = nullptr);

std::vector<CalibrationSample> make_calibration(const runtime::Model& model, const model::Tokenizer& tokenizer,
                                                const CalibrationSpec& spec, const CalibrationProgress& progress = {},
                                                const runtime::Device* device = nullptr);

// max_tokens: the longest sample (prompt + target); longer JSONL samples are an error naming the line.
std::vector<CalibrationSample> load_calibration_file(const std::filesystem::path& path,
                                                     const runtime::Model& model,
                                                     const model::Tokenizer& tokenizer, int32_t max_tokens,
                                                     int32_t answer_tokens = 16,
                                                     const runtime::Device* device = nullptr);

// Checks the file before any model is loaded: it exists, is not empty, and (JSONL) every line parses as an object
// with a string "prompt" (and, when present, a string "target"). Throws the errors load_calibration_file would.
void check_calibration_file(const std::filesystem::path& path);

}  // namespace tessera::plan
