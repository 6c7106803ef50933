#include "attention/pattern/config_io.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <utility>

#include "core/error.h"

namespace tessera::attn {

using nlohmann::json;

namespace {

constexpr int kTesseraPolicyVersion = 1;
constexpr int32_t kMoaSink = 64;
constexpr int32_t kMInferenceBlock = 64;

std::string str(int v) {
  return std::to_string(v);
}

std::string layer_head(int layer, int head) {
  return "layer " + str(layer) + ", head " + str(head);
}

// A JSON value as it appears in the file, shortened for messages.
std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

[[noreturn]] void fail_field(const std::string& where, const std::string& field, const std::string& rule,
                             const std::string& got) {
  throw Error(where + ": field '" + field + "' must be " + rule + ", got " + got);
}

// JSON integers, and floats with an integral value (1000.0), that fit in int32.
int32_t get_int32(const json& v, const std::string& where, const std::string& field) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
      fail_field(where, field, "a 32-bit integer", show(v));
    return static_cast<int32_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < std::numeric_limits<int32_t>::min() || i > std::numeric_limits<int32_t>::max())
      fail_field(where, field, "a 32-bit integer", show(v));
    return static_cast<int32_t>(i);
  }
  if (!v.is_number_float()) fail_field(where, field, "an integer", show(v));
  const double d = v.get<double>();
  if (d != std::floor(d)) fail_field(where, field, "an integer", show(v));
  if (d < std::numeric_limits<int32_t>::min() || d > std::numeric_limits<int32_t>::max())
    fail_field(where, field, "a 32-bit integer", show(v));
  return static_cast<int32_t>(d);
}

double get_number(const json& v, const std::string& where, const std::string& field) {
  if (!v.is_number()) fail_field(where, field, "a number", show(v));
  return v.get<double>();
}

// "0", "17": a head or layer index written as a JSON object key (no sign, no leading zeros).
std::optional<int> parse_index_key(const std::string& key) {
  if (key.empty() || key.size() > 9) return std::nullopt;
  if (key.size() > 1 && key[0] == '0') return std::nullopt;
  int v = 0;
  for (char c : key) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

void check_known_keys(const json& obj, std::initializer_list<const char*> known, const std::string& where) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (std::find_if(known.begin(), known.end(), [&](const char* k) { return it.key() == k; }) != known.end())
      continue;
    std::vector<std::string> names(known.begin(), known.end());
    throw Error(where + ": unknown field '" + it.key() + "' (known: " + join(names) + ")");
  }
}

const json* find(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// ---- tessera patterns ------------------------------------------------------------------------------------

// Reads the optional fields of one pattern object; remembers which names it asked for so that any other key
// can be reported as unknown with the list of the known ones.
class FieldReader {
 public:
  FieldReader(const json& obj, const std::string& where) : obj_(obj), where_(where) {}
  void int32(const char* name, int32_t& out) {
    names_.emplace_back(name);
    if (const json* v = find(obj_, name)) out = get_int32(*v, where_, name);
  }
  void number(const char* name, double& out) {
    names_.emplace_back(name);
    if (const json* v = find(obj_, name)) out = get_number(*v, where_, name);
  }
  void reject_unknown(const std::string& type) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (it.key() == "type" || std::find(names_.begin(), names_.end(), it.key()) != names_.end()) continue;
      throw Error(where_ + ": unknown field '" + it.key() + "' for pattern '" + type + "' (" +
                  (names_.empty() ? std::string("it has no fields") : "known: " + join(names_)) + ")");
    }
  }

 private:
  const json& obj_;
  const std::string& where_;
  std::vector<std::string> names_;
};

// Indexed like the alternatives of Pattern (the names pattern_name() gives).
constexpr std::array<const char*, 6> kPatternNames = {"dense",    "ashape",         "moa_window",
                                                      "triangle", "vertical_slash", "block_sparse"};
static_assert(kPatternNames.size() == std::variant_size_v<Pattern>);

Pattern parse_pattern(const json& j, const std::string& where) {
  if (!j.is_object())
    throw Error(where + ": a pattern must be an object such as {\"type\": \"dense\"}, got " + show(j));
  const json* type_value = find(j, "type");
  if (!type_value) throw Error(where + ": missing field 'type'");
  if (!type_value->is_string()) fail_field(where, "type", "a string", show(*type_value));
  const std::string type = type_value->get<std::string>();

  FieldReader r(j, where);
  Pattern p;
  if (type == "dense") {
    p = DensePattern{};
  } else if (type == "ashape") {
    AShapePattern a;
    r.int32("sink", a.sink);
    r.int32("local", a.local);
    p = a;
  } else if (type == "moa_window") {
    ElasticWindowPattern e;
    r.number("alpha", e.alpha);
    r.number("beta", e.beta);
    r.int32("sink", e.sink);
    p = e;
  } else if (type == "triangle") {
    TrianglePattern t;
    r.int32("sink", t.sink);
    r.int32("local", t.local);
    r.int32("last", t.last);
    p = t;
  } else if (type == "vertical_slash") {
    VerticalSlashPattern v;
    r.int32("vertical", v.vertical);
    r.int32("slash", v.slash);
    r.int32("last_q", v.last_q);
    r.int32("forced_columns", v.forced_columns);
    r.int32("forced_diagonals", v.forced_diagonals);
    r.number("gamma", v.gamma);
    r.int32("min_vertical", v.min_vertical);
    r.int32("min_slash", v.min_slash);
    p = v;
  } else if (type == "block_sparse") {
    BlockSparsePattern b;
    r.int32("top_k", b.top_k);
    r.int32("block", b.block);
    r.number("gamma", b.gamma);
    r.int32("min_top_k", b.min_top_k);
    p = b;
  } else {
    throw Error(where + ": unknown pattern '" + type + "' (known: " +
                join(std::vector<std::string>(kPatternNames.begin(), kPatternNames.end())) + ")");
  }
  r.reject_unknown(type);
  validate(p, where);
  return p;
}

