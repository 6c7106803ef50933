// paged_decode_bench: one decode step's attention over a paged KV store (attention/cpu/paged_decode.h), per
// path, against the loop it replaced (paged_decode_attention_cpu of 8c870a7, reproduced below as `before`),
// one thread.
//
//   paged_decode_bench [--shape smollm2|gemma3] [--lengths 1024,4096,8192] [--types f16,bf16,f32]
//                      [--rounds 7] [--threads N [--min-work W]]
//
// A step = every (layer, kv head) of the model's shape attending its GQA group's query heads over `length`
// keys in blocks of 64 tokens, each (layer, kv head) with its own blocks (SmolLM2 at 4K in f16: 94 MB of K
// and V, read from DRAM as in a forward pass). The paths run one after the other within each round (rounds
// alternate the order); the table gives each path's median step time over the rounds, its spread (min-max),
// and the speedup of each path's median over `before`'s. The machine may be shared: the load average is
// printed before and after.
//
// --threads N (N >= 2): instead, the step through runtime's paged_decode_attention_cpu (one call per layer, one
// decode row over a PagedKVStore of `length` keys of every (layer, kv head)) on a pool of N threads with the rows'
// keys split across the threads (attn::paged_decode_parts at the default minimum) and with splitting off (one work
// item per kv head: Gemma-3's one KV head on one thread), and on one thread; the table gives each variant's median
// step time, spread, and the split's speedup over the unsplit run. --min-work sets the split's minimum part
// (attn::set_paged_split_min_work; default attn::kPagedSplitMinWork). These run paged_decode's walk
// (runtime::set_decode_in_prefill_order(false)); the rows "prefill order" the engine's default for dense views
// (attn::paged_decode_in_prefill_order: the prefill's arithmetic, heads cut across threads, keys not split).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/paged_decode.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "runtime/batch_forward.h"
#include "runtime/kv_cache.h"
#include "runtime/paged_kv.h"

using namespace tessera;
using tessera::attn::KeySpan;
using tessera::attn::PagedDecodeJob;
using tessera::attn::PagedIsa;

namespace {

struct Shape {
  const char* name;
  int layers, kv_heads, group, head_dim;
};
const Shape kShapes[] = {{"smollm2", 30, 3, 3, 64}, {"gemma3", 18, 1, 4, 256}};
constexpr int64_t kBlock = 64;

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string s;
  std::getline(f, s);
  return s;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t at = 0;
  while (at < s.size()) {
    const size_t comma = s.find(',', at);
    v.push_back(std::stoll(s.substr(at, comma - at)));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return v;
}

// The loop of 8c870a7 (runtime/batch_forward.cpp) on one (row, kv head) whose group shares a view, over the
// same spans: a half store's block converted to f32 into buffers first, q . k in eight partial sums, std::exp
// per key.
void before(const PagedDecodeJob& job, runtime::KVType type, std::vector<float>& kbuf,
            std::vector<float>& vbuf, std::vector<float>& acc, std::vector<float>& score) {
  const int64_t d = job.head_dim;
  const int nh = job.heads;
  const bool f32 = type == runtime::KVType::F32;
  float m[16], sum[16];
  std::fill(acc.begin(), acc.begin() + nh * d, 0.0f);
  std::fill(m, m + nh, -INFINITY);
  std::fill(sum, sum + nh, 0.0f);
  for (const KeySpan& sp : job.spans) {
    const int64_t n = sp.n;
    const float* kr;
    const float* vr;
    if (f32) {
      kr = static_cast<const float*>(sp.k);
      vr = static_cast<const float*>(sp.v);
    } else {
      runtime::half_to_f32(static_cast<const uint16_t*>(sp.k), kbuf.data(), n * d, type);
      runtime::half_to_f32(static_cast<const uint16_t*>(sp.v), vbuf.data(), n * d, type);
      kr = kbuf.data();
      vr = vbuf.data();
    }
    const int64_t d8 = d / 8 * 8;
    for (int g = 0; g < nh; ++g) {
      const float* qh = job.q + g * d;
      float* ag = acc.data() + g * d;
      float m_blk = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kr + j * d;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t c = 0; c < d8; c += 8)
          for (int u = 0; u < 8; ++u) part[u] += qh[c + u] * kj[c + u];
        float dot = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        for (int64_t c = d8; c < d; ++c) dot += qh[c] * kj[c];
        score[static_cast<size_t>(j)] = dot * job.scale;
        m_blk = std::max(m_blk, score[static_cast<size_t>(j)]);
      }
      const float m_new = std::max(m[g], m_blk);
      const float corr = std::exp(m[g] - m_new);
      if (corr != 1.0f) {
        for (int64_t c = 0; c < d; ++c) ag[c] *= corr;
        sum[g] *= corr;
      }
      m[g] = m_new;
      float total = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(score[static_cast<size_t>(j)] - m_new);
        const float* vj = vr + j * d;
        for (int64_t c = 0; c < d; ++c) ag[c] += p * vj[c];
        total += p;
      }
      sum[g] += total;
    }
  }
  for (int g = 0; g < nh; ++g) {
    const float inv = sum[g] > 0 ? 1.0f / sum[g] : 0.0f;
    for (int64_t c = 0; c < d; ++c) job.out[g * d + c] = acc[static_cast<size_t>(g * d + c)] * inv;
  }
}

