// The server's socket-free parts (src/server): request parsing and its exact errors, request preparation against
// the real SmolLM2 tokenizer and context, stop sequences, response JSON, metrics text, attention specs, and the
// scheduler (bounded queue, cancellation, timeouts, stop reasons) over a scripted engine and over the real CPU
// engine, whose answer must equal Engine::generate's. The HTTP front is tested through OpenAI's client
// (tests/server/test_openai_api.py, concurrency.py).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "attention/pattern/config_io.h"
#include "attention/pattern/presets.h"
#include "core/error.h"
#include "model/model_file.h"
#include "model/tokenizer/byte_level.h"
#include "runtime/engine.h"
#include "model/model.h"
#include "server/api_request.h"
#include "server/api_response.h"
#include "server/engine_slot.h"
#include "server/metrics.h"
#include "server/policy_cache.h"
#include "server/prompt_tokens.h"
#include "server/request_prep.h"
#include "runtime/batch_engine.h"
#include "server/scheduler.h"
#include "server/stop_matcher.h"
#include "server/stream_serving.h"
#include "server/structured_output.h"

namespace tessera::server {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------
// Parsing

TEST(ServerRequest, ParsesEveryChatField) {
  const ApiRequest r = parse_api_request(Endpoint::Chat, R"({
    "model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                               {"role": "assistant", "content": "Hello", "name": "bot"},
                               {"role": "user", "content": "Again"}],
    "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 12, "stop": ["\n", "END"],
    "stream": true, "stream_options": {"include_usage": true}, "n": 1, "user": "u", "logprobs": false,
    "presence_penalty": 0, "tools": null, "tessera": {"attn": "vs"}})");
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");  // developer is the system role of newer models
  EXPECT_EQ(r.messages[1].content, "Hi there");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.sampling.seed, 12u);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.attn, "vs");
}

TEST(ServerRequest, ParsesResponseFormatAndTools) {
  const ApiRequest a = parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true,
                        "schema": {"type": "object", "properties": {"age": {"type": "integer"}}}}}})");
  EXPECT_EQ(a.response_format.kind, ResponseFormat::Kind::JsonSchema);
  EXPECT_EQ(a.response_format.name, "person");
  EXPECT_TRUE(a.response_format.strict);
  // the schema's text in the client's order (the grammar emits properties in that order)
  EXPECT_EQ(a.response_format.schema, R"({"type":"object","properties":{"age":{"type":"integer"}}})");
  EXPECT_EQ(a.tool_choice, ToolChoice::None);
  const ApiRequest p = parse_api_request(Endpoint::Completion, R"({"model": "m", "prompt": "x",
    "response_format": {"type": "json_object"}})");
  EXPECT_EQ(p.response_format.kind, ResponseFormat::Kind::JsonObject);
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}])";
  const ApiRequest t = parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )" +
                                                             tools + "}");
  ASSERT_EQ(t.tools.size(), 2u);
  EXPECT_EQ(t.tools[0].name, "get_weather");
  EXPECT_EQ(t.tools[0].description, "Weather");
  EXPECT_EQ(t.tools[0].parameters,
            R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");  // in order
  EXPECT_EQ(t.tools[1].parameters, R"({"type":"object"})");  // no parameters: any object
  EXPECT_EQ(t.tool_choice, ToolChoice::Auto);                 // tools without tool_choice
  EXPECT_EQ(tool_answer(t), ToolAnswer::Auto);
  const ApiRequest n = parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )" +
                                                             tools + R"(, "tool_choice": {"type": "function", "function": {"name": "now"}}})");
  EXPECT_EQ(n.tool_choice, ToolChoice::Named);
  EXPECT_EQ(n.tool_name, "now");
  EXPECT_EQ(tool_answer(n), ToolAnswer::Forced);
  // The forced call's schema: the named function alone; "required": any of them.
  EXPECT_EQ(json::parse(tool_call_schema(n)),
            json::parse(R"({"type": "object", "properties": {"name": {"const": "now"}, "arguments": {"type": "object"}},
                            "required": ["name", "arguments"], "additionalProperties": false})"));
  ApiRequest req = n;
  req.tool_choice = ToolChoice::Required;
  EXPECT_EQ(json::parse(tool_call_schema(req))["anyOf"].size(), 2u);
  // The tools go into the system message (appended to the first one, or a new one first).
  const auto msgs = with_tools({{"user", "hi"}}, t.tools);
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_EQ(msgs[0].role, "system");
  EXPECT_EQ(msgs[0].content, tool_system_prompt(t.tools));
  EXPECT_NE(msgs[0].content.find(R"({"type":"function","function":{"name":"get_weather","description":"Weather","parameters":)"),
            std::string::npos);
  const auto msgs2 = with_tools({{"system", "Be brief."}, {"user", "hi"}}, t.tools);
  ASSERT_EQ(msgs2.size(), 2u);
  EXPECT_EQ(msgs2[0].content, "Be brief.\n\n" + tool_system_prompt(t.tools));
}

TEST(ServerRequest, ToolMessagesBecomeTheTemplatesTurns) {
  // An assistant's tool_calls become <tool_call> blocks, tool results one user turn of <tool_response> blocks.
  const ApiRequest r = parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
      {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "9 C"},
    {"role": "user", "content": "Thanks"}]})");
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[1].role, "assistant");
  EXPECT_EQ(r.messages[1].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>\n"
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>");
  EXPECT_EQ(r.messages[2].role, "user");
  EXPECT_EQ(r.messages[2].content, "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C\n</tool_response>");
  EXPECT_EQ(r.messages[3].content, "Thanks");
}

TEST(ServerRequest, ReadsToolCallsBack) {
  const std::vector<ToolFunction> tools{{"get_weather", "", R"({"type":"object"})"}, {"now", "", R"({"type":"object"})"}};
  const json forced = parse_tool_calls(R"({"name": "get_weather", "arguments": {"city": "Paris"}})", ToolAnswer::Forced,
                                       tools, "call_x_0_");
  EXPECT_EQ(forced, json::parse(R"([{"id": "call_x_0_0", "type": "function",
                                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])"));
  // auto: <tool_call> blocks (several), unknown names and broken JSON skipped; plain text holds none
  const json autos = parse_tool_calls(
      "Let me look.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>{\"name\": "
      "\"nope\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>"
      "<tool_call>{broken</tool_call>",
      ToolAnswer::Auto, tools, "c");
  ASSERT_EQ(autos.size(), 2u);
  EXPECT_EQ(autos[0]["function"]["name"], "now");
  EXPECT_EQ(autos[0]["function"]["arguments"], "{}");
  EXPECT_EQ(autos[1]["id"], "c1");
  EXPECT_EQ(autos[1]["function"]["arguments"], R"({"city":"Oslo"})");
  EXPECT_TRUE(parse_tool_calls("It is sunny.", ToolAnswer::Auto, tools, "c").empty());
  EXPECT_EQ(parse_tool_calls(R"( {"name": "now", "arguments": {}} )", ToolAnswer::Auto, tools, "c").size(), 1u);
  EXPECT_TRUE(parse_tool_calls(R"({"name": "now", "arguments": {)", ToolAnswer::Forced, tools, "c").empty());  // cut
  // the chat answer: content null, tool_calls, finish_reason tool_calls
  const AnswerHeader h{Endpoint::Chat, "chatcmpl-1", 5, "m"};
  const json a = answer_json(h, std::vector<Choice>{{"x", "stop", nullptr, forced}}, Usage{});
  EXPECT_EQ(a["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(a["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(a["choices"][0]["message"]["tool_calls"], forced);
  const json c = tool_calls_chunk_json(h, forced, false, 0);
  EXPECT_EQ(c["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
  EXPECT_EQ(c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
}

TEST(ServerRequest, ParsesSamplingAndLogprobFields) {
  const ApiRequest c = parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
    "presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.3, "min_p": 0.05,
    "logit_bias": {"12": -100, "7": 2.5}, "logprobs": true, "top_logprobs": 3, "n": 2})");
  EXPECT_FLOAT_EQ(c.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(c.sampling.frequency_penalty, -1.25f);
  EXPECT_FLOAT_EQ(c.sampling.repetition_penalty, 1.3f);
  EXPECT_FLOAT_EQ(c.sampling.min_p, 0.05f);
  EXPECT_EQ(c.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{12, -100.0f}, {7, 2.5f}}));
  EXPECT_EQ(c.logprobs, 3);
  EXPECT_EQ(c.n, 2);
  EXPECT_EQ(parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
    "logprobs": true})").logprobs, 0);
  EXPECT_EQ(parse_api_request(Endpoint::Chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
    "logprobs": false, "top_logprobs": 0})").logprobs, -1);
  const ApiRequest p = parse_api_request(Endpoint::Completion, R"({"model": "m", "prompt": [1, 2],
    "echo": true, "logprobs": 1, "max_tokens": 0, "best_of": 3, "n": 3})");
  EXPECT_TRUE(p.echo);
  EXPECT_EQ(p.logprobs, 1);
  EXPECT_EQ(p.max_tokens, 0);
  EXPECT_EQ(p.n, 3);
}

TEST(ServerRequest, DefaultsAreTheApis) {
  const ApiRequest r = parse_api_request(Endpoint::Completion, R"({"model": "m", "prompt": "x", "stop": null,
                                                                    "max_tokens": null, "top_k": -1})");
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FALSE(r.seed_given);
  EXPECT_FALSE(r.stream);
  EXPECT_TRUE(r.stop.empty());
  EXPECT_TRUE(r.attn.empty());
  EXPECT_EQ(r.prompt, "x");
}

