// Policy documents as text (config_io.h): format_policy_json's layout (keys in a fixed readable order, one
// layer per line) and summarize_policy's few lines for humans.
#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "attention/pattern/config_io.h"
#include "attention/pattern/config_json.h"

namespace tessera::attn {

using namespace config_detail;

namespace {

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

}  // namespace

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
