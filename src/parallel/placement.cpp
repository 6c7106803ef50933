#include "parallel/placement.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <variant>

#include "attention/index/dense_shortcut.h"
#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::parallel {

using nlohmann::json;

namespace {

// splitmix64: a small generator whose sequence is the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int32_t below(int32_t n) { return static_cast<int32_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_;
};

// Eq. 11-12 for one layer: the per-GPU loads of an assignment.
void layer_loads(const LayerCosts& c, int32_t group, const std::vector<int32_t>& gpu_of_head,
                 int32_t num_gpus, std::vector<double>& loads, std::vector<uint8_t>& held) {
  loads.assign(static_cast<size_t>(num_gpus), 0.0);
  const size_t groups = c.attn.size() / static_cast<size_t>(group);
  held.assign(groups * static_cast<size_t>(num_gpus), 0);
  for (size_t h = 0; h < c.attn.size(); ++h) {
    const auto d = static_cast<size_t>(gpu_of_head[h]);
    loads[d] += c.attn[h] + c.qo;
    uint8_t& g = held[(h / static_cast<size_t>(group)) * static_cast<size_t>(num_gpus) + d];
    if (!g) {
      g = 1;
      loads[d] += c.kv;
    }
  }
}

double layer_makespan(const LayerCosts& c, int32_t group, const std::vector<int32_t>& gpu_of_head,
                      int32_t num_gpus, std::vector<double>& loads, std::vector<uint8_t>& held) {
  layer_loads(c, group, gpu_of_head, num_gpus, loads, held);
  return *std::max_element(loads.begin(), loads.end());
}

std::vector<int32_t> uniform_layer(int32_t heads, int32_t num_gpus) {
  std::vector<int32_t> a(static_cast<size_t>(heads));
  for (int32_t d = 0; d < num_gpus; ++d) {
    const int32_t b = static_cast<int32_t>(static_cast<int64_t>(d) * heads / num_gpus);
    const int32_t e = static_cast<int32_t>(static_cast<int64_t>(d + 1) * heads / num_gpus);
    for (int32_t h = b; h < e; ++h) a[static_cast<size_t>(h)] = d;
  }
  return a;
}

std::vector<int32_t> greedy_layer(const LayerCosts& c, int32_t group, int32_t num_gpus) {
  const auto heads = static_cast<int32_t>(c.attn.size());
  std::vector<int32_t> order(static_cast<size_t>(heads));
  std::iota(order.begin(), order.end(), 0);
  // Longest first; equal costs keep head order (stable), so the result is deterministic.
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return c.attn[static_cast<size_t>(a)] > c.attn[static_cast<size_t>(b)];
  });
  std::vector<double> load(static_cast<size_t>(num_gpus), 0.0);
  std::vector<uint8_t> held(static_cast<size_t>(heads / group * num_gpus), 0);
  std::vector<int32_t> a(static_cast<size_t>(heads), 0);
  for (int32_t h : order) {
    const int32_t g = h / group;
    int32_t best = 0;
    double best_end = 0;
    for (int32_t d = 0; d < num_gpus; ++d) {
      const double add =
          c.attn[static_cast<size_t>(h)] + c.qo + (held[static_cast<size_t>(g * num_gpus + d)] ? 0 : c.kv);
      const double end = load[static_cast<size_t>(d)] + add;
      if (d == 0 || end < best_end ||
          (end == best_end && load[static_cast<size_t>(d)] < load[static_cast<size_t>(best)])) {
        best = d;
        best_end = end;
      }
    }
    a[static_cast<size_t>(h)] = best;
    load[static_cast<size_t>(best)] = best_end;
    held[static_cast<size_t>(g * num_gpus + best)] = 1;
  }
  return a;
}

