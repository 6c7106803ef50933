#include "parallel/tp_batch.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "attention/pattern/config_io.h"
#include "core/error.h"
#include "parallel/shard.h"

namespace tessera::parallel {

using runtime::DecodeRow;
using runtime::DecodeView;
using runtime::SequenceBlocks;

namespace {

int32_t narrow(int64_t v, const char* what) {
  check(v >= 0 && v <= std::numeric_limits<int32_t>::max(),
        std::string("tensor-parallel batch: ") + what + " " + std::to_string(v) + " does not fit the wire's int32");
  return static_cast<int32_t>(v);
}

int32_t wire_span(int64_t v) { return v >= runtime::kUnbounded ? -1 : narrow(v, "a decode view's span"); }
int64_t from_wire_span(int32_t v) { return v < 0 ? runtime::kUnbounded : v; }

// Reads the int32 arguments of a command in order, with a clear error when they run out.
class Reader {
 public:
  explicit Reader(const std::vector<int32_t>& v) : v_(v) {}
  int32_t next() {
    check(at_ < v_.size(), "tensor-parallel batch: a command's arguments end early (" + std::to_string(v_.size()) +
                               " int32)");
    return v_[at_++];
  }
  int32_t count(size_t most, const char* what) {
    const int32_t n = next();
    check(n >= 0 && static_cast<size_t>(n) <= most,
          std::string("tensor-parallel batch: ") + what + " count " + std::to_string(n) + " outside [0, " +
              std::to_string(most) + "]");
    return n;
  }
  bool done() const { return at_ == v_.size(); }

