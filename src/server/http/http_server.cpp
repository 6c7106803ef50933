#include "server/http/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <random>

#include "core/error.h"
#include "server/api_response.h"
#include "server/structured_output.h"

namespace tessera::server {

namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr auto kPoll = 200ms;             // how often a waiting stream checks its job
constexpr auto kKeepAlive = 1000ms;       // a comment line after this long without a write (notices a gone client)

bool same_secret(const std::string& a, const std::string& b) {  // constant time in the length of b
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < b.size(); ++i) diff |= static_cast<unsigned>(b[i] ^ (i < a.size() ? a[i] : 0));
  return diff == 0;
}

const char* endpoint_path(Endpoint e) { return e == Endpoint::Chat ? "/v1/chat/completions" : "/v1/completions"; }

// The label of a path in the metrics: the route, or "other" (so clients cannot add label values).
std::string route_label(const std::string& path) {
  for (const char* p : {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                        "/detokenize", "/v1/tokenize", "/v1/detokenize", "/tokenizer_info"})
    if (path == p) return p;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

}  // namespace

struct HttpServer::Impl {
  HttpOptions options;
  const ServedModel& model;
  PolicyCache& policies;
  Scheduler& scheduler;
  Metrics& metrics;
  httplib::Server http;
  int listen_socket = -1;  // the bound socket (set_socket_options' callback sees it before bind)
  std::atomic<uint64_t> answers{0};
  std::mutex seed_mu, log_mu;
  std::mt19937_64 seeds{std::random_device{}()};

  Impl(HttpOptions o, const ServedModel& m, PolicyCache& p, Scheduler& s, Metrics& me)
      : options(std::move(o)), model(m), policies(p), scheduler(s), metrics(me) {}

  uint64_t random_seed() {
    std::lock_guard<std::mutex> lock(seed_mu);
    return seeds();
  }

  void log(const std::string& line) {
    if (!options.log_requests) return;
    std::lock_guard<std::mutex> lock(log_mu);
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  }

