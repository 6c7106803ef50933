// tessera's own policy format (config_io.h; docs/policy-format.md): the patterns, the header counts, the
// default / layers / table forms and the TriangleMix section, read and written.
#include <algorithm>
#include <string>
#include <utility>

#include "attention/pattern/config_io.h"
#include "attention/pattern/config_json.h"
#include "core/error.h"

namespace tessera::attn {

using namespace config_detail;

namespace {

// Reads the optional fields of one pattern object; remembers which names it asked for so that any other key
// can be reported as unknown with the list of the known ones.
class FieldReader {
 public:
  FieldReader(const json& obj, const std::string& where) : obj_(obj), where_(where) {}
  void field(const char* name, int32_t& out) {
    names_.emplace_back(name);
    if (const json* v = find(obj_, name)) out = get_int32(*v, where_, name);
  }
  void field(const char* name, double& out) {
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

// The default pattern of the kind kPatternNames[kind] names.
template <size_t I = 0>
Pattern default_pattern(size_t kind) {
  if constexpr (I + 1 < std::variant_size_v<Pattern>) {
    if (kind != I) return default_pattern<I + 1>(kind);
  }
  return Pattern(std::in_place_index<I>);
}

Pattern parse_pattern(const json& j, const std::string& where) {
  if (!j.is_object())
    throw Error(where + ": a pattern must be an object such as {\"type\": \"dense\"}, got " + show(j));
  const json* type_value = find(j, "type");
  if (!type_value) throw Error(where + ": missing field 'type'");
  if (!type_value->is_string()) fail_field(where, "type", "a string", show(*type_value));
  const std::string type = type_value->get<std::string>();

  const auto kind = std::find_if(kPatternNames.begin(), kPatternNames.end(),
                                 [&](const char* name) { return type == name; });
  if (kind == kPatternNames.end())
    throw Error(where + ": unknown pattern '" + type + "' (known: " +
                join(std::vector<std::string>(kPatternNames.begin(), kPatternNames.end())) + ")");
  FieldReader r(j, where);
  Pattern p = default_pattern(static_cast<size_t>(kind - kPatternNames.begin()));
  std::visit(
      [&](auto& pattern) {
        for_each_field<std::decay_t<decltype(pattern)>>(
            [&](const auto& field) { r.field(field.name, pattern.*field.member); });
      },
      p);
  r.reject_unknown(type);
  validate(p, where);
  return p;
}

// Every field of for_each_field's table that it says to write (Written).
json write_pattern(const Pattern& p) {
  json j = json::object();
  j["type"] = std::string(pattern_name(p));
  std::visit(
      [&](const auto& pattern) {
        using T = std::decay_t<decltype(pattern)>;
        const T defaults{};
        bool adaptive = false;
        if constexpr (requires { pattern.adaptive(); }) adaptive = pattern.adaptive();
        for_each_field<T>([&](const auto& field) {
          const auto value = pattern.*field.member;
          if (field.written == Written::always ||
              (field.written == Written::unless_default && value != defaults.*field.member) ||
              (field.written == Written::if_adaptive && adaptive))
            j[field.name] = value;
        });
      },
      p);
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

}  // namespace

AttentionPolicy parse_tessera_policy(const json& j, const std::string& source) {
  if (!j.is_object()) throw Error(source + ": a tessera policy must be a JSON object, got " + show(j));
  check_known_keys(j,
                   {"tessera_policy", "comment", "num_layers", "num_q_heads", "num_kv_heads", "default",
                    "layers", "table", "trianglemix", "placement", "planned_lengths"},
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

}  // namespace tessera::attn
