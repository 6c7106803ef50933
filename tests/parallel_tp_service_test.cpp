// `tessera serve --gpus N` (parallel/tp_service.h): the command wire format, and rank 0's TpLeader driven by the server's
// generate_tokens with worker ranks on threads — every rank runs the same forward passes in the same order, through
// prompts in chunks, decoding, stop tokens, a request aborted mid-prefill and the next request.
#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "parallel/tp_service.h"
#include "runtime/generation.h"
#include "test_support.h"
#include "tp_wire.h"

using namespace tessera;
using namespace tessera::parallel;

namespace {

using namespace tessera::test;

// A "model" whose logits depend on every token it has seen and on the policy: the next token is
// (sum of all tokens so far * 31 + pos + (sparse ? 7 : 0)) mod vocab. Records every pass.
struct Pass {
  std::vector<int32_t> tokens;
  int32_t pos, total_len;
  bool sparse;
  bool operator==(const Pass&) const = default;
};

class RecordingForward final : public RankForward {
 public:
  static constexpr int32_t kVocab = 50;
  std::vector<float> run(std::span<const int32_t> tokens, int32_t pos, const attn::AttentionPolicy* policy,
                         int32_t total_len) override {
    if (pos == 0) sum_ = 0;
    for (int32_t t : tokens) sum_ += t;
    passes.push_back({{tokens.begin(), tokens.end()}, pos, total_len, policy != nullptr});
    std::vector<float> logits(kVocab, 0.0f);
    const int64_t end = pos + static_cast<int64_t>(tokens.size());
    logits[static_cast<size_t>((sum_ * 31 + end + (policy ? 7 : 0)) % kVocab)] = 1.0f;
    return logits;
  }
  std::vector<Pass> passes;

 private:
  int64_t sum_ = 0;
};

struct Aborted {};

}  // namespace

TEST(TpService, CommandsRoundTripThroughTheWireFormat) {
  const std::vector<TpCommand> cmds = {
      tp_command(TpOp::kBegin, 0, 0, {}, R"({"tessera_policy":1,"x":"abc"})"),
      tp_command(TpOp::kChunk, 4096, 9000, {1, 2, 3, 40000}), tp_command(TpOp::kDecode, 9000, 9001, {7}),
      tp_command(TpOp::kEnd), tp_command(TpOp::kQuit)};
  for (const TpCommand& c : cmds) {
    const TpHeader h = encode_header(c);
    const std::vector<int32_t> p = encode_payload(c);
    EXPECT_EQ(payload_ints(h), p.size());
    EXPECT_EQ(decode_command(h, p), c);
  }
  TpHeader bad = encode_header(cmds[1]);
  bad[0] = 0;
  EXPECT_EQ(error_of([&] { payload_ints(bad); }), "tensor-parallel command: bad magic 0x00000000 (ranks out of step?)");
  bad = encode_header(cmds[1]);
  bad[1] = 13;
  EXPECT_EQ(error_of([&] { payload_ints(bad); }), "tensor-parallel command: unknown op 13");
  bad = encode_header(cmds[1]);
  bad[4] = 2000000000;
  EXPECT_EQ(error_of([&] { payload_ints(bad); }), "tensor-parallel command: 2000000000 tokens, outside [0, 16777216]");
  EXPECT_EQ(error_of([&] { decode_command(encode_header(cmds[1]), std::vector<int32_t>{1, 2}); }),
            "tensor-parallel command: the payload holds 2 int32, the header announces 4");
}

