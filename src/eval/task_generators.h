// tessera/eval/task_generators.h — the per-task generators behind generate_case (internal to eval).
#pragma once

#include <cstdint>
#include <string>

#include "eval/haystack.h"
#include "eval/task.h"

namespace tessera::eval {

// What every generator gets: the validated spec and the case's own seed and token budget.
struct GeneratorInput {
  const CaseSpec& spec;
  const Haystack& haystack;
  const TokenCounter& count_tokens;
  const TaskOptions& options;
  uint64_t case_seed = 0;  // derive_seed(spec.seed, task name, spec.sample)
  size_t budget = 0;       // length - reserve_tokens
  std::string what;        // "niah_single at 4096 tokens": the start of error messages
};

// Each fills instruction, context, question, answer_prefix, answers, metric, haystack and prompt_tokens.
void generate_needle_task(TaskCase& c, const GeneratorInput& in);  // niah_single/multikey/multivalue, passkey
void generate_variable_tracking(TaskCase& c, const GeneratorInput& in);
void generate_common_words(TaskCase& c, const GeneratorInput& in);
void generate_frequent_words(TaskCase& c, const GeneratorInput& in);

}  // namespace tessera::eval