TEST(ServerRequest, CompletionPromptForms) {
  auto parse = [](const std::string& prompt) {
    return parse_api_request(Endpoint::Completion, R"({"model": "m", "prompt": )" + prompt + "}");
  };
  EXPECT_EQ(parse(R"(["one"])").prompt, "one");
  EXPECT_EQ(parse("[1, 2, 3]").prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(parse("[1, 2, 3]").prompt_is_ids);
  EXPECT_EQ(parse("[[4, 5]]").prompt_ids, (std::vector<int32_t>{4, 5}));
  const ApiRequest several = parse(R"(["a", [7, 8], "b"])");
  ASSERT_EQ(several.prompts.size(), 3u);
  EXPECT_EQ(several.prompt, "a");
  EXPECT_EQ(several.prompts[1].ids, (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(several.prompts[1].is_ids);
  EXPECT_EQ(several.prompts[2].text, "b");
}

struct BadRequest {
  Endpoint endpoint;
  std::string body;
  int status;
  std::string param, code, message;
};

class ServerRequestErrors : public ::testing::TestWithParam<BadRequest> {};

TEST_P(ServerRequestErrors, ExactError) {
  const BadRequest& b = GetParam();
  try {
    (void)parse_api_request(b.endpoint, b.body);
    FAIL() << "accepted: " << b.body;
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), b.status);
    EXPECT_EQ(e.type(), "invalid_request_error");
    EXPECT_EQ(e.param(), b.param);
    EXPECT_EQ(e.code(), b.code);
    EXPECT_EQ(std::string(e.what()), b.message);
  }
}

const Endpoint C = Endpoint::Chat, P = Endpoint::Completion;
const std::string kMsgs = R"("messages": [{"role": "user", "content": "Hi"}])";

INSTANTIATE_TEST_SUITE_P(
    All, ServerRequestErrors,
    ::testing::Values(
        BadRequest{C, "", 400, "", "invalid_json",
                   "malformed JSON in the request body: [json.exception.parse_error.101] parse error at line 1, "
                   "column 1: syntax error while parsing value - unexpected end of input; expected '[', '{', or a "
                   "literal"},
        BadRequest{C, "42", 400, "", "", "the request body must be a JSON object, got integer"},
        BadRequest{C, "{" + kMsgs + "}", 400, "model", "", "'model' is missing"},
        BadRequest{C, R"({"model": 3, )" + kMsgs + "}", 400, "model", "", "'model' must be a string, got integer"},
        BadRequest{C, R"({"model": "m"})", 400, "messages", "", "'messages' is missing"},
        BadRequest{C, R"({"model": "m", "messages": {}})", 400, "messages", "", "'messages' must be an array, got object"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "user"}]})", 400, "messages[0].content", "",
                   "'messages[0].content' is missing"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "function", "content": "x"}]})", 400, "messages[0].role",
                   "unsupported_parameter",
                   "'messages[0].role' is not supported by tessera: legacy function messages are not (use role 'tool')"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]})",
                   400, "messages[0].tool_calls", "", "'messages[0].tool_calls' is only allowed in assistant messages"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]})",
                   400, "messages[0].tool_calls[0].function.arguments", "",
                   "'messages[0].tool_calls[0].function.arguments' must be a JSON object in a string, got '[1]'"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400,
                   "messages[0].content[0].type", "unsupported_parameter",
                   "'messages[0].content[0].type' is not supported by tessera: only text parts are (got 'image_url')"},
        BadRequest{C, R"({"model": "m", "messages": [{"role": "user", "content": "x", "mood": 1}]})", 400,
                   "messages[0].mood", "", "Unrecognized field in messages[0]: 'mood'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "max_tokens": 2.0})", 400, "max_tokens", "",
                   "'max_tokens' must be an integer, got number"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "max_tokens": 0})", 400, "max_tokens", "",
                   "'max_tokens' must be in [1, 2147483647], got 0"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "max_tokens": 5, "max_completion_tokens": 6})", 400,
                   "max_tokens", "", "'max_tokens' (5) and 'max_completion_tokens' (6) disagree; send one of them"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "top_p": -0.5})", 400, "top_p", "",
                   "'top_p' must be in [0.0, 1.0], got -0.5"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "top_k": -2})", 400, "top_k", "",
                   "'top_k' must be in [-1, 2147483647], got -2"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "seed": "7"})", 400, "seed", "",
                   "'seed' must be an integer, got string"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "stop": ["a", "b", "c", "d", "e"]})", 400, "stop", "",
                   "'stop' holds 5 sequences; at most 4 are allowed"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "stop": [""]})", 400, "stop", "",
                   "'stop' sequences must not be empty"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "stop": 5})", 400, "stop", "",
                   "'stop' must be a string or an array of strings, got integer"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "stream_options": {"include_usage": true}})", 400,
                   "stream_options", "", "'stream_options' is only allowed when 'stream' is true"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "n": 17})", 400, "n", "", "'n' must be in [1, 16], got 17"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "n": 0})", 400, "n", "", "'n' must be in [1, 16], got 0"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "frequency_penalty": 2.5})", 400, "frequency_penalty", "",
                   "'frequency_penalty' must be in [-2.0, 2.0], got 2.5"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "presence_penalty": "1"})", 400, "presence_penalty", "",
                   "'presence_penalty' must be a number, got string"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "repetition_penalty": 0})", 400, "repetition_penalty", "",
                   "'repetition_penalty' must be in (0, 100] (1 = off), got 0"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "min_p": 1.5})", 400, "min_p", "",
                   "'min_p' must be in [0.0, 1.0], got 1.5"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "logit_bias": {"x": 1}})", 400, "logit_bias", "",
                   "'logit_bias' keys must be token ids (non-negative integers as strings), got 'x'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "logit_bias": {"5": 101}})", 400, "logit_bias.5", "",
                   "'logit_bias.5' must be in [-100.0, 100.0], got 101"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "logit_bias": [1]})", 400, "logit_bias", "",
                   "'logit_bias' must be an object, got array"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "logprobs": 1})", 400, "logprobs", "",
                   "'logprobs' must be a boolean, got integer"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "top_logprobs": 2})", 400, "top_logprobs", "",
                   "'top_logprobs' requires 'logprobs' to be true"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "logprobs": true, "top_logprobs": 21})", 400,
                   "top_logprobs", "", "'top_logprobs' must be in [0, 20], got 21"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "echo": true})", 400, "echo", "unsupported_parameter",
                   "Unrecognized request argument supplied: echo"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "response_format": {"type": "xml"}})", 400,
                   "response_format.type", "",
                   "'response_format.type' must be one of text, json_object, json_schema; got 'xml'"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}})", 400,
                   "response_format.json_schema", "", "'response_format.json_schema' is missing (type json_schema)"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})",
                   400, "response_format.json_schema.schema", "", "'response_format.json_schema.schema' is missing"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})",
                   400, "response_format.json_schema.name", "", "'response_format.json_schema.name' is missing"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}})",
                   400, "response_format.json_schema.schema", "",
                   "'response_format.json_schema.schema' must be an object (a JSON Schema), got integer"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "response_format": {"type": "json_object", "schema": {}}})",
                   400, "response_format.schema", "", "Unrecognized field in 'response_format': 'schema' (known: type)"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tool_choice": "required"})", 400, "tool_choice", "",
                   "'tool_choice' is only allowed when 'tools' are given"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"})",
                   400, "tool_choice", "",
                   "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}; got 'always'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})",
                   400, "tool_choice", "", "'tool_choice' names the function 'g', which is not in 'tools'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "a b"}}]})",
                   400, "tools[0].function.name", "",
                   "'tools[0].function.name' must be 1 to 64 letters, digits, underscores or dashes, got 'a b'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})",
                   400, "tools[1].function.name", "", "'tools' names the function 'f' twice"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})",
                   400, "tools[0].function.parameters", "",
                   "'tools[0].function.parameters' must be an object (a JSON Schema), got array"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "retrieval"}]})", 400, "tools[0].type",
                   "unsupported_parameter", "'tools[0].type' is not supported by tessera: only function tools are (got 'retrieval')"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}})",
                   400, "response_format", "unsupported_parameter",
                   "'response_format' json_object or json_schema cannot be combined with 'tools' unless 'tool_choice' is \"none\""},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "functions": [{"name": "f"}]})", 400, "functions",
                   "unsupported_parameter",
                   "'functions' is not supported by tessera: the legacy function-calling fields are not implemented; use "
                   "'tools' and 'tool_choice'"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tessera": {"attn": ""}})", 400, "tessera.attn", "",
                   "'tessera.attn' must not be empty"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "tessera": "vs"})", 400, "tessera", "",
                   "'tessera' must be an object, got string"},
        BadRequest{C, R"({"model": "m", )" + kMsgs + R"(, "prompt": "x"})", 400, "prompt", "unsupported_parameter",
                   "Unrecognized request argument supplied: prompt"},
        BadRequest{P, R"({"model": "m", "prompt": []})", 400, "prompt", "", "'prompt' must not be an empty array"},
        BadRequest{P, R"({"model": "m", "prompt": [1, -1]})", 400, "prompt[1]", "",
                   "'prompt[1]' must be in [0, 2147483647], got -1"},
        BadRequest{P, R"({"model": "m", "prompt": {"text": "x"}})", 400, "prompt", "",
                   "'prompt' must be a string, an array of token ids, or an array of strings or of token-id arrays, "
                   "got object"},
        BadRequest{P, R"({"model": "m", "prompt": ["a", 5]})", 400, "prompt[1]", "",
                   "'prompt[1]' must be a string or an array of token ids, got integer"},
        BadRequest{P, R"({"model": "m", "prompt": [[1], []]})", 400, "prompt", "",
                   "'prompt[1]' must not be an empty array"},
        BadRequest{P, R"({"model": "m", "prompt": [[1], [2, -3]]})", 400, "prompt[1][1]", "",
                   "'prompt[1][1]' must be in [0, 2147483647], got -3"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "echo": 1})", 400, "echo", "",
                   "'echo' must be a boolean, got integer"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "logprobs": true})", 400, "logprobs", "",
                   "'logprobs' must be an integer, got boolean"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "logprobs": 21})", 400, "logprobs", "",
                   "'logprobs' must be in [0, 20], got 21"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "max_tokens": 0})", 400, "max_tokens", "",
                   "'max_tokens' must be in [1, 2147483647], got 0 (0 only with 'echo': the prompt alone)"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "best_of": 2})", 400, "best_of", "unsupported_parameter",
                   "'best_of' must equal 'n' (1): tessera returns every choice it generates"},
        BadRequest{P, R"({"model": "m", "prompt": "x", "max_completion_tokens": 2})", 400, "max_completion_tokens",
                   "unsupported_parameter", "Unrecognized request argument supplied: max_completion_tokens"}),
    [](const ::testing::TestParamInfo<BadRequest>& p) {
      // The field the error names (or the code), made an identifier, and the case's index for uniqueness.
      std::string name = p.param.param.empty() ? p.param.code : p.param.param;
      if (name.empty()) name = "body";
      for (char& ch : name)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return name + "_" + std::to_string(p.index);
    });

