// tessera/server/structured_output.h — response_format and tools (issue 34) on the grammar library
// (runtime/grammar.h, XGrammar).
//
// A request's structured output becomes a grammar the sampler follows (a token mask each step):
//   response_format json_object          any JSON object
//   response_format json_schema          JSON valid under json_schema.schema
//   tools + tool_choice "required"       {"name": <one of the tools>, "arguments": <its parameters' schema>}
//   tools + tool_choice {function: name} {"name": "<name>", "arguments": <its parameters' schema>}
//   tools + tool_choice "auto"           no grammar: the model may answer in text or call a tool as the prompt
//                                        shows it (<tool_call>{"name": ..., "arguments": ...}</tool_call>)
// The tools are shown to the model in the system message, in the format of Qwen2.5's and Hermes' chat templates
// (tool_system_prompt), and the answer is read back into OpenAI's tool_calls (parse_tool_calls).
// Compiled grammars are cached per schema (GrammarCache: one XGrammar compiler per served model, whose cache is
// keyed by the schema's text). A schema XGrammar cannot compile is a 400 naming the field:
//   "Invalid JSON schema in 'response_format.json_schema.schema': ..."
#pragma once

#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/grammar.h"
#include "server/api_request.h"

namespace tessera::server {

// The served model's grammar compiler, built on first use (the vocabulary's decoded bytes: 25-60 ms for SmolLM2's
// 49K tokens, bench/grammar_bench).
class GrammarCache {
 public:
  runtime::GrammarCompiler& compiler(const model::Tokenizer& tokenizer);

 private:
  std::once_flag once_;
  std::unique_ptr<runtime::GrammarCompiler> compiler_;
  std::string error_;  // the compiler could not be built (XGrammar missing)
};

// How the answer of a request with tools is read: Forced (required / named: the whole text is one
// {"name", "arguments"} object), Auto (<tool_call> blocks in the text, if any), None (plain text).
enum class ToolAnswer { None, Auto, Forced };

// The grammar of the request's response_format or tool_choice (null: none). Throws ApiError 400 for a schema
// that does not compile (or a server built without XGrammar).
std::shared_ptr<const runtime::Grammar> request_grammar(const ApiRequest& request, const model::Tokenizer& tokenizer,
                                                        GrammarCache& cache);
ToolAnswer tool_answer(const ApiRequest& request);

// The schema a forced tool call follows: {"name": const, "arguments": parameters}, anyOf over the tools allowed.
std::string tool_call_schema(const ApiRequest& request);

// The tools section added to the system message (a system message is put first when the conversation has none).
std::string tool_system_prompt(const std::vector<ToolFunction>& tools);
std::vector<model::ChatMessage> with_tools(const std::vector<model::ChatMessage>& messages,
                                           const std::vector<ToolFunction>& tools);

// The answer's tool calls in OpenAI's shape ([{"id", "type": "function", "function": {"name", "arguments"}}]), or
// an empty array when the text holds none (Auto) / is not a call of one of the tools (Forced: cannot happen under
// the grammar unless the token budget cut it). `id_prefix` + index make the ids.
nlohmann::json parse_tool_calls(const std::string& text, ToolAnswer mode, const std::vector<ToolFunction>& tools,
                                const std::string& id_prefix);

}  // namespace tessera::server
