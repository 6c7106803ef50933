// MInference per-head configs (config_io.h): a JSON list over layers of {"<head>": [pattern_name,
// vertical_size, slash_size, search_score]}, read into and written from a policy.
#include <string>
#include <utility>

#include "attention/pattern/config_io.h"
#include "attention/pattern/config_json.h"
#include "core/error.h"

namespace tessera::attn {

using namespace config_detail;

namespace {

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

}  // namespace

namespace config_detail {

AttentionPolicy import_minference_checked(const json& j, const std::string& source, int num_kv_heads,
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
  if (scores) scores->assign(static_cast<size_t>(num_layers) * static_cast<size_t>(num_q_heads), 0.0);
  return per_head_policy(
      num_layers, num_q_heads, num_kv_heads, source,
      [&](int l) {
        const json& layer = j[static_cast<size_t>(l)];
        if (layer.size() != static_cast<size_t>(num_q_heads))
          throw Error(head_count_mismatch(l, layer.size(), num_q_heads, expected.has_value(), source));
      },
      [&](int l, int h, const std::string& where) {
        const json& layer = j[static_cast<size_t>(l)];
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
        return parse_minference_entry(*it, where, score);
      });
}

}  // namespace config_detail

AttentionPolicy import_minference(const json& j, const std::string& source, int num_kv_heads,
                                  std::vector<double>* scores) {
  return import_minference_checked(j, source, num_kv_heads, std::nullopt, scores);
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

}  // namespace tessera::attn