// ---------------------------------------------------------------------------------------------------------------
// Preparation against the real model's tokenizer

std::string models_dir() {
  if (const char* env = std::getenv("TESSERA_MODELS"); env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/tessera/models";
}

// The SmolLM2 model, loaded once for the tests that need it; null (with the test skipped or failed as the other
// real-model tests do) when it is missing.
struct RealModel {
  std::unique_ptr<runtime::Model> model;
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::optional<model::ChatTemplate> chat;
  ServedModel served;
};

const RealModel* real_model() {
  static const std::unique_ptr<RealModel> m = []() -> std::unique_ptr<RealModel> {
    const std::string path = models_dir() + "/smollm2-135m-instruct-q4_1.gguf";
    if (!std::filesystem::exists(path)) return nullptr;
    auto r = std::make_unique<RealModel>();
    r->model = runtime::Model::load(path);
    r->tokenizer = model::Tokenizer::from_gguf(r->model->file().metadata());
    r->chat = model::ChatTemplate::from_gguf(r->model->file().metadata());
    r->served = {"smollm2", r->tokenizer.get(), &*r->chat, 8192, 0};
    return r;
  }();
  return m.get();
}

#define REQUIRE_REAL_MODEL()                                                                                  \
  const RealModel* rm = real_model();                                                                         \
  if (rm == nullptr) {                                                                                        \
    const char* allow = std::getenv("TESSERA_ALLOW_MISSING_MODELS");                                         \
    if (allow != nullptr && std::string(allow) == "1") GTEST_SKIP() << "SmolLM2 is missing";                 \
    FAIL() << models_dir() << "/smollm2-135m-instruct-q4_1.gguf is missing: run scripts/fetch_models.sh";    \
  }

ApiError prepare_error(const std::string& body, Endpoint e, const ServedModel& m) {
  try {
    (void)prepare_request(parse_api_request(e, body), m, 0);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "", "");
}

TEST(ServerPrepare, ChatUsesTheTemplateAndTheRestOfTheContext) {
  REQUIRE_REAL_MODEL();
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Chat, R"({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                                           "seed": 5, "temperature": 0})"),
      rm->served, 99);
  const std::vector<model::ChatMessage> msgs = {{"user", "Hi"}};
  EXPECT_EQ(p.prompt, rm->tokenizer->encode(rm->chat->apply(msgs, true), {.add_special = false, .parse_special = true}));
  EXPECT_EQ(p.gen.max_new_tokens, 8192 - static_cast<int32_t>(p.prompt.size()));
  EXPECT_EQ(p.gen.sampling.seed, 5u);
  EXPECT_EQ(p.gen.stop_tokens, rm->tokenizer->special().end_of_generation);
  // Completions default to 16 tokens and take the random seed when none is given.
  const PreparedRequest c =
      prepare_request(parse_api_request(Endpoint::Completion, R"({"model": "smollm2", "prompt": "Hello"})"),
                      rm->served, 99);
  EXPECT_EQ(c.gen.max_new_tokens, kDefaultCompletionTokens);
  EXPECT_EQ(c.gen.sampling.seed, 99u);
  EXPECT_EQ(c.prompt, rm->tokenizer->encode("Hello", {.add_special = true}));
}

TEST(ServerPrepare, ModelAndContextErrors) {
  REQUIRE_REAL_MODEL();
  ApiError e = prepare_error(R"({"model": "gpt-4", "prompt": "x"})", Endpoint::Completion, rm->served);
  EXPECT_EQ(e.status(), 404);
  EXPECT_EQ(e.code(), "model_not_found");
  EXPECT_EQ(std::string(e.what()), "The model 'gpt-4' does not exist; this server serves 'smollm2'");
  ServedModel small = rm->served;
  small.context_length = 8;
  e = prepare_error(R"({"model": "smollm2", "prompt": "one two three four five six seven eight nine"})",
                    Endpoint::Completion, small);
  EXPECT_EQ(e.code(), "context_length_exceeded");
  EXPECT_EQ(std::string(e.what()),
            "This model's maximum context length is 8 tokens. However, your prompt resulted in 9 tokens, which "
            "leaves no room for the completion. Please reduce the length of the prompt.");
  e = prepare_error(R"({"model": "smollm2", "prompt": "one two", "max_tokens": 7})", Endpoint::Completion, small);
  EXPECT_EQ(std::string(e.what()),
            "This model's maximum context length is 8 tokens. However, you requested 9 tokens (2 in the prompt, 7 in "
            "the completion). Please reduce the length of the prompt or completion.");
  EXPECT_EQ(e.param(), "max_tokens");
  e = prepare_error(R"({"model": "smollm2", "prompt": [1, 49152]})", Endpoint::Completion, rm->served);
  EXPECT_EQ(std::string(e.what()), "'prompt[1]' is token id 49152, outside the vocabulary of 49152 tokens");
  e = prepare_error(R"({"model": "smollm2", "prompt": ""})", Endpoint::Completion, rm->served);
  EXPECT_EQ(std::string(e.what()), "the prompt is empty");
}

// ---------------------------------------------------------------------------------------------------------------
// Stop sequences, responses, metrics, attention specs

// ---------------------------------------------------------------------------------------------------------------
// The prompt token cache (prompt_tokens.h)

// A conversation's text as a client's turns make it: a long document, then questions and answers.
std::string conversation_text(std::mt19937& rng, size_t words) {
  static const std::vector<std::string> pool = {"the", "record", "of", "Alder", "Creek's", "1127", "wool,", "salt",
                                                "(copper)", "don't", "\u00e9t\u00e9", "\u4e2d\u6587", "<b>", "--"};
  static const std::vector<std::string> gaps = {" ", " ", "  ", "\n", "\n\n", ". ", "\t"};
  std::string out;
  for (size_t i = 0; i < words; ++i) out += pool[rng() % pool.size()] + gaps[rng() % gaps.size()];
  return out;
}

// Turns of several conversations over one document, interleaved as concurrent clients send them, as chat (the
// template's control tokens) and as growing completion texts: every prompt's ids equal Tokenizer::encode's, the
// later turns start from the earlier ones, and a grown conversation replaces its entry.
void check_conversations(const model::Tokenizer& tok, const model::ChatTemplate& chat, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::string doc = conversation_text(rng, 1500);
  PromptTokenCache cache;
  constexpr int kClients = 3, kTurns = 4;
  for (const bool as_chat : {true, false}) {
    const model::EncodeOptions options{.add_special = !as_chat || !chat.renders_bos(), .parse_special = as_chat};
    std::vector<std::vector<model::ChatMessage>> messages(kClients);
    std::vector<std::string> texts(kClients);
    for (int c = 0; c < kClients; ++c) {
      messages[c] = {{"user", doc + "\n\nQuestion " + std::to_string(c) + ": how many?"}};
      texts[c] = doc + "\n\nQuestion " + std::to_string(c) + ": how many?\nAnswer:";
    }
    const PromptTokenCache::Stats start = cache.stats();
    size_t sent = 0;
    for (int turn = 0; turn < kTurns; ++turn) {
      for (int c = 0; c < kClients; ++c) {
        const std::string prompt = as_chat ? chat.apply(messages[c], true) : texts[c];
        sent += prompt.size();
        ASSERT_EQ(cache.encode(tok, prompt, options), tok.encode(prompt, options))
            << "chat " << as_chat << " client " << c << " turn " << turn;
        const std::string answer = " " + std::to_string(rng() % 1000) + " " + conversation_text(rng, 6);
        messages[c].push_back({"assistant", answer});
        messages[c].push_back({"user", "And " + std::to_string(turn) + "?"});
        texts[c] += answer + "\n\nQuestion: and " + std::to_string(turn) + "?\nAnswer:";
      }
    }
    const PromptTokenCache::Stats s = cache.stats();
    EXPECT_EQ(s.lookups - start.lookups, static_cast<uint64_t>(kClients * kTurns));
    // Every prompt but the first starts from a kept one (the others' first turns share the document).
    EXPECT_EQ(s.hits - start.hits, static_cast<uint64_t>(kClients * kTurns - 1));
    EXPECT_GT(s.bytes_reused - start.bytes_reused, sent * 3 / 4);
    EXPECT_EQ(s.entries, static_cast<size_t>(kClients) * (as_chat ? 1 : 2)) << "a grown conversation replaces its entry";
  }
}

