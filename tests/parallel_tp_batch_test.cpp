// The batched engine over tensor-parallel ranks (parallel/tp_batch.h; `serve --gpus N --parallel M`): the batched
// calls through the wire format; rank 0's scheduler driving follower ranks on threads, every follower making the same
// backend calls with the same arguments — block tables included, which travel as changes — through chunked prompts,
// sampling, prefix-cache hits, a request cancelled mid-prefill, prompt log-probabilities, MoA decode windows and
// sliding windows that free blocks; and the per-rank CPU twin (each rank its own backend over its shard, partial
// sums all-reduced between threads) generating the one-rank batched engine's tokens.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "model/model.h"
#include "parallel/placement.h"
#include "parallel/tp_batch.h"
#include "parallel/tp_forward_cpu.h"
#include "runtime/batch_engine.h"
#include "test_support.h"
#include "tp_wire.h"

using namespace tessera;
using namespace tessera::parallel;

namespace {

using namespace tessera::test;

std::string tables_of(const runtime::SequenceBlocks& s) {
  std::ostringstream o;
  o << "len " << s.length() << " tables";
  for (size_t i = 0; i < s.tables(); ++i) {
    o << " [";
    for (int32_t b : s.table(i)) o << b << ",";
    o << "]";
  }
  return o.str();
}

// A backend that logs every call (with the block tables of the sequences it names) and passes it on.
class Recorder final : public runtime::BatchBackend {
 public:
  explicit Recorder(runtime::BatchBackend& inner) : inner_(inner) {}
  const runtime::ModelConfig& config() const override { return inner_.config(); }
  const char* device_name() const override { return inner_.device_name(); }
  double block_bytes(const runtime::PagedKVShape& s) const override { return inner_.block_bytes(s); }
  double default_kv_bytes() const override { return inner_.default_kv_bytes(); }
  void create_store(const runtime::PagedKVShape& s, int32_t blocks, int32_t seqs, int32_t ctx) override {
    log("store " + std::to_string(s.num_layers) + " " + std::to_string(s.num_kv_heads) + " " +
        std::to_string(s.head_dim) + " " + std::to_string(s.block_tokens) + " " + std::to_string(blocks) + " " +
        std::to_string(seqs) + " " + std::to_string(ctx));
    inner_.create_store(s, blocks, seqs, ctx);
  }
  std::vector<float> prefill_chunk(std::span<const int32_t> t, int32_t pos, int32_t total,
                                   const attn::AttentionPolicy* p, bool logits) override {
    log("prefill " + chunk(t, pos, total, p) + (logits ? " logits" : ""));
    return inner_.prefill_chunk(t, pos, total, p, logits);
  }
  bool supports_prompt_logits() const override { return true; }
  std::vector<float> prefill_chunk_rows(std::span<const int32_t> t, int32_t pos, int32_t total,
                                        const attn::AttentionPolicy* p) override {
    log("prefill rows " + chunk(t, pos, total, p));
    return inner_.prefill_chunk_rows(t, pos, total, p);
  }
  void finish_prefill(const runtime::SequenceBlocks& seq, std::span<const runtime::DecodeView> views) override {
    std::string v;
    for (const runtime::DecodeView& d : views)
      v += " " + std::to_string(d.sink) + "/" + std::to_string(d.window) + "/" + std::to_string(d.horizon);
    log("finish " + tables_of(seq) + " views" + v);
    inner_.finish_prefill(seq, views);
  }
  void release_sequence(const runtime::SequenceBlocks& seq) override {
    log("release " + tables_of(seq));
    inner_.release_sequence(seq);
  }
  void abort_prefill() override {
    log("abort");
    inner_.abort_prefill();
  }
  bool supports_prefix_cache() const override { return true; }
  void load_prefix(const runtime::SequenceBlocks& seq, int32_t rows, int32_t total) override {
    log("load " + std::to_string(rows) + " " + std::to_string(total) + " " + tables_of(seq));
    inner_.load_prefix(seq, rows, total);
  }
  std::vector<float> decode(std::span<const int32_t> t, std::span<const runtime::DecodeRow> rows) override {
    log_decode(t, rows);
    return inner_.decode(t, rows);
  }
  std::vector<int32_t> decode_select(std::span<const int32_t> t, std::span<const runtime::DecodeRow> rows,
                                     std::span<const RowChoice> choice) override {
    log_decode(t, rows);
    return inner_.decode_select(t, rows, choice);
  }
  runtime::ForwardTimers timers() const override { return {}; }
  std::vector<std::string> calls;

