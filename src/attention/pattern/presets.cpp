#include "attention/pattern/presets.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <vector>

#include "core/error.h"

namespace tessera::attn {

namespace {

// "name:k=v,k=v" -> name and the key/value pairs (values as text).
struct Spec {
  std::string name;
  std::map<std::string, std::string> params;
};

Spec parse(const std::string& spec) {
  Spec s;
  const size_t colon = spec.find(':');
  s.name = spec.substr(0, colon);
  if (colon == std::string::npos) return s;
  std::string rest = spec.substr(colon + 1);
  size_t pos = 0;
  while (pos <= rest.size()) {
    const size_t comma = rest.find(',', pos);
    const std::string item = rest.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t eq = item.find('=');
    check(eq != std::string::npos && eq > 0,
          "attention spec '" + spec + "': expected key=value, got '" + item + "'");
    check(s.params.emplace(item.substr(0, eq), item.substr(eq + 1)).second,
          "attention spec '" + spec + "': parameter '" + item.substr(0, eq) + "' given twice");
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return s;
}

class Params {
 public:
  Params(const std::string& spec, Spec parsed, std::vector<std::string> known)
      : spec_(spec), p_(std::move(parsed.params)), known_(std::move(known)) {
    for (const auto& [key, value] : p_) {
      bool ok = false;
      std::string list;
      for (const std::string& k : known_) {
        ok |= k == key;
        list += (list.empty() ? "" : ", ") + k;
      }
      check(ok, "attention spec '" + spec_ + "': unknown parameter '" + key + "' (known: " + list + ")");
    }
  }
  int32_t integer(const std::string& key, int32_t fallback) const {
    auto it = p_.find(key);
    if (it == p_.end()) return fallback;
    int32_t v = 0;
    const auto [ptr, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
    check(ec == std::errc() && ptr == it->second.data() + it->second.size(),
          "attention spec '" + spec_ + "': parameter '" + key + "' must be an integer, got '" + it->second + "'");
    return v;
  }
  double real(const std::string& key, double fallback) const {
    auto it = p_.find(key);
    if (it == p_.end()) return fallback;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    check(used == it->second.size() && used > 0,
          "attention spec '" + spec_ + "': parameter '" + key + "' must be a number, got '" + it->second + "'");
    return v;
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    auto it = p_.find(key);
    return it == p_.end() ? fallback : it->second;
  }

 private:
  std::string spec_;
  std::map<std::string, std::string> p_;
  std::vector<std::string> known_;
};

VerticalSlashPattern vs_from(const Params& p, double default_gamma = 0.0) {
  VerticalSlashPattern v;
  v.vertical = p.integer("v", v.vertical);
  v.slash = p.integer("s", v.slash);
  v.last_q = p.integer("last_q", v.last_q);
  v.gamma = p.real("gamma", default_gamma);
  v.min_vertical = p.integer("min_v", v.min_vertical);
  v.min_slash = p.integer("min_s", v.min_slash);
  return v;
}

BlockSparsePattern bs_from(const Params& p, double default_gamma = 0.0) {
  BlockSparsePattern b;
  b.top_k = p.integer("top_k", b.top_k);
  b.block = p.integer("block", b.block);
  b.gamma = p.real("gamma", default_gamma);
  b.min_top_k = p.integer("min_top_k", b.min_top_k);
  return b;
}

// The adaptive presets' gamma must be a coverage target in (0, 1] (0, the fixed budgets, is `vs` / `bs`).
template <typename P>
P adaptive_checked(P pattern, const std::string& spec) {
  if (!(pattern.gamma > 0.0 && pattern.gamma <= 1.0)) {  // also NaN
    char got[32];
    std::snprintf(got, sizeof got, "%g", pattern.gamma);
    throw Error("attention spec '" + spec + "': parameter 'gamma' must be in (0, 1], got " + got);
  }
  return pattern;
}

TrianglePattern triangle_from(const Params& p) {
  TrianglePattern t;
  t.sink = p.integer("sink", t.sink);
  t.local = p.integer("local", t.local);
  t.last = p.integer("last", t.last);
  return t;
}

constexpr int kMaxSpecLayers = 4096;  // the layer limit of model configs (model/model_config.cpp)

// A preset's pattern is checked here, with the preset's own parameter names, before a policy is built from it
// (policy-level errors would name a layer and head, as for a file).
Pattern checked(const Pattern& p, const std::string& spec) {
  static const std::map<std::string, std::string> param_of = {
      {"vertical", "v"}, {"slash", "s"}, {"last_q", "last_q"}, {"sink", "sink"},   {"local", "local"},
      {"last", "last"},  {"top_k", "top_k"}, {"block", "block"}, {"alpha", "alpha"}, {"beta", "beta"},
      {"gamma", "gamma"}, {"min_vertical", "min_v"}, {"min_slash", "min_s"}, {"min_top_k", "min_top_k"}};
  validate(p, "attention spec '" + spec + "'", [](const char* field) {
    const auto it = param_of.find(field);
    return "parameter '" + (it == param_of.end() ? std::string(field) : it->second) + "'";
  });
  return p;
}

// Whether `spec` names something on disk. The error_code overload: a spec too long to be a path (ENAMETOOLONG)
// is no file, not a std::filesystem::filesystem_error (found by tests/fuzz/fuzz_attn_spec).
bool names_a_file(const std::string& spec) {
  std::error_code ec;
  return std::filesystem::exists(spec, ec);
}

}  // namespace

namespace {

// A preset's policy with the model's sliding-window layers dense (their window applies on top: PolicyShape).
AttentionPolicy with_model_windows(AttentionPolicy policy, const PolicyShape& shape) {
  const int layers = std::min(policy.num_layers(), static_cast<int>(shape.sliding_windows.size()));
  for (int l = 0; l < layers; ++l) {
    if (shape.sliding_windows[static_cast<size_t>(l)] <= 0) continue;
    for (int h = 0; h < policy.num_q_heads(); ++h) policy.at(l, h) = DensePattern{};
  }
  return policy;
}

AttentionPolicy preset_policy(const std::string& spec, const Spec& parsed, const PolicyShape& shape);

}  // namespace

AttentionPolicy policy_from_spec(const std::string& spec, const PolicyShape& shape) {
  check(!spec.empty(), "attention spec is empty");
  const Spec parsed = parse(spec);
  if (!is_preset_name(parsed.name) && parsed.params.empty() && names_a_file(spec)) return load_policy_file(spec, shape);
  return with_model_windows(preset_policy(spec, parsed, shape), shape);
}

namespace {

AttentionPolicy preset_policy(const std::string& spec, const Spec& parsed, const PolicyShape& shape) {
  const std::string& name = parsed.name;
  auto uniform = [&](const Pattern& p) {
    return AttentionPolicy::uniform(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, checked(p, spec));
  };
  if (name == "dense") {
    Params p(spec, parsed, {});
    return uniform(DensePattern{});
  }
  if (name == "ashape" || name == "streaming") {
    Params p(spec, parsed, {"sink", "local"});
    AShapePattern a;
    return uniform(AShapePattern{p.integer("sink", a.sink), p.integer("local", a.local)});
  }
  if (name == "triangle") {
    Params p(spec, parsed, {"sink", "local", "last"});
    return uniform(triangle_from(p));
  }
  if (name == "vs" || name == "minference") {
    Params p(spec, parsed, {"v", "s", "last_q"});
    return uniform(vs_from(p));
  }
  if (name == "vs_adaptive") {
    Params p(spec, parsed, {"gamma", "v", "s", "min_v", "min_s", "last_q"});
    return uniform(adaptive_checked(vs_from(p, kDefaultAdaptiveGamma), spec));
  }
  if (name == "bs") {
    Params p(spec, parsed, {"top_k", "block"});
    return uniform(bs_from(p));
  }
  if (name == "bs_adaptive") {
    Params p(spec, parsed, {"gamma", "top_k", "min_top_k", "block"});
    return uniform(adaptive_checked(bs_from(p, kDefaultAdaptiveGamma), spec));
  }
  if (name == "moa") {
    Params p(spec, parsed, {"alpha", "beta", "sink"});
    ElasticWindowPattern e;
    return uniform(ElasticWindowPattern{p.real("alpha", e.alpha), p.real("beta", e.beta), p.integer("sink", e.sink)});
  }
  if (name == "trianglemix") {
    Params p(spec, parsed, {"start", "inner", "sink", "local", "last", "v", "s", "last_q"});
    const std::string inner = p.text("inner", "dense");
    check(inner == "dense" || inner == "vs",
          "attention spec '" + spec + "': inner must be 'dense' or 'vs', got '" + inner + "'");
    const AttentionPolicy base = inner == "vs" ? uniform(vs_from(p)) : uniform(DensePattern{});
    const int32_t start = p.integer("start", shape.num_layers / 2);
    check(start >= 0 && start <= shape.num_layers, "attention spec '" + spec + "': parameter 'start' must be in [0, " +
                                                     std::to_string(shape.num_layers) + "] (the model's layers), got " +
                                                     std::to_string(start));
    const TrianglePattern triangle = triangle_from(p);
    (void)checked(triangle, spec);
    return AttentionPolicy::trianglemix(base, start, triangle);
  }
  throw Error("attention spec '" + spec + "': not a preset (" + preset_list() + ") nor an existing policy file");
}

}  // namespace

bool is_preset_name(const std::string& name) {
  for (const char* p : {"dense", "ashape", "streaming", "triangle", "vs", "vs_adaptive", "minference", "bs",
                        "bs_adaptive", "moa", "trianglemix"})
    if (name == p) return true;
  return false;
}

const char* preset_list() {
  return "dense, ashape, triangle, vs, vs_adaptive, minference, bs, bs_adaptive, moa, trianglemix";
}

void check_policy_spec(const std::string& spec) {
  check(!spec.empty(), "attention spec is empty");
  const Spec parsed = parse(spec);
  if (parsed.params.empty() && names_a_file(spec)) {
    (void)load_policy_file(spec);  // every check but the model's shape
    return;
  }
  // A preset on a stand-in shape: one head per layer, as many layers as any model has (trianglemix's start).
  (void)policy_from_spec(spec, PolicyShape{kMaxSpecLayers, 1, 1});
}

}  // namespace tessera::attn