TEST(ServerPromptCache, ConversationsEqualEncodeSmolLM2) {
  REQUIRE_REAL_MODEL();
  check_conversations(*rm->tokenizer, *rm->chat, 11);
}

TEST(ServerPromptCache, ConversationsEqualEncodeGemma3) {
  const std::string path = models_dir() + "/gemma-3-270m-q4_k_m.gguf";
  if (!std::filesystem::exists(path)) {
    const char* allow = std::getenv("TESSERA_ALLOW_MISSING_MODELS");
    if (allow != nullptr && std::string(allow) == "1") GTEST_SKIP() << path << " is missing";
    FAIL() << path << " is missing: run scripts/fetch_models.sh";
  }
  const auto file = model::ModelFile::open(path);
  const auto tok = model::Tokenizer::from_gguf(file->metadata());
  const model::ChatTemplate chat = model::ChatTemplate::from_gguf(file->metadata());
  check_conversations(*tok, chat, 12);
}

TEST(ServerPromptCache, BoundedLeastRecentlyUsedAndThreadSafe) {
  REQUIRE_REAL_MODEL();
  const model::Tokenizer& tok = *rm->tokenizer;
  const model::EncodeOptions options{.add_special = true, .parse_special = false};
  std::mt19937 rng(5);
  std::vector<std::string> texts;
  for (int i = 0; i < 3; ++i) texts.push_back("doc " + std::to_string(i) + " " + conversation_text(rng, 400));
  PromptTokenCache probe;
  (void)probe.encode(tok, texts[0], options);
  const size_t one = probe.stats().bytes;
  ASSERT_GT(one, texts[0].size());
  // Room for two of the three: the least recently used goes.
  PromptTokenCache cache(one * 2 + one / 2);
  for (const std::string& t : texts) EXPECT_EQ(cache.encode(tok, t, options), tok.encode(t, options));
  PromptTokenCache::Stats s = cache.stats();
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_LE(s.bytes, one * 2 + one / 2);
  EXPECT_EQ(s.hits, 0u);
  (void)cache.encode(tok, texts[1] + " more", options);  // texts[1] grows: found, replaced, now the newest
  (void)cache.encode(tok, texts[0] + " more", options);  // texts[0] was evicted: a miss; texts[2] goes
  s = cache.stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(cache.encode(tok, texts[2] + " more", options), tok.encode(texts[2] + " more", options));
  EXPECT_EQ(cache.stats().hits, 1u) << "texts[2] was the least recently used";
  // A cache of 0 bytes keeps nothing; one entry larger than the cache is not kept.
  PromptTokenCache none(0);
  EXPECT_EQ(none.encode(tok, texts[0], options), tok.encode(texts[0], options));
  EXPECT_EQ(none.stats().entries, 0u);
  PromptTokenCache small(one / 2);
  EXPECT_EQ(small.encode(tok, texts[0], options), tok.encode(texts[0], options));
  EXPECT_EQ(small.stats().entries, 0u);
  // Four threads, each a growing conversation on the same document, on one cache.
  PromptTokenCache shared;
  std::vector<std::future<int>> done;
  for (int t = 0; t < 4; ++t) {
    done.push_back(std::async(std::launch::async, [&, t] {
      std::mt19937 r(100 + static_cast<uint32_t>(t));
      std::string text = texts[0];
      int bad = 0;
      for (int turn = 0; turn < 6; ++turn) {
        text += " Q" + std::to_string(t) + " " + conversation_text(r, 20);
        bad += shared.encode(tok, text, options) != tok.encode(text, options);
      }
      return bad;
    }));
  }
  for (auto& f : done) EXPECT_EQ(f.get(), 0);
  EXPECT_GE(shared.stats().hits, 20u);
}

// The server's requests go through the model's cache: a chat conversation's later turn gives the ids encode() gives.
TEST(ServerPromptCache, PreparedTurnsUseTheCache) {
  REQUIRE_REAL_MODEL();
  ServedModel served = rm->served;
  served.prompt_tokens = std::make_shared<PromptTokenCache>();
  std::mt19937 rng(9);
  const std::string doc = conversation_text(rng, 800);
  json messages = json::array({{{"role", "user"}, {"content", doc}}});
  std::vector<model::ChatMessage> msgs = {{"user", doc}};
  for (int turn = 0; turn < 3; ++turn) {
    const json body = {{"model", "smollm2"}, {"messages", messages}};
    const PreparedRequest p = prepare_request(parse_api_request(Endpoint::Chat, body.dump()), served, 1);
    EXPECT_EQ(p.prompt, rm->tokenizer->encode(rm->chat->apply(msgs, true), {.add_special = false, .parse_special = true}));
    messages.push_back({{"role", "assistant"}, {"content", "Answer " + std::to_string(turn)}});
    messages.push_back({{"role", "user"}, {"content", "Next?"}});
    msgs.push_back({"assistant", "Answer " + std::to_string(turn)});
    msgs.push_back({"user", "Next?"});
  }
  EXPECT_EQ(served.prompt_tokens->stats().hits, 2u);
  EXPECT_GT(served.prompt_tokens->stats().bytes_reused, 3 * doc.size() / 2);
}

TEST(ServerStopMatcher, HoldsBackPrefixesAndCutsAtTheSequence) {
  StopMatcher m({"</s>", "ab"});
  EXPECT_EQ(m.push("xy<"), "xy");  // "<" may start "</s>"
  EXPECT_EQ(m.push("/"), "");
  EXPECT_EQ(m.push("t"), "</t");   // not a stop sequence after all
  EXPECT_EQ(m.push("a"), "");
  EXPECT_EQ(m.push("bc"), "");     // "ab" appeared: nothing from it on is sent
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");
  StopMatcher n({"\n\n"});
  EXPECT_EQ(n.push("a\n"), "a");
  EXPECT_EQ(n.flush(), "\n");  // the end of the answer releases what was held
  EXPECT_FALSE(n.stopped());
  StopMatcher none({});
  EXPECT_EQ(none.push("abc"), "abc");
}

TEST(ServerResponse, ShapesMatchTheApi) {
  const AnswerHeader chat{Endpoint::Chat, answer_id(Endpoint::Chat, 26), 1700000000, "m"};
  EXPECT_EQ(chat.id, "chatcmpl-00000000000000000000001a");
  EXPECT_EQ(dump_json(answer_json(chat, "Paris", "stop", {5, 2})),
            R"({"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":"Paris","refusal":null,"role":"assistant"}}],"created":1700000000,"id":"chatcmpl-00000000000000000000001a","model":"m","object":"chat.completion","system_fingerprint":null,"usage":{"completion_tokens":2,"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":0},"total_tokens":7}})");
  EXPECT_EQ(dump_json(chunk_json(chat, "", true, "", false)["choices"][0]["delta"]),
            R"({"content":"","role":"assistant"})");
  EXPECT_EQ(dump_json(chunk_json(chat, "", false, "length", true)),
            R"({"choices":[{"delta":{},"finish_reason":"length","index":0,"logprobs":null}],"created":1700000000,"id":"chatcmpl-00000000000000000000001a","model":"m","object":"chat.completion.chunk","system_fingerprint":null,"usage":null})");
  const AnswerHeader text{Endpoint::Completion, answer_id(Endpoint::Completion, 1), 1, "m"};
  EXPECT_EQ(sse_event(chunk_json(text, "a\xff", false, "", false)),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"logprobs\":null,\"text\":\"a\xEF\xBF\xBD\"}],"
            "\"created\":1,\"id\":\"cmpl-000000000000000000000001\",\"model\":\"m\",\"object\":\"text_completion\","
            "\"system_fingerprint\":null}\n\n");
  EXPECT_EQ(dump_json(usage_chunk_json(text, {3, 4, 2})["usage"]),
            R"({"completion_tokens":4,"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2},"total_tokens":7})");
  EXPECT_EQ(dump_json(error_json(ApiError(429, "rate_limit_error", "busy", {}, "queue_full"))),
            R"({"error":{"code":"queue_full","message":"busy","param":null,"type":"rate_limit_error"}})");
}

// The log-probabilities' shapes: chat's content entries, completions' four parallel lists (the echoed prompt's first
// token null; top_logprobs holding the chosen token too), text_offset in characters continuing from *offset.
const model::Tokenizer& byte_tokenizer();  // below: ids 0..255 are the bytes

TEST(ServerResponse, LogprobShapes) {
  const model::Tokenizer& tok = byte_tokenizer();
  const std::vector<runtime::TokenLogprobs> lps = {{'a', std::numeric_limits<float>::quiet_NaN(), {}},
                                                   {'b', -0.5f, {{'c', -0.25f}}}};
  EXPECT_EQ(dump_json(logprobs_json(Endpoint::Chat, tok, std::span(lps).subspan(1), nullptr)),
            R"({"content":[{"bytes":[98],"logprob":-0.5,"token":"b","top_logprobs":[{"bytes":[99],"logprob":-0.25,"token":"c"}]}],"refusal":null})");
  int64_t offset = 3;
  EXPECT_EQ(dump_json(logprobs_json(Endpoint::Completion, tok, lps, &offset)),
            R"({"text_offset":[3,4],"token_logprobs":[null,-0.5],"tokens":["a","b"],"top_logprobs":[null,{"b":-0.5,"c":-0.25}]})");
  EXPECT_EQ(offset, 5);
  const AnswerHeader text{Endpoint::Completion, answer_id(Endpoint::Completion, 1), 1, "m"};
  const nlohmann::json two = answer_json(text, {{"x", "stop", nullptr}, {"y", "length", {{"tokens", {"y"}}}}}, {2, 2});
  EXPECT_EQ(dump_json(two["choices"]),
            R"([{"finish_reason":"stop","index":0,"logprobs":null,"text":"x"},{"finish_reason":"length","index":1,"logprobs":{"tokens":["y"]},"text":"y"}])");
}

