// libFuzzer harness for chat formats: ChatTemplate::detect on a Jinja template text (tokenizer.chat_template
// of a GGUF, chat_template of tokenizer_config.json), then apply() on conversations.
//
// Input: "#file:" sections (tests/fuzz/fuzz_common.h). Bytes before the first marker are the template text;
// optional sections: "architecture" (general.architecture), "vocab" (one token per line), "bos" and "eos"
// (token texts), "messages" (one message per line, "role:content"). The harness recognises the family,
// reads ChatML's default system prompt, and formats the input's messages and a few fixed conversations, with
// and without the generation prompt; it also runs python_strip on every section. A tessera::Error is the
// expected outcome for bad input (a conversation the family rejects); anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "model/tokenizer/chat_template.h"

using namespace tessera;

namespace {

std::vector<std::string_view> lines(std::string_view text) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    out.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

void format(const model::ChatTemplate& chat, std::span<const model::ChatMessage> messages) {
  for (const bool generation_prompt : {true, false}) {
    try {
      (void)chat.apply(messages, generation_prompt);
    } catch (const Error&) {
      // roles the family rejects
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  auto files =
      fuzz::split_files(input, "template", {"template", "architecture", "vocab", "bos", "eos", "messages"});
  for (const auto& [name, text] : files) (void)model::python_strip(text);

  std::vector<std::string> vocab;
  for (std::string_view v : lines(files["vocab"])) vocab.emplace_back(v);
  std::vector<model::ChatMessage> messages;
  for (std::string_view line : lines(files["messages"])) {
    const size_t colon = line.find(':');
    messages.push_back({std::string(line.substr(0, colon)), colon == std::string_view::npos
                                                                ? std::string()
                                                                : std::string(line.substr(colon + 1))});
  }
  model::ChatTemplate::Options options;
  options.bos_token = std::string(files["bos"]);
  options.eos_token = std::string(files["eos"]);
  (void)model::ChatTemplate::chatml_default_system_prompt(files["template"]);
  try {
    const model::ChatTemplate chat =
        model::ChatTemplate::detect(files["template"], files["architecture"], vocab, options);
    (void)chat.renders_bos();
    format(chat, messages);
    const std::vector<model::ChatMessage> fixed = {{"system", "  You are terse.\n"},
                                                   {"user", " Hi\xE3\x80\x80"},
                                                   {"assistant", "Hello.\xC2\x85"},
                                                   {"user", "\xE2\x80\xA8"}};
    format(chat, fixed);
    format(chat, std::span(fixed).subspan(1));
    format(chat, std::span(fixed).subspan(0, 0));
  } catch (const Error&) {
    // no family recognised
  }
  return 0;
}
