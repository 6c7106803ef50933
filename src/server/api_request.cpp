#include "server/api_request.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

namespace tessera::server {

ApiError invalid_request(const std::string& message, const std::string& param, const std::string& code) {
  return ApiError(400, "invalid_request_error", message, param, code);
}

namespace {

using nlohmann::json;

std::string type_name(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    default: return "a binary value";
  }
}

[[noreturn]] void wrong_type(const std::string& field, const std::string& expected, const json& got) {
  throw invalid_request("'" + field + "' must be " + expected + ", got " + type_name(got), field);
}

// An integer field in [lo, hi]. JSON floats with an integral value (5.0) are refused like the OpenAI API does.
int64_t get_int(const json& j, const std::string& field, int64_t lo, int64_t hi) {
  if (!j.is_number_integer()) wrong_type(field, "an integer", j);  // (unsigned JSON numbers are integers too)
  if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi))
    throw invalid_request("'" + field + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                              "], got " + std::to_string(j.get<uint64_t>()),
                          field);
  const auto v = j.get<int64_t>();
  if (v < lo || v > hi)
    throw invalid_request("'" + field + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                              "], got " + std::to_string(v),
                          field);
  return v;
}

double get_number(const json& j, const std::string& field, double lo, double hi) {
  if (!j.is_number()) wrong_type(field, "a number", j);
  const double v = j.get<double>();
  if (!(v >= lo && v <= hi)) {
    json shown = j;
    throw invalid_request("'" + field + "' must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " +
                              shown.dump(),
                          field);
  }
  return v;
}

bool get_bool(const json& j, const std::string& field) {
  if (!j.is_boolean()) wrong_type(field, "a boolean", j);
  return j.get<bool>();
}

const std::string& get_string(const json& j, const std::string& field) {
  if (!j.is_string()) wrong_type(field, "a string", j);
  return j.get_ref<const std::string&>();
}

[[noreturn]] void unsupported(const std::string& field, const std::string& what) {
  throw invalid_request("'" + field + "' is not supported by tessera: " + what, field, "unsupported_parameter");
}

// Fields a client may send with their "off" value (null, false, 0, empty) but which tessera cannot honour
// otherwise; the message says what tessera does instead.
void refuse_unless_off(const json& j, const std::string& field, const std::string& what) {
  const bool off = j.is_null() || (j.is_boolean() && !j.get<bool>()) || (j.is_number() && j.get<double>() == 0) ||
                   (j.is_string() && j.get_ref<const std::string&>().empty()) || (j.is_array() && j.empty()) ||
                   (j.is_object() && j.empty());
  if (!off) unsupported(field, what);
}

std::string message_content(const json& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) wrong_type(field, "a string or an array of text parts", content);
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string pf = field + "[" + std::to_string(i) + "]";
    if (!part.is_object()) wrong_type(pf, "an object", part);
    if (!part.contains("type")) throw invalid_request("'" + pf + ".type' is missing", pf + ".type");
    const std::string type = get_string(part["type"], pf + ".type");  // a copy: GCC 13 sees a dangling reference
    if (type != "text") unsupported(pf + ".type", "only text parts are (got '" + type + "')");
    if (!part.contains("text")) throw invalid_request("'" + pf + ".text' is missing", pf + ".text");
    text += get_string(part["text"], pf + ".text");
  }
  return text;
}

// An assistant message's tool_calls as the prompt shows them (Qwen2.5's and Hermes' format, the one the tools'
// system message teaches: server/structured_output.h): one <tool_call> block per call.
std::string tool_call_blocks(const json& calls, const std::string& f) {
  if (!calls.is_array()) wrong_type(f, "an array", calls);
  std::string text;
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string c = f + "[" + std::to_string(k) + "]";
    const json& call = calls[k];
    if (!call.is_object()) wrong_type(c, "an object", call);
    if (call.contains("type") && !call["type"].is_null() && get_string(call["type"], c + ".type") != "function")
      unsupported(c + ".type", "only function calls are");
    if (!call.contains("function") || !call["function"].is_object())
      throw invalid_request("'" + c + ".function' must be an object with the function's name and arguments",
                            c + ".function");
    const json& fn = call["function"];
    if (!fn.contains("name")) throw invalid_request("'" + c + ".function.name' is missing", c + ".function.name");
    const std::string name = get_string(fn["name"], c + ".function.name");
    json args = json::object();
    if (fn.contains("arguments") && !fn["arguments"].is_null()) {
      const std::string a = get_string(fn["arguments"], c + ".function.arguments");
      args = json::parse(a, nullptr, /*allow_exceptions=*/false);
      if (!args.is_object())
        throw invalid_request("'" + c + ".function.arguments' must be a JSON object in a string, got '" + a + "'",
                              c + ".function.arguments");
    }
    nlohmann::ordered_json shown = {{"name", name}, {"arguments", nlohmann::ordered_json::parse(args.dump())}};
    text += (k > 0 ? "\n" : "") + std::string("<tool_call>\n") + shown.dump() + "\n</tool_call>";
  }
  return text;
}

