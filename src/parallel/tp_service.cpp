#include "parallel/tp_service.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "attention/pattern/config_io.h"
#include "core/error.h"

namespace tessera::parallel {

namespace {

constexpr int64_t kMaxTokens = int64_t{1} << 24;       // tokens in one command
constexpr int64_t kMaxPolicyBytes = int64_t{64} << 20;  // as a policy file

std::string where() { return "tensor-parallel command: "; }

}  // namespace

TpHeader encode_header(const TpCommand& c) {
  return {kTpMagic, static_cast<int32_t>(c.op), c.pos, c.total_len, static_cast<int32_t>(c.tokens.size()),
          static_cast<int32_t>(c.policy_json.size()), c.flags, 0};
}

std::vector<int32_t> encode_payload(const TpCommand& c) {
  std::vector<int32_t> p(c.tokens.begin(), c.tokens.end());
  const size_t words = (c.policy_json.size() + 3) / 4;
  const size_t at = p.size();
  p.resize(at + words, 0);
  if (!c.policy_json.empty()) std::memcpy(p.data() + at, c.policy_json.data(), c.policy_json.size());
  return p;
}

size_t payload_ints(const TpHeader& h) {
  if (h[0] != kTpMagic) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%08x", static_cast<unsigned>(h[0]));
    throw Error(where() + "bad magic " + buf + " (ranks out of step?)");
  }
  if (h[1] < static_cast<int32_t>(TpOp::kBegin) || h[1] > kTpLastOp)
    throw Error(where() + "unknown op " + std::to_string(h[1]));
  check(h[4] >= 0 && h[4] <= kMaxTokens,
        where() + std::to_string(h[4]) + " tokens, outside [0, " + std::to_string(kMaxTokens) + "]");
  check(h[5] >= 0 && h[5] <= kMaxPolicyBytes,
        where() + "a policy of " + std::to_string(h[5]) + " bytes, outside [0, " + std::to_string(kMaxPolicyBytes) + "]");
  check(h[2] >= 0 && h[3] >= 0, where() + "negative position or length");
  return static_cast<size_t>(h[4]) + (static_cast<size_t>(h[5]) + 3) / 4;
}

TpCommand decode_command(const TpHeader& h, std::span<const int32_t> payload) {
  const size_t n = payload_ints(h);
  check(payload.size() == n, where() + "the payload holds " + std::to_string(payload.size()) +
                                 " int32, the header announces " + std::to_string(n));
  TpCommand c;
  c.op = static_cast<TpOp>(h[1]);
  c.pos = h[2];
  c.total_len = h[3];
  c.flags = h[6];
  c.tokens.assign(payload.begin(), payload.begin() + h[4]);
  c.policy_json.resize(static_cast<size_t>(h[5]));
  if (h[5] > 0) std::memcpy(c.policy_json.data(), payload.data() + h[4], static_cast<size_t>(h[5]));
  return c;
}

int64_t tp_serve_worker(CommandChannel& channel, RankForward& forward, const attn::PolicyShape& shape) {
  attn::AttentionPolicy policy;
  int64_t passes = 0;
  for (;;) {
    const TpCommand c = channel.receive();
    switch (c.op) {
      case TpOp::kBegin:
        policy = c.policy_json.empty()
                     ? attn::AttentionPolicy()
                     : attn::load_policy_json(nlohmann::json::parse(c.policy_json), "the leader's policy", shape);
        break;
      case TpOp::kChunk:  // prefill under the sequence's policy
        forward.run(c.tokens, c.pos, policy.table().empty() ? nullptr : &policy, c.total_len);
        ++passes;
        break;
      case TpOp::kDecode:  // decode attends densely (as TpLeader::decode)
        forward.run(c.tokens, c.pos, nullptr, c.total_len);
        ++passes;
        break;
      case TpOp::kEnd:
        break;
      case TpOp::kQuit:
        return passes;
      default:
        throw Error("tensor-parallel worker: op " + std::to_string(static_cast<int32_t>(c.op)) +
                    " is the batched backend's (parallel/tp_batch.h), not the single-sequence worker's");
    }
  }
}

TpLeader::TpLeader(CommandChannel& channel, RankForward& forward, int32_t max_context, int32_t chunk)
    : channel_(channel), forward_(forward), max_context_(max_context), chunk_(chunk) {
  check(chunk > 0, "tensor-parallel server: the prefill chunk must be positive");
}

void TpLeader::begin(const attn::AttentionPolicy& policy) {
  if (open_) end();
  policy_ = policy;
  pos_ = 0;
  TpCommand c = tp_command(TpOp::kBegin);
  if (!policy.table().empty()) c.policy_json = attn::save_policy_json(policy).dump();
  channel_.send(c);
  open_ = true;
}

std::vector<float> TpLeader::prefill(std::span<const int32_t> tokens,
                                     const std::function<void(int64_t, int64_t)>& progress) {
  check(open_, "tensor-parallel server: prefill before begin");
  const auto n = static_cast<int32_t>(tokens.size());
  check(pos_ + n <= max_context_, "tensor-parallel server: " + std::to_string(pos_ + n) +
                                      " tokens, over the context of " + std::to_string(max_context_));
  const attn::AttentionPolicy* policy = policy_.table().empty() ? nullptr : &policy_;
  std::vector<float> logits;
  const int32_t total = pos_ + n;
  for (int32_t done = 0; done < n; done += chunk_) {
    const int32_t m = std::min(chunk_, n - done);
    TpCommand c = tp_command(TpOp::kChunk, pos_, total);
    c.tokens.assign(tokens.begin() + done, tokens.begin() + done + m);
    channel_.send(c);
    logits = forward_.run(c.tokens, pos_, policy, total);
    pos_ += m;
    if (progress) {
      try {
        progress(done + m, n);
      } catch (...) {
        end();
        throw;
      }
    }
  }
  return logits;
}

std::vector<float> TpLeader::decode(int32_t token) {
  check(open_, "tensor-parallel server: decode before begin");
  check(pos_ < max_context_, "tensor-parallel server: the context of " + std::to_string(max_context_) + " is full");
  TpCommand c = tp_command(TpOp::kDecode, pos_, pos_ + 1, {token});
  channel_.send(c);
  std::vector<float> logits = forward_.run(c.tokens, pos_, nullptr, pos_ + 1);
  ++pos_;
  return logits;
}

void TpLeader::end() {
  if (!open_) return;
  channel_.send(tp_command(TpOp::kEnd));
  open_ = false;
}

void TpLeader::quit() {
  end();
  channel_.send(tp_command(TpOp::kQuit));
}

}  // namespace tessera::parallel