 private:
  void log(std::string s) { calls.push_back(std::move(s)); }
  static std::string chunk(std::span<const int32_t> t, int32_t pos, int32_t total, const attn::AttentionPolicy* p) {
    std::string s = std::to_string(pos) + "/" + std::to_string(total) + (p != nullptr && !p->table().empty() ? " sparse" : " dense") + " [";
    for (int32_t x : t) s += std::to_string(x) + ",";
    return s + "]";
  }
  void log_decode(std::span<const int32_t> t, std::span<const runtime::DecodeRow> rows) {
    std::string s = "decode";
    for (size_t i = 0; i < rows.size(); ++i) s += " | " + std::to_string(t[i]) + " " + tables_of(*rows[i].seq);
    log(s);
  }
  runtime::BatchBackend& inner_;
};

std::vector<int32_t> prompt(int32_t n, int32_t vocab, int32_t salt) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 37 + 11 + salt * 101) % vocab;
  return t;
}

// Requests of the given prompt lengths; every second one sampled; `policy` on the third; the fifth repeats the
// first's prompt plus a tail (a prefix-cache hit); the sixth asks for its prompt's log-probabilities.
std::vector<runtime::BatchRequest> requests(const std::vector<int32_t>& lengths, int32_t vocab,
                                            const attn::AttentionPolicy* policy) {
  std::vector<runtime::BatchRequest> reqs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    runtime::BatchRequest r;
    r.prompt = prompt(lengths[i], vocab, static_cast<int32_t>(i));
    if (i == 4) {
      r.prompt = reqs[0].prompt;
      r.prompt.insert(r.prompt.end(), {5, 6, 7});
    }
    r.options.max_new_tokens = 9 + static_cast<int32_t>(i) * 3;
    if (i % 2 == 1) {
      r.options.sampling.temperature = 0.8f;
      r.options.sampling.top_k = 20;
      r.options.sampling.seed = 700 + i;
    }
    if (i == 2 && policy != nullptr) r.policy = *policy;
    if (i == 5) r.prompt_logprobs = 2;
    reqs.push_back(r);
  }
  return reqs;
}

runtime::BatchEngineOptions engine_options() {
  runtime::BatchEngineOptions o;
  o.chunk_size = 16;
  o.block_tokens = 8;
  o.max_batch = 3;
  return o;
}

// Runs `reqs` through a BatchEngine over `backend` step by step, cancelling request `cancel` (submission index)
// after its first prefill chunk; returns every request's tokens.
std::vector<std::vector<int32_t>> run_engine(runtime::BatchBackend& backend, const std::vector<runtime::BatchRequest>& reqs,
                                             int cancel = -1) {
  runtime::BatchEngine engine(backend, engine_options());
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) index[engine.submit(reqs[i])] = i;
  std::vector<std::vector<int32_t>> out(reqs.size());
  // Prompts are prefilled one at a time in submission order: request `cancel` is in its prefill once more tokens
  // than the earlier prompts hold have been prefilled.
  int64_t before = 0;
  for (int i = 0; i < cancel; ++i) before += static_cast<int64_t>(reqs[static_cast<size_t>(i)].prompt.size());
  bool cancelled = cancel < 0;
  while (engine.busy()) {
    for (const runtime::BatchEvent& e : engine.step())
      if (e.token >= 0) out[index[e.id]].push_back(e.token);
    if (!cancelled && engine.stats().prefill_tokens > before)
      for (const auto& [id, i] : index)
        if (static_cast<int>(i) == cancel) cancelled = engine.cancel(id);
  }
  EXPECT_TRUE(cancelled);
  return out;
}