 private:
  const std::vector<int32_t>& v_;
  size_t at_ = 0;
};

// Growing a sequence from old_len to seq.length() rows takes blocks at the end of its tables and frees those whose
// rows fell out of a window: only those columns can have changed. f(table, b0, b1) for each such range (b0 may be
// negative, b1 past the table: the caller clips).
template <class F>
void growth_columns(const SequenceBlocks& seq, int64_t old_len, F&& f) {
  const int64_t B = seq.shape().block_tokens, len = seq.length();
  for (int32_t l = 0; l < seq.shape().num_layers; ++l)
    for (int32_t h = 0; h < seq.shape().num_kv_heads; ++h) {
      const size_t i = static_cast<size_t>(l) * static_cast<size_t>(seq.shape().num_kv_heads) + static_cast<size_t>(h);
      f(i, std::max<int64_t>(old_len - 1, 0) / B, (len - 1) / B);
      const int64_t w = seq.retention(l, h).window;
      if (w < runtime::kUnbounded) f(i, (old_len - w) / B - 2, (len - w) / B + 1);
    }
}

}  // namespace

TpBatchLeader::TpBatchLeader(CommandChannel& channel, runtime::BatchBackend& local)
    : channel_(channel), local_(local) {}

void TpBatchLeader::send(const TpCommand& c) {
  channel_.send(c);
  ++commands_;
  payload_ints_ += static_cast<int64_t>(c.tokens.size() + (c.policy_json.size() + 3) / 4);
}

void TpBatchLeader::create_store(const runtime::PagedKVShape& shape, int32_t num_blocks, int32_t max_sequences,
                                 int32_t max_context) {
  send(tp_command(TpOp::kStore, num_blocks, max_context,
                  {shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_tokens, max_sequences}));
  local_.create_store(shape, num_blocks, max_sequences, max_context);
}

void TpBatchLeader::prefill_command(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                    const attn::AttentionPolicy* policy, int32_t flags) {
  TpCommand c = tp_command(TpOp::kPrefill, pos, total_len, {tokens.begin(), tokens.end()});
  std::string json = policy == nullptr || policy->table().empty() ? "" : attn::save_policy_json(*policy).dump();
  if (!policy_sent_ || json != policy_json_) {
    flags |= kTpPolicy;
    c.policy_json = json;
    policy_json_ = std::move(json);
    policy_sent_ = true;
  }
  c.flags = flags;
  send(c);
}

std::vector<float> TpBatchLeader::prefill_chunk(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                const attn::AttentionPolicy* policy, bool logits) {
  prefill_command(tokens, pos, total_len, policy, logits ? kTpLogits : 0);
  return local_.prefill_chunk(tokens, pos, total_len, policy, logits);
}

std::vector<float> TpBatchLeader::prefill_chunk_rows(std::span<const int32_t> tokens, int32_t pos, int32_t total_len,
                                                     const attn::AttentionPolicy* policy) {
  prefill_command(tokens, pos, total_len, policy, kTpRows);
  return local_.prefill_chunk_rows(tokens, pos, total_len, policy);
}

TpBatchLeader::Sent& TpBatchLeader::full(const SequenceBlocks& seq, std::vector<int32_t>& out) {
  auto it = sent_.find(&seq);
  if (it == sent_.end()) it = sent_.emplace(&seq, Sent{next_id_++, 0, {}}).first;
  Sent& s = it->second;
  s.length = seq.length();
  s.tables.resize(seq.tables());
  out.push_back(s.id);
  out.push_back(narrow(seq.length(), "a sequence length"));
  out.push_back(narrow(static_cast<int64_t>(seq.tables()), "a table count"));
  for (size_t i = 0; i < seq.tables(); ++i) {
    const std::vector<int32_t>& t = seq.table(i);
    out.push_back(narrow(static_cast<int64_t>(t.size()), "a table size"));
    out.insert(out.end(), t.begin(), t.end());
    s.tables[i] = t;
  }
  return s;
}

void TpBatchLeader::load_prefix(const SequenceBlocks& seq, int32_t rows, int32_t total_len) {
  TpCommand c = tp_command(TpOp::kLoadPrefix, rows, total_len);
  full(seq, c.tokens);
  send(c);
  local_.load_prefix(seq, rows, total_len);
}

void TpBatchLeader::finish_prefill(const SequenceBlocks& seq, std::span<const DecodeView> views) {
  TpCommand c = tp_command(TpOp::kFinish);
  full(seq, c.tokens);
  c.tokens.push_back(narrow(static_cast<int64_t>(views.size()), "a view count"));
  for (const DecodeView& v : views) c.tokens.insert(c.tokens.end(), {v.sink, wire_span(v.window), wire_span(v.horizon)});
  send(c);
  local_.finish_prefill(seq, views);
}

void TpBatchLeader::release_sequence(const SequenceBlocks& seq) {
  const auto it = sent_.find(&seq);
  if (it != sent_.end()) {
    send(tp_command(TpOp::kRelease, it->second.id));
    sent_.erase(it);
  }
  local_.release_sequence(seq);
}

void TpBatchLeader::abort_prefill() {
  send(tp_command(TpOp::kAbort));
  local_.abort_prefill();
}

std::unique_ptr<runtime::StreamMemory> TpBatchLeader::new_stream(const runtime::StreamOptions&) {
  throw Error("streaming memory: the tensor-parallel batched backend has none (drop --stream or --gpus)");
}

void TpBatchLeader::decode_command(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  TpCommand c = tp_command(TpOp::kBatchDecode);
  std::vector<int32_t>& out = c.tokens;
  out.push_back(narrow(static_cast<int64_t>(rows.size()), "a batch size"));
  out.insert(out.end(), tokens.begin(), tokens.end());
  for (const DecodeRow& r : rows) {
    check(r.seq != nullptr && r.stream == nullptr, "tensor-parallel batch: a decode row without blocks");
    const SequenceBlocks& seq = *r.seq;
    const auto it = sent_.find(&seq);
    check(it != sent_.end(), "tensor-parallel batch: a sequence decoded before its prefill ended");
    Sent& s = it->second;
    out.push_back(s.id);
    out.push_back(narrow(seq.length(), "a sequence length"));
    const size_t count_at = out.size();
    out.push_back(0);
    const int64_t len = seq.length();
    int32_t changes = 0;
    growth_columns(seq, s.length, [&](size_t i, int64_t b0, int64_t b1) {
      const std::vector<int32_t>& t = seq.table(i);
      std::vector<int32_t>& m = s.tables[i];
      b0 = std::max<int64_t>(b0, 0);
      b1 = std::min<int64_t>(b1, static_cast<int64_t>(std::max(t.size(), m.size())) - 1);
      for (int64_t b = b0; b <= b1; ++b) {
        const int32_t now = b < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(b)] : -1;
        const int32_t was = b < static_cast<int64_t>(m.size()) ? m[static_cast<size_t>(b)] : -1;
        if (now == was) continue;
        if (static_cast<int64_t>(m.size()) <= b) m.resize(static_cast<size_t>(b) + 1, -1);
        m[static_cast<size_t>(b)] = now;
        out.insert(out.end(), {static_cast<int32_t>(i), static_cast<int32_t>(b), now});
        ++changes;
      }
    });
    out[count_at] = changes;
    s.length = len;
  }
  send(c);
}

