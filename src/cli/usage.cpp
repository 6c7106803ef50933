// The command line's answer to a wrong command line (usage.h): unknown flags and subcommands with the nearest known
// name, llama.cpp's flags with tessera's equivalent.
#include "cli/usage.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <numeric>
#include <vector>

namespace tessera::cli {

size_t edit_distance(std::string_view a, std::string_view b) {
  // Three rows: a transposition of neighbours (rnu -> run) looks two rows back.
  std::vector<size_t> before(b.size() + 1), prev(b.size() + 1), row(b.size() + 1);
  std::iota(prev.begin(), prev.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      row[j] = std::min({prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) row[j] = std::min(row[j], before[j - 2] + 1);
    }
    before.swap(prev);
    prev.swap(row);
  }
  return prev[b.size()];
}

namespace {

// llama.cpp's flags (llama-cli, llama-server, llama-bench) that tessera has no flag of the same name for, with what
// to use instead. Flags whose meaning is tessera's are aliases in main.cpp (-c/--ctx-size, --temp, -s,
// --n-predict, --file, --system-prompt) and never get here. `commands`: the subcommands the line is for ("" all).
struct Foreign {
  const char* names;     // space-separated
  const char* commands;  // space-separated subcommands, "" for any
  const char* llama;     // llama.cpp's long name
  const char* advice;
};
constexpr Foreign kForeign[] = {
    {"-ngl --n-gpu-layers --gpu-layers", "", "--n-gpu-layers",
     "tessera does not split a model's layers between devices: --device cuda runs every layer on the GPU, "
     "--device cpu none"},
    {"-fa --flash-attn", "", "--flash-attn",
     "tessera's attention is always fused (flash-style); --attn picks the sparse pattern"},
    {"-b --batch-size -ub --ubatch-size", "run serve eval", "--batch-size", "tessera's prefill chunk is --chunk N"},
    {"-cnv --conversation -i --interactive", "run", "--conversation",
     "tessera run answers one prompt; --chat wraps it as a user turn in the model's chat format (tessera serve for "
     "conversations)"},
    {"-sys", "run", "--system-prompt", "tessera's is --system TEXT (with --chat)"},
    {"--repeat-penalty --presence-penalty --frequency-penalty --min-p --mirostat --typical --dry-multiplier", "run",
     "sampling options", "'tessera run --help' lists the sampling flags tessera has"},
    {"-mg --main-gpu -sm --split-mode -ts --tensor-split", "", "--split-mode",
     "tessera's tensor parallelism over several GPUs is --gpus N (docs/multi-gpu.md)"},
    {"-np", "serve", "--parallel", "tessera's is --parallel N"},
    {"-hf --hf-repo -mu --model-url", "", "--hf-repo",
     "tessera reads local files: -m MODEL (.gguf, .safetensors or a Hugging Face folder)"},
    {"-ctk --cache-type-k -ctv --cache-type-v", "", "--cache-type-k",
     "tessera's KV cache type is --kv-type f32|bf16|f16 on the CPU, bf16|fp8 on the GPU (K and V alike); --stream "
     "bounds it for long prompts"},
    {"-e --escape", "run", "--escape", "tessera passes the prompt as given (no escape sequences are processed)"},
    {"-p --n-prompt", "bench", "llama-bench's --n-prompt", "tessera bench's prompt lengths are -d/--depths 512,4096"},
    {"-n --n-gen", "bench", "llama-bench's --n-gen", "tessera bench's decode steps are --decode N"},
    {"-r --repetitions", "bench", "llama-bench's --repetitions", "tessera bench's is --reps N"},
    {"-o --output", "bench", "llama-bench's --output", "tessera bench's output format is --format md|csv|json (or --json)"},
};

bool has_word(std::string_view words, std::string_view w) {
  size_t at = 0;
  while (at <= words.size()) {
    const size_t end = std::min(words.find(' ', at), words.size());
    if (words.substr(at, end - at) == w) return true;
    at = end + 1;
  }
  return false;
}

// The options `app` accepts: its own and, with fallthrough, its parents'.
std::vector<const CLI::Option*> known_options(const CLI::App& app) {
  std::vector<const CLI::Option*> out;
  for (const CLI::App* a = &app; a != nullptr; a = a->get_fallthrough() ? a->get_parent() : nullptr) {
    for (const CLI::Option* o : a->get_options()) {
      if (o->nonpositional()) out.push_back(o);
    }
  }
  return out;
}

const CLI::Option* find_option(const std::vector<const CLI::Option*>& options, const std::string& dashed) {
  for (const CLI::Option* o : options)
    if (o->check_name(dashed)) return o;
  return nullptr;
}

const CLI::App* find_subcommand(const CLI::App& app, const std::string& name) {
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
    if (s->check_name(name)) return s;
  return nullptr;
}

// As CLI11's classification: "--x..." and "-x..." (x not '-', '!' or a space) are flags, except "-<digit>..."
// (negative numbers are values: no flag of tessera is a digit).
bool looks_like_flag(const std::string& a) {
  if (a.size() < 2 || a[0] != '-') return false;
  const char c = a[1] == '-' ? (a.size() > 2 ? a[2] : '-') : a[1];
  if (c == '-' || c == '!' || c == ' ' || c == '\n') return false;
  return a[1] == '-' || !std::isdigit(static_cast<unsigned char>(c));
}

std::string command_name(const CLI::App& app) {
  return app.get_parent() == nullptr ? std::string("tessera") : app.get_name();
}

// The nearest name among `names`: by edit distance (at most a third of the length, at least 1) or, for a prefix of
// at least 3 characters, the one name it begins.
std::string nearest(const std::string& given, const std::vector<std::string>& names) {
  std::string best;
  size_t best_d = std::max<size_t>(1, given.size() / 3) + 1;
  for (const std::string& n : names) {
    const size_t d = edit_distance(given, n);
    if (d < best_d) best_d = d, best = n;
  }
  if (!best.empty()) return best;
  std::string prefix_of;
  int count = 0;
  for (const std::string& n : names)
    if (given.size() >= 3 && n.size() > given.size() && n.compare(0, given.size(), given) == 0) prefix_of = n, ++count;
  return count == 1 ? prefix_of : std::string();
}

std::string unknown_flag(const CLI::App& app, const std::string& arg) {
  const std::string flag = arg.substr(0, arg.find('='));
  const std::string cmd = command_name(app);
  const std::string where = app.get_parent() == nullptr ? "" : cmd + ": ";
  const std::vector<const CLI::Option*> options = known_options(app);
  for (const Foreign& f : kForeign) {
    if (!has_word(f.names, flag) || (*f.commands != '\0' && !has_word(f.commands, cmd))) continue;
    return where + "unknown flag " + flag + " (llama.cpp's " + f.llama + "): " + f.advice;
  }
  // Threads: a flag where the program has one, else the environment.
  if (flag == "-t" || flag == "--threads" || flag == "-tb" || flag == "--threads-batch") {
    const CLI::Option* threads = find_option(options, "--threads");
    return where + "unknown flag " + flag + " (llama.cpp's --threads): " +
           (threads != nullptr ? "tessera's is --threads N"
                               : "tessera's thread count is the environment variable TESSERA_NUM_THREADS");
  }
  std::vector<std::string> names;
  for (const CLI::Option* o : options) {
    for (const std::string& l : o->get_lnames()) names.push_back("--" + l);
    for (const std::string& s : o->get_snames()) names.push_back("-" + s);
  }
  // A long flag written with one dash (-temperature).
  std::string near;
  if (flag.size() > 2 && flag[1] != '-' && find_option(options, "-" + flag) != nullptr) near = "-" + flag;
  if (near.empty()) near = nearest(flag, names);
  return where + "unknown flag " + flag +
         (near.empty() ? " ('tessera " + (app.get_parent() == nullptr ? std::string() : cmd + " ") +
                             "--help' lists the flags)"
                       : "; did you mean " + near + "?");
}

// The number of arguments after argv[i] that option `o` takes (it has no "=value" and no value glued to it), as
// CLI11 takes them: its minimum whatever they look like, then up to its maximum while they are no flag.
int values_taken(const CLI::App& app, const CLI::Option* o, int argc, const char* const* argv, int i) {
  const int max = o->get_items_expected_max();
  if (max == 0) return 0;
  const int min = std::max(1, std::min(o->get_type_size_min(), o->get_items_expected_min()));
  int taken = 0;
  while (taken < min && i + 1 + taken < argc) ++taken;
  while (taken < max && i + 1 + taken < argc) {
    const std::string next = argv[i + 1 + taken];
    if (next == "--" || looks_like_flag(next) || find_subcommand(app, next) != nullptr) break;
    ++taken;
  }
  return taken;
}

}  // namespace

std::string subcommand_of(const CLI::App& app, int argc, const char* const* argv) {
  const std::vector<const CLI::Option*> options = known_options(app);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (const CLI::App* s = find_subcommand(app, a)) return s->get_name();
    const CLI::Option* o = looks_like_flag(a) && a.find('=') == std::string::npos ? find_option(options, a) : nullptr;
    if (o != nullptr) i += values_taken(app, o, argc, argv, i);
  }
  return {};
}