// Rank 0's engine over TpBatchLeader and `followers` ranks on threads, each a tp_batch_worker over its backend.
// make_backend(rank) gives each rank's backend (called on the rank's own thread).
std::vector<std::vector<int32_t>> run_ranks(
    int followers, const std::vector<runtime::BatchRequest>& reqs, const attn::PolicyShape& shape,
    const std::function<runtime::BatchBackend&(int)>& backend, int cancel = -1) {
  std::vector<Wire> wires(static_cast<size_t>(followers));
  std::vector<Wire*> wp;
  for (Wire& w : wires) wp.push_back(&w);
  LeaderChannel lc(wp);
  std::vector<std::thread> threads;
  for (int r = 1; r <= followers; ++r)
    threads.emplace_back([&, r] {
      WorkerChannel wc(wires[static_cast<size_t>(r - 1)]);
      tp_batch_worker(wc, backend(r), shape);
    });
  TpBatchLeader leader(lc, backend(0));
  std::vector<std::vector<int32_t>> out;
  try {
    out = run_engine(leader, reqs, cancel);
  } catch (...) {
    leader.quit();
    for (std::thread& t : threads) t.join();
    throw;
  }
  leader.quit();
  for (std::thread& t : threads) t.join();
  return out;
}

}  // namespace

TEST(TpBatch, BatchedCommandsRoundTripThroughTheWireFormat) {
  TpCommand c = tp_command(TpOp::kPrefill, 16, 90, {1, 2, 3}, R"({"tessera_policy":1})");
  c.flags = kTpLogits | kTpPolicy;
  for (const TpCommand& x : {c, tp_command(TpOp::kStore, 512, 4096, {2, 4, 16, 8, 3}),
                             tp_command(TpOp::kBatchDecode, 0, 0, {1, 42, 7, 9, 1, 3, 1, 12}),
                             tp_command(TpOp::kRelease, 7), tp_command(TpOp::kAbort)}) {
    const TpHeader h = encode_header(x);
    EXPECT_EQ(decode_command(h, encode_payload(x)), x);
  }
  // The single-sequence worker refuses a batched command (and the other way round), naming whose it is.
  struct NoForward final : RankForward {
    std::vector<float> run(std::span<const int32_t>, int32_t, const attn::AttentionPolicy*, int32_t) override {
      return {};
    }
  };
  Wire w;
  LeaderChannel lc({&w});
  WorkerChannel wc(w);
  NoForward nf;
  lc.send(tp_command(TpOp::kAbort));
  EXPECT_EQ(error_of([&] { tp_serve_worker(wc, nf, attn::PolicyShape{1, 1, 1}); }),
            "tensor-parallel worker: op 10 is the batched backend's (parallel/tp_batch.h), not the single-sequence "
            "worker's");
}

