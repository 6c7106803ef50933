// tessera/eval/task.h — RULER-style long-context tasks: what a case is and how cases are generated.
//
// Every case is a prompt (instruction, context, question, answer prefix) and the answers a correct output
// contains. Generation is deterministic: the same spec, haystack, options and token counter give
// byte-identical cases on every platform (see rng.h). Lengths are in tokens of the model's tokenizer, which
// the caller passes as a counting callback, so this layer needs no model and tests can count words or bytes
// instead.
//
// Budget: full_prompt(case) counts at most `length - options.reserve_tokens` tokens, and as close to it as
// the filler's granularity allows (the generator finds, by measuring, the largest number of haystack
// sentences / list words that fits). The token counter must grow (weakly) with text appended.
//
// Thread safety: generate_case only reads its arguments, so cases may be generated in parallel when the token
// counter is safe to call from several threads.
//
// Depth: for needle tasks, the share of the context's haystack tokens (measured sentence by sentence) that
// precede the needle, in percent: 0 puts it first, 100 last, always between two sentences.
//
// Seeds: a case's random draws come from derive_seed(seed, task name, sample) only, so across a
// length x depth grid one sample keeps the same haystack start, keys and values and only length and depth
// change, as in the NIAH figures of the papers.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eval/haystack.h"
#include "eval/scoring.h"

namespace tessera::eval {

// Tokens of a text under the model's tokenizer (without BOS or chat template).
using TokenCounter = std::function<size_t(const std::string&)>;

enum class TaskKind {
  niah_single,        // one needle "The special magic number for <key> is: <value>."; ask for the value
  niah_multikey,      // several needles with distinct keys; ask for one key's value
  niah_multivalue,    // one key with several values, each its own needle; ask for all values
  passkey,            // "The pass key is <n>. Remember it. <n> is the pass key."; ask for it
  variable_tracking,  // chains VAR A = 12345, VAR B = VAR A, ...; ask for every variable holding 12345
  common_words,       // numbered word list, a few words repeated many times; ask for the most common
  frequent_words,     // Zipf-distributed coded words; ask for the most frequent
};

// Every kind, in the order above.
const std::vector<TaskKind>& all_tasks();
// "niah_single", "niah_multikey", "niah_multivalue", "passkey", "variable_tracking", "common_words",
// "frequent_words".
std::string_view task_name(TaskKind task);
// Throws tessera::Error listing the names when `name` is not one of them.
TaskKind parse_task(std::string_view name);
// Whether cases of this task are placed at a depth (the NIAH family and passkey).
bool task_uses_depth(TaskKind task);
// Tokens to let the model generate for an answer (RULER's budgets: 128 for the NIAH family, 30 for
// variable_tracking, 120 for common_words, 50 for frequent_words; 32 for passkey).
size_t answer_tokens(TaskKind task);

enum class NeedleValue { number, uuid };

struct TaskOptions {
  NeedleValue needle_value = NeedleValue::number;  // niah_*: 7-digit numbers or UUIDs
  int number_digits = 7;
  int passkey_digits = 5;
  int multikey_needles = 4;   // niah_multikey: needles, all with distinct keys
  int multivalue_values = 4;  // niah_multivalue: values of the one key
  int vt_chains = 1;          // variable_tracking: chains (one is asked, the others distract)
  int vt_hops = 4;            // assignments after the first, so each chain names vt_hops + 1 variables
  int cwe_words = 10;         // common_words: the words asked for
  int cwe_common_count = 30;  // occurrences of each common word
  int cwe_rare_count = 3;     // occurrences of each other word
  int fwe_words = 3;          // frequent_words: the words asked for
  double fwe_alpha = 2.0;     // Zipf exponent: the word of rank r appears floor(C / r^alpha) times
  size_t reserve_tokens = 0;  // kept free below the length (the answer, chat template tokens)
};

struct CaseSpec {
  TaskKind task = TaskKind::niah_single;
  size_t length = 0;            // tokens
  std::optional<double> depth;  // percent in [0, 100]: required exactly when task_uses_depth(task)
  uint64_t seed = 0;
  uint32_t sample = 0;
};

struct TaskCase {
  std::string id;  // "niah_single/4096/d50/s0"; "common_words/4096/s0" for tasks without depth
  TaskKind task = TaskKind::niah_single;
  size_t length = 0;
  std::optional<double> depth;
  uint64_t seed = 0;
  uint32_t sample = 0;
  // Haystack::name of the filler (for common_words: of the word source; "" for frequent_words).
  std::string haystack;

  std::string instruction;    // before the context
  std::string context;        // the long part
  std::string question;       // after the context
  std::string answer_prefix;  // the start of the answer, for the model to continue
  std::vector<std::string> answers;
  Metric metric = Metric::string_match_all;
  size_t prompt_tokens = 0;  // count_tokens(full_prompt(case))
};

// instruction + "\n\n" + context + "\n\n" + question: the user turn of a chat model.
std::string user_prompt(const TaskCase& c);
// user_prompt + " " + answer_prefix: the text a base model continues (a chat model gets the answer prefix at
// the start of its own turn instead).
std::string full_prompt(const TaskCase& c);
// The same from parts.
std::string assemble_prompt(std::string_view instruction, std::string_view context, std::string_view question,
                            std::string_view answer_prefix);

// The case id of a spec (see TaskCase::id).
std::string case_id(const CaseSpec& spec);

// Generates one case. Throws tessera::Error when the spec is invalid (depth missing, present or out of range,
// options out of range) or when the length cannot hold the task's fixed text, naming the task and length.
TaskCase generate_case(const CaseSpec& spec, const Haystack& haystack, const TokenCounter& count_tokens,
                       const TaskOptions& options = {});

struct SuiteSpec {
  std::vector<TaskKind> tasks;
  std::vector<size_t> lengths;
  std::vector<double> depths;  // used by the tasks with depth; the others get one case per length and sample
  uint32_t samples = 1;
  uint64_t seed = 0;
  TaskOptions options;
};

// `steps` depths evenly from 0 to 100 (steps = 11 gives 0, 10, ..., 100). steps must be >= 2.
std::vector<double> depth_grid(int steps);

// The specs of a suite, in the order task, length, depth, sample.
std::vector<CaseSpec> suite_specs(const SuiteSpec& suite);

// generate_case for every spec of the suite.
std::vector<TaskCase> generate_suite(const SuiteSpec& suite, const Haystack& haystack,
                                     const TokenCounter& count_tokens);

// A case as JSON (every field) and back; case_from_json throws tessera::Error naming `source` and the field.
nlohmann::json case_to_json(const TaskCase& c);
TaskCase case_from_json(const nlohmann::json& j, const std::string& source);

}  // namespace tessera::eval
