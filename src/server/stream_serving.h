// tessera/server/stream_serving.h — `tessera serve --stream`: every request through streaming memory.
//
// With --stream (docs/streaming.md) a request's prompt may be longer than the model's trained context: what bounds
// it is the host memory the evicted KV blocks need (StreamingKV::check_sequence). The server states that bound as
// its context length (GET /v1/models, and the 400 context_length_exceeded answer), so a client learns it before
// sending a prompt the engine would refuse halfway.
#pragma once

#include <cstdint>
#include <string>

#include "model/model_config.h"
#include "runtime/stream/stream_options.h"
#include "runtime/stream/streaming_kv.h"

namespace tessera::server {

// The longest sequence (prompt + completion) an engine streaming with `options` accepts: the largest n for which
// StreamingKV(config, options, storage).check_sequence(n) passes, at most `cap`. Throws tessera::Error for a model
// that cannot stream or bad options (StreamingKV's own messages). streamingllm keeps no evicted block: `cap`.
int32_t streaming_context_limit(const runtime::ModelConfig& config, const runtime::StreamOptions& options,
                                runtime::StreamingKV::Storage storage, int32_t cap);

// "ltri (sinks 128, local 4096, chunk 512, blocks of 128, top 32; host budget 12.0 GB)": the startup line's words;
// streamingllm: "streamingllm (sinks 128, local 8192, chunk 512, blocks of 128; evicted blocks dropped: no host memory)".
std::string describe_streaming(const runtime::StreamOptions& options, int64_t host_budget);

}  // namespace tessera::server