// The echo's prompt log-probabilities (EngineSlot::prompt_logprobs, pieces of 64 rows and then more) equal the
// perplexity path (Engine::score) row for row, past a piece's end, and their top tokens the argmax of every row.
TEST(ServerLogprobs, PromptLogprobsEqualScore) {
  const auto model = runtime::Model::load(
      (std::filesystem::path(__FILE__).parent_path().parent_path() / "data" / "hf_tiny" / "llama3").string());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 150; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + 11) % 256));
  EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions> slot(*model, runtime::EngineOptions{});
  const std::vector<runtime::TokenLogprobs> got = slot.prompt_logprobs(prompt, 2, attn::AttentionPolicy{}, {});
  runtime::Engine ref(*model);
  const std::vector<double> want = ref.score(prompt);
  ASSERT_EQ(got.size(), want.size());
  runtime::Engine all(*model);
  const std::vector<float> logits = all.forward_all_logits(prompt);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token, prompt[i + 1]);
    EXPECT_NEAR(got[i].logprob, want[i], 1e-4) << i;
    ASSERT_EQ(got[i].top.size(), 2u);
    EXPECT_EQ(got[i].top[0].token, runtime::argmax(std::span<const float>(logits).subspan(i * 256, 256))) << i;
  }
  EXPECT_TRUE(slot.prompt_logprobs(prompt, 1, attn::AttentionPolicy{}, [] { return true; }).empty());  // aborted
}