std::vector<model::ChatMessage> parse_messages(const json& j) {
  if (!j.is_array()) wrong_type("messages", "an array", j);
  if (j.empty()) throw invalid_request("'messages' must hold at least one message", "messages");
  std::vector<model::ChatMessage> out;
  bool after_tool = false;  // the last message was a tool result (consecutive results share one user turn)
  for (size_t i = 0; i < j.size(); ++i) {
    const json& m = j[i];
    const std::string f = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) wrong_type(f, "an object", m);
    for (const auto& [key, value] : m.items()) {
      if (key == "role" || key == "content" || key == "name" || key == "tool_calls" || key == "tool_call_id") continue;
      if (key == "function_call" || key == "audio" || key == "refusal") {
        refuse_unless_off(value, f + "." + key, "legacy function calls, audio and refusals are not implemented");
        continue;
      }
      throw invalid_request("Unrecognized field in " + f + ": '" + key + "'", f + "." + key);
    }
    if (!m.contains("role")) throw invalid_request("'" + f + ".role' is missing", f + ".role");
    std::string role = get_string(m["role"], f + ".role");
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      if (role == "function") unsupported(f + ".role", "legacy function messages are not (use role 'tool')");
      throw invalid_request("'" + f + ".role' must be one of system, developer, user, assistant, tool; got '" + role +
                                "'",
                            f + ".role");
    }
    const bool calls = m.contains("tool_calls") && !m["tool_calls"].is_null() &&
                       !(m["tool_calls"].is_array() && m["tool_calls"].empty());
    if (calls && role != "assistant")
      throw invalid_request("'" + f + ".tool_calls' is only allowed in assistant messages", f + ".tool_calls");
    if (m.contains("tool_call_id") && !m["tool_call_id"].is_null()) {
      if (role != "tool")
        throw invalid_request("'" + f + ".tool_call_id' is only allowed in tool messages", f + ".tool_call_id");
      (void)get_string(m["tool_call_id"], f + ".tool_call_id");
    }
    const bool has_content = m.contains("content") && !m["content"].is_null();
    if (!has_content && !calls) throw invalid_request("'" + f + ".content' is missing", f + ".content");
    std::string content = has_content ? message_content(m["content"], f + ".content") : std::string();
    if (calls) content += (content.empty() ? "" : "\n") + tool_call_blocks(m["tool_calls"], f + ".tool_calls");
    if (role == "tool") {
      // A tool's result goes back as a user turn in <tool_response> tags (Qwen2.5's and Hermes' templates).
      const std::string block = "<tool_response>\n" + content + "\n</tool_response>";
      if (after_tool) out.back().content += "\n" + block;
      else out.push_back({"user", block});
      after_tool = true;
      continue;
    }
    after_tool = false;
    out.push_back({role, std::move(content)});
  }
  return out;
}

int32_t token_id(const json& j, const std::string& field) {
  return static_cast<int32_t>(get_int(j, field, 0, std::numeric_limits<int32_t>::max()));
}

std::vector<int32_t> prompt_ids(const json& j, const std::string& field) {
  if (j.empty()) throw invalid_request("'" + field + "' must not be an empty array", "prompt");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < j.size(); ++i) ids.push_back(token_id(j[i], field + "[" + std::to_string(i) + "]"));
  return ids;
}

