// tessera/eval/scoring.h — how a model's output is judged against a case's expected answers.
//
// The metrics are RULER's: substring matches, case-insensitive, on the output after control characters become
// newlines and the ends are trimmed. They reward an answer that appears anywhere in the output, so a model
// that repeats the question or adds words still passes; that is the benchmark's convention, kept so our
// numbers compare with published ones.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::eval {

enum class Metric {
  string_match_all,   // score = share of the answers found in the output; pass = all found
  string_match_part,  // score = 1 when any answer is found; pass = score 1
  first_number,       // the first number in the output equals one of the answers (numeric single answers)
};

// "string_match_all", "string_match_part", "first_number".
std::string_view metric_name(Metric metric);
// Throws tessera::Error listing the names when `name` is not one of them.
Metric parse_metric(std::string_view name);

struct Score {
  double score = 0;   // in [0, 1]
  bool pass = false;  // score == 1
};

// RULER's post-processing: every byte below 0x20 becomes '\n', then whitespace is trimmed from both ends.
std::string normalize_output(std::string_view output);

// ASCII lower-casing (bytes >= 0x80 are left as they are).
std::string to_lower_ascii(std::string_view s);

// Case-insensitive (ASCII) substring test. An empty needle is contained.
bool contains_ci(std::string_view text, std::string_view needle);

// Share of `answers` that occur in the (normalized) output. Throws tessera::Error when `answers` is empty.
double string_match_all(std::string_view output, const std::vector<std::string>& answers);

// 1 when any of `answers` occurs in the output, else 0. Throws tessera::Error when `answers` is empty.
double string_match_part(std::string_view output, const std::vector<std::string>& answers);

// The first run of decimal digits in the text; thousands separators inside it are removed ("7,654,321" gives
// "7654321", but "12,34" gives "12"). nullopt when the text has no digit.
std::optional<std::string> first_number(std::string_view text);

// Every number in the text, in order, with the same rule as first_number.
std::vector<std::string> all_numbers(std::string_view text);

// Scores `output` with `metric`.
Score score_output(Metric metric, std::string_view output, const std::vector<std::string>& answers);

}  // namespace tessera::eval
