#include "model/tokenizer/chat_template.h"

#include <iterator>

#include "core/enum_names.h"
#include "core/error.h"
#include "model/tokenizer/utf8.h"

namespace tessera::model {

namespace {

using nlohmann::json;

// Python's str.isspace() for one code point.
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

void require_alternation(std::span<const ChatMessage> messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const bool user = messages[i].role == "user";
    if (user != (i % 2 == 0) || (!user && messages[i].role != "assistant")) {
      throw Error(
          "chat template: conversation roles must alternate user/assistant/user/assistant/... (message " +
          std::to_string(i) + " has role \"" + messages[i].role + "\")");
    }
  }
}

// Gemma and Mistral have no system turn: a leading system message becomes `prefix` ("content\n\n"), which the
// first turn starts with. Returns the messages after it, which must alternate user/assistant.
std::span<const ChatMessage> fold_system_message(std::span<const ChatMessage> messages, std::string& prefix) {
  std::span<const ChatMessage> rest = messages;
  if (!messages.empty() && messages[0].role == "system") {
    prefix = messages[0].content + "\n\n";
    rest = messages.subspan(1);
  }
  require_alternation(rest);
  return rest;
}

// In the enum's order.
constexpr std::string_view kChatFamilyNames[] = {"chatml", "llama3", "llama3.1", "gemma", "mistral"};
static_assert(std::size(kChatFamilyNames) == static_cast<size_t>(ChatFamily::Mistral) + 1);

}  // namespace

std::string python_strip(std::string_view s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    const size_t n = utf8::char_length(s, begin);
    if (!py_space(utf8::decode_at(s, begin))) break;
    begin += n;
  }
  while (end > begin) {
    size_t start = end - 1;  // back up to the start of the last character
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80 && end - start < 4) --start;
    if (utf8::char_length(s, start) != end - start || !py_space(utf8::decode_at(s, start))) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

std::string_view chat_family_name(ChatFamily f) {
  return enum_name(kChatFamilyNames, f);
}

ChatTemplate::ChatTemplate(ChatFamily family, Options options)
    : family_(family), options_(std::move(options)) {}

bool ChatTemplate::renders_bos() const {
  return family_ == ChatFamily::Llama3 || family_ == ChatFamily::Llama31 || family_ == ChatFamily::Gemma ||
         family_ == ChatFamily::Mistral;
}

std::string ChatTemplate::chatml_default_system_prompt(std::string_view t) {
  // The literal "<|im_start|>system\n...<|im_end|>" a template writes when messages[0] is not a system
  // message. Inside a Jinja string the newline is either a real newline or the escape "\n".
  for (std::string_view open :
       {std::string_view("<|im_start|>system\n"), std::string_view("<|im_start|>system\\n")}) {
    const size_t at = t.find(open);
    if (at == std::string_view::npos) continue;
    const size_t begin = at + open.size();
    const size_t end = t.find("<|im_end|>", begin);
    if (end == std::string_view::npos) continue;
    const std::string_view body = t.substr(begin, end - begin);
    // A template that writes the caller's system message here (message['content'], ...) has no default.
    if (contains(body, "{{") || contains(body, "'") || contains(body, "\"") || contains(body, "+")) continue;
    std::string out;
    for (size_t i = 0; i < body.size(); ++i) {
      if (body[i] == '\\' && i + 1 < body.size()) {
        const char e = body[++i];
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      } else {
        out += body[i];
      }
    }
    return out;
  }
  return {};
}

ChatTemplate ChatTemplate::detect(std::string_view t, std::string_view arch,
                                  const std::vector<std::string>& vocab, Options options) {
  const auto recognised = [](ChatTemplate c) {
    c.from_template_ = true;
    return c;
  };
  if (contains(t, "<|im_start|>")) {
    if (options.default_system_prompt.empty())
      options.default_system_prompt = chatml_default_system_prompt(t);
    return recognised(ChatTemplate(ChatFamily::ChatML, std::move(options)));
  }
  if (contains(t, "<|start_header_id|>")) {
    return recognised(ChatTemplate(contains(t, "Cutting Knowledge Date") ? ChatFamily::Llama31 : ChatFamily::Llama3,
                                   std::move(options)));
  }
  if (contains(t, "<start_of_turn>")) return recognised(ChatTemplate(ChatFamily::Gemma, std::move(options)));
  if (contains(t, "[INST]")) return recognised(ChatTemplate(ChatFamily::Mistral, std::move(options)));
  if (arch == "gemma" || arch == "gemma2" || arch == "gemma3")
    return ChatTemplate(ChatFamily::Gemma, std::move(options));
  auto has = [&](std::string_view token) {
    for (const auto& v : vocab) {
      if (v == token) return true;
    }
    return false;
  };
  if (has("<|im_start|>")) return ChatTemplate(ChatFamily::ChatML, std::move(options));
  if (has("<|start_header_id|>")) return ChatTemplate(ChatFamily::Llama3, std::move(options));
  if (has("<start_of_turn>")) return ChatTemplate(ChatFamily::Gemma, std::move(options));
  if (has("[INST]") || arch == "mistral") return ChatTemplate(ChatFamily::Mistral, std::move(options));
  throw Error("chat template: cannot tell the chat format of this model (architecture \"" +
              std::string(arch) + "\"); tessera formats ChatML, Llama-3, Gemma and Mistral [INST] chats");
}

