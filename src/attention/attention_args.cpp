#include "attention/attention_args.h"

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"

namespace tessera::attn {

float AttentionArgs::effective_scale() const {
  return scale != 0 ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim())));
}

void validate(const AttentionArgs& a) {
  a.q.expect_shape("attention q", {-1, -1, -1});
  a.q.expect_dtype("attention q", {DType::F32, DType::BF16});
  check(a.q.data != nullptr || a.q.numel() == 0, "attention q: data is null");
  const int64_t q_len = a.q.dim(0), hq = a.q.dim(1), d = a.q.dim(2);
  check(d > 0, "attention q: head_dim must be positive, got " + std::to_string(d));
  check(hq > 0, "attention q: needs at least one query head");

  a.k.expect_shape("attention k", {-1, -1, d});
  a.k.expect_dtype("attention k", {DType::F32, DType::BF16, DType::F16});
  const int64_t kv_len = a.k.dim(0), hkv = a.k.dim(1);
  check(hkv > 0, "attention k: needs at least one kv head");
  a.v.expect_shape("attention v", {kv_len, hkv, d});
  a.v.expect_dtype("attention v", {DType::F32, DType::BF16, DType::F16});
  check(hq % hkv == 0, "attention: " + std::to_string(hq) + " query heads are not a multiple of " +
                           std::to_string(hkv) + " kv heads");

  a.out.expect_shape("attention out", {q_len, hq, d});
  a.out.expect_dtype("attention out", {DType::F32});
  if (a.has_lse()) {
    a.lse.expect_shape("attention lse", {hq, q_len});
    a.lse.expect_dtype("attention lse", {DType::F32});
  }

  check(a.q_begin >= 0, "attention: q_begin must be >= 0, got " + std::to_string(a.q_begin));
  check(static_cast<int64_t>(a.q_begin) + q_len <= std::numeric_limits<int32_t>::max() &&
            kv_len <= std::numeric_limits<int32_t>::max(),
        "attention: positions must fit in int32");
  check(kv_len >= a.q_begin + q_len,
        "attention: kv_len " + std::to_string(kv_len) + " is less than q_begin + q_len = " +
            std::to_string(a.q_begin + q_len) + " (every query must see its own position)");
  check(a.window >= 0, "attention: window must be >= 0 (0: no window), got " + std::to_string(a.window));
  check(std::isfinite(a.scale), "attention: scale must be finite, got " + std::to_string(a.scale));
  if (q_len > 0) {
    check(a.k.data != nullptr && a.v.data != nullptr, "attention: k or v data is null");
    check(a.out.data != nullptr, "attention out: data is null");
  }
}

}  // namespace tessera::attn
