// tessera/cli/commands.h — the subcommands of the `tessera` program.
#pragma once

#include <string>
#include <vector>

#include "runtime/sampling.h"

namespace tessera::cli {

struct RunOptions {
  std::string model;
  std::string prompt;       // text, or
  std::string prompt_file;  // a file holding it
  bool chat = false;
  std::string system;
  std::string attn = "dense";
  bool compare = false;  // run dense first, then `attn`, and print both answers and the speedup
  int max_tokens = 128;
  runtime::SamplingOptions sampling;
  int chunk = 2048;
  int max_context = 0;
  bool progress = false;  // force the progress bar when stderr is not a terminal
  // Needle-in-a-haystack prompt instead of --prompt: a tokens-long haystack with one needle at `needle_depth`
  // (0..1), built by eval's niah_single generator; the answer is then checked against the needle.
  int needle_tokens = 0;
  double needle_depth = 0.5;
  uint64_t needle_seed = 0;
  std::string haystack = "kjv";
};

struct BenchOptions {
  std::string model;
  std::vector<int> depths = {1024, 4096, 8192};
  std::vector<std::string> attn = {"trianglemix", "ashape:sink=64,local=1024"};
  int decode_tokens = 16;
  int chunk = 2048;
  int reps = 1;
  std::string format = "md";  // md | csv | json
};

struct InspectOptions {
  std::string model;
  bool tensors = false;
  bool metadata = false;
};

int run_command(const RunOptions& o);
int bench_command(const BenchOptions& o);
int inspect_command(const InspectOptions& o);

}  // namespace tessera::cli