TEST(TpBatch, FollowersMakeRankZerosCallsWithTheSameBlockTables) {
  // gemma3's local layers have an 8-token window: with 8-token blocks, decoding frees blocks at the window's tail.
  for (const char* name : {"llama3", "gemma3"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    attn::AttentionPolicy policy =
        attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 16});
    policy.at(0, 1) = attn::ElasticWindowPattern{12.0, 0.1, 2};  // MoA: a per-head decode window
    const auto reqs = requests({37, 5, 90, 64, 0, 21}, c.vocab_size, &policy);
    runtime::CpuBatchBackend alone(m);
    const auto ref = run_engine(alone, reqs, /*cancel=*/2);

    constexpr int kFollowers = 2;
    std::vector<std::unique_ptr<ThreadPool>> pools;  // each rank's thread its own pool (one pool, one caller)
    std::vector<std::unique_ptr<runtime::CpuBatchBackend>> inner;
    std::vector<std::unique_ptr<Recorder>> rec;
    for (int r = 0; r <= kFollowers; ++r) {
      pools.push_back(std::make_unique<ThreadPool>(1));
      inner.push_back(std::make_unique<runtime::CpuBatchBackend>(m, pools.back().get()));
      rec.push_back(std::make_unique<Recorder>(*inner.back()));
    }
    const auto got = run_ranks(kFollowers, reqs, attn::PolicyShape{c.num_layers, c.num_q_heads, c.num_kv_heads},
                               [&](int r) -> runtime::BatchBackend& { return *rec[static_cast<size_t>(r)]; }, 2);
    EXPECT_EQ(got, ref) << name;
    const std::vector<std::string>& calls = rec[0]->calls;
    ASSERT_GT(calls.size(), 20u);
    for (int r = 1; r <= kFollowers; ++r) {
      const std::vector<std::string>& f = rec[static_cast<size_t>(r)]->calls;
      ASSERT_EQ(f.size(), calls.size()) << name << ", rank " << r;
      for (size_t i = 0; i < calls.size(); ++i) ASSERT_EQ(f[i], calls[i]) << name << ", rank " << r << ", call " << i;
    }
    // The run went through every kind of call: a cached prefix, an abort, prompt rows, the policy and dense.
    auto count = [&](const std::string& prefix) {
      return std::count_if(calls.begin(), calls.end(), [&](const std::string& s) { return s.rfind(prefix, 0) == 0; });
    };
    EXPECT_EQ(count("store"), 1);
    EXPECT_EQ(count("abort"), 1) << name;
    EXPECT_GE(count("load"), 1) << name;
    EXPECT_GE(count("prefill rows"), 1) << name;
    EXPECT_EQ(count("finish"), 5) << name;
    EXPECT_EQ(count("release"), 5) << name;
    EXPECT_GT(count("decode"), 20) << name;
    EXPECT_TRUE(std::any_of(calls.begin(), calls.end(), [](const std::string& s) {
      return s.find(" sparse ") != std::string::npos;
    }));
    if (std::string(name) == "gemma3") {  // a window's freed block travels as -1
      EXPECT_TRUE(std::any_of(calls.begin(), calls.end(), [](const std::string& s) {
        return s.rfind("decode", 0) == 0 && s.find("[-1,") != std::string::npos;
      }));
    }
  }
}

TEST(TpBatch, StreamingMemoryIsRefused) {
  const runtime::Model& m = fixture("llama3");
  runtime::CpuBatchBackend local(m);
  Wire w;
  LeaderChannel lc({&w});
  TpBatchLeader leader(lc, local);
  EXPECT_EQ(error_of([&] { leader.new_stream(runtime::StreamOptions{}); }),
            "streaming memory: the tensor-parallel batched backend has none (drop --stream or --gpus)");
}

TEST(TpBatch, PerRankTwinEqualsOneRankAndTheSingleProcessTwin) {
  for (const char* name : {"llama3", "qwen2", "gemma3"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    attn::AttentionPolicy policy =
        attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 16});
    policy.at(0, 1) = attn::ElasticWindowPattern{12.0, 0.1, 2};
    const auto reqs = requests({37, 5, 90, 64, 0, 21}, c.vocab_size, &policy);
    runtime::CpuBatchBackend alone(m);
    const auto ref = run_engine(alone, reqs);
    // Megatron's split on 2 ranks; 3 ranks with every KV group split (head h on rank (h + l) % 3).
    auto placement = [&](int32_t gpus, const std::function<int32_t(int32_t, int32_t)>& rank_of) {
      Placement p;
      p.num_gpus = gpus;
      p.num_q_heads = c.num_q_heads;
      p.num_kv_heads = c.num_kv_heads;
      p.method = gpus == 2 ? "uniform" : "split";
      p.gpu_of_head.resize(static_cast<size_t>(c.num_layers));
      for (int32_t l = 0; l < c.num_layers; ++l)
        for (int32_t h = 0; h < c.num_q_heads; ++h) p.gpu_of_head[static_cast<size_t>(l)].push_back(rank_of(l, h));
      return p;
    };
    for (const Placement& p : {placement(2, [&](int32_t, int32_t h) { return h * 2 / c.num_q_heads; }),
                               placement(3, [](int32_t l, int32_t h) { return (h + l) % 3; })}) {
      auto single = tp_cpu_batch_backend(m, p);
      const auto twin = run_engine(*single, reqs);
      HostAllReduce reduce(p.num_gpus);
      std::vector<std::unique_ptr<ThreadPool>> pools;
      std::vector<std::unique_ptr<runtime::BatchBackend>> ranks;
      for (int32_t r = 0; r < p.num_gpus; ++r) {
        pools.push_back(std::make_unique<ThreadPool>(1));
        ranks.push_back(tp_cpu_rank_backend(m, p, r, reduce.of_rank(r), *pools.back()));
      }
      const auto got = run_ranks(p.num_gpus - 1, reqs, attn::PolicyShape{c.num_layers, c.num_q_heads, c.num_kv_heads},
                                 [&](int r) -> runtime::BatchBackend& { return *ranks[static_cast<size_t>(r)]; });
      EXPECT_EQ(got, twin) << name << ", " << p.method;  // the same sums in the same order
      for (size_t i = 0; i < reqs.size(); ++i)
        EXPECT_EQ(got[i], ref[i]) << name << ", " << p.method << ", request " << i;
    }
  }
}

