// tessera/server/http/http_server.h — the HTTP face of `tessera serve` (cpp-httplib): routes, auth, streaming.
//
//   POST /v1/chat/completions, POST /v1/completions   generation (JSON, or server-sent events with "stream")
//   GET  /v1/models, /v1/models/{id}                  the served model
//   GET  /health                                      JSON: status, slots, running, queued, KV use, RSS
//   GET  /metrics                                     Prometheus text (metrics.h)
//
// Everything that does not need a socket lives beside it in src/server (request parsing, preparation, response
// JSON, the scheduler): this file only moves bytes. Each request is one line on stdout. With an API key, the
// /v1 routes need "Authorization: Bearer KEY" (401 otherwise); /health and /metrics stay open. A streamed
// request whose client goes away is cancelled (a failed write, or a keep-alive comment written every second
// while no token comes, notices it), which frees its slot and KV cache.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "server/metrics.h"
#include "server/policy_cache.h"
#include "server/request_prep.h"
#include "server/scheduler.h"

namespace httplib {
class Server;
}

namespace tessera::server {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                              // 0: any free port (bind() returns it)
  std::string api_key;                          // empty: no auth
  size_t max_body_bytes = 8u << 20;             // larger bodies get 413
  double timeout_seconds = 600;                 // per request, from arrival (queueing included)
  int threads = 0;                              // HTTP worker threads; 0: slots + queue + 8
  bool log_requests = true;                     // one line per request on stdout
};

class HttpServer {
 public:
  HttpServer(HttpOptions options, const ServedModel& model, PolicyCache& policies, Scheduler& scheduler,
             Metrics& metrics);
  ~HttpServer();

  // Binds host:port; returns the port. Throws tessera::Error when it cannot.
  int bind();
  // Serves until stop() (from another thread or a signal-watching thread).
  void listen();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::server