void parse_prompt(const json& j, ApiRequest& r) {
  if (j.is_string()) {
    r.prompts.push_back({j.get<std::string>(), {}, false});
  } else if (!j.is_array()) {
    wrong_type("prompt", "a string, an array of token ids, or an array of strings or of token-id arrays", j);
  } else if (j.empty()) {
    throw invalid_request("'prompt' must not be an empty array", "prompt");
  } else if (j[0].is_string() || j[0].is_array()) {  // several prompts
    if (j.size() > kMaxPrompts)
      throw invalid_request("'prompt' holds " + std::to_string(j.size()) + " prompts; at most " +
                                std::to_string(kMaxPrompts) + " are allowed",
                            "prompt");
    for (size_t i = 0; i < j.size(); ++i) {
      const std::string field = "prompt[" + std::to_string(i) + "]";
      if (j[i].is_string()) r.prompts.push_back({j[i].get<std::string>(), {}, false});
      else if (j[i].is_array()) r.prompts.push_back({{}, prompt_ids(j[i], field), true});
      else wrong_type(field, "a string or an array of token ids", j[i]);
    }
  } else {
    r.prompts.push_back({{}, prompt_ids(j, "prompt"), true});
  }
  r.prompt = r.prompts[0].text;
  r.prompt_ids = r.prompts[0].ids;
  r.prompt_is_ids = r.prompts[0].is_ids;
}

std::vector<std::string> parse_stop(const json& j) {
  std::vector<std::string> out;
  if (j.is_string()) {
    out.push_back(j.get<std::string>());
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) out.push_back(get_string(j[i], "stop[" + std::to_string(i) + "]"));
  } else {
    wrong_type("stop", "a string or an array of strings", j);
  }
  if (out.size() > kMaxStopSequences)
    throw invalid_request("'stop' holds " + std::to_string(out.size()) + " sequences; at most " +
                              std::to_string(kMaxStopSequences) + " are allowed",
                          "stop");
  for (const std::string& s : out) {
    if (s.empty()) throw invalid_request("'stop' sequences must not be empty", "stop");
    if (s.size() > kMaxStopSequenceBytes)
      throw invalid_request("'stop' sequences must be at most " + std::to_string(kMaxStopSequenceBytes) +
                                " bytes, got one of " + std::to_string(s.size()),
                            "stop");
  }
  return out;
}

void parse_tessera(const json& j, ApiRequest& r) {
  if (!j.is_object()) wrong_type("tessera", "an object", j);
  for (const auto& [key, value] : j.items()) {
    if (key == "attn") {
      r.attn = get_string(value, "tessera.attn");
      if (r.attn.empty()) throw invalid_request("'tessera.attn' must not be empty", "tessera.attn");
    } else {
      throw invalid_request("Unrecognized field in 'tessera': '" + key + "' (known: attn)", "tessera." + key);
    }
  }
}

// Rejects keys of object `j` (field `f`) outside `known`.
void only_keys(const json& j, const std::string& f, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) {
      std::string list;
      for (const char* k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      throw invalid_request("Unrecognized field in '" + f + "': '" + key + "' (known: " + list + ")", f + "." + key);
    }
  }
}