std::vector<int32_t> genetic_layer(const LayerCosts& c, int32_t group, int32_t num_gpus,
                                   const GeneticOptions& o, uint64_t layer_seed) {
  const auto heads = static_cast<int32_t>(c.attn.size());
  Rng rng(layer_seed);
  std::vector<double> loads;
  std::vector<uint8_t> held;
  auto cost = [&](const std::vector<int32_t>& ind) {
    return layer_makespan(c, group, ind, num_gpus, loads, held);
  };
  const auto pop_size = static_cast<size_t>(std::max(o.population, 2));

  std::vector<std::vector<int32_t>> pop;
  pop.push_back(uniform_layer(heads, num_gpus));
  pop.push_back(greedy_layer(c, group, num_gpus));  // (uniform is already in: the better of the two is kept)
  while (pop.size() < pop_size) {
    std::vector<int32_t> ind(static_cast<size_t>(heads));
    for (int32_t& g : ind) g = rng.below(num_gpus);
    pop.push_back(std::move(ind));
  }
  std::vector<double> costs(pop.size());
  for (size_t i = 0; i < pop.size(); ++i) costs[i] = cost(pop[i]);

  auto best_of = [&] {
    return static_cast<size_t>(std::min_element(costs.begin(), costs.end()) - costs.begin());
  };
  double best = costs[best_of()];
  int32_t stall = 0;
  const size_t elite = std::min(pop_size, static_cast<size_t>(std::max(o.elite, 0)));
  for (int32_t gen = 0; gen < o.max_generations && stall < o.stall_generations; ++gen) {
    // Roulette wheel on fitness 1 / cost.
    std::vector<double> wheel(pop.size());
    double acc = 0;
    for (size_t i = 0; i < pop.size(); ++i) {
      acc += costs[i] > 0 ? 1.0 / costs[i] : 1.0;
      wheel[i] = acc;
    }
    auto pick = [&]() -> const std::vector<int32_t>& {
      const double r = rng.uniform() * acc;
      const size_t i = static_cast<size_t>(std::upper_bound(wheel.begin(), wheel.end(), r) - wheel.begin());
      return pop[std::min(i, pop.size() - 1)];
    };
    // Elites first (by cost, ties to the lower index).
    std::vector<size_t> rank(pop.size());
    std::iota(rank.begin(), rank.end(), size_t{0});
    std::stable_sort(rank.begin(), rank.end(), [&](size_t a, size_t b) { return costs[a] < costs[b]; });
    std::vector<std::vector<int32_t>> next;
    for (size_t i = 0; i < elite; ++i) next.push_back(pop[rank[i]]);
    while (next.size() < pop_size) {
      std::vector<int32_t> a = pick(), b = pick();
      if (heads > 1 && rng.uniform() < o.crossover) {
        const int32_t cut = 1 + rng.below(heads - 1);  // single point in [1, heads)
        for (int32_t h = cut; h < heads; ++h) std::swap(a[static_cast<size_t>(h)], b[static_cast<size_t>(h)]);
      }
      for (auto* child : {&a, &b}) {
        for (int32_t& g : *child)
          if (num_gpus > 1 && rng.uniform() < o.mutation) g = (g + 1 + rng.below(num_gpus - 1)) % num_gpus;
        if (next.size() < pop_size) next.push_back(std::move(*child));
      }
    }
    pop = std::move(next);
    for (size_t i = 0; i < pop.size(); ++i) costs[i] = cost(pop[i]);
    const double b = costs[best_of()];
    if (b < best) {
      best = b;
      stall = 0;
    } else {
      ++stall;
    }
  }
  return pop[best_of()];
}

const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

template <class T>
T get(const json& j, const char* key, const std::string& source) {
  const json* v = find(j, key);
  if (v == nullptr) throw Error(source + ": missing field '" + key + "'");
  try {
    return v->get<T>();
  } catch (const json::exception&) {
    throw Error(source + ": field '" + key + "' has the wrong type (" + v->dump() + ")");
  }
}

}  // namespace