// The fields that describe() shows are always written, so that a reader sees the sizes without looking up the
// defaults; vertical_slash's estimator details (last_q, forced_*) only when they differ from the defaults.
json write_pattern(const Pattern& p) {
  json j = json::object();
  j["type"] = std::string(pattern_name(p));
  if (const auto* a = std::get_if<AShapePattern>(&p)) {
    j["sink"] = a->sink;
    j["local"] = a->local;
  } else if (const auto* e = std::get_if<ElasticWindowPattern>(&p)) {
    j["alpha"] = e->alpha;
    j["beta"] = e->beta;
    j["sink"] = e->sink;
  } else if (const auto* t = std::get_if<TrianglePattern>(&p)) {
    j["sink"] = t->sink;
    j["local"] = t->local;
    j["last"] = t->last;
  } else if (const auto* v = std::get_if<VerticalSlashPattern>(&p)) {
    const VerticalSlashPattern d;
    j["vertical"] = v->vertical;
    j["slash"] = v->slash;
    if (v->last_q != d.last_q) j["last_q"] = v->last_q;
    if (v->forced_columns != d.forced_columns) j["forced_columns"] = v->forced_columns;
    if (v->forced_diagonals != d.forced_diagonals) j["forced_diagonals"] = v->forced_diagonals;
    if (v->adaptive()) {  // adaptive budgets: vertical / slash above are the maxima
      j["gamma"] = v->gamma;
      j["min_vertical"] = v->min_vertical;
      j["min_slash"] = v->min_slash;
    }
  } else if (const auto* b = std::get_if<BlockSparsePattern>(&p)) {
    j["top_k"] = b->top_k;
    j["block"] = b->block;
    if (b->adaptive()) {
      j["gamma"] = b->gamma;
      j["min_top_k"] = b->min_top_k;
    }
  }
  return j;
}

// A count for the top-level header fields: an integer >= min_value.
int get_count(const json& obj, const char* field, int min_value, const std::string& source) {
  const json* v = find(obj, field);
  if (!v) throw Error(source + ": missing field '" + field + "'");
  const int32_t n = get_int32(*v, source, field);
  if (n < min_value) fail_field(source, field, ">= " + str(min_value), str(n));
  return n;
}

// The most frequent pattern of table[begin, end); `preferred` wins ties so that layers agree with the
// default.
Pattern most_common(const std::vector<Pattern>& table, size_t begin, size_t end, const Pattern* preferred) {
  std::vector<std::pair<Pattern, size_t>> counts;
  for (size_t i = begin; i < end; ++i) {
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == table[i]; });
    if (it == counts.end())
      counts.emplace_back(table[i], 1);
    else
      ++it->second;
  }
  size_t best = 0;
  for (size_t i = 1; i < counts.size(); ++i)
    if (counts[i].second > counts[best].second) best = i;
  if (preferred)
    for (const auto& c : counts)
      if (c.first == *preferred && c.second == counts[best].second) return c.first;
  return counts[best].first;
}

// ---- MInference and MoA ----------------------------------------------------------------------------------

void check_kv_heads(int num_q_heads, int num_kv_heads, const std::string& source) {
  check(num_kv_heads >= 1, source + ": num_kv_heads must be >= 1, got " + str(num_kv_heads));
  check(num_q_heads % num_kv_heads == 0, source + ": " + str(num_q_heads) +
                                             " query heads are not a multiple of " + str(num_kv_heads) +
                                             " KV heads");
}

// The reference head count of every layer: the model's when known, else layer 0's.
std::string head_count_mismatch(int layer, size_t got, int want, bool from_model, const std::string& source,
                                const std::string& in_what = "") {
  return source + ": layer " + str(layer) + " has " + std::to_string(got) + " heads" + in_what + ", but " +
         (from_model ? "the model has " + str(want) + " query heads" : "layer 0 has " + str(want));
}

std::string layer_count_mismatch(size_t got, int want, const std::string& source) {
  return source + ": the policy has " + std::to_string(got) + " layers, but the model has " + str(want);
}

