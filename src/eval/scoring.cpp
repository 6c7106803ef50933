#include "eval/scoring.h"

#include <algorithm>
#include <cctype>
#include <iterator>
#include <optional>

#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::eval {

namespace {

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Reads the number that starts at text[i] (a digit); returns it and moves i past it.
std::string read_number(std::string_view text, size_t& i) {
  std::string out;
  while (i < text.size() && is_digit(text[i])) out.push_back(text[i++]);
  // "7,654,321": a comma followed by exactly three digits continues the number when the leading group had at
  // most three digits.
  if (out.size() > 3) return out;
  auto group_at = [&](size_t k) {
    return k + 3 < text.size() && text[k] == ',' && is_digit(text[k + 1]) && is_digit(text[k + 2]) &&
           is_digit(text[k + 3]) && (k + 4 == text.size() || !is_digit(text[k + 4]));
  };
  while (group_at(i)) {
    out.append(text.substr(i + 1, 3));
    i += 4;
  }
  return out;
}

void check_answers(const std::vector<std::string>& answers, std::string_view metric) {
  check(!answers.empty(), std::string(metric) + ": a case needs at least one expected answer");
}

// In the enum's order.
constexpr std::string_view kMetricNames[] = {"string_match_all", "string_match_part", "first_number"};
static_assert(std::size(kMetricNames) == static_cast<size_t>(Metric::first_number) + 1);

}  // namespace

std::string_view metric_name(Metric metric) {
  return enum_name(kMetricNames, metric);
}

Metric parse_metric(std::string_view name) {
  if (const std::optional<Metric> m = enum_value<Metric>(kMetricNames, name)) return *m;
  throw Error("unknown metric '" + std::string(name) +
              "': expected string_match_all, string_match_part or first_number");
}

std::string normalize_output(std::string_view output) {
  std::string s(output);
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  }
  auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  size_t b = 0, e = s.size();
  while (b < e && space(s[b])) ++b;
  while (e > b && space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

std::string to_lower_ascii(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

bool contains_ci(std::string_view text, std::string_view needle) {
  return to_lower_ascii(text).find(to_lower_ascii(needle)) != std::string::npos;
}

double string_match_all(std::string_view output, const std::vector<std::string>& answers) {
  check_answers(answers, "string_match_all");
  const std::string text = to_lower_ascii(normalize_output(output));
  size_t found = 0;
  for (const std::string& a : answers) found += text.find(to_lower_ascii(a)) != std::string::npos;
  return static_cast<double>(found) / static_cast<double>(answers.size());
}

double string_match_part(std::string_view output, const std::vector<std::string>& answers) {
  check_answers(answers, "string_match_part");
  const std::string text = to_lower_ascii(normalize_output(output));
  for (const std::string& a : answers) {
    if (text.find(to_lower_ascii(a)) != std::string::npos) return 1.0;
  }
  return 0.0;
}

std::optional<std::string> first_number(std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (is_digit(text[i])) return read_number(text, i);
  }
  return std::nullopt;
}

std::vector<std::string> all_numbers(std::string_view text) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    if (is_digit(text[i])) {
      out.push_back(read_number(text, i));
    } else {
      ++i;
    }
  }
  return out;
}

Score score_output(Metric metric, std::string_view output, const std::vector<std::string>& answers) {
  Score s;
  switch (metric) {
    case Metric::string_match_all:
      s.score = string_match_all(output, answers);
      break;
    case Metric::string_match_part:
      s.score = string_match_part(output, answers);
      break;
    case Metric::first_number: {
      check_answers(answers, "first_number");
      const auto n = first_number(output);
      s.score = n && std::find(answers.begin(), answers.end(), *n) != answers.end() ? 1.0 : 0.0;
      break;
    }
  }
  s.pass = s.score == 1.0;
  return s;
}

}  // namespace tessera::eval