  static void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status();
    res.set_content(dump_json(error_json(e)), "application/json");
  }

  void check_auth(const httplib::Request& req) const {
    if (options.api_key.empty()) return;
    const std::string auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (auth.rfind(prefix, 0) != 0 || !same_secret(auth.substr(prefix.size()), options.api_key))
      throw ApiError(401, "invalid_request_error",
                     auth.empty() ? "You didn't provide an API key: pass it as 'Authorization: Bearer KEY'"
                                  : "Incorrect API key provided",
                     {}, "invalid_api_key");
  }

  static std::string summary(const JobResult& r) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "prompt=%lld completion=%lld queue=%.2fs ttft=%.3fs total=%.2fs finish=%s slot=%d",
                  static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.completion_tokens),
                  r.queue_seconds, r.ttft_seconds, r.total_seconds, finish_reason_name(r.reason), r.slot);
    return buf;
  }

  // The error a job that did not end normally answers with.
  ApiError job_error(const JobResult& r) const {
    switch (r.reason) {
      case FinishReason::Timeout:
        return ApiError(504, "timeout_error",
                        "the request timed out after " + std::to_string(static_cast<int>(options.timeout_seconds)) +
                            " s (the server's --timeout)",
                        {}, "request_timeout");
      case FinishReason::Cancelled:
        return ApiError(503, "server_error", "the server is shutting down", {}, "shutting_down");
      default:
        return ApiError(500, "server_error", "generation failed: " + r.error, {}, "engine_error");
    }
  }

  void generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    const std::string what = std::string("POST ") + endpoint_path(endpoint);
    std::vector<std::shared_ptr<Job>> jobs;
    try {
      check_auth(req);
      const ApiRequest r = parse_api_request(endpoint, req.body);
      // One prepared request per prompt (completions may hold several); every error before any job starts.
      std::vector<PreparedRequest> prompts;
      const uint64_t seed = random_seed();
      for (size_t p = 0; p < std::max<size_t>(1, r.prompts.size()); ++p) prompts.push_back(prepare_request(r, model, seed, p));
      const PreparedRequest& prepared = prompts[0];
      if (prepared.echo && prepared.gen.logprobs >= 0 && !scheduler.prompt_logprobs())
        throw invalid_request("'echo' with 'logprobs' (the prompt's log-probabilities) is not available with "
                              "streaming memory in the batched engine (--stream with --parallel " +
                                  std::to_string(scheduler.options().slots) + "); send 'echo' without 'logprobs'",
                              "echo", "unsupported_parameter");
      auto policy = policies.get(r.attn);
      const std::string attn = r.attn.empty() ? policies.default_label() : r.attn;
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(options.timeout_seconds));
      // n choices per prompt: one job each, choice i with seed + i (vLLM's rule), so that a seeded request repeats;
      // the choice of prompt p is index p * n + i.
      for (const PreparedRequest& one : prompts)
        for (int32_t i = 0; i < r.n; ++i) {
          PreparedRequest p = one;
          p.gen.sampling.seed = one.gen.sampling.seed + static_cast<uint64_t>(i);
          jobs.push_back(std::make_shared<Job>(std::move(p), policy, deadline));
        }
      for (const auto& job : jobs) {
        const Admission a = scheduler.submit(job);
        if (a == Admission::Accepted) continue;
        for (const auto& other : jobs) scheduler.cancel(other);
        if (a == Admission::QueueFull)
          throw ApiError(429, "rate_limit_error",
                         "the server is busy: " + std::to_string(scheduler.options().slots) + " running and " +
                             std::to_string(scheduler.options().queue) + " queued requests (--parallel, --queue)" +
                             (jobs.size() > 1
                                  ? " with room for fewer than this request's " + std::to_string(jobs.size()) + " choices"
                                  : std::string()) +
                             "; retry later",
                         {}, "queue_full");
        throw ApiError(503, "server_error", "the server is shutting down", {}, "shutting_down");
      }
      const AnswerHeader h{endpoint, answer_id(endpoint, ++answers), static_cast<int64_t>(std::time(nullptr)),
                           model.id};
      const bool logprobs = prepared.gen.logprobs >= 0;
      if (r.stream) {
        stream(res, jobs, r.n, h, r.include_usage, logprobs, what + " 200 stream id=" + h.id + " attn=" + attn,
               prepared.tools, r.tools);
        return;
      }
      std::vector<Choice> choices;
      Usage usage;
      std::string lines;
      for (size_t k = 0; k < jobs.size(); ++k) {
        const auto& job = jobs[k];
        std::string text;
        std::vector<runtime::TokenLogprobs> lps;
        while (!job->wait(text, logprobs ? &lps : nullptr, kKeepAlive)) {
        }
        const JobResult& result = job->result();
        metrics.observe_request(result.total_seconds);
        if (result.reason != FinishReason::Stop && result.reason != FinishReason::Length) {
          for (const auto& other : jobs) scheduler.cancel(other);
          throw job_error(result);
        }
        int64_t offset = 0;
        json calls = nullptr;  // tools: the answer read back as tool calls (structured_output.h)
        if (prepared.tools != ToolAnswer::None)
          calls = parse_tool_calls(text, prepared.tools, r.tools, tool_call_id_prefix(h, k));
        choices.push_back({std::move(text), finish_reason_name(result.reason),
                           logprobs ? logprobs_json(endpoint, *model.tokenizer, lps, &offset) : json(nullptr),
                           std::move(calls)});
        if (k % static_cast<size_t>(r.n) == 0) {  // each prompt once
          usage.prompt_tokens += result.prompt_tokens;
          usage.cached_tokens += result.cached_tokens;
        }
        usage.completion_tokens += result.completion_tokens;
        lines += (lines.empty() ? "" : " | ") + summary(result);
      }
      res.set_content(dump_json(answer_json(h, choices, usage)), "application/json");
      log(what + " 200 id=" + h.id + " attn=" + attn + " " + lines);
    } catch (const ApiError& e) {
      send_error(res, e);
      log(what + " " + std::to_string(e.status()) + " " + e.type() + ": " + e.what());
    }
  }

  // "call_" + the answer's id digits + the choice: tool-call ids unique per server run.
  static std::string tool_call_id_prefix(const AnswerHeader& h, size_t choice) {
    return "call_" + h.id.substr(h.id.find('-') + 1) + "_" + std::to_string(choice) + "_";
  }

  struct StreamState {
    std::vector<std::shared_ptr<Job>> jobs;  // one per choice
    // Chat with tools: each choice's text (and log-probabilities) is held to its end, then sent as tool calls
    // when it holds any, else as one text chunk.
    ToolAnswer tools = ToolAnswer::None;
    std::vector<ToolFunction> tool_list;
    std::vector<std::string> held;
    std::vector<std::vector<runtime::TokenLogprobs>> held_logprobs;
    std::vector<bool> finished;              // the choice's finish chunk went out
    std::vector<int64_t> offsets;            // completions' text_offset so far, per choice
    int32_t n_per_prompt = 1;                // choices per prompt (usage counts each prompt once)
    AnswerHeader header;
    bool include_usage = false;
    bool logprobs = false;
    bool started = false;
    bool ended = false;
    Clock::time_point last_write = Clock::now();
    std::string line;  // the log line's start
  };

  void stream(httplib::Response& res, const std::vector<std::shared_ptr<Job>>& jobs, int32_t n_per_prompt,
              const AnswerHeader& h, bool include_usage, bool logprobs, std::string line,
              ToolAnswer tools = ToolAnswer::None, const std::vector<ToolFunction>& tool_list = {}) {
    auto st = std::make_shared<StreamState>();
    st->tools = tools;
    st->tool_list = tool_list;
    st->held.assign(jobs.size(), {});
    st->held_logprobs.assign(jobs.size(), {});
    st->jobs = jobs;
    st->n_per_prompt = n_per_prompt;
    st->finished.assign(jobs.size(), false);
    st->offsets.assign(jobs.size(), 0);
    st->header = h;
    st->include_usage = include_usage;
    st->logprobs = logprobs;
    st->line = std::move(line);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, st](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) {
            st->last_write = Clock::now();
            return sink.write(s.data(), s.size());
          };
          const AnswerHeader& hh = st->header;
          const auto n = static_cast<int>(st->jobs.size());
          if (!st->started) {
            st->started = true;
            // The role comes first (chat), before any text, as OpenAI's streams do.
            if (hh.endpoint == Endpoint::Chat)
              for (int i = 0; i < n; ++i)
                if (!write(sse_event(chunk_json(hh, "", true, "", st->include_usage, i)))) return gone(*st);
          }
          bool all_done = true, wrote = false, waited = false;
          for (int i = 0; i < n; ++i) {
            if (st->finished[static_cast<size_t>(i)]) continue;
            Job& job = *st->jobs[static_cast<size_t>(i)];
            std::string text;
            std::vector<runtime::TokenLogprobs> lps;
            // The first unfinished choice waits for news; the others are only looked at.
            const bool done = job.wait(text, st->logprobs ? &lps : nullptr, waited ? 0ms : kPoll);
            waited = true;
            const auto ui = static_cast<size_t>(i);
            if (st->tools != ToolAnswer::None) {  // held to the end (above)
              st->held[ui] += text;
              for (auto& lp : lps) st->held_logprobs[ui].push_back(std::move(lp));
              text.clear();
              lps.clear();
              if (done && job.result().reason != FinishReason::Stop && job.result().reason != FinishReason::Length) {
                // an error: nothing held goes out (below)
              } else if (done) {
                const json calls = parse_tool_calls(st->held[ui], st->tools, st->tool_list, tool_call_id_prefix(hh, ui));
                if (!calls.empty()) {
                  if (!write(sse_event(tool_calls_chunk_json(hh, calls, st->include_usage, i)))) return gone(*st);
                  if (!write(sse_event(chunk_json(hh, "", false, "tool_calls", st->include_usage, i)))) return gone(*st);
                  st->finished[ui] = true;
                  wrote = true;
                  continue;
                }
                text = std::move(st->held[ui]);
                lps = std::move(st->held_logprobs[ui]);
              }
            }
            if (!text.empty() || !lps.empty()) {
              const json lj = st->logprobs ? logprobs_json(hh.endpoint, *model.tokenizer, lps,
                                                           &st->offsets[static_cast<size_t>(i)])
                                           : json(nullptr);
              if (!write(sse_event(chunk_json(hh, text, false, "", st->include_usage, i, lj)))) return gone(*st);
              wrote = true;
            }
            if (!done) {
              all_done = false;
              continue;
            }
            const JobResult& r = job.result();
            if (r.reason != FinishReason::Stop && r.reason != FinishReason::Length) {
              for (const auto& other : st->jobs) scheduler.cancel(other);
              for (const auto& other : st->jobs) {  // every choice ends before the error goes out
                std::string ignored;
                while (!other->wait(ignored, kPoll)) {
                }
              }
              metrics.observe_request(r.total_seconds);
              const bool ok = write(sse_event(error_json(job_error(r))) + kSseDone);  // the client's library raises it
              st->ended = true;
              if (ok) sink.done();
              log(st->line + " " + summary(r) + (ok ? "" : " (client gone before the end)"));
              return ok;
            }
            if (!write(sse_event(chunk_json(hh, "", false, finish_reason_name(r.reason), st->include_usage, i))))
              return gone(*st);
            st->finished[static_cast<size_t>(i)] = true;
            wrote = true;
          }
          if (!all_done) {
            if (!wrote && Clock::now() - st->last_write >= kKeepAlive && !write(": keep-alive\n\n")) return gone(*st);
            return true;
          }
          Usage usage;
          std::string summaries;
          for (size_t k = 0; k < st->jobs.size(); ++k) {
            const JobResult& r = st->jobs[k]->result();
            metrics.observe_request(r.total_seconds);
            if (k % static_cast<size_t>(st->n_per_prompt) == 0) {
              usage.prompt_tokens += r.prompt_tokens;
              usage.cached_tokens += r.cached_tokens;
            }
            usage.completion_tokens += r.completion_tokens;
            summaries += (summaries.empty() ? "" : " | ") + summary(r);
          }
          std::string tail;
          if (st->include_usage) tail += sse_event(usage_chunk_json(hh, usage));
          tail += kSseDone;
          const bool ok = write(tail);
          st->ended = true;
          if (ok) sink.done();
          log(st->line + " " + summaries + (ok ? "" : " (client gone before the end)"));
          return ok;
        },
        [this, st](bool success) {
          if (!success || !st->ended)
            for (const auto& job : st->jobs) scheduler.cancel(job);
        });
  }

  // The client went away mid-stream: cancel (the slot frees its KV cache at the next token) and say so.
  bool gone(StreamState& st) {
    for (const auto& job : st.jobs) scheduler.cancel(job);
    std::string summaries;
    for (const auto& job : st.jobs) {
      std::string text;
      while (!job->wait(text, kPoll)) {
      }
      summaries += (summaries.empty() ? "" : " | ") + summary(job->result());
    }
    st.ended = true;
    log(st.line + " " + summaries + " (client disconnected)");
    return false;
  }

  json health() const {
    const Gauges g = scheduler.gauges();
    return {{"status", "ok"},         {"model", model.id},           {"slots", g.slots},
            {"running", g.running},   {"queued", g.queued},          {"kv_cache_tokens", g.kv_tokens},
            {"kv_cache_bytes", g.kv_bytes}, {"rss_bytes", resident_bytes()}};
  }

  // An authenticated endpoint answering JSON: `answer` returns the body; an ApiError (the key's or the answer's)
  // becomes the API's error object.
  template <typename Answer>
  httplib::Server::Handler json_route(Answer answer) {
    return [this, answer](const httplib::Request& q, httplib::Response& s) {
      try {
        check_auth(q);
        s.set_content(dump_json(answer(q)), "application/json");
      } catch (const ApiError& e) {
        send_error(s, e);
      }
    };
  }

  void routes() {
    http.set_payload_max_length(options.max_body_bytes);
    // httplib's default sets SO_REUSEPORT, which lets a second server bind the same port and share its
    // connections; SO_REUSEADDR alone allows a restart over TIME_WAIT but makes a port in use an error.
    http.set_socket_options([this](auto sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_socket = static_cast<int>(sock);  // (the last one offered is the one that bound)
    });
    // A streamed answer is one small write a token: without TCP_NODELAY, Nagle's algorithm holds a token's chunk
    // until the client acknowledges the one before (as uvicorn, vLLM's server, and llama.cpp's server set it).
    // Accepted connections inherit it from the listening socket.
    http.set_tcp_nodelay(true);
    const int threads = options.threads > 0 ? options.threads
                                            : scheduler.options().slots + scheduler.options().queue + 8;
    http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    http.Post("/v1/chat/completions",
              [this](const httplib::Request& q, httplib::Response& s) { generate(Endpoint::Chat, q, s); });
    http.Post("/v1/completions",
              [this](const httplib::Request& q, httplib::Response& s) { generate(Endpoint::Completion, q, s); });
    // vLLM's /tokenize and /detokenize (also under /v1/, where OpenAI's clients' post() puts them).
    for (const char* prefix : {"", "/v1"}) {
      http.Post(std::string(prefix) + "/tokenize", json_route([this](const httplib::Request& q) {
        const TokenizeRequest r = parse_tokenize_request(q.body);
        const std::vector<int32_t> ids = tokenize_request(r, model);
        json j = {{"count", ids.size()}, {"max_model_len", model.context_length}, {"tokens", ids},
                  {"token_strs", nullptr}};
        if (r.token_strs) {
          j["token_strs"] = json::array();
          for (int32_t id : ids) j["token_strs"].push_back(model.tokenizer->token_to_piece(id));
        }
        return j;
      }));
      http.Post(std::string(prefix) + "/detokenize", json_route([this](const httplib::Request& q) {
        return json{{"prompt", detokenize_request(parse_detokenize_request(q.body), model)}};
      }));
    }
    // vLLM's /tokenizer_info (what lm-evaluation-harness's remote tokenizer reads before using /tokenize): the
    // special tokens' text and the context; no chat template (tessera's are C++, not Jinja).
    http.Get("/tokenizer_info", json_route([this](const httplib::Request&) {
      const model::Tokenizer& tok = *model.tokenizer;
      const auto piece = [&](int32_t id) { return id >= 0 ? json(tok.token_to_piece(id)) : json(nullptr); };
      return json{{"tokenizer_class", "tessera"},
                  {"eos_token", piece(tok.special().eos)},
                  {"bos_token", piece(tok.special().bos)},
                  {"pad_token", piece(tok.special().pad)},
                  {"unk_token", piece(tok.special().unk)},
                  {"add_bos_token", tok.special().add_bos},
                  {"model_max_length", model.context_length},
                  {"vocab_size", tok.vocab_size()},
                  {"chat_template", nullptr}};
    }));
    http.Get("/v1/models", json_route([this](const httplib::Request&) { return models_json(model); }));
    http.Get(R"(/v1/models/(.+))", json_route([this](const httplib::Request& q) {
      if (q.matches[1] != model.id)
        throw ApiError(404, "invalid_request_error",
                       "The model '" + std::string(q.matches[1]) + "' does not exist; this server serves '" +
                           model.id + "'",
                       "model", "model_not_found");
      return model_json(model);
    }));
    http.Get("/health", [this](const httplib::Request&, httplib::Response& s) {
      s.set_content(dump_json(health()), "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& s) {
      Gauges g = scheduler.gauges();
      if (model.prompt_tokens) {
        const PromptTokenCache::Stats p = model.prompt_tokens->stats();
        g.prompt_cache_hits = static_cast<int64_t>(p.hits);
        g.prompt_cache_bytes_reused = static_cast<int64_t>(p.bytes_reused);
        g.prompt_cache_bytes = static_cast<int64_t>(p.bytes);
      }
      s.set_content(metrics.prometheus(g), "text/plain; version=0.0.4");
    });
    // What httplib answers by itself (unknown routes, bodies over the limit) gets the API's error shape too.
    http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& q, httplib::Response& s) {
      if (!s.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string message = "HTTP " + std::to_string(s.status);
      std::string code;
      if (s.status == 404) {
        message = "Unknown request URL: " + q.method + " " + q.path;
        code = "unknown_url";
      } else if (s.status == 413) {
        message = "the request body is larger than the server's limit of " + std::to_string(options.max_body_bytes) +
                  " bytes (--max-body)";
        code = "body_too_large";
      } else if (s.status == 400) {
        message = "malformed HTTP request";
      }
      send_error(s, ApiError(s.status, s.status >= 500 ? "server_error" : "invalid_request_error", message, {}, code));
      log(q.method + " " + q.path + " " + std::to_string(s.status) + " " + message);
      return httplib::Server::HandlerResponse::Handled;
    }));
    http.set_exception_handler([this](const httplib::Request& q, httplib::Response& s, std::exception_ptr ep) {
      std::string message = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        message = std::string("internal error: ") + e.what();
      } catch (...) {
      }
      send_error(s, ApiError(500, "server_error", message));
      log(q.method + " " + q.path + " 500 " + message);
    });
    http.set_logger([this](const httplib::Request& q, const httplib::Response& s) {
      metrics.count_request(route_label(q.path), s.status);
    });
  }
};

