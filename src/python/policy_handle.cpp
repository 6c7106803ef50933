#include "python/policy_handle.h"

#include <map>
#include <mutex>
#include <tuple>
#include <variant>

#include "attention/pattern/presets.h"
#include "core/error.h"

namespace tessera::python {

namespace {

attn::AttentionPolicy dense_if_empty(attn::AttentionPolicy p, const attn::PolicyShape& shape) {
  if (!p.table().empty()) return p;
  return attn::AttentionPolicy::uniform(shape.num_layers, shape.num_q_heads, shape.num_kv_heads,
                                        attn::DensePattern{});
}

}  // namespace

PolicyHandle PolicyHandle::from_spec(const std::string& spec, const attn::PolicyShape& shape) {
  check(shape.num_layers > 0 && shape.num_q_heads > 0 && shape.num_kv_heads > 0,
        "Policy.from_spec: num_layers, num_q_heads and num_kv_heads must be > 0");
  check(shape.num_q_heads % shape.num_kv_heads == 0,
        "Policy.from_spec: " + std::to_string(shape.num_q_heads) + " query heads are not a multiple of " +
            std::to_string(shape.num_kv_heads) + " kv heads");
  if (spec == "dense") return {dense_if_empty({}, shape)};
  return {dense_if_empty(attn::policy_from_spec(spec, shape), shape)};
}

PolicyHandle PolicyHandle::from_json(const std::string& text, const std::string& source) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  check(!j.is_discarded(), source + ": not valid JSON");
  return {attn::load_policy_json(j, source)};
}

PolicyHandle PolicyHandle::for_session(const cli::Session& s, const std::string& spec) {
  const auto& c = s.model->config();
  return {dense_if_empty(s.policy(spec), {c.num_layers, c.num_q_heads, c.num_kv_heads})};
}

const attn::Pattern& PolicyHandle::at(int layer, int q_head) const {
  check(layer >= 0 && layer < policy.num_layers(), "policy: layer " + std::to_string(layer) +
                                                       " out of range (the policy has " +
                                                       std::to_string(policy.num_layers()) + " layers)");
  check(q_head >= 0 && q_head < policy.num_q_heads(),
        "policy: query head " + std::to_string(q_head) + " out of range (the policy has " +
            std::to_string(policy.num_q_heads()) + " query heads)");
  return policy.at(layer, q_head);
}

std::string PolicyHandle::layer_json(int layer) const {
  (void)at(layer, 0);
  const attn::AttentionPolicy one(1, policy.num_q_heads(), policy.num_kv_heads(), policy.layer(layer));
  return attn::save_policy_json(one).dump();
}

bool PolicyHandle::layer_is_dense(int layer) const {
  (void)at(layer, 0);
  for (const attn::Pattern& p : policy.layer(layer))
    if (!std::holds_alternative<attn::DensePattern>(p)) return false;
  return true;
}

std::vector<attn::Pattern> parse_layer(const std::string& text, int num_q_heads, int num_kv_heads) {
  static std::mutex mutex;
  static std::map<std::tuple<std::string, int, int>, std::vector<attn::Pattern>> cache;
  const auto key = std::make_tuple(text, num_q_heads, num_kv_heads);
  {
    std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  check(num_kv_heads > 0 && num_q_heads > 0 && num_q_heads % num_kv_heads == 0,
        "attention: " + std::to_string(num_q_heads) + " query heads are not a multiple of " +
            std::to_string(num_kv_heads) + " kv heads");
  std::vector<attn::Pattern> patterns;
  if (!text.empty() && text.front() == '{') {
    const PolicyHandle p = PolicyHandle::from_json(text, "policy");
    check(p.policy.num_layers() == 1,
          "policy: the ops take one layer (Policy.layer_json(layer)); this policy has " +
              std::to_string(p.policy.num_layers()) + " layers");
    check(p.policy.num_q_heads() == num_q_heads && p.policy.num_kv_heads() == num_kv_heads,
          "policy: the layer has " + std::to_string(p.policy.num_q_heads()) + " query heads (" +
              std::to_string(p.policy.num_kv_heads()) + " kv heads); the tensors have " +
              std::to_string(num_q_heads) + " query heads (" + std::to_string(num_kv_heads) + " kv heads)");
    patterns = p.policy.layer(0);
  } else {
    patterns = PolicyHandle::from_spec(text, {1, num_q_heads, num_kv_heads}).policy.layer(0);
  }
  std::lock_guard lock(mutex);
  if (cache.size() > 4096) cache.clear();  // a bound, not an LRU: distinct policies are few in practice
  return cache.emplace(key, std::move(patterns)).first->second;
}

}  // namespace tessera::python
