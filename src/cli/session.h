// tessera/cli/session.h — what every command loads: the model, its tokenizer and chat format, a policy.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "attention/pattern/config_io.h"
#include "attention/pattern/policy.h"
#include "core/format.h"
#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/engine.h"
#include "model/model.h"

namespace tessera::cli {

struct Session {
  std::unique_ptr<runtime::Model> model;    // null after open_tokenizer
  std::string model_name;                   // the model's name (its config's)
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::optional<model::ChatTemplate> chat;  // the model's own chat template; absent when it has none tessera reads
  std::string no_chat_reason;               // why `chat` is absent ("" when present)

  // Loads the model file and its tokenizer (GGUF metadata, or tokenizer.json beside HF weights).
  static Session open(const std::string& path);
  // The tokenizer and chat format only, without loading the weights (`tessera tokenize`): `model` stays null.
  static Session open_tokenizer(const std::string& path);

  // The policy named by `spec` (presets.h) for this model's shape; "dense" gives an empty table.
  attn::AttentionPolicy policy(const std::string& spec) const;
  // The model's policy shape: layers, heads and each layer's sliding window (presets leave window layers dense).
  attn::PolicyShape policy_shape() const;

  // Throws tessera::Error (with no_chat_reason) when the model has no chat template.
  void require_chat() const;

  // Prompt text -> ids: as a chat user turn (with an optional system message) or as plain text.
  std::vector<int32_t> encode_prompt(const std::string& text, bool chat_mode, const std::string& system) const;
};

// Progress on stderr: a bar when stderr is a terminal, nothing otherwise (unless forced).
class ProgressBar {
 public:
  ProgressBar(std::string label, bool enabled);
  void update(int64_t done, int64_t total);
  void finish();

 private:
  std::string label_;
  bool enabled_;
  double start_;
  bool drawn_ = false;
};

// Before a text is tokenized: throws tessera::Error when `bytes` of text must give more than `max_context` tokens
// (every token covers at most the longest vocabulary entry's bytes), so a huge prompt fails at once with the
// numbers instead of being tokenized whole first.
void check_prompt_text_fits(const Session& s, size_t bytes, int64_t max_context, const std::string& what);

// `tessera run --logits-out FILE`: the logits after the prompt (the first answer token's distribution), raw f32
// little-endian, vocabulary-many values — what scripts/gpu/tp_x4.sh compares between one GPU and several.
// Throws tessera::Error when the file cannot be written.
void write_logits(const std::string& path, const std::vector<float>& logits);
// Writes `text` to `path` (replacing it); tessera::Error "<path>: cannot write" / "<path>: write failed".
void write_text(const std::string& path, const std::string& text);
// `count` tokens of real text for benchmarks (the KJV when installed, else synthetic filler), so that dynamic
// estimators see attention of the kind they were designed for; repeated to the length.
std::vector<int32_t> bench_tokens(const Session& s, int count);

double now_seconds();

}  // namespace tessera::cli