std::string unknown_argument(const CLI::App& app, int argc, const char* const* argv) {
  const CLI::App* cur = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;  // the rest are values
    if (a == "-h" || a == "--help" || a == "--version") continue;
    if (!looks_like_flag(a)) {
      if (const CLI::App* s = find_subcommand(*cur, a)) {
        cur = s;
        continue;
      }
      if (cur == &app && app.get_require_subcommand_min() > 0) {
        std::vector<std::string> names;
        std::string list;
        for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) {
          names.push_back(s->get_name());
          list += (list.empty() ? "" : ", ") + s->get_name();
        }
        const std::string near = nearest(a, names);
        return "unknown subcommand '" + a + "'" + (near.empty() ? "" : "; did you mean '" + near + "'?") +
               " (subcommands: " + list + ")";
      }
      continue;  // a positional value (inspect's MODEL): CLI11 places it or says it was not expected
    }
    const std::vector<const CLI::Option*> options = known_options(*cur);
    const bool is_long = a[1] == '-';
    if (is_long) {
      const std::string name = a.substr(0, a.find('='));
      const CLI::Option* o = find_option(options, name);
      if (o == nullptr) return unknown_flag(*cur, a);
      if (name.size() == a.size()) i += values_taken(*cur, o, argc, argv, i);
      continue;
    }
    // "-x" or "-xVALUE": llama.cpp's many-letter short flags (-ngl) are not "-n gl".
    const CLI::Option* o = find_option(options, a.substr(0, 2));
    if (o == nullptr) return unknown_flag(*cur, a);
    if (a.size() > 2) {
      // A glued value is read as one only when it is a number (-n5, -n-1) or the flag takes text (-mMODEL is
      // rare; -ngl, -fa, -cnv are llama.cpp's flags).
      bool foreign = false;
      for (const Foreign& f : kForeign) foreign = foreign || has_word(f.names, a);
      const std::string rest = a.substr(2);
      const bool number = std::isdigit(static_cast<unsigned char>(rest[0])) || (rest[0] == '-' && rest.size() > 1);
      if (foreign || (!number && o->get_items_expected_max() != 0 && o->get_type_name() != "TEXT"))
        return unknown_flag(*cur, a);
      continue;
    }
    i += values_taken(*cur, o, argc, argv, i);
  }
  return {};
}

}  // namespace tessera::cli