Pattern parse_minference_entry(const json& e, const std::string& where, double* score) {
  if (!e.is_array() || e.size() < 3 || e.size() > 4)
    throw Error(where + ": expected [pattern_name, vertical_size, slash_size, search_score], got " + show(e));
  if (!e[0].is_string()) fail_field(where, "pattern_name", "a string", show(e[0]));
  const std::string name = e[0].get<std::string>();
  const int32_t vertical = get_int32(e[1], where, "vertical_size");
  const int32_t slash = get_int32(e[2], where, "slash_size");
  if (e.size() == 4) {
    const double s = get_number(e[3], where, "search_score");
    if (score) *score = s;
  } else if (score) {
    *score = 0;
  }
  if (vertical < 0) fail_field(where, "vertical_size", ">= 0", str(vertical));
  if (slash < 0) fail_field(where, "slash_size", ">= 0", str(slash));

  Pattern p;
  if (name == "vertical_and_slash") {
    VerticalSlashPattern v;
    v.vertical = vertical;
    v.slash = slash;
    p = v;
  } else if (name == "stream_llm") {
    if (slash < 1)
      fail_field(where, "slash_size", ">= 1 for stream_llm (it is the local window)", str(slash));
    p = AShapePattern{vertical, slash};
  } else if (name == "block_sparse") {
    BlockSparsePattern b;
    b.top_k = vertical;
    p = b;
  } else {
    throw Error(where + ": unknown pattern '" + name +
                "' (known: vertical_and_slash, stream_llm, block_sparse)");
  }
  validate(p, where);
  return p;
}

AttentionPolicy import_minference_impl(const json& j, const std::string& source, int num_kv_heads,
                                       const std::optional<PolicyShape>& expected,
                                       std::vector<double>* scores) {
  if (!j.is_array())
    throw Error(source + ": a MInference config must be a JSON list over layers, got " +
                std::string(j.type_name()));
  if (j.empty()) throw Error(source + ": the MInference config has no layers");
  if (expected && j.size() != static_cast<size_t>(expected->num_layers))
    throw Error(layer_count_mismatch(j.size(), expected->num_layers, source));
  for (size_t l = 0; l < j.size(); ++l)
    if (!j[l].is_object())
      throw Error(source + ": layer " + std::to_string(l) +
                  ": expected an object mapping head index to [pattern_name, vertical_size, slash_size, "
                  "search_score], got " +
                  show(j[l]));
  const int num_layers = static_cast<int>(j.size());
  const int num_q_heads = expected ? expected->num_q_heads : static_cast<int>(j[0].size());
  if (num_q_heads == 0) throw Error(source + ": layer 0 has no heads");

  std::vector<Pattern> table;
  table.reserve(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads));
  if (scores) scores->assign(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads), 0.0);
  for (int l = 0; l < num_layers; ++l) {
    const json& layer = j[static_cast<size_t>(l)];
    if (layer.size() != static_cast<size_t>(num_q_heads))
      throw Error(head_count_mismatch(l, layer.size(), num_q_heads, expected.has_value(), source));
    for (int h = 0; h < num_q_heads; ++h) {
      const std::string where = source + ": " + layer_head(l, h);
      auto it = layer.find(str(h));
      if (it == layer.end()) {
        std::string found;
        for (auto k = layer.begin(); k != layer.end(); ++k) {
          const auto idx = parse_index_key(k.key());
          if (!idx || *idx >= num_q_heads) {
            found = " (found key \"" + k.key() + "\" instead)";
            break;
          }
        }
        throw Error(where + ": missing" + found);
      }
      double* score =
          scores
              ? &(*scores)[static_cast<size_t>(l) * static_cast<size_t>(num_q_heads) + static_cast<size_t>(h)]
              : nullptr;
      table.push_back(parse_minference_entry(*it, where, score));
    }
  }
  check_kv_heads(num_q_heads, num_kv_heads, source);
  return AttentionPolicy(num_layers, num_q_heads, num_kv_heads, std::move(table));
}

const json& moa_field(const json& j, const char* field, const std::string& source) {
  const json* v = find(j, field);
  if (!v) throw Error(source + ": missing field '" + field + "'");
  if (!v->is_array()) fail_field(source, field, "a list over layers", show(*v));
  return *v;
}