CostModel flop_costs(const attn::AttentionPolicy& policy, int64_t length, int64_t hidden, int64_t head_dim,
                     const FlopRates& rates) {
  check(length > 0 && length <= INT32_MAX,
        "placement: prompt length must be in [1, 2^31), got " + std::to_string(length));
  CostModel m;
  m.num_q_heads = policy.num_q_heads();
  m.num_kv_heads = policy.num_kv_heads();
  m.source = "flops";
  const auto len = static_cast<int32_t>(length);
  const attn::LoweringContext ctx = attn::LoweringContext::prefill(len, 128);
  const double causal = static_cast<double>(length) * static_cast<double>(length + 1) / 2.0;
  const double d = static_cast<double>(head_dim);
  const double proj =
      2.0 * static_cast<double>(length) * static_cast<double>(hidden) * d / rates.gemm_flops_per_s;
  for (int32_t l = 0; l < policy.num_layers(); ++l) {
    LayerCosts c;
    c.qo = 2 * proj;
    c.kv = 2 * proj;
    for (int32_t h = 0; h < policy.num_q_heads(); ++h) {
      const attn::Pattern& p = policy.at(l, h);
      double flops = 4.0 * d * causal * attn::head_coverage(p, ctx);
      if (const auto* vs = std::get_if<attn::VerticalSlashPattern>(&p))
        flops += 2.0 * d * vs->last_q * static_cast<double>(length);
      if (const auto* bs = std::get_if<attn::BlockSparsePattern>(&p)) {
        const double blocks = static_cast<double>(length) / std::max(bs->block, 1);
        flops += 2.0 * d * blocks * blocks / 2.0;
      }
      c.attn.push_back(flops / rates.attention_flops_per_s);
    }
    m.layers.push_back(std::move(c));
  }
  return m;
}

json HeadCostProfile::to_json() const {
  json j;
  j["tessera_head_profile"] = 1;
  j["device"] = device;
  json e = json::array();
  for (const Entry& x : entries)
    e.push_back({{"pattern", x.pattern}, {"length", x.length}, {"seconds", x.seconds}});
  j["entries"] = e;
  json p = json::array();
  for (const Projection& x : projections)
    p.push_back({{"length", x.length}, {"qo_seconds", x.qo_seconds}, {"kv_seconds", x.kv_seconds}});
  j["projections"] = p;
  return j;
}

HeadCostProfile HeadCostProfile::from_json(const json& j, const std::string& source) {
  if (!j.is_object() || find(j, "tessera_head_profile") == nullptr)
    throw Error(source + ": not a head profile (an object with \"tessera_head_profile\")");
  HeadCostProfile p;
  if (const json* dev = find(j, "device"); dev != nullptr && dev->is_string())
    p.device = dev->get<std::string>();
  for (const json& e : get<json>(j, "entries", source)) {
    Entry x{get<std::string>(e, "pattern", source), get<int64_t>(e, "length", source),
            get<double>(e, "seconds", source)};
    if (x.length <= 0 || !(x.seconds >= 0))
      throw Error(source + ": entry for " + x.pattern + " needs length > 0 and seconds >= 0");
    p.entries.push_back(std::move(x));
  }
  if (const json* pr = find(j, "projections"); pr != nullptr)
    for (const json& e : *pr)
      p.projections.push_back({get<int64_t>(e, "length", source), get<double>(e, "qo_seconds", source),
                               get<double>(e, "kv_seconds", source)});
  return p;
}

namespace {

// Interpolates (length, value) samples at `length`: linear between neighbours, scaled by (length /
// nearest)^power outside.
double interpolate(std::vector<std::pair<int64_t, double>> s, int64_t length, double power) {
  std::sort(s.begin(), s.end());
  if (length <= s.front().first)
    return s.front().second *
           std::pow(static_cast<double>(length) / static_cast<double>(s.front().first), power);
  if (length >= s.back().first)
    return s.back().second *
           std::pow(static_cast<double>(length) / static_cast<double>(s.back().first), power);
  for (size_t i = 1; i < s.size(); ++i)
    if (length <= s[i].first) {
      const double t =
          static_cast<double>(length - s[i - 1].first) / static_cast<double>(s[i].first - s[i - 1].first);
      return s[i - 1].second + t * (s[i].second - s[i - 1].second);
    }
  return s.back().second;
}

}  // namespace

