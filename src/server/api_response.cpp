#include "server/api_response.h"

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
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json answer_json(const AnswerHeader& h, const std::string& text, const std::string& finish_reason, const Usage& usage) {
  json j = base(h, false);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", null_or(finish_reason)}};
  if (h.endpoint == Endpoint::Chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}, {"refusal", nullptr}};
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  j["usage"] = usage_json(usage);
  return j;
}

json chunk_json(const AnswerHeader& h, const std::string& text, bool role, const std::string& finish_reason,
                bool with_usage_null) {
  json j = base(h, true);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", null_or(finish_reason)}};
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