ResponseFormat parse_response_format(const json& v) {
  const std::string f = "response_format";
  if (!v.is_object()) wrong_type(f, "an object", v);
  if (!v.contains("type")) throw invalid_request("'response_format.type' is missing", "response_format.type");
  const std::string type = get_string(v["type"], "response_format.type");
  ResponseFormat out;
  if (type == "text" || type == "json_object") {
    only_keys(v, f, {"type"});
    out.kind = type == "text" ? ResponseFormat::Kind::Text : ResponseFormat::Kind::JsonObject;
    return out;
  }
  if (type != "json_schema")
    throw invalid_request("'response_format.type' must be one of text, json_object, json_schema; got '" + type + "'",
                          "response_format.type");
  only_keys(v, f, {"type", "json_schema"});
  const std::string g = "response_format.json_schema";
  if (!v.contains("json_schema") || v["json_schema"].is_null())
    throw invalid_request("'" + g + "' is missing (type json_schema)", g);
  const json& js = v["json_schema"];
  if (!js.is_object()) wrong_type(g, "an object", js);
  only_keys(js, g, {"name", "description", "schema", "strict"});
  if (!js.contains("name")) throw invalid_request("'" + g + ".name' is missing", g + ".name");
  out.name = get_string(js["name"], g + ".name");
  if (out.name.empty() || out.name.size() > 64 ||
      out.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") != std::string::npos)
    throw invalid_request("'" + g + ".name' must be 1 to 64 letters, digits, underscores or dashes, got '" + out.name +
                              "'",
                          g + ".name");
  if (js.contains("description") && !js["description"].is_null()) (void)get_string(js["description"], g + ".description");
  if (js.contains("strict") && !js["strict"].is_null()) out.strict = get_bool(js["strict"], g + ".strict");
  if (!js.contains("schema") || js["schema"].is_null())
    throw invalid_request("'" + g + ".schema' is missing", g + ".schema");
  if (!js["schema"].is_object()) wrong_type(g + ".schema", "an object (a JSON Schema)", js["schema"]);
  out.kind = ResponseFormat::Kind::JsonSchema;
  out.schema = js["schema"].dump();
  return out;
}

bool valid_function_name(const std::string& name) {
  return !name.empty() && name.size() <= 64 &&
         name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") ==
             std::string::npos;
}

std::vector<ToolFunction> parse_tools(const json& v) {
  if (!v.is_array()) wrong_type("tools", "an array", v);
  if (v.size() > kMaxTools)
    throw invalid_request("'tools' holds " + std::to_string(v.size()) + " tools; at most " + std::to_string(kMaxTools) +
                              " are allowed",
                          "tools");
  std::vector<ToolFunction> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string f = "tools[" + std::to_string(i) + "]";
    const json& t = v[i];
    if (!t.is_object()) wrong_type(f, "an object", t);
    only_keys(t, f, {"type", "function"});
    if (!t.contains("type")) throw invalid_request("'" + f + ".type' is missing", f + ".type");
    const std::string type = get_string(t["type"], f + ".type");
    if (type != "function") unsupported(f + ".type", "only function tools are (got '" + type + "')");
    if (!t.contains("function")) throw invalid_request("'" + f + ".function' is missing", f + ".function");
    const json& fn = t["function"];
    const std::string ff = f + ".function";
    if (!fn.is_object()) wrong_type(ff, "an object", fn);
    only_keys(fn, ff, {"name", "description", "parameters", "strict"});
    if (!fn.contains("name")) throw invalid_request("'" + ff + ".name' is missing", ff + ".name");
    ToolFunction tool;
    tool.name = get_string(fn["name"], ff + ".name");
    if (!valid_function_name(tool.name))
      throw invalid_request("'" + ff + ".name' must be 1 to 64 letters, digits, underscores or dashes, got '" +
                                tool.name + "'",
                            ff + ".name");
    for (const ToolFunction& other : out)
      if (other.name == tool.name)
        throw invalid_request("'tools' names the function '" + tool.name + "' twice", ff + ".name");
    if (fn.contains("description") && !fn["description"].is_null())
      tool.description = get_string(fn["description"], ff + ".description");
    if (fn.contains("strict") && !fn["strict"].is_null()) (void)get_bool(fn["strict"], ff + ".strict");
    tool.parameters = R"({"type":"object"})";
    if (fn.contains("parameters") && !fn["parameters"].is_null()) {
      const json& p = fn["parameters"];
      if (!p.is_object()) wrong_type(ff + ".parameters", "an object (a JSON Schema)", p);
      tool.parameters = p.dump();
    }
    out.push_back(std::move(tool));
  }
  return out;
}