AttentionPolicy import_moa_impl(const json& j, const std::string& source, int num_kv_heads,
                                const std::optional<PolicyShape>& expected) {
  if (!j.is_object())
    throw Error(source + ": a MoA plan must be an object {\"alphas\": [[...]], \"betas\": [[...]]}, got " +
                std::string(j.type_name()));
  const json& alphas = moa_field(j, "alphas", source);
  const json& betas = moa_field(j, "betas", source);
  if (alphas.empty()) throw Error(source + ": 'alphas' has no layers");
  if (expected && alphas.size() != static_cast<size_t>(expected->num_layers))
    throw Error(layer_count_mismatch(alphas.size(), expected->num_layers, source));
  if (betas.size() != alphas.size())
    throw Error(source + ": 'betas' has " + std::to_string(betas.size()) + " layers, but 'alphas' has " +
                std::to_string(alphas.size()));
  for (size_t l = 0; l < alphas.size(); ++l) {
    if (!alphas[l].is_array())
      fail_field(source + ": layer " + std::to_string(l), "alphas", "a list over heads", show(alphas[l]));
    if (!betas[l].is_array())
      fail_field(source + ": layer " + std::to_string(l), "betas", "a list over heads", show(betas[l]));
  }
  const int num_layers = static_cast<int>(alphas.size());
  const int num_q_heads = expected ? expected->num_q_heads : static_cast<int>(alphas[0].size());
  if (num_q_heads == 0) throw Error(source + ": layer 0 has no heads");

  std::vector<Pattern> table;
  table.reserve(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads));
  for (int l = 0; l < num_layers; ++l) {
    const json& la = alphas[static_cast<size_t>(l)];
    const json& lb = betas[static_cast<size_t>(l)];
    if (la.size() != static_cast<size_t>(num_q_heads))
      throw Error(
          head_count_mismatch(l, la.size(), num_q_heads, expected.has_value(), source, " in 'alphas'"));
    if (lb.size() != static_cast<size_t>(num_q_heads))
      throw Error(source + ": layer " + str(l) + " has " + std::to_string(lb.size()) +
                  " heads in 'betas', but " + str(num_q_heads) + " in 'alphas'");
    for (int h = 0; h < num_q_heads; ++h) {
      const std::string where = source + ": " + layer_head(l, h);
      ElasticWindowPattern e;
      e.alpha = get_number(la[static_cast<size_t>(h)], where, "alphas");
      e.beta = get_number(lb[static_cast<size_t>(h)], where, "betas");
      e.sink = kMoaSink;
      if (!(e.beta >= 0)) fail_field(where, "betas", ">= 0", show(lb[static_cast<size_t>(h)]));
      validate(e, where);
      table.push_back(e);
    }
  }
  check_kv_heads(num_q_heads, num_kv_heads, source);
  return AttentionPolicy(num_layers, num_q_heads, num_kv_heads, std::move(table));
}

// The head count of layer 0 of a foreign file, when it can be seen; 1 otherwise (the import then reports the
// structural problem).
int peek_q_heads(const json& j, PolicyFormat format) {
  const json* layer0 = nullptr;
  if (format == PolicyFormat::minference && j.is_array() && !j.empty()) layer0 = &j[0];
  if (format == PolicyFormat::moa) {
    const json* a = find(j, "alphas");
    if (a && a->is_array() && !a->empty()) layer0 = &(*a)[0];
  }
  if (!layer0 || !(layer0->is_object() || layer0->is_array()) || layer0->empty()) return 1;
  return static_cast<int>(layer0->size());
}

// ---- text ------------------------------------------------------------------------------------------------

// Keys in the order a reader expects them; head/layer indices numerically after the known names.
int key_rank(const std::string& key) {
  static constexpr std::array<const char*, 29> kOrder = {"tessera_policy",
                                                         "comment",
                                                         "num_layers",
                                                         "num_q_heads",
                                                         "num_kv_heads",
                                                         "default",
                                                         "layers",
                                                         "table",
                                                         "trianglemix",
                                                         "start_layer",
                                                         "triangle",
                                                         "heads",
                                                         "type",
                                                         "alpha",
                                                         "beta",
                                                         "sink",
                                                         "local",
                                                         "last",
                                                         "vertical",
                                                         "slash",
                                                         "last_q",
                                                         "forced_columns",
                                                         "forced_diagonals",
                                                         "gamma",
                                                         "min_vertical",
                                                         "min_slash",
                                                         "top_k",
                                                         "block",
                                                         "min_top_k"};
  for (size_t i = 0; i < kOrder.size(); ++i)
    if (key == kOrder[i]) return static_cast<int>(i);
  return static_cast<int>(kOrder.size());
}

std::vector<std::string> ordered_keys(const json& obj) {
  std::vector<std::string> keys;
  for (auto it = obj.begin(); it != obj.end(); ++it) keys.push_back(it.key());
  std::stable_sort(keys.begin(), keys.end(), [](const std::string& a, const std::string& b) {
    const int ra = key_rank(a), rb = key_rank(b);
    if (ra != rb) return ra < rb;
    const auto ia = parse_index_key(a), ib = parse_index_key(b);
    if (ia && ib) return *ia < *ib;
    if (ia.has_value() != ib.has_value()) return ia.has_value();
    return a < b;
  });
  return keys;
}

void write_inline(const json& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const std::string& k : ordered_keys(v)) {
      out += first ? "" : ", ";
      first = false;
      out += json(k).dump() + ": ";
      write_inline(v.at(k), out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      out += i ? ", " : "";
      write_inline(v[i], out);
    }
    out += ']';
  } else {
    out += v.dump();
  }
}

// Arrays of containers (layers, table rows) get one element per line; everything else stays inline.
void write_member(const json& v, const std::string& indent, std::string& out) {
  const bool expand = v.is_array() && !v.empty() &&
                      std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_structured(); });
  if (!expand) {
    write_inline(v, out);
    return;
  }
  out += "[\n";
  for (size_t i = 0; i < v.size(); ++i) {
    out += indent + "  ";
    write_inline(v[i], out);
    out += i + 1 < v.size() ? ",\n" : "\n";
  }
  out += indent + "]";
}

