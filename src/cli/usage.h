// tessera/cli/usage.h — what the command line answers to a wrong command line: its exit codes, "did you mean" for
// an unknown flag or subcommand, and what tessera calls the flags users bring from llama.cpp (docs/cli.md).
#pragma once

#include <string>
#include <string_view>

#include "core/error.h"

namespace CLI {
class App;
}

namespace tessera::cli {

// The exit codes of `tessera` (docs/cli.md#exit-codes): one meaning each.
inline constexpr int kExitOk = 0;       // done (also --help and --version)
inline constexpr int kExitRuntime = 1;  // it ran and failed: a file, a model, memory, a device, a request
inline constexpr int kExitUsage = 2;    // the command line is wrong; nothing was loaded or run

// A wrong command line found by tessera's own checks of the flags' values (options_check.cpp), before anything is
// loaded: main() answers it with kExitUsage. Every other tessera::Error is kExitRuntime.
class UsageError : public Error {
 public:
  using Error::Error;
};
// check() for the command line: throws UsageError(message) when !ok. (Inline: the Python module compiles the flag
// code that calls it without the rest of the command line.)
inline void usage_check(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

// Walks argv as CLI11 will parse it against `app` (its subcommands, the options of each with the number of values
// they take, flags of the program itself after the subcommand) and returns the message for the first argument
// that names no flag or subcommand: "run: unknown flag --temprature; did you mean --temperature?", llama.cpp's
// flags with tessera's equivalent ("-ngl (llama.cpp's --n-gpu-layers): ..."), "unknown subcommand 'rnu'; did
// you mean 'run'?". Empty when every argument is known. Call it before app.parse: CLI11 itself reads "-ngl 99" as
// "-n gl" plus a stray 99, which gives messages about -n.
std::string unknown_argument(const CLI::App& app, int argc, const char* const* argv);

// The subcommand argv names (its first word that is one of app's subcommands), or "" when none.
std::string subcommand_of(const CLI::App& app, int argc, const char* const* argv);

// Edit distance (optimal string alignment): insertions, deletions, substitutions of bytes and transpositions of
// neighbours.
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace tessera::cli