TEST(TpBatch, HostAllReduceRefusesUnequalCounts) {
  HostAllReduce reduce(2);
  std::vector<float> a(3, 1.0f), b(4, 2.0f);
  std::string err_b;
  std::thread t([&] { err_b = error_of([&] { reduce.all_reduce_sum(1, b.data(), b.size()); }); });
  const std::string err_a = error_of([&] { reduce.all_reduce_sum(0, a.data(), a.size()); });
  t.join();
  EXPECT_EQ(err_a, "host all-reduce: ranks passed different counts (3, 4)");
  EXPECT_EQ(err_b, err_a);
  std::vector<float> c = {1.0f, 2.0f}, d = {10.0f, 20.0f};
  std::thread u([&] { reduce.all_reduce_sum(1, d.data(), d.size()); });
  reduce.all_reduce_sum(0, c.data(), c.size());
  u.join();
  EXPECT_EQ(c, (std::vector<float>{11.0f, 22.0f}));
  EXPECT_EQ(d, c);
}

TEST(TpBatch, RankSlicesOfTheUniformPlacement) {
  const runtime::Model& m = fixture("llama3");  // 4 query heads, 2 KV heads
  const runtime::ModelConfig& c = m.config();
  EXPECT_EQ(error_of([&] { uniform_rank_placement(c, 3); }),
            "tensor-parallel batching: the model's 2 KV heads do not split over 3 GPUs; use a GPU count that divides 2");
  const Placement u = uniform_rank_placement(c, 2);
  const RankSlice s1 = rank_slice(c, u, 1);
  EXPECT_EQ(s1.q0, 2);
  EXPECT_EQ(s1.q_heads, 2);
  EXPECT_EQ(s1.kv0, 1);
  EXPECT_EQ(s1.kv_heads, 1);
  EXPECT_EQ(s1.ffn_begin, c.intermediate_size / 2);
  EXPECT_EQ(s1.ffn_end, c.intermediate_size);
  Placement other = u;
  other.gpu_of_head[0][1] = 1;
  EXPECT_EQ(error_of([&] { rank_slice(c, other, 0, "p.json"); }),
            "tensor-parallel batching (--parallel): p.json puts layer 0 head 1 on GPU 1; the batched backend runs the "
            "uniform placement only (drop --placement, or serve with --parallel 1)");
  // The rank's model: its heads' rows of wq, its KV head's of wk and wv, its columns of wo and the MLP.
  const runtime::ModelConfig rc = rank_config(c, s1);
  EXPECT_EQ(rc.num_q_heads, 2);
  EXPECT_EQ(rc.num_kv_heads, 1);
  EXPECT_EQ(rc.intermediate_size, c.intermediate_size / 2);
  const runtime::ModelWeights w = rank_weights(c, m.weights(), u, 1);
  ASSERT_EQ(w.layers.size(), static_cast<size_t>(c.num_layers));
  const runtime::LayerWeights& full = m.weights().layers[0];
  const runtime::LayerWeights& mine = w.layers[0];
  const int64_t D = c.head_dim, H = c.hidden_size;
  EXPECT_EQ(mine.wq.rows, 2 * D);
  EXPECT_EQ(mine.wk.rows, D);
  EXPECT_EQ(mine.wo.cols, 2 * D);
  const std::vector<float> fq = full.wq.to_f32(), mq = mine.wq.to_f32(), fk = full.wk.to_f32(), mk = mine.wk.to_f32();
  EXPECT_EQ(std::vector<float>(mq.begin(), mq.end()), std::vector<float>(fq.begin() + 2 * D * H, fq.end()));
  EXPECT_EQ(std::vector<float>(mk.begin(), mk.end()), std::vector<float>(fk.begin() + D * H, fk.end()));
  // Its policy patterns and decode views: the same layers, its heads.
  attn::AttentionPolicy policy =
      attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::AShapePattern{4, 16});
  policy.at(1, 3) = attn::ElasticWindowPattern{12.0, 0.1, 2};
  const attn::AttentionPolicy rp = rank_policy(&policy, s1);
  ASSERT_EQ(rp.num_q_heads(), 2);
  EXPECT_EQ(rp.at(1, 1), policy.at(1, 3));
  EXPECT_EQ(rp.at(0, 0), policy.at(0, 2));
  EXPECT_TRUE(rank_policy(nullptr, s1).table().empty());
  const auto views = runtime::decode_views(c, &policy, 40);
  const auto rv = rank_views(views, c, s1);
  ASSERT_EQ(rv.size(), static_cast<size_t>(c.num_layers) * 2);
  EXPECT_EQ(rv[3], views[static_cast<size_t>(c.num_q_heads) + 3]);
  EXPECT_EQ(rv[0], views[2]);
}