std::vector<float> TpBatchLeader::decode(std::span<const int32_t> tokens, std::span<const DecodeRow> rows) {
  decode_command(tokens, rows);
  return local_.decode(tokens, rows);
}

std::vector<int32_t> TpBatchLeader::decode_select(std::span<const int32_t> tokens, std::span<const DecodeRow> rows,
                                                  std::span<const RowChoice> choice) {
  decode_command(tokens, rows);
  return local_.decode_select(tokens, rows, choice);
}

void TpBatchLeader::quit() { send(tp_command(TpOp::kQuit)); }

namespace {

// Sets a mirror's tables and length from a full encoding (entries past the new sizes become -1).
void read_full(Reader& in, TpBatchMirror& m) {
  const int32_t length = in.next();
  check(length >= 0, "tensor-parallel batch: a negative sequence length");
  const int32_t tables = in.count(m.seq.tables(), "table");
  check(static_cast<size_t>(tables) == m.seq.tables(),
        "tensor-parallel batch: " + std::to_string(tables) + " tables, the store has " + std::to_string(m.seq.tables()));
  for (size_t i = 0; i < static_cast<size_t>(tables); ++i) {
    const int32_t size = in.count(size_t{1} << 24, "block");
    for (int32_t b = 0; b < size; ++b) m.seq.set_entry(i, b, in.next());
    for (auto b = static_cast<int64_t>(size); b < static_cast<int64_t>(m.seq.table(i).size()); ++b)
      m.seq.set_entry(i, b, -1);
  }
  m.seq.set_length(length);
}

}  // namespace

int64_t tp_batch_worker(CommandChannel& channel, runtime::BatchBackend& local, const attn::PolicyShape& shape,
                        const std::function<void(const TpCommand&, const std::map<int32_t, std::unique_ptr<TpBatchMirror>>&)>&
                            on_call) {
  std::map<int32_t, std::unique_ptr<TpBatchMirror>> seqs;
  runtime::PagedKVShape kv;
  attn::AttentionPolicy policy;
  int64_t ran = 0;
  auto mirror = [&](int32_t id) -> TpBatchMirror& {
    auto it = seqs.find(id);
    if (it == seqs.end())
      it = seqs.emplace(id, std::make_unique<TpBatchMirror>(TpBatchMirror{SequenceBlocks::mirror(kv), {}})).first;
    return *it->second;
  };
  auto known = [&](int32_t id) -> TpBatchMirror& {
    const auto it = seqs.find(id);
    check(it != seqs.end(), "tensor-parallel batch: rank 0 named sequence " + std::to_string(id) + ", unknown here");
    return *it->second;
  };
  for (;;) {
    const TpCommand c = channel.receive();
    if (c.op == TpOp::kQuit) return ran;
    try {
      Reader in(c.tokens);
      switch (c.op) {
        case TpOp::kStore:
          kv.num_layers = in.next();
          kv.num_kv_heads = in.next();
          kv.head_dim = in.next();
          kv.block_tokens = in.next();
          local.create_store(kv, c.pos, in.next(), c.total_len);
          break;
        case TpOp::kPrefill: {
          if (c.flags & kTpPolicy)
            policy = c.policy_json.empty() ? attn::AttentionPolicy()
                                           : attn::load_policy_json(nlohmann::json::parse(c.policy_json),
                                                                    "rank 0's policy", shape);
          const attn::AttentionPolicy* p = policy.table().empty() ? nullptr : &policy;
          if (c.flags & kTpRows) local.prefill_chunk_rows(c.tokens, c.pos, c.total_len, p);
          else local.prefill_chunk(c.tokens, c.pos, c.total_len, p, (c.flags & kTpLogits) != 0);
          break;
        }
        case TpOp::kLoadPrefix: {
          TpBatchMirror& m = mirror(in.next());
          read_full(in, m);
          local.load_prefix(m.seq, c.pos, c.total_len);
          break;
        }
        case TpOp::kFinish: {
          TpBatchMirror& m = mirror(in.next());
          read_full(in, m);
          const int32_t views = in.count(size_t{1} << 24, "view");
          m.views.clear();
          for (int32_t v = 0; v < views; ++v) {
            DecodeView d;
            d.sink = in.next();
            d.window = from_wire_span(in.next());
            d.horizon = from_wire_span(in.next());
            m.views.push_back(d);
          }
          local.finish_prefill(m.seq, m.views);
          break;
        }
        case TpOp::kBatchDecode: {
          const int32_t n = in.count(size_t{1} << 20, "row");
          std::vector<int32_t> tokens(static_cast<size_t>(n));
          for (int32_t& t : tokens) t = in.next();
          std::vector<DecodeRow> rows;
          for (int32_t r = 0; r < n; ++r) {
            TpBatchMirror& m = known(in.next());
            const int32_t length = in.next();
            const int32_t changes = in.count(size_t{1} << 30, "change");
            for (int32_t k = 0; k < changes; ++k) {
              const int32_t table = in.next(), block = in.next(), id = in.next();
              m.seq.set_entry(static_cast<size_t>(table), block, id);
            }
            m.seq.set_length(length);
            rows.push_back(DecodeRow{&m.seq, m.views, nullptr});
          }
          local.decode(tokens, rows);
          break;
        }
        case TpOp::kRelease: {
          const auto it = seqs.find(c.pos);
          if (it != seqs.end()) {
            local.release_sequence(it->second->seq);
            seqs.erase(it);
          }
          break;
        }
        case TpOp::kAbort:
          local.abort_prefill();
          break;
        default:
          throw Error("tensor-parallel batch: op " + std::to_string(static_cast<int32_t>(c.op)) +
                      " is the single-sequence worker's (tp_serve_worker)");
      }
      check(c.op == TpOp::kPrefill || in.done(), "tensor-parallel batch: op " + std::to_string(static_cast<int32_t>(c.op)) +
                           " carried more arguments than it reads");
    } catch (const Error& e) {
      std::fprintf(stderr, "tessera: tensor-parallel worker: %s\n", e.what());
    }
    ++ran;
    if (on_call) on_call(c, seqs);
  }
}