// tool_choice (null or absent: "auto" with tools, "none" without), checked against the tools.
void parse_tool_choice(const json* v, ApiRequest& r) {
  const bool given = v != nullptr && !v->is_null();
  if (!given) {
    r.tool_choice = r.tools.empty() ? ToolChoice::None : ToolChoice::Auto;
  } else if (v->is_string()) {
    const std::string& s = v->get_ref<const std::string&>();
    if (s == "none") r.tool_choice = ToolChoice::None;
    else if (s == "auto") r.tool_choice = ToolChoice::Auto;
    else if (s == "required") r.tool_choice = ToolChoice::Required;
    else
      throw invalid_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}; got '" + s + "'",
                            "tool_choice");
  } else if (v->is_object()) {
    only_keys(*v, "tool_choice", {"type", "function"});
    if (!v->contains("type")) throw invalid_request("'tool_choice.type' is missing", "tool_choice.type");
    const std::string type = get_string((*v)["type"], "tool_choice.type");
    if (type != "function")
      throw invalid_request("'tool_choice.type' must be 'function', got '" + type + "'", "tool_choice.type");
    if (!v->contains("function") || !(*v)["function"].is_object())
      throw invalid_request("'tool_choice.function' must be an object with the function's name", "tool_choice.function");
    const json& fn = (*v)["function"];
    only_keys(fn, "tool_choice.function", {"name"});
    if (!fn.contains("name")) throw invalid_request("'tool_choice.function.name' is missing", "tool_choice.function.name");
    r.tool_name = get_string(fn["name"], "tool_choice.function.name");
    r.tool_choice = ToolChoice::Named;
  } else {
    wrong_type("tool_choice", "a string or an object", *v);
  }
  if (r.tools.empty() && r.tool_choice != ToolChoice::None)
    throw invalid_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice");
  if (r.tool_choice == ToolChoice::Named) {
    bool found = false;
    for (const ToolFunction& t : r.tools) found = found || t.name == r.tool_name;
    if (!found)
      throw invalid_request("'tool_choice' names the function '" + r.tool_name + "', which is not in 'tools'",
                            "tool_choice");
  }
  if (r.tool_choice != ToolChoice::None && r.response_format.kind != ResponseFormat::Kind::Text)
    throw invalid_request("'response_format' json_object or json_schema cannot be combined with 'tools' unless "
                          "'tool_choice' is \"none\"",
                          "response_format", "unsupported_parameter");
}

json parse_body(std::string_view body) {
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    // Say where the JSON breaks: parse again with exceptions for the parser's message.
    std::string detail;
    try {
      [[maybe_unused]] const json again = json::parse(body.begin(), body.end());
    } catch (const json::exception& e) {
      detail = e.what();
    }
    throw invalid_request("malformed JSON in the request body: " + detail, {}, "invalid_json");
  }
  if (!j.is_object()) throw invalid_request("the request body must be a JSON object, got " + type_name(j));
  return j;
}

[[noreturn]] void unrecognized(const std::string& key) {
  throw invalid_request("Unrecognized request argument supplied: " + key, key, "unsupported_parameter");
}

// The body of a tokenizer endpoint (/tokenize, /detokenize): "model" (a string, or null) into `model`, every other
// key through field(key, value), which returns false for a key it does not know (refused as unrecognized).
template <class Field>
void parse_tokenizer_body(std::string_view body, std::string& model, const Field& field) {
  const json j = parse_body(body);
  for (const auto& [key, v] : j.items()) {
    if (key == "model") {
      if (!v.is_null()) model = get_string(v, key);
    } else if (!field(key, v)) {
      unrecognized(key);
    }
  }
}

}  // namespace

TokenizeRequest parse_tokenize_request(std::string_view body) {
  TokenizeRequest r;
  bool prompt = false;
  parse_tokenizer_body(body, r.model, [&](const std::string& key, const json& v) {
    if (key == "prompt") {
      r.prompt = get_string(v, key);
      prompt = true;
    } else if (key == "messages") {
      r.messages = parse_messages(v);
      r.chat = true;
    } else if (v.is_null()) {
      // an option sent as null: its default
    } else if (key == "add_special_tokens") {
      r.add_special = get_bool(v, key);
    } else if (key == "add_generation_prompt") {
      r.add_generation_prompt = get_bool(v, key);
    } else if (key == "return_token_strs") {
      r.token_strs = get_bool(v, key);
    } else {
      return false;
    }
    return true;
  });
  if (prompt == r.chat) throw invalid_request("send either 'prompt' or 'messages'", prompt ? "messages" : "prompt");
  return r;
}

DetokenizeRequest parse_detokenize_request(std::string_view body) {
  DetokenizeRequest r;
  bool tokens = false;
  parse_tokenizer_body(body, r.model, [&](const std::string& key, const json& v) {
    if (key != "tokens") return false;
    if (!v.is_array()) wrong_type(key, "an array of token ids", v);
    for (size_t i = 0; i < v.size(); ++i) r.tokens.push_back(token_id(v[i], "tokens[" + std::to_string(i) + "]"));
    tokens = true;
    return true;
  });
  if (!tokens) throw invalid_request("'tokens' is missing", "tokens");
  return r;
}

