// eval tasks: deterministic draws, the .Z decoder and the KJV reader, haystacks, and every task generator
// (determinism, needle placement, length budget, answers correct by construction, checked independently).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "eval/haystack.h"
#include "eval/kjv.h"
#include "eval/lzw.h"
#include "eval/prompt_fit.h"
#include "eval/rng.h"
#include "eval/task.h"

namespace tessera::eval {
namespace {

namespace fs = std::filesystem;

// The message of the tessera::Error that fn throws, or a marker when it throws nothing.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Fake tokenizers: whitespace-separated words, bytes, and a non-additive one (4 bytes a token, rounded up).
size_t count_words(const std::string& s) {
  size_t n = 0;
  bool in_word = false;
  for (char c : s) {
    const bool space = c == ' ' || c == '\n' || c == '\t';
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}
size_t count_bytes(const std::string& s) {
  return s.size();
}
size_t count_quads(const std::string& s) {
  return (s.size() + 3) / 4;
}

size_t occurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

bool kjv_installed() {
  return fs::exists(kDefaultKjvPath);
}

// The KJV when installed (loaded once), else a noise haystack; tests that need the KJV itself skip instead.
const Haystack& prose_haystack() {
  static const Haystack h = kjv_installed() ? kjv_haystack() : noise_haystack(7);
  return h;
}

CaseSpec spec_of(TaskKind task, size_t length, std::optional<double> depth, uint64_t seed = 1,
                 uint32_t sample = 0) {
  CaseSpec s;
  s.task = task;
  s.length = length;
  s.depth = depth;
  s.seed = seed;
  s.sample = sample;
  return s;
}

std::optional<double> depth_for(TaskKind task) {
  return task_uses_depth(task) ? std::optional<double>(50.0) : std::nullopt;
}

// ---------------------------------------------------------------------------------------------------------
// Rng

TEST(EvalRng, EngineIsTheStandardMt19937_64) {
  // The C++ standard fixes the 10000th output of a default-seeded mt19937_64.
  Rng rng(5489u);
  uint64_t x = 0;
  for (int i = 0; i < 10000; ++i) x = rng.next();
  EXPECT_EQ(x, 9981545732273789042ULL);
}

TEST(EvalRng, BoundedDrawsStayInRangeAndCoverIt) {
  Rng rng(3);
  std::vector<int> hist(7, 0);
  for (int i = 0; i < 70000; ++i) {
    const uint64_t v = rng.below(7);
    ASSERT_LT(v, 7u);
    ++hist[v];
  }
  for (int h : hist) EXPECT_NEAR(h, 10000, 500);
  for (int i = 0; i < 1000; ++i) {
    const int64_t v = rng.between(-3, 3);
    ASSERT_GE(v, -3);
    ASSERT_LE(v, 3);
    const double u = rng.unit();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
  EXPECT_EQ(rng.between(5, 5), 5);
  EXPECT_NE(error_of([&] { rng.below(0); }), "<no error>");
}

TEST(EvalRng, DrawsAreFixedAcrossPlatforms) {
  // Pure integer arithmetic on the standard engine: these values must hold on every standard library.
  Rng rng(42);
  std::vector<uint64_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(rng.below(1000));
  Rng again(42);
  std::vector<uint64_t> expect;
  for (int i = 0; i < 6; ++i) expect.push_back(again.next() % 1000);  // 2^64 mod 1000 rejections are ~1e-16
  EXPECT_EQ(got, expect);
  std::vector<int> v = {0, 1, 2, 3, 4, 5, 6, 7};
  Rng a(9), b(9);
  std::vector<int> w = v;
  a.shuffle(v);
  b.shuffle(w);
  EXPECT_EQ(v, w);
  EXPECT_NE(v, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_NE(derive_seed(1, "a", 0), derive_seed(1, "b", 0));
  EXPECT_NE(derive_seed(1, "a", 0), derive_seed(1, "a", 1));
  EXPECT_NE(derive_seed(1, "a", 0), derive_seed(2, "a", 0));
}

// ---------------------------------------------------------------------------------------------------------
// .Z decoder

// A compress(1)-style LZW encoder, written independently of the decoder (its output was checked with
// `gzip -dc`): 9-bit codes growing to max_bits, groups of eight codes padded when the width changes, and,
// with clear_when_full, a CLEAR code whenever the dictionary fills.
std::vector<uint8_t> compress_z(const std::string& in, int max_bits, bool clear_when_full) {
  std::vector<uint8_t> out = {0x1f, 0x9d, static_cast<uint8_t>(0x80 | max_bits)};
  const size_t header = out.size();
  uint64_t bit = 0, group_start = 0;
  auto put = [&](uint32_t code, int width) {
    for (int i = 0; i < width; ++i, ++bit) {
      const size_t byte = header + bit / 8;
      if (byte >= out.size()) out.push_back(0);
      if ((code >> i) & 1) out[byte] |= static_cast<uint8_t>(1u << (bit % 8));
    }
  };
  auto pad = [&](int width) {
    const uint64_t g = static_cast<uint64_t>(width) * 8;
    const uint64_t used = bit - group_start;
    const uint64_t target = group_start + (used + g - 1) / g * g;
    while (bit < target) put(0, 1);
    group_start = bit;
  };
  std::map<std::pair<uint32_t, uint8_t>, uint32_t> dict;
  int width = 9;
  uint32_t max_code = 511;
  uint32_t next = 257;
  const uint32_t limit = 1u << max_bits;
  if (in.empty()) return out;
  uint32_t w = static_cast<uint8_t>(in[0]);
  for (size_t i = 1; i < in.size(); ++i) {
    const auto c = static_cast<uint8_t>(in[i]);
    auto it = dict.find({w, c});
    if (it != dict.end()) {
      w = it->second;
      continue;
    }
    put(w, width);
    if (next > max_code) {
      pad(width);
      ++width;
      max_code = width == max_bits ? limit : (1u << width) - 1;
    }
    if (next < limit) {
      dict[{w, c}] = next++;
    } else if (clear_when_full) {
      put(256, width);
      pad(width);
      width = 9;
      max_code = 511;
      next = 257;
      dict.clear();
    }
    w = c;
  }
  put(w, width);
  return out;
}

TEST(EvalLzw, DecodesAHandWrittenStream) {
  // 'a' (97) then code 257, the entry being defined ("aa"): 97 | 257 << 9 = 0x020261, LSB first.
  const std::vector<uint8_t> z = {0x1f, 0x9d, 0x90, 0x61, 0x02, 0x02};
  EXPECT_EQ(lzw_decompress(z), "aaa");
}

TEST(EvalLzw, RoundTripsThroughWidthChangesAndClears) {
  Rng rng(11);
  std::string text;
  for (int i = 0; i < 200000; ++i)
    text.push_back("abcdefgh  \n"[rng.below(11)] + (rng.below(50) == 0 ? 1 : 0));
  for (int max_bits : {9, 10, 12, 16}) {
    for (bool clear : {false, true}) {
      SCOPED_TRACE("max_bits " + std::to_string(max_bits) + (clear ? " with clears" : ""));
      EXPECT_EQ(lzw_decompress(compress_z(text, max_bits, clear)), text);
    }
  }
  EXPECT_EQ(lzw_decompress(compress_z("x", 16, false)), "x");
}

TEST(EvalLzw, RejectsBadInput) {
  EXPECT_EQ(error_of([] {
              lzw_decompress(std::vector<uint8_t>{0x1f, 0x8b, 0x08});
            }),
            "not a compress (.Z) stream: the header must start with bytes 1f 9d");
  EXPECT_EQ(error_of([] {
              lzw_decompress(std::vector<uint8_t>{0x1f, 0x9d, 0x91});
            }),
            "compress (.Z) stream: maximum code width 17 is outside 9..16");
  // First code 300 is not a literal.
  EXPECT_EQ(error_of([] {
              lzw_decompress(std::vector<uint8_t>{0x1f, 0x9d, 0x90, 0x2c, 0x01});
            }),
            "compress (.Z) stream: first code 300 is not a literal");
}

// ---------------------------------------------------------------------------------------------------------
// KJV

TEST(EvalKjv, ReadsEveryVerse) {
  if (!kjv_installed()) GTEST_SKIP() << "bible-kjv-text is not installed";
  const std::string text = read_kjv_text();
  EXPECT_EQ(text.size(), 4404475u);
  EXPECT_EQ(text.rfind("Holy Bible, Authorized (King James) Version.", 0), 0u);
  const std::vector<KjvVerse> verses = read_kjv_verses();
  ASSERT_EQ(verses.size(), 31102u);
  EXPECT_EQ(verses.front().book, "Ge");
  EXPECT_EQ(verses.front().chapter, 1);
  EXPECT_EQ(verses.front().verse, 1);
  EXPECT_EQ(verses.front().text, "In the beginning God created the heaven and the earth.");
  EXPECT_EQ(verses.back().book, "Rev");
  EXPECT_EQ(verses.back().chapter, 22);
  EXPECT_EQ(verses.back().verse, 21);
  EXPECT_EQ(verses.back().text, "The grace of our Lord Jesus Christ be with you all. Amen.");
  std::set<std::string> books;
  for (const KjvVerse& v : verses) books.insert(v.book);
  EXPECT_EQ(books.size(), 66u);
}

TEST(EvalKjv, ParsesReferences) {
  KjvVerse v;
  ASSERT_TRUE(parse_kjv_line("1Sm3:10 And the LORD came, and stood.", v));
  EXPECT_EQ(v.book, "1Sm");
  EXPECT_EQ(v.chapter, 3);
  EXPECT_EQ(v.verse, 10);
  EXPECT_EQ(v.text, "And the LORD came, and stood.");
  ASSERT_TRUE(parse_kjv_line("SSol1:1 The song of songs, which is Solomon's.", v));
  EXPECT_EQ(v.book, "SSol");
  EXPECT_FALSE(parse_kjv_line("Holy Bible, Authorized (King James) Version.  Textfile 930105.", v));
  EXPECT_FALSE(parse_kjv_line("Ge1 In the beginning", v));
  EXPECT_FALSE(parse_kjv_line("", v));
}

TEST(EvalKjv, MissingFileSaysHowToInstall) {
  EXPECT_EQ(error_of([] { read_kjv_text("/nonexistent/bible.data"); }),
            "/nonexistent/bible.data: cannot open the KJV data file (install it with `apt-get install "
            "bible-kjv-text`, or pass the path of bible.data)");
}

TEST(EvalKjv, HaystackIsCleanProse) {
  if (!kjv_installed()) GTEST_SKIP() << "bible-kjv-text is not installed";
  const Haystack& h = prose_haystack();
  EXPECT_EQ(h.name, "kjv");
  EXPECT_GT(h.sentences.size(), 29000u);
  EXPECT_GT(h.vocabulary.size(), 10000u);
  EXPECT_EQ(h.sentences.front(), "In the beginning God created the heaven and the earth.");
  const std::regex reference(R"(\b[1-3]?[A-Z][a-z]*\d+:\d+\b)");
  for (const std::string& s : h.sentences) {
    ASSERT_FALSE(s.empty());
    ASSERT_NE(s.front(), ' ');
    ASSERT_NE(s.back(), ' ');
    ASSERT_EQ(s.find("  "), std::string::npos) << s;
    ASSERT_EQ(s.find_first_of("0123456789\n\t"), std::string::npos) << s;
    ASSERT_LE(count_words(s), kMaxSentenceWords) << s;
  }
  ASSERT_FALSE(std::regex_search(h.sentences[100], reference));
}

// ---------------------------------------------------------------------------------------------------------
// Haystacks

TEST(EvalHaystack, SplitsSentences) {
  EXPECT_EQ(split_sentences("  One two.  Three?\n\nFour!\"  (Five.) Six"),
            (std::vector<std::string>{"One two.", "Three?", "Four!\"", "(Five.)", "Six"}));
  EXPECT_EQ(split_sentences("Pi is 3.14 exactly. Done..."),
            (std::vector<std::string>{"Pi is 3.14 exactly.", "Done..."}));
  EXPECT_TRUE(split_sentences(" \n ").empty());
}

TEST(EvalHaystack, SplitsLongSentencesAtClauses) {
  const std::vector<std::string> in = {"a b c; d e f: g h, i j k.", "short one."};
  EXPECT_EQ(split_long_sentences(in, 4),
            (std::vector<std::string>{"a b c;", "d e f:", "g h,", "i j k.", "short one."}));
  EXPECT_EQ(split_long_sentences(in, 100), in);
  EXPECT_EQ(split_long_sentences({"w w w w w w"}, 2), (std::vector<std::string>{"w w w w w w"}));
}

TEST(EvalHaystack, NoiseIsDeterministic) {
  const Haystack a = noise_haystack(3, 50), b = noise_haystack(3, 50), c = noise_haystack(4, 50);
  EXPECT_EQ(a.sentences, b.sentences);
  EXPECT_NE(a.sentences, c.sentences);
  EXPECT_EQ(a.name, "noise:3");
  for (const std::string& s : a.sentences) EXPECT_EQ(split_sentences(s), std::vector<std::string>{s});
  EXPECT_EQ(a.sentence(53), a.sentences[3]);
}

TEST(EvalHaystack, ReadsTextFilesAndSpecs) {
  const fs::path path =
      fs::temp_directory_path() / ("tessera_eval_haystack_" + std::to_string(getpid()) + ".txt");
  {
    std::ofstream out(path);
    out << "It was a bright cold day in April.\nThe clocks were striking thirteen.\n\nNothing more.\n";
  }
  const Haystack h = load_haystack("file:" + path.string());
  EXPECT_EQ(h.name, "file:" + path.string());
  EXPECT_EQ(h.sentences, (std::vector<std::string>{"It was a bright cold day in April.",
                                                   "The clocks were striking thirteen.", "Nothing more."}));
  EXPECT_EQ(h.vocabulary.front(), "april");
  fs::remove(path);
  EXPECT_EQ(load_haystack("noise:5").sentences, noise_haystack(5).sentences);
  EXPECT_EQ(load_haystack("noise").name, "noise:0");
  EXPECT_EQ(
      error_of([] { load_haystack("essays"); }),
      "haystack 'essays' is not one of: kjv, kjv:<path to bible.data>, noise, noise:<seed>, file:<path>");
  EXPECT_EQ(error_of([] { load_haystack("noise:x"); }),
            "haystack 'noise:x': the noise seed must be a decimal number");
  EXPECT_EQ(error_of([] { text_file_haystack("/nonexistent/x.txt"); }),
            "/nonexistent/x.txt: cannot open the haystack text file");
}

TEST(EvalHaystack, VocabularyIsPlainLowerCaseWords) {
  Haystack h;
  h.sentences = {"The LORD's word, and the Word.", "Twenty-two men (of Judah) went up; at 3 o'clock."};
  EXPECT_EQ(haystack_vocabulary(h), (std::vector<std::string>{"and", "judah", "men", "the", "went", "word"}));
}

// ---------------------------------------------------------------------------------------------------------
// Budget fitting

TEST(EvalFit, FindsTheLargestSizeThatFits) {
  for (size_t budget : {0, 1, 5, 100, 12345}) {
    // 3 tokens of fixed text, then 7 per unit.
    const FitResult r = fit_largest(budget + 3, 1000000, [](size_t n) { return 3 + 7 * n; });
    EXPECT_EQ(r.n, budget / 7) << budget;
    EXPECT_EQ(r.tokens, 3 + 7 * (budget / 7));
  }
  // Units of growing size and a cap.
  const FitResult r = fit_largest(1000, 20, [](size_t n) { return n * n; });
  EXPECT_EQ(r.n, 20u);
  const FitResult q = fit_largest(1000, 100, [](size_t n) { return n * n; });
  EXPECT_EQ(q.n, 31u);
}

TEST(EvalFit, PlacesInsertionsByTokenShare) {
  const std::vector<size_t> tokens = {10, 10, 10, 10};  // boundaries at 0, 10, 20, 30, 40 tokens
  std::vector<Insertion> ins = {{"a", 0.0}, {"b", 0.24}, {"c", 0.26}, {"d", 0.5}, {"e", 1.0}, {"f", 0.125}};
  EXPECT_EQ(insertion_boundaries(tokens, ins), (std::vector<size_t>{0, 1, 1, 2, 4, 0}));
  EXPECT_EQ(insertion_boundaries({}, ins), (std::vector<size_t>(6, 0)));
}

// ---------------------------------------------------------------------------------------------------------
// Task generation

TEST(EvalTasks, NamesAndIds) {
  for (TaskKind t : all_tasks()) EXPECT_EQ(parse_task(task_name(t)), t);
  EXPECT_EQ(error_of([] { parse_task("qa"); }),
            "unknown task 'qa': expected one of niah_single, niah_multikey, niah_multivalue, passkey, "
            "variable_tracking, common_words, frequent_words");
  EXPECT_EQ(case_id(spec_of(TaskKind::niah_single, 4096, 12.5, 1, 3)), "niah_single/4096/d12.5/s3");
  EXPECT_EQ(case_id(spec_of(TaskKind::common_words, 8192, std::nullopt, 1, 0)), "common_words/8192/s0");
  EXPECT_EQ(depth_grid(5), (std::vector<double>{0, 25, 50, 75, 100}));
  EXPECT_EQ(depth_grid(3), (std::vector<double>{0, 50, 100}));
  EXPECT_EQ(answer_tokens(TaskKind::niah_single), 128u);
  EXPECT_EQ(answer_tokens(TaskKind::variable_tracking), 30u);
}

TEST(EvalTasks, SameSeedGivesIdenticalCasesAndOtherSeedsDiffer) {
  const Haystack& h = prose_haystack();
  for (TaskKind task : all_tasks()) {
    SCOPED_TRACE(std::string(task_name(task)));
    const CaseSpec spec = spec_of(task, 3000, depth_for(task), 17);
    const TaskCase a = generate_case(spec, h, count_words);
    const TaskCase b = generate_case(spec, h, count_words);
    EXPECT_EQ(case_to_json(a).dump(), case_to_json(b).dump());
    CaseSpec other = spec;
    other.seed = 18;
    const TaskCase c = generate_case(other, h, count_words);
    EXPECT_NE(a.context, c.context);
    EXPECT_NE(a.answers, c.answers);
    CaseSpec next_sample = spec;
    next_sample.sample = 1;
    EXPECT_NE(generate_case(next_sample, h, count_words).answers, a.answers);
  }
}

TEST(EvalTasks, OneSampleKeepsItsNeedleAcrossTheGrid) {
  const Haystack& h = prose_haystack();
  const TaskCase a = generate_case(spec_of(TaskKind::niah_single, 2000, 10.0), h, count_words);
  const TaskCase b = generate_case(spec_of(TaskKind::niah_single, 4000, 90.0), h, count_words);
  EXPECT_EQ(a.answers, b.answers);
  EXPECT_EQ(a.question, b.question);
  // Same haystack start: the shorter context's first sentence opens the longer one too.
  EXPECT_EQ(a.context.substr(0, 40), b.context.substr(0, 40));
}

TEST(EvalTasks, FitsTheBudgetWithoutGoingOver) {
  const Haystack& h = prose_haystack();
  const std::vector<std::pair<std::string, TokenCounter>> counters = {
      {"words", count_words}, {"bytes", count_bytes}, {"quads", count_quads}};
  for (const auto& [counter_name, counter] : counters) {
    size_t longest_sentence = 0;
    for (size_t i = 0; i < std::min<size_t>(h.sentences.size(), 40000); ++i) {
      longest_sentence = std::max(longest_sentence, counter(h.sentences[i]));
    }
    for (TaskKind task : all_tasks()) {
      for (size_t length : {2500, 9000}) {
        SCOPED_TRACE(counter_name + " " + std::string(task_name(task)) + " " + std::to_string(length));
        const size_t length_in_units = counter_name == "words" ? length : length * 4;
        TaskOptions options;
        options.reserve_tokens = 100;
        const TaskCase c =
            generate_case(spec_of(task, length_in_units, depth_for(task)), h, counter, options);
        const size_t budget = length_in_units - options.reserve_tokens;
        EXPECT_EQ(c.prompt_tokens, counter(full_prompt(c)));
        EXPECT_LE(c.prompt_tokens, budget);
        // Within one filler step of the budget: a haystack sentence (plus a joining space), or a few list
        // words.
        const size_t step =
            task == TaskKind::common_words || task == TaskKind::frequent_words ? 64 : longest_sentence + 2;
        EXPECT_GE(c.prompt_tokens + step, budget);
      }
    }
  }
}

TEST(EvalTasks, TooShortLengthsSayWhatDidNotFit) {
  const Haystack& h = prose_haystack();
  EXPECT_EQ(
      error_of([&] { generate_case(spec_of(TaskKind::niah_single, 20, 50.0), h, count_words); }),
      "niah_single at 20 tokens: the budget of 20 tokens cannot hold the task's fixed text (instruction, "
      "question and needles take 52 tokens); use a longer length");
  EXPECT_EQ(
      error_of([&] { generate_case(spec_of(TaskKind::common_words, 500, std::nullopt), h, count_words); }),
      "common_words at 500 tokens: the budget of 500 tokens cannot hold the 10 common words x 30 (645 "
      "tokens); use a longer length or a smaller cwe_common_count");
  EXPECT_EQ(
      error_of([&] { generate_case(spec_of(TaskKind::frequent_words, 60, std::nullopt), h, count_words); }),
      "frequent_words at 60 tokens: too short to rank 3 words apart (the most frequent words would tie); use "
      "a longer length");
}

TEST(EvalTasks, RejectsInvalidSpecs) {
  const Haystack& h = prose_haystack();
  EXPECT_EQ(
      error_of([&] { generate_case(spec_of(TaskKind::niah_single, 4096, std::nullopt), h, count_words); }),
      "niah_single at 4096 tokens: this task needs a depth (percent, 0 to 100)");
  EXPECT_EQ(error_of([&] { generate_case(spec_of(TaskKind::passkey, 4096, 101.0), h, count_words); }),
            "passkey at 4096 tokens: depth must be a percentage in [0, 100], got 101");
  EXPECT_EQ(error_of([&] { generate_case(spec_of(TaskKind::common_words, 4096, 5.0), h, count_words); }),
            "common_words at 4096 tokens: this task has no depth; leave it unset");
  TaskOptions o;
  o.reserve_tokens = 4096;
  EXPECT_EQ(error_of([&] { generate_case(spec_of(TaskKind::passkey, 4096, 5.0), h, count_words, o); }),
            "passkey at 4096 tokens: the length must exceed reserve_tokens (4096)");
  o = {};
  o.cwe_common_count = 3;
  EXPECT_EQ(error_of([&] {
              generate_case(spec_of(TaskKind::common_words, 4096, std::nullopt), h, count_words, o);
            }),
            "common_words at 4096 tokens: option cwe_common_count must be > cwe_rare_count");
  EXPECT_EQ(error_of([&] { generate_case(spec_of(TaskKind::passkey, 4096, 5.0), h, TokenCounter{}); }),
            "passkey at 4096 tokens: no token counter given");
}

// The context with `needle` (and one joining space) taken out, and the words before it.
struct NeedleSplit {
  std::string haystack_text;
  size_t words_before = 0;
};

NeedleSplit take_out(const std::string& context, const std::string& needle) {
  const size_t at = context.find(needle);
  EXPECT_NE(at, std::string::npos);
  NeedleSplit s;
  s.words_before = count_words(context.substr(0, at));
  std::string rest = context;
  rest.erase(at, needle.size());
  if (at < rest.size() && rest[at] == ' ') {
    rest.erase(at, 1);
  } else if (at > 0 && rest[at - 1] == ' ') {
    rest.erase(at - 1, 1);
  }
  s.haystack_text = rest;
  return s;
}

TEST(EvalTasks, NeedleSitsOnceAtTheRequestedDepth) {
  const Haystack& h = prose_haystack();
  for (double depth : {0.0, 10.0, 25.0, 33.0, 50.0, 75.0, 90.0, 100.0}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    const TaskCase c = generate_case(spec_of(TaskKind::niah_single, 4000, depth), h, count_words);
    ASSERT_EQ(c.answers.size(), 1u);
    const std::string value = c.answers[0];
    EXPECT_EQ(value.size(), 7u);
    EXPECT_EQ(value.find_first_not_of("0123456789"), std::string::npos);
    // The needle: "The special magic number for <key> is: <value>.", with <key> the one the question names.
    const std::string key = c.question.substr(c.question.find(" for ") + 5,
                                              c.question.find(" mentioned") - c.question.find(" for ") - 5);
    const std::string needle = "The special magic number for " + key + " is: " + value + ".";
    EXPECT_EQ(c.question, "What is the special magic number for " + key + " mentioned in the text above?");
    ASSERT_EQ(occurrences(c.context, needle), 1u);
    EXPECT_EQ(occurrences(full_prompt(c), value), 1u);
    if (depth == 0) {
      EXPECT_EQ(c.context.rfind(needle, 0), 0u);
    }
    if (depth == 100) {
      EXPECT_EQ(c.context.substr(c.context.size() - needle.size()), needle);
    }
    // Between two sentences, and within one sentence of the requested share of the haystack's words.
    const size_t at = c.context.find(needle);
    if (at > 0) {
      EXPECT_EQ(c.context[at - 1], ' ');
      EXPECT_NE(std::string(".?!;:,\"')").find(c.context[at - 2]), std::string::npos);
    }
    const NeedleSplit split = take_out(c.context, needle);
    const std::vector<std::string> sentences = split_sentences(split.haystack_text);
    size_t longest = 0, total = 0;
    for (const std::string& s : sentences) {
      longest = std::max(longest, count_words(s));
      total += count_words(s);
    }
    EXPECT_EQ(total, count_words(split.haystack_text));
    const double target = depth / 100.0 * static_cast<double>(total);
    EXPECT_LE(std::abs(static_cast<double>(split.words_before) - target), static_cast<double>(longest))
        << "needle after " << split.words_before << " of " << total << " words";
  }
}

TEST(EvalTasks, MultikeyHidesDistinctKeysAndAsksOne) {
  const Haystack& h = prose_haystack();
  TaskOptions o;
  o.multikey_needles = 5;
  for (uint64_t seed : {1, 2, 3}) {
    const TaskCase c = generate_case(spec_of(TaskKind::niah_multikey, 5000, 40.0, seed), h, count_words, o);
    const std::regex needle_re(R"(The special magic number for ([a-z]+-[a-z]+) is: (\d{7})\.)");
    std::map<std::string, std::string> found;
    for (auto it = std::sregex_iterator(c.context.begin(), c.context.end(), needle_re);
         it != std::sregex_iterator(); ++it) {
      EXPECT_TRUE(found.emplace((*it)[1].str(), (*it)[2].str()).second) << "key repeated: " << (*it)[1];
    }
    ASSERT_EQ(found.size(), 5u);
    std::set<std::string> values;
    for (const auto& [k, v] : found) values.insert(v);
    EXPECT_EQ(values.size(), 5u);
    bool asked = false;
    for (const auto& [k, v] : found) {
      if (c.question.find(" " + k + " ") != std::string::npos) {
        asked = true;
        EXPECT_EQ(c.answers, std::vector<std::string>{v});
        EXPECT_EQ(c.answer_prefix, "The special magic number for " + k + " mentioned in the text above is");
      }
    }
    EXPECT_TRUE(asked);
  }
}

TEST(EvalTasks, MultivalueAsksForEveryValue) {
  const Haystack& h = prose_haystack();
  const TaskCase c = generate_case(spec_of(TaskKind::niah_multivalue, 5000, 60.0), h, count_words);
  ASSERT_EQ(c.answers.size(), 4u);
  const std::string key = c.question.substr(c.question.find(" for ") + 5,
                                            c.question.find(" mentioned") - c.question.find(" for ") - 5);
  for (const std::string& v : c.answers) {
    EXPECT_EQ(occurrences(c.context, "The special magic number for " + key + " is: " + v + "."), 1u);
  }
  EXPECT_EQ(occurrences(c.context, "The special magic number for "), 4u);
  EXPECT_EQ(std::set<std::string>(c.answers.begin(), c.answers.end()).size(), 4u);
}

TEST(EvalTasks, UuidNeedles) {
  TaskOptions o;
  o.needle_value = NeedleValue::uuid;
  const TaskCase c =
      generate_case(spec_of(TaskKind::niah_single, 3000, 30.0), prose_haystack(), count_words, o);
  ASSERT_EQ(c.answers.size(), 1u);
  EXPECT_TRUE(
      std::regex_match(c.answers[0], std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                                                "[0-9a-f]{12}")));
  EXPECT_EQ(occurrences(c.context, "The special magic uuid for "), 1u);
  EXPECT_EQ(occurrences(c.context, c.answers[0]), 1u);
}

TEST(EvalTasks, PasskeyInNoise) {
  const Haystack noise = noise_haystack();
  const TaskCase c = generate_case(spec_of(TaskKind::passkey, 2000, 70.0), noise, count_words);
  ASSERT_EQ(c.answers.size(), 1u);
  const std::string& v = c.answers[0];
  EXPECT_EQ(v.size(), 5u);
  EXPECT_EQ(occurrences(c.context, "The pass key is " + v + ". Remember it. " + v + " is the pass key."), 1u);
  EXPECT_EQ(c.question, "What is the pass key?");
  EXPECT_EQ(c.answer_prefix, "The pass key is");
  EXPECT_EQ(c.haystack, "noise:0");
  EXPECT_EQ(full_prompt(c), c.instruction + "\n\n" + c.context + "\n\n" + c.question + " " + c.answer_prefix);
  EXPECT_EQ(user_prompt(c), c.instruction + "\n\n" + c.context + "\n\n" + c.question);
}

TEST(EvalTasks, VariableTrackingAnswersFollowTheChains) {
  const Haystack& h = prose_haystack();
  for (int chains : {1, 3}) {
    for (int hops : {0, 2, 6}) {
      SCOPED_TRACE(std::to_string(chains) + " chains, " + std::to_string(hops) + " hops");
      TaskOptions o;
      o.vt_chains = chains;
      o.vt_hops = hops;
      const TaskCase c =
          generate_case(spec_of(TaskKind::variable_tracking, 4000, std::nullopt, 5), h, count_words, o);
      // Resolve every assignment in text order, independently of the generator.
      const std::regex stmt(R"(VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.)");
      std::map<std::string, std::string> value_of;
      size_t statements = 0;
      for (auto it = std::sregex_iterator(c.context.begin(), c.context.end(), stmt);
           it != std::sregex_iterator(); ++it, ++statements) {
        const std::string name = (*it)[1].str();
        ASSERT_EQ(value_of.count(name), 0u) << name << " assigned twice";
        if ((*it)[3].matched) {
          value_of[name] = (*it)[3].str();
        } else {
          const auto src = value_of.find((*it)[2].str());
          ASSERT_NE(src, value_of.end()) << name << " copies a variable not assigned before it";
          value_of[name] = src->second;
        }
      }
      EXPECT_EQ(statements, static_cast<size_t>(chains * (hops + 1)));
      const std::smatch m = [&] {
        std::smatch r;
        std::regex_search(c.question, r, std::regex(R"(the value (\d+) in)"));
        return r;
      }();
      ASSERT_TRUE(!m.empty());
      std::set<std::string> expected;
      for (const auto& [name, value] : value_of) {
        if (value == m[1].str()) expected.insert(name);
      }
      EXPECT_EQ(std::set<std::string>(c.answers.begin(), c.answers.end()), expected);
      EXPECT_EQ(c.answers.size(), static_cast<size_t>(hops + 1));
    }
  }
}

TEST(EvalTasks, CommonWordsCountsAreExact) {
  for (const Haystack* h : {&prose_haystack(), static_cast<const Haystack*>(nullptr)}) {
    const Haystack noise = noise_haystack();
    const Haystack& hay = h ? *h : noise;
    TaskOptions o;
    const TaskCase c =
        generate_case(spec_of(TaskKind::common_words, 6000, std::nullopt, 9), hay, count_words, o);
    // "1. word\n2. word\n...": numbered from 1 without gaps.
    std::map<std::string, int> counts;
    size_t line_no = 0, begin = 0;
    while (begin <= c.context.size()) {
      size_t end = c.context.find('\n', begin);
      if (end == std::string::npos) end = c.context.size();
      const std::string line = c.context.substr(begin, end - begin);
      ++line_no;
      const std::string prefix = std::to_string(line_no) + ". ";
      ASSERT_EQ(line.rfind(prefix, 0), 0u) << line;
      ++counts[line.substr(prefix.size())];
      begin = end + 1;
    }
    std::vector<std::string> common;
    for (const auto& [word, n] : counts) {
      ASSERT_TRUE(n == o.cwe_common_count || n == o.cwe_rare_count) << word << " " << n;
      if (n == o.cwe_common_count) common.push_back(word);
    }
    EXPECT_GT(counts.size(), 100u);
    EXPECT_EQ(std::set<std::string>(common.begin(), common.end()),
              std::set<std::string>(c.answers.begin(), c.answers.end()));
    EXPECT_EQ(c.answers.size(), 10u);
    // No listed word contains an answer or is contained in one (substring scoring stays sound).
    for (const auto& [word, n] : counts) {
      for (const std::string& a : c.answers) {
        if (word != a) {
          EXPECT_TRUE(word.find(a) == std::string::npos && a.find(word) == std::string::npos)
              << word << " " << a;
        }
      }
    }
  }
}

TEST(EvalTasks, FrequentWordsTopRanksAreStrict) {
  const TaskCase c =
      generate_case(spec_of(TaskKind::frequent_words, 5000, std::nullopt, 4), prose_haystack(), count_words);
  std::map<std::string, size_t> counts;
  size_t begin = 0;
  while (begin < c.context.size()) {
    size_t end = c.context.find(' ', begin);
    if (end == std::string::npos) end = c.context.size();
    ++counts[c.context.substr(begin, end - begin)];
    begin = end + 1;
  }
  std::vector<std::pair<size_t, std::string>> ranked;
  for (const auto& [w, n] : counts) ranked.emplace_back(n, w);
  std::sort(ranked.rbegin(), ranked.rend());
  ASSERT_GE(ranked.size(), 4u);
  EXPECT_GT(ranked[2].first, ranked[3].first);
  EXPECT_EQ(c.answers, (std::vector<std::string>{ranked[0].second, ranked[1].second, ranked[2].second}));
  // Zipf with alpha 2: the first rank appears about 4 and 9 times as often as the second and third.
  EXPECT_NEAR(static_cast<double>(ranked[0].first) / static_cast<double>(ranked[1].first), 4.0, 0.1);
  EXPECT_NEAR(static_cast<double>(ranked[0].first) / static_cast<double>(ranked[2].first), 9.0, 0.2);
}

TEST(EvalTasks, SuiteCoversTheGridInOrder) {
  SuiteSpec suite;
  suite.tasks = {TaskKind::niah_single, TaskKind::variable_tracking};
  suite.lengths = {1500, 3000};
  suite.depths = {0, 50, 100};
  suite.samples = 2;
  suite.seed = 3;
  const std::vector<CaseSpec> specs = suite_specs(suite);
  ASSERT_EQ(specs.size(), 2u * 3 * 2 + 2u * 2);
  EXPECT_EQ(case_id(specs[0]), "niah_single/1500/d0/s0");
  EXPECT_EQ(case_id(specs[1]), "niah_single/1500/d0/s1");
  EXPECT_EQ(case_id(specs[2]), "niah_single/1500/d50/s0");
  EXPECT_EQ(case_id(specs[12]), "variable_tracking/1500/s0");
  const std::vector<TaskCase> cases = generate_suite(suite, noise_haystack(), count_words);
  ASSERT_EQ(cases.size(), specs.size());
  std::set<std::string> ids;
  for (const TaskCase& c : cases) ids.insert(c.id);
  EXPECT_EQ(ids.size(), cases.size());
  suite.depths.clear();
  EXPECT_EQ(error_of([&] { suite_specs(suite); }),
            "eval suite: task niah_single needs depths, and none were given");
}

TEST(EvalTasks, CaseJsonRoundTrips) {
  const TaskCase c =
      generate_case(spec_of(TaskKind::niah_multivalue, 2000, 20.0), noise_haystack(), count_words);
  const TaskCase back = case_from_json(case_to_json(c), "cases.json");
  EXPECT_EQ(case_to_json(back).dump(), case_to_json(c).dump());
  nlohmann::json j = case_to_json(c);
  j.erase("answers");
  EXPECT_EQ(error_of([&] { case_from_json(j, "cases.json"); }),
            "cases.json: case is missing field 'answers'");
  j = case_to_json(c);
  j["task"] = "qa";
  EXPECT_NE(error_of([&] { case_from_json(j, "cases.json"); }).find("cases.json: unknown task 'qa'"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera::eval
