// The small streaming-memory sizes of the CPU tests (runtime_stream_test, batch_engine_test): a prompt of ~100
// tokens already evicts blocks and retrieves them.
#pragma once

#include "runtime/stream/stream_options.h"

namespace tessera::runtime {

inline StreamOptions small_stream(StreamMethod m) {
  StreamOptions o;
  o.method = m;
  o.sinks = 8;
  o.local = 32;
  o.block = 16;
  o.chunk = 16;
  o.top_k = 2;
  return o;
}

}  // namespace tessera::runtime
