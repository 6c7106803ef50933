// tessera/server/request_prep.h — from a parsed request to what the engine runs: prompt ids and options.
//
// Applies what needs the served model: the model name, the chat template, the tokenizer, the context limit and
// the endpoint's default token budget. Errors are ApiError in the OpenAI shape:
//   404 model_not_found            "The model 'gpt-4' does not exist; this server serves 'smollm2-135m-...'"
//   400 context_length_exceeded    "This model's maximum context length is 8192 tokens. However, you requested
//                                   9000 tokens (8990 in the messages, 10 in the completion). ..."
//   400 invalid_request_error      a conversation the template refuses, token ids outside the vocabulary, an
//                                  empty prompt, a chat request to a model without a chat format
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/tokenizer.h"
#include "runtime/generation.h"
#include "server/api_request.h"
#include "server/prompt_tokens.h"
#include "server/structured_output.h"

namespace tessera::server {

struct ServedModel {
  std::string id;                               // the name clients pass as "model" (GET /v1/models lists it)
  const model::Tokenizer* tokenizer = nullptr;  // must outlive the requests
  const model::ChatTemplate* chat = nullptr;    // null: the model has no chat format tessera knows
  int32_t context_length = 0;                   // tokens: prompt + completion
  int64_t created = 0;                          // unix time the server loaded it (the models list shows it)
  std::shared_ptr<GrammarCache> grammars = std::make_shared<GrammarCache>();  // structured output's compiled grammars
  // Prompts' ids by their text, so that a conversation's next turn tokenizes only what is new (null: none).
  std::shared_ptr<PromptTokenCache> prompt_tokens = std::make_shared<PromptTokenCache>();
};

// /v1/completions without max_tokens generates this many tokens, as the OpenAI API does; chat completions
// default to the rest of the context.
inline constexpr int32_t kDefaultCompletionTokens = 16;

struct PreparedRequest {
  std::vector<int32_t> prompt;       // token ids, chat template applied
  runtime::GenerateOptions gen;      // token budget (0: echo only), sampling (seed filled in), end-of-generation
                                     // tokens, logprobs (alternatives per token; -1: none)
  std::vector<std::string> stop;     // stop sequences
  bool echo = false;                 // completions: echo_text comes first, and with logprobs the prompt's
  std::string echo_text;             // the prompt as text (the request's string, or its ids decoded)
  ToolAnswer tools = ToolAnswer::None;  // chat with tools: how the answer is read back (tool_calls)
};

// `random_seed` is used when the request sets no seed. `which`: the prompt (ApiRequest::prompts) of a completions
// request; its errors name prompt[which] when the request holds several.
PreparedRequest prepare_request(const ApiRequest& request, const ServedModel& model, uint64_t random_seed,
                                size_t which = 0);

// POST /tokenize: the ids a completion (prompt) or chat (messages, as the chat request encodes them) would run.
std::vector<int32_t> tokenize_request(const TokenizeRequest& request, const ServedModel& model);
// POST /detokenize: the text of the ids (ApiError 400 for an id outside the vocabulary).
std::string detokenize_request(const DetokenizeRequest& request, const ServedModel& model);

}  // namespace tessera::server