[[noreturn]] void cannot_express(const char* format, int layer, int head, const Pattern& p,
                                 const char* what) {
  throw Error(std::string("export to ") + format + " format: " + layer_head(layer, head) + " runs " +
              describe(p) + ", which that format cannot express (" + what + ")");
}

}  // namespace

// ---- public ----------------------------------------------------------------------------------------------

PolicyShape shape_of(const AttentionPolicy& policy) {
  return {policy.num_layers(), policy.num_q_heads(), policy.num_kv_heads()};
}

std::string_view format_name(PolicyFormat format) {
  switch (format) {
    case PolicyFormat::tessera:
      return "tessera";
    case PolicyFormat::minference:
      return "minference";
    case PolicyFormat::moa:
      return "moa";
  }
  return "unknown";
}

PolicyFormat detect_policy_format(const json& j, const std::string& source) {
  if (j.is_object() && j.contains("tessera_policy")) return PolicyFormat::tessera;
  if (j.is_array()) return PolicyFormat::minference;
  if (j.is_object() && (j.contains("alphas") || j.contains("betas"))) return PolicyFormat::moa;
  throw Error(
      source +
      ": not a policy file: expected a tessera policy (an object with \"tessera_policy\"), a MInference "
      "config (a list over layers) or a MoA plan (an object with \"alphas\" and \"betas\"), got " +
      (j.is_object() ? std::string("an object without those keys") : "a " + std::string(j.type_name())));
}

void check_policy_shape(const AttentionPolicy& policy, const PolicyShape& expected,
                        const std::string& source) {
  if (policy.num_layers() != expected.num_layers)
    throw Error(layer_count_mismatch(static_cast<size_t>(policy.num_layers()), expected.num_layers, source));
  if (policy.num_q_heads() != expected.num_q_heads)
    throw Error(source + ": the policy has " + str(policy.num_q_heads()) +
                " query heads per layer, but the model has " + str(expected.num_q_heads));
  if (policy.num_kv_heads() != expected.num_kv_heads)
    throw Error(source + ": the policy has " + str(policy.num_kv_heads()) + " KV heads, but the model has " +
                str(expected.num_kv_heads));
}

AttentionPolicy load_policy_json(const json& j, const std::string& source,
                                 const std::optional<PolicyShape>& expected) {
  const PolicyFormat format = detect_policy_format(j, source);
  AttentionPolicy policy;
  switch (format) {
    case PolicyFormat::tessera:
      // The header's counts size the table: compare them with the model before anything is allocated.
      if (expected && j.is_object()) {
        // (The messages of check_policy_shape, which the parsed policy meets again.)
        const std::tuple<const char*, const char*, int> counts[] = {
            {"num_layers", " layers", expected->num_layers},
            {"num_q_heads", " query heads per layer", expected->num_q_heads},
            {"num_kv_heads", " KV heads", expected->num_kv_heads}};
        for (const auto& [field, unit, want] : counts) {
          const json* v = find(j, field);
          if (v && v->is_number_integer() && v->get<int64_t>() != want)
            throw Error(source + ": the policy has " + show(*v) + unit + ", but the model has " + str(want));
        }
      }
      policy = parse_tessera_policy(j, source);
      break;
    case PolicyFormat::minference:
      policy = import_minference_impl(j, source, expected ? expected->num_kv_heads : peek_q_heads(j, format),
                                      expected, nullptr);
      break;
    case PolicyFormat::moa:
      policy =
          import_moa_impl(j, source, expected ? expected->num_kv_heads : peek_q_heads(j, format), expected);
      break;
  }
  if (expected) check_policy_shape(policy, *expected, source);
  return policy;
}

