// tessera/attention/pattern/config_json.h — internal to the policy-file readers and writers of config_io.h
// (config_io.cpp: format detection and file I/O; policy_json.cpp: tessera's format; minference_io.cpp and
// moa_io.cpp: the foreign formats; policy_text.cpp: layout and summaries): the JSON field readers, the
// per-pattern field table and the error messages they share. Not for use outside attention/pattern.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention/pattern/config_io.h"
#include "attention/pattern/pattern.h"
#include "attention/pattern/policy.h"

namespace tessera::attn::config_detail {

using nlohmann::json;

inline constexpr int kTesseraPolicyVersion = 1;
inline constexpr int32_t kMoaSink = 64;
inline constexpr int32_t kMInferenceBlock = 64;

// Indexed like the alternatives of Pattern (the names pattern_name() gives).
inline constexpr std::array<const char*, 6> kPatternNames = {"dense",    "ashape",         "moa_window",
                                                             "triangle", "vertical_slash", "block_sparse"};
static_assert(kPatternNames.size() == std::variant_size_v<Pattern>);

std::string str(int v);
// "layer 3, head 17".
std::string layer_head(int layer, int head);
// A JSON value as it appears in the file, shortened for messages.
std::string show(const json& v);
std::string join(const std::vector<std::string>& items, const char* sep = ", ");

[[noreturn]] void fail_field(const std::string& where, const std::string& field, const std::string& rule,
                             const std::string& got);

// JSON integers, and floats with an integral value (1000.0), that fit in int32.
int32_t get_int32(const json& v, const std::string& where, const std::string& field);
double get_number(const json& v, const std::string& where, const std::string& field);

// "0", "17": a head or layer index written as a JSON object key (no sign, no leading zeros).
std::optional<int> parse_index_key(const std::string& key);

void check_known_keys(const json& obj, std::initializer_list<const char*> known, const std::string& where);

// The member `key` of an object, or nullptr.
const json* find(const json& obj, const char* key);

// When the tessera format writes a field: always (the fields describe() shows, so that a reader sees the sizes
// without looking up the defaults), only where it differs from the default (vertical_slash's estimator
// details), or only for adaptive patterns (the coverage fields).
enum class Written { always, unless_default, if_adaptive };

// One field of a pattern kind in the tessera format: its name, the member (int32_t or double) and when it is
// written.
template <class Member>
struct Field {
  const char* name;
  Member member;
  Written written = Written::always;
};
template <class Member>
Field(const char*, Member) -> Field<Member>;
template <class Member>
Field(const char*, Member, Written) -> Field<Member>;

// The fields of pattern kind T in the tessera format, in the order they are read and listed in messages (a
// tuple of Field). Reading and writing both go through this table.
template <class T>
constexpr auto fields_of() {
  using W = Written;
  if constexpr (std::is_same_v<T, AShapePattern>) {
    return std::tuple{Field{"sink", &T::sink}, Field{"local", &T::local}};
  } else if constexpr (std::is_same_v<T, ElasticWindowPattern>) {
    return std::tuple{Field{"alpha", &T::alpha}, Field{"beta", &T::beta}, Field{"sink", &T::sink}};
  } else if constexpr (std::is_same_v<T, TrianglePattern>) {
    return std::tuple{Field{"sink", &T::sink}, Field{"local", &T::local}, Field{"last", &T::last}};
  } else if constexpr (std::is_same_v<T, VerticalSlashPattern>) {
    return std::tuple{Field{"vertical", &T::vertical},
                      Field{"slash", &T::slash},
                      Field{"last_q", &T::last_q, W::unless_default},
                      Field{"forced_columns", &T::forced_columns, W::unless_default},
                      Field{"forced_diagonals", &T::forced_diagonals, W::unless_default},
                      Field{"gamma", &T::gamma, W::if_adaptive},
                      Field{"min_vertical", &T::min_vertical, W::if_adaptive},
                      Field{"min_slash", &T::min_slash, W::if_adaptive}};
  } else if constexpr (std::is_same_v<T, BlockSparsePattern>) {
    return std::tuple{Field{"top_k", &T::top_k}, Field{"block", &T::block},
                      Field{"gamma", &T::gamma, W::if_adaptive}, Field{"min_top_k", &T::min_top_k, W::if_adaptive}};
  } else {
    static_assert(std::is_same_v<T, DensePattern>, "a pattern kind without its fields here");
    return std::tuple{};
  }
}

// f(field) for each Field of pattern kind T, in fields_of's order.
template <class T, class F>
void for_each_field(F&& f) {
  std::apply([&](const auto&... field) { (f(field), ...); }, fields_of<T>());
}

// ---- MInference and MoA (per query head, without a KV head count) ----------------------------------------

void check_kv_heads(int num_q_heads, int num_kv_heads, const std::string& source);

// The reference head count of every layer: the model's when known, else layer 0's.
std::string head_count_mismatch(int layer, size_t got, int want, bool from_model, const std::string& source,
                                const std::string& in_what = "");
std::string layer_count_mismatch(size_t got, int want, const std::string& source);

// The policy of a foreign file's num_layers x num_q_heads heads, layer-major: check_layer(l) before layer l's
// heads, then head(l, h, where) gives each head's pattern (where = "<source>: layer l, head h"); last, the KV
// head count is checked.
AttentionPolicy per_head_policy(int num_layers, int num_q_heads, int num_kv_heads, const std::string& source,
                                const std::function<void(int)>& check_layer,
                                const std::function<Pattern(int, int, const std::string&)>& head);

// load_policy_json's importers: `expected`, when given, fixes the layer and query head counts.
AttentionPolicy import_minference_checked(const json& j, const std::string& source, int num_kv_heads,
                                          const std::optional<PolicyShape>& expected,
                                          std::vector<double>* scores);
AttentionPolicy import_moa_checked(const json& j, const std::string& source, int num_kv_heads,
                                   const std::optional<PolicyShape>& expected);

[[noreturn]] void cannot_express(const char* format, int layer, int head, const Pattern& p, const char* what);

}  // namespace tessera::attn::config_detail
