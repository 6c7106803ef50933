// grammar_bench — what structured output (runtime/grammar.h, XGrammar) costs on the host, per model vocabulary:
// building the grammar compiler (the vocabulary's decoded bytes), compiling a JSON schema (first time, and again:
// the cache), and per generated token: Sampler::sample with the grammar's mask against the same sampler without
// it, and Sampler::edits (the batched engine's way: the mask as -inf edits). Logits: normal(0, 3), fixed seed; a
// sequence runs until the grammar ends (a stop token) and starts again. Prints one markdown table.
//
//   grammar_bench [--steps 400] [MODEL.gguf ...]   (default: the two test models under ~/.cache/tessera/models)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "model/model_file.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/grammar.h"
#include "runtime/sampling.h"

using namespace tessera;
using namespace tessera::runtime;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

const char* kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
  "required": ["name", "age", "color", "tags"]})";

// Mean microseconds per token over `steps` tokens: with edits_path, Sampler::edits + edit_logit + sample_token +
// accept (the batched engine's rows); else Sampler::sample.
double per_token_us(const model::Tokenizer& tok, const std::shared_ptr<const Grammar>& grammar, int steps,
                    bool edits_path) {
  const int32_t vocab = tok.vocab_size();
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> rows(16, std::vector<float>(static_cast<size_t>(vocab)));
  for (auto& r : rows)
    for (float& x : r) x = normal(rng);
  SamplingOptions o{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 1};
  o.grammar = grammar;
  auto sampler = std::make_unique<Sampler>(o);
  double total = 0;
  for (int s = 0; s < steps; ++s) {
    const std::vector<float>& logits = rows[static_cast<size_t>(s) % rows.size()];
    const auto t0 = Clock::now();
    int32_t t = 0;
    if (edits_path) {
      std::vector<float> edited = logits;
      for (const LogitEdit& e : sampler->edits(vocab))
        edited[static_cast<size_t>(e.token)] = edit_logit(edited[static_cast<size_t>(e.token)], e);
      t = sample_token(edited, sampler->options(), sampler->next_uniform());
      sampler->accept(t);
    } else {
      t = sampler->sample(logits);
    }
    total += ms_since(t0);
    if (grammar && tok.is_end_of_generation(t)) {
      o.seed += 1;
      sampler = std::make_unique<Sampler>(o);  // the grammar ended: a new sequence
    }
  }
  return 1000.0 * total / steps;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 400;
  std::vector<std::string> models;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else models.push_back(a);
  }
  if (models.empty()) {
    const char* home = std::getenv("HOME");
    const std::string dir = std::string(home != nullptr ? home : ".") + "/.cache/tessera/models/";
    for (const char* f : {"smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"})
      if (std::filesystem::exists(dir + f)) models.push_back(dir + f);
  }
  if (!grammar_available()) {
    std::printf("grammar_bench: built without XGrammar (TESSERA_XGRAMMAR=OFF)\n");
    return 0;
  }
  std::printf("| model | vocab | compiler (ms) | schema compile (ms) | again, cached (ms) | sample (us/token) | "
              "+ grammar (us/token) | edits path + grammar (us/token) |\n|---|---|---|---|---|---|---|---|\n");
  for (const std::string& path : models) {
    const auto tok = model::Tokenizer::from_gguf(model::ModelFile::open(path)->metadata());
    auto t0 = Clock::now();
    GrammarCompiler compiler(*tok);
    const double build = ms_since(t0);
    t0 = Clock::now();
    const auto grammar = compiler.json_schema(kSchema);
    const double first = ms_since(t0);
    t0 = Clock::now();
    (void)compiler.json_schema(kSchema);
    const double again = ms_since(t0);
    const double plain = per_token_us(*tok, nullptr, steps, false);
    const double masked = per_token_us(*tok, grammar, steps, false);
    const double edits = per_token_us(*tok, grammar, steps, true);
    std::printf("| %s | %d | %.0f | %.1f | %.3f | %.0f | %.0f | %.0f |\n",
                std::filesystem::path(path).stem().string().c_str(), tok->vocab_size(), build, first, again, plain,
                masked, edits);
  }
  return 0;
}