CostModel profile_costs(const attn::AttentionPolicy& policy, int64_t length, const HeadCostProfile& profile,
                        const std::string& source) {
  std::map<std::string, std::vector<std::pair<int64_t, double>>> by_pattern;
  for (const auto& e : profile.entries) by_pattern[e.pattern].emplace_back(e.length, e.seconds);
  check(!profile.projections.empty(), source + ": the profile has no projection timings");
  std::vector<std::pair<int64_t, double>> qo, kv;
  for (const auto& p : profile.projections) {
    qo.emplace_back(p.length, p.qo_seconds);
    kv.emplace_back(p.length, p.kv_seconds);
  }
  CostModel m;
  m.num_q_heads = policy.num_q_heads();
  m.num_kv_heads = policy.num_kv_heads();
  m.source = source;
  std::map<std::string, double> memo;
  for (int32_t l = 0; l < policy.num_layers(); ++l) {
    LayerCosts c;
    c.qo = interpolate(qo, length, 1.0);
    c.kv = interpolate(kv, length, 1.0);
    for (int32_t h = 0; h < policy.num_q_heads(); ++h) {
      const std::string name = attn::describe(policy.at(l, h));
      auto hit = memo.find(name);
      if (hit == memo.end()) {
        auto it = by_pattern.find(name);
        if (it == by_pattern.end())
          throw Error(source + ": the profile has no timing for " + name + " (layer " + std::to_string(l) +
                      ", head " + std::to_string(h) + "); profile it with tp_bench --profile");
        hit = memo.emplace(name, interpolate(it->second, length, 2.0)).first;
      }
      c.attn.push_back(hit->second);
    }
    m.layers.push_back(std::move(c));
  }
  return m;
}

namespace {
constexpr std::string_view kPlacementNames[] = {"uniform", "greedy", "genetic"};  // PlacementMethod's order
}  // namespace

const char* placement_method_name(PlacementMethod m) { return enum_name(kPlacementNames, m).data(); }

PlacementMethod parse_placement_method(const std::string& name) {
  if (const std::optional<PlacementMethod> m = enum_value<PlacementMethod>(kPlacementNames, name)) return *m;
  throw Error("unknown placement method '" + name + "' (uniform, greedy, genetic)");
}

void check_gpu_count(int32_t num_gpus, int32_t num_q_heads) {
  check(num_gpus >= 1, "placement: the GPU count must be at least 1, got " + std::to_string(num_gpus));
  check(num_gpus <= num_q_heads, "placement: " + std::to_string(num_gpus) + " GPUs but the model has " +
                                     std::to_string(num_q_heads) + " query heads per layer; use at most " +
                                     std::to_string(num_q_heads) + " GPUs");
}

std::vector<int32_t> Placement::heads_of(int32_t layer, int32_t gpu) const {
  std::vector<int32_t> out;
  const auto& a = gpu_of_head.at(static_cast<size_t>(layer));
  for (size_t h = 0; h < a.size(); ++h)
    if (a[h] == gpu)
      out.push_back(static_cast<int32_t>(h));  // head order is group order (GQA groups are contiguous)
  return out;
}

std::vector<int32_t> Placement::groups_of(int32_t layer, int32_t gpu) const {
  std::vector<int32_t> out;
  const int32_t group = num_q_heads / num_kv_heads;
  for (int32_t h : heads_of(layer, gpu))
    if (out.empty() || out.back() != h / group) out.push_back(h / group);
  return out;
}

Placement place_uniform(const CostModel& costs, int32_t num_gpus) {
  return place(costs, num_gpus, PlacementMethod::kUniform);
}