TEST(TpService, WorkersRunWhatRankZeroRuns) {
  constexpr int kWorkers = 3;
  const attn::PolicyShape shape{2, 4, 2};
  std::vector<Wire> wires(kWorkers);
  std::vector<Wire*> wp;
  for (Wire& w : wires) wp.push_back(&w);
  LeaderChannel lc(wp);
  RecordingForward leader_fwd;
  std::vector<RecordingForward> worker_fwd(kWorkers);
  std::vector<int64_t> worker_passes(kWorkers, -1);
  std::vector<std::thread> workers;
  for (int r = 0; r < kWorkers; ++r)
    workers.emplace_back([&, r] {
      WorkerChannel wc(wires[static_cast<size_t>(r)]);
      worker_passes[static_cast<size_t>(r)] = tp_serve_worker(wc, worker_fwd[static_cast<size_t>(r)], shape);
    });

  TpLeader leader(lc, leader_fwd, /*max_context=*/64, /*chunk=*/5);
  runtime::GenerateOptions gen;
  gen.max_new_tokens = 6;
  // Request 1: dense, a 12-token prompt in chunks of 5, 6 tokens.
  const std::vector<int32_t> prompt1 = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
  leader.begin(attn::AttentionPolicy());
  const std::vector<int32_t> out1 = runtime::generate_tokens(leader, prompt1, gen, {}, [](int32_t) {});
  leader.end();
  EXPECT_EQ(out1.size(), 6u);
  // Request 2: a sparse policy (its JSON travels to the workers), stopped by a stop token.
  attn::AttentionPolicy sparse = attn::AttentionPolicy::uniform(2, 4, 2, attn::AShapePattern{4, 8});
  leader.begin(sparse);
  runtime::GenerateOptions gen2 = gen;
  std::vector<int32_t> out2 = runtime::generate_tokens(leader, std::vector<int32_t>{7, 7, 7}, gen2, {}, [](int32_t) {});
  leader.end();
  ASSERT_FALSE(out2.empty());
  gen2.stop_tokens = {out2[1]};  // the same request again stops before its second token
  leader.begin(sparse);
  const std::vector<int32_t> out3 = runtime::generate_tokens(leader, std::vector<int32_t>{7, 7, 7}, gen2, {}, [](int32_t) {});
  leader.end();
  EXPECT_EQ(out3, std::vector<int32_t>{out2[0]});
  // Request 3: aborted after the first of three prefill chunks (a client gone), then request 1 again.
  leader.begin(attn::AttentionPolicy());
  EXPECT_THROW(leader.prefill(prompt1, [](int64_t done, int64_t) {
    if (done >= 5) throw Aborted{};
  }),
               Aborted);
  leader.begin(attn::AttentionPolicy());
  EXPECT_EQ(runtime::generate_tokens(leader, prompt1, gen, {}, [](int32_t) {}), out1);
  leader.quit();
  for (std::thread& t : workers) t.join();

  // Every rank ran the same passes: prompts in chunks of 5 (pos, total), decodes one token at a time; the sparse
  // policy on prefill chunks only.
  ASSERT_FALSE(leader_fwd.passes.empty());
  for (int r = 0; r < kWorkers; ++r) {
    EXPECT_EQ(worker_fwd[static_cast<size_t>(r)].passes, leader_fwd.passes) << "worker " << r;
    EXPECT_EQ(worker_passes[static_cast<size_t>(r)], static_cast<int64_t>(leader_fwd.passes.size()));
  }
  const std::vector<Pass>& p = leader_fwd.passes;
  EXPECT_EQ(p[0], (Pass{{3, 1, 4, 1, 5}, 0, 12, false}));
  EXPECT_EQ(p[1], (Pass{{9, 2, 6, 5, 3}, 5, 12, false}));
  EXPECT_EQ(p[2], (Pass{{5, 8}, 10, 12, false}));
  EXPECT_EQ(p[3].pos, 12);
  EXPECT_EQ(p[3].tokens, std::vector<int32_t>{out1[0]});
  // Request 2's prefill is sparse, its decode dense.
  EXPECT_EQ(p[8], (Pass{{7, 7, 7}, 0, 3, true}));
  EXPECT_FALSE(p[9].sparse);

  // Errors: over the context, decode before begin.
  leader.begin(attn::AttentionPolicy());
  EXPECT_EQ(error_of([&] { leader.prefill(std::vector<int32_t>(65, 1)); }),
            "tensor-parallel server: 65 tokens, over the context of 64");
  TpLeader fresh(lc, leader_fwd, 64, 5);
  EXPECT_EQ(error_of([&] { fresh.decode(1); }), "tensor-parallel server: decode before begin");
}