TEST(ServerMetrics, PrometheusText) {
  Histogram h({0.1, 1});
  h.observe(0.05);
  h.observe(0.1);
  h.observe(5);
  std::string out;
  h.render(out, "x");
  EXPECT_EQ(out, "x_bucket{le=\"0.1\"} 2\nx_bucket{le=\"1\"} 2\nx_bucket{le=\"+Inf\"} 3\nx_sum 5.15\nx_count 3\n");
  out.clear();
  h.render(out, "x", "kind=\"a\"");
  EXPECT_EQ(out, "x_bucket{kind=\"a\",le=\"0.1\"} 2\nx_bucket{kind=\"a\",le=\"1\"} 2\nx_bucket{kind=\"a\",le=\"+Inf\"} 3\n"
                 "x_sum{kind=\"a\"} 5.15\nx_count{kind=\"a\"} 3\n");
  {  // the batched engine's step histograms appear once a step is observed
    Metrics steps;
    EXPECT_EQ(steps.prometheus({}).find("tessera_engine_step_seconds"), std::string::npos);
    steps.observe_step(0.0012, false, 0.0001);
    steps.observe_step(0.0042, true, 0.0003);
    steps.observe_step(0.0013, false, 0.0002);
    const std::string t = steps.prometheus({});
    for (const char* line : {"tessera_engine_step_seconds_bucket{kind=\"decode\",le=\"0.0015\"} 2\n",
                             "tessera_engine_step_seconds_count{kind=\"decode\"} 2\n",
                             "tessera_engine_step_seconds_bucket{kind=\"prefill\",le=\"0.004\"} 0\n",
                             "tessera_engine_step_seconds_bucket{kind=\"prefill\",le=\"0.005\"} 1\n",
                             "tessera_engine_step_seconds_count{kind=\"prefill\"} 1\n",
                             "tessera_scheduler_step_seconds_bucket{le=\"0.00025\"} 2\n",
                             "tessera_scheduler_step_seconds_count 3\n"})
      EXPECT_NE(t.find(line), std::string::npos) << line << "\n" << t;
  }
  Metrics m;
  m.count_request("/v1/completions", 200);
  m.count_request("/v1/completions", 200);
  m.add_tokens(10, 3);
  const std::string text = m.prometheus({.queued = 2, .running = 1, .slots = 1, .kv_tokens = 13, .kv_bytes = 4096,
                                         .prompt_cache_hits = 3, .prompt_cache_bytes_reused = 5000,
                                         .prompt_cache_bytes = 7000});
  for (const char* line : {"tessera_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n",
                           "tessera_prompt_tokens_total 10\n", "tessera_generation_tokens_total 3\n",
                           "tessera_queue_depth 2\n", "tessera_kv_cache_tokens 13\n", "tessera_kv_cache_bytes 4096\n",
                           "tessera_prompt_cache_hits_total 3\n", "tessera_prompt_cache_reused_bytes_total 5000\n",
                           "tessera_prompt_cache_bytes 7000\n",
                           "# TYPE tessera_time_to_first_token_seconds histogram\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line;
}

TEST(ServerPolicies, PresetsPlansAndNoPaths) {
  const attn::PolicyShape shape{4, 2, 1};
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_server_policies_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  attn::save_policy_file(attn::policy_from_spec("ashape:sink=4,local=8", shape), dir / "short.json");
  PolicyCache cache(shape, "dense", dir.string());
  EXPECT_TRUE(cache.get("")->table().empty());  // the default: dense
  EXPECT_EQ(cache.get("vs").get(), cache.get("vs").get());  // built once
  EXPECT_EQ(cache.get("short")->table(), attn::policy_from_spec("ashape:sink=4,local=8", shape).table());
  // The adaptive presets are presets, not plan names.
  EXPECT_EQ(cache.get("vs_adaptive:gamma=0.95")->table(),
            attn::policy_from_spec("vs_adaptive:gamma=0.95", shape).table());
  EXPECT_EQ(cache.get("bs_adaptive")->table(), attn::policy_from_spec("bs_adaptive", shape).table());
  auto error = [&](const std::string& spec) {
    try {
      (void)cache.get(spec);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param(), "tessera.attn");
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error((dir / "short.json").string()),
            "'tessera.attn' is '" + (dir / "short.json").string() +
                "': not a preset (dense, ashape, triangle, vs, vs_adaptive, minference, bs, bs_adaptive, moa, "
                "trianglemix) nor a plan name (letters, digits, '.', '_', '-'); requests cannot name file paths");
  EXPECT_EQ(error("long"), "'tessera.attn' is 'long': no such preset, and no plan long or long.json in the server's "
                           "--policy-dir");
  EXPECT_EQ(error("bs:top_k=0"), "'tessera.attn': attention spec 'bs:top_k=0': parameter 'top_k' must be >= 1, got 0");
  std::filesystem::remove_all(dir);
  EXPECT_THROW(PolicyCache(shape, "vs:x=1", ""), Error);  // the server's own spec is checked at start
}

// serve --stream: requests run dense attention within streaming memory; naming another policy is a 400.
TEST(ServerPolicies, OnlyDenseWhenStreaming) {
  PolicyCache cache({4, 2, 1}, "dense", "");
  EXPECT_EQ(cache.default_label(), "dense");
  cache.only_dense("this server streams every request (--stream ltri)", "stream:ltri");
  EXPECT_EQ(cache.default_label(), "stream:ltri");
  EXPECT_TRUE(cache.get("")->table().empty());
  EXPECT_TRUE(cache.get("dense")->table().empty());
  try {
    (void)cache.get("vs");
    ADD_FAILURE() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param(), "tessera.attn");
    EXPECT_EQ(std::string(e.what()), "'tessera.attn' is 'vs': this server streams every request (--stream ltri)");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The scheduler over a scripted engine

// A vocabulary of the 256 bytes (ids 0..255) and an end token (256).
const model::Tokenizer& byte_tokenizer() {
  static const model::Tokenizer tok = [] {
    model::TokenizerData d;
    d.kind = model::TokenizerKind::ByteLevelBPE;
    for (int b = 0; b < 256; ++b) d.tokens.push_back(model::byte_level::spell(std::string(1, static_cast<char>(b))));
    d.tokens.push_back("<eos>");
    d.types.assign(256, model::TokenType::Normal);
    d.types.push_back(model::TokenType::Control);
    d.special.eos = 256;
    d.special.end_of_generation = {256};
    return model::Tokenizer(std::move(d));
  }();
  return tok;
}

// Generates the bytes of `script` (then the end token), one every `delay`, like generate_tokens does.
class ScriptedSlot final : public SlotEngine {
 public:
  ScriptedSlot(std::string script, std::chrono::milliseconds delay, bool fail = false, int prefill_chunks = 1)
      : script_(std::move(script)), delay_(delay), fail_(fail), prefill_chunks_(prefill_chunks) {}
  std::vector<int32_t> generate(std::span<const int32_t> prompt, const runtime::GenerateOptions& options,
                                const attn::AttentionPolicy&, const std::function<bool(int32_t)>& on_token,
                                const std::function<bool()>& abort) override {
    if (fail_) throw Error("prefill: out of scripted memory");
    kv_tokens_ = static_cast<int64_t>(prompt.size());
    kv_bytes_ = 1000;
    for (int chunk = 0; chunk < prefill_chunks_; ++chunk) {  // a prefill in chunks, asking abort after each
      std::this_thread::sleep_for(delay_);
      if (abort()) {
        kv_tokens_ = 0;
        kv_bytes_ = 0;
        return {};
      }
    }
    std::vector<int32_t> out;
    for (const char ch : script_) {
      std::this_thread::sleep_for(delay_);
      const int32_t tok = static_cast<unsigned char>(ch);
      out.push_back(tok);
      ++kv_tokens_;
      if (!on_token(tok) || static_cast<int32_t>(out.size()) >= options.max_new_tokens) break;
    }
    kv_tokens_ = 0;
    kv_bytes_ = 0;
    return out;
  }

 private:
  std::string script_;
  std::chrono::milliseconds delay_;
  bool fail_;
  int prefill_chunks_;
};

struct Fixture {
  Metrics metrics;
  std::unique_ptr<Scheduler> scheduler;
  Fixture(int slots, int queue, std::string script, std::chrono::milliseconds delay = 1ms, bool fail = false,
          int prefill_chunks = 1) {
    scheduler = std::make_unique<Scheduler>(
        SchedulerOptions{slots, queue},
        [=](int, int) { return std::make_unique<ScriptedSlot>(script, delay, fail, prefill_chunks); },
        byte_tokenizer(), metrics);
  }
};

std::shared_ptr<Job> job(int32_t max_tokens, std::vector<std::string> stop = {},
                         std::chrono::milliseconds timeout = 60s) {
  PreparedRequest p;
  p.prompt = {104, 105};
  p.gen.max_new_tokens = max_tokens;
  p.gen.stop_tokens = {256};
  p.stop = std::move(stop);
  return std::make_shared<Job>(std::move(p), std::make_shared<const attn::AttentionPolicy>(), Clock::now() + timeout);
}

std::string drain(Job& j) {
  std::string text;
  while (!j.wait(text, 50ms)) {
  }
  return text;
}

TEST(ServerScheduler, FinishReasonsAndText) {
  Fixture f(1, 4, "Hello, world");
  auto a = job(100);
  ASSERT_EQ(f.scheduler->submit(a), Admission::Accepted);
  EXPECT_EQ(drain(*a), "Hello, world");
  EXPECT_EQ(a->result().reason, FinishReason::Stop);  // the script ran out: as an end token
  EXPECT_EQ(a->result().completion_tokens, 12);
  EXPECT_EQ(a->result().prompt_tokens, 2);
  EXPECT_GE(a->result().ttft_seconds, 0);
  auto b = job(5);
  ASSERT_EQ(f.scheduler->submit(b), Admission::Accepted);
  EXPECT_EQ(drain(*b), "Hello");
  EXPECT_EQ(b->result().reason, FinishReason::Length);
  auto c = job(100, {"o, w"});  // a stop sequence across tokens: cut before it, its tokens counted
  ASSERT_EQ(f.scheduler->submit(c), Admission::Accepted);
  EXPECT_EQ(drain(*c), "Hell");
  EXPECT_EQ(c->result().reason, FinishReason::Stop);
  EXPECT_EQ(c->result().completion_tokens, 8);
  const std::string m = f.metrics.prometheus(f.scheduler->gauges());
  EXPECT_NE(m.find("tessera_generation_tokens_total 25\n"), std::string::npos) << m;
  EXPECT_NE(m.find("tessera_time_to_first_token_seconds_count 3\n"), std::string::npos) << m;
  EXPECT_NE(m.find("tessera_inter_token_latency_seconds_count 22\n"), std::string::npos) << m;
}

TEST(ServerScheduler, BoundedQueueAndCancellation) {
  Fixture f(1, 2, std::string(400, 'x'), 5ms);
  auto running = job(400), q1 = job(400), q2 = job(400), over = job(400);
  ASSERT_EQ(f.scheduler->submit(running), Admission::Accepted);
  std::string text;
  while (text.empty()) running->wait(text, 50ms);  // it is on the slot
  ASSERT_EQ(f.scheduler->submit(q1), Admission::Accepted);
  ASSERT_EQ(f.scheduler->submit(q2), Admission::Accepted);
  EXPECT_EQ(f.scheduler->submit(over), Admission::QueueFull);
  Gauges g = f.scheduler->gauges();
  EXPECT_EQ(g.running, 1);
  EXPECT_EQ(g.queued, 2);
  EXPECT_GT(g.kv_tokens, 0);
  EXPECT_EQ(g.kv_bytes, 1000);
  f.scheduler->cancel(q1);  // a queued job ends at once
  EXPECT_TRUE(q1->wait(text, 0ms));
  EXPECT_EQ(q1->result().reason, FinishReason::Cancelled);
  EXPECT_EQ(f.scheduler->gauges().queued, 1);
  f.scheduler->cancel(running);  // a running one at its next token
  drain(*running);
  EXPECT_EQ(running->result().reason, FinishReason::Cancelled);
  EXPECT_LT(running->result().completion_tokens, 400);
  f.scheduler->cancel(q2);
  drain(*q2);
  for (int i = 0; i < 100 && f.scheduler->gauges().running > 0; ++i) std::this_thread::sleep_for(10ms);
  g = f.scheduler->gauges();
  EXPECT_EQ(g.running + g.queued + g.kv_tokens + g.kv_bytes, 0);
  EXPECT_NE(f.metrics.prometheus(g).find("tessera_requests_cancelled_total 3\n"), std::string::npos);
}

TEST(ServerScheduler, TimeoutsAndEngineErrors) {
  Fixture f(1, 4, std::string(1000, 'y'), 2ms);
  auto slow = job(1000, {}, 50ms);
  ASSERT_EQ(f.scheduler->submit(slow), Admission::Accepted);
  drain(*slow);
  EXPECT_EQ(slow->result().reason, FinishReason::Timeout);
  EXPECT_LT(slow->result().completion_tokens, 1000);
  auto expired = job(10, {}, -1ms);  // its deadline passed while it waited: never runs
  ASSERT_EQ(f.scheduler->submit(expired), Admission::Accepted);
  drain(*expired);
  EXPECT_EQ(expired->result().reason, FinishReason::Timeout);
  EXPECT_EQ(expired->result().completion_tokens, 0);

  Fixture broken(1, 1, "z", 1ms, /*fail=*/true);
  auto j = job(3);
  ASSERT_EQ(broken.scheduler->submit(j), Admission::Accepted);
  drain(*j);
  EXPECT_EQ(j->result().reason, FinishReason::Error);
  EXPECT_EQ(j->result().error, "prefill: out of scripted memory");
}

TEST(ServerScheduler, CancelAndTimeoutStopAPrefill) {
  Fixture f(1, 1, "abc", 5ms, false, /*prefill_chunks=*/1000);  // a 5 s prefill
  auto a = job(3);
  ASSERT_EQ(f.scheduler->submit(a), Admission::Accepted);
  while (f.scheduler->gauges().kv_tokens == 0) std::this_thread::sleep_for(1ms);  // it is prefilling
  const auto t0 = Clock::now();
  f.scheduler->cancel(a);
  EXPECT_EQ(drain(*a), "");
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_EQ(a->result().reason, FinishReason::Cancelled);
  EXPECT_EQ(a->result().completion_tokens, 0);
  auto b = job(3, {}, 100ms);
  ASSERT_EQ(f.scheduler->submit(b), Admission::Accepted);
  drain(*b);
  EXPECT_EQ(b->result().reason, FinishReason::Timeout);
  EXPECT_LT(b->result().total_seconds, 1.0);
  EXPECT_EQ(f.scheduler->gauges().kv_bytes, 0);
}

TEST(ServerScheduler, ShutdownEndsEverything) {
  Fixture f(1, 4, std::string(10000, 'z'), 1ms);
  auto a = job(10000), b = job(10000);
  ASSERT_EQ(f.scheduler->submit(a), Admission::Accepted);
  ASSERT_EQ(f.scheduler->submit(b), Admission::Accepted);
  f.scheduler->shutdown();
  drain(*a);
  drain(*b);
  EXPECT_EQ(a->result().reason, FinishReason::Cancelled);
  EXPECT_EQ(b->result().reason, FinishReason::Cancelled);
  EXPECT_EQ(f.scheduler->submit(job(1)), Admission::ShuttingDown);
}

// ---------------------------------------------------------------------------------------------------------------
// The scheduler over the real CPU engine

TEST(ServerScheduler, RealEngineAnswersAsEngineGenerate) {
  REQUIRE_REAL_MODEL();
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Chat, R"({"model": "smollm2", "temperature": 0, "max_tokens": 12,
                                           "messages": [{"role": "user", "content": "What is 2+2?"}]})"),
      rm->served, 0);
  runtime::Engine engine(*rm->model);
  const std::vector<int32_t> ids = engine.generate(p.prompt, p.gen);
  const std::string want = rm->tokenizer->decode(ids, {.skip_special = true});

  Metrics metrics;
  runtime::EngineOptions eo;
  eo.chunk_size = 16;  // several prefill chunks
  Scheduler sched({.slots = 2, .queue = 2}, cpu_slot_factory(*rm->model, eo), *rm->tokenizer, metrics);
  auto a = std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s);
  auto b = std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s);
  ASSERT_EQ(sched.submit(a), Admission::Accepted);
  ASSERT_EQ(sched.submit(b), Admission::Accepted);  // both slots at once, each with its own thread pool
  EXPECT_EQ(drain(*a), want);
  EXPECT_EQ(drain(*b), want);
  EXPECT_EQ(a->result().completion_tokens, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(a->result().reason, static_cast<int32_t>(ids.size()) == 12 ? FinishReason::Length : FinishReason::Stop);
  const Gauges g = sched.gauges();
  EXPECT_EQ(g.kv_tokens + g.kv_bytes, 0);  // the engines, and their caches, went with the requests
}

// serve --stream: the context the server states is the longest sequence whose evicted blocks fit the host budget
// (f32 blocks on the CPU, bf16 on the GPU), and its slots answer as the streaming engine does, several at once.
runtime::StreamOptions small_stream(int64_t host_budget) {
  runtime::StreamOptions o;
  o.method = runtime::StreamMethod::Ltri;
  o.sinks = 16;
  o.local = 64;
  o.block = 16;
  o.top_k = 2;
  o.chunk = 32;
  o.last_chunk = 16;
  o.host_budget = host_budget;
  return o;
}

