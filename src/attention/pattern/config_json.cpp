// The JSON field readers and messages that the policy-file formats share (config_json.h).
#include "attention/pattern/config_json.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/error.h"

namespace tessera::attn::config_detail {

std::string str(int v) {
  return std::to_string(v);
}

std::string layer_head(int layer, int head) {
  return "layer " + str(layer) + ", head " + str(head);
}

std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

[[noreturn]] void fail_field(const std::string& where, const std::string& field, const std::string& rule,
                             const std::string& got) {
  throw Error(where + ": field '" + field + "' must be " + rule + ", got " + got);
}

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

void check_kv_heads(int num_q_heads, int num_kv_heads, const std::string& source) {
  check(num_kv_heads >= 1, source + ": num_kv_heads must be >= 1, got " + str(num_kv_heads));
  check(num_q_heads % num_kv_heads == 0, source + ": " + str(num_q_heads) +
                                             " query heads are not a multiple of " + str(num_kv_heads) +
                                             " KV heads");
}

std::string head_count_mismatch(int layer, size_t got, int want, bool from_model, const std::string& source,
                                const std::string& in_what) {
  return source + ": layer " + str(layer) + " has " + std::to_string(got) + " heads" + in_what + ", but " +
         (from_model ? "the model has " + str(want) + " query heads" : "layer 0 has " + str(want));
}

std::string layer_count_mismatch(size_t got, int want, const std::string& source) {
  return source + ": the policy has " + std::to_string(got) + " layers, but the model has " + str(want);
}

AttentionPolicy per_head_policy(int num_layers, int num_q_heads, int num_kv_heads, const std::string& source,
                                const std::function<void(int)>& check_layer,
                                const std::function<Pattern(int, int, const std::string&)>& head) {
  std::vector<Pattern> table;
  table.reserve(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads));
  for (int l = 0; l < num_layers; ++l) {
    check_layer(l);
    for (int h = 0; h < num_q_heads; ++h) table.push_back(head(l, h, source + ": " + layer_head(l, h)));
  }
  check_kv_heads(num_q_heads, num_kv_heads, source);
  return AttentionPolicy(num_layers, num_q_heads, num_kv_heads, std::move(table));
}

[[noreturn]] void cannot_express(const char* format, int layer, int head, const Pattern& p,
                                 const char* what) {
  throw Error(std::string("export to ") + format + " format: " + layer_head(layer, head) + " runs " +
              describe(p) + ", which that format cannot express (" + what + ")");
}

}  // namespace tessera::attn::config_detail
