#include "server/request_prep.h"

#include "core/error.h"

namespace tessera::server {

namespace {

void check_model(const std::string& name, const ServedModel& m) {
  if (name != m.id)
    throw ApiError(404, "invalid_request_error",
                   "The model '" + name + "' does not exist; this server serves '" + m.id + "'", "model",
                   "model_not_found");
}

std::vector<int32_t> encode_prompt(const ServedModel& m, std::string_view text, const model::EncodeOptions& options) {
  return m.prompt_tokens ? m.prompt_tokens->encode(*m.tokenizer, text, options) : m.tokenizer->encode(text, options);
}

std::vector<int32_t> chat_prompt(std::span<const model::ChatMessage> messages, const ServedModel& m,
                                 bool add_generation_prompt) {
  if (m.chat == nullptr)
    throw invalid_request("model '" + m.id +
                              "' has no chat format tessera knows (ChatML, Llama-3, Gemma, Mistral); use "
                              "/v1/completions",
                          "messages");
  std::string text;
  try {
    text = m.chat->apply(messages, add_generation_prompt);
  } catch (const Error& e) {
    throw invalid_request(std::string("the model's chat format refuses this conversation: ") + e.what(), "messages");
  }
  // As the CLI's --chat: the rendered conversation is encoded with parse_special, so the template's markers
  // become control tokens (so would a marker's spelling typed inside a message).
  return encode_prompt(m, text, {.add_special = !m.chat->renders_bos(), .parse_special = true});
}

}  // namespace

std::vector<int32_t> tokenize_request(const TokenizeRequest& r, const ServedModel& m) {
  if (!r.model.empty()) check_model(r.model, m);
  if (r.chat) return chat_prompt(r.messages, m, r.add_generation_prompt);
  return encode_prompt(m, r.prompt, {.add_special = r.add_special, .parse_special = false});
}

std::string detokenize_request(const DetokenizeRequest& r, const ServedModel& m) {
  if (!r.model.empty()) check_model(r.model, m);
  const model::Tokenizer& tok = *m.tokenizer;
  for (size_t i = 0; i < r.tokens.size(); ++i)
    if (r.tokens[i] >= tok.vocab_size())
      throw invalid_request("'tokens[" + std::to_string(i) + "]' is token id " + std::to_string(r.tokens[i]) +
                                ", outside the vocabulary of " + std::to_string(tok.vocab_size()) + " tokens",
                            "tokens");
  return tok.decode(r.tokens);
}

PreparedRequest prepare_request(const ApiRequest& request, const ServedModel& m, uint64_t random_seed, size_t which) {
  check_model(request.model, m);
  ApiRequest one;  // the prompt `which` of a completions request with several
  const bool several = request.endpoint == Endpoint::Completion && request.prompts.size() > 1;
  if (several) {
    check(which < request.prompts.size(), "prepare_request: no prompt " + std::to_string(which));
    one = request;
    one.prompt = request.prompts[which].text;
    one.prompt_ids = request.prompts[which].ids;
    one.prompt_is_ids = request.prompts[which].is_ids;
  }
  const ApiRequest& r = several ? one : request;
  const std::string name = several ? "prompt[" + std::to_string(which) + "]" : "prompt";
  PreparedRequest p;
  const model::Tokenizer& tok = *m.tokenizer;
  if (r.endpoint == Endpoint::Chat) {
    // With tools (tool_choice other than "none"), the system message shows them (structured_output.h).
    p.prompt = r.tool_choice == ToolChoice::None ? chat_prompt(r.messages, m, /*add_generation_prompt=*/true)
                                                 : chat_prompt(with_tools(r.messages, r.tools), m, true);
    p.tools = tool_answer(r);
  } else if (r.prompt_is_ids) {
    for (size_t i = 0; i < r.prompt_ids.size(); ++i) {
      if (r.prompt_ids[i] >= tok.vocab_size())
        throw invalid_request("'" + name + "[" + std::to_string(i) + "]' is token id " + std::to_string(r.prompt_ids[i]) +
                                  ", outside the vocabulary of " + std::to_string(tok.vocab_size()) + " tokens",
                              "prompt");
    }
    p.prompt = r.prompt_ids;
  } else {
    p.prompt = encode_prompt(m, r.prompt, {.add_special = true, .parse_special = false});
  }
  if (p.prompt.empty())
    throw invalid_request(several ? "'" + name + "' is empty" : std::string("the prompt is empty"),
                          r.endpoint == Endpoint::Chat ? "messages" : "prompt");

  const int64_t n = static_cast<int64_t>(p.prompt.size());
  const std::string where = r.endpoint == Endpoint::Chat ? "messages" : "prompt";
  if (n >= m.context_length)
    throw invalid_request("This model's maximum context length is " + std::to_string(m.context_length) +
                              " tokens. However, your " + where + " resulted in " + std::to_string(n) +
                              " tokens, which leaves no room for the completion. Please reduce the length of the " +
                              where + ".",
                          where, "context_length_exceeded");
  const int64_t room = m.context_length - n;
  if (r.max_tokens && *r.max_tokens > room)
    throw invalid_request("This model's maximum context length is " + std::to_string(m.context_length) +
                              " tokens. However, you requested " + std::to_string(n + *r.max_tokens) + " tokens (" +
                              std::to_string(n) + " in the " + where + ", " + std::to_string(*r.max_tokens) +
                              " in the completion). Please reduce the length of the " + where +
                              " or completion.",
                          "max_tokens", "context_length_exceeded");
  int64_t budget = room;
  if (r.max_tokens) budget = *r.max_tokens;
  else if (r.endpoint == Endpoint::Completion) budget = std::min<int64_t>(room, kDefaultCompletionTokens);
  p.gen.max_new_tokens = static_cast<int32_t>(budget);
  p.gen.sampling = r.sampling;
  if (!r.seed_given) p.gen.sampling.seed = random_seed;
  p.gen.stop_tokens = tok.special().end_of_generation;
  for (const auto& [id, bias] : p.gen.sampling.logit_bias)
    if (id >= tok.vocab_size())
      throw invalid_request("'logit_bias' names token id " + std::to_string(id) + ", outside the vocabulary of " +
                                std::to_string(tok.vocab_size()) + " tokens",
                            "logit_bias");
  p.gen.sampling.grammar = request_grammar(r, tok, *m.grammars);  // response_format, forced tool calls
  p.gen.logprobs = r.logprobs;
  p.echo = r.echo;
  if (r.echo) p.echo_text = r.prompt_is_ids ? tok.decode(p.prompt) : r.prompt;
  p.stop = r.stop;
  return p;
}

}  // namespace tessera::server