TEST(ServerStreaming, ContextIsWhatTheHostBudgetHolds) {
  REQUIRE_REAL_MODEL();
  const runtime::ModelConfig& c = rm->model->config();  // 30 layers, 3 kv heads of 64
  // One evicted block of 16 tokens, all 30 layers, K and V: 16 * 3 * 64 * 2 values = 737,280 B in f32.
  // 2 MiB holds 2 of them; a sequence evicts (n - 16 - 64) / 16 blocks: the longest is 80 + 3 * 16 - 1 = 127.
  const runtime::StreamOptions o = small_stream(2 << 20);
  using Storage = runtime::StreamingKV::Storage;
  EXPECT_EQ(streaming_context_limit(c, o, Storage::Host, 1 << 30), 127);
  // bf16 blocks (the GPU's pinned memory): 5 fit, so 80 + 6 * 16 - 1 = 175.
  EXPECT_EQ(streaming_context_limit(c, o, Storage::Device, 1 << 30), 175);
  EXPECT_EQ(streaming_context_limit(c, o, Storage::Host, 100), 100);  // --max-context below the budget's bound
  const runtime::StreamingKV probe(c, o, Storage::Host);
  EXPECT_NO_THROW(probe.check_sequence(127));
  EXPECT_THROW(probe.check_sequence(128), Error);
  EXPECT_EQ(describe_streaming(o, 2 << 20),
            "ltri (sinks 16, local 64, chunk 32, blocks of 16, top 2; host budget 2.10 MB)");
  // streamingllm keeps no evicted block: the budget sets no context.
  runtime::StreamOptions sl = o;
  sl.method = runtime::StreamMethod::StreamingLLM;
  EXPECT_EQ(streaming_context_limit(c, sl, Storage::Host, 1 << 30), 1 << 30);
  EXPECT_EQ(streaming_context_limit(c, sl, Storage::Device, 1 << 30), 1 << 30);
  EXPECT_EQ(describe_streaming(sl, 2 << 20),
            "streamingllm (sinks 16, local 64, chunk 32, blocks of 16; evicted blocks dropped: no host memory)");
}

TEST(ServerStreaming, SlotsAnswerAsTheStreamingEngine) {
  REQUIRE_REAL_MODEL();
  std::string text;
  for (int i = 0; i < 10; ++i) text += "The quick brown fox jumps over the lazy dog. ";
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Completion,
                        R"({"model": "smollm2", "temperature": 0, "max_tokens": 8, "prompt": ")" + text + R"("})"),
      rm->served, 0);
  ASSERT_GT(p.prompt.size(), 96u);  // past sinks + local + one block: blocks are evicted and retrieved
  runtime::EngineOptions eo;
  eo.stream = small_stream(64 << 20);
  runtime::Engine engine(*rm->model, eo);
  const std::vector<int32_t> ids = engine.generate(p.prompt, p.gen);
  ASSERT_GT(engine.streaming()->evicted_blocks(), 0);
  const std::string want = rm->tokenizer->decode(ids, {.skip_special = true});

  Metrics metrics;
  Scheduler sched({.slots = 2, .queue = 2}, cpu_slot_factory(*rm->model, eo), *rm->tokenizer, metrics);
  auto a = std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s);
  auto b = std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s);
  ASSERT_EQ(sched.submit(a), Admission::Accepted);
  ASSERT_EQ(sched.submit(b), Admission::Accepted);  // two streaming engines at once
  EXPECT_EQ(drain(*a), want);
  EXPECT_EQ(drain(*b), want);
  EXPECT_EQ(a->result().completion_tokens, static_cast<int64_t>(ids.size()));
  const Gauges g = sched.gauges();
  EXPECT_EQ(g.kv_tokens + g.kv_bytes, 0);
}

// A slot keeps one engine between requests (resetting it); with streaming memory the pinned slabs and the
// streaming buffers are made once: every answer still equals a fresh streaming engine's, after an aborted request
// too, and a failed request (over the host budget: the exact error) leaves no engine behind to reuse.
TEST(ServerStreaming, SlotKeepsItsEngineBetweenRequests) {
  REQUIRE_REAL_MODEL();
  const auto request = [rm](const std::string& text) {
    return prepare_request(
        parse_api_request(Endpoint::Completion,
                          R"({"model": "smollm2", "temperature": 0, "max_tokens": 8, "prompt": ")" + text + R"("})"),
        rm->served, 0);
  };
  std::string fox, lorem, long_text;
  for (int i = 0; i < 10; ++i) fox += "The quick brown fox jumps over the lazy dog. ";
  for (int i = 0; i < 5; ++i) lorem += "Lorem ipsum dolor sit amet, consectetur adipiscing elit. ";
  for (int i = 0; i < 30; ++i) long_text += "The quick brown fox jumps over the lazy dog. ";
  const PreparedRequest a = request(fox), b = request(lorem), over = request(long_text);
  ASSERT_GT(a.prompt.size(), 96u);  // both evict blocks and retrieve them
  ASSERT_GT(b.prompt.size(), 96u);
  runtime::EngineOptions eo;
  eo.stream = small_stream(2 << 20);  // holds 127 tokens (ContextIsWhatTheHostBudgetHolds)
  ASSERT_LE(a.prompt.size() + 8, 127u);
  ASSERT_LE(b.prompt.size() + 8, 127u);
  ASSERT_GT(over.prompt.size(), 127u);
  const auto fresh = [&](const PreparedRequest& p) {
    runtime::Engine engine(*rm->model, eo);
    return engine.generate(p.prompt, p.gen);
  };
  const std::vector<int32_t> want_a = fresh(a), want_b = fresh(b);
  ASSERT_NE(want_a, want_b);

  EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions> slot(*rm->model, eo);
  const attn::AttentionPolicy dense;
  const auto on_token = [](int32_t) { return true; };
  const std::function<bool()> no_abort;
  EXPECT_EQ(slot.generate(a.prompt, a.gen, dense, on_token, no_abort), want_a);
  EXPECT_EQ(slot.generate(b.prompt, b.gen, dense, on_token, no_abort), want_b);
  EXPECT_EQ(slot.generate(a.prompt, a.gen, dense, on_token, no_abort), want_a);
  EXPECT_EQ(slot.engines_made(), 1);
  int asked = 0;  // aborted after its second prefill chunk: an empty answer, then the next request is whole
  const std::function<bool()> abort_second = [&asked] { return ++asked >= 2; };
  EXPECT_TRUE(slot.generate(b.prompt, b.gen, dense, on_token, abort_second).empty());
  EXPECT_EQ(slot.generate(b.prompt, b.gen, dense, on_token, no_abort), want_b);
  EXPECT_EQ(slot.engines_made(), 1);
  try {
    slot.generate(over.prompt, over.gen, dense, on_token, no_abort);
    ADD_FAILURE() << "a prompt over the host budget streamed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("over the budget of 2.10 MB for evicted KV blocks"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(slot.generate(a.prompt, a.gen, dense, on_token, no_abort), want_a);
  EXPECT_EQ(slot.engines_made(), 2);  // the failed request's engine was dropped
  EXPECT_EQ(slot.kv_tokens() + slot.kv_bytes(), 0);

  // Without streaming: the kept engine serves every request of its policy (its KV pool made once), reset between
  // them, with the answers of a fresh engine; another policy gets a new engine, and back again another.
  runtime::EngineOptions plain;
  const auto fresh_plain = [&](const PreparedRequest& p, const attn::AttentionPolicy& policy) {
    runtime::EngineOptions o = plain;
    o.policy = policy;
    runtime::Engine engine(*rm->model, o);
    return engine.generate(p.prompt, p.gen);
  };
  const runtime::ModelConfig& c = rm->model->config();
  const attn::AttentionPolicy ashape =
      attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 32});
  EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions> dense_slot(*rm->model, plain);
  EXPECT_EQ(dense_slot.generate(a.prompt, a.gen, dense, on_token, no_abort), fresh_plain(a, dense));
  EXPECT_EQ(dense_slot.generate(b.prompt, b.gen, dense, on_token, no_abort), fresh_plain(b, dense));
  EXPECT_EQ(dense_slot.engines_made(), 1);
  EXPECT_EQ(dense_slot.generate(b.prompt, b.gen, ashape, on_token, no_abort), fresh_plain(b, ashape));
  EXPECT_EQ(dense_slot.engines_made(), 2);
  EXPECT_EQ(dense_slot.generate(a.prompt, a.gen, dense, on_token, no_abort), fresh_plain(a, dense));
  EXPECT_EQ(dense_slot.engines_made(), 3);
  EXPECT_EQ(dense_slot.kv_tokens() + dense_slot.kv_bytes(), 0);
}