Placement uniform_rank_placement(const runtime::ModelConfig& config, int32_t world) {
  check(world >= 1 && config.num_kv_heads % world == 0,
        "tensor-parallel batching: the model's " + std::to_string(config.num_kv_heads) + " KV heads do not split over " +
            std::to_string(world) + " GPUs; use a GPU count that divides " + std::to_string(config.num_kv_heads));
  Placement p;
  p.num_gpus = world;
  p.num_q_heads = config.num_q_heads;
  p.num_kv_heads = config.num_kv_heads;
  p.method = "uniform";
  p.gpu_of_head.assign(static_cast<size_t>(config.num_layers), {});
  for (std::vector<int32_t>& layer : p.gpu_of_head)
    for (int32_t h = 0; h < config.num_q_heads; ++h) layer.push_back(h * world / config.num_q_heads);
  return p;
}

RankSlice rank_slice(const runtime::ModelConfig& config, const Placement& placement, int32_t rank,
                     const std::string& source) {
  const Placement uniform = uniform_rank_placement(config, placement.num_gpus);
  validate(placement, config.num_layers, config.num_q_heads, config.num_kv_heads, source);
  for (int32_t l = 0; l < config.num_layers; ++l)
    for (int32_t h = 0; h < config.num_q_heads; ++h) {
      const int32_t g = placement.gpu_of_head[static_cast<size_t>(l)][static_cast<size_t>(h)];
      check(g == uniform.gpu_of_head[static_cast<size_t>(l)][static_cast<size_t>(h)],
            "tensor-parallel batching (--parallel): " + source + " puts layer " + std::to_string(l) + " head " +
                std::to_string(h) + " on GPU " + std::to_string(g) +
                "; the batched backend runs the uniform placement only (drop --placement, or serve with --parallel 1)");
    }
  const RankPlan plan = rank_plan(config, placement, rank);
  RankSlice s;
  s.rank = rank;
  s.world = placement.num_gpus;
  s.q_heads = config.num_q_heads / s.world;
  s.q0 = rank * s.q_heads;
  s.kv_heads = config.num_kv_heads / s.world;
  s.kv0 = rank * s.kv_heads;
  s.ffn_begin = plan.ffn_begin;
  s.ffn_end = plan.ffn_end;
  return s;
}

