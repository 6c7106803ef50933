// eval scoring and reports: RULER's string-match metrics and answer extraction, the results file, pass-rate
// tables, agreement with dense, the markdown report, the SVG heatmap and perplexity, against hand-computed
// values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "eval/heatmap.h"
#include "eval/metrics.h"
#include "eval/report.h"
#include "eval/results.h"
#include "eval/scoring.h"
#include "eval/task.h"

namespace tessera::eval {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// ---------------------------------------------------------------------------------------------------------
// Scoring

TEST(EvalScoring, NormalizesLikeRuler) {
  EXPECT_EQ(normalize_output("\x01 Hello\tworld \n"), "Hello\nworld");
  EXPECT_EQ(normalize_output("   "), "");
  EXPECT_EQ(to_lower_ascii("AbC-\xc3\x89"), "abc-\xc3\x89");
  EXPECT_TRUE(contains_ci("The Quiet-Harbor", "quiet-HARBOR"));
  EXPECT_FALSE(contains_ci("abc", "abd"));
}

TEST(EvalScoring, StringMatchAllAndPart) {
  const std::vector<std::string> answers = {"123", "456", "789"};
  EXPECT_DOUBLE_EQ(string_match_all("The numbers are 123 and 456.", answers), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(string_match_all("789, 456, 123", answers), 1.0);
  EXPECT_DOUBLE_EQ(string_match_all("nothing", answers), 0.0);
  EXPECT_DOUBLE_EQ(string_match_all("ANSWER: Quiet-Harbor", {"quiet-harbor"}), 1.0);
  EXPECT_DOUBLE_EQ(string_match_part("only 456 here", answers), 1.0);
  EXPECT_DOUBLE_EQ(string_match_part("only 45 here", answers), 0.0);
  EXPECT_EQ(error_of([] { string_match_all("x", {}); }),
            "string_match_all: a case needs at least one expected answer");

  Score s = score_output(Metric::string_match_all, "123 and 789", answers);
  EXPECT_DOUBLE_EQ(s.score, 2.0 / 3.0);
  EXPECT_FALSE(s.pass);
  s = score_output(Metric::string_match_part, "123 and 789", answers);
  EXPECT_TRUE(s.pass);
  s = score_output(Metric::string_match_all, " 123 456 789\n", answers);
  EXPECT_TRUE(s.pass);
}

TEST(EvalScoring, ExtractsNumbers) {
  EXPECT_EQ(first_number("The special magic number is 7,654,321."), "7654321");
  EXPECT_EQ(first_number("abc 12,34 x"), "12");
  EXPECT_EQ(first_number("1234,567"), "1234");
  EXPECT_EQ(first_number("007 is 7"), "007");
  EXPECT_EQ(first_number("no digits"), std::nullopt);
  EXPECT_EQ(all_numbers("a1b22c 3,000 and 4, 5"), (std::vector<std::string>{"1", "22", "3000", "4", "5"}));
  EXPECT_EQ(all_numbers(""), std::vector<std::string>{});

  EXPECT_FALSE(score_output(Metric::first_number, "It is 1234567 or 7654321", {"7654321"}).pass);
  EXPECT_TRUE(score_output(Metric::first_number, "It is 1234567 or 7654321", {"1234567"}).pass);
  EXPECT_TRUE(score_output(Metric::first_number, "is: 1,234,567.", {"1234567"}).pass);
  EXPECT_FALSE(score_output(Metric::first_number, "I do not know", {"1234567"}).pass);
}

TEST(EvalScoring, MetricNames) {
  for (Metric m : {Metric::string_match_all, Metric::string_match_part, Metric::first_number}) {
    EXPECT_EQ(parse_metric(metric_name(m)), m);
  }
  EXPECT_EQ(error_of([] { parse_metric("rouge"); }),
            "unknown metric 'rouge': expected string_match_all, string_match_part or first_number");
}

TEST(EvalScoring, ScoresAGeneratedCase) {
  CaseSpec spec;
  spec.task = TaskKind::niah_multivalue;
  spec.length = 1000;
  spec.depth = 50;
  const auto words = [](const std::string& s) {
    size_t n = 0;
    for (size_t i = 0; i < s.size(); ++i)
      n += s[i] != ' ' && s[i] != '\n' && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '\n');
    return n;
  };
  const TaskCase c = generate_case(spec, noise_haystack(), words);
  const CaseResult all = score_case(
      c, "dense", c.answers[0] + ", " + c.answers[1] + ", " + c.answers[2] + " and " + c.answers[3] + ".");
  EXPECT_TRUE(all.pass);
  EXPECT_EQ(all.id, c.id);
  EXPECT_EQ(all.task, "niah_multivalue");
  EXPECT_EQ(all.depth, 50.0);
  EXPECT_EQ(all.expected, c.answers);
  const CaseResult half = score_case(c, "vs", c.answers[0] + " " + c.answers[2]);
  EXPECT_FALSE(half.pass);
  EXPECT_DOUBLE_EQ(half.score, 0.5);
  EXPECT_EQ(half.policy, "vs");
}

// ---------------------------------------------------------------------------------------------------------
// Results

CaseResult result(const std::string& policy, const std::string& task, size_t length,
                  std::optional<double> depth, bool pass) {
  CaseResult r;
  r.task = task;
  r.length = length;
  r.depth = depth;
  r.id = task + "/" + std::to_string(length) +
         (depth ? "/d" + std::to_string(static_cast<int>(*depth)) : "") + "/s0";
  r.policy = policy;
  r.expected = {"1234567"};
  r.output = pass ? "1234567" : "no idea";
  r.score = pass ? 1 : 0;
  r.pass = pass;
  return r;
}

// Three policies; vs comes first in the input, dense must still lead every listing.
std::vector<CaseResult> sample_results() {
  return {
      result("vs", "niah_single", 4096, 0, true),
      result("vs", "niah_single", 4096, 100, true),
      result("vs", "niah_single", 8192, 0, false),
      result("vs", "niah_single", 8192, 100, true),
      result("vs", "common_words", 4096, std::nullopt, false),
      result("dense", "niah_single", 4096, 0, true),
      result("dense", "niah_single", 4096, 100, false),
      result("dense", "niah_single", 8192, 0, true),
      result("dense", "niah_single", 8192, 100, true),
      result("dense", "common_words", 4096, std::nullopt, true),
      result("ashape", "niah_single", 4096, 0, false),
  };
}

TEST(EvalResults, JsonRoundTripsAndFilesToo) {
  std::vector<CaseResult> rs = sample_results();
  rs[0].output = "bad utf-8 \xff here";
  const nlohmann::json meta = {{"model", "smollm2-135m"}};
  const nlohmann::json j = results_to_json(rs, meta);
  EXPECT_EQ(j["tessera_eval_results"], 1);
  EXPECT_EQ(j["meta"]["model"], "smollm2-135m");
  EXPECT_TRUE(j["results"][4]["depth"].is_null());
  EXPECT_EQ(j["results"][0]["depth"], 0.0);
  const std::vector<CaseResult> back = results_from_json(j, "r.json");
  ASSERT_EQ(back.size(), rs.size());
  for (size_t i = 0; i < rs.size(); ++i) EXPECT_EQ(result_to_json(back[i]), result_to_json(rs[i]));

  const fs::path path =
      fs::temp_directory_path() / ("tessera_eval_results_" + std::to_string(getpid()) + ".json");
  write_results_file(path, rs, meta);
  const std::vector<CaseResult> read = read_results_file(path);
  ASSERT_EQ(read.size(), rs.size());
  EXPECT_EQ(read[0].output, "bad utf-8 \xef\xbf\xbd here");  // the invalid byte became U+FFFD
  EXPECT_EQ(result_to_json(read[3]), result_to_json(rs[3]));
  fs::remove(path);
}

TEST(EvalResults, ErrorsNameTheFileAndField) {
  EXPECT_EQ(error_of([] { results_from_json(nlohmann::json::object(), "r.json"); }),
            "r.json: not a tessera results file (no \"tessera_eval_results\" field)");
  EXPECT_EQ(
      error_of([] {
        results_from_json({{"tessera_eval_results", 2}, {"results", nlohmann::json::array()}}, "r.json");
      }),
      "r.json: results format version 2 is not supported (this build reads version 1)");
  nlohmann::json j = results_to_json(sample_results());
  j["results"][1].erase("pass");
  EXPECT_EQ(error_of([&] { results_from_json(j, "r.json"); }),
            "r.json: results[1]: result is missing field 'pass'");
  j = results_to_json(sample_results());
  j["results"][2]["length"] = "long";
  EXPECT_NE(error_of([&] {
              results_from_json(j, "r.json");
            }).find("r.json: results[2]: result \"niah_single/8192/d0/s0\" has a field of the wrong type"),
            std::string::npos);
  EXPECT_EQ(error_of([] { read_results_file("/nonexistent/r.json"); }),
            "/nonexistent/r.json: cannot open the results file");
}

// ---------------------------------------------------------------------------------------------------------
// Reports

TEST(EvalReport, OrdersPoliciesTasksAndLengths) {
  const std::vector<CaseResult> rs = sample_results();
  EXPECT_EQ(policies_in(rs), (std::vector<std::string>{"dense", "vs", "ashape"}));
  EXPECT_EQ(policies_in(rs, "none"), (std::vector<std::string>{"vs", "dense", "ashape"}));
  EXPECT_EQ(tasks_in(rs), (std::vector<std::string>{"niah_single", "common_words"}));
  EXPECT_EQ(lengths_in(rs), (std::vector<size_t>{4096, 8192}));
  EXPECT_EQ(format_length(4096), "4K");
  EXPECT_EQ(format_length(1u << 20), "1M");
  EXPECT_EQ(format_length(3000), "3000");
  EXPECT_EQ(format_depth(12.5), "12.5%");
  EXPECT_EQ(format_rate({1, 3}), "33.3% (1/3)");
  EXPECT_EQ(format_rate({}), "-");
  EXPECT_EQ(pass_rate(rs, [](const CaseResult& r) { return r.policy == "vs"; }), (PassRate{3, 5}));
}

TEST(EvalReport, GridsCountHandComputedCells) {
  const std::vector<CaseResult> rs = sample_results();
  const PassGrid g = task_length_grid(rs, "dense");
  EXPECT_EQ(g.row_labels, (std::vector<std::string>{"niah_single", "common_words"}));
  EXPECT_EQ(g.col_labels, (std::vector<std::string>{"4K", "8K"}));
  EXPECT_EQ(g.at(0, 0), (PassRate{1, 2}));
  EXPECT_EQ(g.at(0, 1), (PassRate{2, 2}));
  EXPECT_EQ(g.at(1, 0), (PassRate{1, 1}));
  EXPECT_EQ(g.at(1, 1), (PassRate{0, 0}));
  EXPECT_EQ(g.row_total(0), (PassRate{3, 4}));
  EXPECT_EQ(g.col_total(0), (PassRate{2, 3}));
  EXPECT_EQ(g.total(), (PassRate{4, 5}));

  const PassGrid d = depth_length_grid(rs, "vs", "niah_single");
  EXPECT_EQ(d.row_labels, (std::vector<std::string>{"0%", "100%"}));
  EXPECT_EQ(d.col_labels, (std::vector<std::string>{"4K", "8K"}));
  EXPECT_EQ(d.at(0, 0), (PassRate{1, 1}));
  EXPECT_EQ(d.at(0, 1), (PassRate{0, 1}));
  EXPECT_EQ(d.at(1, 0), (PassRate{1, 1}));
  EXPECT_EQ(d.at(1, 1), (PassRate{1, 1}));
  EXPECT_EQ(depth_length_grid(rs, "vs", "common_words").rows(), 0u);
}

TEST(EvalReport, AgreementCountsOnlyCasesDensePasses) {
  const std::vector<Agreement> a = agreement_with_baseline(sample_results());
  ASSERT_EQ(a.size(), 2u);
  // dense passes niah 4K d0, niah 8K d0, niah 8K d100 and common_words 4K.
  EXPECT_EQ(a[0].policy, "vs");  // passes niah 4K d0 and niah 8K d100 of those
  EXPECT_EQ(a[0].lengths, (std::vector<size_t>{4096, 8192}));
  EXPECT_EQ(a[0].by_length, (std::vector<PassRate>{{1, 2}, {1, 2}}));
  EXPECT_EQ(a[0].overall, (PassRate{2, 4}));
  EXPECT_EQ(a[1].policy, "ashape");  // has only niah 4K d0, which it fails
  EXPECT_EQ(a[1].by_length, (std::vector<PassRate>{{0, 1}, {0, 0}}));
  EXPECT_EQ(a[1].overall, (PassRate{0, 1}));

  std::vector<CaseResult> dup = sample_results();
  dup.push_back(dup.front());
  EXPECT_EQ(error_of([&] { agreement_with_baseline(dup); }),
            "results: policy 'vs' has two results for case 'niah_single/4096/d0/s0'");
}

TEST(EvalReport, MarkdownTables) {
  const std::string md = markdown_report(sample_results());
  const std::string dense =
      "## dense\n\n"
      "| task | 4K | 8K | all |\n"
      "|:--|--:|--:|--:|\n"
      "| niah_single | 50.0% (1/2) | 100.0% (2/2) | 75.0% (3/4) |\n"
      "| common_words | 100.0% (1/1) | - | 100.0% (1/1) |\n"
      "| **all** | 66.7% (2/3) | 100.0% (2/2) | 80.0% (4/5) |\n"
      "\n### dense: niah_single by depth\n\n"
      "| depth | 4K | 8K | all |\n"
      "|:--|--:|--:|--:|\n"
      "| 0% | 100.0% (1/1) | 100.0% (1/1) | 100.0% (2/2) |\n"
      "| 100% | 0.0% (0/1) | 100.0% (1/1) | 50.0% (1/2) |\n"
      "| **all** | 50.0% (1/2) | 100.0% (2/2) | 75.0% (3/4) |\n";
  EXPECT_NE(md.find(dense), std::string::npos) << md;
  const std::string agreement =
      "## Agreement with dense\n\nOf the cases dense passes, the share each policy also passes.\n\n"
      "| policy | 4K | 8K | all |\n"
      "|:--|--:|--:|--:|\n"
      "| vs | 50.0% (1/2) | 50.0% (1/2) | 50.0% (2/4) |\n"
      "| ashape | 0.0% (0/1) | - | 0.0% (0/1) |\n";
  EXPECT_NE(md.find(agreement), std::string::npos) << md;
  EXPECT_LT(md.find("## dense"), md.find("## vs"));
  EXPECT_LT(md.find("## vs"), md.find("## ashape"));
  // Without dense results there is no agreement section.
  std::vector<CaseResult> no_dense;
  for (const CaseResult& r : sample_results()) {
    if (r.policy != "dense") no_dense.push_back(r);
  }
  EXPECT_EQ(markdown_report(no_dense).find("Agreement"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------
// Heatmap

// A minimal XML well-formedness check: balanced tags, quoted attributes, escaped '&' and '<' in text.
bool well_formed(const std::string& s, std::string* error) {
  std::vector<std::string> stack;
  size_t i = 0;
  auto fail = [&](const std::string& why) {
    *error = why + " at byte " + std::to_string(i);
    return false;
  };
  while (i < s.size()) {
    if (s[i] == '&') {
      bool ok = false;
      for (const char* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"})
        ok = ok || s.compare(i, std::strlen(e), e) == 0;
      if (!ok) return fail("bare &");
      ++i;
      continue;
    }
    if (s[i] != '<') {
      if (s[i] == '>') return fail("bare >");
      ++i;
      continue;
    }
    const bool closing = i + 1 < s.size() && s[i + 1] == '/';
    size_t j = i + (closing ? 2 : 1);
    size_t name_end = j;
    while (name_end < s.size() && (std::isalnum(static_cast<unsigned char>(s[name_end])) ||
                                   s[name_end] == '-' || s[name_end] == ':'))
      ++name_end;
    const std::string name = s.substr(j, name_end - j);
    if (name.empty()) return fail("tag without a name");
    size_t k = name_end;
    char quote = 0;
    while (k < s.size() && (quote || s[k] != '>')) {
      if (quote && s[k] == quote) {
        quote = 0;
      } else if (!quote && (s[k] == '"' || s[k] == '\'')) {
        quote = s[k];
      } else if (quote && s[k] == '<') {
        return fail("< inside an attribute");
      }
      ++k;
    }
    if (k >= s.size()) return fail("unterminated tag");
    const bool self_closing = s[k - 1] == '/';
    if (closing) {
      if (stack.empty() || stack.back() != name) return fail("mismatched </" + name + ">");
      stack.pop_back();
    } else if (!self_closing) {
      if (stack.empty() && i != 0) return fail("second root element");
      stack.push_back(name);
    }
    i = k + 1;
    if (stack.empty() && i < s.size() && s.find_first_not_of(" \n", i) != std::string::npos) {
      return fail("content after the root element");
    }
  }
  if (!stack.empty()) return fail("unclosed <" + stack.back() + ">");
  return true;
}

size_t count_of(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(EvalHeatmap, ColoursRunRedYellowGreen) {
  EXPECT_EQ(heat_colour(0), "#d73027");
  EXPECT_EQ(heat_colour(0.5), "#fee08b");
  EXPECT_EQ(heat_colour(1), "#1a9850");
  EXPECT_EQ(heat_colour(-1), "#d73027");
  EXPECT_EQ(heat_colour(2), "#1a9850");
  EXPECT_EQ(xml_escape("a<b & \"c\" 'd'>"), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;");
}

TEST(EvalHeatmap, OneRectPerCellInAWellFormedSvg) {
  PassGrid g;
  for (int d = 0; d <= 100; d += 10) g.row_labels.push_back(format_depth(d));
  for (size_t l : {4096, 8192, 16384, 32768, 65536}) g.col_labels.push_back(format_length(l));
  g.cells.assign(g.rows() * g.cols(), {});
  for (size_t r = 0; r < g.rows(); ++r) {
    for (size_t c = 0; c < g.cols(); ++c) {
      if ((r + c) % 4 != 0) g.at(r, c) = PassRate{r % 4, 3};  // some empty cells too
    }
  }
  const std::string svg = heatmap_svg(g, "dense & <vs>: niah_single");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(count_of(svg, "<rect "), 11u * 5u);
  size_t empty = 0;
  for (const PassRate& p : g.cells) empty += p.total == 0;
  EXPECT_EQ(empty, 14u);
  EXPECT_EQ(count_of(svg, "fill=\"#dddddd\""), empty);
  EXPECT_NE(svg.find("dense &amp; &lt;vs&gt;: niah_single"), std::string::npos);
  EXPECT_NE(svg.find("<title>8K, depth 20%: 66.7% (2/3)</title>"), std::string::npos);
  std::string error;
  EXPECT_TRUE(well_formed(svg, &error)) << error;

  const PassGrid d = depth_length_grid(sample_results(), "dense", "niah_single");
  const std::string small = heatmap_svg(d, "dense");
  EXPECT_EQ(count_of(small, "<rect "), 4u);
  EXPECT_TRUE(well_formed(small, &error)) << error;
  // A full cell is green, an empty-pass cell red.
  EXPECT_NE(small.find("fill=\"" + heat_colour(1) + "\""), std::string::npos);
  EXPECT_NE(small.find("fill=\"" + heat_colour(0) + "\""), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------
// Metrics

TEST(EvalMetrics, Perplexity) {
  const std::vector<double> quarter(4, std::log(0.25));
  EXPECT_NEAR(perplexity(quarter), 4.0, 1e-12);
  const std::vector<double> mixed = {std::log(0.5), std::log(0.125)};
  EXPECT_NEAR(perplexity(mixed), 4.0, 1e-12);
  PerplexityAccumulator acc;
  acc.add(std::log(0.5));
  acc.add(std::vector<double>{std::log(0.125)});
  EXPECT_EQ(acc.tokens(), 2u);
  EXPECT_NEAR(acc.perplexity(), 4.0, 1e-12);
  EXPECT_NEAR(acc.bits_per_token(), 2.0, 1e-12);
  EXPECT_NEAR(acc.mean_nll(), 2 * std::log(2.0), 1e-12);
  EXPECT_EQ(error_of([] { perplexity(std::vector<double>{}); }), "perplexity: no tokens");
  EXPECT_NE(error_of([] { perplexity(std::vector<double>{0.5}); }).find("must be <= 0"), std::string::npos);
  EXPECT_NE(error_of([] { perplexity(std::vector<double>{std::nan("")}); }).find("must be <= 0"),
            std::string::npos);
}

TEST(EvalMetrics, WilsonIntervalAndMean) {
  const Interval half = wilson_interval({5, 10});
  EXPECT_NEAR(half.low, 0.236589, 1e-6);
  EXPECT_NEAR(half.high, 0.763411, 1e-6);
  const Interval none = wilson_interval({0, 10});
  EXPECT_NEAR(none.low, 0.0, 1e-12);
  EXPECT_NEAR(none.high, 0.277540, 1e-6);  // 2 * (z^2 / 2n) / (1 + z^2 / n)
  const Interval empty = wilson_interval({0, 0});
  EXPECT_EQ(empty.low, 0.0);
  EXPECT_EQ(empty.high, 1.0);
  EXPECT_DOUBLE_EQ(mean(std::vector<double>{1, 2, 3, 6}), 3.0);
  EXPECT_EQ(error_of([] { mean(std::vector<double>{}); }), "mean: no values");
  PassRate p;
  p.add(true);
  p.add(false);
  p.add(true);
  EXPECT_EQ(p, (PassRate{2, 3}));
  EXPECT_DOUBLE_EQ(p.rate(), 2.0 / 3.0);
}

}  // namespace
}  // namespace tessera::eval