HttpServer::HttpServer(HttpOptions options, const ServedModel& model, PolicyCache& policies, Scheduler& scheduler,
                       Metrics& metrics)
    : impl_(std::make_unique<Impl>(std::move(options), model, policies, scheduler, metrics)) {
  impl_->routes();
}

HttpServer::~HttpServer() = default;

constexpr int kListenBacklog = 1024;  // (uvicorn 2048, nginx 511)

int HttpServer::bind() {
  const HttpOptions& o = impl_->options;
  int port = o.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    check(port > 0, "serve: cannot listen on " + o.host + " (any port)");
  } else {
    check(impl_->http.bind_to_port(o.host, port),
          "serve: cannot listen on " + o.host + ":" + std::to_string(port) +
              " (in use, or not an address of this machine; --host / --port)");
  }
  // cpp-httplib's library listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into it): a burst of
  // clients then overflows the accept queue while the server is busy (the kernel's ListenOverflows counter; SYN
  // cookies, one of which failed and reset a client in tests/server/concurrency.py under CI's load). listen() on the
  // bound socket again sets the backlog (Linux; the kernel caps it at net.core.somaxconn).
  check(impl_->listen_socket >= 0 && ::listen(impl_->listen_socket, kListenBacklog) == 0,
        "serve: cannot set the listen backlog on " + o.host + ":" + std::to_string(port));
  return port;
}

void HttpServer::listen() { impl_->http.listen_after_bind(); }

void HttpServer::stop() { impl_->http.stop(); }

}  // namespace tessera::server