TEST(TpBatch, RankTablesFollowGrowthAndWindows) {
  // Gemma-3's fixture: one KV head, sliding-window layers (blocks freed as decoding goes on); llama3: two KV heads
  // (rank 1 keeps the second's tables), a MoA window on one head.
  for (const char* name : {"gemma3", "llama3"}) {
    const runtime::Model& m = fixture(name);
    const runtime::ModelConfig& c = m.config();
    const int32_t world = c.num_kv_heads;
    const RankSlice s = rank_slice(c, uniform_rank_placement(c, world), world - 1);
    attn::AttentionPolicy policy =
        attn::AttentionPolicy::uniform(c.num_layers, c.num_q_heads, c.num_kv_heads, attn::DensePattern{});
    for (int32_t h = s.q0 + s.q_heads - c.num_q_heads / c.num_kv_heads; h < s.q0 + s.q_heads; ++h)
      policy.at(0, h) = attn::ElasticWindowPattern{12.0, 0.1, 2};  // a whole GQA group: its KV head keeps a window
    const auto views = runtime::decode_views(c, &policy, 30);
    const runtime::PagedKVShape shape{c.num_layers, c.num_kv_heads, c.head_dim, 8};
    runtime::BlockPool pool(4096);
    runtime::SequenceBlocks seq(shape, runtime::kv_retention(c, views));
    seq.grow(30, pool);
    RankTables tables(shape, s);
    EXPECT_EQ(tables.shape().num_kv_heads, s.kv_heads);
    tables.sync(seq, true);
    bool freed = false;
    for (int step = 0; step < 60; ++step) {
      seq.grow(1, pool);
      const runtime::SequenceBlocks& r = tables.sync(seq, false);
      ASSERT_EQ(r.length(), seq.length());
      for (int32_t l = 0; l < c.num_layers; ++l)
        for (int32_t j = 0; j < s.kv_heads; ++j) {
          std::vector<int32_t> want = seq.table(l, s.kv0 + j), got = r.table(l, j);
          while (!got.empty() && got.size() > want.size() && got.back() == -1) got.pop_back();
          ASSERT_EQ(got, want) << name << " layer " << l << " step " << step;
          freed = freed || std::find(want.begin(), want.end(), -1) != want.end();
        }
    }
    EXPECT_TRUE(freed) << name << ": no window freed a block";
    tables.forget(seq);
    EXPECT_EQ(tables.size(), 0u);
  }
}
