#include "server/structured_output.h"

#include <string_view>

namespace tessera::server {

using nlohmann::json;

runtime::GrammarCompiler& GrammarCache::compiler(const model::Tokenizer& tokenizer) {
  std::call_once(once_, [&] {
    try {
      compiler_ = std::make_unique<runtime::GrammarCompiler>(tokenizer);
    } catch (const runtime::GrammarError& e) {
      error_ = e.what();
    }
  });
  if (!compiler_)
    throw invalid_request("structured output is not available: " + error_, "response_format", "unsupported_parameter");
  return *compiler_;
}

ToolAnswer tool_answer(const ApiRequest& r) {
  switch (r.tool_choice) {
    case ToolChoice::Auto: return ToolAnswer::Auto;
    case ToolChoice::Required:
    case ToolChoice::Named: return ToolAnswer::Forced;
    default: return ToolAnswer::None;
  }
}

std::string tool_call_schema(const ApiRequest& r) {
  using ojson = nlohmann::ordered_json;  // "name" before "arguments", the parameters in the client's order
  ojson any = ojson::array();
  for (const ToolFunction& t : r.tools) {
    if (r.tool_choice == ToolChoice::Named && t.name != r.tool_name) continue;
    any.push_back({{"type", "object"},
                   {"properties", {{"name", {{"const", t.name}}}, {"arguments", ojson::parse(t.parameters)}}},
                   {"required", {"name", "arguments"}},
                   {"additionalProperties", false}});
  }
  return (any.size() == 1 ? any[0] : ojson{{"anyOf", any}}).dump();
}

std::shared_ptr<const runtime::Grammar> request_grammar(const ApiRequest& r, const model::Tokenizer& tokenizer,
                                                        GrammarCache& cache) {
  const bool forced = tool_answer(r) == ToolAnswer::Forced;
  if (r.response_format.kind == ResponseFormat::Kind::Text && !forced) return nullptr;
  runtime::GrammarCompiler& compiler = cache.compiler(tokenizer);
  if (forced) {
    try {
      return compiler.json_schema(tool_call_schema(r));
    } catch (const runtime::GrammarError& e) {
      throw invalid_request(std::string("Invalid JSON schema in the parameters of 'tools': ") + e.what(), "tools");
    }
  }
  if (r.response_format.kind == ResponseFormat::Kind::JsonObject) return compiler.json_object();
  try {
    return compiler.json_schema(r.response_format.schema);
  } catch (const runtime::GrammarError& e) {
    throw invalid_request(std::string("Invalid JSON schema in 'response_format.json_schema.schema': ") + e.what(),
                          "response_format.json_schema.schema");
  }
}

std::string tool_system_prompt(const std::vector<ToolFunction>& tools) {
  std::string s =
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
      "signatures within <tools></tools> XML tags:\n<tools>";
  for (const ToolFunction& t : tools) {  // keys in the order of the request's shape (as Qwen's template prints it)
    nlohmann::ordered_json fn = {{"name", t.name}};
    if (!t.description.empty()) fn["description"] = t.description;
    fn["parameters"] = nlohmann::ordered_json::parse(t.parameters);
    s += "\n" + nlohmann::ordered_json{{"type", "function"}, {"function", fn}}.dump();
  }
  s += "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
       "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
       "<args-json-object>}\n</tool_call>";
  return s;
}

std::vector<model::ChatMessage> with_tools(const std::vector<model::ChatMessage>& messages,
                                           const std::vector<ToolFunction>& tools) {
  std::vector<model::ChatMessage> out = messages;
  const std::string section = tool_system_prompt(tools);
  if (!out.empty() && out[0].role == "system") out[0].content += "\n\n" + section;
  else out.insert(out.begin(), model::ChatMessage{"system", section});
  return out;
}

namespace {

// {"name": <a tool's name>, "arguments": <an object>} (also "parameters", as some models write it) -> a call.
bool as_call(const json& j, const std::vector<ToolFunction>& tools, json& call) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const std::string name = j["name"];
  bool known = false;
  for (const ToolFunction& t : tools) known = known || t.name == name;
  if (!known) return false;
  json args = json::object();
  if (j.contains("arguments")) args = j["arguments"];
  else if (j.contains("parameters")) args = j["parameters"];
  if (!args.is_object()) return false;
  call = {{"type", "function"}, {"function", {{"name", name}, {"arguments", args.dump()}}}};
  return true;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

json parse_tool_calls(const std::string& text, ToolAnswer mode, const std::vector<ToolFunction>& tools,
                      const std::string& id_prefix) {
  json calls = json::array();
  auto add = [&](std::string_view piece) {
    const json j = json::parse(trim(piece), nullptr, /*allow_exceptions=*/false);
    json call;
    if (j.is_discarded() || !as_call(j, tools, call)) return;
    call["id"] = id_prefix + std::to_string(calls.size());
    calls.push_back(std::move(call));
  };
  if (mode == ToolAnswer::Forced) {
    add(text);
  } else if (mode == ToolAnswer::Auto) {
    constexpr std::string_view open = "<tool_call>", close = "</tool_call>";
    size_t at = 0;
    while ((at = text.find(open, at)) != std::string::npos) {
      const size_t begin = at + open.size();
      const size_t end = text.find(close, begin);
      add(std::string_view(text).substr(begin, end == std::string::npos ? std::string::npos : end - begin));
      if (end == std::string::npos) break;
      at = end + close.size();
    }
    if (calls.empty() && trim(text).starts_with("{")) add(text);  // a bare call, as small models often write it
  }
  return calls;
}

}  // namespace tessera::server
