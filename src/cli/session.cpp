#include "cli/session.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "attention/pattern/presets.h"
#include "core/error.h"
#include "eval/haystack.h"

namespace tessera::cli {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

// The tokenizer and chat format of a model file (GGUF metadata, or tokenizer.json beside HF weights).
void read_tokenizer(Session& s, const model::ModelFile& file, const runtime::ModelConfig& config,
                    const std::string& path) {
  s.model_name = config.name;
  if (file.format() == model::FileFormat::GGUF) {
    s.tokenizer = model::Tokenizer::from_gguf(file.metadata());
    try {
      s.chat = model::ChatTemplate::from_gguf(file.metadata());
    } catch (const Error&) {
      s.chat.reset();  // no known chat format: --chat will say so
    }
    if (!file.metadata().contains("tokenizer.chat_template")) s.no_chat_reason = "its GGUF has no tokenizer.chat_template (a base model?)";
  } else {
    const auto tok = file.tokenizer_json_path();
    check(tok.has_value(), path + ": no tokenizer.json beside the weights");
    s.tokenizer = model::Tokenizer::from_hf_file(*tok);
    std::string template_text;
    const std::string cfg_path = std::filesystem::path(*tok).parent_path() / "tokenizer_config.json";
    if (std::ifstream in(cfg_path); in) {
      const nlohmann::json cfg = nlohmann::json::parse(in, nullptr, false);
      if (cfg.is_object() && cfg.contains("chat_template") && cfg["chat_template"].is_string()) {
        template_text = cfg["chat_template"].get<std::string>();
      }
    }
    std::vector<std::string> vocab;
    for (int32_t i = 0; i < s.tokenizer->vocab_size(); ++i) vocab.push_back(s.tokenizer->token_text(i));
    model::ChatTemplate::Options options;
    const auto& sp = s.tokenizer->special();
    if (sp.bos >= 0) options.bos_token = s.tokenizer->token_text(sp.bos);
    if (sp.eos >= 0) options.eos_token = s.tokenizer->token_text(sp.eos);
    options.default_system_prompt = model::ChatTemplate::chatml_default_system_prompt(template_text);
    if (template_text.empty()) s.no_chat_reason = "its tokenizer_config.json has no chat_template (a base model?)";
    try {
      s.chat = model::ChatTemplate::detect(template_text,
                                           runtime::architecture_name(config.arch), vocab, options);
    } catch (const Error&) {
      s.chat.reset();
    }
  }
  // A format guessed from the architecture or the vocabulary is not the model's: chatting in it gives nonsense.
  if (s.chat && !s.chat->from_template()) {
    if (s.no_chat_reason.empty()) s.no_chat_reason = "its chat template is not one tessera recognises";
    s.chat.reset();
  }
  if (!s.chat && s.no_chat_reason.empty())
    s.no_chat_reason = "its chat template is not one tessera formats (ChatML, Llama-3, Gemma, Mistral)";
}

}  // namespace

Session Session::open(const std::string& path) {
  Session s;
  s.model = runtime::Model::load(path);
  read_tokenizer(s, s.model->file(), s.model->config(), path);
  return s;
}

Session Session::open_tokenizer(const std::string& path) {
  Session s;
  const std::unique_ptr<model::ModelFile> file = model::ModelFile::open(path);
  read_tokenizer(s, *file, runtime::load_model_config(*file), path);
  return s;
}

void Session::require_chat() const {
  check(chat.has_value(), "model " + model_name + " has no chat template tessera can use: " +
                              no_chat_reason + "; run without --chat");
}

attn::AttentionPolicy Session::policy(const std::string& spec) const {
  check(model != nullptr, "this session holds no model weights (Session::open_tokenizer)");
  if (spec == "dense") return {};
  return attn::policy_from_spec(spec, policy_shape());
}

attn::PolicyShape Session::policy_shape() const {
  check(model != nullptr, "this session holds no model weights (Session::open_tokenizer)");
  const auto& c = model->config();
  attn::PolicyShape shape{c.num_layers, c.num_q_heads, c.num_kv_heads, {}};
  for (const auto& layer : c.layers) shape.sliding_windows.push_back(layer.sliding_window);
  return shape;
}

std::vector<int32_t> Session::encode_prompt(const std::string& text, bool chat_mode, const std::string& system) const {
  if (!chat_mode) return tokenizer->encode(text, {.add_special = true, .parse_special = false});
  require_chat();
  std::vector<model::ChatMessage> messages;
  if (!system.empty()) messages.push_back({"system", system});
  messages.push_back({"user", text});
  const std::string prompt = chat->apply(messages, /*add_generation_prompt=*/true);
  return tokenizer->encode(prompt, {.add_special = !chat->renders_bos(), .parse_special = true});
}

void check_prompt_text_fits(const Session& s, size_t bytes, int64_t max_context, const std::string& what) {
  size_t longest = 1;
  for (int32_t i = 0; i < s.tokenizer->vocab_size(); ++i) longest = std::max(longest, s.tokenizer->token_text(i).size());
  const auto at_least = static_cast<int64_t>((bytes + longest - 1) / longest);
  check(at_least <= max_context,
        what + " holds " + with_commas(static_cast<int64_t>(bytes)) + " bytes of text: at least " + with_commas(at_least) +
            " tokens (no token of model " + s.model_name + " covers more than " + std::to_string(longest) +
            " bytes), over the context limit of " + with_commas(max_context) +
            " tokens; shorten the prompt or pass a larger --max-context");
}

void write_logits(const std::string& path, const std::vector<float>& logits) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
  check(static_cast<bool>(out), path + ": cannot write the logits (--logits-out)");
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  check(static_cast<bool>(out), path + ": cannot write");
  out << text;
  check(static_cast<bool>(out), path + ": write failed");
}

std::vector<int32_t> bench_tokens(const Session& s, int count) {
  eval::Haystack hay;
  try {
    hay = eval::load_haystack("kjv");
  } catch (const Error&) {
    hay = eval::load_haystack("noise:1");
  }
  std::string text;
  for (size_t i = 0; text.size() < static_cast<size_t>(count) * 6; ++i) text += hay.sentence(i) + " ";
  std::vector<int32_t> ids = s.tokenizer->encode(text, {.add_special = true, .parse_special = false});
  check(!ids.empty(), "bench: the haystack text encoded to no tokens");
  while (static_cast<int>(ids.size()) < count) ids.insert(ids.end(), ids.begin(), ids.end());
  ids.resize(static_cast<size_t>(count));
  return ids;
}

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled), start_(now_seconds()) {}

void ProgressBar::update(int64_t done, int64_t total) {
  if (!enabled_ || total <= 0) return;
  const int width = 30;
  const int filled = static_cast<int>(width * done / total);
  const double elapsed = now_seconds() - start_;
  std::fprintf(stderr, "\r%s [%s%s] %s/%s tokens  %.0f tok/s ", label_.c_str(), std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(width - filled), ' ').c_str(), with_commas(done).c_str(),
               with_commas(total).c_str(), elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0);
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::finish() {
  if (drawn_) std::fprintf(stderr, "\r\033[K");
  drawn_ = false;
}

}  // namespace tessera::cli
