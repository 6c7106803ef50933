// MoA alpha/beta plans (config_io.h): {"alphas": [[...]], "betas": [[...]]} over layers and query heads, each
// head an elastic window with MoA's sink, read into and written from a policy. A dense head is written as alpha 0,
// beta 1 (a span of the whole prompt: the same cells), read back as that window.
#include <string>
#include <utility>

#include "attention/pattern/config_io.h"
#include "attention/pattern/config_json.h"
#include "core/error.h"

namespace tessera::attn {

using namespace config_detail;

namespace {

const json& moa_field(const json& j, const char* field, const std::string& source) {
  const json* v = find(j, field);
  if (!v) throw Error(source + ": missing field '" + field + "'");
  if (!v->is_array()) fail_field(source, field, "a list over layers", show(*v));
  return *v;
}

}  // namespace

namespace config_detail {

AttentionPolicy import_moa_checked(const json& j, const std::string& source, int num_kv_heads,
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
  return per_head_policy(
      num_layers, num_q_heads, num_kv_heads, source,
      [&](int l) {
        const json& la = alphas[static_cast<size_t>(l)];
        const json& lb = betas[static_cast<size_t>(l)];
        if (la.size() != static_cast<size_t>(num_q_heads))
          throw Error(
              head_count_mismatch(l, la.size(), num_q_heads, expected.has_value(), source, " in 'alphas'"));
        if (lb.size() != static_cast<size_t>(num_q_heads))
          throw Error(source + ": layer " + str(l) + " has " + std::to_string(lb.size()) +
                      " heads in 'betas', but " + str(num_q_heads) + " in 'alphas'");
      },
      [&](int l, int h, const std::string& where) {
        const json& la = alphas[static_cast<size_t>(l)];
        const json& lb = betas[static_cast<size_t>(l)];
        ElasticWindowPattern e;
        e.alpha = get_number(la[static_cast<size_t>(h)], where, "alphas");
        e.beta = get_number(lb[static_cast<size_t>(h)], where, "betas");
        e.sink = kMoaSink;
        if (!(e.beta >= 0)) fail_field(where, "betas", ">= 0", show(lb[static_cast<size_t>(h)]));
        validate(e, where);
        return Pattern(e);
      });
}

}  // namespace config_detail

AttentionPolicy import_moa(const json& j, const std::string& source, int num_kv_heads) {
  return import_moa_checked(j, source, num_kv_heads, std::nullopt);
}

json export_moa(const AttentionPolicy& policy) {
  json alphas = json::array(), betas = json::array();
  for (int l = 0; l < policy.num_layers(); ++l) {
    json la = json::array(), lb = json::array();
    for (int h = 0; h < policy.num_q_heads(); ++h) {
      const Pattern& p = policy.at(l, h);
      if (std::holds_alternative<DensePattern>(p)) {  // span alpha + beta N = N: every key (read back as that window)
        la.push_back(0.0);
        lb.push_back(1.0);
        continue;
      }
      const auto* e = std::get_if<ElasticWindowPattern>(&p);
      if (!e || e->sink != kMoaSink) cannot_express("moa", l, h, p, "it has only moa_window with sink 64 and dense");
      la.push_back(e->alpha);
      lb.push_back(e->beta);
    }
    alphas.push_back(std::move(la));
    betas.push_back(std::move(lb));
  }
  return {{"alphas", std::move(alphas)}, {"betas", std::move(betas)}};
}

}  // namespace tessera::attn