runtime::ModelConfig rank_config(const runtime::ModelConfig& config, const RankSlice& slice) {
  runtime::ModelConfig c = config;
  c.num_q_heads = slice.q_heads;
  c.num_kv_heads = slice.kv_heads;
  c.intermediate_size = slice.ffn_end - slice.ffn_begin;
  return c;
}

runtime::ModelWeights rank_weights(const runtime::ModelConfig& config, const runtime::ModelWeights& weights,
                                   const Placement& placement, int32_t rank) {
  const RankPlan plan = rank_plan(config, placement, rank);
  runtime::ModelWeights w;
  w.embedding = weights.embedding;
  w.lm_head = weights.lm_head;
  w.final_norm = weights.final_norm;
  w.rope_freq_factors = weights.rope_freq_factors;
  for (int32_t l = 0; l < config.num_layers; ++l)
    w.layers.push_back(shard_layer(weights.layers[static_cast<size_t>(l)], config, plan.layers[static_cast<size_t>(l)],
                                   plan.ffn_begin, plan.ffn_end));
  return w;
}

attn::AttentionPolicy rank_policy(const attn::AttentionPolicy* policy, const RankSlice& slice) {
  if (policy == nullptr || policy->table().empty()) return {};
  std::vector<attn::Pattern> table;
  for (int l = 0; l < policy->num_layers(); ++l)
    for (int32_t h = slice.q0; h < slice.q0 + slice.q_heads; ++h) table.push_back(policy->at(l, h));
  return attn::AttentionPolicy(policy->num_layers(), slice.q_heads, slice.kv_heads, std::move(table));
}

std::vector<DecodeView> rank_views(std::span<const DecodeView> views, const runtime::ModelConfig& config,
                                   const RankSlice& slice) {
  check(views.size() == static_cast<size_t>(config.num_layers) * static_cast<size_t>(config.num_q_heads),
        "tensor-parallel batching: one decode view per layer and query head");
  std::vector<DecodeView> out;
  for (int32_t l = 0; l < config.num_layers; ++l)
    for (int32_t h = slice.q0; h < slice.q0 + slice.q_heads; ++h)
      out.push_back(views[static_cast<size_t>(l) * static_cast<size_t>(config.num_q_heads) + static_cast<size_t>(h)]);
  return out;
}

RankTables::RankTables(const runtime::PagedKVShape& full, const RankSlice& slice) : full_(full), shape_(full), slice_(slice) {
  shape_.num_kv_heads = slice.kv_heads;
}

const SequenceBlocks& RankTables::sync(const SequenceBlocks& full, bool whole) {
  auto it = seqs_.find(&full);
  if (it == seqs_.end()) {
    it = seqs_.emplace(&full, std::make_unique<SequenceBlocks>(SequenceBlocks::mirror(shape_))).first;
    whole = true;
  }
  SequenceBlocks& m = *it->second;
  const auto Hf = static_cast<size_t>(full_.num_kv_heads), Hr = static_cast<size_t>(shape_.num_kv_heads);
  auto copy = [&](size_t i, int64_t b0, int64_t b1) {
    const size_t l = i / Hf, h = i % Hf;
    if (h < static_cast<size_t>(slice_.kv0) || h >= static_cast<size_t>(slice_.kv0 + slice_.kv_heads)) return;
    const size_t j = l * Hr + (h - static_cast<size_t>(slice_.kv0));
    const std::vector<int32_t>& t = full.table(i);
    const std::vector<int32_t>& r = m.table(j);
    b0 = std::max<int64_t>(b0, 0);
    b1 = std::min<int64_t>(b1, static_cast<int64_t>(std::max(t.size(), r.size())) - 1);
    for (int64_t b = b0; b <= b1; ++b) {
      const int32_t now = b < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(b)] : -1;
      if (b >= static_cast<int64_t>(r.size()) ? now >= 0 : r[static_cast<size_t>(b)] != now) m.set_entry(j, b, now);
    }
  };
  if (whole) {
    for (size_t i = 0; i < full.tables(); ++i) copy(i, 0, std::numeric_limits<int32_t>::max());
  } else {
    growth_columns(full, m.length(), copy);
  }
  m.set_length(full.length());
  return m;
}

void RankTables::forget(const SequenceBlocks& full) { seqs_.erase(&full); }

}  // namespace tessera::parallel
