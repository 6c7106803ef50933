// tessera/server/api_request.h — one OpenAI API request, parsed and validated, and the API's error value.
//
//   ApiRequest r = parse_api_request(Endpoint::Chat, body);   // throws ApiError (status, type, message, param)
//
// parse_api_request is a pure function of the body's bytes (no model, no I/O), so the HTTP layer, the tests and
// the fuzz harness (tests/fuzz/fuzz_server_request.cpp) call the same code. It checks what the JSON alone can
// tell: the shape and type of every field the server reads, ranges, and that nothing asks for a feature tessera
// does not have (audio, tool messages, ...): those are refused by name rather than ignored, so a
// client never gets an answer computed without what it asked for. Whether a JSON schema compiles is checked when
// the grammar is built (server/structured_output.h). What needs the model (the model name, the
// prompt's length, the attention spec) is checked later (request_prep.h, policy_cache.h).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/chat_template.h"
#include "runtime/sampling.h"

namespace tessera::server {

enum class Endpoint { Chat, Completion };  // POST /v1/chat/completions, POST /v1/completions

// An error as the OpenAI API reports it: HTTP status and {"error": {"message", "type", "param", "code"}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, const std::string& message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status_(status), type_(std::move(type)), param_(std::move(param)),
        code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }  // "" -> null
  const std::string& code() const { return code_; }    // "" -> null

 private:
  int status_;
  std::string type_, param_, code_;
};

// 400 invalid_request_error naming the field.
ApiError invalid_request(const std::string& message, const std::string& param = {}, const std::string& code = {});

// response_format (chat and completions): text (the default), any JSON object, or JSON under a schema.
struct ResponseFormat {
  enum class Kind { Text, JsonObject, JsonSchema };
  Kind kind = Kind::Text;
  std::string name;    // json_schema.name
  std::string schema;  // json_schema.schema, as JSON text
  bool strict = false;  // json_schema.strict (the output follows the schema strictly either way)
};

// One entry of `tools` (chat): {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}.
struct ToolFunction {
  std::string name;         // [A-Za-z0-9_-], 1 to 64 characters, distinct
  std::string description;  // may be empty
  std::string parameters;   // a JSON Schema object as JSON text ({"type": "object"} when not given)
};
// tool_choice: "auto" (default with tools: the model may call one), "none", "required" (it must call one) or
// {"type": "function", "function": {"name"}} (it must call that one).
enum class ToolChoice { Auto, None, Required, Named };

struct ApiRequest {
  Endpoint endpoint = Endpoint::Chat;
  std::string model;
  std::vector<model::ChatMessage> messages;  // Chat: roles system (also "developer"), user, assistant
  std::string prompt;                        // Completion: the prompt text, or
  std::vector<int32_t> prompt_ids;           // its token ids (the API's integer-array form)
  bool prompt_is_ids = false;
  // Completion: every prompt of the request (a list of strings or of token-id lists gives several; the fields above
  // are the first). Each is answered with n choices: choice index = prompt * n + choice, as vLLM.
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
    bool is_ids = false;
  };
  std::vector<Prompt> prompts;
  std::optional<int32_t> max_tokens;  // max_tokens or max_completion_tokens; absent: the endpoint's default
  runtime::SamplingOptions sampling{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};  // API defaults
  bool seed_given = false;
  std::vector<std::string> stop;  // stop sequences (not part of the answer)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::string attn;            // "tessera": {"attn": ...}; empty: the server's --attn
  // Log-probabilities: -1 none; else the alternatives per token (chat: top_logprobs with logprobs true;
  // completions: logprobs, whose entries also hold the chosen token).
  int32_t logprobs = -1;
  bool echo = false;  // completions: the prompt comes back first (with its log-probabilities when logprobs >= 0)
  int32_t n = 1;      // choices
  ResponseFormat response_format;
  std::vector<ToolFunction> tools;         // chat
  ToolChoice tool_choice = ToolChoice::None;  // Auto when tools are given without tool_choice
  std::string tool_name;                   // ToolChoice::Named: the function
};

// Parses and validates a request body for `endpoint`. Throws ApiError (status 400, type invalid_request_error)
// with the offending field in param, e.g. "'max_tokens' must be an integer, got string" (param max_tokens),
// "'n' must be 1: tessera returns one choice per request" (param n), "malformed JSON: ..." (no param).
ApiRequest parse_api_request(Endpoint endpoint, std::string_view body);

// POST /tokenize (vLLM's shape): {"model"?, "prompt": text, "add_special_tokens"?: true} or {"model"?, "messages":
// [...], "add_generation_prompt"?: true} (the chat request's prompt exactly); "return_token_strs"?: false.
struct TokenizeRequest {
  std::string model;  // empty: not given
  bool chat = false;
  std::string prompt;
  std::vector<model::ChatMessage> messages;
  bool add_special = true;
  bool add_generation_prompt = true;
  bool token_strs = false;
};
TokenizeRequest parse_tokenize_request(std::string_view body);

// POST /detokenize (vLLM's shape): {"model"?, "tokens": [ids]} -> {"prompt": text}.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
DetokenizeRequest parse_detokenize_request(std::string_view body);

// Limits the parser enforces (documented in docs/server.md).
inline constexpr size_t kMaxStopSequences = 4;       // as the OpenAI API
inline constexpr size_t kMaxStopSequenceBytes = 256;
inline constexpr int32_t kMaxLogprobs = 20;  // top_logprobs (chat) and logprobs (completions), as vLLM's default
inline constexpr int32_t kMaxChoices = 16;   // n
inline constexpr size_t kMaxPrompts = 64;     // prompts of one completions request
inline constexpr size_t kMaxTools = 128;     // tools of one chat request, as the OpenAI API

}  // namespace tessera::server
