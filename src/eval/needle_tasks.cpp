// Needle tasks: sentences hidden in a haystack at chosen depths (NIAH single/multikey/multivalue, passkey)
// and chains of variable assignments (variable tracking).
#include <algorithm>

#include "core/error.h"
#include "eval/prompt_fit.h"
#include "eval/rng.h"
#include "eval/task_generators.h"
#include "eval/words.h"

namespace tessera::eval {

namespace {

void fill_from_haystack(TaskCase& c, const GeneratorInput& in, size_t start,
                        const std::vector<Insertion>& needles, const PromptParts& parts) {
  const FittedContext fit =
      fit_haystack(in.haystack, start, needles, parts, in.budget, in.count_tokens, in.what);
  c.haystack = in.haystack.name;
  c.instruction = parts.instruction;
  c.context = fit.context;
  c.question = parts.question;
  c.answer_prefix = parts.answer_prefix;
  c.prompt_tokens = fit.tokens;
}

}  // namespace

void generate_needle_task(TaskCase& c, const GeneratorInput& in) {
  const TaskOptions& o = in.options;
  Rng rng(in.case_seed);
  // Draw order is part of the case format: start, then keys, then values, then the distractors' depths.
  const size_t start = static_cast<size_t>(rng.below(in.haystack.sentences.size()));
  const double depth = *in.spec.depth / 100.0;
  const bool uuid = o.needle_value == NeedleValue::uuid;
  const std::string noun = uuid ? "uuid" : "number";
  auto draw_value = [&] { return uuid ? random_uuid(rng) : random_number(rng, o.number_digits); };
  auto needle = [&](const std::string& key, const std::string& value) {
    return "The special magic " + noun + " for " + key + " is: " + value + ".";
  };

  std::vector<Insertion> needles;
  PromptParts parts;
  c.metric = Metric::string_match_all;
  switch (in.spec.task) {
    case TaskKind::niah_single: {
      const std::string key = random_key(rng);
      const std::string value = draw_value();
      needles.push_back({needle(key, value), depth});
      parts.instruction =
          "A special magic " + noun +
          " is hidden within the following text. Memorize it: I will ask you about it afterwards.";
      parts.question = "What is the special magic " + noun + " for " + key + " mentioned in the text above?";
      parts.answer_prefix = "The special magic " + noun + " for " + key + " mentioned in the text above is";
      c.answers = {value};
      break;
    }
    case TaskKind::niah_multikey: {
      const auto n = static_cast<size_t>(o.multikey_needles);
      const std::vector<std::string> keys = distinct_keys(rng, n);
      const std::vector<std::string> values = distinct(n, draw_value);
      const size_t asked = static_cast<size_t>(rng.below(n));
      for (size_t i = 0; i < n; ++i) {
        const double fraction = i == asked ? depth : rng.unit();
        needles.push_back({needle(keys[i], values[i]), fraction});
      }
      parts.instruction =
          "Some special magic " + noun +
          "s are hidden within the following text. Memorize them: I will ask you about one of "
          "them afterwards.";
      parts.question =
          "What is the special magic " + noun + " for " + keys[asked] + " mentioned in the text above?";
      parts.answer_prefix =
          "The special magic " + noun + " for " + keys[asked] + " mentioned in the text above is";
      c.answers = {values[asked]};
      break;
    }
    case TaskKind::niah_multivalue: {
      const auto n = static_cast<size_t>(o.multivalue_values);
      const std::string key = random_key(rng);
      const std::vector<std::string> values = distinct(n, draw_value);
      for (size_t i = 0; i < n; ++i) needles.push_back({needle(key, values[i]), i == 0 ? depth : rng.unit()});
      parts.instruction = "Some special magic " + noun +
                          "s are hidden within the following text. Memorize them: I will ask you about them "
                          "afterwards.";
      parts.question =
          "What are all the special magic " + noun + "s for " + key + " mentioned in the text above?";
      parts.answer_prefix = "The special magic " + noun + "s for " + key + " mentioned in the text above are";
      c.answers = values;
      break;
    }
    case TaskKind::passkey: {
      const std::string value = random_number(rng, o.passkey_digits);
      needles.push_back(
          {"The pass key is " + value + ". Remember it. " + value + " is the pass key.", depth});
      parts.instruction =
          "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about it.";
      parts.question = "What is the pass key?";
      parts.answer_prefix = "The pass key is";
      c.answers = {value};
      break;
    }
    default:
      throw Error(in.what + ": not a needle task");
  }
  fill_from_haystack(c, in, start, needles, parts);
}

void generate_variable_tracking(TaskCase& c, const GeneratorInput& in) {
  const TaskOptions& o = in.options;
  Rng rng(in.case_seed);
  const size_t start = static_cast<size_t>(rng.below(in.haystack.sentences.size()));
  const auto chains = static_cast<size_t>(o.vt_chains);
  const auto names_per_chain = static_cast<size_t>(o.vt_hops) + 1;
  const std::vector<std::string> names =
      distinct(chains * names_per_chain, [&] { return variable_name(rng); });
  const std::vector<std::string> values = distinct(chains, [&] { return random_number(rng, 5); });
  const size_t asked = static_cast<size_t>(rng.below(chains));

  // Each chain's statements at increasing depths, so every assignment follows the one it copies.
  std::vector<Insertion> statements;
  for (size_t ch = 0; ch < chains; ++ch) {
    std::vector<double> fractions(names_per_chain);
    for (double& f : fractions) f = rng.unit();
    std::sort(fractions.begin(), fractions.end());
    for (size_t h = 0; h < names_per_chain; ++h) {
      const std::string& name = names[ch * names_per_chain + h];
      const std::string rhs = h == 0 ? values[ch] : "VAR " + names[ch * names_per_chain + h - 1];
      statements.push_back({"VAR " + name + " = " + rhs + ".", fractions[h]});
    }
  }
  PromptParts parts;
  parts.instruction = "Memorize and track the chains of variable assignments hidden in the following text.";
  parts.question = "Find all variables that are assigned the value " + values[asked] + " in the text above.";
  parts.answer_prefix = "In the text above, " + std::to_string(names_per_chain) +
                        " variables are assigned the value " + values[asked] + ". They are:";
  c.answers.assign(names.begin() + static_cast<ptrdiff_t>(asked * names_per_chain),
                   names.begin() + static_cast<ptrdiff_t>((asked + 1) * names_per_chain));
  c.metric = Metric::string_match_all;
  fill_from_haystack(c, in, start, statements, parts);
}

}  // namespace tessera::eval