AttentionPolicy load_policy_file(const std::filesystem::path& path,
                                 const std::optional<PolicyShape>& expected) {
  const std::string source = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw Error(source + ": file not found");
  if (std::filesystem::is_directory(path, ec)) throw Error(source + ": is a directory, not a policy file");
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(source + ": not a regular file (a policy is read from a JSON file, not a device or a pipe)");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(source + ": cannot read the file size: " + ec.message());
  if (size > kMaxPolicyFileBytes)
    throw Error(source + ": " + std::to_string(size) + " bytes, more than a policy file may hold (" +
                std::to_string(kMaxPolicyFileBytes >> 20) + " MiB)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(source + ": cannot open file for reading: " + std::strerror(errno));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (in.bad() || static_cast<size_t>(in.gcount()) != size) throw Error(source + ": error while reading the file");

  json j;
  try {
    j = json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // nlohmann's message reads "[json.exception.parse_error.101] parse error at line 3, column 5: <why>".
    std::string what = e.what();
    const size_t at = what.find("parse error at ");
    if (at != std::string::npos)
      what = what.substr(at + std::strlen("parse error "));
    else
      what = "at byte " + std::to_string(e.byte) + ": " + what;
    throw Error(source + ": invalid JSON " + what);
  } catch (const json::exception& e) {  // out_of_range 406: a number too large for a double ("1e999")
    std::string what = e.what();
    if (const size_t at = what.find("] "); at != std::string::npos) what.erase(0, at + 2);
    throw Error(source + ": invalid JSON (" + what + ")");
  }
  return load_policy_json(j, source, expected);
}

AttentionPolicy parse_tessera_policy(const json& j, const std::string& source) {
  if (!j.is_object()) throw Error(source + ": a tessera policy must be a JSON object, got " + show(j));
  check_known_keys(j,
                   {"tessera_policy", "comment", "num_layers", "num_q_heads", "num_kv_heads", "default",
                    "layers", "table", "trianglemix", "placement"},
                   source);
  const json* version = find(j, "tessera_policy");
  if (!version) throw Error(source + ": missing field 'tessera_policy'");
  if (!version->is_number_integer() || version->get<int64_t>() != kTesseraPolicyVersion)
    throw Error(source + ": unsupported tessera_policy version " + show(*version) +
                " (this build reads version " + str(kTesseraPolicyVersion) + ")");
  if (const json* comment = find(j, "comment"); comment && !comment->is_string())
    fail_field(source, "comment", "a string", show(*comment));

  const int num_layers = get_count(j, "num_layers", 0, source);
  const int num_q_heads = get_count(j, "num_q_heads", 1, source);
  const int num_kv_heads = get_count(j, "num_kv_heads", 1, source);
  check(num_q_heads % num_kv_heads == 0, source + ": num_q_heads (" + str(num_q_heads) +
                                             ") is not a multiple of num_kv_heads (" + str(num_kv_heads) +
                                             ")");
  const size_t L = static_cast<size_t>(num_layers), H = static_cast<size_t>(num_q_heads);
  if (L * H > kMaxPolicyHeads)
    throw Error(source + ": num_layers x num_q_heads = " + std::to_string(L * H) + " heads, more than tessera's limit of " +
                std::to_string(kMaxPolicyHeads) + " (a policy holds one pattern per layer and query head)");

  std::vector<Pattern> table;
  table.reserve(L * H);
  if (const json* t = find(j, "table")) {
    for (const char* other : {"default", "layers"})
      if (j.contains(other))
        throw Error(source + ": 'table' lists every head; it cannot be combined with '" + other + "'");
    if (!t->is_array()) fail_field(source, "table", "a list over layers", show(*t));
    if (t->size() != L)
      throw Error(source + ": 'table' has " + std::to_string(t->size()) + " layers, but num_layers is " +
                  str(num_layers));
    for (size_t l = 0; l < L; ++l) {
      const json& row = (*t)[l];
      if (!row.is_array())
        fail_field(source + ": table, layer " + std::to_string(l), "table", "a list over heads", show(row));
      if (row.size() != H)
        throw Error(source + ": table, layer " + std::to_string(l) + " has " + std::to_string(row.size()) +
                    " heads, but num_q_heads is " + str(num_q_heads));
      for (size_t h = 0; h < H; ++h)
        table.push_back(
            parse_pattern(row[h], source + ": " + layer_head(static_cast<int>(l), static_cast<int>(h))));
    }
  } else {
    std::optional<Pattern> global_default;
    if (const json* d = find(j, "default")) global_default = parse_pattern(*d, source + ": default");
    const json* layers = find(j, "layers");
    if (layers) {
      if (!layers->is_array()) fail_field(source, "layers", "a list over layers", show(*layers));
      if (layers->size() != L)
        throw Error(source + ": 'layers' has " + std::to_string(layers->size()) +
                    " entries, but num_layers is " + str(num_layers));
    }
    for (size_t l = 0; l < L; ++l) {
      const std::string layer_where = source + ": layer " + std::to_string(l);
      std::optional<Pattern> layer_default = global_default;
      std::vector<std::optional<Pattern>> heads(H);
      if (layers) {
        const json& entry = (*layers)[l];
        if (!entry.is_object())
          throw Error(layer_where +
                      ": a layer entry must be an object with optional 'default' and 'heads', got " +
                      show(entry));
        check_known_keys(entry, {"default", "heads"}, layer_where);
        if (const json* d = find(entry, "default"))
          layer_default = parse_pattern(*d, layer_where + ", default");
        if (const json* hs = find(entry, "heads")) {
          if (!hs->is_object())
            fail_field(layer_where, "heads", "an object mapping head index to pattern", show(*hs));
          for (auto it = hs->begin(); it != hs->end(); ++it) {
            const auto h = parse_index_key(it.key());
            if (!h) throw Error(layer_where + ": head key '" + it.key() + "' is not a head index");
            if (*h >= num_q_heads)
              throw Error(layer_where + ": head " + it.key() + " is out of range (num_q_heads is " +
                          str(num_q_heads) + ")");
            heads[static_cast<size_t>(*h)] =
                parse_pattern(it.value(), source + ": " + layer_head(static_cast<int>(l), *h));
          }
        }
      }
      for (size_t h = 0; h < H; ++h) {
        if (!heads[h] && !layer_default)
          throw Error(source + ": " + layer_head(static_cast<int>(l), static_cast<int>(h)) +
                      ": no pattern (give a top-level 'default', a layer 'default' or a 'heads' entry)");
        table.push_back(heads[h] ? *heads[h] : *layer_default);
      }
    }
  }
  AttentionPolicy policy(num_layers, num_q_heads, num_kv_heads, std::move(table));

  if (const json* tm = find(j, "trianglemix")) {
    const std::string where = source + ": trianglemix";
    if (!tm->is_object())
      throw Error(where + ": must be an object {\"start_layer\": ..., \"triangle\": {...}}");
    check_known_keys(*tm, {"start_layer", "triangle"}, where);
    const json* start = find(*tm, "start_layer");
    if (!start) throw Error(where + ": missing field 'start_layer'");
    const int32_t start_layer = get_int32(*start, where, "start_layer");
    if (start_layer < 0 || start_layer > num_layers)
      fail_field(where, "start_layer", "in [0, " + str(num_layers) + "]", str(start_layer));
    TrianglePattern triangle;
    if (const json* t = find(*tm, "triangle")) {
      json tj = *t;
      if (tj.is_object() && !tj.contains("type")) tj["type"] = "triangle";
      const Pattern p = parse_pattern(tj, where + ".triangle");
      if (!std::holds_alternative<TrianglePattern>(p))
        throw Error(where + ".triangle: must be a triangle pattern, got '" + std::string(pattern_name(p)) +
                    "'");
      triangle = std::get<TrianglePattern>(p);
    }
    policy = AttentionPolicy::trianglemix(policy, start_layer, triangle);
  }
  return policy;
}

json save_policy_json(const AttentionPolicy& policy) {
  const int L = policy.num_layers(), H = policy.num_q_heads();
  const auto& table = policy.table();
  auto row = [&](int l) { return static_cast<size_t>(l) * static_cast<size_t>(H); };
  auto layer_is = [&](int l, const Pattern& p) {
    return std::all_of(table.begin() + static_cast<std::ptrdiff_t>(row(l)),
                       table.begin() + static_cast<std::ptrdiff_t>(row(l + 1)),
                       [&](const Pattern& q) { return q == p; });
  };

  json j = json::object();
  j["tessera_policy"] = kTesseraPolicyVersion;
  j["num_layers"] = L;
  j["num_q_heads"] = H;
  j["num_kv_heads"] = policy.num_kv_heads();

  // TriangleMix shape: the deepest layers all run one triangle (and some shallower layer does not).
  int body_layers = L;
  if (L > 0 && std::holds_alternative<TrianglePattern>(table[row(L - 1)])) {
    const Pattern tri = table[row(L - 1)];
    int start = L;
    while (start > 0 && layer_is(start - 1, tri)) --start;
    if (start > 0 && start < L) {
      body_layers = start;
      j["trianglemix"] = {{"start_layer", start}, {"triangle", write_pattern(tri)}};
    }
  }
  if (body_layers == 0) return j;

  const Pattern global_default = most_common(table, 0, row(body_layers), nullptr);
  j["default"] = write_pattern(global_default);
  json layers = json::array();
  bool any_override = false;
  for (int l = 0; l < L; ++l) {
    json entry = json::object();
    if (l < body_layers) {
      const Pattern layer_default = most_common(table, row(l), row(l + 1), &global_default);
      if (!(layer_default == global_default)) entry["default"] = write_pattern(layer_default);
      json heads = json::object();
      for (int h = 0; h < H; ++h)
        if (!(table[row(l) + static_cast<size_t>(h)] == layer_default))
          heads[str(h)] = write_pattern(table[row(l) + static_cast<size_t>(h)]);
      if (!heads.empty()) entry["heads"] = std::move(heads);
    }
    any_override = any_override || !entry.empty();
    layers.push_back(std::move(entry));
  }
  if (any_override) j["layers"] = std::move(layers);
  return j;
}

AttentionPolicy import_minference(const json& j, const std::string& source, int num_kv_heads,
                                  std::vector<double>* scores) {
  return import_minference_impl(j, source, num_kv_heads, std::nullopt, scores);
}

json export_minference(const AttentionPolicy& policy, const std::vector<double>* scores) {
  const int L = policy.num_layers(), H = policy.num_q_heads();
  check(!scores || scores->size() == policy.table().size(),
        "export to minference format: " + std::to_string(scores ? scores->size() : 0) + " scores for " +
            std::to_string(policy.table().size()) + " heads");
  const VerticalSlashPattern vs_defaults;
  json out = json::array();
  for (int l = 0; l < L; ++l) {
    json layer = json::object();
    for (int h = 0; h < H; ++h) {
      const Pattern& p = policy.at(l, h);
      const size_t i = static_cast<size_t>(l) * static_cast<size_t>(H) + static_cast<size_t>(h);
      const json score = scores ? json((*scores)[i]) : json(0);
      const char* what =
          "it has vertical_and_slash with last_q 64, 30 forced columns and 100 forced diagonals, stream_llm, "
          "and "
          "block_sparse with block 64";
      if (const auto* v = std::get_if<VerticalSlashPattern>(&p)) {
        if (v->last_q != vs_defaults.last_q || v->forced_columns != vs_defaults.forced_columns ||
            v->forced_diagonals != vs_defaults.forced_diagonals || v->adaptive())
          cannot_express("minference", l, h, p, what);
        layer[str(h)] = {"vertical_and_slash", v->vertical, v->slash, score};
      } else if (const auto* a = std::get_if<AShapePattern>(&p)) {
        layer[str(h)] = {"stream_llm", a->sink, a->local, score};
      } else if (const auto* b = std::get_if<BlockSparsePattern>(&p)) {
        if (b->block != kMInferenceBlock || b->adaptive()) cannot_express("minference", l, h, p, what);
        layer[str(h)] = {"block_sparse", b->top_k, 0, score};
      } else {
        cannot_express("minference", l, h, p, what);
      }
    }
    out.push_back(std::move(layer));
  }
  return out;
}

AttentionPolicy import_moa(const json& j, const std::string& source, int num_kv_heads) {
  return import_moa_impl(j, source, num_kv_heads, std::nullopt);
}

json export_moa(const AttentionPolicy& policy) {
  json alphas = json::array(), betas = json::array();
  for (int l = 0; l < policy.num_layers(); ++l) {
    json la = json::array(), lb = json::array();
    for (int h = 0; h < policy.num_q_heads(); ++h) {
      const Pattern& p = policy.at(l, h);
      const auto* e = std::get_if<ElasticWindowPattern>(&p);
      if (!e || e->sink != kMoaSink) cannot_express("moa", l, h, p, "it has only moa_window with sink 64");
      la.push_back(e->alpha);
      lb.push_back(e->beta);
    }
    alphas.push_back(std::move(la));
    betas.push_back(std::move(lb));
  }
  return {{"alphas", std::move(alphas)}, {"betas", std::move(betas)}};
}

std::string format_policy_json(const json& j) {
  std::string out;
  if (j.is_object() && !j.empty()) {
    out += "{\n";
    const auto keys = ordered_keys(j);
    for (size_t i = 0; i < keys.size(); ++i) {
      out += "  " + json(keys[i]).dump() + ": ";
      write_member(j.at(keys[i]), "  ", out);
      out += i + 1 < keys.size() ? ",\n" : "\n";
    }
    out += "}";
  } else {
    write_member(j, "", out);
  }
  return out;
}

void save_policy_file(const AttentionPolicy& policy, const std::filesystem::path& path, PolicyFormat format) {
  json j;
  switch (format) {
    case PolicyFormat::tessera:
      j = save_policy_json(policy);
      break;
    case PolicyFormat::minference:
      j = export_minference(policy);
      break;
    case PolicyFormat::moa:
      j = export_moa(policy);
      break;
  }
  const std::string text = format_policy_json(j) + "\n";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path.string() + ": cannot open file for writing: " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) throw Error(path.string() + ": error while writing the file");
}

