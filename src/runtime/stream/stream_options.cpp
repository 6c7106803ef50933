#include "runtime/stream/stream_options.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/enum_names.h"
#include "core/error.h"
#include "runtime/stream/span_index.h"

namespace tessera::runtime {

namespace {
constexpr std::string_view kMethodNames[] = {"none", "streamingllm", "infllm", "ltri"};  // StreamMethod's order
}  // namespace

StreamMethod parse_stream_method(const std::string& name, const std::string& what) {
  if (name.empty()) return StreamMethod::None;
  if (const std::optional<StreamMethod> m = enum_value<StreamMethod>(kMethodNames, name)) return *m;
  throw Error(what + " must be ltri, infllm or streamingllm, got '" + name + "'");
}

const char* stream_method_name(StreamMethod m) { return enum_name(kMethodNames, m).data(); }

std::vector<RetrievalHead> read_retrieval_heads(const std::string& path) {
  std::ifstream in(path);
  check(static_cast<bool>(in), path + ": cannot read the retrieval heads file");
  std::vector<RetrievalHead> heads;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    RetrievalHead h;
    check(static_cast<bool>(ls >> h.layer >> h.head >> h.score),
          path + ":" + std::to_string(n) + ": expected \"layer head score\", got '" + line + "'");
    heads.push_back(h);
  }
  return heads;
}

int64_t StreamOptions::attended_tokens() const {
  const int64_t k = method == StreamMethod::StreamingLLM ? 0 : top_k;
  return static_cast<int64_t>(sinks) + k * block + local + block - 1 + chunk;
}

StreamOptions streamingllm_equal_memory(StreamOptions o) {
  o.local += o.top_k * o.block;
  o.top_k = 0;
  o.method = StreamMethod::StreamingLLM;
  return o;
}

void check_stream_options(const StreamOptions& o) {
  auto positive = [](int64_t v, const char* flag) {
    check(v > 0, std::string(flag) + " must be positive, got " + std::to_string(v));
  };
  check(o.sinks >= 0, "--stream-sinks must not be negative, got " + std::to_string(o.sinks));
  positive(o.local, "--stream-local");
  positive(o.chunk, "--stream-chunk");
  positive(o.block, "--stream-block");
  check(o.last_chunk >= 0, "--stream-last-chunk must not be negative, got " + std::to_string(o.last_chunk));
  check(o.top_k >= 0, "--stream-top-k must not be negative, got " + std::to_string(o.top_k));
  check(o.host_budget >= 0, "--stream-host-budget must not be negative");
  check(o.theta_quantile >= 0 && o.theta_quantile <= 1, "the span threshold quantile must be in [0, 1]");
  check(o.iou >= 0 && o.iou <= 1, "the NMS IoU threshold must be in [0, 1]");
  check(o.lambda > 0 && o.lambda_early > 0, "the retention slope lambda must be positive");
  check(o.min_vectors >= 1 && o.max_vectors >= o.min_vectors,
        "index vectors per span: need 1 <= min (" + std::to_string(o.min_vectors) + ") <= max (" +
            std::to_string(o.max_vectors) + ")");
  positive(o.repr_keys, "InfLLM representative keys");
  if (o.index_ratio != 0) stream::check_index_ratio(o.index_ratio);
}

int64_t stream_chunk_end(const StreamOptions& o, int64_t c0, int64_t n) {
  const int64_t tail = o.last_chunk > 0 && o.last_chunk < o.chunk ? std::max<int64_t>(0, n - o.last_chunk) : n;
  return c0 < tail ? std::min<int64_t>(tail, c0 + o.chunk) : n;
}

}  // namespace tessera::runtime
