// tessera/server/api_response.h — the JSON the server sends, in the OpenAI API's shapes.
//
// Non-streamed answers are one "chat.completion" / "text_completion" object with usage. Streamed answers are
// server-sent events: chunks ("chat.completion.chunk" / "text_completion"), the first chat chunk carrying the
// assistant role, one chunk per piece of text, a last chunk with the finish_reason, with
// stream_options.include_usage a final chunk with empty choices and the usage (every other chunk then has
// "usage": null), and the line "data: [DONE]". Errors are {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "model/tokenizer/tokenizer.h"
#include "runtime/sampling.h"
#include "server/api_request.h"
#include "server/request_prep.h"

namespace tessera::server {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // of prompt_tokens, those taken from the prefix cache (prompt_tokens_details)
};

// Identity of one answer: its id ("chatcmpl-..." / "cmpl-..."), creation time and model name.
struct AnswerHeader {
  Endpoint endpoint = Endpoint::Chat;
  std::string id;
  int64_t created = 0;  // unix seconds
  std::string model;
};

// "chatcmpl-" or "cmpl-" followed by 24 hex digits from `number` (unique per server run).
std::string answer_id(Endpoint endpoint, uint64_t number);

nlohmann::json error_json(const ApiError& e);
nlohmann::json usage_json(const Usage& u);

// One choice of an answer: its text, finish_reason and log-probabilities (null: none asked; logprobs_json).
struct Choice {
  std::string text;
  std::string finish_reason;
  nlohmann::json logprobs = nullptr;
  // Chat: the answer's tool calls (structured_output.h's parse_tool_calls); when non-empty, the message's content
  // is null, it carries tool_calls, and finish_reason is "tool_calls".
  nlohmann::json tool_calls = nullptr;
};

// The whole answer of a non-streamed request: its choices (index = position) and the usage.
nlohmann::json answer_json(const AnswerHeader& h, const std::vector<Choice>& choices, const Usage& usage);
nlohmann::json answer_json(const AnswerHeader& h, const std::string& text, const std::string& finish_reason,
                           const Usage& usage);

// One streamed chunk: `text` (chat: the delta's content), `role` (chat: the first chunk says "assistant"),
// `finish_reason` ("" -> null). `with_usage_null`: stream_options.include_usage was set. `index`: the choice;
// `logprobs`: the chunk's tokens' (logprobs_json), null when none were asked.
nlohmann::json chunk_json(const AnswerHeader& h, const std::string& text, bool role, const std::string& finish_reason,
                          bool with_usage_null, int index = 0, const nlohmann::json& logprobs = nullptr);

// The log-probabilities of some tokens in the endpoint's shape (OpenAI's):
//   chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}...]}...],
//                 "refusal": null}    (top_logprobs: the most likely tokens, as many as the request asked)
//   completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}...],
//                 "text_offset": [...]}  (each top_logprobs object: the `logprobs` most likely and the chosen token;
//                 the echoed prompt's first token, logprob NaN, gets null in both)
// A token's text is its own bytes (Tokenizer::token_to_piece; invalid UTF-8 is replaced when sent). text_offset
// counts characters from *offset, which advances past these tokens (a stream's chunks continue it).
nlohmann::json logprobs_json(Endpoint endpoint, const model::Tokenizer& tokenizer,
                             std::span<const runtime::TokenLogprobs> logprobs, int64_t* offset);
// A streamed chat answer's tool calls, all in one chunk: delta {"tool_calls": [{"index", "id", "type", "function":
// {"name", "arguments"}}]} (the finish chunk, finish_reason "tool_calls", follows).
nlohmann::json tool_calls_chunk_json(const AnswerHeader& h, const nlohmann::json& calls, bool with_usage_null,
                                     int index = 0);
// The final chunk of a stream with include_usage: empty choices and the usage.
nlohmann::json usage_chunk_json(const AnswerHeader& h, const Usage& usage);

// GET /v1/models and /v1/models/{id}.
nlohmann::json model_json(const ServedModel& m);
nlohmann::json models_json(const ServedModel& m);

// "data: <json>\n\n" (invalid UTF-8 in text is replaced, never thrown on).
std::string sse_event(const nlohmann::json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

// j.dump() that replaces invalid UTF-8 instead of throwing.
std::string dump_json(const nlohmann::json& j);

}  // namespace tessera::server