ChatTemplate ChatTemplate::from_gguf(const json& md) {
  auto str = [&](const char* key) {
    const auto it = md.find(key);
    return it != md.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  std::vector<std::string> vocab;
  if (const auto it = md.find("tokenizer.ggml.tokens"); it != md.end() && it->is_array()) {
    vocab.reserve(it->size());
    for (const json& t : *it) {
      if (!t.is_string())
        throw Error("chat template: GGUF metadata tokenizer.ggml.tokens holds a value that is not a string");
      vocab.push_back(t.get<std::string>());
    }
  }
  auto token = [&](const char* key) {
    const auto it = md.find(key);
    if (it == md.end() || !it->is_number_integer()) return std::string();
    const auto id = it->get<int64_t>();
    return id >= 0 && static_cast<size_t>(id) < vocab.size() ? vocab[id] : std::string();
  };
  Options options;
  options.bos_token = token("tokenizer.ggml.bos_token_id");
  options.eos_token = token("tokenizer.ggml.eos_token_id");
  return detect(str("tokenizer.chat_template"), str("general.architecture"), vocab, std::move(options));
}

std::string ChatTemplate::apply(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  switch (family_) {
    case ChatFamily::ChatML: {
      for (size_t i = 0; i < messages.size(); ++i) {
        if (i == 0 && messages[0].role != "system" && !options_.default_system_prompt.empty()) {
          out += "<|im_start|>system\n" + options_.default_system_prompt + "<|im_end|>\n";
        }
        out += "<|im_start|>" + messages[i].role + "\n" + messages[i].content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case ChatFamily::Llama3:
    case ChatFamily::Llama31: {
      // Llama-3 writes BOS with the first message; Llama-3.1 reads messages[0] and so needs one.
      if (family_ == ChatFamily::Llama31 && messages.empty()) throw Error("chat template: no messages");
      if (!messages.empty()) out += options_.bos_token;
      size_t first = 0;
      if (family_ == ChatFamily::Llama31) {
        std::string system;
        if (!messages.empty() && messages[0].role == "system") {
          system = python_strip(messages[0].content);
          first = 1;
        }
        out +=
            "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday "
            "Date: " +
            options_.date_string + "\n\n" + system + "<|eot_id|>";
      }
      for (size_t i = first; i < messages.size(); ++i) {
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               python_strip(messages[i].content) + "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case ChatFamily::Gemma: {
      if (messages.empty()) throw Error("chat template: no messages");  // Gemma's template reads messages[0]
      out += options_.bos_token;
      std::string prefix;
      const std::span<const ChatMessage> rest = fold_system_message(messages, prefix);
      for (size_t i = 0; i < rest.size(); ++i) {
        const std::string role = rest[i].role == "assistant" ? "model" : rest[i].role;
        out += "<start_of_turn>" + role + "\n" + (i == 0 ? prefix : std::string()) +
               python_strip(rest[i].content) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
    case ChatFamily::Mistral: {
      out += options_.bos_token;
      std::string prefix;
      const std::span<const ChatMessage> rest = fold_system_message(messages, prefix);
      for (size_t i = 0; i < rest.size(); ++i) {
        if (rest[i].role == "user") {
          out += "[INST] " + (i == 0 ? prefix : std::string()) + rest[i].content + " [/INST]";
        } else {
          out += rest[i].content + options_.eos_token;
        }
      }
      break;  // the [INST] format has no separate generation prompt: "[/INST]" is it
    }
  }
  return out;
}

}  // namespace tessera::model
