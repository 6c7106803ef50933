// tessera/model/tokenizer/chat_template.h — chat prompts in each supported family's format.
//
//   auto chat = tessera::model::ChatTemplate::from_gguf(model_file->metadata());
//   std::string prompt = chat.apply({{"user", "Hi"}}, /*add_generation_prompt=*/true);
//   auto ids = tokenizer->encode(prompt, {.add_special = !chat.renders_bos(), .parse_special = true});
//
// tessera formats chats natively, one function per family, instead of running a Jinja engine: the families
// below cover the models tessera serves, and each is checked character for character against the model's own
// Jinja template rendered by jinja2 the way transformers renders it (tests/data/tokenizer/make_fixtures.py).
// A template string is used only to recognise the family and to read the parts that vary between models of
// one family (the default system prompt of ChatML templates).
//
// Families
// - ChatML (SmolLM2, Qwen2/2.5): "<|im_start|>{role}\n{content}<|im_end|>\n" per message; when the first
// message
//   is not a system message and the template has a default system prompt, a system message with it comes
//   first. Generation prompt "<|im_start|>assistant\n".
// - Llama3: "{bos}<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>"; Llama31
// additionally
//   opens with the system header carrying "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n" and
//   the (trimmed) system message.
// - Gemma (Gemma-3; Gemma-2 alike): "{bos}<start_of_turn>user\n{system}\n\n{content|trim}<end_of_turn>\n",
//   assistant turns are role "model"; roles must alternate user/assistant.
// - Mistral ([INST], v0.1-v0.2): "{bos}[INST] {user} [/INST]{assistant}{eos}"; roles must alternate. A system
//   message (which Mistral's own template rejects) is put in front of the first user message, followed by
//   "\n\n".
// Errors (a conversation the family's template rejects) are tessera::Error.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::model {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

enum class ChatFamily { ChatML, Llama3, Llama31, Gemma, Mistral };

std::string_view chat_family_name(ChatFamily f);  // "chatml", "llama3", "llama3.1", "gemma", "mistral"

class ChatTemplate {
 public:
  struct Options {
    std::string bos_token;                    // text of the BOS token, for families that write it
    std::string eos_token;                    // text of the EOS token (Mistral ends assistant turns with it)
    std::string default_system_prompt;        // ChatML: used when the conversation has no system message
    std::string date_string = "26 Jul 2024";  // Llama31: the "Today Date" line (the template's own default)
  };

  ChatTemplate(ChatFamily family, Options options);

  // Recognises the family from a Jinja template (tokenizer.chat_template), falling back to the architecture
  // (general.architecture) and then to the vocabulary's special tokens when the template is empty or unknown.
  // Throws Error when none of them names a supported family.
  static ChatTemplate detect(std::string_view template_text, std::string_view architecture,
                             const std::vector<std::string>& vocabulary, Options options);
  // From GGUF metadata: tokenizer.chat_template, general.architecture, tokenizer.ggml.tokens and the bos/eos
  // ids.
  static ChatTemplate from_gguf(const nlohmann::json& metadata);

  // The default system prompt a ChatML template writes when the conversation has none ("" when it has none).
  static std::string chatml_default_system_prompt(std::string_view template_text);

  std::string apply(std::span<const ChatMessage> messages, bool add_generation_prompt = true) const;

  ChatFamily family() const { return family_; }
  // True when the family was read from the model's own chat template; false when detect() guessed it from the
  // architecture or the vocabulary (a base model without a template: chatting with it would give nonsense).
  bool from_template() const { return from_template_; }
  const Options& options() const { return options_; }
  // True when apply() writes the BOS token's text itself, so the prompt must be encoded without adding BOS.
  bool renders_bos() const;

 private:
  ChatFamily family_;
  Options options_;
  bool from_template_ = false;
};

// Python's str.strip() (what Jinja's trim filter does): removes leading and trailing Unicode whitespace.
std::string python_strip(std::string_view s);

}  // namespace tessera::model
