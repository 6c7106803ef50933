// tessera/attention/index/lowering_context.h — the shape of one prefill call, as the index sees it.
#pragma once

#include <cstdint>

namespace tessera::attn {

struct LoweringContext {
  int32_t q_begin = 0;    // absolute position of the first query of this call (chunked prefill: chunk start)
  int32_t q_len = 0;      // queries in this call
  int32_t kv_len = 0;     // keys available: normally q_begin + q_len
  int32_t total_len = 0; // N: length of the whole prompt (MoA span, Triangle's last rows); 0 means kv_len
  int32_t tile = 64;      // query-tile height of the index to build

  int32_t n() const { return total_len > 0 ? total_len : kv_len; }

  // A whole-prompt prefill of S tokens.
  static LoweringContext prefill(int32_t seq_len, int32_t tile = 64) {
    return LoweringContext{0, seq_len, seq_len, seq_len, tile};
  }
};

}  // namespace tessera::attn