Placement place(const CostModel& costs, int32_t num_gpus, PlacementMethod method,
                const GeneticOptions& genetic) {
  check(costs.num_kv_heads > 0 && costs.num_q_heads % costs.num_kv_heads == 0,
        "placement: query heads (" + std::to_string(costs.num_q_heads) +
            ") must be a multiple of KV heads (" + std::to_string(costs.num_kv_heads) + ")");
  check_gpu_count(num_gpus, costs.num_q_heads);
  const auto t0 = std::chrono::steady_clock::now();
  Placement p;
  p.num_gpus = num_gpus;
  p.num_q_heads = costs.num_q_heads;
  p.num_kv_heads = costs.num_kv_heads;
  p.method = placement_method_name(method);
  p.cost_source = costs.source;
  p.seed = method == PlacementMethod::kGenetic ? genetic.seed : 0;
  for (size_t l = 0; l < costs.layers.size(); ++l) {
    const LayerCosts& c = costs.layers[l];
    check(static_cast<int32_t>(c.attn.size()) == costs.num_q_heads,
          "placement: layer " + std::to_string(l) + " has " + std::to_string(c.attn.size()) +
              " head costs, expected " + std::to_string(costs.num_q_heads));
    switch (method) {
      case PlacementMethod::kUniform:
        p.gpu_of_head.push_back(uniform_layer(costs.num_q_heads, num_gpus));
        break;
      case PlacementMethod::kGreedy: {
        // Greedy is a heuristic: where it splits KV groups for no gain it can end behind the uniform split;
        // the layer then keeps the uniform split.
        std::vector<int32_t> g = greedy_layer(c, costs.group_size(), num_gpus);
        std::vector<int32_t> u = uniform_layer(costs.num_q_heads, num_gpus);
        std::vector<double> loads;
        std::vector<uint8_t> held;
        const double cg = layer_makespan(c, costs.group_size(), g, num_gpus, loads, held);
        const double cu = layer_makespan(c, costs.group_size(), u, num_gpus, loads, held);
        p.gpu_of_head.push_back(cg <= cu ? std::move(g) : std::move(u));
        break;
      }
      case PlacementMethod::kGenetic:
        // One stream per layer, derived from the seed: a layer's result does not depend on the others.
        p.gpu_of_head.push_back(
            genetic_layer(c, costs.group_size(), num_gpus, genetic, genetic.seed * 0x100000001B3ull + l + 1));
        break;
    }
  }
  p.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

std::vector<std::vector<double>> gpu_costs(const CostModel& costs, const Placement& placement) {
  std::vector<std::vector<double>> out;
  std::vector<double> loads;
  std::vector<uint8_t> held;
  for (size_t l = 0; l < costs.layers.size(); ++l) {
    layer_loads(costs.layers[l], costs.group_size(), placement.gpu_of_head.at(l), placement.num_gpus, loads,
                held);
    out.push_back(loads);
  }
  return out;
}

PlacementSummary summarize(const CostModel& costs, const Placement& placement) {
  PlacementSummary s;
  const auto per = gpu_costs(costs, placement);
  for (const auto& loads : per) {
    const double mx = *std::max_element(loads.begin(), loads.end());
    const double mn = *std::min_element(loads.begin(), loads.end());
    s.total += mx;
    s.ideal += std::accumulate(loads.begin(), loads.end(), 0.0) / static_cast<double>(loads.size());
    const double r = mn > 0 ? mx / mn : (mx > 0 ? INFINITY : 1.0);
    s.max_imbalance = std::max(s.max_imbalance, r);
    s.mean_imbalance += r / static_cast<double>(per.size());
  }
  return s;
}

void validate(const Placement& p, int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
              const std::string& source) {
  check(p.num_q_heads == num_q_heads && p.num_kv_heads == num_kv_heads,
        source + ": the placement is for " + std::to_string(p.num_q_heads) + " query / " +
            std::to_string(p.num_kv_heads) + " KV heads, the model has " + std::to_string(num_q_heads) +
            " / " + std::to_string(num_kv_heads));
  check(p.num_layers() == num_layers, source + ": the placement has " + std::to_string(p.num_layers()) +
                                          " layers, the model " + std::to_string(num_layers));
  check_gpu_count(p.num_gpus, num_q_heads);
  for (int32_t l = 0; l < p.num_layers(); ++l) {
    const auto& a = p.gpu_of_head[static_cast<size_t>(l)];
    check(static_cast<int32_t>(a.size()) == num_q_heads,
          source + ": layer " + std::to_string(l) + " places " + std::to_string(a.size()) +
              " heads, expected " + std::to_string(num_q_heads));
    for (size_t h = 0; h < a.size(); ++h)
      check(a[h] >= 0 && a[h] < p.num_gpus, source + ": layer " + std::to_string(l) + " head " +
                                                std::to_string(h) + " is on GPU " + std::to_string(a[h]) +
                                                ", outside [0, " + std::to_string(p.num_gpus) + ")");
  }
}

json placement_to_json(const Placement& p) {
  json j;
  j["tessera_placement"] = 1;
  j["num_gpus"] = p.num_gpus;
  j["num_layers"] = p.num_layers();
  j["num_q_heads"] = p.num_q_heads;
  j["num_kv_heads"] = p.num_kv_heads;
  j["method"] = p.method;
  j["seed"] = p.seed;
  j["length"] = p.length;
  j["cost_source"] = p.cost_source;
  j["search_seconds"] = p.search_seconds;
  j["layers"] = p.gpu_of_head;
  return j;
}

Placement placement_from_json(const json& doc, const std::string& source) {
  const json* pj = &doc;
  if (doc.is_object() && find(doc, "tessera_placement") == nullptr && find(doc, "placement") != nullptr)
    pj = find(doc, "placement");
  const json& j = *pj;
  if (!j.is_object() || find(j, "tessera_placement") == nullptr)
    throw Error(source +
                ": no placement (an object with \"tessera_placement\", or a plan with \"placement\")");
  if (get<int>(j, "tessera_placement", source) != 1)
    throw Error(source + ": unsupported tessera_placement version " + find(j, "tessera_placement")->dump());
  Placement p;
  p.num_gpus = get<int32_t>(j, "num_gpus", source);
  p.num_q_heads = get<int32_t>(j, "num_q_heads", source);
  p.num_kv_heads = get<int32_t>(j, "num_kv_heads", source);
  p.method = get<std::string>(j, "method", source);
  if (find(j, "seed")) p.seed = get<uint64_t>(j, "seed", source);
  if (find(j, "length")) p.length = get<int64_t>(j, "length", source);
  if (find(j, "cost_source")) p.cost_source = get<std::string>(j, "cost_source", source);
  if (find(j, "search_seconds")) p.search_seconds = get<double>(j, "search_seconds", source);
  p.gpu_of_head = get<std::vector<std::vector<int32_t>>>(j, "layers", source);
  const int32_t layers = find(j, "num_layers") ? get<int32_t>(j, "num_layers", source) : p.num_layers();
  check(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
        source + ": num_q_heads must be a multiple of num_kv_heads");
  validate(p, layers, p.num_q_heads, p.num_kv_heads, source);
  return p;
}

void save_placement(const Placement& p, const std::filesystem::path& path) {
  std::ofstream f(path);
  check(static_cast<bool>(f), path.string() + ": cannot write");
  f << placement_to_json(p).dump(1) << "\n";
  check(static_cast<bool>(f), path.string() + ": write failed");
}

Placement load_placement(const std::filesystem::path& path, int32_t num_gpus, int32_t num_layers,
                         int32_t num_q_heads, int32_t num_kv_heads) {
  const std::string source = path.string();
  std::ifstream f(path);
  check(static_cast<bool>(f), source + ": cannot open the placement file");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw Error(source + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  Placement p = placement_from_json(j, source);
  check(p.num_gpus == num_gpus, source + ": the placement was made for " + std::to_string(p.num_gpus) +
                                    " GPUs, this run has " + std::to_string(num_gpus) + "; make one for " +
                                    std::to_string(num_gpus) + " GPUs (tp_bench --gpus " +
                                    std::to_string(num_gpus) + " writes placement_" + p.method +
                                    "_<length>.json)");
  validate(p, num_layers, num_q_heads, num_kv_heads, source);
  return p;
}

Placement plan_placement(const attn::AttentionPolicy& policy, int64_t length, int64_t hidden, int64_t head_dim,
                         int32_t num_gpus, PlacementMethod method) {
  check(length > 0, "placement: the prompt length must be positive, got " + std::to_string(length));
  Placement p = place(flop_costs(policy, length, hidden, head_dim), num_gpus, method);
  p.length = length;
  return p;
}

std::optional<Placement> placement_in_policy_file(const std::filesystem::path& path, int32_t num_gpus,
                                                  int32_t num_layers, int32_t num_q_heads, int32_t num_kv_heads,
                                                  std::string* note) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;  // a preset name, not a file
  std::ifstream f(path);
  if (!f) return std::nullopt;
  const json j = json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("placement")) return std::nullopt;
  Placement p = placement_from_json(j, path.string());
  if (p.num_gpus != num_gpus) {
    if (note)
      *note = path.string() + " holds a placement for " + std::to_string(p.num_gpus) + " GPUs, this run has " +
              std::to_string(num_gpus) + ": placing the heads anew";
    return std::nullopt;
  }
  validate(p, num_layers, num_q_heads, num_kv_heads, path.string());
  return p;
}

}  // namespace tessera::parallel
