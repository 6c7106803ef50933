// tessera/parallel/tp_service.h — a tensor-parallel model behind one front end: `tessera serve --gpus N`.
//
// Rank 0 runs the server (HTTP, scheduler, tokenizer, sampling); the other ranks only run the model. Every forward
// pass must run on every rank in the same order (each layer all-reduces), so rank 0 sends each step to the others
// as a command before running it itself:
//
//   rank 0 (a server slot)                          ranks 1..N-1 (tp_serve_worker)
//   TpLeader::begin(policy)      -> kBegin + the policy's JSON        set the policy
//   TpLeader::prefill(tokens)    -> kChunk per prefill chunk          run the chunk at pos
//   TpLeader::decode(token)      -> kDecode                           run the token at pos
//   TpLeader::end()              -> kEnd                              (the sequence is over; the next kBegin resets)
//   TpLeader::quit()             -> kQuit                             return
//
// runtime::generate_tokens drives TpLeader as it drives the single-sequence engines (prefill / decode / position
// / max_context), so sampling, stop tokens and a client that goes away are the server's usual code: rank 0 samples
// and the others never need the token until it is decoded. A request aborted between prefill chunks stops sending
// chunks and sends kEnd: every rank has run the same chunks.
//
// The transport (CommandChannel) and the forward pass (RankForward) are interfaces: NCCL broadcasts and the
// tensor-parallel GPU engine in parallel/cuda/tp_service_cuda.h; in-process queues and the CPU engine in the tests.
//
// Wire format of a command: a header of kHeaderInts int32 {kMagic, op, pos, total_len, token count, policy bytes,
// flags, 0}, then (when either count is non-zero) a payload of token count + ceil(policy bytes / 4) int32: the tokens,
// then the policy JSON's bytes packed 4 to an int32, little-endian.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "attention/pattern/config_io.h"
#include "attention/pattern/policy.h"

namespace tessera::parallel {

enum class TpOp : int32_t {
  kBegin = 1, kChunk = 2, kDecode = 3, kEnd = 4, kQuit = 5,
  // The batched backend's calls (parallel/tp_batch.h: `serve --gpus N --parallel M`); their arguments in `tokens`.
  kStore = 6, kPrefill = 7, kFinish = 8, kRelease = 9, kAbort = 10, kLoadPrefix = 11, kBatchDecode = 12,
};
inline constexpr int32_t kTpLastOp = 12;

struct TpCommand {
  TpOp op = TpOp::kEnd;
  int32_t pos = 0;        // kChunk / kDecode: the first token's position
  int32_t total_len = 0;  // kChunk: the prompt's length (the lowering's total)
  std::vector<int32_t> tokens;
  std::string policy_json;  // kBegin: the policy (empty: dense)
  int32_t flags = 0;        // the batched calls' flags (parallel/tp_batch.h)
  bool operator==(const TpCommand&) const = default;
};

inline TpCommand tp_command(TpOp op, int32_t pos = 0, int32_t total_len = 0, std::vector<int32_t> tokens = {},
                            std::string policy_json = {}) {
  return TpCommand{op, pos, total_len, std::move(tokens), std::move(policy_json)};
}

inline constexpr int32_t kTpMagic = 0x54505331;  // "TPS1"
inline constexpr size_t kTpHeaderInts = 8;
using TpHeader = std::array<int32_t, kTpHeaderInts>;

// Encodes a command; the payload is empty when the command carries no tokens and no policy.
TpHeader encode_header(const TpCommand& c);
std::vector<int32_t> encode_payload(const TpCommand& c);
// How many payload int32 follow a header. Throws tessera::Error for a header that is not a command:
//   "tensor-parallel command: bad magic 0x00000000 (ranks out of step?)", "... unknown op 9",
//   "... 2000000000 tokens, more than 16777216"
size_t payload_ints(const TpHeader& h);
TpCommand decode_command(const TpHeader& h, std::span<const int32_t> payload);

class CommandChannel {
 public:
  virtual ~CommandChannel() = default;
  virtual void send(const TpCommand& c) = 0;  // rank 0
  virtual TpCommand receive() = 0;            // the other ranks (blocks)
};

// One rank's share of the model: runs tokens at [pos, pos + n) under `policy` (null: dense) and returns the last
// token's logits (rank 0 uses them; the others may return nothing).
class RankForward {
 public:
  virtual ~RankForward() = default;
  virtual std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                                 int32_t total_len) = 0;
};

// Ranks 1..N-1: executes commands until kQuit. Returns the number of forward passes run.
int64_t tp_serve_worker(CommandChannel& channel, RankForward& forward, const attn::PolicyShape& shape);

// Rank 0's engine for one sequence at a time (the generate_tokens concept).
class TpLeader {
 public:
  // chunk: prefill chunk in tokens (> 0); max_context: the KV caches' room on every rank.
  TpLeader(CommandChannel& channel, RankForward& forward, int32_t max_context, int32_t chunk);

  void begin(const attn::AttentionPolicy& policy);
  // Runs the prompt in chunks; after each, progress(done, total) may throw to abort (kEnd then goes out and the
  // exception propagates).
  std::vector<float> prefill(std::span<const int32_t> tokens,
                             const std::function<void(int64_t, int64_t)>& progress = {});
  std::vector<float> decode(int32_t token);
  void end();
  void quit();
  int32_t position() const { return pos_; }
  int32_t max_context() const { return max_context_; }

 private:
  CommandChannel& channel_;
  RankForward& forward_;
  int32_t max_context_, chunk_;
  int32_t pos_ = 0;
  attn::AttentionPolicy policy_;
  bool open_ = false;
};

}  // namespace tessera::parallel