ApiRequest parse_api_request(Endpoint endpoint, std::string_view body) {
  const json j = parse_body(body);
  const bool chat = endpoint == Endpoint::Chat;
  ApiRequest r;
  r.endpoint = endpoint;
  std::optional<int64_t> max_tokens, max_completion_tokens;
  bool stream_options_given = false;
  bool chat_logprobs = false;
  std::optional<int32_t> top_logprobs;
  std::optional<int64_t> best_of;
  const json* tool_choice = nullptr;
  for (const auto& [key, v] : j.items()) {
    if (key == "model") {
      r.model = get_string(v, "model");
    } else if (chat && key == "messages") {
      r.messages = parse_messages(v);
    } else if (!chat && key == "prompt") {
      parse_prompt(v, r);
    } else if (v.is_null()) {
      continue;  // every other field is optional, and null means "not given" in the API
    } else if (key == "max_tokens") {
      max_tokens = get_int(v, key, chat ? 1 : 0, std::numeric_limits<int32_t>::max());  // 0: echo only (below)
    } else if (chat && key == "max_completion_tokens") {
      max_completion_tokens = get_int(v, key, 1, std::numeric_limits<int32_t>::max());
    } else if (key == "temperature") {
      r.sampling.temperature = static_cast<float>(get_number(v, key, 0, 2));
    } else if (key == "top_p") {
      r.sampling.top_p = static_cast<float>(get_number(v, key, 0, 1));
    } else if (key == "top_k") {
      const int64_t k = get_int(v, key, -1, std::numeric_limits<int32_t>::max());
      r.sampling.top_k = k < 0 ? 0 : static_cast<int32_t>(k);  // -1: off, as vLLM and llama.cpp read it
    } else if (key == "seed") {
      if (v.is_number_unsigned()) {
        r.sampling.seed = v.get<uint64_t>();
      } else {
        r.sampling.seed = static_cast<uint64_t>(
            get_int(v, key, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
      }
      r.seed_given = true;
    } else if (key == "stop") {
      r.stop = parse_stop(v);
    } else if (key == "stream") {
      r.stream = get_bool(v, key);
    } else if (key == "stream_options") {
      if (!v.is_object()) wrong_type(key, "an object", v);
      stream_options_given = true;
      for (const auto& [k2, v2] : v.items()) {
        if (k2 == "include_usage") {
          if (!v2.is_null()) r.include_usage = get_bool(v2, "stream_options.include_usage");
        } else if (k2 == "include_obfuscation") {
          if (!v2.is_null()) (void)get_bool(v2, "stream_options.include_obfuscation");  // nothing to obfuscate
        } else {
          throw invalid_request("Unrecognized field in 'stream_options': '" + k2 + "'", "stream_options." + k2);
        }
      }
    } else if (key == "n") {
      r.n = static_cast<int32_t>(get_int(v, key, 1, kMaxChoices));
    } else if (!chat && key == "best_of") {
      best_of = get_int(v, key, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
    } else if (key == "tessera") {
      parse_tessera(v, r);
    } else if (key == "user" || key == "service_tier" || key == "safety_identifier" || key == "prompt_cache_key") {
      (void)get_string(v, key);  // accepted and ignored: they only label the request
    } else if (key == "metadata") {
      if (!v.is_object()) wrong_type(key, "an object", v);
    } else if (key == "store") {
      refuse_unless_off(v, key, "tessera keeps no completions");
    } else if (key == "parallel_tool_calls") {
      (void)get_bool(v, key);  // meaningless without tools
    } else if (chat && key == "logprobs") {
      chat_logprobs = get_bool(v, key);
    } else if (chat && key == "top_logprobs") {
      top_logprobs = static_cast<int32_t>(get_int(v, key, 0, kMaxLogprobs));
    } else if (!chat && key == "logprobs") {
      r.logprobs = static_cast<int32_t>(get_int(v, key, 0, kMaxLogprobs));
    } else if (key == "presence_penalty") {
      r.sampling.presence_penalty = static_cast<float>(get_number(v, key, -2, 2));
    } else if (key == "frequency_penalty") {
      r.sampling.frequency_penalty = static_cast<float>(get_number(v, key, -2, 2));
    } else if (key == "repetition_penalty") {  // vLLM's and llama.cpp's extension (transformers' rule)
      if (!v.is_number()) wrong_type(key, "a number", v);
      const double p = v.get<double>();
      if (!(p > 0 && p <= 100)) throw invalid_request("'repetition_penalty' must be in (0, 100] (1 = off), got " + v.dump(), key);
      r.sampling.repetition_penalty = static_cast<float>(p);
    } else if (key == "min_p") {  // vLLM's and llama.cpp's extension
      r.sampling.min_p = static_cast<float>(get_number(v, key, 0, 1));
    } else if (key == "logit_bias") {
      if (!v.is_object()) wrong_type(key, "an object", v);
      for (const auto& [id, bias] : v.items()) {
        int64_t t = -1;
        const bool digits = !id.empty() && id.size() <= 10 && id.find_first_not_of("0123456789") == std::string::npos;
        if (digits) t = std::stoll(id);
        if (!digits || t > std::numeric_limits<int32_t>::max())
          throw invalid_request("'logit_bias' keys must be token ids (non-negative integers as strings), got '" + id +
                                    "'",
                                key);
        r.sampling.logit_bias.emplace_back(static_cast<int32_t>(t),
                                           static_cast<float>(get_number(bias, "logit_bias." + id, -100, 100)));
      }
    } else if (chat && key == "tools") {
      r.tools = parse_tools(v);
    } else if (chat && key == "tool_choice") {
      tool_choice = &v;
    } else if (chat && (key == "functions" || key == "function_call")) {
      refuse_unless_off(v, key, "the legacy function-calling fields are not implemented; use 'tools' and 'tool_choice'");
    } else if (key == "response_format") {
      r.response_format = parse_response_format(v);
    } else if (chat && key == "modalities") {
      if (!(v.is_array() && v.size() == 1 && v[0] == "text")) unsupported(key, "only [\"text\"] is");
    } else if (chat && (key == "audio" || key == "prediction" || key == "web_search_options" ||
                        key == "reasoning_effort" || key == "verbosity")) {
      unsupported(key, "tessera generates plain text only");
    } else if (!chat && key == "echo") {
      r.echo = get_bool(v, key);
    } else if (!chat && key == "suffix") {
      refuse_unless_off(v, key, "insertion (suffix) is not implemented");
    } else {
      throw invalid_request("Unrecognized request argument supplied: " + key, key, "unsupported_parameter");
    }
  }
  if (!j.contains("model")) throw invalid_request("'model' is missing", "model");
  if (chat && (!j.contains("messages") || j["messages"].is_null()))
    throw invalid_request("'messages' is missing", "messages");
  if (!chat && (!j.contains("prompt") || j["prompt"].is_null()))
    throw invalid_request("'prompt' is missing", "prompt");
  if (max_tokens && max_completion_tokens && *max_tokens != *max_completion_tokens)
    throw invalid_request("'max_tokens' (" + std::to_string(*max_tokens) + ") and 'max_completion_tokens' (" +
                              std::to_string(*max_completion_tokens) + ") disagree; send one of them",
                          "max_tokens");
  if (max_completion_tokens) max_tokens = max_completion_tokens;
  if (max_tokens && *max_tokens == 0 && !r.echo)
    throw invalid_request("'max_tokens' must be in [1, 2147483647], got 0 (0 only with 'echo': the prompt alone)",
                          "max_tokens");
  if (top_logprobs && *top_logprobs > 0 && !chat_logprobs)
    throw invalid_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs");
  if (chat_logprobs) r.logprobs = top_logprobs.value_or(0);
  if (best_of && *best_of != r.n)
    throw invalid_request("'best_of' must equal 'n' (" + std::to_string(r.n) +
                              "): tessera returns every choice it generates",
                          "best_of", "unsupported_parameter");
  if (max_tokens) r.max_tokens = static_cast<int32_t>(*max_tokens);
  parse_tool_choice(tool_choice, r);
  // The schemas as the client wrote them: the grammar emits an object's properties in the schema's order, which
  // json (a sorted map) lost; ordered_json keeps it.
  if (r.response_format.kind == ResponseFormat::Kind::JsonSchema || !r.tools.empty()) {
    const auto o = nlohmann::ordered_json::parse(body.begin(), body.end());
    if (r.response_format.kind == ResponseFormat::Kind::JsonSchema)
      r.response_format.schema = o["response_format"]["json_schema"]["schema"].dump();
    for (size_t i = 0; i < r.tools.size(); ++i) {
      const auto& fn = o["tools"][i]["function"];
      if (fn.contains("parameters") && !fn["parameters"].is_null()) r.tools[i].parameters = fn["parameters"].dump();
    }
  }
  if (stream_options_given && !r.stream)
    throw invalid_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
  return r;
}

}  // namespace tessera::server