std::string summarize_policy(const AttentionPolicy& policy) {
  const int L = policy.num_layers(), H = policy.num_q_heads();
  std::string out = "policy: " + str(L) + " layers x " + str(H) + " query heads (" +
                    str(policy.num_kv_heads()) + " KV heads), " + std::to_string(policy.table().size()) +
                    " heads\n";
  constexpr size_t kKinds = std::variant_size_v<Pattern>;
  auto kind_counts = [&](int l) {
    std::array<int, kKinds> c{};
    for (int h = 0; h < H; ++h) ++c[policy.at(l, h).index()];
    return c;
  };
  for (int l = 0; l < L;) {
    const auto counts = kind_counts(l);
    int end = l + 1;
    while (end < L && kind_counts(end) == counts) ++end;
    std::vector<std::string> parts;  // totals over the range
    for (size_t k = 0; k < kKinds; ++k)
      if (counts[k]) parts.push_back(std::string(kPatternNames[k]) + " " + str(counts[k] * (end - l)));
    out += (end - l == 1 ? "layer " + str(l) : "layers " + str(l) + "-" + str(end - 1)) + ": " + join(parts) +
           "\n";
    l = end;
  }
  // Distinct patterns by description, most frequent first (ties: first seen first).
  std::vector<std::pair<std::string, size_t>> distinct;
  for (const Pattern& p : policy.table()) {
    const std::string d = describe(p);
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& e) { return e.first == d; });
    if (it == distinct.end())
      distinct.emplace_back(d, 1);
    else
      ++it->second;
  }
  std::stable_sort(distinct.begin(), distinct.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  if (!distinct.empty()) {
    out += "distinct patterns:\n";
    const size_t width = std::to_string(distinct.front().second).size();
    for (const auto& [d, n] : distinct) {
      const std::string count = std::to_string(n);
      out += "  " + std::string(width - count.size(), ' ') + count + "  " + d + "\n";
    }
  }
  return out;
}

}  // namespace tessera::attn