// Median, min and max of a list of times.
struct Stat {
  double med, lo, hi;
};
Stat stat_of(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back()};
}

// --threads: one decode row's attention over every layer through paged_decode_attention_cpu, split and unsplit on
// `threads` threads, and on one.
void run_threaded(const Shape& sh, int64_t len, runtime::KVType type, int threads, int rounds) {
  using namespace runtime;
  const int32_t Hq = sh.kv_heads * sh.group, d = sh.head_dim;
  const PagedKVShape shape{sh.layers, sh.kv_heads, d, static_cast<int32_t>(kBlock)};
  const std::vector<DecodeView> views(static_cast<size_t>(sh.layers * Hq));  // dense
  const auto nblocks = static_cast<int32_t>(sh.layers * sh.kv_heads * ((len + kBlock - 1) / kBlock));
  BlockPool blocks(nblocks);
  PagedKVStore store(shape, nblocks, type);
  SequenceBlocks seq(shape, std::vector<KVRetention>(static_cast<size_t>(sh.layers * sh.kv_heads)));
  seq.grow(len, blocks);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<float> k(static_cast<size_t>(kBlock * d)), v(k.size());
    for (int32_t b = 0; b < nblocks; ++b) {
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      store.write(b, 0, kBlock, k.data(), v.data());
    }
  }
  const std::vector<DecodeRow> rows{{&seq, views}};
  std::vector<float> q(static_cast<size_t>(Hq * d)), out(q.size()), ref(q.size());
  {
    std::mt19937 rng(2);
    std::normal_distribution<float> nd;
    for (float& x : q) x = nd(rng);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ThreadPool one(1), pool(threads);
  const int64_t default_min = attn::paged_split_min_work();
  auto step = [&](ThreadPool& p, int64_t min_work, float* o, bool prefill_order = false) {
    attn::set_paged_split_min_work(min_work);
    runtime::set_decode_in_prefill_order(prefill_order);
    for (int32_t l = 0; l < sh.layers; ++l) paged_decode_attention_cpu(q.data(), o, rows, l, Hq, store, scale, p);
  };
  const std::string n = std::to_string(threads);
  const std::vector<std::pair<std::string, std::function<void(float*)>>> variants{
      {"1 thread", [&](float* o) { step(one, default_min, o); }},
      {n + " threads, unsplit", [&](float* o) { step(pool, 0, o); }},
      {n + " threads, split", [&](float* o) { step(pool, default_min, o); }},
      {n + " threads, prefill order", [&](float* o) { step(pool, default_min, o, true); }},
      {"1 thread, prefill order", [&](float* o) { step(one, default_min, o, true); }}};
  variants[0].second(ref.data());
  double worst = 0;
  for (size_t v = 1; v < variants.size(); ++v) {
    variants[v].second(out.data());
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(out[i] - ref[i])));
  }
  std::vector<std::vector<double>> ms(variants.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = r % 2 == 0 ? k : variants.size() - 1 - k;
      const auto t0 = std::chrono::steady_clock::now();
      variants[v].second(out.data());
      ms[v].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  attn::set_paged_split_min_work(default_min);
  runtime::set_decode_in_prefill_order(true);
  const Stat unsplit = stat_of(ms[1]);
  for (size_t v = 0; v < variants.size(); ++v) {
    const Stat st = stat_of(ms[v]);
    std::printf("| %s | %lld | %s | %s | %.2f | %.2f-%.2f | %.2fx |\n", sh.name, static_cast<long long>(len),
                std::string(kv_type_name(type)).c_str(), variants[v].first.c_str(), st.med, st.lo, st.hi,
                unsplit.med / st.med);
  }
  std::printf("|  |  |  | (max |difference| from 1 thread: %.2g) |  |  |  |\n", worst);
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name, lengths_s = "1024,4096,8192", types_s = "f16,bf16,f32";
  int rounds = 7, threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shape") {
      shape_name = next();
    } else if (a == "--lengths") {
      lengths_s = next();
    } else if (a == "--types") {
      types_s = next();
    } else if (a == "--rounds") {
      rounds = std::stoi(next());
    } else if (a == "--threads") {
      threads = std::stoi(next());
    } else if (a == "--min-work") {
      attn::set_paged_split_min_work(std::stoll(next()));
    } else {
      std::fprintf(stderr,
                   "usage: paged_decode_bench [--shape smollm2|gemma3] [--lengths 1024,4096] "
                   "[--types f16,bf16,f32] [--rounds 7] [--threads N [--min-work W]]\n");
      return 2;
    }
  }
  std::vector<runtime::KVType> types;
  for (size_t at = 0; at <= types_s.size();) {
    const size_t comma = std::min(types_s.find(',', at), types_s.size());
    types.push_back(runtime::parse_kv_type(types_s.substr(at, comma - at)));
    at = comma + 1;
  }
  if (threads > 1) {
    std::printf("# paged_decode_bench, paged_decode_attention_cpu on %d threads (split at a minimum work of %lld) "
                "and on 1, blocks of %lld tokens, %d rounds, path %s; load average before: %s\n",
                threads, static_cast<long long>(attn::paged_split_min_work()), static_cast<long long>(kBlock), rounds,
                std::string(attn::paged_isa_name(attn::paged_decode_isa())).c_str(), loadavg().c_str());
    std::printf("| shape | keys | KV type | variant | step ms (median) | spread ms | vs unsplit |\n");
    std::printf("|---|---:|---|---|---:|---:|---:|\n");
    for (const Shape& sh : kShapes) {
      if (!shape_name.empty() && shape_name != sh.name) continue;
      for (int64_t len : parse_list(lengths_s))
        for (runtime::KVType type : types) run_threaded(sh, len, type, threads, rounds);
    }
    std::printf("# load average after: %s\n", loadavg().c_str());
    return 0;
  }
  std::vector<std::pair<std::string, PagedIsa>> paths;
  for (PagedIsa isa : {PagedIsa::Portable, PagedIsa::Avx2, PagedIsa::Avx512})
    if (attn::paged_decode_isa_available(isa))
      paths.emplace_back(std::string(attn::paged_isa_name(isa)), isa);
  std::printf("# paged_decode_bench, 1 thread, blocks of %lld tokens, %d rounds; load average before: %s\n",
              static_cast<long long>(kBlock), rounds, loadavg().c_str());
  std::printf(
      "| shape | keys | KV type | MB read | path | step ms (median) | spread ms | GB/s | vs before |\n");
  std::printf("|---|---:|---|---:|---|---:|---:|---:|---:|\n");
  for (const Shape& sh : kShapes) {
    if (!shape_name.empty() && shape_name != sh.name) continue;
    for (int64_t len : parse_list(lengths_s))
      for (runtime::KVType type : types) {
        const int64_t d = sh.head_dim, items = static_cast<int64_t>(sh.layers) * sh.kv_heads;
        const int64_t nblocks = (len + kBlock - 1) / kBlock;
        const size_t per_item = static_cast<size_t>(nblocks * kBlock * d);
        const size_t es = runtime::kv_type_size(type);
        std::vector<std::byte> K(per_item * static_cast<size_t>(items) * es), V(K.size());
        {
          std::mt19937 rng(1);
          std::normal_distribution<float> nd;
          std::vector<float> row(per_item);
          for (int64_t it = 0; it < items; ++it)
            for (std::vector<std::byte>* dst : {&K, &V}) {
              for (float& x : row) x = nd(rng);
              std::byte* at = dst->data() + static_cast<size_t>(it) * per_item * es;
              if (type == runtime::KVType::F32)
                std::memcpy(at, row.data(), per_item * es);
              else
                runtime::f32_to_half(row.data(), reinterpret_cast<uint16_t*>(at),
                                     static_cast<int64_t>(per_item), type);
            }
        }
        // Each item's blocks in reverse order (as a paged store's need not be in order).
        std::vector<std::vector<KeySpan>> spans(static_cast<size_t>(items));
        for (int64_t it = 0; it < items; ++it)
          for (int64_t b = 0; b < nblocks; ++b) {
            const size_t at =
                (static_cast<size_t>(it) * per_item + static_cast<size_t>((nblocks - 1 - b) * kBlock * d)) *
                es;
            spans[static_cast<size_t>(it)].push_back(
                {K.data() + at, V.data() + at, std::min(kBlock, len - b * kBlock)});
          }
        std::vector<float> q(static_cast<size_t>(sh.group * d)), out(q.size()), ref(q.size());
        {
          std::mt19937 rng(2);
          std::normal_distribution<float> nd;
          for (float& x : q) x = nd(rng);
        }
        const DType elem = type == runtime::KVType::F16    ? DType::F16
                           : type == runtime::KVType::BF16 ? DType::BF16
                                                           : DType::F32;
        std::vector<float> kbuf(static_cast<size_t>(kBlock * d)), vbuf(kbuf.size()),
            acc(static_cast<size_t>(sh.group * d)), score(static_cast<size_t>(kBlock));
        auto job_for = [&](int64_t it, float* o) {
          PagedDecodeJob job;
          job.q = q.data();
          job.out = o;
          job.heads = sh.group;
          job.head_dim = sh.head_dim;
          job.elem = elem;
          job.scale = 1.0f / std::sqrt(static_cast<float>(d));
          job.spans = spans[static_cast<size_t>(it)];
          return job;
        };
        // Variants: before, then each path; a step runs every item.
        std::vector<std::pair<std::string, std::function<void(float*)>>> variants;
        variants.emplace_back("before", [&](float* o) {
          for (int64_t it = 0; it < items; ++it) before(job_for(it, o), type, kbuf, vbuf, acc, score);
        });
        for (const auto& [name, isa] : paths)
          variants.emplace_back(name, [&, isa = isa](float* o) {
            for (int64_t it = 0; it < items; ++it) attn::paged_decode(job_for(it, o), isa);
          });
        // Agreement (the last item's output) with `before`, printed for the record.
        variants[0].second(ref.data());
        double worst = 0;
        for (size_t v = 1; v < variants.size(); ++v) {
          variants[v].second(out.data());
          for (size_t i = 0; i < out.size(); ++i)
            worst = std::max(worst, static_cast<double>(std::abs(out[i] - ref[i])));
        }
        std::vector<std::vector<double>> ms(variants.size());
        for (int r = 0; r < rounds; ++r)
          for (size_t k = 0; k < variants.size(); ++k) {
            const size_t v = r % 2 == 0 ? k : variants.size() - 1 - k;  // alternate the order
            const auto t0 = std::chrono::steady_clock::now();
            variants[v].second(out.data());
            ms[v].push_back(
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          }
        const double mb = 2.0 * static_cast<double>(items) * static_cast<double>(len) *
                          static_cast<double>(d) * static_cast<double>(es) / 1e6;
        double before_med = 0;
        for (size_t v = 0; v < variants.size(); ++v) {
          std::vector<double> t = ms[v];
          std::sort(t.begin(), t.end());
          const double med = t[t.size() / 2];
          if (v == 0) before_med = med;
          std::printf("| %s | %lld | %s | %.1f | %s | %.2f | %.2f-%.2f | %.1f | %.2fx |\n", sh.name,
                      static_cast<long long>(len), std::string(runtime::kv_type_name(type)).c_str(), mb,
                      variants[v].first.c_str(), med, t.front(), t.back(), mb / med, before_med / med);
        }
        std::printf("|  |  |  |  | (max |difference| from before: %.2g) |  |  |  |  |\n", worst);
      }
  }
  std::printf("# load average after: %s\n", loadavg().c_str());
  return 0;
}
