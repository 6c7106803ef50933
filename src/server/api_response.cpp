#include "server/api_response.h"

#include <cmath>
#include <cstdio>

namespace tessera::server {

using nlohmann::json;

std::string answer_id(Endpoint endpoint, uint64_t number) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%024llx", static_cast<unsigned long long>(number));
  return (endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-") + std::string(buf);
}

namespace {

json null_or(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

json base(const AnswerHeader& h, bool chunk) {
  const bool chat = h.endpoint == Endpoint::Chat;
  return {{"id", h.id},
          {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", h.created},
          {"model", h.model},
          {"system_fingerprint", nullptr}};
}

}  // namespace

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.what()}, {"type", e.type()}, {"param", null_or(e.param())}, {"code", null_or(e.code())}}}};
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json answer_json(const AnswerHeader& h, const std::vector<Choice>& choices, const Usage& usage) {
  json j = base(h, false);
  j["choices"] = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json choice = {{"index", i}, {"logprobs", c.logprobs}, {"finish_reason", null_or(c.finish_reason)}};
    if (h.endpoint == Endpoint::Chat && c.tool_calls.is_array() && !c.tool_calls.empty()) {
      choice["message"] = {{"role", "assistant"}, {"content", nullptr}, {"refusal", nullptr}, {"tool_calls", c.tool_calls}};
      choice["finish_reason"] = "tool_calls";
    } else if (h.endpoint == Endpoint::Chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
    } else {
      choice["text"] = c.text;
    }
    j["choices"].push_back(std::move(choice));
  }
  j["usage"] = usage_json(usage);
  return j;
}

json answer_json(const AnswerHeader& h, const std::string& text, const std::string& finish_reason, const Usage& usage) {
  return answer_json(h, std::vector<Choice>{{text, finish_reason, nullptr}}, usage);
}

namespace {

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

int64_t characters(const std::string& s) {  // UTF-8 lead bytes (continuation bytes 0x80-0xBF are not counted)
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80 ? 1 : 0;
  return n;
}

json number_or_null(float x) { return std::isfinite(x) ? json(static_cast<double>(x)) : json(nullptr); }

}  // namespace

json logprobs_json(Endpoint endpoint, const model::Tokenizer& tok, std::span<const runtime::TokenLogprobs> lps,
                   int64_t* offset) {
  if (endpoint == Endpoint::Chat) {
    json content = json::array();
    for (const runtime::TokenLogprobs& l : lps) {
      const std::string piece = tok.token_to_piece(l.token);
      json top = json::array();
      for (const runtime::TokenLogprob& t : l.top) {
        const std::string p = tok.token_to_piece(t.token);
        top.push_back({{"token", p}, {"logprob", number_or_null(t.logprob)}, {"bytes", bytes_of(p)}});
      }
      content.push_back({{"token", piece}, {"logprob", number_or_null(l.logprob)}, {"bytes", bytes_of(piece)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), text_offset = json::array();
  int64_t at = offset ? *offset : 0;
  for (const runtime::TokenLogprobs& l : lps) {
    const std::string piece = tok.token_to_piece(l.token);
    tokens.push_back(piece);
    text_offset.push_back(at);
    at += characters(piece);
    if (std::isnan(l.logprob)) {  // the echoed prompt's first token
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(number_or_null(l.logprob));
    json top = json::object();
    for (const runtime::TokenLogprob& t : l.top) top[tok.token_to_piece(t.token)] = number_or_null(t.logprob);
    top[piece] = number_or_null(l.logprob);
    top_logprobs.push_back(std::move(top));
  }
  if (offset) *offset = at;
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(text_offset)}};
}

json chunk_json(const AnswerHeader& h, const std::string& text, bool role, const std::string& finish_reason,
                bool with_usage_null, int index, const json& logprobs) {
  json j = base(h, true);
  json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", null_or(finish_reason)}};
  if (h.endpoint == Endpoint::Chat) {
    json delta = json::object();
    if (role) delta["role"] = "assistant";
    if (role || !text.empty()) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  if (with_usage_null) j["usage"] = nullptr;
  return j;
}

json tool_calls_chunk_json(const AnswerHeader& h, const json& calls, bool with_usage_null, int index) {
  json j = base(h, true);
  json deltas = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = calls[i];
    c["index"] = i;
    deltas.push_back(std::move(c));
  }
  j["choices"] = json::array(
      {{{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullptr}, {"delta", {{"tool_calls", deltas}}}}});
  if (with_usage_null) j["usage"] = nullptr;
  return j;
}

json usage_chunk_json(const AnswerHeader& h, const Usage& usage) {
  json j = base(h, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

json model_json(const ServedModel& m) {
  return {{"id", m.id}, {"object", "model"}, {"created", m.created}, {"owned_by", "tessera"},
          {"context_length", m.context_length}};
}

json models_json(const ServedModel& m) { return {{"object", "list"}, {"data", json::array({model_json(m)})}}; }

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

}  // namespace tessera::server