// The scheduler over the batched engine (tessera serve --parallel N > 1): every request answers as the
// single-sequence engine would, several at once; a cancelled one ends and every KV block comes back.
TEST(ServerScheduler, BatchedEngineAnswersAsEngineGenerate) {
  REQUIRE_REAL_MODEL();
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Chat, R"({"model": "smollm2", "temperature": 0, "max_tokens": 12,
                                           "messages": [{"role": "user", "content": "What is 2+2?"}]})"),
      rm->served, 0);
  runtime::Engine engine(*rm->model);
  const std::vector<int32_t> ids = engine.generate(p.prompt, p.gen);
  const std::string want = rm->tokenizer->decode(ids, {.skip_special = true});

  Metrics metrics;
  BatchedEngine batched;
  batched.backend = std::make_unique<runtime::CpuBatchBackend>(*rm->model);
  runtime::BatchEngineOptions bo;
  bo.chunk_size = 16;  // several prefill chunks, between the others' decode steps
  bo.max_batch = 3;
  bo.kv_bytes = 64e6;
  batched.engine = std::make_unique<runtime::BatchEngine>(*batched.backend, bo);
  const runtime::BatchEngine* eng = batched.engine.get();
  Scheduler sched({.slots = 3, .queue = 4}, std::move(batched), *rm->tokenizer, metrics);
  std::vector<std::shared_ptr<Job>> jobs;
  for (int i = 0; i < 4; ++i) {
    jobs.push_back(std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s));
    ASSERT_EQ(sched.submit(jobs.back()), Admission::Accepted);
  }
  sched.cancel(jobs[3]);  // queued or just admitted: it ends, cancelled
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(drain(*jobs[static_cast<size_t>(i)]), want) << i;
    EXPECT_EQ(jobs[static_cast<size_t>(i)]->result().completion_tokens, static_cast<int64_t>(ids.size()));
    EXPECT_EQ(jobs[static_cast<size_t>(i)]->result().reason,
              static_cast<int32_t>(ids.size()) == 12 ? FinishReason::Length : FinishReason::Stop);
  }
  drain(*jobs[3]);
  EXPECT_EQ(jobs[3]->result().reason, FinishReason::Cancelled);
  for (int i = 0; i < 100 && sched.gauges().running > 0; ++i) std::this_thread::sleep_for(10ms);
  const Gauges g = sched.gauges();
  EXPECT_EQ(g.running + g.queued + g.kv_tokens + g.kv_bytes, 0);
  EXPECT_EQ(eng->blocks().used(), eng->prefix_cache().ids_held());  // only the prefix cache holds blocks
  // The engine's counters, as /metrics shows them: every answer's tokens but the first (the prefill's) decoded.
  EXPECT_TRUE(g.batched);
  EXPECT_EQ(g.decode_tokens, eng->stats().decode_tokens);
  EXPECT_GE(g.decode_tokens, 3 * (static_cast<int64_t>(ids.size()) - 1));
  EXPECT_GT(g.decode_steps, 0);
  EXPECT_GT(g.engine_steps, g.decode_steps);  // the prefill chunks of 16 tokens took steps of their own
  EXPECT_EQ(g.step_builds, 0);                // the CPU builds no graphs
  EXPECT_EQ(eng->stats().greedy_tokens, eng->stats().decode_tokens);  // temperature 0: the backend picks
  const std::string text = metrics.prometheus(g);
  EXPECT_NE(text.find("tessera_engine_decode_tokens_total " + std::to_string(g.decode_tokens) + "\n"),
            std::string::npos);
  EXPECT_NE(text.find("tessera_engine_step_builds_total 0\n"), std::string::npos);
  // Every engine step in the step histograms, split by whether it ran a prefill chunk.
  const auto count_of = [&](const std::string& key) {
    const size_t at = text.find(key);
    return at == std::string::npos ? int64_t{-1} : std::stoll(text.substr(at + key.size()));
  };
  const int64_t decode_only = count_of("tessera_engine_step_seconds_count{kind=\"decode\"} ");
  const int64_t with_prefill = count_of("tessera_engine_step_seconds_count{kind=\"prefill\"} ");
  EXPECT_EQ(decode_only + with_prefill, g.engine_steps) << text;
  EXPECT_GE(with_prefill, 3);  // at least one chunk for each answered prompt
  EXPECT_EQ(count_of("tessera_scheduler_step_seconds_count "), g.engine_steps);
}

// Prefix caching behind the scheduler: the second turn of the same long prompt prefills only its last block's
// tokens, answers as the first, and says so in its result (usage.prompt_tokens_details.cached_tokens) and /metrics.
TEST(ServerScheduler, BatchedEngineReportsCachedPromptTokens) {
  REQUIRE_REAL_MODEL();
  std::string doc;
  for (int i = 0; i < 30; ++i) doc += "The archive keeps room " + std::to_string(i) + " locked. ";
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Chat, R"({"model": "smollm2", "temperature": 0, "max_tokens": 6,
                                           "messages": [{"role": "user", "content": ")" + doc + R"("}]})"),
      rm->served, 0);
  ASSERT_GT(p.prompt.size(), 200u);
  Metrics metrics;
  BatchedEngine batched;
  batched.backend = std::make_unique<runtime::CpuBatchBackend>(*rm->model);
  runtime::BatchEngineOptions bo;
  bo.chunk_size = 64;
  bo.max_batch = 2;
  bo.kv_bytes = 64e6;
  batched.engine = std::make_unique<runtime::BatchEngine>(*batched.backend, bo);
  Scheduler sched({.slots = 2, .queue = 4}, std::move(batched), *rm->tokenizer, metrics);
  std::vector<std::string> answers;
  std::vector<int64_t> cached;
  for (int turn = 0; turn < 2; ++turn) {
    auto job = std::make_shared<Job>(p, std::make_shared<const attn::AttentionPolicy>(), Clock::now() + 120s);
    ASSERT_EQ(sched.submit(job), Admission::Accepted);
    answers.push_back(drain(*job));
    cached.push_back(job->result().cached_tokens);
  }
  EXPECT_EQ(answers[1], answers[0]);
  EXPECT_EQ(cached, (std::vector<int64_t>{0, static_cast<int64_t>((p.prompt.size() - 1) / 64 * 64)}));
  // (the scheduler's thread copies the engine's counters after the step that ended the job)
  for (int i = 0; i < 100 && sched.gauges().prefix_cache_bytes == 0; ++i) std::this_thread::sleep_for(10ms);
  const Gauges g = sched.gauges();
  EXPECT_EQ(g.prefix_hits, 1);
  EXPECT_EQ(g.prefix_cached_tokens, cached[1]);
  EXPECT_GT(g.prefix_cache_bytes, 0);
  const std::string text = metrics.prometheus(g);
  EXPECT_NE(text.find("tessera_prefix_cache_hits_total 1\n"), std::string::npos);
  EXPECT_NE(text.find("tessera_prefix_cache_tokens_total " + std::to_string(cached[1]) + "\n"), std::string::npos);
  const json usage = usage_json({static_cast<int64_t>(p.prompt.size()), 6, cached[1]});
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], cached[1]);
}

// Echo with logprobs on the batched engine (lm-evaluation-harness's log-likelihood request: max_tokens 0, and one
// with a completion after the echo): the prompt's text and log-probabilities, from the batched prefill, equal the
// single-slot engine's (EngineSlot::prompt_logprobs) within the Q4_1 rounding of other row counts, beside another
// request, under a token budget; no generated token is reported for max_tokens 0.
TEST(ServerScheduler, BatchedEchoLogprobsEqualTheSlot) {
  REQUIRE_REAL_MODEL();
  const PreparedRequest p = prepare_request(
      parse_api_request(Endpoint::Completion, R"({"model": "smollm2", "temperature": 0, "max_tokens": 0,
                        "echo": true, "logprobs": 2, "prompt": "The capital of France is Paris, and the capital of Italy is Rome."})"),
      rm->served, 0);
  ASSERT_TRUE(p.echo);
  EngineSlot<runtime::Engine, runtime::Model, runtime::EngineOptions> slot(*rm->model, runtime::EngineOptions{});
  const std::vector<runtime::TokenLogprobs> want = slot.prompt_logprobs(p.prompt, 2, attn::AttentionPolicy{}, {});
  ASSERT_EQ(want.size(), p.prompt.size() - 1);
  Metrics metrics;
  BatchedEngine batched;
  batched.backend = std::make_unique<runtime::CpuBatchBackend>(*rm->model);
  runtime::BatchEngineOptions bo;
  bo.chunk_size = 16;
  bo.max_batch = 2;
  bo.step_tokens = 12;
  bo.kv_bytes = 64e6;
  batched.engine = std::make_unique<runtime::BatchEngine>(*batched.backend, bo);
  Scheduler sched({.slots = 2, .queue = 4}, std::move(batched), *rm->tokenizer, metrics);
  EXPECT_TRUE(sched.prompt_logprobs());
  PreparedRequest with_answer = p;
  with_answer.gen.max_new_tokens = 3;
  const auto policy = std::make_shared<const attn::AttentionPolicy>();
  auto a = std::make_shared<Job>(p, policy, Clock::now() + 120s);
  auto b = std::make_shared<Job>(with_answer, policy, Clock::now() + 120s);
  ASSERT_EQ(sched.submit(b), Admission::Accepted);
  ASSERT_EQ(sched.submit(a), Admission::Accepted);
  for (auto* j : {a.get(), b.get()}) {
    std::string text;
    std::vector<runtime::TokenLogprobs> lp;
    while (!j->wait(text, &lp, 50ms)) {
    }
    const bool answer = j == b.get();
    EXPECT_EQ(j->result().reason, FinishReason::Length);
    EXPECT_EQ(j->result().completion_tokens, answer ? 3 : 0);
    EXPECT_EQ(text.substr(0, p.echo_text.size()), p.echo_text);
    if (!answer) {
      EXPECT_EQ(text, p.echo_text);
    }
    ASSERT_EQ(lp.size(), p.prompt.size() + (answer ? 3 : 0)) << answer;
    EXPECT_EQ(lp[0].token, p.prompt[0]);
    EXPECT_TRUE(std::isnan(lp[0].logprob));  // nothing predicts the first token
    for (size_t i = 1; i < p.prompt.size(); ++i) {
      EXPECT_EQ(lp[i].token, want[i - 1].token) << i;
      EXPECT_NEAR(lp[i].logprob, want[i - 1].logprob, 0.15) << i;
      ASSERT_EQ(lp[i].top.size(), 2u) << i;
      EXPECT_NEAR(lp[i].top[0].logprob, want[i - 1].top[0].logprob, 0.15) << i;
    }
  }
}

}  // namespace
}  // namespace tessera::server
